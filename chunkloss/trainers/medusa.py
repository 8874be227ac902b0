"""``ChunkedMedusaTrainer``: TRL's ``SFTTrainer`` training Medusa heads (arXiv:2401.10774) through
:class:`chunkloss.FusedLinearMultiTokenLoss`, without the K heads' ``[tokens, vocab]`` logits.

* Stage 1 (Medusa-1, ``medusa_stage=1``): the backbone and base LM head are frozen and the backbone runs
  without autograd; the loss is ``Σ_k w_k·L_k`` over the K Medusa heads.
* Stage 2 (Medusa-2, ``medusa_stage=2``): heads and model train together on ``λ₀·L_0 + Σ_k w_k·L_k``,
  ``L_0`` the base head's next-token loss (TRL's SFT loss).

``w_k = medusa_heads_coefficient · medusa_decay^k`` for Medusa head k = 1 … K, which predicts the token k+1
places after the base head's. The heads are ``model.medusa_heads`` (:func:`chunkloss.heads.add_medusa_heads`,
added when the model has none) and are saved with the model's weights; a model loaded from such a directory
gets its heads back (:func:`chunkloss.heads.load_medusa_heads`), so stage 2 can start from stage 1's output.
Logged per head: ``medusa{k}/loss`` and ``medusa{k}/mean_token_accuracy`` (and TRL's ``mean_token_accuracy``
of the base head in stage 2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from chunkloss._compat import trl as trl_compat
from chunkloss.heads import add_medusa_heads, load_medusa_heads
from chunkloss.losses.multi_token import FusedLinearMultiTokenLoss

from ._arguments import chunk_options
from ._common import peft_base, refuse
from .sft import ChunkedSFTConfig, ChunkedSFTTrainer

__all__ = ["ChunkedMedusaConfig", "ChunkedMedusaTrainer"]


@dataclass
class ChunkedMedusaConfig(ChunkedSFTConfig):
    """``ChunkedSFTConfig`` with the Medusa fields.

    Args:
        medusa_num_heads: K, heads added to a model that has none.
        medusa_num_layers: residual blocks per head.
        medusa_share_lm_head: heads project through the base LM head instead of their own copies of it.
        medusa_stage: 1 (heads only, backbone frozen) or 2 (heads and model jointly).
        medusa_decay: head k's weight is ``medusa_heads_coefficient · medusa_decay^k``.
        medusa_heads_coefficient: scales every Medusa head's weight.
        medusa_base_weight: λ₀, the base head's loss weight in stage 2.
    """

    medusa_num_heads: int = field(
        default=3, metadata={"help": "Medusa heads K added to a model without them."}
    )
    medusa_num_layers: int = field(default=1, metadata={"help": "Residual blocks per Medusa head."})
    medusa_share_lm_head: bool = field(
        default=False, metadata={"help": "Heads share the base LM head (else each has its own copy)."}
    )
    medusa_stage: int = field(
        default=1, metadata={"help": "1: train the heads on a frozen backbone; 2: heads and model jointly."}
    )
    medusa_decay: float = field(default=0.8, metadata={"help": "Head k's loss weight decays as decay^k."})
    medusa_heads_coefficient: float = field(
        default=1.0, metadata={"help": "Scales every Medusa head's weight."}
    )
    medusa_base_weight: float = field(default=1.0, metadata={"help": "Stage 2: λ₀, the base head's weight."})

    def __post_init__(self):
        super().__post_init__()
        if self.medusa_stage not in (1, 2):
            raise ValueError(f"medusa_stage must be 1 or 2, got {self.medusa_stage!r}")
        for name in ("medusa_num_heads", "medusa_num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)!r}")
        for name in ("medusa_decay", "medusa_heads_coefficient", "medusa_base_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be ≥ 0, got {getattr(self, name)!r}")


class ChunkedMedusaTrainer(ChunkedSFTTrainer):
    """``ChunkedSFTTrainer`` training Medusa heads (stage 1) or heads and model (stage 2); see the module.

    Refused: packed or padding-free batches (a head's target k tokens ahead would cross into the next
    sequence).
    """

    _tag_names = ["trl", "sft", "chunkloss", "medusa"]

    def __init__(self, model, args: ChunkedMedusaConfig | None = None, *pos, **kwargs):
        if args is None:
            raise ValueError("ChunkedMedusaTrainer needs args=ChunkedMedusaConfig(...)")
        if not isinstance(args, ChunkedMedusaConfig):
            raise TypeError(f"ChunkedMedusaTrainer needs a ChunkedMedusaConfig, got {type(args).__name__}")
        if args.packing or args.padding_free:
            refuse(type(self).__name__, "packing or padding_free", "Medusa targets would cross sequences")
        super().__init__(model, args, *pos, **kwargs)
        base = peft_base(self.model)
        a = self.args
        saved = getattr(base.config, "name_or_path", None) or ""
        if getattr(base.config, "medusa_num_heads", None) and os.path.isdir(saved):
            load_medusa_heads(base, saved)  # a model saved with its heads (stage 2 after stage 1)
        self.medusa_heads = add_medusa_heads(
            base, a.medusa_num_heads, a.medusa_num_layers, a.medusa_share_lm_head
        )
        if a.medusa_stage == 1:
            _freeze_backbone(base)
        self._medusa_losses: dict = {}

    def _medusa_loss(self, head) -> FusedLinearMultiTokenLoss:
        """One loss module per head transform (softcap, logit scale), built once."""
        key = (head.softcap, head.logit_scale)
        if key not in self._medusa_losses:
            a = self.args
            k = a.medusa_num_heads
            weights = [a.medusa_heads_coefficient * a.medusa_decay**i for i in range(1, k + 1)]
            if a.medusa_stage == 2:
                weights = [a.medusa_base_weight, *weights]
            self._medusa_losses[key] = FusedLinearMultiTokenLoss(
                weights, softcap=head.softcap, logit_scale=head.logit_scale, **chunk_options(a)
            )
        return self._medusa_losses[key]

    def _head_loss(self, hidden, head, target, normaliser):
        """The heads' loss on the backbone's hidden state (B, T, H) and the base head's targets (B, T)."""
        stage2 = self.args.medusa_stage == 2
        if not stage2:  # Medusa head 1 is the loss's head 0: its targets start one token later
            hidden, target = hidden[:, :-1], target[:, 1:]
        feats = self.medusa_heads(hidden)
        heads = self.medusa_heads
        weights = heads.weights(head.weight)
        if heads.share_lm_head:
            hiddens = [head.features(f) for f in ([hidden] if stage2 else []) + feats]
            weight, bias = head.weight, head.bias
        else:
            hiddens = ([head.features(hidden)] if stage2 else []) + feats
            weight = ([head.weight] if stage2 else []) + weights
            bias = ([head.bias] if stage2 else []) + [None] * len(feats)
        loss_mod = self._medusa_loss(head)
        loss = loss_mod(hiddens, weight, target, bias=bias, num_items_in_batch=normaliser)
        return loss, loss_mod.metrics

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        labels, shift_labels = inputs.get("labels"), inputs.get("shift_labels")
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        model_inputs["use_cache"] = False
        normaliser = None if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).clamp(min=1)

        def head_fn(hidden, head):
            if shift_labels is None:
                hidden, target = hidden[:, :-1], labels[:, 1:]
            else:
                target = shift_labels
            return self._head_loss(hidden, head, target.to(hidden.device), normaliser)

        loss, metrics = model(**model_inputs, chunked_head=head_fn).result
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        self._log_heads(mode, metrics)
        if mode == "train":
            mask = inputs.get("attention_mask")
            count = mask.sum() if mask is not None else torch.tensor(inputs["input_ids"].numel())
            self.record_tokens(mode, self.accelerator.gather_for_metrics(count).sum())
        else:
            self.record_tokens(mode, None)
        if return_outputs:
            with torch.no_grad():
                return loss, model(**{k: v for k, v in inputs.items() if k != "labels"})
        return loss

    def _log_heads(self, mode: str, metrics: dict) -> None:
        """Per-head loss and accuracy, as TRL logs token means: sums gathered over ranks over the gathered
        count. The loss's head 0 is the base head in stage 2 (TRL's ``mean_token_accuracy``)."""
        gather, store = self.accelerator.gather_for_metrics, trl_compat.metrics(self, mode)
        first = 1 if self.args.medusa_stage == 1 else 0
        for k in range(self.args.medusa_num_heads + 1 - first):
            n = metrics[f"head{k}/num_tokens"]
            total = gather(n).sum()
            name = "" if k + first == 0 else f"medusa{k + first}/"
            if name:
                store[f"{name}loss"].append(
                    self.mean_or_zero(gather(metrics[f"head{k}/loss"] * n).sum(), total)
                )
            acc = gather(metrics[f"head{k}/accuracy"] * n).sum()
            store[f"{name}mean_token_accuracy"].append(self.mean_or_zero(acc, total))


def _freeze_backbone(model) -> None:
    """Stage 1: only ``model.medusa_heads`` trains, and the backbone runs without autograd (its forward
    under ``torch.no_grad``: no activations kept); the heads' loss, run after it, builds its graph."""
    for name, p in model.named_parameters():
        if not name.startswith("medusa_heads."):
            p.requires_grad_(False)
    backbone = model.base_model
    if getattr(backbone, "_chunkloss_no_grad", False):
        return
    forward = backbone.forward

    def no_grad_forward(*args, **kwargs):
        with torch.no_grad():
            return forward(*args, **kwargs)

    backbone.forward = no_grad_forward
    backbone._chunkloss_no_grad = True
