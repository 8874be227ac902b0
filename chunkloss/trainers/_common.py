"""Small helpers every chunked trainer module uses: the refusal error, the model under a PEFT wrapper and its
decoder layers, a loss module built once per options, and the JSD loss of a pair of heads."""

from __future__ import annotations

__all__ = ["cached_loss", "decoder_layers", "jsd_loss_for", "peft_base", "refuse"]


def refuse(trainer: str, option: str, why: str) -> None:
    """Raise the error for an option the chunked trainer does not cover (no silent fallback)."""
    raise ValueError(f"{trainer} does not support {option}: {why}")


def peft_base(model):
    """The model under a PEFT wrapper, or the model itself."""
    from accelerate.utils import is_peft_model

    return model.get_base_model() if is_peft_model(model) else model


def decoder_layers(trainer) -> list:
    """The trained model's decoder layers (``get_decoder().layers`` under accelerate's and PEFT's wrappers),
    or ``[]`` where it has no list of them."""
    model = peft_base(trainer.accelerator.unwrap_model(trainer.model))
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return list(getattr(decoder, "layers", None) or [])


def cached_loss(cache: dict, cls: type, chunk_opts: dict, **options):
    """``cls(**options, **chunk_opts)``, built once per class and ``options`` (hashable values) in ``cache``;
    ``chunk_opts`` (the engine's options) are the trainer's own for its lifetime."""
    key = (cls, *sorted(options.items()))
    if key not in cache:
        cache[key] = cls(**options, **chunk_opts)
    return cache[key]


def jsd_loss_for(cache: dict, student_head, teacher_head, **options):
    """One ``FusedLinearJSDLoss`` per pair of head transforms (logit scale, softcap), built once."""
    from chunkloss.losses.jsd import FusedLinearJSDLoss

    key = (student_head.softcap, student_head.logit_scale, teacher_head.softcap, teacher_head.logit_scale)
    if key not in cache:
        cache[key] = FusedLinearJSDLoss(
            student_logit_scale=student_head.logit_scale,
            teacher_logit_scale=teacher_head.logit_scale,
            student_softcap=student_head.softcap,
            teacher_softcap=teacher_head.softcap,
            **options,
        )
    return cache[key]
