"""Which per-chunk steps the losses build inside a ``with`` block: the CUDA steps on CPU tensors (through
``TRITON_INTERPRET=1``), an eager ``SEQ_COEF`` step, or simply steps built afresh; and the steps a loss has
run. A block makes a :class:`~chunkloss.engine.steps.StepCache` of its own current for its duration."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

from chunkloss.engine.contract import LossContract
from chunkloss.engine.steps import StepCache, StepKind, step_cache, use_step_cache

__all__ = ["select_steps", "steps_of"]


@contextlib.contextmanager
def select_steps(
    device_type: str | None = None, *, kinds: Collection[StepKind | str] | None = None, eager_seq_coef=False
) -> Iterator[StepCache]:
    """Inside the block every loss builds its steps afresh, in a cache of the block's own, and builds them as
    for ``device_type`` (e.g. ``"cuda"``: the Triton steps a loss registered, which CPU tensors run through
    ``TRITON_INTERPRET=1``), for the step ``kinds`` given or all of them; with ``eager_seq_coef`` the
    ``SEQ_COEF`` step runs eagerly. Steps built before the block are not reused inside it, and steps built
    inside are dropped at its end. Yields the block's :class:`~chunkloss.engine.steps.StepCache` (its
    ``built`` steps)."""
    outer = use_step_cache(StepCache(device_type, kinds, eager_seq_coef))
    try:
        yield step_cache()
    finally:
        use_step_cache(outer)


def steps_of(loss: LossContract) -> dict[tuple[StepKind, str], object]:
    """The steps ``loss`` has run with the current step cache, by (kind, device type)."""
    return dict(step_cache().by_loss.get(loss, {}))
