"""What the chunked online-RL trainers (GRPO, RLOO) share: the policy's forward through the chunked head on
the completion positions (:func:`policy_forward`), the no-grad log-probs through the chunked head
(:class:`ChunkedScoring`), and TRL's cross-process metric reductions (:func:`global_mean`,
:func:`gathered`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss

from ._common import cached_loss, peft_base, refuse
from ._head import ChunkedHeadOutput, has_active_head_adapter, label_logps_head

__all__ = [
    "MULTIMODAL",
    "ChunkedScoring",
    "gathered",
    "global_mean",
    "policy_forward",
    "refuse_image_columns",
]

#: The inputs of TRL's vision-language batches; the chunked head covers text models only.
MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def refuse_image_columns(trainer: str, *datasets) -> None:
    """Refuse, before anything is built, a dataset (or a dict of them) with the columns TRL's online trainers
    read images from (``image``, ``images``): vision-language training, which the chunked head does not
    cover."""
    for ds in datasets:
        for d in ds.values() if isinstance(ds, dict) else (ds,):
            found = sorted({"image", "images"} & set(getattr(d, "column_names", None) or ()))
            if found:
                refuse(
                    trainer,
                    f"a dataset with an {found[0]!r} column",
                    "the chunked head covers text models only",
                )


def policy_forward(trainer, model, inputs: dict, loss_fn: Callable) -> ChunkedHeadOutput:
    """``model`` on ``prompt_ids + completion_ids`` with the chunked head: ``loss_fn(x, w, b)`` gets the
    hidden states at the positions that predict the completion tokens (B, T, H') and the head's weight and
    bias (fp32 with ``cast_lm_head_to_fp32``, outside autocast, as TRL's fused head runs it). Returns
    ``ChunkedHeadOutput(loss_fn's result, the MoE load-balancing loss where the trainer uses it)``.
    Multimodal inputs are refused."""
    name = type(trainer).__name__
    for key in MULTIMODAL:
        if inputs.get(key) is not None:
            refuse(name, f"multimodal input {key!r}", "the chunked head covers text models only")
    completion_ids = inputs["completion_ids"]
    k = completion_ids.size(1)
    cast = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))

    def head_fn(hidden, head):
        x = head.features(hidden[:, -k - 1 : -1])  # positions that predict the completion tokens
        w, b = head.weight, head.bias
        ctx = contextlib.nullcontext()
        if cast:
            x, w, b = x.float(), w.float(), None if b is None else b.float()
            ctx = torch.autocast(x.device.type, enabled=False)
        with ctx:
            return loss_fn(x, w, b)

    model_inputs = {
        "input_ids": torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
        "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
    }
    if trainer.aux_loss_enabled:
        model_inputs["output_router_logits"] = True
    with trainer.accelerator.autocast():
        return model(**model_inputs, chunked_head=head_fn)


def global_mean(accelerator, mean: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """TRL's global mean from this process's ``mean`` over ``count`` items: the sums and counts added over
    processes (on the device: ``DeferredMetrics`` fetches it when the trainer logs)."""
    totals = accelerator.reduce(torch.stack([mean.float() * count, count]), reduction="sum")
    return totals[0] / totals[1].clamp(min=1.0)


def gathered(accelerator, value: torch.Tensor, reduce: Callable) -> torch.Tensor:
    """``reduce`` (``nanmin`` or ``nanmax``) of every process's 0-d ``value``."""
    return reduce(accelerator.gather(value.reshape(1).float()))


class ChunkedScoring:
    """Mixin placed before the TRL trainer: the no-grad log-probs TRL scores with
    ``_get_per_token_logps_and_entropies`` (the old log-probs; a reference scored through the policy with its
    adapters off or a "ref" adapter) come from the chunked head when the model has it: per-token log-probs
    of the completion tokens, 0 on padding, as TRL returns them, with no (rows, tokens, vocabulary) logits
    (TRL's path holds them for ``batch_size`` rows at a time: 2.1 GB in bf16 for 8 completions of 1k tokens
    at V = 128256, 80 GB at 32k tokens and V = 151936). A LoRA adapter on ``lm_head`` needs this path: TRL's
    reads ``lm_head.weight`` alone. Entropies and multimodal inputs keep TRL's path (refused with a head
    adapter), and so does a model without the chunked head (a separate reference model). The policy's own
    log-probs are ``_compute_loss``'s. Needs ``self._chunk_losses`` (a dict)."""

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
        base = peft_base(self.accelerator.unwrap_model(model))
        beyond = compute_entropy or any(v is not None for v in multimodal.values())
        if beyond and has_active_head_adapter(base):
            refuse(
                type(self).__name__,
                "entropies or multimodal inputs through a LoRA adapter on lm_head",
                "the chunked head scores text log-probs only",
            )
        if beyond or not getattr(base, "_chunkloss_head", False):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        k = logits_to_keep
        logp_loss = cached_loss(
            self._chunk_losses,
            FusedLinearCrossEntropyLoss,
            self.chunk_opts,
            reduction="none",
            temperature=float(self.temperature),
            **self.head_transforms,
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
