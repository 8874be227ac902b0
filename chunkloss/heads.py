"""Extra decoding heads trained with :class:`chunkloss.FusedLinearMultiTokenLoss`.

* :class:`MedusaHeads` (Cai et al. 2024, arXiv:2401.10774): K heads on the backbone's last hidden state,
  head k (1-based) predicting the token k+1 places after the base head's. Each head is ``num_layers``
  residual blocks ``x + SiLU(Linear(x))`` (the linear's weight zero-initialised, as Medusa does, so a new head
  starts as the base head's features) followed by an LM head: its own, initialised from the base head's
  weight, or the base head itself.
* :class:`MultiTokenPrediction` (DeepSeek-V3, arXiv:2412.19437 §2.2): D sequential modules sharing the
  model's embedding and output head; module k combines the previous depth's representation at position i with
  the embedding of token i+k and runs its own transformer block, and predicts token i+k+1.

Both return the hidden states the loss takes, one (B, T, H) per head; the logits are never formed.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MedusaHeads",
    "MultiTokenPrediction",
    "ResBlock",
    "add_medusa_heads",
    "load_medusa_heads",
]


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))`` with the linear's weight zero-initialised (Medusa's ResBlock)."""

    def __init__(self, hidden_size: int, device=None, dtype=None):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, device=device, dtype=dtype)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads over a hidden state (B, T, H).

    Args:
        hidden_size: H.
        vocab_size: V.
        num_heads: K ≥ 1.
        num_layers: residual blocks per head.
        base_weight: (V, H) the base LM head's weight, copied into each head's own LM head (ignored with
            ``share_lm_head``); ``None`` leaves ``nn.Linear``'s initialisation.
        share_lm_head: every head projects through the base LM head (no LM head of its own).
        device, dtype: of the new parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int,
        num_layers: int = 1,
        base_weight: Tensor | None = None,
        share_lm_head: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("num_layers", num_layers)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
        kw = dict(device=device, dtype=dtype)
        self.num_heads, self.share_lm_head = num_heads, share_lm_head
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size, **kw) for _ in range(num_layers)]) for _ in range(num_heads)
        )
        self.lm_heads = None
        if not share_lm_head:
            self.lm_heads = nn.ModuleList(
                nn.Linear(hidden_size, vocab_size, bias=False, **kw) for _ in range(num_heads)
            )
            if base_weight is not None:
                if base_weight.shape != (vocab_size, hidden_size):
                    raise ValueError(
                        f"base_weight must be (V, H)=({vocab_size}, {hidden_size}), "
                        f"got {tuple(base_weight.shape)}"
                    )
                with torch.no_grad():
                    for head in self.lm_heads:
                        head.weight.copy_(base_weight)

    def forward(self, hidden: Tensor) -> list[Tensor]:
        """The K heads' features: ``blocks[k](hidden)``, each (B, T, H)."""
        return [block(hidden) for block in self.blocks]

    def weights(self, base_weight: Tensor) -> Tensor | list[Tensor]:
        """The LM head weight(s) for :class:`~chunkloss.FusedLinearMultiTokenLoss`: ``base_weight`` when
        shared, else the K heads' own (V, H) weights."""
        return base_weight if self.share_lm_head else [head.weight for head in self.lm_heads]

    def logits(self, hidden: Tensor, base_weight: Tensor | None = None) -> Tensor:
        """(K, B, T, V) materialised logits, for decoding (``base_weight`` needed when shared)."""
        feats = self(hidden)
        if self.share_lm_head:
            if base_weight is None:
                raise ValueError("heads that share the base LM head need base_weight for their logits")
            return torch.stack([f @ base_weight.t() for f in feats])
        return torch.stack([head(f) for head, f in zip(self.lm_heads, feats)])


class _CausalBlock(nn.Module):
    """A pre-norm transformer block: causal self-attention and a SiLU-gated MLP, each with a residual."""

    def __init__(self, hidden_size: int, num_attention_heads: int, intermediate_size: int, eps: float):
        super().__init__()
        if hidden_size % num_attention_heads:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of {num_attention_heads} heads")
        self.heads = num_attention_heads
        self.attn_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.out(a.transpose(1, 2).reshape(b, t, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class _MTPModule(nn.Module):
    def __init__(self, hidden_size: int, block: nn.Module, eps: float):
        super().__init__()
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.embed_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.out_norm = nn.RMSNorm(hidden_size, eps=eps)


class MultiTokenPrediction(nn.Module):
    """DeepSeek-V3's D sequential multi-token prediction modules (arXiv:2412.19437 §2.2).

    Module k (1-based) at position i::

        h'_i = M_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))],   h^k = TRM_k(h'),   out_k = RMSNorm(h^k)

    with ``h^0`` the main model's last hidden state and ``Emb`` the model's (shared) embedding; ``out_k``
    goes through the model's (shared) output head and predicts ``t_{i+k+1}``: head k of
    :class:`~chunkloss.FusedLinearMultiTokenLoss` with the labels shifted for the main head. DeepSeek-V3
    trains ``L = λ/D · Σ_k L_k`` beside the main loss: ``head_weights = (1, λ/D, …, λ/D)``.

    Args:
        hidden_size: H.
        depth: D ≥ 1.
        num_attention_heads, intermediate_size: of the default block (a pre-norm causal transformer block
            without positional encoding: positions are already in ``h^{k-1}``).
        block_factory: ``() -> nn.Module`` mapping (B, T, H) to (B, T, H) causally, e.g. a decoder layer of
            the model's own family, instead of the default block.
        eps: of the RMSNorms.
    """

    def __init__(
        self,
        hidden_size: int,
        depth: int,
        num_attention_heads: int = 4,
        intermediate_size: int | None = None,
        block_factory=None,
        eps: float = 1e-6,
    ):
        super().__init__()
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth must be an int ≥ 1, got {depth!r}")
        ff = intermediate_size or 4 * hidden_size
        make = block_factory or (lambda: _CausalBlock(hidden_size, num_attention_heads, ff, eps))
        self.layers = nn.ModuleList(_MTPModule(hidden_size, make(), eps) for _ in range(depth))

    def forward(self, hidden: Tensor, embeds: Tensor) -> list[Tensor]:
        """``hidden`` (B, T, H): the main model's last hidden state; ``embeds`` (B, T, H): the embeddings of
        the input tokens. Returns the D outputs ``out_k`` (B, T, H); positions i ≥ T - k have no token i+k and
        see zeros there (they have no target either)."""
        if embeds.shape != hidden.shape:
            raise ValueError(f"embeds shape {tuple(embeds.shape)} must equal hidden's {tuple(hidden.shape)}")
        outs, h = [], hidden
        for k, layer in enumerate(self.layers, 1):
            e = F.pad(embeds[:, k:], (0, 0, 0, min(k, embeds.shape[1])))
            h = layer.block(layer.proj(torch.cat([layer.hidden_norm(h), layer.embed_norm(e)], dim=-1)))
            outs.append(layer.out_norm(h))
        return outs


def add_medusa_heads(
    model: nn.Module,
    num_heads: int | None = None,
    num_layers: int | None = None,
    share_lm_head: bool | None = None,
) -> MedusaHeads:
    """Attach :class:`MedusaHeads` to a transformers causal LM as ``model.medusa_heads`` (saved with the
    model's weights) and record their shape in ``model.config`` (``medusa_num_heads``, ``medusa_num_layers``,
    ``medusa_share_lm_head``, written by ``save_pretrained``). Arguments left ``None`` come from those config
    fields when present (a model saved with heads), else 3 heads, 1 layer, own LM heads. The heads take the
    LM head's device and dtype; their own LM heads start as copies of it. Returns the heads (the model's own
    if it already has heads of that shape)."""
    cfg = model.config
    num_heads = num_heads if num_heads is not None else getattr(cfg, "medusa_num_heads", 3)
    num_layers = num_layers if num_layers is not None else getattr(cfg, "medusa_num_layers", 1)
    share = share_lm_head if share_lm_head is not None else getattr(cfg, "medusa_share_lm_head", False)
    lm_head = model.get_output_embeddings()
    if lm_head is None or not hasattr(lm_head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head) for the Medusa heads")
    old = getattr(model, "medusa_heads", None)
    if old is not None:
        shape = (len(old.blocks), len(old.blocks[0]), old.share_lm_head)
        if shape != (num_heads, num_layers, share):
            raise ValueError(f"the model already has Medusa heads (heads, layers, shared) = {shape}")
        return old
    weight = lm_head.weight
    heads = MedusaHeads(
        weight.shape[1],
        weight.shape[0],
        num_heads,
        num_layers,
        weight.detach(),
        share,
        device=weight.device,
        dtype=weight.dtype,
    )
    model.medusa_heads = heads
    cfg.medusa_num_heads, cfg.medusa_num_layers, cfg.medusa_share_lm_head = num_heads, num_layers, share
    return heads


def load_medusa_heads(model: nn.Module, path: str) -> MedusaHeads:
    """Add the Medusa heads recorded in ``model.config`` and load their weights from a model directory saved
    with them (``model.safetensors`` or a sharded index); ``from_pretrained`` skips those weights."""
    from safetensors.torch import load_file

    heads = add_medusa_heads(model)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(
                {v for k, v in json.load(f)["weight_map"].items() if k.startswith("medusa_heads.")}
            )
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        tensors = load_file(os.path.join(path, name))
        state.update(
            {k[len("medusa_heads.") :]: v for k, v in tensors.items() if k.startswith("medusa_heads.")}
        )
    if not state:
        raise ValueError(f"{path} holds no Medusa head weights (keys 'medusa_heads.*')")
    heads.load_state_dict(state)
    return heads
