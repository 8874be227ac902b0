"""Small helpers every chunked trainer module uses: the refusal error, the model under a PEFT wrapper, and the
JSD loss of a pair of heads."""

from __future__ import annotations

__all__ = ["jsd_loss_for", "peft_base", "refuse"]


def refuse(trainer: str, option: str, why: str) -> None:
    """Raise the error for an option the chunked trainer does not cover (no silent fallback)."""
    raise ValueError(f"{trainer} does not support {option}: {why}")


def peft_base(model):
    """The model under a PEFT wrapper, or the model itself."""
    from accelerate.utils import is_peft_model

    return model.get_base_model() if is_peft_model(model) else model


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
