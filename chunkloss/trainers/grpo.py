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

import contextlib
from dataclasses import dataclass

import torch
from trl import GRPOConfig, GRPOTrainer

from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss
from chunkloss.losses.grpo import (
    CLIP_LOSS_TYPES,
    GLOBAL_COUNT_LOSS_TYPES,
    FusedLinearGRPOLoss,
    nanmax,
    nanmin,
)

from ._checkpointing import CheckpointingDefault
from ._common import ChunkedArguments, DeferredMetrics, peft_base, refuse
from ._head import has_active_head_adapter, label_logps_head
from ._setup import ChunkedTrainerSetup

__all__ = ["ChunkedGRPOConfig", "ChunkedGRPOTrainer"]

_MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


@dataclass
class ChunkedGRPOConfig(CheckpointingDefault, GRPOConfig, ChunkedArguments):
    """``trl.GRPOConfig`` with the chunkloss fields of :class:`ChunkedArguments`;
    TRL's activation checkpointing default (on) under transformers' name (:class:`CheckpointingDefault`)."""


class ChunkedGRPOTrainer(ChunkedTrainerSetup, DeferredMetrics, GRPOTrainer):
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
            entropy_coef=1.0 if self._entropy_bonus_enabled else 0.0,
            max_completion_length=self.max_completion_length,
            **self.head_transforms,
        )
        key = tuple(sorted(opts.items()))
        mod = self._chunk_losses.get(key)
        if mod is None:
            mod = self._chunk_losses[key] = FusedLinearGRPOLoss(**opts, **self.chunk_opts)
        return mod

    def _applied_entropy_coef(self) -> float:
        """TRL's coefficient of the entropy bonus for this step: the adaptive controller's from the end of the
        previous optimizer step where the entropy measured then was at or below ``entropy_target``, else 0."""
        if not self._entropy_bonus_enabled:
            return 0.0
        if self.use_adaptive_entropy and not self._last_world_entropy <= self.args.entropy_target:
            return 0.0
        return float(self.entropy_coef)

    def _update_adaptive_entropy(self, entropy_sum: torch.Tensor, count: torch.Tensor) -> None:
        """TRL's adaptive entropy controller: the entropy sum and token count of each micro-batch add up over
        the accumulation window; at its last micro-batch their global mean moves ``entropy_coef`` by
        ``entropy_coef_delta`` (up at or below ``entropy_target``, down above it, within
        ``[entropy_coef_min, entropy_coef_max]``) for the next step."""
        stats = torch.stack([entropy_sum, count]).detach()
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()  # TRL's host sync: the next coef
        a = self.args
        if world_entropy <= a.entropy_target:
            self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's, except while a LoRA adapter on ``lm_head`` is active: TRL's fused head reads
        ``lm_head.weight`` alone, so the old log-probs (``steps_per_generation`` or ``num_iterations`` past
        the accumulation steps, vLLM's importance-sampling correction) and a reference scored through a "ref"
        adapter would leave the adapter out. They come from the chunked head instead: per-token log-probs of
        the completion tokens, 0 on padding, as TRL returns them. The policy's own are ``_compute_loss``'s."""
        base = peft_base(self.accelerator.unwrap_model(model))
        if not getattr(base, "_chunkloss_head", False) or not has_active_head_adapter(base):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal,
            )  # fmt: skip
        if compute_entropy or any(v is not None for v in multimodal.values()):
            refuse(
                type(self).__name__,
                "entropies or multimodal inputs through a LoRA adapter on lm_head",
                "the chunked head scores text log-probs only",
            )
        k = logits_to_keep
        key = ("logps", float(self.temperature))
        logp_loss = self._chunk_losses.get(key)
        if logp_loss is None:
            logp_loss = self._chunk_losses[key] = FusedLinearCrossEntropyLoss(
                reduction="none", temperature=key[1], **self.head_transforms, **self.chunk_opts
            )
        cast = bool(getattr(self.args, "cast_lm_head_to_fp32", False))
        batch_size = batch_size or input_ids.size(0)
        logps, aux = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start : start + batch_size]
            att = attention_mask[start : start + batch_size]
            targets = ids[:, -k:].masked_fill(att[:, -k:] == 0, -100)
            inputs = {"input_ids": ids, "attention_mask": att}
            if compute_aux_loss:
                inputs["output_router_logits"] = True
            with self.accelerator.autocast():
                out = model(**inputs, chunked_head=label_logps_head(logp_loss, targets, cast))
            logps.append(out.result)
            if compute_aux_loss:
                aux.append(out.aux_loss)
        return torch.cat(logps), None, torch.stack(aux).mean() if compute_aux_loss else None

    def _compute_loss(self, model, inputs):
        for k in _MULTIMODAL:
            if inputs.get(k) is not None:
                refuse(
                    type(self).__name__, f"multimodal input {k!r}", "the chunked head covers text models only"
                )
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        k = completion_ids.size(1)
        loss_mod = self._grpo_loss()
        if self.loss_type == "vespo":
            is_ratio = inputs.get("importance_sampling_ratio")
        elif self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"]
        else:
            is_ratio = None
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        old = inputs.get("old_per_token_logps")
        needs_global = self.loss_type in GLOBAL_COUNT_LOSS_TYPES
        cast = bool(getattr(self.args, "cast_lm_head_to_fp32", False))

        def head_fn(hidden, head):
            x = head.features(hidden[:, -k - 1 : -1])  # positions that predict the completion tokens
            w, b = head.weight, head.bias
            ctx = contextlib.nullcontext()
            if cast:
                x, w, b = x.float(), w.float(), None if b is None else b.float()
                ctx = torch.autocast(x.device.type, enabled=False)
            with ctx:
                loss = loss_mod(
                    x,
                    w,
                    completion_ids,
                    completion_mask,
                    inputs["advantages"],
                    bias=b,
                    old_logps=old,
                    ref_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
                    importance_sampling_ratio=is_ratio,
                    num_items_in_batch=inputs["num_items_in_batch"] if needs_global else None,
                    tool_mask=inputs.get("tool_mask"),
                    sampling_logps=inputs.get("sampling_per_token_logps"),
                    num_processes=self.accelerator.num_processes,
                    gradient_accumulation_steps=ga,
                    steps_per_generation=self.args.steps_per_generation if mode == "train" else 1,
                    entropy_coef=self._applied_entropy_coef() if self._entropy_bonus_enabled else None,
                )
            return loss, dict(loss_mod.metrics)

        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.aux_loss_enabled:
            model_inputs["output_router_logits"] = True
        with self.accelerator.autocast():
            out = model(**model_inputs, chunked_head=head_fn)
        loss, metrics = out.result

        # TRL's masked means count completion_mask · tool_mask.
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        n_tok = mask.sum().float()
        if self._entropy_bonus_enabled:
            # With the adaptive coefficient at 0 the loss is the policy loss alone (before TRL's GA division).
            policy_loss = metrics.get("policy_loss")
            if policy_loss is None:
                policy_loss = loss.detach() * (1.0 if needs_global else ga)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean())
            if self.use_adaptive_entropy and mode == "train":
                self._update_adaptive_entropy(metrics["entropy"] * n_tok, n_tok)
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * out.aux_loss / ga
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(out.aux_loss).mean())

        self._log_loss_metrics(mode, metrics, inputs, n_tok)
        return loss

    def _log_loss_metrics(self, mode: str, metrics: dict, inputs: dict, n_tok) -> None:
        """Log the loss's metrics under TRL's names (``n_tok``: the masked completion tokens)."""
        # TRL's values, fetched when the trainer logs (``DeferredMetrics``), not with .item() here.
        # TRL's global masked means: local means times local counts, summed over processes.
        per_seq = self.importance_sampling_level == "sequence" and inputs["advantages"].dim() == 1
        n_seq = torch.tensor(float(inputs["completion_ids"].size(0)), device=n_tok.device)

        def global_mean(name, count):
            totals = self.accelerator.reduce(
                torch.stack([metrics[name].float() * count, count]), reduction="sum"
            )
            return totals[0] / totals[1].clamp(min=1.0)

        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(global_mean("kl", n_tok))
        self._metrics[mode]["entropy"].append(global_mean("entropy", n_tok))
        clip_count = n_seq if per_seq else n_tok
        if self.loss_type in CLIP_LOSS_TYPES:
            for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
                self._metrics[mode][name].append(global_mean(name, clip_count))
            low = self.accelerator.gather(metrics["clip_ratio/low_min"].reshape(1).float())
            high = self.accelerator.gather(metrics["clip_ratio/high_max"].reshape(1).float())
            self._metrics[mode]["clip_ratio/low_min"].append(nanmin(low))
            self._metrics[mode]["clip_ratio/high_max"].append(nanmax(high))
        elif self.loss_type == "cispo":
            self._metrics[mode]["cispo_clip_ratio"].append(global_mean("cispo_clip_ratio", clip_count))
        elif self.loss_type == "vespo":
            self._metrics[mode]["vespo/phi_seq_mean"].append(global_mean("vespo/phi_seq_mean", n_seq))
