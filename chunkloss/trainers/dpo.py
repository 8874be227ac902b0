"""``ChunkedDPOTrainer``: TRL's ``DPOTrainer`` with the loss computed by ``FusedLinearDPOLoss``.

The policy's hidden states of the chosen and rejected rows go to the chunked DPO loss with the LM head's
weight; the reference's sequence log-probs come from TRL itself (precomputed in the dataset, or
``DPOTrainer.compute_ref_log_probs`` on the reference model / the adapter-less PEFT model, through TRL's fused
head without grad). Every loss type, loss weights, f-divergence, ``ld_alpha``, WPO weighting and label
smoothing of TRL 1.16 is covered, with the model's final logit softcapping (Gemma-2) and logit scale
(Cohere). TRL's ``entropy`` and ``mean_token_accuracy`` metrics come from the same chunked pass as the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import DPOConfig, DPOTrainer

from chunkloss._compat import trl as trl_compat
from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss
from chunkloss.losses.dpo import FusedLinearDPOLoss

from ._arguments import ChunkedArguments
from ._checkpointing import CheckpointingDefault
from ._common import refuse
from ._head import fused_head_call, has_lm_head_lora, refuse_precomputed_head_lora_reference
from ._metrics import DeferredMetrics
from ._setup import ChunkedTrainerSetup

__all__ = ["ChunkedDPOConfig", "ChunkedDPOTrainer"]


@dataclass
class ChunkedDPOConfig(CheckpointingDefault, DPOConfig, ChunkedArguments):
    """``trl.DPOConfig`` with the chunkloss fields of :class:`ChunkedArguments`;
    TRL's activation checkpointing default (on) under transformers' name (:class:`CheckpointingDefault`)."""


class ChunkedDPOTrainer(ChunkedTrainerSetup, DeferredMetrics, DPOTrainer):
    """``trl.DPOTrainer`` whose loss never materialises the logits.

    A ``PeftModel`` whose adapter has LoRA on ``lm_head``, given without ``ref_model``, is scored as TRL
    scores it (through a "ref" copy of the adapter), with the adapter's ``lm_head`` included: see
    :meth:`compute_ref_log_probs`. Refused at construction: adapters on ``lm_head`` other than plain LoRA,
    that case with ``precompute_ref_log_probs`` (TRL precomputes in its constructor, without the adapter's
    ``lm_head``), and ``use_weighting`` with an ``"sft"`` term (TRL 1.16's own path fails on it). Multimodal
    inputs are refused when they arrive.
    """

    _tag_names = ["trl", "dpo", "chunkloss"]

    def _refuse_early(self, call: dict) -> None:
        refuse_precomputed_head_lora_reference(type(self).__name__, call)

    def _refuse_built(self) -> None:
        if self.use_weighting and "sft" in self.loss_types:
            refuse(
                type(self).__name__,
                "use_weighting=True with an 'sft' loss_type",
                "TRL 1.16's own DPOTrainer fails on it (a per-pair weight times the scalar SFT term), so "
                "there is no objective to match",
            )

    def _setup_loss(self) -> None:
        args = self.args
        self._dpo_loss = FusedLinearDPOLoss(
            beta=float(self.beta),
            loss_type=tuple(self.loss_types),
            loss_weights=None if self.loss_weights is None else tuple(self.loss_weights),
            label_smoothing=float(args.label_smoothing),
            f_divergence_type=self.f_divergence_type,
            f_alpha_divergence_coef=float(self.f_alpha_divergence_coef),
            ld_alpha=self.ld_alpha,
            use_weighting=bool(self.use_weighting),
            discopop_tau=float(args.discopop_tau),
            return_token_metrics=True,
            **self.head_transforms,
            **self.chunk_opts,
        )
        # The reference's per-token log-probs through a LoRA adapter on lm_head (compute_ref_log_probs).
        self._ref_logp_loss = FusedLinearCrossEntropyLoss(
            reduction="none", **self.head_transforms, **self.chunk_opts
        )

    def compute_ref_log_probs(self, model, inputs):
        """TRL's, except when the reference is a "ref" copy of a LoRA adapter on ``lm_head`` (a ``PeftModel``
        given without ``ref_model``): TRL's fused head reads ``lm_head.weight`` alone and would leave that
        adapter's ``lm_head`` out, so its per-token log-probs come from the chunked head instead, under the
        adapter TRL selects; TRL's own code still picks the adapter and sums (or ``ld_alpha``-weights)
        them."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        if self.ref_model is not None or not has_lm_head_lora(unwrapped):
            return super().compute_ref_log_probs(model, inputs)
        return super().compute_ref_log_probs(fused_head_call(model, self._ref_logp_loss), inputs)

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        model_keys = {"input_ids", "attention_mask", "position_ids"}
        other = set(inputs) - model_keys - {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}
        if other:
            refuse(type(self).__name__, f"inputs {sorted(other)}", "the chunked head covers text models only")
        model_kwargs = {k: v for k, v in inputs.items() if k in model_keys}
        if self.aux_loss_enabled:
            model_kwargs["output_router_logits"] = True
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)[:, 1:]
        n = labels.shape[0] // 2
        chosen, rejected = labels[:n], labels[n:]

        if self.precompute_ref_logps:
            ref_c, ref_r = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            ref_model = self.ref_model if self.ref_model is not None else self.model
            ref_c, ref_r = self.compute_ref_log_probs(ref_model, inputs)

        def head_fn(hidden, head):
            # The hidden states just before each real token but the first, counted from the end: prompt tuning
            # and p-tuning put their virtual tokens first (TRL keeps the last positions of its log-probs too).
            x = head.features(hidden[:, -labels.shape[1] - 1 : -1])
            loss = self._dpo_loss(
                x,
                head.weight,
                chosen,
                rejected,
                bias=head.bias,
                ref_chosen_logps=ref_c.detach().float(),
                ref_rejected_logps=ref_r.detach().float(),
            )
            return loss, dict(self._dpo_loss.metrics)

        out = model(**model_kwargs, chunked_head=head_fn)
        loss, metrics = out.result
        n_chosen, n_rej = (chosen != -100).sum(), (rejected != -100).sum()
        n_tok = n_chosen + n_rej
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * out.aux_loss
            self.record_aux_loss(mode, out.aux_loss)

        # TRL's values, fetched when the trainer logs (``DeferredMetrics``), not with .item() here.
        gather, store = self.accelerator.gather_for_metrics, trl_compat.metrics(self, mode)
        # TRL's token-weighted means across processes: local means times local counts, summed.
        total = gather(n_tok).sum()
        entropy_sum = gather(metrics["entropy"] * n_tok).sum()
        store["entropy"].append(self.mean_or_zero(entropy_sum, total))
        self.record_tokens(mode, gather(inputs["attention_mask"].sum()).sum() if mode == "train" else None)
        for name, count in (("logits/chosen", n_chosen), ("logits/rejected", n_rej)):
            # TRL divides the two fetched Python numbers: float64.
            s = gather(metrics[name] * count.clamp(min=1)).sum().double()
            store[name].append(self.mean_or_zero(s, gather(count).sum()))
        tot_c = gather(n_chosen).sum()
        n_correct = gather(metrics["mean_token_accuracy"] * n_chosen).sum()
        store["mean_token_accuracy"].append(self.mean_or_zero(n_correct, tot_c))
        for name in (
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
        ):
            store[name].append(self.accelerator.gather(metrics[name].reshape(1)).mean())
        if return_outputs:
            # Asked for by compute_metrics: the user wants the logits.
            with torch.no_grad():
                return loss, model(**{k: v for k, v in model_kwargs.items() if k != "output_router_logits"})
        return loss
