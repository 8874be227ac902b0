"""The forwards ``patch`` gives a family's RMSNorm, MLP, attention and decoder-layer modules, written out.

Each is a mixin placed in front of the module's own class (``module.__class__`` becomes a subclass with the
same name, so ``isinstance``, class-name lookups such as ``_no_split_modules`` and hooks see the module as
before). The forwards follow transformers' own (``modeling_llama.py``, ``modeling_qwen3.py``,
``modeling_gemma2.py``) line for line, with the kernels where transformers calls ``F.linear``, the norm or
``apply_rotary_pos_emb``; attention itself goes through transformers' interface
(``ALL_ATTENTION_FUNCTIONS`` / the family's ``eager_attention_forward``), as the family's forward does.

What runs fused is decided at each call from what the modules are then: a projection that is not an
``nn.Linear`` or a plain LoRA layer (:mod:`chunkloss.models.lora`; over a 4-bit base too, where the call
computes in its compute dtype), a module with a hook other than FSDP2's and DeepSpeed's, or dtypes that
autocast would change run the separate path, which computes the same values. A fused call runs inside the
forwards of the modules whose parameters it reads that have such hooks (:mod:`chunkloss.models.hooks`), so
that FSDP2 and ZeRO-3 gather those parameters for it and for its backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from chunkloss._compat import transformers as transformers_compat
from chunkloss.kernels import glu as _glu
from chunkloss.kernels.attention_input import attention_input, autocast_changes_dtype
from chunkloss.kernels.lora import lora_linear
from chunkloss.kernels.mlp import gated_mlp
from chunkloss.kernels.rms_norm import rms_norm
from chunkloss.kernels.rope import apply_rotary_pos_emb

from . import saved_norms
from .hooks import gathering_hooks_only, hooked_owners, run_inside
from .lora import Projection, computes_as_is, projection

__all__ = [
    "PatchedNormOptions",
    "PatchedMLPOptions",
    "PatchedLayerOptions",
    "PatchedRMSNorm",
    "PatchedGatedMLP",
    "PatchedAttention",
    "Qwen3Attention",
    "MistralAttention",
    "SlidingWindowAttention",
    "Gemma2Attention",
    "PreNormLayer",
    "SandwichLayer",
]


@dataclass(frozen=True)
class PatchedNormOptions:
    eps: float
    offset: float  # 1.0 for Gemma (the weight scales by 1 + w)
    casting: str  # "llama" or "gemma"
    in_place: bool  # the backward may write dx over the incoming gradient (see _norm_in_place_safe)
    offer: bool  # register the output with an open SavedNorms (norm_recompute)


@dataclass(frozen=True)
class PatchedMLPOptions:
    activation: str  # "silu", "gelu_tanh" or "gelu"
    recompute: bool  # the fused MLP replays the gate/up GEMM in the backward
    tile: int | None = None  # tokens per call of the fused MLP (None: all)


@dataclass(frozen=True)
class PatchedLayerOptions:
    fuse_attention_input: bool  # the input norm, q/k/v and RoPE as one attention_input call
    norm_recompute: bool  # keep no pre-norm output for the backward (chunkloss.models.saved_norms)


def _compiling_adapter(part: Projection) -> bool:
    """A LoRA projection while ``torch.compile`` traces: it runs PEFT's forward. Compiled by Inductor on CUDA,
    the fused calls with adapters gave wrong adapter gradients (a Llama's q_proj ``lora_A``, torch 2.11,
    H100), where eager and CPU compilation are right."""
    return part.adapter is not None and torch.compiler.is_compiling()


def _fusable(projections: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[Projection, ...] | None:
    """The projections as :class:`Projection` when a fused kernel can take all of them on ``x``."""
    parts = tuple(map(projection, projections))
    if any(p is None or not computes_as_is(p, x) or _compiling_adapter(p) for p in parts):
        return None
    return parts


def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, a plain LoRA layer's (over a 4-bit base too) as one
    :func:`~chunkloss.kernels.lora.lora_linear` call."""
    part = projection(module)
    # A plain nn.Linear, or a LoRA layer computing its base alone, runs as the module it is.
    if part is None or part.adapter is None or not computes_as_is(part, x) or _compiling_adapter(part):
        return module(x)

    def fused(y):
        part = projection(module)  # read inside the forwards: the parameters as gathered
        return lora_linear(y, part.weight, part.bias, part.adapter)

    return run_inside(hooked_owners([module]), fused, x)


def _adapters(parts: tuple[Projection, ...]):
    """The projections' LoRA adapters for the kernels' ``adapters=`` (None when none has one)."""
    adapters = tuple(p.adapter for p in parts)
    return adapters if any(a is not None for a in adapters) else None


class PatchedRMSNorm:
    """``XRMSNorm.forward`` on :func:`~chunkloss.kernels.rms_norm`."""

    chunkloss_norm: PatchedNormOptions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        opts = self.chunkloss_norm
        out = rms_norm(x, self.weight, opts.eps, opts.offset, opts.casting, opts.in_place)
        if opts.offer:
            saved_norms.offer(
                out, lambda: rms_norm(x, self.weight, opts.eps, opts.offset, opts.casting, opts.in_place)
            )
        return out


class PatchedGatedMLP:
    """``XMLP.forward``, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, as one
    :func:`~chunkloss.kernels.gated_mlp` call (plain LoRA projections included). When one projection cannot
    run there, each runs on its own (a plain LoRA one as :func:`~chunkloss.kernels.lora.lora_linear`) and the
    gating on the GLU kernel."""

    chunkloss_mlp: PatchedMLPOptions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        opts = self.chunkloss_mlp
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if _fusable(projections, x) is not None:
            return run_inside(hooked_owners(projections), self._fused, x)
        # gate_proj / up_proj outputs are read only here, so the backward may overwrite them with their grads.
        gated = _glu._glu(_linear(self.gate_proj, x), _linear(self.up_proj, x), opts.activation, True)
        return _linear(self.down_proj, gated)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        opts = self.chunkloss_mlp
        parts = gate, up, down = _fusable((self.gate_proj, self.up_proj, self.down_proj), x)
        return gated_mlp(
            x,
            gate.weight,
            up.weight,
            down.weight,
            b_gate=gate.bias,
            b_up=up.bias,
            b_down=down.bias,
            activation=opts.activation,
            recompute=opts.recompute,
            adapters=_adapters(parts),
            tile=opts.tile,
        )


class PatchedAttention:
    """``LlamaAttention.forward`` (Llama, Gemma; the subclasses below for the others): q/k/v projections,
    RoPE on :func:`~chunkloss.kernels.apply_rotary_pos_emb`, the cache, transformers' attention interface and
    ``o_proj``. :meth:`attend` is the part after RoPE, which the decoder layer calls after a fused
    :func:`~chunkloss.kernels.attention_input`."""

    # The input norm, q/k/v and RoPE can run as one attention_input call (not Qwen3: its per-head q/k norms
    # sit between the projections and RoPE).
    takes_attention_input = True

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        q, k, v = self.project(hidden_states)
        q, k = self.rotate(q, k, position_embeddings)
        return self.attend(q, k, v, attention_mask, cache, **kwargs)

    def project(self, hidden_states):
        """q, k, v as (B, heads, T, head_dim) views of the projections."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        return tuple(
            _linear(proj, hidden_states).view(shape).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )

    def rotate(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        # q and k are fresh projections (transposed views) that attention reads only through the result.
        return apply_rotary_pos_emb(q, k, cos, sin, in_place=True)

    def interface_kwargs(self) -> dict:
        """What the family's forward passes to the attention interface besides dropout and scaling."""
        return {}

    def attend(self, q, k, v, attention_mask, cache=None, **kwargs):
        """Attention over rotated q (B, Hq, T, D), k and v (B, Hkv, T, D), then ``o_proj``."""
        batch, _, seq, _ = q.shape
        if cache is not None:
            k, v = transformers_compat.cache_update(cache, k, v, self.layer_idx, kwargs)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            transformers_compat.attn_implementation(self.config),
            transformers_compat.eager_attention_forward(self),
        )
        out, weights = interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **self.interface_kwargs(),
            **kwargs,
        )
        out = out.reshape(batch, seq, -1).contiguous()
        return _linear(self.o_proj, out), weights

    def takes_residual(self, x) -> bool:
        """Whether :meth:`attend_from_residual` can take ``x`` with the projections as they are now."""
        parts = _fusable((self.q_proj, self.k_proj, self.v_proj), x)
        # Under autocast the separate modules normalise x in its own dtype and cast only the projections'
        # operands, a rounding attention_input does not reproduce.
        return parts is not None and not autocast_changes_dtype(x, *(p.weight for p in parts))

    def attend_from_residual(
        self, x, norm, position_embeddings, attention_mask, cache=None, *, norm_recompute=False, **kwargs
    ):
        """``self(norm(x), ...)`` with the norm, q/k/v (and their LoRA adapters) and RoPE as one
        attention_input call, run inside the forwards of the norm and the projections (those with hooks);
        :meth:`takes_residual` must hold."""
        projections = (self.q_proj, self.k_proj, self.v_proj)

        def qkv(y):
            parts = _fusable(projections, y)
            cos, sin = position_embeddings
            opts = norm.chunkloss_norm
            return attention_input(
                y,
                norm.weight,
                *(p.weight for p in parts),
                cos,
                sin,
                b_q=parts[0].bias,
                b_k=parts[1].bias,
                b_v=parts[2].bias,
                head_dim=self.head_dim,
                eps=opts.eps,
                offset=opts.offset,
                casting=opts.casting,
                norm_recompute=norm_recompute,
                adapters=_adapters(parts),
            )

        q, k, v = run_inside(hooked_owners((norm, *projections)), qkv, x)
        return self.attend(q, k, v, attention_mask, cache, **kwargs)


class SlidingWindowAttention(PatchedAttention):
    """Qwen2: the layer's sliding window goes to the interface."""

    def interface_kwargs(self) -> dict:
        return {"sliding_window": self.sliding_window}


class MistralAttention(PatchedAttention):
    def interface_kwargs(self) -> dict:
        return {"sliding_window": getattr(self.config, "sliding_window", None)}


class Qwen3Attention(SlidingWindowAttention):
    """``Qwen3Attention.forward``: q and k normalised per head (``q_norm``, ``k_norm``) before RoPE."""

    takes_attention_input = False

    def project(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_norm(_linear(self.q_proj, hidden_states).view(shape)).transpose(1, 2)
        k = self.k_norm(_linear(self.k_proj, hidden_states).view(shape)).transpose(1, 2)
        return q, k, _linear(self.v_proj, hidden_states).view(shape).transpose(1, 2)


class Gemma2Attention(SlidingWindowAttention):
    def interface_kwargs(self) -> dict:
        return {"sliding_window": self.sliding_window, "softcap": self.attn_logit_softcapping}


class _Layer:
    chunkloss_layer: PatchedLayerOptions

    def saved_norms(self):
        """:class:`~chunkloss.models.saved_norms.SavedNorms` around a layer's forward with
        ``norm_recompute``, unless gradients are off or the layer is checkpointed (it keeps nothing then)."""
        checkpointed = transformers_compat.layer_checkpointed(self)
        if self.chunkloss_layer.norm_recompute and torch.is_grad_enabled() and not checkpointed:
            return saved_norms.SavedNorms()
        return contextlib.nullcontext()

    def attention(self, x, position_embeddings, attention_mask, **kwargs):
        """``self_attn(input_layernorm(x))``'s output, the norm, q/k/v and RoPE fused where they can be."""
        attn, norm = self.self_attn, self.input_layernorm
        opts = self.chunkloss_layer
        if (
            opts.fuse_attention_input
            and isinstance(attn, PatchedAttention)
            and attn.takes_attention_input
            and isinstance(norm, PatchedRMSNorm)
            and gathering_hooks_only(attn)
            and gathering_hooks_only(norm)
            and attn.takes_residual(x)
        ):

            def fused(y):
                return attn.attend_from_residual(
                    y, norm, position_embeddings, attention_mask, norm_recompute=opts.norm_recompute, **kwargs
                )

            # Inside the attention module's forward too, as the separate path calls it.
            return run_inside(hooked_owners([attn], recurse=False), fused, x)[0]
        out, _ = attn(
            hidden_states=norm(x),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
        )
        return out


class PreNormLayer(_Layer):
    """``LlamaDecoderLayer.forward`` (Llama, Mistral, Qwen2, Qwen3, Gemma)."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        with self.saved_norms():
            residual = hidden_states
            hidden_states = self.attention(
                hidden_states,
                position_embeddings,
                attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
            return residual + hidden_states


class SandwichLayer(_Layer):
    """``Gemma2DecoderLayer.forward``: a norm before and after attention and before and after the MLP."""

    def forward(
        self,
        hidden_states,
        position_embeddings=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        **kwargs,
    ):
        with self.saved_norms():
            residual = hidden_states
            hidden_states = self.attention(
                hidden_states,
                position_embeddings,
                attention_mask,
                position_ids=position_ids,
                cache=cache,
                **kwargs,
            )
            hidden_states = residual + self.post_attention_layernorm(hidden_states)
            residual = hidden_states
            hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
            return residual + self.post_feedforward_layernorm(hidden_states)
