"""The metrics of the chunked trainers: stored on the device as TRL stores its ``.item()`` values, and fetched
in one host sync when the trainer logs (:class:`DeferredMetrics`)."""

from __future__ import annotations

import torch

from chunkloss._compat import trl as trl_compat

__all__ = ["DeferredMetrics", "fetch_metrics", "mean_or_zero"]


def mean_or_zero(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count``, or 0 where ``count`` is 0, on the device: TRL's ``(total / count).item() if
    count > 0 else 0.0`` without its two host syncs (the value is the same once fetched)."""
    return torch.where(
        count > 0, total / count.clamp(min=1), torch.zeros((), dtype=total.dtype, device=total.device)
    )


def fetch_metrics(*stores: dict[str, list]) -> None:
    """Replace the 0-d tensors in the lists of each ``store`` (TRL's metrics of one mode) by Python
    floats, with one host sync for all of them. ``tolist()`` of a tensor gives the floats its ``.item()``
    gives."""
    where = [
        (vals, i)
        for store in stores
        for vals in store.values()
        for i, v in enumerate(vals)
        if isinstance(v, torch.Tensor)
    ]
    if not where:
        return
    values = torch.stack([vals[i].detach().reshape(()).double() for vals, i in where]).tolist()
    for (vals, i), value in zip(where, values):
        vals[i] = value


class DeferredMetrics:
    """Mixin of the chunked trainers: the metrics ``compute_loss`` stores stay on the device until the trainer
    logs.

    TRL's trainers call ``.item()`` on each metric inside ``compute_loss``, so the host waits there for the
    step so far. With a chunked loss that includes the LM head's gradient GEMMs, which run in the forward
    (TRL's head runs them in the backward, while the host is still launching it): the GPU then idles while
    the host launches the backward. Here ``compute_loss`` stores 0-d tensors (``mean_or_zero`` for TRL's
    guarded means) and the step's token count (``record_tokens``), and ``log`` fetches them all in one sync
    before TRL's ``log`` averages them, so the logged values are TRL's.
    """

    mean_or_zero = staticmethod(mean_or_zero)

    def record_tokens(self, mode: str, count: torch.Tensor | None) -> None:
        """TRL's ``num_tokens`` bookkeeping: in training the running total grows by ``count.item() //``
        the tensor-parallel size, with ``count`` fetched at the next log; in evaluation (``count`` None) the
        running total now. Either way the ``num_tokens`` metric holds the total (in training, replaced by the
        fetched one when the trainer logs)."""
        if mode == "train":
            self.__dict__.setdefault("_pending_tokens", []).append(count)
        else:
            self.fetch_deferred_metrics()
        trl_compat.metrics(self, mode)["num_tokens"] = [trl_compat.total_train_tokens(self)]

    def record_aux_loss(self, mode: str, aux_loss: torch.Tensor) -> None:
        """TRL's ``aux_loss`` metric of a mixture-of-experts router: its mean over the gathered processes."""
        trl_compat.metrics(self, mode)["aux_loss"].append(
            self.accelerator.gather_for_metrics(aux_loss).mean()
        )

    def fetch_deferred_metrics(self) -> None:
        """Fetch the stored metrics and token counts (what ``log`` does first; an evaluation step calls it
        too, since TRL's evaluation metrics read the running token count)."""
        pending = self.__dict__.get("_pending_tokens")
        if pending:
            counts = torch.stack(pending).tolist()
            pending.clear()
            tp = trl_compat.tp_size(self)
            total = trl_compat.total_train_tokens(self) + sum(c // tp for c in counts)
            trl_compat.set_total_train_tokens(self, total)
        # Trainers that defer their token count (SFT, DPO) log the running total, as TRL's set it each step.
        if pending is not None and "num_tokens" in trl_compat.metrics(self, "train"):
            trl_compat.metrics(self, "train")["num_tokens"] = [trl_compat.total_train_tokens(self)]
        fetch_metrics(*trl_compat.metric_stores(self))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self.fetch_deferred_metrics()
        super().log(logs, start_time)
