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

from ._common import ChunkedArguments, DeferredMetrics, apply_chunk_kernels, chunk_options, peft_base, refuse
from ._head import add_chunked_head, allow_lm_head_adapter, check_head_supported, head_transforms

__all__ = ["ChunkedORPOConfig", "ChunkedORPOTrainer"]


@dataclass
class ChunkedORPOConfig(ORPOConfig, ChunkedArguments):
    """``trl.experimental.orpo.ORPOConfig`` with the chunkloss fields of :class:`ChunkedArguments`."""


class ChunkedORPOTrainer(DeferredMetrics, ORPOTrainer):
    """``ORPOTrainer`` whose loss never materialises the logits.

    Refused at construction: encoder-decoder models, adapters on ``lm_head`` other than plain LoRA, and
    ``use_liger_kernel=True`` with Liger's fused linear cross-entropy on (its default): Liger replaces the
    model's forward with its own when training starts, which drops the chunked head (TRL's fused-head trainers
    turn it off for the same reason). ``liger_kernel_config={"fused_linear_cross_entropy": False}`` keeps
    Liger's layer kernels, which TRL's ORPO and this trainer then run alike.
    """

    _tag_names = ["trl", "orpo", "chunkloss"]

    def __init__(self, model=None, args: ORPOConfig | None = None, *pos, **kwargs):
        name = type(self).__name__
        if args is not None:
            chunk_options(args)
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
        with allow_lm_head_adapter(model):
            super().__init__(model, args, *pos, **kwargs)
        if self.is_encoder_decoder:  # before the kernels patch anything
            refuse(name, "encoder-decoder models", "the chunked head covers causal LMs")
        apply_chunk_kernels(self)
        base = peft_base(self.model)
        check_head_supported(base)
        softcap, logit_scale = head_transforms(base.config)
        add_chunked_head(base)
        opts = chunk_options(self.args)
        self._orpo_loss = FusedLinearORPOLoss(
            beta=float(self.beta), softcap=softcap, logit_scale=logit_scale, **opts
        )

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
        metrics = {f"{prefix}{k}": fetch(gather(m[k].reshape(1)).mean()) for k in (
            "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/rejected",
            "logps/chosen", "logits/rejected", "logits/chosen")}  # fmt: skip
        for k in ("nll_loss", "log_odds_ratio", "log_odds_chosen"):
            metrics[f"{prefix}{k}"] = fetch(gather(m[k].reshape(1)).mean())
        if self.aux_loss_enabled:
            loss = loss + self.aux_loss_coef * aux_loss
        return loss, metrics
