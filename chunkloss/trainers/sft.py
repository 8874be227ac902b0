"""``ChunkedSFTTrainer``: TRL's ``SFTTrainer`` with the loss computed by chunkloss's fused LM-head losses.

Same constructor, same config (``ChunkedSFTConfig`` adds the chunkloss fields), same metrics under the same
names. The loss equals ``SFTTrainer.compute_loss`` for ``loss_type`` ``"nll"`` and ``"dft"``, with
``label_smoothing_factor`` (which TRL computes from materialised logits), completion-only and assistant-only
labels, padding-free and packed batches, ``num_items_in_batch`` under gradient accumulation (label smoothing
included) and the MoE router loss. With ``loss_type="dft"``, ``label_smoothing_factor`` is left out, as TRL
leaves it out.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from trl import SFTConfig, SFTTrainer

from chunkloss._compat import trl as trl_compat
from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss
from chunkloss.losses.dft import FusedLinearDFTLoss

from ._arguments import ChunkedArguments
from ._checkpointing import CheckpointingDefault
from ._common import refuse
from ._head import left_pad
from ._metrics import DeferredMetrics
from ._setup import ChunkedTrainerSetup

__all__ = ["ChunkedSFTConfig", "ChunkedSFTTrainer"]


_SP_WHY = "TRL reduces the model's own loss across ranks there"


def _deepspeed_sp(pc) -> bool:
    """Whether an accelerate ``ParallelismConfig`` (or ``None``) turns on DeepSpeed sequence parallelism (read
    with ``getattr``: accelerate before 1.12 has no sequence parallelism fields)."""
    return getattr(pc, "sp_enabled", False) and getattr(pc, "sp_backend", None) == "deepspeed"


@dataclass
class ChunkedSFTConfig(CheckpointingDefault, SFTConfig, ChunkedArguments):
    """``trl.SFTConfig`` with the chunkloss fields of :class:`ChunkedArguments`;
    TRL's activation checkpointing default (on) under transformers' name (:class:`CheckpointingDefault`)."""


class ChunkedSFTTrainer(ChunkedTrainerSetup, DeferredMetrics, SFTTrainer):
    """``trl.SFTTrainer`` whose loss never materialises the ``[tokens, vocab]`` logits.

    Refused at construction (no silent fallback): ``compute_loss_func`` (an arbitrary function of the logits),
    DeepSpeed sequence parallelism (TRL reduces the model's own loss there), and adapters on ``lm_head`` other
    than plain LoRA. A LoRA adapter on ``lm_head`` is trained (TRL refuses it).
    """

    _tag_names = ["trl", "sft", "chunkloss"]

    def _refuse_early(self, call: dict) -> None:
        name = type(self).__name__
        if call.get("compute_loss_func") is not None:
            refuse(
                name,
                "compute_loss_func",
                "it needs the full logits; subclass and override compute_loss instead",
            )
        if _deepspeed_sp(getattr(call.get("args"), "parallelism_config", None)):
            refuse(name, "DeepSpeed sequence parallelism", _SP_WHY)

    def _refuse_built(self) -> None:
        # Set through an accelerate config file instead, it reaches the accelerator but not args.
        if _deepspeed_sp(self.accelerator.parallelism_config):
            refuse(type(self).__name__, "DeepSpeed sequence parallelism", _SP_WHY)

    def _setup_loss(self) -> None:
        common = dict(return_token_accuracy=True, return_entropy=True, **self.chunk_opts)
        if self.args.loss_type == "dft":
            self._chunk_loss_cls, self._chunk_loss_kwargs = FusedLinearDFTLoss, common
        else:
            eps = self.args.label_smoothing_factor
            self._chunk_loss_cls = FusedLinearCrossEntropyLoss
            self._chunk_loss_kwargs = dict(label_smoothing=eps, **common)
        self._chunk_losses: dict = {}

    def _loss_module(self, head):
        key = (head.softcap, head.logit_scale)
        mod = self._chunk_losses.get(key)
        if mod is None:
            mod = self._chunk_loss_cls(
                softcap=head.softcap, logit_scale=head.logit_scale, **self._chunk_loss_kwargs
            )
            self._chunk_losses[key] = mod
        return mod

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        inputs["use_cache"] = False
        if self.aux_loss_enabled:
            inputs["output_router_logits"] = True
        logits_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        labels, shift_labels = inputs.get("labels"), inputs.get("shift_labels")
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        normaliser = None if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).clamp(min=1)

        def head_fn(hidden, head):
            # Prompt tuning lengthens the hidden states by its virtual tokens: PEFT pads the labels so.
            if shift_labels is None:
                hidden, target = hidden[:, :-1], left_pad(labels, hidden.shape[1], -100)[:, 1:]
            else:
                target = left_pad(shift_labels, hidden.shape[1], -100)
            target = target.to(hidden.device)
            loss_mod = self._loss_module(head)
            loss = loss_mod(
                head.features(hidden), head.weight, target, bias=head.bias, num_items_in_batch=normaliser
            )
            return loss, loss_mod.metrics, (target != -100).sum()

        out = model(**model_inputs, chunked_head=head_fn)
        loss, metrics, num_valid_local = out.result
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if self.aux_loss_enabled:
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * out.aux_loss / steps

        # Entropy and token accuracy, as TRL logs them: sums gathered over ranks, divided by the valid count.
        num_valid = self.accelerator.gather_for_metrics(num_valid_local).sum()
        entropy_sum = self.accelerator.gather_for_metrics(metrics["entropy"] * num_valid_local).sum()
        num_correct = self.accelerator.gather_for_metrics(
            metrics["mean_token_accuracy"] * num_valid_local
        ).sum()
        # TRL's values, fetched when the trainer logs (``DeferredMetrics``), not with .item() here.
        store = trl_compat.metrics(self, mode)
        store["entropy"].append(self.mean_or_zero(entropy_sum, num_valid))
        store["mean_token_accuracy"].append(self.mean_or_zero(num_correct, num_valid))

        num_tokens_in_batch = None
        if mode == "train":
            if "attention_mask" in inputs:
                num_tokens_in_batch = self.accelerator.gather_for_metrics(
                    inputs["attention_mask"].sum()
                ).sum()
            elif "position_ids" in inputs:
                local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
                num_tokens_in_batch = self.accelerator.gather_for_metrics(local).sum()
            else:
                raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        self.record_tokens(mode, num_tokens_in_batch)
        if self.aux_loss_enabled:
            self.record_aux_loss(mode, out.aux_loss)

        if return_outputs:
            # Asked for by compute_metrics / preprocess_logits_for_metrics: the user wants the logits.
            warnings.warn(
                "return_outputs=True materialises the full logits with an extra forward pass.", stacklevel=2
            )
            with torch.no_grad():
                outputs = model(**logits_inputs)
            return loss, outputs
        return loss
