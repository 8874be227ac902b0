"""What every chunked trainer shares: the chunkloss fields of the config subclasses, and reading them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["ChunkedArguments", "chunk_options", "refuse"]

_ACCUM = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "weight": None,
    "none": None,
}


@dataclass
class ChunkedArguments:
    """chunkloss fields added to TRL's config classes (the defaults need no tuning).

    Args:
        chunk_size: rows of logits per chunk; ``None`` sizes chunks to a 448 MiB logits budget.
        chunk_accum_dtype: dtype of the LM-head gradient accumulator across chunks: ``"float32"`` (default),
            ``"bfloat16"``, ``"float16"`` or ``"weight"`` (the weight's own dtype).
        chunk_compile: run the per-chunk math under ``torch.compile``.
    """

    chunk_size: int | None = field(
        default=None, metadata={"help": "Rows of logits per chunk (None: automatic)."}
    )
    chunk_accum_dtype: str = field(
        default="float32",
        metadata={"help": "LM-head gradient accumulator dtype: float32, bfloat16 or weight."},
    )
    chunk_compile: bool = field(
        default=True, metadata={"help": "Compile the per-chunk loss with torch.compile."}
    )


def chunk_options(args) -> dict:
    """The engine options (``chunk_size``, ``accum_dtype``, ``compile``) from a config, TRL's own or ours."""
    accum = getattr(args, "chunk_accum_dtype", "float32")
    if accum not in _ACCUM:
        raise ValueError(f"chunk_accum_dtype must be one of {sorted(_ACCUM)}, got {accum!r}")
    chunk_size = getattr(args, "chunk_size", None)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    return {
        "chunk_size": chunk_size,
        "accum_dtype": _ACCUM[accum],
        "compile": bool(getattr(args, "chunk_compile", True)),
    }


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
