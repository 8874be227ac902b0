"""The contract a loss author implements: the per-chunk math of a loss and the few class attributes the engine
reads. :class:`~chunkloss.engine.FusedLinearBase` is this contract on an ``nn.Module``; the chunk loop
(``plan``, ``steps``, ``loop``) reads a loss only through it.

A loss over the LM head ``logits = hidden @ weight.T (+ bias)`` never holds the full ``[N, V]`` logits: the
engine projects them chunk by chunk, asks the loss's per-chunk math for the chunk's loss and ``dL/dlogits``,
turns that into the gradients of ``hidden``, ``weight`` and ``bias`` with two more GEMMs, and drops the
logits (``chunkloss.engine.loop``). A loss provides the per-chunk math as pure functions of tensors and its
options, in one of two forms:

* a **token loss** defines ``chunk_loss``: the chunk's loss, a sum over its rows already divided by the
  global normalisers (passed in ``scalars``), and its metrics;
* a **sequence loss** defines ``token_stats`` (a few differentiable numbers per row, e.g. the label
  log-prob) and ``sequence_loss`` (the loss from those numbers, grouped by sequence).

Its ``forward`` checks the inputs, picks the rows that take part, builds a :class:`~chunkloss.engine.Batch`
(``sequence_batch`` for a sequence loss) and calls ``FusedLinearBase.run``. Autograd, chunking, one or two
passes, compilation and the weight-gradient accumulator are the engine's.

The engine checks the contract where a mistake would otherwise surface deep inside it or not at all: the
per-chunk functions are static methods (at class definition), they return ``(loss, metrics)`` (every call,
:func:`loss_and_metrics`), and their loss and metrics add up over rows (each loss class's first call,
:func:`check_chunk_loss` and :func:`check_sequence_loss`).
"""

from __future__ import annotations

import inspect
import os
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from chunkloss.engine.batch import Batch, Rows, Sequences
from chunkloss.engine.options import FusedOptions

__all__ = [
    "CHECK_EVERY_CALL_ENV",
    "LossContract",
    "check_chunk_loss",
    "check_due",
    "check_sequence_loss",
    "loss_and_metrics",
]

#: The per-chunk functions a loss defines as static methods, and the arguments the engine calls them with.
_STATIC = {
    "chunk_loss": "logits, extra_logits, token, scalars, opts",
    "token_stats": "logits, extra_logits, token, opts",
    "sequence_loss": "stats, seq_id, num_seqs, token, sequence, scalars, opts",
    "extra_token_stats": "extra_logits, token, opts",
}


class LossContract:
    """What a chunked loss provides the engine.

    A subclass sets ``options_cls`` (a frozen :class:`~chunkloss.engine.FusedOptions` subclass) and defines
    either :meth:`chunk_loss` (a token loss) or :meth:`token_stats` and :meth:`sequence_loss` (a sequence
    loss) as static methods. The per-chunk functions must be pure functions of their tensors and ``opts``: the
    engine differentiates them with ``torch.func`` and compiles them. Their row tensors hold only the rows
    that take part, in chunk order; a row of one call may land in any chunk.
    """

    options_cls: type[FusedOptions] = FusedOptions
    #: The instance's options (an ``options_cls``).
    options: FusedOptions
    #: The arguments of ``forward`` that are a linear head's tensors (hidden states, weight, bias; a tensor
    #: or a sequence of tensors): cast to the autocast dtype under ``torch.autocast``, as ``nn.Linear``'s
    #: operands would be. The other arguments (labels, masks, log-probs) are left as they are.
    head_args: tuple[str, ...] = ("hidden", "weight", "bias")
    #: Sequence losses: the loss needs statistics of the whole batch (always two passes).
    needs_global_stats: bool = False
    #: Token losses: names of per-row outputs in ``chunk_loss``'s metrics (``("loss",)`` for
    #: reduction='none'). With one, the module returns that metric per row, shape (N,), 0 for rows that take
    #: no part, and the engine computes the backward itself as the gradient of ``Σ_i grad_output_i·out_i``:
    #: ``chunk_loss`` need not know about ``grad_output``.
    token_outputs: tuple[str, ...] = ()
    #: Sequence losses: every group holds exactly this many sequences (2: the preference losses' pairs), so a
    #: batch or chunk of S sequences holds S / ``seqs_per_group`` groups.
    seqs_per_group: int = 1
    #: Optional ``extra_token_stats(extra_logits, token, opts) -> (N_c, K)``: reduce the no-grad heads'
    #: logits to a few numbers per row (e.g. the reference log-prob) right after they are projected, so they
    #: are freed before the policy's logits exist; the loss then reads ``token.extra_stats`` and gets
    #: ``extra_logits == []``. Losses that need whole extra distributions (JSD) leave it None. It runs
    #: uncompiled and so must not build [C, V] temporaries (``chunkloss.losses.common.nograd_label_logprob``
    #: reads the logits once).
    extra_token_stats = None
    #: After each call: the per-chunk ``metrics`` summed over the chunks, by name. ``forward`` turns them into
    #: the user's ``metrics`` (by default the same), e.g. per-sequence vectors into their minimum.
    chunk_sums: dict[str, Tensor]

    def __init_subclass__(cls, **kwargs):
        """A per-chunk function defined as a plain method (``@staticmethod`` forgotten) is refused here: the
        engine calls it without ``self``."""
        super().__init_subclass__(**kwargs)
        for name, args in _STATIC.items():
            value = cls.__dict__.get(name)
            if inspect.isfunction(value) or isinstance(value, classmethod):
                raise TypeError(
                    f"{cls.__name__}.{name} must be a @staticmethod: the engine calls it as {name}({args}), "
                    "without self"
                )

    @staticmethod
    def chunk_loss(logits, extra_logits, token, scalars, opts):  # pragma: no cover - interface
        """Token losses: the loss and metrics of one chunk.

        Args:
            logits: (C, V) the chunk's logits in the head's dtype (differentiated: do not modify).
            extra_logits: list of (C, V_e) logits of the heads without grad (``Batch.extra``), or ``[]``.
            token: the loss's :class:`~chunkloss.engine.Rows` (``Batch.token``) of the chunk's rows, (C, ...).
            scalars: ``Batch.scalars``, the loss's tensors of the whole batch (e.g. the normaliser).
            opts: the loss's options.

        Returns:
            ``(loss, metrics)``: ``loss`` a 0-d fp32 tensor, the chunk's share of the total (a sum over rows
            divided by global normalisers, so the chunks' losses add up to the loss); ``metrics`` a dict of
            tensors by name, summed over chunks into :attr:`chunk_sums` (0-d, or vectors of a fixed size such
            as per-sequence sums), plus the (C,) per-row outputs named in ``token_outputs``.
        """
        raise NotImplementedError

    @staticmethod
    def token_stats(logits, extra_logits, token, opts):  # pragma: no cover - interface
        """Sequence losses: differentiable per-row statistics of one chunk.

        Args: as :meth:`chunk_loss`'s, without ``scalars``. Heads without grad reach it through
        ``token.extra_stats`` when the loss defines ``extra_token_stats``.

        Returns:
            (C, K) fp32 tensor (K fixed by the loss). A Triton ``STATS`` step may return ``(stats, carry)``:
            in one pass ``carry`` reaches the ``SEQ_PASS2`` step of the same chunk as a last argument.
        """
        raise NotImplementedError

    @staticmethod
    def sequence_loss(stats, seq_id, num_seqs, token, sequence, scalars, opts):  # pragma: no cover
        """Sequence losses: the loss of whole sequences from their rows' statistics.

        Args:
            stats: (R, K) :meth:`token_stats` of the rows of ``num_seqs`` whole sequences.
            seq_id: (R,) int64 sequence of each row in ``[0, num_seqs)``, sequences in group order
                (``segment_sum(stats, seq_id, num_seqs)`` gives per-sequence sums).
            num_seqs: S, a multiple of ``seqs_per_group`` (a Python int).
            token: the loss's :class:`~chunkloss.engine.Rows` of these rows, (R, ...).
            sequence: the loss's :class:`~chunkloss.engine.Sequences` of these sequences, (S, ...).
            scalars: ``Batch.scalars``.
            opts: the loss's options.

        Returns:
            ``(loss, metrics)`` as :meth:`chunk_loss`'s: the share of these sequences, adding up over calls.
            It is called on the sequences of one chunk (one pass) or of the whole batch (two passes).
        """
        raise NotImplementedError

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
        pass 2 projects only the rows whose coefficient changed, adding the difference (the logits gradient
        is linear in the coefficient). None (the default): rows wait for pass 2 (or ``rows_in_pass_1``).
        """
        return None

    @property
    def is_sequence_loss(self) -> bool:
        """Run ``token_stats`` + ``sequence_loss`` rather than ``chunk_loss``. By default: the class
        defines ``sequence_loss``; a loss with both forms (GRPO) decides from its options."""
        return type(self).sequence_loss is not LossContract.sequence_loss


# --------------------------------------------------------------------------------------------------
# Checks of the contract.
def loss_and_metrics(out, fn: Callable | str) -> tuple[Tensor, dict[str, Tensor]]:
    """``(loss, metrics)`` as ``chunk_loss`` or ``sequence_loss`` (``fn``, or its name for the message)
    returned them, checked: a 0-d loss and a dict of tensors. Python checks only (no host sync); under
    ``torch.compile`` they run while tracing."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict)):
        got = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise TypeError(
            f"{_name(fn)} must return (loss, metrics): a 0-d loss and a dict of tensors by name ({{}} for "
            f"none), got {got}"
        )
    loss, metrics = out
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise TypeError(
            f"{_name(fn)} must return a 0-d loss (a sum over the rows divided by batch-wide normalisers), "
            f"got {got}"
        )
    for key, value in metrics.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"{_name(fn)}'s metric {key!r} must be a tensor, got {type(value).__name__}")
    return loss, metrics


def _name(fn: Callable | str) -> str:
    if isinstance(fn, str):
        return fn
    name = getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__name__", "the loss")
    return name.rsplit("<locals>.", 1)[-1]


#: Set (to anything but 0) to check every call of every loss; by default each loss class is checked once.
CHECK_EVERY_CALL_ENV = "CHUNKLOSS_CHECK_EVERY_CALL"
#: The loss classes whose loss was found to add up over rows.
_CHECKED: weakref.WeakSet = weakref.WeakSet()
#: Rows of the first chunk that :func:`check_chunk_loss` evaluates ``chunk_loss`` on.
CHECK_ROWS = 8
#: ``|L(rows twice) - 2·L(rows)|`` above this fraction of ``|2·L(rows)|`` fails a check. A mean over the rows
#: gives 1/2; a sum rounded in bf16 stays under 1/100.
CHECK_RTOL = 0.25


def check_due(loss: LossContract) -> bool:
    """Whether this call checks that the loss adds up over rows: the first call of each loss class (until
    one check has run), or every call where ``CHUNKLOSS_CHECK_EVERY_CALL`` is set; never while
    ``torch.compile`` traces the caller (a check syncs once)."""
    if torch.compiler.is_compiling():
        return False
    return type(loss) not in _CHECKED or os.environ.get(CHECK_EVERY_CALL_ENV, "0") not in ("", "0")


def check_chunk_loss(loss: LossContract, logits: Tensor, extra_logits: list, token: Rows, scalars) -> None:
    """Raise unless ``chunk_loss`` adds up over rows: evaluated eagerly on the chunk's first rows (at most
    :data:`CHECK_ROWS`) taken once and taken twice, the loss and every metric but the ``token_outputs``
    must double. A sum over the rows divided by batch-wide normalisers does; a mean over the chunk's rows
    stays the same, and would make the loss depend on the chunk size. One host sync."""
    m = min(logits.shape[0], CHECK_ROWS)
    if m == 0:
        return
    fn, opts = type(loss).chunk_loss, loss.options

    def twice(t: Tensor) -> Tensor:
        return torch.cat([t[:m], t[:m]])

    once = fn(logits[:m], [e[:m] for e in extra_logits], token[:m], scalars, opts)
    both = fn(twice(logits), [twice(e) for e in extra_logits], token.map(twice), scalars, opts)
    name = f"{type(loss).__name__}.chunk_loss"
    once, both = loss_and_metrics(once, name), loss_and_metrics(both, name)
    for key in loss.token_outputs:
        out = once[1].get(key)
        if out is None or out.shape != (m,):
            got = "none" if out is None else f"shape {tuple(out.shape)}"
            raise ValueError(
                f"{name} must return the per-row output {key!r} (named in token_outputs) in its metrics, "
                f"one value per row: ({m},) on {m} rows, got {got}"
            )
    _check_doubles(loss, once, both, (name, "the chunk's rows", f"{m} rows"))


def check_sequence_loss(
    loss: LossContract, stats, seq_id, num_seqs: int, token: Rows, sequence: Sequences, scalars
) -> None:
    """:func:`check_chunk_loss` for ``sequence_loss``: on the sequences given and on them taken twice (the
    second copy numbered after the first), the loss and metrics must double. Skipped for a loss that
    ``needs_global_stats`` (it sees the whole batch at once). One host sync."""
    if loss.needs_global_stats or num_seqs == 0:
        return
    fn, opts = type(loss).sequence_loss, loss.options

    def twice(t: Tensor) -> Tensor:
        return torch.cat([t, t])

    once = fn(stats, seq_id, num_seqs, token, sequence, scalars, opts)
    seq_ids = torch.cat([seq_id, seq_id + num_seqs])
    both = fn(twice(stats), seq_ids, 2 * num_seqs, token.map(twice), sequence.map(twice), scalars, opts)
    name = f"{type(loss).__name__}.sequence_loss"
    once, both = loss_and_metrics(once, name), loss_and_metrics(both, name)
    _check_doubles(loss, once, both, (name, "its sequences", f"{num_seqs} sequences"))


def _check_doubles(loss: LossContract, once, both, where: tuple[str, str, str]) -> None:
    """Raise unless ``both``'s loss and metrics (the rows taken twice) are twice ``once``'s."""
    fn_name, over, counted = where
    names, pairs = ["loss"], [(once[0], both[0])]
    for key, value in once[1].items():
        if key in loss.token_outputs:
            continue
        other = both[1].get(key)
        if other is None or other.shape != value.shape:
            got = "none" if other is None else f"shape {tuple(other.shape)}"
            raise ValueError(
                f"{fn_name}'s metric {key!r} has shape {tuple(value.shape)} on {counted} but {got} on twice "
                "as many: metrics have a fixed shape (a per-row output is named in token_outputs)"
            )
        names.append(key)
        pairs.append((value, other))
    rows = []
    for a, b in pairs:
        a, b = a.detach().float(), b.detach().float()
        bad = ((b - 2 * a).abs() > CHECK_RTOL * (2 * a).abs()).any()
        rows.append(torch.stack([bad.float(), a.sum(), b.sum()]))
    flags = torch.stack(rows).tolist()  # the check's one host sync
    for name, (bad, a, b) in zip(names, flags):
        if bad:
            what = fn_name if name == "loss" else f"{fn_name}'s metric {name!r}"
            raise ValueError(
                f"{what} must return a sum over {over} divided by batch-wide normalisers, not a mean: on "
                f"{counted} it gave {a:.6g}, on the same taken twice {b:.6g} rather than {2 * a:.6g} (divide "
                "by a count computed once for the batch and passed in scalars)"
            )
    _CHECKED.add(type(loss))
