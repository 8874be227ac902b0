"""Running out of memory in a chunked trainer: a retry at a smaller batch with ``auto_find_batch_size`` (each
attempt starts afresh), or one error that names the batch and what to do: :class:`OutOfMemoryRetry`."""

from __future__ import annotations

import torch

from chunkloss._compat import trl as trl_compat

from ._resume import last_complete_checkpoint

__all__ = ["OutOfMemoryRetry"]


def _find_oom(exc: BaseException | None) -> torch.OutOfMemoryError | None:
    """The ``torch.OutOfMemoryError`` that ``exc`` is or was raised from (torch.compile and Triton launches
    wrap it), or ``None``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class OutOfMemoryRetry:
    """Mixin placed before the TRL trainer, after :class:`~chunkloss.trainers._resume.ResumableCheckpoints`
    (whose ``_resumed_state`` is each attempt's start): per attempt of the training loop, the state a
    checkpoint would restore and empty metrics; the out-of-memory error as accelerate's retry needs it, or as
    one that says what to do."""

    def train(self, *args, **kwargs):
        self.__dict__.pop("_attempt_start", None)
        try:
            return super().train(*args, **kwargs)
        finally:
            self.__dict__.pop("_attempt_start", None)

    def _prepare_inputs(self, inputs):
        prepared = super()._prepare_inputs(inputs)
        if isinstance(prepared, dict):  # the shapes an out-of-memory error names
            self._batch_shapes = {
                k: tuple(v.shape)
                for k, v in prepared.items()
                if k.endswith("_ids") and isinstance(v, torch.Tensor) and v.ndim == 2
            }
        return prepared

    def _inner_training_loop(self, batch_size=None, *args, **kwargs):
        """transformers' loop; what one attempt leaves behind is reset before the next (with
        ``auto_find_batch_size``, the loop runs again at a smaller batch after running out of memory), and
        an out-of-memory error is re-raised as itself (not wrapped by torch.compile), or, without
        ``auto_find_batch_size``, as one that names the batch and what to do."""
        trl_compat.restore_state(self, self.__dict__.setdefault("_attempt_start", self._resumed_state()))
        trl_compat.clear_metrics(self)
        self.__dict__.pop("_pending_tokens", None)
        try:
            return super()._inner_training_loop(batch_size, *args, **kwargs)
        except Exception as exc:
            oom = _find_oom(exc)
            if oom is None:
                raise
            if self.args.auto_find_batch_size:
                if oom is exc:
                    raise
                raise oom from None  # accelerate retries only on the error itself
            raise torch.OutOfMemoryError(self._oom_message(batch_size, oom)) from exc

    def _oom_message(self, batch_size, oom) -> str:
        shapes = getattr(self, "_batch_shapes", {})
        batch = ", ".join(f"{k} {v}" for k, v in shapes.items()) or "before its first batch"
        last = last_complete_checkpoint(self.args.output_dir)
        resume = f"resume from {last}" if last else "no checkpoint was written"
        first = str(oom).split("\n")[0]
        size = batch_size or self.args.per_device_train_batch_size
        return (
            f"out of memory at per_device_train_batch_size={size} (the batch: {batch}): set "
            "auto_find_batch_size=True to retry at smaller batches, or lower per_device_train_batch_size "
            "(raising gradient_accumulation_steps keeps the effective batch) or the sequence length, or set "
            f"chunk_kernels=True and its recompute options; {resume}. ({first})"
        )
