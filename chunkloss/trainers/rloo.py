"""``ChunkedRLOOTrainer``: TRL's ``RLOOTrainer`` with the policy loss computed by ``FusedLinearRLOOLoss``.

Generation, rewards, the KL penalty (``beta``: TRL subtracts it from the rewards, from the old and reference
log-probs), the leave-one-out advantages and their normalisation, vLLM, and the old and reference log-probs
(through the chunked head, without grad) are TRL's. ``_compute_loss`` changes: the policy's hidden states at
the completion positions go to the chunked RLOO loss with the LM head's weight, so the ``[B, T, V]`` logits
never exist. And where the old log-probs equal the current ones when the loss reads them (on-policy: each
generation used within one optimizer step, no KL penalty, or evaluating), their no-grad forward is skipped and
the loss takes the current ones, detached, as TRL's GRPO trainer does by the same rule. The clip range
(``epsilon``, ``epsilon_high``), the sampling temperature and the model's logit transforms are the loss's
options; metrics are logged under TRL's names with TRL's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import RLOOConfig, RLOOTrainer

from chunkloss._compat import trl as trl_compat
from chunkloss.losses.grpo import nanmax, nanmin
from chunkloss.losses.rloo import FusedLinearRLOOLoss

from ._arguments import ChunkedArguments
from ._checkpointing import CheckpointingDefault
from ._common import cached_loss
from ._metrics import DeferredMetrics
from ._online import ChunkedScoring, gathered, global_mean, policy_forward, refuse_image_columns
from ._setup import ChunkedTrainerSetup

__all__ = ["ChunkedRLOOConfig", "ChunkedRLOOTrainer"]


@dataclass
class ChunkedRLOOConfig(CheckpointingDefault, RLOOConfig, ChunkedArguments):
    """``trl.RLOOConfig`` with the chunkloss fields of :class:`ChunkedArguments`;
    TRL's activation checkpointing default (on) under transformers' name (:class:`CheckpointingDefault`)."""


class ChunkedRLOOTrainer(ChunkedTrainerSetup, DeferredMetrics, ChunkedScoring, RLOOTrainer):
    """``trl.RLOOTrainer`` whose policy loss never materialises the logits.

    The model's final logit softcapping (Gemma-2) and logit scale (Cohere) are applied by the loss, as TRL's
    fused head applies them. A LoRA adapter on ``lm_head`` is trained (TRL refuses one); the old and reference
    log-probs then come through the chunked head with the adapter. Refused at construction: adapters on
    ``lm_head`` other than plain LoRA, and datasets with TRL's image columns (``image``, ``images``); other
    multimodal inputs are refused when they arrive.
    """

    _tag_names = ["trl", "rloo", "chunkloss"]

    def _refuse_early(self, call: dict) -> None:
        refuse_image_columns(type(self).__name__, call.get("train_dataset"), call.get("eval_dataset"))

    def _setup_loss(self) -> None:
        self._chunk_losses: dict = {}

    _skip_old_logps = False

    def _old_logps_needed(self) -> bool:
        """Whether the loss needs the sampling policy's log-probs scored apart: for the KL penalty
        (``beta``), or in training when a generation outlives an optimizer step (TRL's GRPO rule:
        ``gradient_accumulation_steps`` not a multiple of ``steps_per_generation · num_iterations``)."""
        if self.beta != 0.0:
            return True
        every = self.args.steps_per_generation * self.num_iterations
        return self.model.training and self.args.gradient_accumulation_steps % every != 0

    def _generate_and_score_completions(self, inputs):
        skip = not self._old_logps_needed()
        self._skip_old_logps = skip
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._skip_old_logps = False
        if skip:
            out["old_logps"] = None  # on-policy: the loss takes the current log-probs, detached
        return out

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        if self._skip_old_logps:  # the old log-probs' forward, while scoring on-policy: not needed
            return input_ids.new_zeros(input_ids.size(0), logits_to_keep, dtype=torch.float32), None, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *a, **kw
        )

    def _rloo_loss(self) -> FusedLinearRLOOLoss:
        """The loss module for the trainer's current settings (read on each call, as TRL reads them)."""
        opts = dict(
            epsilon_low=float(self.epsilon_low),
            epsilon_high=float(self.epsilon_high),
            temperature=float(self.temperature),
            **self.head_transforms,
        )
        return cached_loss(self._chunk_losses, FusedLinearRLOOLoss, self.chunk_opts, **opts)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        loss_mod = self._rloo_loss()
        completion_mask = inputs["completion_mask"]

        def loss_fn(x, w, b):
            loss = loss_mod(
                x,
                w,
                inputs["completion_ids"],
                completion_mask,
                inputs["advantages"],
                bias=b,
                old_logps=inputs["old_logps"],
            )
            return loss, dict(loss_mod.metrics)

        out = policy_forward(self, model, inputs, loss_fn)
        loss, metrics = out.result
        # TRL returns the loss unscaled (transformers divides it by the accumulation steps), the aux term too.
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * out.aux_loss
            self.record_aux_loss(mode, out.aux_loss)
        self._log_loss_metrics(mode, metrics, completion_mask)
        return loss

    def _log_loss_metrics(self, mode: str, metrics: dict, completion_mask: torch.Tensor) -> None:
        """Log the loss's metrics under TRL's names, in TRL's order, as 0-d tensors (``DeferredMetrics``
        fetches them when the trainer logs): the entropy's masked token mean and the clip flags' means over
        every process's completions, their min and max."""
        acc, store = self.accelerator, trl_compat.metrics(self, mode)
        n_tok = completion_mask.sum().float()
        n_seq = torch.tensor(float(completion_mask.size(0)), device=n_tok.device)
        store["entropy"].append(global_mean(acc, metrics["entropy"], n_tok))
        store["clip_ratio/low_mean"].append(global_mean(acc, metrics["clip_ratio/low_mean"], n_seq))
        store["clip_ratio/low_min"].append(gathered(acc, metrics["clip_ratio/low_min"], nanmin))
        store["clip_ratio/high_mean"].append(global_mean(acc, metrics["clip_ratio/high_mean"], n_seq))
        store["clip_ratio/high_max"].append(gathered(acc, metrics["clip_ratio/high_max"], nanmax))
        store["clip_ratio/region_mean"].append(global_mean(acc, metrics["clip_ratio/region_mean"], n_seq))
