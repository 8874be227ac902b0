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
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from chunkloss.engine.batch import Batch
from chunkloss.engine.options import FusedOptions

__all__ = ["LossContract"]


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
