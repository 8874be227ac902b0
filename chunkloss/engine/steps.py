"""The per-chunk steps: what each step kind computes from a loss's math, how it is built (compiled, eager, or
a Triton step a loss registered for CUDA), and the cache that shares built steps between instances.

Every step is a function of one chunk's tensors; the chunk loop (``chunkloss.engine.loop``) calls them:

==================  =========================================================  ============================
kind                arguments                                                  returns
==================  =========================================================  ============================
``TOKEN``           ``logits, extra_logits, token, scalars``                   ``(dL/dlogits, loss, metrics)``
``TOKEN_VALUE``     ``logits, extra_logits, token, scalars``                   ``(None, loss, metrics)``
``TOKEN_ROWS``      ``logits, extra_logits, token, scalars, row_weight``       ``d(Σ_i w_i·out_i)/dlogits``
``STATS``           ``logits, extra_logits, token``                            ``stats`` or ``(stats, carry)``
``SEQ_PASS2``       ``logits, extra_logits, token, coef[, carry]``             ``d(Σ stats·coef)/dlogits``
``SEQ_COEF``        ``stats, seq_id, num_seqs, token, sequence, scalars,``     ``(dL/dstats, loss, metrics)``
                    ``need_grad``
==================  =========================================================  ============================

``dL/dlogits`` has the logits' dtype and, when compiled, is written over the logits (one [C, V] buffer per
chunk). ``out_i`` of ``TOKEN_ROWS`` is the loss's per-row output ``metrics[token_outputs[0]]``.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Collection, Mapping
from enum import Enum

import torch

from chunkloss.engine.compiled import RowDynamic, SequenceDynamic, bind
from chunkloss.engine.contract import LossContract, loss_and_metrics
from chunkloss.engine.options import FusedOptions

__all__ = [
    "StepCache",
    "StepKind",
    "build_step",
    "gpu_step",
    "register_gpu_steps",
    "step_cache",
    "step_for",
    "step_upcasts_extra",
    "use_step_cache",
]


class StepKind(str, Enum):
    """The per-chunk steps the loop runs (a ``str``: ``StepKind.TOKEN == "token"``)."""

    #: token loss: ``chunk_loss`` and its gradient over the logits.
    TOKEN = "token"
    #: token loss without grads: ``chunk_loss``'s value and metrics.
    TOKEN_VALUE = "token_value"
    #: token loss with a per-row output (reduction='none'), backward: the gradient of the per-row output
    #: weighted by ``grad_output``.
    TOKEN_ROWS = "token_rows"
    #: sequence loss: ``token_stats`` of the chunk's rows, without grad.
    STATS = "stats"
    #: sequence loss: the gradient over the logits of ``Σ token_stats · coef`` (``coef = dL/dstats``).
    SEQ_PASS2 = "seq_pass2"
    #: sequence loss: ``sequence_loss`` on the rows' statistics of whole sequences, and ``dL/dstats``.
    SEQ_COEF = "seq_coef"


# --------------------------------------------------------------------------------------------------
# The steps' math. Each is what torch.compile sees (bound to a loss's functions and options by ``bind``).
def _token_step(chunk_loss, opts, logits, extra_logits, token, scalars):
    (g, (loss, metrics)) = torch.func.grad_and_value(
        lambda z: _with_aux(chunk_loss(z, extra_logits, token, scalars, opts), chunk_loss), has_aux=True
    )(logits)
    return _grad_out(g, logits, opts), loss, metrics


def _token_value(chunk_loss, opts, logits, extra_logits, token, scalars):
    loss, metrics = loss_and_metrics(chunk_loss(logits, extra_logits, token, scalars, opts), chunk_loss)
    return None, loss, metrics


def _token_rows_step(chunk_loss, output, opts, logits, extra_logits, token, scalars, row_weight):
    def weighted(z):
        metrics = loss_and_metrics(chunk_loss(z, extra_logits, token, scalars, opts), chunk_loss)[1]
        return (metrics[output] * row_weight).sum()

    g = torch.func.grad(weighted)(logits)
    return _grad_out(g, logits, opts)


def _stats_value(token_stats, opts, logits, extra_logits, token):
    return token_stats(logits, extra_logits, token, opts)


def _sequence_pass2_step(token_stats, opts, logits, extra_logits, token, coef):
    g = torch.func.grad(lambda z: (token_stats(z, extra_logits, token, opts) * coef).sum())(logits)
    return _grad_out(g, logits, opts)


def sequence_coef_eager(sequence_loss, opts, stats, seq_id, num_seqs, token, sequence, scalars, need_grad):
    """``sequence_loss`` and ``dL/dstats`` (None without ``need_grad``) by eager autograd."""
    with torch.enable_grad():
        stats = stats.detach().requires_grad_(need_grad)
        out = sequence_loss(stats, seq_id, num_seqs, token, sequence, scalars, opts)
        loss, metrics = loss_and_metrics(out, sequence_loss)
        coef = torch.autograd.grad(loss, stats, allow_unused=True)[0] if need_grad else None
    return coef, loss.detach(), {k: v.detach() for k, v in metrics.items()}


def _sequence_coef(sequence_loss, opts, stats, seq_id, groups, token, sequence, scalars):
    """:func:`sequence_coef_eager` for torch.compile; ``groups`` (G, g, 0) carries the number of groups G and
    of sequences per group g, and the per-sequence tensors come as (G, g, ...) (see ``SequenceDynamic``)."""
    num_seqs = groups.shape[0] * groups.shape[1]
    sequence = sequence.map(lambda v: v.flatten(0, 1))

    def loss_of(s):
        return _with_aux(sequence_loss(s, seq_id, num_seqs, token, sequence, scalars, opts), sequence_loss)

    coef, (loss, metrics) = torch.func.grad_and_value(loss_of, has_aux=True)(stats)
    return coef, loss, metrics


def _grad_out(g, logits, opts):
    """The logits gradient in the logits' dtype; compiled, it overwrites the logits in place so inductor
    writes it straight into their buffer and a chunk costs one [C, V] buffer instead of two."""
    if opts.compile:
        logits.copy_(g)
        return logits
    return g.to(logits.dtype)


def _with_aux(out, fn):
    loss, metrics = loss_and_metrics(out, fn)
    return loss, {k: v.detach() for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------------
# Triton steps registered for CUDA, by loss class.
@dataclasses.dataclass(frozen=True)
class _GpuSteps:
    steps: Mapping[StepKind, Callable]
    math: tuple[str, ...]


_GPU_STEPS: dict[type, _GpuSteps] = {}


def register_gpu_steps(
    loss_cls: type, steps: Mapping[StepKind | str, Callable], math: tuple[str, ...]
) -> None:
    """Run ``steps`` instead of the compiled steps of ``loss_cls`` on CUDA when ``compile`` is on.

    Args:
        loss_cls: a :class:`~chunkloss.engine.FusedLinearBase` subclass (a registration is inherited).
        steps: by step kind, ``fn(opts, *step_args)`` with the arguments and result of that kind (module
            docstring); kinds left out stay compiled.
        math: names of the class attributes whose functions the steps compute (``"chunk_loss"``,
            ``"token_stats"``, ...). A subclass that replaces one of them keeps the compiled steps (the
            kernels would compute its parent's loss); a subclass registered itself gets its own steps only.
    """
    _GPU_STEPS[loss_cls] = _GpuSteps({StepKind(k): fn for k, fn in steps.items()}, tuple(math))


def gpu_step(loss_cls: type, kind: StepKind, opts: FusedOptions, device_type: str):
    """The registered Triton step of ``kind`` for ``loss_cls`` on ``device_type``, or None."""
    if device_type != "cuda" or not opts.compile:
        return None
    owner = next((c for c in loss_cls.__mro__ if c in _GPU_STEPS), None)
    if owner is None:
        return None
    entry = _GPU_STEPS[owner]
    fn = entry.steps.get(kind)
    if fn is None or any(getattr(loss_cls, name) is not getattr(owner, name) for name in entry.math):
        return None
    return functools.partial(fn, opts)


def step_upcasts_extra(loss: LossContract, device_type: str) -> bool:
    """Whether the ``TOKEN`` step holds an fp32 copy of the extra heads' logits: the compiled step does
    (inductor upcasts bf16 inputs of a reduction), a Triton step reads them in place."""
    return gpu_step(type(loss), StepKind.TOKEN, loss.options, device_type) is None


# --------------------------------------------------------------------------------------------------
# Built steps, and which steps are built.
class StepCache:
    """The steps built so far, and how steps are built: as for their tensors' device (the process's cache,
    :func:`step_cache`), or as a cache made with other settings asks while it is current
    (:func:`use_step_cache`; ``chunkloss.testing.select_steps`` makes one for a ``with`` block).

    Attributes:
        device_type: the device type the steps are built for, whatever their tensors' device (``None``: the
            tensors' own).
        kinds: the step kinds ``device_type`` applies to (``None``: every kind).
        eager_seq_coef: ``SEQ_COEF`` runs :func:`sequence_coef_eager`, never a compiled graph.
        built: the built steps, by (kind, device type, loss class, per-row outputs, options), shared by every
            loss instance with those (a compiled graph is built once).
        by_loss: each loss instance's steps by (kind, device type): skips the options' hashing on later calls.
    """

    def __init__(
        self,
        device_type: str | None = None,
        kinds: Collection[StepKind | str] | None = None,
        eager_seq_coef: bool = False,
    ):
        self.device_type = device_type
        self.kinds = None if kinds is None else frozenset(StepKind(k) for k in kinds)
        self.eager_seq_coef = eager_seq_coef
        self.built: dict[tuple, object] = {}
        self.by_loss: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def device_for(self, kind: StepKind, device_type: str) -> str:
        if self.device_type is None or (self.kinds is not None and kind not in self.kinds):
            return device_type
        return self.device_type


_cache = StepCache()


def step_cache() -> StepCache:
    """The current :class:`StepCache`: the one steps are looked up in and built into."""
    return _cache


def use_step_cache(cache: StepCache) -> StepCache:
    """Make ``cache`` the current one and return the one it replaces (to be put back)."""
    global _cache
    outer, _cache = _cache, cache
    return outer


def step_for(loss: LossContract, kind: StepKind | str, device_type: str):
    """The step of ``kind`` for ``loss`` on tensors of ``device_type``, built once per loss class, options
    (those the step reads) and device type, and shared by every instance with those (a compiled graph is built
    once)."""
    kind = StepKind(kind)
    cache = _cache
    device_type = cache.device_for(kind, device_type)
    own = cache.by_loss.setdefault(loss, {})
    fn = own.get((kind, device_type))
    if fn is not None:
        return fn
    # The engine's own fields do not enter the step: losses differing only there share it.
    base = FusedOptions
    opts = dataclasses.replace(
        loss.options,
        chunk_size=base.chunk_size,
        logits_budget_mb=base.logits_budget_mb,
        accum_dtype=base.accum_dtype,
    )
    shared_key = (kind, device_type, type(loss), loss.token_outputs, opts)
    try:
        fn = cache.built.get(shared_key)
    except TypeError:  # options with unhashable fields: this instance builds its own
        shared_key = None
    if fn is None:
        if kind is StepKind.SEQ_COEF and cache.eager_seq_coef:
            fn = functools.partial(sequence_coef_eager, type(loss).sequence_loss, opts)
        else:
            fn = build_step(loss, kind, opts, device_type)
        if shared_key is not None:
            cache.built[shared_key] = fn
    own[(kind, device_type)] = fn
    return fn


def build_step(loss: LossContract, kind: StepKind, opts: FusedOptions, device_type: str):
    """The step of ``kind``: the loss's registered Triton step on CUDA, else its math bound by :func:`bind`,
    under :class:`RowDynamic` when ``opts.compile``. ``SEQ_COEF`` runs eagerly beside compiled ``STATS``/
    ``SEQ_PASS2`` steps (a loss keeps two graphs) and compiled beside Triton ones (docs/design.md)."""
    kind = StepKind(kind)
    cls = type(loss)
    kernel = gpu_step(cls, kind, opts, device_type)
    if kernel is not None:
        return kernel
    if kind is StepKind.SEQ_COEF:
        if gpu_step(cls, StepKind.STATS, opts, device_type) is None:
            return functools.partial(sequence_coef_eager, cls.sequence_loss, opts)
        return SequenceDynamic(bind(_sequence_coef, cls.sequence_loss, opts), cls.seqs_per_group)
    if kind is StepKind.TOKEN:
        fn = bind(_token_step, cls.chunk_loss, opts)
    elif kind is StepKind.TOKEN_VALUE:
        fn = bind(_token_value, cls.chunk_loss, opts)
    elif kind is StepKind.TOKEN_ROWS:
        fn = bind(_token_rows_step, cls.chunk_loss, loss.token_outputs[0], opts)
    elif kind is StepKind.STATS:
        fn = bind(_stats_value, cls.token_stats, opts)
    else:
        fn = bind(_sequence_pass2_step, cls.token_stats, opts)
    # Rows are marked dynamic per call; the vocabulary stays static so inductor picks reduction configs
    # for the real V.
    return RowDynamic(fn) if opts.compile else fn
