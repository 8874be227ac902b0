"""The options every chunked loss takes, and the automatic chunk size (see docs/design.md, "Chunk size")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FusedOptions", "default_chunk_size"]


@dataclass(frozen=True)
class FusedOptions:
    """Options every chunked loss takes.

    Args:
        chunk_size: rows of logits per chunk; ``None`` picks one from ``logits_budget_mb``.
        logits_budget_mb: memory for one chunk's logits and their gradient, used when ``chunk_size`` is
            ``None``. Token losses without extra heads that accumulate the weight gradient in fp32 use at
            least the weight gradient's own size, and on CUDA all of a call's rows as one chunk where their
            logits fit the fp32 accumulator's bytes (see ``chunkloss.engine.plan.chunk_rows``).
        accum_dtype: dtype of the weight/bias gradient accumulator across chunks; ``None`` uses the
            weight's own dtype (saves 4·V·H bytes at bf16, loses some precision).
        compile: run the per-chunk math under ``torch.compile`` (or a Triton step where the loss registered
            one, on CUDA).
    """

    chunk_size: int | None = None
    logits_budget_mb: int = 448
    accum_dtype: torch.dtype | None = torch.float32
    compile: bool = True

    def __post_init__(self):
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size <= 0):
            raise ValueError(f"chunk_size must be a positive int or None, got {self.chunk_size!r}")
        if self.logits_budget_mb <= 0:
            raise ValueError(f"logits_budget_mb must be positive, got {self.logits_budget_mb!r}")


def default_chunk_size(
    vocab: int, itemsize: int, budget_mb: int, extra_vocab: int = 0, grad_in_place: bool = False
) -> int:
    """Rows per chunk so that one chunk's logits, their gradient (in place when compiled) and the logits
    of heads without grad (``extra_vocab``: summed vocabularies of a reference/teacher head) fit in
    ``budget_mb``.

    Rounded down to a multiple of 128 (whole tensor-core tiles) and kept in [128, 16384]: fewer rows leave
    the GEMM's M dimension too thin to keep the GPU busy.
    """
    rows = budget_mb * 2**20 // (((1 if grad_in_place else 2) * vocab + extra_vocab) * max(itemsize, 2))
    return int(min(16384, max(128, rows // 128 * 128)))
