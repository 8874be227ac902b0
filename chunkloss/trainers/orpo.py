"""``ChunkedORPOTrainer``: TRL's experimental ``ORPOTrainer`` with the loss of ``FusedLinearORPOLoss``.

TRL's ORPO materialises the ``[2B, T, V]`` logits; here the chosen and rejected hidden states go to the
chunked ORPO loss (odds-ratio term over the completions, NLL over the chosen prompt and completion). The
``logits/chosen`` / ``logits/rejected`` metrics (TRL: the mean logit over every position of the padded batch)
come from the same chunked pass (``logit_rows``: every position is projected). The model's final logit
softcapping (Gemma-2) and logit scale (Cohere) are applied by the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from chunkloss.losses.orpo import FusedLinearORPOLoss

from ._arguments import ChunkedArguments
from ._checkpointing import CheckpointingDefault
from ._common import refuse
from ._metrics import DeferredMetrics
from ._setup import P_TUNING, PROMPT_TUNING, ChunkedTrainerSetup

__all__ = ["ChunkedORPOConfig", "ChunkedORPOTrainer"]

_ENC_DEC_WHY = "the chunked head covers causal LMs"


def _is_encoder_decoder(model, args) -> bool:
    """Whether the model ORPOTrainer would build is an encoder-decoder, read from its config alone (a model
    name's config file, not its weights); ``args.is_encoder_decoder`` when no model is given."""
    if isinstance(model, torch.nn.Module):
        return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    if isinstance(model, str):
        from transformers import AutoConfig

        trust = bool(getattr(args, "trust_remote_code", False))
        try:
            config = AutoConfig.from_pretrained(model, trust_remote_code=trust)
        except (OSError, ValueError):  # TRL's own loading reports it
            return False
        return bool(getattr(config, "is_encoder_decoder", False))
    return bool(getattr(args, "is_encoder_decoder", False))


@dataclass
class ChunkedORPOConfig(CheckpointingDefault, ORPOConfig, ChunkedArguments):
    """``trl.experimental.orpo.ORPOConfig`` with the chunkloss fields of :class:`ChunkedArguments`;
    TRL's activation checkpointing default (on) under transformers' name (:class:`CheckpointingDefault`)."""


class ChunkedORPOTrainer(ChunkedTrainerSetup, DeferredMetrics, ORPOTrainer):
    """``ORPOTrainer`` whose loss never materialises the logits.

    Refused at construction: encoder-decoder models (before TRL's constructor loads or tokenises anything),
    adapters on ``lm_head`` other than plain LoRA, PEFT prompt tuning and p-tuning, and
    ``use_liger_kernel=True`` with Liger's fused linear cross-entropy on (its default): Liger replaces the
    model's forward with its own when training starts, which drops the chunked head (TRL's fused-head trainers
    turn it off for the same reason). ``liger_kernel_config={"fused_linear_cross_entropy": False}`` keeps
    Liger's layer kernels, which TRL's ORPO and this trainer then run alike.
    """

    _tag_names = ["trl", "orpo", "chunkloss"]

    _prompt_learning_refused = (
        (PROMPT_TUNING, P_TUNING),
        "its logits carry the virtual tokens, its labels do not",
    )

    def _refuse_early(self, call: dict) -> None:
        name = type(self).__name__
        args = call.get("args")
        if args is not None:
            liger = args.liger_kernel_config or {}
            flce_off = isinstance(liger, dict) and not liger.get("fused_linear_cross_entropy", True)
            if args.use_liger_kernel and not flce_off:
                refuse(
                    name,
                    f"use_liger_kernel=True with liger_kernel_config={args.liger_kernel_config!r}",
                    "Liger's fused linear cross-entropy (on unless that dict sets it False) replaces the "
                    "model's forward, which this trainer patches with the chunked head; pass "
                    "liger_kernel_config={'fused_linear_cross_entropy': False} to keep Liger's layer kernels",
                )
        if _is_encoder_decoder(call.get("model"), args):
            refuse(name, "encoder-decoder models", _ENC_DEC_WHY)

    def _refuse_built(self) -> None:
        if self.is_encoder_decoder:  # a model built by model_init; before the kernels patch anything
            refuse(type(self).__name__, "encoder-decoder models", _ENC_DEC_WHY)

    def _setup_loss(self) -> None:
        opts = {**self.head_transforms, **self.chunk_opts}
        self._orpo_loss = FusedLinearORPOLoss(beta=float(self.beta), **opts)

    def concatenated_forward(self, model, batch):
        cat = self.concatenated_inputs(
            batch, is_encoder_decoder=False, padding_value=self.padding_value, device=self.accelerator.device
        )
        n = batch["chosen_labels"].shape[0]
        input_ids, attention_mask = cat["concatenated_input_ids"], cat["concatenated_attention_mask"]
        labels = cat["concatenated_labels"][:, 1:]
        nll_labels = input_ids.masked_fill(attention_mask != 1, -100)[:n, 1:]

        def head_fn(hidden, head):
            x = head.features(hidden[:, :-1])
            loss = self._orpo_loss(
                x,
                head.weight,
                labels[:n],
                labels[n:],
                bias=head.bias,
                nll_labels=nll_labels,
                logit_rows=torch.ones(labels.shape, dtype=torch.bool, device=labels.device),
            )
            return loss, dict(self._orpo_loss.metrics)

        kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
        out = model(input_ids, attention_mask=attention_mask, use_cache=False, chunked_head=head_fn, **kwargs)
        return out.result, out.aux_loss

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        (loss, m), aux_loss = self.concatenated_forward(model, batch)
        prefix = "eval_" if train_eval == "eval" else ""
        gather = self.accelerator.gather_for_metrics
        # Training steps store the values on the device, fetched when the trainer logs (``DeferredMetrics``),
        # not with .item() here. Evaluation hands some to ``prediction_step`` as numbers, as TRL does.
        fetch = (lambda t: t) if train_eval == "train" else (lambda t: t.item())
        metrics = {
            f"{prefix}{k}": fetch(gather(m[k].reshape(1)).mean())
            for k in (
                "rewards/chosen",
                "rewards/rejected",
                "rewards/accuracies",
                "rewards/margins",
                "logps/rejected",
                "logps/chosen",
                "logits/rejected",
                "logits/chosen",
            )
        }
        for k in ("nll_loss", "log_odds_ratio", "log_odds_chosen"):
            metrics[f"{prefix}{k}"] = fetch(gather(m[k].reshape(1)).mean())
        if self.aux_loss_enabled:
            loss = loss + self.aux_loss_coef * aux_loss
        return loss, metrics
