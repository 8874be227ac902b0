"""``ChunkedGRPOTrainer``: TRL's ``GRPOTrainer`` with the policy loss computed by ``FusedLinearGRPOLoss``.

Generation, rewards, advantages, vLLM, the reference and old log-probs (TRL's own fused head, without grad)
are TRL's. Only ``_compute_loss`` changes: the policy's hidden states at the completion positions go to the
chunked GRPO loss with the LM head's weight, so the ``[B, T, V]`` logits never exist. Every loss type and
importance-sampling level of TRL 1.16 is covered, with the KL term, two-sided clipping, the off-policy mask,
the entropy mask, the entropy bonus (static, or TRL's adaptive controller with its gradient-accumulation
window), vLLM's importance-sampling ratio (per token or per sequence) and
``cast_lm_head_to_fp32``; metrics are logged under TRL's names with TRL's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import GRPOConfig, GRPOTrainer

from chunkloss._compat import trl as trl_compat
from chunkloss.losses.grpo import FusedLinearGRPOLoss, nanmax, nanmin
from chunkloss.losses.grpo_options import ClipMetrics, GRPOLossType

from ._arguments import ChunkedArguments
from ._checkpointing import CheckpointingDefault
from ._common import cached_loss, refuse
from ._metrics import DeferredMetrics
from ._online import ChunkedScoring, gathered, global_mean, policy_forward
from ._setup import ChunkedTrainerSetup

__all__ = ["ChunkedGRPOConfig", "ChunkedGRPOTrainer"]


@dataclass
class ChunkedGRPOConfig(CheckpointingDefault, GRPOConfig, ChunkedArguments):
    """``trl.GRPOConfig`` with the chunkloss fields of :class:`ChunkedArguments`;
    TRL's activation checkpointing default (on) under transformers' name (:class:`CheckpointingDefault`)."""


class ChunkedGRPOTrainer(ChunkedTrainerSetup, DeferredMetrics, ChunkedScoring, GRPOTrainer):
    """``trl.GRPOTrainer`` whose policy loss never materialises the logits.

    The model's final logit softcapping (Gemma-2) and logit scale (Cohere) are applied by the loss, as TRL's
    fused head applies them. Refused at construction: ``top_entropy_quantile < 1`` on several processes (TRL
    takes the quantile over every process's tokens) or with ``use_adaptive_entropy`` (the controller would
    read the masked tokens' entropy), and adapters on ``lm_head`` other than plain LoRA. Multimodal inputs are
    refused when they arrive.
    """

    _tag_names = ["trl", "grpo", "chunkloss"]

    def _refuse_early(self, call: dict) -> None:
        args = call.get("args")
        if args is not None and args.use_adaptive_entropy and args.top_entropy_quantile < 1.0:
            refuse(
                type(self).__name__,
                "use_adaptive_entropy=True with top_entropy_quantile < 1",
                "the controller would measure the entropy of the masked tokens, which the chunked loss does "
                "not return; use one of the two",
            )

    def _refuse_built(self) -> None:
        if self.top_entropy_quantile < 1.0 and self.accelerator.num_processes > 1:
            refuse(
                type(self).__name__,
                "top_entropy_quantile < 1 with several processes",
                "TRL takes the entropy quantile over every process's tokens",
            )

    def _setup_loss(self) -> None:
        self._chunk_losses: dict = {}

    def _grpo_loss(self) -> FusedLinearGRPOLoss:
        """The loss module for the trainer's current settings (read on each call, as TRL reads them)."""
        args = self.args
        opts = dict(
            loss_type=self.loss_type,
            beta=float(self.beta),
            epsilon_low=float(self.epsilon_low),
            epsilon_high=float(self.epsilon_high),
            delta=args.delta,
            importance_sampling_level=self.importance_sampling_level,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            use_bias_correction_kl=bool(args.use_bias_correction_kl),
            temperature=float(self.temperature),
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            top_entropy_quantile=float(self.top_entropy_quantile),
            # The bonus on or off; its coefficient, which the adaptive controller moves, goes to each call.
            entropy_coef=1.0 if trl_compat.EntropyControl(self).enabled else 0.0,
            max_completion_length=self.max_completion_length,
            **self.head_transforms,
        )
        return cached_loss(self._chunk_losses, FusedLinearGRPOLoss, self.chunk_opts, **opts)

    def _applied_entropy_coef(self) -> float:
        """TRL's coefficient of the entropy bonus for this step: the adaptive controller's from the end of the
        previous optimizer step where the entropy measured then was at or below ``entropy_target``, else 0."""
        control = trl_compat.EntropyControl(self)
        if not control.enabled:
            return 0.0
        if self.use_adaptive_entropy and not control.last_world_entropy <= self.args.entropy_target:
            return 0.0
        return float(self.entropy_coef)

    def _update_adaptive_entropy(self, entropy_sum: torch.Tensor, count: torch.Tensor) -> None:
        """TRL's adaptive entropy controller: the entropy sum and token count of each micro-batch add up over
        the accumulation window; at its last micro-batch their global mean moves ``entropy_coef`` by
        ``entropy_coef_delta`` (up at or below ``entropy_target``, down above it, within
        ``[entropy_coef_min, entropy_coef_max]``) for the next step."""
        control = trl_compat.EntropyControl(self)
        stats = torch.stack([entropy_sum, count]).detach()
        control.window = stats if control.window is None else control.window + stats
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(control.window, reduction="sum")
        world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()  # TRL's host sync: the next coef
        a = self.args
        if world_entropy <= a.entropy_target:
            self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
        control.last_world_entropy = world_entropy
        control.window = None

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        bonus = trl_compat.EntropyControl(self).enabled
        loss_mod = self._grpo_loss()
        loss_type = loss_mod.options.loss_type
        if loss_type.sequence_weight:
            is_ratio = inputs.get("importance_sampling_ratio")
        elif self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"]
        else:
            is_ratio = None
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        needs_global = loss_type.global_count
        completion_mask = inputs["completion_mask"]

        def loss_fn(x, w, b):
            loss = loss_mod(
                x,
                w,
                inputs["completion_ids"],
                completion_mask,
                inputs["advantages"],
                bias=b,
                old_logps=inputs.get("old_per_token_logps"),
                ref_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
                importance_sampling_ratio=is_ratio,
                num_items_in_batch=inputs["num_items_in_batch"] if needs_global else None,
                tool_mask=inputs.get("tool_mask"),
                sampling_logps=inputs.get("sampling_per_token_logps"),
                num_processes=self.accelerator.num_processes,
                gradient_accumulation_steps=ga,
                steps_per_generation=self.args.steps_per_generation if mode == "train" else 1,
                entropy_coef=self._applied_entropy_coef() if bonus else None,
            )
            return loss, dict(loss_mod.metrics)

        out = policy_forward(self, model, inputs, loss_fn)
        loss, metrics = out.result

        # TRL's masked means count completion_mask · tool_mask.
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        n_tok = mask.sum().float()
        if bonus:
            # With the adaptive coefficient at 0 the loss is the policy loss alone (before TRL's GA division).
            policy_loss = metrics.get("policy_loss")
            if policy_loss is None:
                policy_loss = loss.detach() * (1.0 if needs_global else ga)
            store = trl_compat.metrics(self, mode)
            store["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean())
            if self.use_adaptive_entropy and mode == "train":
                self._update_adaptive_entropy(metrics["entropy"] * n_tok, n_tok)
            if mode == "train" and self.accelerator.sync_gradients:
                store["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * out.aux_loss / ga
            self.record_aux_loss(mode, out.aux_loss)

        self._log_loss_metrics(mode, metrics, inputs, n_tok, loss_type)
        return loss

    def _log_loss_metrics(
        self, mode: str, metrics: dict, inputs: dict, n_tok, loss_type: GRPOLossType
    ) -> None:
        """Log the loss's metrics under TRL's names (``n_tok``: the masked completion tokens)."""
        # TRL's values, fetched when the trainer logs (``DeferredMetrics``), not with .item() here.
        # TRL's global masked means: local means times local counts, summed over processes.
        per_seq = self.importance_sampling_level == "sequence" and inputs["advantages"].dim() == 1
        n_seq = torch.tensor(float(inputs["completion_ids"].size(0)), device=n_tok.device)
        acc, store = self.accelerator, trl_compat.metrics(self, mode)

        if self.beta != 0.0:
            store["kl"].append(global_mean(acc, metrics["kl"], n_tok))
        store["entropy"].append(global_mean(acc, metrics["entropy"], n_tok))
        clip_count = n_seq if per_seq else n_tok
        clip_metrics = loss_type.clip_metrics
        if clip_metrics is ClipMetrics.CLIP_RATIO:
            for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
                store[name].append(global_mean(acc, metrics[name], clip_count))
            store["clip_ratio/low_min"].append(gathered(acc, metrics["clip_ratio/low_min"], nanmin))
            store["clip_ratio/high_max"].append(gathered(acc, metrics["clip_ratio/high_max"], nanmax))
        elif clip_metrics is ClipMetrics.CISPO:
            store["cispo_clip_ratio"].append(global_mean(acc, metrics["cispo_clip_ratio"], clip_count))
        elif clip_metrics is ClipMetrics.VESPO_PHI:
            store["vespo/phi_seq_mean"].append(global_mean(acc, metrics["vespo/phi_seq_mean"], n_seq))
