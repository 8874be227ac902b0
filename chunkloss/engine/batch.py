"""What a loss hands the engine: the rows that take part and their tensors (:class:`Batch`), its declared
per-row and per-sequence tensors (subclasses of :class:`Rows` and :class:`Sequences`), the heads without grad
that ride along (:class:`ExtraHead`), and the helpers that build a sequence loss's batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = ["Batch", "ExtraHead", "Rows", "Sequences", "TensorFields", "segment_sum", "sequence_batch"]

_T = TypeVar("_T", bound="TensorFields")


class TensorFields:
    """Base of a dataclass whose fields are tensors along one leading dimension (or ``None``): indexing it
    indexes every tensor (``x[a:b]``, ``x[index]``), and :meth:`map` applies a function to each."""

    def map(self: _T, fn: Callable[[Tensor], Tensor]) -> _T:
        """A copy with ``fn(tensor)`` for every tensor field (``None`` fields stay ``None``)."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                changes[f.name] = fn(value)
        return dataclasses.replace(self, **changes)

    def __getitem__(self: _T, index) -> _T:
        return self.map(lambda t: t[index])


def check_fields(value, base: type[TensorFields], what: str, n: int | None = None) -> None:
    """``value`` is a dataclass subclassing ``base`` whose fields are tensors (with ``n`` rows, where given)
    or ``None``: a TypeError or ValueError naming the mistake otherwise. The engine indexes those fields
    alone, so a plain dataclass, or an attribute that is not a field, would fail or be dropped in the loop."""
    cls = type(value)
    if not isinstance(value, base):
        raise TypeError(
            f"{what} must be a dataclass subclassing chunkloss.engine.{base.__name__} (@dataclass class "
            f"{cls.__name__}({base.__name__}): ...), got {cls.__name__}"
        )
    fields = [f.name for f in dataclasses.fields(value)]
    undeclared = sorted(set(getattr(value, "__dict__", ())) - set(fields))
    if undeclared:
        raise TypeError(
            f"{cls.__name__}.{undeclared[0]} is not a dataclass field: decorate {cls.__name__} with "
            "@dataclass and declare it as a field (the engine indexes only the fields)"
        )
    for name in fields:
        t = getattr(value, name)
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{cls.__name__}.{name} must be a tensor or None, got {type(t).__name__}")
        if n is not None and t is not None and (t.dim() == 0 or t.shape[0] != n):
            raise ValueError(
                f"{cls.__name__}.{name} has shape {tuple(t.shape)}, but Batch.rows has {n} rows: a per-row "
                "tensor holds one entry per row that takes part, in the order of Batch.rows (labels[rows])"
            )


@dataclass
class Rows(TensorFields):
    """Base of what a loss declares per row (a dataclass of tensors (N, ...), one entry per row that takes
    part, in the order of ``Batch.rows``; ``None`` for a tensor the options leave out). The engine hands a
    chunk's rows to the loss's per-chunk math.

    Attributes:
        extra_stats: the engine's own field: (N, K) ``extra_token_stats`` of the heads without grad, when the
            loss defines it (``None`` otherwise).
    """

    extra_stats: Tensor | None = field(default=None, kw_only=True)


@dataclass
class Sequences(TensorFields):
    """Base of what a sequence loss declares per sequence (a dataclass of tensors (S, ...))."""


@dataclass
class ExtraHead:
    """A linear head without grad that rides along: ``hidden (N, H) @ weight.T (V, H) + bias (V,)`` over the
    same N rows (a reference model, a teacher)."""

    hidden: Tensor  # (N, H)
    weight: Tensor  # (V, H)
    bias: Tensor | None = None  # (V,)


@dataclass
class Batch:
    """What a loss hands the engine: the rows that take part and the tensors that go with them.

    Attributes:
        rows: indices into the flattened hidden of the rows that take part, in chunk order (N_valid,).
        token: the loss's :class:`Rows`, already restricted to ``rows`` (N_valid, ...).
        scalars: the loss's tensors of the whole batch, computed once (a dataclass: normalisers, counts;
            ``None`` where the loss needs none). Handed to the per-chunk math as they are.
        extra: heads without grad projected over the same rows (reference model, teacher).
        seq_id: for sequence losses, the group-local sequence index of each row (N_valid,).
        sequence: for sequence losses, the loss's :class:`Sequences` (S, ...).
        group_of_seq: for sequence losses, the group of each sequence (S,); sequences of one group
            (a chosen/rejected pair) must share a chunk for the one-pass mode. Groups are numbered
            in row order, so ``rows`` sorted by group keeps each group contiguous.
        tokens_per_group: host list of rows per group (one-pass chunk planning).
        seqs_per_group: host list of sequences per group (one-pass chunk planning).
        num_seqs: S, number of sequences (sequence losses).
        last_seq_rows: host count of the rows of the last sequence in row order (sequence losses).
        num_rows: N, rows of the flattened hidden (for the per-row output of reduction='none').
        all_rows: ``rows`` is ``arange(N)``: chunks are plain slices (no gather/scatter copies).
    """

    rows: Tensor
    token: Rows = field(default_factory=Rows)
    scalars: Any = None
    extra: list[ExtraHead] = field(default_factory=list)
    seq_id: Tensor | None = None
    sequence: Sequences = field(default_factory=Sequences)
    group_of_seq: Tensor | None = None
    tokens_per_group: list[int] | None = None
    seqs_per_group: list[int] | None = None
    num_rows: int = 0
    all_rows: bool = False
    num_seqs: int = 0
    last_seq_rows: int = 0

    def __post_init__(self):
        check_fields(self.token, Rows, "Batch.token", self.rows.shape[0])
        check_fields(self.sequence, Sequences, "Batch.sequence")


def segment_sum(values: Tensor, seq_id: Tensor, num_seqs: int) -> Tensor:
    """Sum of ``values`` (N, ...) per sequence id -> (num_seqs, ...), in ``values``' dtype.

    Accumulated in float64 and rounded once: ``index_add`` adds the rows one at a time, which in fp32 drifts
    from the exact sum over a long sequence (docs/design.md, "Sequence sums"); this is the exact sum to
    fp32's own precision, as ``torch.sum`` (pairwise, what TRL uses) nearly is.
    """
    out = torch.zeros((num_seqs, *values.shape[1:]), dtype=torch.float64, device=values.device)
    return out.index_add(0, seq_id, values.double()).to(values.dtype)


def sequence_batch(
    keep: Tensor,  # (S, T) bool: rows that take part
    group_of_seq: Tensor,  # (S,) long: sequences of one group must share a chunk (pairs)
    token: Rows | None = None,  # (S, T, ...) per-token tensors
    sequence: Sequences | None = None,  # (S, ...) per-sequence tensors
    scalars: Any = None,
    extra: list[ExtraHead] | None = None,
    host_checks: list[tuple[Tensor, Callable[[int], None]]] = (),
) -> tuple[Batch, Tensor]:
    """A :class:`Batch` for a sequence loss over S sequences of T positions (flattened row = s·T + t):
    ``token`` holds (S, T, ...) tensors, restricted here to the rows that take part.

    Sequences are reordered by group (stable), so each group's rows are contiguous in ``rows``;
    ``sequence`` tensors and ``seq_id`` follow that order. Returns the batch and ``order`` (S,), the
    original index of each reordered sequence (e.g. pairs (g, B+g) come out as [0, B, 1, B+1, ...]).
    ``host_checks`` are ``(0-d integer tensor, check)`` pairs from input validation (``check_labels(...,
    defer=...)``): their values come to the host in this function's one sync, and each ``check(value)``
    runs (and may raise) before anything reads the batch.
    """
    if token is not None:
        check_fields(token, Rows, "sequence_batch's token")
    if sequence is not None:
        check_fields(sequence, Sequences, "sequence_batch's sequence")
    n_seq, t = keep.shape
    order = torch.argsort(group_of_seq, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n_seq, device=order.device)
    groups = group_of_seq[order]
    # Group index of each reordered sequence (sorted groups: a new one starts where the value changes).
    group_idx = torch.cat([groups.new_zeros(min(n_seq, 1)), (groups[1:] != groups[:-1]).long().cumsum(0)])
    rows_per_seq = keep.sum(1)
    per_group = torch.zeros(2, max(n_seq, 1), dtype=torch.long, device=keep.device)
    per_group[0].index_add_(0, group_idx, rows_per_seq[order])  # rows of each group
    per_group[1].index_add_(0, group_idx, torch.ones_like(group_idx))  # sequences of each group
    n_groups = group_idx[-1:] + 1 if n_seq else group_idx.new_zeros(1)
    # The one host sync: rows in all, rows of the last sequence, groups, and per group its rows and sequences
    # (chunk planning).
    checks = [c.reshape(1).long() for c, _ in host_checks]
    last_rows = rows_per_seq[order[-1:]] if n_seq else rows_per_seq.new_zeros(1)
    host = torch.cat(
        [*checks, rows_per_seq.sum().reshape(1), last_rows, n_groups, per_group.reshape(-1)]
    ).tolist()
    for (_, check), value in zip(host_checks, host):
        check(value)
    host = host[len(checks) :]
    last_seq_rows = host.pop(1)
    n_rows, n_groups = host[0], host[1]
    width = max(n_seq, 1)
    rows = torch.nonzero_static(keep.reshape(-1), size=n_rows).squeeze(1)
    seq_of_row = rows // t
    perm = torch.argsort(rank[seq_of_row] * t + rows % t)  # rows by (reordered seq, position)
    rows = rows[perm]
    seq_id = rank[rows // t]
    batch = Batch(
        rows=rows,
        token=(token or Rows()).map(lambda v: v.reshape(n_seq * t, *v.shape[2:])[rows]),
        scalars=scalars,
        extra=extra or [],
        seq_id=seq_id,
        sequence=(sequence or Sequences())[order],
        group_of_seq=group_idx,
        tokens_per_group=host[2 : 2 + n_groups],
        seqs_per_group=host[2 + width : 2 + width + n_groups],
        num_rows=n_seq * t,
        all_rows=False,
        num_seqs=n_seq,
        last_seq_rows=last_seq_rows,
    )
    return batch, order
