"""FusedLinearBase: the one chunk loop every chunkloss loss runs on.

A loss over the LM head ``logits = hidden @ weight.T (+ bias)`` is computed without ever holding the
full ``[N, V]`` logits. The rows that take part (label not ignored, loss mask 1) are selected first;
then, chunk by chunk, the logits are projected, the loss and ``dL/dlogits`` come from
``torch.func.grad_and_value`` of the loss's per-chunk math (under ``torch.compile``), and three GEMMs
turn that into the gradients::

    logits_c     = x_c @ W.T (+ b)            # GEMM 1 (forward)
    grad_x[c]    = g_c @ W                    # GEMM 2, written into a preallocated buffer
    grad_W      += g_c.T @ x_c                # GEMM 3, accumulated in place (fp32 by default)
    grad_b      += g_c.sum(0)

The logits are then dropped. Backward only multiplies the stored gradients by ``grad_output``.

Two kinds of loss run on the loop:

* **token losses** (cross-entropy, JSD, token-level GRPO) define ``chunk_loss``: a sum over the
  chunk's rows, already divided by global normalisers passed in as tensors;
* **sequence losses** (DPO, ORPO, SimPO, CPO, sequence-level GRPO) define ``token_stats`` (a few
  differentiable numbers per row, e.g. the label log-prob) and ``sequence_loss`` (the loss from those
  numbers, grouped by sequence). Either way the statistics are computed without grad, ``sequence_loss``
  runs on those small tensors and autograd gives ``dL/dstats`` (compiled where the other steps are Triton
  kernels, see ``_build_step``'s "seq_coef"), and a pointwise step pulls that coefficient back to
  ``dL/dlogits`` in place. When whole groups of sequences (a chosen/rejected pair)
  fit in a chunk, chunks are aligned to groups and all of this happens on the chunk's logits in **one
  pass** (3 GEMMs). Otherwise (or when the loss needs batch-wide statistics such as an entropy
  quantile) it takes **two passes**: pass 1 projects every chunk and stores its statistics, then the
  loss runs over the whole batch, then pass 2 re-projects each chunk for the gradient (4 GEMMs).

Heads without grad (a reference model, a teacher) ride along: their logits for the same rows are
projected in the same chunk step and handed to the loss as ``extra_logits``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = ["Batch", "FusedLinearBase", "FusedOptions", "Head", "segment_sum", "sequence_batch"]


@dataclass(frozen=True)
class FusedOptions:
    """Options every chunked loss takes.

    Args:
        chunk_size: rows of logits per chunk; ``None`` picks one from ``logits_budget_mb``.
        logits_budget_mb: memory for one chunk's logits and their gradient, used when
            ``chunk_size`` is ``None``. 448 MiB keeps all the step's working memory (logits chunk, gathered
            rows, per-row tensors) under 0.5 GiB beyond the gradients with weight-dtype accumulation
            (measured on an H100 at V=128256: 0.46 GiB at N=8192; 512 MiB measured 0.52 GiB at N=32768).
            Token losses without extra heads that accumulate the weight gradient in fp32 use at least the
            weight gradient's own size, and on CUDA all of a call's rows as one chunk where their logits fit
            the fp32 accumulator's bytes (see ``FusedLinearBase.chunk_rows``).
        accum_dtype: dtype of the weight/bias gradient accumulator across chunks; ``None`` uses the
            weight's own dtype (saves 4·V·H bytes at bf16, loses some precision).
        compile: run the per-chunk math under ``torch.compile``.
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


@dataclass
class Head:
    """A linear head: ``hidden (N, H) @ weight.T (V, H) + bias (V,)`` over the same N rows."""

    hidden: Tensor  # (N, H)
    weight: Tensor  # (V, H)
    bias: Tensor | None = None  # (V,)


@dataclass
class Batch:
    """What a loss hands the engine: the rows that take part and the tensors that go with them.

    Attributes:
        rows: indices into the flattened hidden of the rows that take part, in chunk order (N_valid,).
        token: per-row tensors, already restricted to ``rows`` (N_valid, ...).
        scalars: 0-d tensors computed once for the whole batch (normalisers).
        extra: heads without grad projected over the same rows (reference model, teacher).
        seq_id: for sequence losses, the group-local sequence index of each row (N_valid,).
        sequence: for sequence losses, per-sequence tensors (S, ...).
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
    token: dict[str, Tensor] = field(default_factory=dict)
    scalars: dict[str, Tensor] = field(default_factory=dict)
    extra: list[Head] = field(default_factory=list)
    seq_id: Tensor | None = None
    sequence: dict[str, Tensor] = field(default_factory=dict)
    group_of_seq: Tensor | None = None
    tokens_per_group: list[int] | None = None
    seqs_per_group: list[int] | None = None
    num_rows: int = 0
    all_rows: bool = False
    num_seqs: int = 0
    last_seq_rows: int = 0


#: Devices where one chunk's weight gradient is one GEMM into the weight's dtype (no fp32 copies), so that
#: ``FusedLinearBase.chunk_rows`` may take a call's rows as one chunk in the fp32 accumulator's memory.
#: "meta" for shape-only checks.
ONE_CHUNK_DEVICES = ("cuda", "meta")


def default_chunk_size(
    vocab: int, itemsize: int, budget_mb: int, extra_vocab: int = 0, grad_in_place: bool = False
) -> int:
    """Rows per chunk so that one chunk's logits, their gradient (in place when compiled) and the logits
    of heads without grad (``extra_vocab``: summed vocabularies of a reference/teacher head) fit in
    ``budget_mb``.

    Rounded down to a multiple of 128 (whole tensor-core tiles) and kept in [128, 16384]: fewer than
    128 rows leave the GEMM's M dimension too thin to keep an H100 busy.
    """
    rows = budget_mb * 2**20 // (((1 if grad_in_place else 2) * vocab + extra_vocab) * max(itemsize, 2))
    return int(min(16384, max(128, rows // 128 * 128)))


def _project(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()


def _accumulate_weight_grad(acc: Tensor, g: Tensor, x: Tensor, beta: float = 1.0) -> None:
    """``acc = beta·acc + g.T @ x`` in place, without a [V, H] temporary (beta=0 for the first chunk
    saves zero-filling the accumulator)."""
    if acc.dtype == g.dtype:
        acc.addmm_(g.t(), x, beta=beta)
    elif acc.is_cuda:
        # cuBLAS: bf16/fp16 operands, fp32 output and accumulation.
        torch.addmm(acc, g.t(), x, beta=beta, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(g.t().to(acc.dtype), x.to(acc.dtype), beta=beta)


class _WeightGrad:
    """The weight's gradient over the chunks: accumulated in ``accum`` and handed out in the weight's dtype.

    The contribution the loop marks as the last (``add(..., last=True)``) and a scale still pending from
    ``scale`` (the deferred rows' λ of two passes) go into that final tensor without another pass over an
    fp32 accumulator where it is cheaper:

    * a last contribution with nothing before it (one chunk) is one GEMM that writes the weight's dtype; no
      accumulator is allocated. cuBLAS accumulates in fp32 inside the GEMM and rounds once, which is what
      casting an fp32 accumulator would give;
    * on CUDA, with an fp32 accumulator of a bf16/fp16 weight, a last contribution of at most
      ``weight_grad.MAX_ROWS`` rows, or the pending scale alone, runs ``finish_weight_grad``: one pass that
      reads the accumulator, scales it, adds ``g.T @ x`` and writes the weight's dtype. cuBLAS's addmm would
      read and write the accumulator and the cast read it again (at 128256 x 4096, 3.1 ms against 1.6 for 256
      rows; a scale and cast 2.7 ms against 1.0).

    Otherwise the chunk's GEMM accumulates in place (``_accumulate_weight_grad``) and ``finish`` casts.
    """

    #: Tests run the fused kernel on CPU tensors through the Triton interpreter.
    fuse_off_cuda = False

    def __init__(self, weight: Tensor, accum: torch.dtype):
        self.weight, self.accum = weight, accum
        self.acc: Tensor | None = None  # allocated at the first contribution that is not the last
        self.s: Tensor | None = None  # pending scale of ``acc``
        self.out: Tensor | None = None  # the finished gradient

    def _fusable(self) -> bool:
        return (
            (self.weight.is_cuda or self.fuse_off_cuda)
            and self.accum == torch.float32
            and self.weight.dtype in (torch.bfloat16, torch.float16)
        )

    def add(self, g: Tensor, x: Tensor, last: bool = False) -> None:
        """``grad_W += g.T @ x``; ``last``: no contribution or scale follows."""
        assert self.out is None, "a weight-gradient contribution after the one marked last"
        if last and self.acc is None:
            if g.dtype == self.weight.dtype and (g.is_cuda or g.dtype == self.accum):
                self.out = g.t() @ x
            else:  # CPU: the accumulator's arithmetic, then one rounding
                self.out = (g.t().to(self.accum) @ x.to(self.accum)).to(self.weight.dtype)
            return
        if last and self._fusable() and g.shape[0] <= _weight_grad_kernels().MAX_ROWS and _unit_rows(g, x):
            self.out = _weight_grad_kernels().finish_weight_grad(self.acc, g, x, self.s, self.weight.dtype)
            self.acc = self.s = None
            return
        if self.acc is None:
            self.acc = torch.empty(self.weight.shape, dtype=self.accum, device=self.weight.device)
            _accumulate_weight_grad(self.acc, g, x, beta=0.0)
            return
        if self.s is not None:
            self.acc.mul_(self.s)
            self.s = None
        _accumulate_weight_grad(self.acc, g, x)

    def scale(self, lam: Tensor) -> None:
        """Multiply the gradient so far by the one-element tensor ``lam`` (before any later ``add``)."""
        if self.acc is not None:
            self.s = lam if self.s is None else self.s * lam

    def finish(self) -> Tensor:
        """The gradient in the weight's dtype (zeros when no rows took part)."""
        if self.out is not None:
            return self.out
        if self.acc is None:
            return torch.zeros_like(self.weight)
        if self.s is not None:
            if self._fusable():
                finish = _weight_grad_kernels().finish_weight_grad
                return finish(self.acc, None, None, self.s, self.weight.dtype)
            self.acc.mul_(self.s)
        return self.acc.to(self.weight.dtype)


def _unit_rows(*ts: Tensor) -> bool:
    """Whether each 2-D tensor's rows are contiguous (unit column stride), as the Triton kernels read them."""
    return all(t.stride(1) == 1 or t.shape[1] <= 1 for t in ts)


def _weight_grad_kernels():
    """``chunkloss.kernels.weight_grad``, imported when first used (Triton is imported only where it runs)."""
    from chunkloss.kernels import weight_grad

    return weight_grad


def segment_sum(values: Tensor, seq_id: Tensor, num_seqs: int) -> Tensor:
    """Sum of ``values`` (N, ...) per sequence id -> (num_seqs, ...), in ``values``' dtype.

    Accumulated in float64: ``index_add`` adds the rows one at a time, and a long sequence's log-probs summed
    that way in fp32 drift far from the exact sum (16k tokens of log-prob ≈ -12 each: 0.32 nats off, which
    moved a DPO loss by 2.5%); ``torch.sum``, which TRL uses, sums pairwise. Summed in float64 and rounded
    once, the result is the exact sum to fp32's own precision.
    """
    out = torch.zeros((num_seqs, *values.shape[1:]), dtype=torch.float64, device=values.device)
    return out.index_add(0, seq_id, values.double()).to(values.dtype)


def sequence_batch(
    keep: Tensor,  # (S, T) bool: rows that take part
    group_of_seq: Tensor,  # (S,) long: sequences of one group must share a chunk (pairs)
    token: dict[str, Tensor] | None = None,  # (S, T, ...) per-token tensors
    sequence: dict[str, Tensor] | None = None,  # (S, ...) per-sequence tensors
    scalars: dict[str, Tensor] | None = None,
    extra: list[Head] | None = None,
    host_checks: list[tuple[Tensor, Callable[[int], None]]] = (),
) -> tuple[Batch, Tensor]:
    """A :class:`Batch` for a sequence loss over S sequences of T positions (flattened row = s·T + t).

    Sequences are reordered by group (stable), so each group's rows are contiguous in ``rows``;
    ``sequence`` tensors and ``seq_id`` follow that order. Returns the batch and ``order`` (S,), the
    original index of each reordered sequence (e.g. pairs (g, B+g) come out as [0, B, 1, B+1, ...]).
    ``host_checks`` are ``(0-d integer tensor, check)`` pairs from input validation (``check_labels(...,
    defer=...)``): their values come to the host in this function's one sync, and each ``check(value)``
    runs (and may raise) before anything reads the batch.
    """
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
        token={k: v.reshape(n_seq * t, *v.shape[2:])[rows] for k, v in (token or {}).items()},
        scalars=scalars or {},
        extra=extra or [],
        seq_id=seq_id,
        sequence={k: v[order] for k, v in (sequence or {}).items()},
        group_of_seq=group_idx,
        tokens_per_group=host[2 : 2 + n_groups],
        seqs_per_group=host[2 + width : 2 + width + n_groups],
        num_rows=n_seq * t,
        all_rows=False,
        num_seqs=n_seq,
        last_seq_rows=last_seq_rows,
    )
    return batch, order


# Arguments of a loss's forward that are a head's tensors (cast under autocast): hidden, weight, bias and
# their ref_/student_/teacher_ forms.
_HEAD_ARG = re.compile(r"^(?:(?:ref|student|teacher)_)?(?:hidden|weight|bias)$")


def _autocast_device(args, kwargs) -> str | None:
    """The device type of the first tensor argument when autocast is on for it, else ``None``."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            device = value.device.type
            return device if torch.is_autocast_enabled(device) else None
    return None


@functools.cache
def _forward_signature(cls) -> inspect.Signature:
    return inspect.signature(cls.forward)


class FusedLinearBase(nn.Module):
    """Base module of every chunked loss. Subclasses set ``options_cls`` and define either
    ``chunk_loss`` (token losses) or ``token_stats`` + ``sequence_loss`` (sequence losses), and a
    ``forward`` that validates its inputs, builds a :class:`Batch` and calls :meth:`run`.

    After each call ``self.metrics`` holds the loss's metrics by name (detached 0-d tensors).
    """

    options_cls: type[FusedOptions] = FusedOptions
    #: sequence losses: the loss needs statistics of the whole batch (always two passes).
    needs_global_stats: bool = False
    #: per-row outputs of ``chunk_loss``'s metrics dict (e.g. "loss" for reduction='none').
    token_outputs: tuple[str, ...] = ()
    #: sequence losses: every group holds exactly this many sequences (2: the preference losses' pairs), so a
    #: batch or chunk of S sequences holds S / ``seqs_per_group`` groups. The compiled "seq_coef" step takes
    #: the number of groups as its dynamic size (see ``_SequenceDynamic``).
    seqs_per_group: int = 1

    def __init__(self, **options):
        super().__init__()
        fields = {f.name for f in dataclasses.fields(self.options_cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown option(s) {unknown}; accepted: {sorted(fields)}"
            )
        self.options = self.options_cls(**options)
        self.metrics: dict[str, Tensor] = {}
        self._compiled: dict[str, object] = {}

    def __call__(self, *args, **kwargs):
        """Under ``torch.autocast`` the heads run in the autocast dtype, as ``nn.Linear`` would.

        The heads' floating-point tensors (``hidden``, ``weight``, ``bias`` and their ``ref_``/``student_``/
        ``teacher_`` forms, fp32, fp16 or bf16) are cast to the autocast dtype before the loss sees them, as
        autocast casts a matmul's operands, and the loss runs with autocast off:
        inside the chunk loop every GEMM writes into buffers of the inputs' dtype. Autograd carries the
        gradients back through the casts to the fp32 tensors. Other tensors (labels, advantages,
        log-probs) are left as they are.
        """
        device = _autocast_device(args, kwargs)
        if device is None:
            return super().__call__(*args, **kwargs)
        dtype = torch.get_autocast_dtype(device)
        bound = _forward_signature(type(self)).bind(self, *args, **kwargs)
        for name, value in bound.arguments.items():
            if _HEAD_ARG.match(name) and isinstance(value, Tensor) and value.is_floating_point():
                bound.arguments[name] = value.to(dtype)  # a no-op where it already has the dtype
        with torch.autocast(device, enabled=False):
            return super().__call__(*bound.args[1:], **bound.kwargs)  # args[0] is self

    # ----------------------------------------------------------------------------------------------
    # The per-chunk math a subclass provides (pure functions of tensors and the options).
    @staticmethod
    def chunk_loss(logits, extra_logits, token, scalars, opts):  # pragma: no cover - interface
        """Token losses: ``(loss, metrics)`` of one chunk; a sum over rows, already normalised."""
        raise NotImplementedError

    @staticmethod
    def token_stats(logits, extra_logits, token, opts):  # pragma: no cover - interface
        """Sequence losses: differentiable per-row statistics ``(N_c, K)`` in fp32.

        Heads without grad reach it through ``token["extra_stats"]`` (see ``extra_token_stats``),
        computed once in the first pass and reused in the second. A loss's own "stats" step (``kernel_steps``)
        may return ``(statistics, carry)``; in one pass ``carry`` reaches its "seq_pass2" step on the same
        logits as a last argument (``_stats_and_carry``).
        """
        raise NotImplementedError

    @staticmethod
    def sequence_loss(stats, seq_id, num_seqs, token, sequence, scalars, opts):  # pragma: no cover
        """Sequence losses: ``(loss, metrics)`` from the rows' statistics of whole sequences."""
        raise NotImplementedError

    #: Optional ``extra_token_stats(extra_logits, token, opts) -> (N_c, K)``: reduce the no-grad heads'
    #: logits to a few numbers per row (e.g. the reference log-prob) right after they are projected, so
    #: they are freed before the policy's logits exist; the loss then reads ``token["extra_stats"]``
    #: and gets ``extra_logits == []``. Losses that need whole extra distributions (JSD) leave it None.
    #: It runs uncompiled (a loss keeps its compiled graphs to the two of its own steps) and so must not
    #: build [C, V] temporaries: ``chunkloss.losses.common.nograd_label_logprob`` reads the logits once.
    extra_token_stats = None

    def rows_in_pass_1(self, batch: Batch) -> tuple[int, int, Tensor] | None:
        """Two passes: ``(k, n, m)`` when the batch's last ``n`` rows get their whole gradient through
        statistics column ``k``, as ``dL/dstats[row] = λ·m[row]·e_k`` (in the columns that depend on the
        logits) for one scalar λ and multipliers ``m`` (n,) known before the loss is (e.g. the preference
        losses: the last pair's rejected sequence, whose summed log-prob alone reaches the loss, with m = 1).
        Those rows then run their backward in pass 1 with coefficient ``m·e_k``, their gradients are scaled by
        λ once the loss is known, and pass 2 projects only the other rows again. None (the default): every
        row waits for pass 2.
        """
        return None

    def pass_1_estimates(self, batch: Batch) -> Callable[[list[Tensor]], dict[str, Tensor]] | None:
        """Two passes: for a loss whose rows' coefficients ``dL/dstats`` depend on the rest of the batch only
        through a few scalars of its statistics (GRPO's entropy threshold), a function from statistics (a
        list of (C, K) tensors) to those scalars, which ``sequence_loss`` then reads from ``scalars`` instead
        of computing them. Every chunk runs its backward in pass 1 with the coefficient ``sequence_loss``
        gives on the chunk alone with the scalars estimated from the statistics seen so far (this chunk's
        included); once every row is seen, ``sequence_loss`` runs over all rows with the final scalars, and
        pass 2 projects only the rows whose coefficient changed, adding the difference
        (the logits gradient is linear in the coefficient). Rows on the same side of the final threshold
        need no second projection. None (the default): rows wait for pass 2 (or ``rows_in_pass_1``).
        """
        return None

    @property
    def is_sequence_loss(self) -> bool:
        """Run ``token_stats`` + ``sequence_loss`` rather than ``chunk_loss``. By default: the class
        defines ``sequence_loss``; a loss with both forms (GRPO) decides from its options."""
        return type(self).sequence_loss is not FusedLinearBase.sequence_loss

    #: Triton steps for this class's own per-chunk math, by step kind (``"token"``, ``"token_value"``,
    #: ``"stats"``, ``"seq_pass2"``): ``fn(opts, *step_args)``, run instead of the compiled step on CUDA when
    #: ``compile`` is on. ``kernel_math`` names the class attributes whose functions they compute: a subclass
    #: that replaces one of them keeps the compiled steps (the kernels would compute its parent's loss), and
    #: one that declares ``kernel_steps`` of its own gets those instead of its parent's.
    kernel_steps: dict[str, Callable] = {}
    kernel_math: tuple[str, ...] = ()

    def _kernel_step(self, kind: str, opts: FusedOptions, device_type: str):
        """The Triton step of ``kind`` for this loss on ``device_type``, or None (see ``kernel_steps``)."""
        if device_type != "cuda" or not opts.compile:
            return None
        cls = type(self)
        owner = next(c for c in cls.__mro__ if "kernel_steps" in c.__dict__)
        fn = owner.kernel_steps.get(kind)
        if fn is None or any(getattr(cls, name) is not getattr(owner, name) for name in owner.kernel_math):
            return None
        return functools.partial(fn, opts)

    def _step_upcasts_extra(self, device_type: str) -> bool:
        """Whether the chunk step holds an fp32 copy of the extra heads' logits: the compiled step does
        (inductor upcasts bf16 inputs of a reduction), a Triton kernel step reads them in place."""
        return self._kernel_step("token", self.options, device_type) is None

    # ----------------------------------------------------------------------------------------------
    def _step_fn(self, kind: str, device_type: str = "cuda"):
        """The per-chunk step of ``kind`` (``"token"``, ``"token_value"``, ``"stats"``, ``"seq_pass2"``, or
        ``"seq_coef"``: ``sequence_loss`` and its ``dL/dstats``), compiled when asked: once per loss class,
        options (those the step reads) and device type, and shared by every instance with those (see
        ``_bind``)."""
        key = (kind, device_type)
        fn = self._compiled.get(key)
        if fn is None:
            # The engine's own fields do not enter the step: losses differing only there share it.
            base = FusedOptions
            opts = dataclasses.replace(
                self.options,
                chunk_size=base.chunk_size,
                logits_budget_mb=base.logits_budget_mb,
                accum_dtype=base.accum_dtype,
            )
            shared_key = (kind, device_type, type(self), opts)
            try:
                fn = _SHARED_STEPS.get(shared_key)
            except TypeError:  # options with unhashable fields: this instance compiles its own
                shared_key = None
            if fn is None:
                fn = self._build_step(kind, opts, device_type)
                if shared_key is not None:
                    _SHARED_STEPS[shared_key] = fn
            self._compiled[key] = fn
        return fn

    def _build_step(self, kind: str, opts: FusedOptions, device_type: str):
        kernel = self._kernel_step(kind, opts, device_type)
        if kernel is not None:
            return kernel
        cls = type(self)
        if kind == "token":
            fn = _bind(_token_step, cls.chunk_loss, opts)
        elif kind == "token_value":
            fn = _bind(_token_value, cls.chunk_loss, opts)
        elif kind == "stats":
            fn = _bind(_stats_value, cls.token_stats, opts)
        elif kind == "seq_pass2":
            fn = _bind(_sequence_pass2_step, cls.token_stats, opts)
        elif kind == "seq_coef":
            # ``sequence_loss`` on a chunk's statistics is a few hundred tiny kernels (session 8's H100
            # profile of DPO+ref 8x1024: ~4.5 ms of idle GPU in an 80 ms step; ORPO 8x1024 ran 4% faster
            # compiled). Beside compiled "stats"/"seq_pass2" steps it runs eagerly, keeping the loss at two
            # graphs; Triton steps compile none, so beside them it is the loss's one compiled step.
            if self._kernel_step("stats", opts, device_type) is None:
                return functools.partial(_sequence_coef_eager, cls.sequence_loss, opts)
            return _SequenceDynamic(_bind(_sequence_coef, cls.sequence_loss, opts), cls.seqs_per_group)
        else:  # pragma: no cover
            raise KeyError(kind)
        if not opts.compile:
            return fn
        # Rows are marked dynamic per call; the vocabulary stays static so inductor picks reduction configs
        # for the real V (dynamic=True ran the logsumexp reduction at 0.4 TB/s on an H100).
        return _RowDynamic(fn)

    def run(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, batch: Batch) -> Tensor:
        """Run the chunk loop. ``hidden`` (N, H) is the flattened hidden state, ``batch.rows`` the
        rows that take part. Returns the loss (0-d, or (N,) for per-row outputs)."""
        metrics: dict[str, Tensor] = {}
        loss = _FusedLinearFunction.apply(hidden, weight, bias, self, batch, metrics)
        self.metrics = metrics
        return loss

    def chunk_rows(
        self,
        weight: Tensor,
        hidden: Tensor,
        extra: list[Head] = (),
        fp32_grad_w: bool = False,
        whole: int = 0,
    ) -> int:
        """Rows per chunk: ``chunk_size``, or as many as ``logits_budget_mb`` holds.

        With an fp32 weight-gradient accumulator (``fp32_grad_w``) the backward holds the accumulator and its
        cast to the weight's dtype at once, so a chunk whose logits take no more than that cast's V·H bytes
        leaves the step's peak where it is; the loss then takes that larger budget, with the logits of
        extra heads (a teacher) counted twice where the step makes an fp32 copy of them
        (``_step_upcasts_extra``). Larger chunks run the GEMMs
        faster (``benchmarks/chunk_sweep.py``, H200, all at 1.96 GiB beyond the gradients unless noted): CE
        at N=8192 39.4 ms at 1792 rows, 38.3 at 4096; GRPO dapo 2x16384 165.4 ms at 1792, 158.5 at 3072;
        JSD at N=8192 70.7 ms at 896, 66.7 at 1280 (2.20 GiB), 63.2 at 2048 (2.94 GiB, hence the fp32
        count). Sequence losses take it too: automatic chunks run them in two passes, each holding one
        [C, V] tensor (a no-grad projection reduced to per-row statistics, then a pointwise in-place step).

        ``whole``: the call's rows, when one chunk of them all would be the loop's only weight-gradient
        contribution (a token loss, or a sequence loss that then runs in one pass); 0 otherwise. One chunk
        needs no fp32 accumulator of a bf16/fp16 weight: on CUDA its GEMM writes the weight's dtype. So up to
        the rows whose logits take the accumulator's 4·V·H bytes, one chunk holds no more memory than chunks
        of the budget above plus the accumulator, and saves the accumulator's reads, writes and cast
        (``ONE_CHUNK_DEVICES``; on CPU that GEMM goes through fp32 copies of its operands: the rule is off).
        """
        opts = self.options
        if opts.chunk_size is not None:
            return opts.chunk_size
        if self.extra_token_stats is not None:
            # Each extra head's logits are reduced and freed before the next projection.
            extra_vocab = max([e.weight.shape[0] - weight.shape[0] for e in extra] + [0])
        else:
            extra_vocab = sum(e.weight.shape[0] for e in extra)
        budget = opts.logits_budget_mb
        v, itemsize = weight.shape[0], hidden.element_size()
        if fp32_grad_w and opts.compile:
            budget = max(budget, weight.numel() * weight.element_size() // 2**20)
            if self._step_upcasts_extra(hidden.device.type):
                extra_vocab *= 2
        rows = default_chunk_size(v, itemsize, budget, extra_vocab, grad_in_place=opts.compile)
        one_gemm = hidden.device.type in ONE_CHUNK_DEVICES and weight.dtype in (torch.bfloat16, torch.float16)
        if fp32_grad_w and opts.compile and one_gemm and whole > rows:
            acc_mb = weight.numel() * 4 // 2**20
            if whole <= default_chunk_size(v, itemsize, acc_mb, extra_vocab, grad_in_place=True):
                return whole
        return rows


# --------------------------------------------------------------------------------------------------
# Compiled per-chunk steps, by (kind, device type, loss class, options); see FusedLinearBase._step_fn.
_SHARED_STEPS: dict[tuple, object] = {}


def _bind(step, *bound):
    """``step`` with its leading arguments bound, as a function with a code object of its own.

    Dynamo keeps compiled graphs per code object (``torch.compile`` of a ``functools.partial`` compiles one
    wrapper shared by every partial), with a limit of 8 recompilations past which it runs the function
    eagerly and only logs a warning. With one code object for every loss, the ninth option set (or
    vocabulary, or dtype) in a process ran its chunk step eagerly, holding several fp32 copies of the
    logits: DPO at V=128256 took 11.8 GiB beyond the gradients instead of 1.96 on an H100.
    """

    def bound_step(*args):
        return step(*bound, *args)

    code = bound_step.__code__.replace()  # a new code object: a fresh compile cache
    return types.FunctionType(code, bound_step.__globals__, step.__name__, None, bound_step.__closure__)


# Per-chunk steps. Each returns (grad wrt logits or None, loss, metrics) and is what torch.compile sees.
def _token_step(chunk_loss, opts, logits, extra_logits, token, scalars):
    (g, (loss, metrics)) = torch.func.grad_and_value(
        lambda z: _with_aux(chunk_loss(z, extra_logits, token, scalars, opts)), has_aux=True
    )(logits)
    return _grad_out(g, logits, opts), loss, metrics


def _token_value(chunk_loss, opts, logits, extra_logits, token, scalars):
    loss, metrics = chunk_loss(logits, extra_logits, token, scalars, opts)
    return None, loss, metrics


def _stats_value(token_stats, opts, logits, extra_logits, token):
    return token_stats(logits, extra_logits, token, opts)


def _sequence_pass2_step(token_stats, opts, logits, extra_logits, token, coef):
    g = torch.func.grad(lambda z: (token_stats(z, extra_logits, token, opts) * coef).sum())(logits)
    return _grad_out(g, logits, opts)


# Sequence coefficient steps: ``sequence_loss`` on the rows' statistics of whole sequences. Each returns
# (dL/dstats or None, loss, metrics).
def _sequence_coef_eager(sequence_loss, opts, stats, seq_id, num_seqs, token, sequence, scalars, need_grad):
    with torch.enable_grad():
        stats = stats.detach().requires_grad_(need_grad)
        loss, metrics = sequence_loss(stats, seq_id, num_seqs, token, sequence, scalars, opts)
        coef = torch.autograd.grad(loss, stats, allow_unused=True)[0] if need_grad else None
    return coef, loss.detach(), {k: v.detach() for k, v in metrics.items()}


def _sequence_coef(sequence_loss, opts, stats, seq_id, groups, token, sequence, scalars):
    """``_sequence_coef_eager`` for torch.compile; ``groups`` (G, g, 0) carries the number of groups G and of
    sequences per group g, and the per-sequence tensors come as (G, g, ...) (see ``_SequenceDynamic``)."""
    num_seqs = groups.shape[0] * groups.shape[1]
    sequence = {k: v.flatten(0, 1) for k, v in sequence.items()}
    coef, (loss, metrics) = torch.func.grad_and_value(
        lambda s: _with_aux(sequence_loss(s, seq_id, num_seqs, token, sequence, scalars, opts)), has_aux=True
    )(stats)
    return coef, loss, metrics


def _grad_out(g, logits, opts):
    """The logits gradient in the logits' dtype; compiled, it overwrites the logits in place so inductor
    writes it straight into their buffer and a chunk costs one [C, V] buffer instead of two."""
    if opts.compile:
        logits.copy_(g)
        return logits
    return g.to(logits.dtype)


@functools.cache
def _backport_guard_location_str() -> None:
    """torch < 2.13 cannot print a shape guard without a source location (``SLoc.__str__`` calls
    ``format_frame(None)``): building the guards of a compiled step then fails with ``AttributeError:
    'NoneType' object has no attribute 'filename'`` (met on an H100 with torch 2.11 by the compiled "seq_coef"
    step of DPO and SimPO in one pass). Where ``str(SLoc(None, None))`` raises, ``SLoc.__str__`` becomes torch
    2.13's, which prints such a location as empty; a torch that prints it is left alone."""
    from torch._guards import SLoc

    try:
        str(SLoc(None, None))
        return
    except AttributeError:
        pass
    from torch.utils._traceback import format_frame

    def __str__(self) -> str:
        loc = self.framework_loc
        floc = loc if isinstance(loc, str) else "" if loc is None else format_frame(loc)
        return f"{self.maybe_user_loc} ({floc})" if self.maybe_user_loc is not None else f"({floc})"

    SLoc.__str__ = __str__


class _RowDynamic:
    """Calls a compiled step after marking dim 0 of every tensor argument dynamic, so chunks of any
    row count share one graph.

    A chunk of one row runs the step eagerly instead: dynamo specialises sizes 0 and 1, so it would
    compile a graph of its own (one more per step kind, which a batch with a single valid token or a
    rounding tail of one row meets), for a chunk whose eager cost is a few small kernels.

    If the compiler fails to build the step (``BackendCompilerFailed``: a bug of the backend, e.g. torch
    2.13's CPU inductor raising ``KeyError: 'buf9'`` in its outer-loop fusion for GRPO with both ``beta`` and
    ``entropy_coef``; or ``InternalTorchDynamoError``: a bug of dynamo, e.g. torch 2.11's guard builder
    raising ``AttributeError`` while formatting a shape guard without a source location, met on an H100 by
    the compiled "seq_coef" of DPO and SimPO in one pass and fixed in 2.13; or any other dynamo error, as
    the same torch raised for GRPO's entropy quantile there), the step runs eagerly from then on, with a
    warning: the same math, slower (an error of the inputs themselves is then raised by the eager step). A
    step writes the logits' gradient in place as its last operation, so a graph that fails to compile (that
    one or any before it) fails before anything was written over its inputs."""

    def __init__(self, fn):
        _backport_guard_location_str()
        self.eager = fn
        self.fn = torch.compile(fn)

    def __call__(self, logits, *args):
        if logits.shape[0] <= 1 or self.fn is None:
            return self.eager(logits, *args)
        for t in _tensors((logits, args)):
            if t.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            return self.fn(logits, *args)
        except torch._dynamo.exc.TorchDynamoException as exc:
            warnings.warn(
                f"chunkloss: torch.compile could not build a per-chunk step ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]}); this step runs eagerly from now on (same result, "
                "slower)",
                RuntimeWarning,
                stacklevel=2,
            )
            self.fn = None
            return self.eager(logits, *args)


class _SequenceDynamic(_RowDynamic):
    """The compiled sequence coefficient step, called as ``(stats, seq_id, num_seqs, token, sequence, scalars,
    need_grad=)`` like ``_sequence_coef_eager``.

    The number of sequences, a Python int that changes from chunk to chunk, reaches the graph as the sizes of
    an empty (G, g, 0) tensor: G groups of g sequences (S = G·g, g the loss's ``seqs_per_group``), G marked
    dynamic with the rows (as an int, dynamo would specialise its first value and compile another graph for
    the next); the per-sequence tensors come as (G, g, ...) too. S is then a multiple of g by construction,
    so the preference losses' (P, 2, K) view of the pairs needs no shape guard: with S as the symbol that
    view left guards such as ``Eq(Mod(s, (s//2)), 0)`` and, from its backward, ``Ne(s, (s//((s//2))))``,
    and torch 2.11's guard builder failed on a shape guard without a source location (DPO and SimPO in one
    pass, on an H100). One sequence runs eagerly, as one row does (dynamo specialises size 1); the
    preference losses still compile a second graph for chunks of one pair (G = 1 specialises). Without
    ``need_grad`` the same graph runs and its gradient is dropped: a value-only graph would be one more per
    loss."""

    def __init__(self, fn, seqs_per_group: int = 1):
        super().__init__(fn)
        self.seqs_per_group = seqs_per_group

    def __call__(self, stats, seq_id, num_seqs, token, sequence, scalars, need_grad):
        g = self.seqs_per_group
        n_groups, rest = divmod(num_seqs, g)
        if rest:
            raise ValueError(f"{num_seqs} sequences are not whole groups of {g}")
        groups = stats.new_empty(n_groups, g, 0)
        sequence = {k: v.unflatten(0, (n_groups, g)) for k, v in sequence.items()}
        args = (stats, seq_id, groups, token, sequence, scalars)
        coef, loss, metrics = self.eager(*args) if num_seqs <= 1 else super().__call__(*args)
        return coef if need_grad else None, loss, metrics


def _tensors(obj):
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _with_aux(out):
    loss, metrics = out
    return loss, {k: v.detach() for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """Chunk boundaries over ``batch.rows`` and, for one-pass sequence losses, the sequences each
    chunk holds."""

    bounds: list[tuple[int, int]]
    seq_bounds: list[tuple[int, int]] | None = None  # sequences [s0, s1) of each chunk


def _one_pass_possible(loss: FusedLinearBase, batch: Batch) -> bool:
    """Whether the loss can run in one pass given chunks that hold whole groups: a token loss always; a
    sequence loss when it needs no batch-wide statistics first and the batch carries its group sizes."""
    if not loss.is_sequence_loss:
        return True
    return not (loss.needs_global_stats or batch.tokens_per_group is None or batch.seqs_per_group is None)


def _plan_chunks(loss: FusedLinearBase, batch: Batch, n_rows: int, chunk: int) -> tuple[_Plan, bool]:
    """Chunk boundaries, and whether a sequence loss runs in one pass."""
    if not loss.is_sequence_loss:
        return _Plan(_even_bounds(n_rows, chunk)), True
    counts = batch.tokens_per_group
    # One pass needs every group whole in a chunk. It saves the second projection (3 GEMMs instead of 4),
    # which outweighs the smaller chunks that group-aligned packing can leave: per row, an H100 ran the
    # 3 GEMMs of a 1024-row chunk faster than the 4 of a 4096-row one (H=4096, V=128256).
    seqs_per_group = batch.seqs_per_group
    if not _one_pass_possible(loss, batch) or n_rows == 0 or max(counts) > chunk:
        return _Plan(_even_bounds(n_rows, chunk)), False
    # Pack whole groups greedily; each chunk ends on a group boundary.
    bounds, seq_bounds = [], []
    r0 = r = s0 = s = 0
    for n_tok, n_seq in zip(counts, seqs_per_group):
        if r + n_tok - r0 > chunk:
            bounds.append((r0, r))
            seq_bounds.append((s0, s))
            r0, s0 = r, s
        r += n_tok
        s += n_seq
    bounds.append((r0, r))
    seq_bounds.append((s0, s))
    return _Plan(bounds, seq_bounds), True


def _even_bounds(n_rows: int, chunk: int) -> list[tuple[int, int]]:
    """At most ``chunk`` rows per chunk, in as few chunks as possible, of nearly equal size (multiples of
    128 where the chunk allows it) rather than full chunks and a small tail that runs the GEMMs badly."""
    if n_rows == 0:
        return []
    n_chunks = -(-n_rows // chunk)
    size = -(-n_rows // n_chunks)
    if chunk >= 128:
        size = min(chunk, -(-size // 128) * 128)
    return [(s, min(s + size, n_rows)) for s in range(0, n_rows, size)]


def _slice_rows(d: dict[str, Tensor], a: int, b: int) -> dict[str, Tensor]:
    return {k: v[a:b] for k, v in d.items()}


class _FusedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, loss_mod: FusedLinearBase, batch: Batch, metrics_out: dict):
        grad_enabled = torch.is_grad_enabled() or any(ctx.needs_input_grad[:3])
        need = (
            grad_enabled and ctx.needs_input_grad[0],
            grad_enabled and ctx.needs_input_grad[1],
            grad_enabled and bias is not None and ctx.needs_input_grad[2],
        )
        per_row = ctx.per_row = bool(loss_mod.token_outputs)
        if per_row:
            # reduction='none': the forward only evaluates; backward reruns the loop with the
            # per-row grad_output as the rows' weights (the stored-gradient trick needs a scalar).
            per_row_out, _, _, metric_sums = _run_loop(loss_mod, hidden, weight, bias, batch, (False,) * 3)
            ctx.loss_mod, ctx.batch, ctx.need = loss_mod, batch, need
            ctx.save_for_backward(hidden, weight, bias)
            metrics_out.update(metric_sums)
            return per_row_out
        loss, grads, _, metric_sums = _run_loop(loss_mod, hidden, weight, bias, batch, need)
        ctx.save_for_backward(*grads)
        metrics_out.update(metric_sums)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.per_row:
            hidden, weight, bias = ctx.saved_tensors
            batch = dataclasses.replace(
                ctx.batch, token={**ctx.batch.token, "grad_scale": grad_output.reshape(-1)[ctx.batch.rows]}
            )
            _, grads, _, _ = _run_loop(ctx.loss_mod, hidden, weight, bias, batch, ctx.need)
            return (*grads, None, None, None)
        if getattr(ctx, "consumed", False):
            raise RuntimeError(
                "chunkloss computes the gradients in forward and scales them in place in backward; "
                "backward through the same loss twice (retain_graph=True) is not supported"
            )
        ctx.consumed = True
        grad_h, grad_w, grad_b = ctx.saved_tensors if ctx.saved_tensors else (None, None, None)
        # In place: the stored gradients belong to this call alone, and a copy would double their memory.
        return (
            _scale_grad(grad_h, grad_output),
            _scale_grad(grad_w, grad_output),
            _scale_grad(grad_b, grad_output),
            None,
            None,
            None,
        )


def _scale_grad(grad: Tensor | None, grad_output: Tensor) -> Tensor | None:
    """``grad · grad_output`` in place, bit for bit ``grad.mul_(grad_output.to(grad.dtype))``. With
    weight-dtype gradients of an fp32 accumulator this rounds twice when ``grad_output`` is not a power of two
    (≤ 1 ulp of the weight's dtype more); at 1 it is exact.

    ``grad_output`` is almost always exactly 1 (``loss.backward()``), yet ``mul_`` would read and write the
    whole gradient (1 GB for a bf16 128256 x 4096 head). On CUDA ``chunkloss.kernels.scale`` reads
    ``grad_output`` on the device and its programs return at once when it is 1, with no host sync; NaN or inf
    still multiply. Elsewhere this is ``mul_`` (Triton is imported only on CUDA)."""
    if grad is None:
        return None
    if grad.is_cuda:
        from chunkloss.kernels.scale import scale_

        return scale_(grad, grad_output)
    return grad.mul_(grad_output.to(grad.dtype))


def _run_loop(loss_mod: FusedLinearBase, hidden, weight, bias, batch: Batch, need):
    """The chunk loop. Returns (loss, (grad_hidden, grad_weight, grad_bias), per-row outputs, metrics), the
    gradients in their inputs' dtypes."""
    opts = loss_mod.options
    n_rows = batch.rows.numel()
    need_h, need_w, need_b = need
    any_grad = need_h or need_w or need_b
    accum = opts.accum_dtype or weight.dtype
    # Every row is written when all rows take part; otherwise dropped rows keep a zero gradient.
    new_grad_h = torch.empty if batch.all_rows else torch.zeros
    grad_h = new_grad_h(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
    grad_w = _WeightGrad(weight, accum) if need_w else None
    grad_b = torch.zeros(bias.shape, dtype=accum, device=bias.device) if need_b else None
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    metrics: dict[str, Tensor] = {}
    token_out = (
        {
            k: torch.zeros(batch.num_rows, dtype=torch.float32, device=hidden.device)
            for k in loss_mod.token_outputs
        }
        if loss_mod.token_outputs
        else {}
    )
    # Where one pass is possible, one chunk of every row runs in one pass (``_plan_chunks``) and is the loop's
    # only weight-gradient contribution; two passes may contribute twice.
    chunk = loss_mod.chunk_rows(
        weight,
        hidden,
        batch.extra,
        fp32_grad_w=need_w and accum == torch.float32,
        whole=n_rows if _one_pass_possible(loss_mod, batch) else 0,
    )
    dev = hidden.device.type
    plan, one_pass = _plan_chunks(loss_mod, batch, n_rows, chunk)
    # Rows in natural order with nothing dropped: chunks are slices (rows=None), no gather/scatter copies.
    # Otherwise ``rows`` holds the flattened hidden's row of each position, and chunk [a, b) gathers them.
    rows_all = None if batch.all_rows else batch.rows

    def gather(h: Tensor, rows: Tensor | None, a: int, b: int) -> Tensor:
        return h[a:b] if rows is None else h.index_select(0, rows[a:b])

    reduce_extra = loss_mod.extra_token_stats is not None and bool(batch.extra)
    extra_stats_parts: list[Tensor] = []

    def project(rows, a, b, token, extra_stats=None):
        """(x, logits, extra_logits, token) of positions [a, b); the extra heads are reduced first when the
        loss can, or their statistics from the first pass come in as ``extra_stats`` (no projection)."""
        if reduce_extra:
            if extra_stats is None:
                extra_logits = [_project(gather(e.hidden, rows, a, b), e.weight, e.bias) for e in batch.extra]
                extra_stats_parts.append(loss_mod.extra_token_stats(extra_logits, token, opts))
                del extra_logits
                token = {**token, "extra_stats": extra_stats_parts[-1]}
            else:
                token = {**token, "extra_stats": extra_stats[a:b]}
            extra = []
        else:
            extra = [_project(gather(e.hidden, rows, a, b), e.weight, e.bias) for e in batch.extra]
        x = gather(hidden, rows, a, b)
        return x, _project(x, weight, bias), extra, token

    def backprop(g, x, rows, a, b, add=False, last=False):
        """Gradients of positions [a, b) from their logits gradient ``g``; ``add``: onto the hidden rows'
        gradient from pass 1 rather than over it; ``last``: the loop's last weight-gradient contribution."""
        if need_h:
            if rows is None:
                if add:
                    grad_h[a:b].addmm_(g, weight)
                else:
                    torch.mm(g, weight, out=grad_h[a:b])
            elif add:
                grad_h.index_add_(0, rows[a:b], g @ weight)
            else:
                grad_h.index_copy_(0, rows[a:b], g @ weight)
        if need_w:
            grad_w.add(g, x, last)
        if need_b:
            grad_b.add_(g.sum(0, dtype=accum))

    def sequence_coef(stats, seq_id, num_seqs, token, sequence, scalars=batch.scalars):
        """Run ``sequence_loss`` on the rows' statistics (adding its loss and metrics) and return
        ``dL/dstats``, the per-row coefficient the pointwise step pulls back to the logits (None without
        grads)."""
        coef, l_c, m = loss_mod._step_fn("seq_coef", dev)(
            stats, seq_id, num_seqs, token, sequence, scalars, need_grad=any_grad
        )
        loss.add_(l_c)
        add_metrics(m)
        return coef

    def one_pass_chunk(a, b, token, coef_of, last=False):
        """Positions [a, b) in one pass: project, the "stats" step, the coefficient ``coef_of(stats, token)``
        (None without grads), and the "seq_pass2" step on the same logits with what the stats step carried
        over (e.g. their logsumexp); returns the chunk's statistics. ``last``: as for ``backprop``."""
        x, logits, extra, token = project(rows_all, a, b, token)
        stats, carry = _stats_and_carry(loss_mod._step_fn("stats", dev)(logits, extra, token))
        coef = coef_of(stats, token)
        if coef is not None:
            args = (coef,) if carry is None else (coef, carry)
            g = loss_mod._step_fn("seq_pass2", dev)(logits, extra, token, *args)
            backprop(g, x, rows_all, a, b, last=last)
        del x, logits, extra, carry  # free this chunk's [C, V] buffer before the next is projected
        return stats

    def add_metrics(m):
        for k, v in m.items():
            if k in token_out:
                continue
            metrics[k] = metrics[k] + v.float() if k in metrics else v.float()

    with torch.no_grad():
        if not loss_mod.is_sequence_loss:
            step = loss_mod._step_fn("token" if any_grad else "token_value", dev)
            for a, b in plan.bounds:
                x, logits, extra, token = project(rows_all, a, b, _slice_rows(batch.token, a, b))
                g, l_c, m = step(logits, extra, token, batch.scalars)
                loss += l_c
                add_metrics(m)
                for k in token_out:
                    token_out[k].index_copy_(0, batch.rows[a:b], m[k].float())
                if any_grad:
                    backprop(g, x, rows_all, a, b, last=b == n_rows)
                del x, logits, extra, g  # free this chunk's [C, V] buffer before the next is projected
        elif one_pass:
            for (a, b), (s0, s1) in zip(plan.bounds, plan.seq_bounds):
                one_pass_chunk(
                    a, b, _slice_rows(batch.token, a, b),
                    lambda stats, token, a=a, b=b, s0=s0, s1=s1: sequence_coef(
                        stats, batch.seq_id[a:b] - s0, s1 - s0, token, _slice_rows(batch.sequence, s0, s1)
                    ),
                    last=b == n_rows,
                )  # fmt: skip
        else:
            stats_fn, step = loss_mod._step_fn("stats", dev), loss_mod._step_fn("seq_pass2", dev)
            # Either every chunk runs its backward in pass 1 with estimated scalars (``pass_1_estimates``), or
            # the last rows [n_rest, n_rows) do with coefficient m·e_col (``rows_in_pass_1``) and pass 2
            # covers rows [0, n_rest) only.
            estimate = loss_mod.pass_1_estimates(batch) if any_grad else None
            deferred = loss_mod.rows_in_pass_1(batch) if any_grad and estimate is None else None
            col, n_def, mult = deferred if deferred is not None else (None, 0, None)
            n_rest = n_rows - n_def
            parts = []
            guess_bounds = _even_bounds(n_rows, chunk) if estimate is not None else []
            guesses = []  # pass 1's coefficients of those chunks

            for a, b in guess_bounds:

                def guess(stats, token, a=a, b=b):
                    """``dL/dstats`` of positions [a, b) from ``sequence_loss`` on them alone with the scalars
                    estimated from the statistics so far (the per-row tensors without the extra heads' reduced
                    statistics, as in the final call below: one step, one graph)."""
                    token = {k: v for k, v in token.items() if k != "extra_stats"}
                    scalars = {**batch.scalars, **estimate([*parts, stats])}
                    guesses.append(
                        loss_mod._step_fn("seq_coef", dev)(
                            stats, batch.seq_id[a:b], batch.num_seqs, token, batch.sequence, scalars,
                            need_grad=True,
                        )[0]
                    )  # fmt: skip
                    return guesses[-1]

                parts.append(one_pass_chunk(a, b, _slice_rows(batch.token, a, b), guess))
            for a, b in _even_bounds(n_rest, chunk) if estimate is None else []:
                _, logits, extra, token = project(rows_all, a, b, _slice_rows(batch.token, a, b))
                parts.append(_stats_and_carry(stats_fn(logits, extra, token))[0])  # no carry: other logits
                del logits, extra
            # Its per-row tensors start at offset 0, as pass 2's do: a compiled step specialises on it.
            token_def = {k: v[n_rest:].clone() for k, v in batch.token.items()} if n_def else {}
            for a, b in _even_bounds(n_def, chunk):

                def unit(stats, token, a=a, b=b):
                    coef = torch.zeros_like(stats)
                    coef[:, col] = mult[a:b]
                    return coef

                parts.append(one_pass_chunk(n_rest + a, n_rest + b, _slice_rows(token_def, a, b), unit))
            stats = torch.cat(parts) if parts else _empty_stats(loss_mod, hidden, weight, batch)
            extra_stats = torch.cat(extra_stats_parts) if extra_stats_parts else None
            # With guesses, the final scalars (the ones ``sequence_loss`` computes) go in too: the same step
            # and graph as the guesses, so a row whose coefficient did not change gets the guess bit for bit
            # (coefficients are per row) and pass 2 projects only the changed rows.
            scalars = {**batch.scalars, **estimate(parts)} if guesses else batch.scalars
            coef = sequence_coef(stats, batch.seq_id, batch.num_seqs, batch.token, batch.sequence, scalars)
            if guesses:
                coef = coef - torch.cat(guesses)
            if coef is not None and n_def:
                # Each deferred row's coefficient is λ·m·e_col: its gradients so far are λ = 1's.
                lam = coef[n_rows - 1, col] / mult[-1]
                _scale_rows(grad_h, rows_all, n_rest, n_rows, lam)
                if need_w:
                    grad_w.scale(lam)
                if need_b:
                    grad_b.mul_(lam)
                coef = coef[:n_rest]
                extra_stats = None if extra_stats is None else extra_stats[:n_rest]
            if coef is not None and n_rest:  # none left when the last rows were all of them (one long pair)
                rows, token_all = rows_all, batch.token
                # Pass 2 re-projects only the rows with a gradient: a row whose coefficients are all 0 (an
                # entropy mask keeping the top 20% of tokens drops the other 80%) contributes exactly 0.
                idx = coef.ne(0).any(1).nonzero().squeeze(1)  # the one host sync of the second pass
                n_live = idx.numel()
                add = bool(guesses)  # pass 2 adds the coefficients' change to pass 1's gradients
                if n_live < n_rest:
                    rows, coef = batch.rows[idx], coef[idx]
                    token_all = {k: v[idx] for k, v in batch.token.items()}
                    extra_stats = None if extra_stats is None else extra_stats[idx]
                    if need_h and batch.all_rows and not add:
                        grad_h[:n_rest].zero_()  # the skipped rows are not written
                for a, b in _even_bounds(n_live, chunk):
                    # Heads without grad are not projected again: their reduced statistics from pass 1
                    # come in as token["extra_stats"].
                    x, logits, extra, token = project(rows, a, b, _slice_rows(token_all, a, b), extra_stats)
                    backprop(step(logits, extra, token, coef[a:b]), x, rows, a, b, add, last=b == n_live)
                    del x, logits, extra  # free this chunk's [C, V] buffer before the next is projected

    # The gradients leave in the parameters' dtype: an fp32 accumulator would otherwise stay alive, at twice
    # the size, from here until the backward reaches the head, i.e. across the model's activation peak.
    grad_w = grad_w.finish() if need_w else None
    grad_b = grad_b.to(bias.dtype) if need_b else None
    out = next(iter(token_out.values())) if token_out else loss
    return out, (grad_h, grad_w, grad_b), token_out, metrics


def _scale_rows(grad_h: Tensor | None, rows: Tensor | None, a: int, b: int, lam: Tensor) -> None:
    """``grad_h`` of positions [a, b) (hidden rows ``rows[a:b]``, or rows a..b with ``rows`` None) times λ."""
    if grad_h is None or a == b:
        return
    if rows is None:
        grad_h[a:b].mul_(lam)
    else:
        r = rows[a:b]
        grad_h.index_copy_(0, r, grad_h.index_select(0, r).mul_(lam))


def _stats_and_carry(out) -> tuple[Tensor, object]:
    """A "stats" step returns the rows' statistics, or ``(statistics, carry)``: ``carry`` is handed to the
    "seq_pass2" step of the same chunk in one pass, on the same logits (two passes drop it)."""
    return out if isinstance(out, tuple) else (out, None)


def _empty_stats(loss_mod, hidden, weight, batch) -> Tensor:
    """Statistics of zero rows, with the loss's own width (evaluated on a 1-row dummy)."""
    dummy = torch.zeros(1, weight.shape[0], dtype=torch.float32, device=hidden.device)
    extra = [
        torch.zeros(1, e.weight.shape[0], dtype=torch.float32, device=hidden.device) for e in batch.extra
    ]
    token = {k: v.new_zeros((1, *v.shape[1:])) for k, v in batch.token.items()}
    if loss_mod.extra_token_stats is not None and extra:
        token["extra_stats"] = type(loss_mod).extra_token_stats(extra, token, loss_mod.options)
        extra = []
    width = type(loss_mod).token_stats(dummy, extra, token, loss_mod.options).shape[1]
    return torch.zeros(0, width, dtype=torch.float32, device=hidden.device)
