"""``ChunkedGRPOTrainer``: TRL's ``GRPOTrainer`` with the policy loss computed by ``FusedLinearGRPOLoss``.

Generation, rewards, advantages, vLLM, the reference and old log-probs (TRL's own fused head, without grad)
are TRL's. Only ``_compute_loss`` changes: the policy's hidden states at the completion positions go to the
chunked GRPO loss with the LM head's weight, so the ``[B, T, V]`` logits never exist. Every loss type and
importance-sampling level of TRL 1.16 is covered, with the KL term, two-sided clipping, the off-policy mask,
the entropy mask, the static entropy bonus, vLLM's importance-sampling ratio (per token or per sequence) and
``cast_lm_head_to_fp32``; metrics are logged under TRL's names with TRL's values.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from trl import GRPOConfig, GRPOTrainer

from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss
from chunkloss.losses.grpo import FusedLinearGRPOLoss

from ._common import ChunkedArguments, DeferredMetrics, apply_chunk_kernels, chunk_options, peft_base, refuse
from ._head import (
    _head_of,
    add_chunked_head,
    allow_lm_head_adapter,
    check_head_supported,
    head_transforms,
    label_logps_head,
)

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
class ChunkedGRPOConfig(GRPOConfig, ChunkedArguments):
    """``trl.GRPOConfig`` with the chunkloss fields of :class:`ChunkedArguments`."""


class ChunkedGRPOTrainer(DeferredMetrics, GRPOTrainer):
    """``trl.GRPOTrainer`` whose policy loss never materialises the logits.

    The model's final logit softcapping (Gemma-2) and logit scale (Cohere) are applied by the loss, as TRL's
    fused head applies them. Refused at construction: ``use_adaptive_entropy`` (the adaptive entropy
    controller), ``top_entropy_quantile < 1`` on several processes (TRL takes the quantile over every
    process's tokens), and adapters on ``lm_head`` other than plain LoRA. Multimodal inputs are refused when
    they arrive.
    """

    _tag_names = ["trl", "grpo", "chunkloss"]

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, *pos, **kwargs):
        name = type(self).__name__
        if args is not None:
            chunk_options(args)
            if args.use_adaptive_entropy:
                refuse(
                    name,
                    "use_adaptive_entropy=True",
                    "the adaptive entropy controller is not implemented; set a static entropy_coef",
                )
        with allow_lm_head_adapter(model):
            super().__init__(model, reward_funcs, args, *pos, **kwargs)
        apply_chunk_kernels(self)
        base = peft_base(self.model)
        check_head_supported(base)
        softcap, logit_scale = head_transforms(base.config)
        self._head_transforms = {"softcap": softcap, "logit_scale": logit_scale}
        if self.top_entropy_quantile < 1.0 and self.accelerator.num_processes > 1:
            refuse(
                name,
                "top_entropy_quantile < 1 with several processes",
                "TRL takes the entropy quantile over every process's tokens",
            )
        add_chunked_head(base)
        self._chunk_opts = chunk_options(self.args)
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
            entropy_coef=float(self.entropy_coef) if self._entropy_bonus_enabled else 0.0,
            max_completion_length=self.max_completion_length,
            **self._head_transforms,
        )
        key = tuple(sorted(opts.items()))
        mod = self._chunk_losses.get(key)
        if mod is None:
            mod = self._chunk_losses[key] = FusedLinearGRPOLoss(**opts, **self._chunk_opts)
        return mod

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
        if not getattr(base, "_chunkloss_head", False) or _head_of(base)[0]._features is None:
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
                reduction="none", temperature=key[1], **self._head_transforms, **self._chunk_opts
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
        needs_global = self.loss_type in ("dapo", "cispo", "vespo")
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
                )
            return loss, dict(loss_mod.metrics)

        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.aux_loss_enabled:
            model_inputs["output_router_logits"] = True
        with self.accelerator.autocast():
            out = model(**model_inputs, chunked_head=head_fn)
        loss, metrics = out.result

        if self._entropy_bonus_enabled:
            self._metrics[mode]["policy_loss"].append(
                self.accelerator.gather(metrics["policy_loss"]).nanmean()
            )
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * out.aux_loss / ga
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(out.aux_loss).mean())

        # TRL's values, fetched when the trainer logs (``DeferredMetrics``), not with .item() here.
        # TRL's global masked means: local means times local counts, summed over processes.
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        n_tok = mask.sum().float()
        per_seq = self.importance_sampling_level == "sequence" and inputs["advantages"].dim() == 1
        n_seq = torch.tensor(float(completion_ids.size(0)), device=n_tok.device)

        def global_mean(name, count):
            totals = self.accelerator.reduce(
                torch.stack([metrics[name].float() * count, count]), reduction="sum"
            )
            return totals[0] / totals[1].clamp(min=1.0)

        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(global_mean("kl", n_tok))
        self._metrics[mode]["entropy"].append(global_mean("entropy", n_tok))
        clip_count = n_seq if per_seq else n_tok
        if self.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
                self._metrics[mode][name].append(global_mean(name, clip_count))
            low = self.accelerator.gather(metrics["clip_ratio/low_min"].reshape(1).float())
            high = self.accelerator.gather(metrics["clip_ratio/high_max"].reshape(1).float())
            self._metrics[mode]["clip_ratio/low_min"].append(_nanreduce(low, torch.min, float("inf")))
            self._metrics[mode]["clip_ratio/high_max"].append(_nanreduce(high, torch.max, float("-inf")))
        elif self.loss_type == "cispo":
            self._metrics[mode]["cispo_clip_ratio"].append(global_mean("cispo_clip_ratio", clip_count))
        elif self.loss_type == "vespo":
            self._metrics[mode]["vespo/phi_seq_mean"].append(global_mean("vespo/phi_seq_mean", n_seq))
        return loss


def _nanreduce(x: torch.Tensor, fn, neutral: float) -> torch.Tensor:
    """TRL's ``fn(x[~isnan(x)]).item() if any are not NaN else nan`` on the device (no sync): NaNs replaced by
    ``fn``'s neutral value (+inf for min, -inf for max)."""
    ok = ~torch.isnan(x)
    nan = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
    return torch.where(ok.any(), fn(torch.where(ok, x, neutral)), nan)
