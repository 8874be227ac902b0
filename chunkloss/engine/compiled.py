"""How a per-chunk step is compiled: a code object of its own per loss (:func:`bind`), rows marked dynamic
(:class:`RowDynamic`), the number of sequences as a dynamic size (:class:`SequenceDynamic`), an eager
fallback when the compiler fails, and a workaround for a torch < 2.13 guard printer, active only inside
those calls (:func:`chunkloss._compat.torch.guard_location_fix`). Why each: docs/design.md, "Compiled
steps"."""

from __future__ import annotations

import dataclasses
import types
import warnings

import torch
from torch import Tensor

from chunkloss._compat import torch as torch_compat

__all__ = ["RowDynamic", "SequenceDynamic", "bind"]


def bind(step, *bound):
    """``step`` with its leading arguments bound, as a function with a code object of its own.

    Dynamo keeps compiled graphs per code object (``torch.compile`` of a ``functools.partial`` compiles one
    wrapper shared by every partial), with a limit of 8 recompilations past which it runs the function
    eagerly and only logs a warning. With one code object per (loss class, options, step kind), a process
    that runs many losses never reaches that limit.
    """

    def bound_step(*args):
        return step(*bound, *args)

    code = bound_step.__code__.replace()  # a new code object: a fresh compile cache
    return types.FunctionType(code, bound_step.__globals__, step.__name__, None, bound_step.__closure__)


class RowDynamic:
    """Calls a compiled step after marking dim 0 of every tensor argument dynamic, so chunks of any
    row count share one graph.

    A chunk of one row runs the step eagerly instead: dynamo specialises sizes 0 and 1, so it would
    compile a graph of its own for a chunk whose eager cost is a few small kernels.

    If the compiler fails to build the step (``BackendCompilerFailed``: a bug of the backend, e.g. torch
    2.13's CPU inductor raising ``KeyError: 'buf9'`` in its outer-loop fusion for GRPO with both ``beta`` and
    ``entropy_coef``; ``InternalTorchDynamoError`` or any other dynamo error), the step runs eagerly from
    then on, with a warning: the same math, slower (an error of the inputs themselves is then raised by the
    eager step). A step writes the logits' gradient in place as its last operation, so a graph that fails to
    compile (that one or any before it) fails before anything was written over its inputs.
    """

    def __init__(self, fn):
        self.eager = fn
        self.fn = torch.compile(fn)

    def __call__(self, logits, *args):
        if logits.shape[0] <= 1 or self.fn is None:
            return self.eager(logits, *args)
        for t in _tensors((logits, args)):
            if t.dim() > 0:
                torch_compat.mark_rows_dynamic(t)
        try:
            with torch_compat.guard_location_fix():
                return self.fn(logits, *args)
        except torch_compat.dynamo_error() as exc:
            warnings.warn(
                f"chunkloss: torch.compile could not build a per-chunk step ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]}); this step runs eagerly from now on (same result, "
                "slower)",
                RuntimeWarning,
                stacklevel=2,
            )
            self.fn = None
            return self.eager(logits, *args)


class SequenceDynamic(RowDynamic):
    """The compiled sequence coefficient step, called as ``(stats, seq_id, num_seqs, token, sequence, scalars,
    need_grad=)`` like ``steps.sequence_coef_eager``.

    The number of sequences, a Python int that changes from chunk to chunk, reaches the graph as the sizes of
    an empty (G, g, 0) tensor: G groups of g sequences (S = G·g, g the loss's ``seqs_per_group``), G marked
    dynamic with the rows (as an int, dynamo would specialise its first value and compile another graph for
    the next); the per-sequence tensors come as (G, g, ...) too. S is then a multiple of g by construction,
    so the preference losses' (P, 2, K) view of the pairs needs no shape guard on S. One sequence runs
    eagerly, as one row does (dynamo specialises size 1); the preference losses still compile a second graph
    for chunks of one pair (G = 1 specialises). Without ``need_grad`` the same graph runs and its gradient is
    dropped: a value-only graph would be one more per loss.
    """

    def __init__(self, fn, seqs_per_group: int = 1):
        super().__init__(fn)
        self.seqs_per_group = seqs_per_group

    def __call__(self, stats, seq_id, num_seqs, token, sequence, scalars, need_grad):
        g = self.seqs_per_group
        n_groups, rest = divmod(num_seqs, g)
        if rest:
            raise ValueError(f"{num_seqs} sequences are not whole groups of {g}")
        groups = stats.new_empty(n_groups, g, 0)
        sequence = sequence.map(lambda v: v.unflatten(0, (n_groups, g)))
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
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
