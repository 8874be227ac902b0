"""Shared base of the chunked preference losses (DPO, ORPO, SimPO, CPO).

Inputs follow TRL's concatenated layout: ``hidden`` (2B, T, H) holds the chosen rows followed by the
rejected rows; ``chosen`` and ``rejected`` (B, T) are the (already shifted) labels of those rows, with
``ignore_index`` on prompt and padding. The rows that take part are projected chunk by chunk over the
B·T tokens (never whole pairs at a time, so memory does not grow with T). Per row the base keeps a
few statistics (fp32)::

    logp       w_t · log p(y_t)            w_t = 1 on completion tokens (DPO's ld_alpha: α past the
                                           shorter completion of the pair), 0 elsewhere
    logp_raw   m_t · log p(y_t)            m_t = 1 on completion tokens
    nll        n_t · log p(y'_t)           NLL targets y' of the chosen rows (ORPO, CPO), n_t their mask
    ref_logp   w_t · log p_ref(y_t)        reference head, no grad
    mean_logit l_t · mean_v z_tv           no grad (the ``logits/*`` metrics; l_t = m_t, or the rows
                                           given as ``logit_rows``)
    wpo        m_t · (log p(y_t) - log Σ_v p_v²)   no grad (WPO weights, DPO only)
    entropy    m_t · H(p_t)                no grad (``return_token_metrics``)
    top1       m_t · [argmax_v z_tv = y_t]  no grad (``return_token_metrics``)

The logits are the model's: ``z = scale(hidden @ weight.T + bias)`` with ``logit_scale`` (Cohere)
then ``softcap·tanh(z/softcap)`` (Gemma-2), for the policy and the reference head alike.

Per sequence these are summed (``segment_sum``); a subclass turns the pair sums into a per-pair loss
with ``pair_loss``. The loss is ``Σ_pairs pair_loss / B + nll_coef · NLL``, NLL being the mean over
the NLL targets of the chosen rows (``torch.nn.CrossEntropyLoss`` as TRL's ORPO/CPO take it).

When a chosen/rejected pair's valid tokens fit in one chunk the engine runs one pass with chunks
aligned to pairs; otherwise (long sequences) it takes two passes, so the chunk stays a fixed number
of tokens whatever T is. On CUDA (with ``compile=True``) the statistics and the pass-2 gradient come from the
Triton row kernels of ``chunkloss.kernels.logprob`` instead of compiled graphs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from chunkloss.engine import (
    ExtraHead,
    FusedLinearBase,
    FusedOptions,
    Rows,
    Sequences,
    StepKind,
    register_gpu_steps,
    segment_sum,
    sequence_batch,
)
from chunkloss.losses.common import (
    RowStats,
    check_head,
    check_head_transforms,
    check_labels,
    check_positive,
    kernel_row_statistics,
    nograd_label_logprob,
    row_statistics,
    saved_statistics,
    to_scalar,
)

__all__ = [
    "FusedLinearPreferenceLoss",
    "Pairs",
    "PreferenceOptions",
    "PreferenceRows",
    "PreferenceScalars",
    "PreferenceSequences",
]

# Columns of the per-row statistics.
LOGP, LOGP_RAW, NLL, REF_LOGP, MEAN_LOGIT, WPO, ENTROPY, TOP1 = range(8)


@dataclass
class PreferenceRows(Rows):
    """Per row of the chosen then rejected sequences (the module docstring's ``w_t``, ``m_t``, ``n_t``,
    ``l_t``)."""

    labels: Tensor  # (N,) int64 completion labels (0 where ignored)
    pref_mask: Tensor  # (N,) m_t: 1 on completion tokens
    pref_weight: Tensor  # (N,) w_t: the token's weight in the sequence log-prob
    logit_mask: Tensor  # (N,) l_t: 1 on the rows averaged into the ``logits/*`` metrics
    nll_labels: Tensor | None = None  # (N,) y'_t, the NLL targets of the chosen rows (ORPO, CPO)
    nll_mask: Tensor | None = None  # (N,) n_t: 1 where y'_t is a target


@dataclass
class PreferenceSequences(Sequences):
    """Per sequence (chosen, rejected of each pair)."""

    n_tokens: Tensor  # (S,) completion tokens
    ref_logps: Tensor | None = None  # (S,) precomputed reference log-probs, instead of a reference head


@dataclass
class PreferenceScalars:
    """The batch's normalisers (each at least 1)."""

    n_pairs: Tensor
    n_chosen_tokens: Tensor
    n_rejected_tokens: Tensor
    n_tokens: Tensor
    n_chosen_logit_rows: Tensor
    n_rejected_logit_rows: Tensor
    n_nll_tokens: Tensor | None = None  # with an NLL term


@dataclass
class Pairs:
    """What ``pair_loss`` receives: (P,) tensors per pair."""

    chosen: Tensor  # policy sequence log-probs, summed or averaged per ``opts.avg_logps``
    rejected: Tensor
    ref_chosen: Tensor  # the reference's (0 without a reference)
    ref_rejected: Tensor
    n_chosen: Tensor  # completion tokens
    n_rejected: Tensor
    raw_chosen: Tensor  # unweighted chosen log-prob sum
    wpo_chosen: Tensor  # WPO statistics (0 unless ``opts.wpo``)
    wpo_rejected: Tensor
    valid: Tensor  # bool: both completions non-empty


@dataclass(frozen=True)
class PreferenceOptions(FusedOptions):
    """Args:
    ignore_index: label value of prompt and padding tokens (their rows cost no GEMM).
    beta: the loss's β.
    logit_scale: the logits are multiplied by it (Cohere's ``logit_scale``).
    softcap: final logit softcapping ``c·tanh(z/c)`` after the scale (Gemma-2's
        ``final_logit_softcapping``); ``None`` for off.
    return_token_metrics: also report TRL DPOTrainer's ``entropy`` (mean over the chosen and
        rejected completion tokens) and ``mean_token_accuracy`` (top-1 over the chosen completion
        tokens); one more reduction over V per row.
    """

    ignore_index: int = -100
    beta: float = 0.1
    logit_scale: float = 1.0
    softcap: float | None = None
    return_token_metrics: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_positive("beta", self.beta)
        check_head_transforms(self)

    @property
    def avg_logps(self) -> bool:
        """Sequence log-prob is the mean over completion tokens (True) or their sum (False)."""
        return False

    @property
    def nll_coef(self) -> float:
        """Weight of the NLL term over the chosen rows."""
        return 0.0

    @property
    def wpo(self) -> bool:
        """Compute the WPO statistic (an extra logsumexp over V per row)."""
        return False


def preference_ref_stats(extra_logits, token, opts: PreferenceOptions) -> Tensor:
    """The reference head's weighted label log-prob per row (C, 1), reduced as soon as it is projected."""
    ref_lp = nograd_label_logprob(extra_logits[0], token.labels, opts.logit_scale, opts.softcap)
    return (ref_lp * token.pref_weight).unsqueeze(1)


def _row_request(token, opts: PreferenceOptions) -> dict:
    """What the statistics below read of a row (``row_statistics`` arguments)."""
    return dict(
        labels2=token.nll_labels,
        logit_scale=opts.logit_scale,
        softcap=opts.softcap,
        lse=True,  # for WPO, and for the CUDA pass-2 step when it runs on the same logits
        lse2=opts.wpo,
        mean=True,
        entropy=opts.return_token_metrics,
        argmax=opts.return_token_metrics,
    )


def _columns(rows: RowStats, token, opts: PreferenceOptions) -> Tensor:
    """The (C, 8) statistics of the module docstring from the rows' ``row_statistics``."""
    lp = rows.logp
    m, w = token.pref_mask, token.pref_weight
    zero = torch.zeros_like(lp)
    nll = rows.logp2 * token.nll_mask if token.nll_labels is not None else zero
    ref = token.extra_stats[:, 0] if token.extra_stats is not None else zero
    mean_logit = (rows.mean * token.logit_mask).detach()
    # log Σ_v p_v² = logsumexp(2z) - 2·lse
    wpo = ((lp - (rows.lse2 - 2 * rows.lse)) * m).detach() if opts.wpo else zero
    if opts.return_token_metrics:
        ent = rows.entropy.detach() * m
        # argmax takes the first maximum: TRL's is_top1 (the label is the first maximal logit).
        top1 = (rows.argmax == token.labels).float() * m
    else:
        ent = top1 = zero
    return torch.stack([lp * w, lp * m, nll, ref, mean_logit, wpo, ent, top1], dim=1)


def preference_token_stats(logits, extra_logits, token: PreferenceRows, opts: PreferenceOptions) -> Tensor:
    """Per-row statistics (C, 8) of one chunk; columns as in the module docstring."""
    return _columns(row_statistics(logits, token.labels, **_row_request(token, opts)), token, opts)


def preference_sequence_loss(
    pair_loss,
    stats,
    seq_id,
    num_seqs,
    token: PreferenceRows,
    sequence: PreferenceSequences,
    scalars: PreferenceScalars,
    opts,
):
    """Loss of whole pairs from their rows' statistics: ``Σ pair_loss / B + nll_coef·NLL``.

    Sequences come ordered [c0, r0, c1, r1, ...] (``sequence_batch`` groups each pair), so the
    per-sequence sums reshape to (P, 2, K).
    """
    s = segment_sum(stats, seq_id, num_seqs).view(-1, 2, stats.shape[1])
    n_tok = sequence.n_tokens.view(-1, 2)
    logps = s[:, :, LOGP]
    if opts.avg_logps:
        logps = logps / n_tok.clamp(min=1)
    if sequence.ref_logps is not None:
        ref = sequence.ref_logps.view(-1, 2)
    else:
        ref = s[:, :, REF_LOGP]
        if opts.avg_logps:
            ref = ref / n_tok.clamp(min=1)
    pair = Pairs(
        chosen=logps[:, 0],
        rejected=logps[:, 1],
        ref_chosen=ref[:, 0],
        ref_rejected=ref[:, 1],
        n_chosen=n_tok[:, 0],
        n_rejected=n_tok[:, 1],
        raw_chosen=s[:, 0, LOGP_RAW],
        wpo_chosen=s[:, 0, WPO],
        wpo_rejected=s[:, 1, WPO],
        valid=(n_tok[:, 0] > 0) & (n_tok[:, 1] > 0),
    )
    per_pair, reward_c, reward_r, extra = pair_loss(pair, scalars, opts)
    n_pairs = scalars.n_pairs
    loss = per_pair.sum() / n_pairs
    reward_c, reward_r = reward_c.detach(), reward_r.detach()
    metrics = {
        "rewards/chosen": reward_c.sum() / n_pairs,
        "rewards/rejected": reward_r.sum() / n_pairs,
        "rewards/accuracies": (reward_c > reward_r).float().sum() / n_pairs,
        "rewards/margins": (reward_c - reward_r).sum() / n_pairs,
        "logps/chosen": pair.chosen.detach().sum() / n_pairs,
        "logps/rejected": pair.rejected.detach().sum() / n_pairs,
        "logits/chosen": s[:, 0, MEAN_LOGIT].sum() / scalars.n_chosen_logit_rows,
        "logits/rejected": s[:, 1, MEAN_LOGIT].sum() / scalars.n_rejected_logit_rows,
    }
    if opts.return_token_metrics:
        metrics["entropy"] = s[:, :, ENTROPY].sum() / scalars.n_tokens
        metrics["mean_token_accuracy"] = s[:, 0, TOP1].sum() / scalars.n_chosen_tokens
    if token.nll_labels is not None:
        nll = -s[:, 0, NLL].sum() / scalars.n_nll_tokens
        metrics["nll_loss"] = nll.detach()
        loss = loss + opts.nll_coef * nll
    metrics.update({k: v.detach().sum() / n_pairs for k, v in extra.items()})
    return loss, metrics


class FusedLinearPreferenceLoss(FusedLinearBase):
    """Base of the paired preference losses. A subclass sets ``options_cls`` and defines::

        @staticmethod
        def pair_loss(pair: Pairs, scalars: PreferenceScalars, opts) -> (per_pair_loss, reward_chosen,
                                                                          reward_rejected, metrics)

    where ``pair`` holds (P,) tensors (:class:`Pairs`); ``metrics`` are (P,) tensors averaged over pairs
    under their names.
    """

    options_cls = PreferenceOptions
    options: PreferenceOptions
    head_args = ("hidden", "weight", "bias", "ref_hidden", "ref_weight", "ref_bias")
    seqs_per_group = 2  # a chosen/rejected pair
    token_stats = staticmethod(preference_token_stats)
    extra_token_stats = staticmethod(preference_ref_stats)
    #: ``rows_in_pass_1`` holds for this class's own statistics and sequence loss; a subclass with a
    #: ``token_stats`` or ``sequence_loss`` of its own (not from ``pair_loss``) loses it unless it sets it
    #: again.
    own_math_rows_in_pass_1: bool = True
    #: the loss takes a reference (model head or precomputed log-probs).
    uses_reference: bool = False
    #: the loss has an NLL term over the chosen rows that may take its own targets.
    uses_nll: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "pair_loss" in cls.__dict__:
            cls.sequence_loss = staticmethod(functools.partial(preference_sequence_loss, cls.pair_loss))
        own_math = "token_stats" in cls.__dict__ or (
            "sequence_loss" in cls.__dict__ and "pair_loss" not in cls.__dict__
        )
        if own_math and "own_math_rows_in_pass_1" not in cls.__dict__:
            cls.own_math_rows_in_pass_1 = False

    @staticmethod
    def pair_loss(pair, scalars, opts):  # pragma: no cover - interface
        raise NotImplementedError

    @staticmethod
    def margin_power(opts) -> int | None:
        """``p`` when ``pair_loss`` depends on the pair's summed log-probs S only through the margin
        ``S_c/n_c^p - S_r/n_r^p`` (n: completion tokens, at least 1), i.e. ``dL/dS_c = λ·n_c^-p`` and
        ``dL/dS_r = -λ·n_r^-p`` for one λ; None otherwise (the default)."""
        return None

    def rows_in_pass_1(self, batch):
        """The last pair's rows when its loss is a function of its margin (``margin_power``): multipliers
        ``n_c^-p`` on the chosen rows and ``-n_r^-p`` on the rejected ones. Otherwise the last sequence's rows
        (the last pair's rejected one, which reaches the loss through ``pair.rejected`` alone; its NLL and
        raw log-prob columns are not read), multiplier 1. See ``FusedLinearBase.rows_in_pass_1``."""
        if not self.own_math_rows_in_pass_1 or not batch.tokens_per_group:
            return None
        p = type(self).margin_power(self.options)
        if p is None or batch.seqs_per_group[-1] != 2:
            n = batch.last_seq_rows
            return LOGP, n, torch.ones(n, device=batch.rows.device)
        n = batch.tokens_per_group[-1]
        n_tok = batch.sequence.n_tokens[-2:].float().clamp(min=1.0)
        per_seq = torch.stack([n_tok[0] ** -p, -(n_tok[1] ** -p)])
        return LOGP, n, per_seq[batch.seq_id[-n:] - (batch.num_seqs - 2)] if n else per_seq[:0]

    def token_weights(self, chosen_mask: Tensor, rejected_mask: Tensor) -> Tensor:
        """Weights (2B, T) of each completion token in the sequence log-prob (DPO's ld_alpha)."""
        return torch.cat([chosen_mask, rejected_mask]).float()

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        chosen: Tensor,
        rejected: Tensor,
        *,
        bias: Tensor | None = None,
        nll_labels: Tensor | None = None,
        ref_hidden: Tensor | None = None,
        ref_weight: Tensor | None = None,
        ref_bias: Tensor | None = None,
        ref_chosen_logps: Tensor | None = None,
        ref_rejected_logps: Tensor | None = None,
        logit_rows: Tensor | None = None,
    ) -> Tensor:
        """Args:
            hidden: (2B, T, H) the chosen rows, then the rejected rows.
            weight: (V, H) the head's weight.
            chosen: (B, T) labels of the chosen rows, already shifted; ``ignore_index`` on prompt and padding.
            rejected: (B, T) labels of the rejected rows.
            bias: (V,) the head's bias, or ``None``.
            nll_labels: (B, T) targets of the NLL term over the chosen rows (ORPO, CPO); default ``chosen``.
            ref_hidden, ref_weight, ref_bias: (2B, T, H_ref), (V, H_ref), (V,): the reference model's head,
                projected without grad in the same pass (losses with a reference: DPO).
            ref_chosen_logps, ref_rejected_logps: (B,) precomputed reference sequence log-probs, instead of
                a reference head.
            logit_rows: (2B, T) bool, the rows averaged into the ``logits/*`` metrics; default the
                completion tokens.

        Returns:
            The 0-d loss.
        """
        check_head(hidden, weight, bias)
        if hidden.dim() != 3 or hidden.shape[0] % 2:
            raise ValueError(
                "hidden must be (2B, T, H), the chosen rows then the rejected rows, "
                f"got {tuple(hidden.shape)}"
            )
        label_checks = self._check_labels(hidden, weight.shape[0], chosen, rejected, nll_labels)
        has_ref_head = ref_hidden is not None or ref_weight is not None or ref_bias is not None
        has_ref_logps = ref_chosen_logps is not None or ref_rejected_logps is not None
        if (has_ref_head or has_ref_logps) and not self.uses_reference:
            raise ValueError(f"{type(self).__name__} takes no reference: ref_* arguments must be None")
        if has_ref_head and has_ref_logps:
            raise ValueError("give the reference either as ref_hidden/ref_weight or as ref_*_logps, not both")
        extra = _reference_head(hidden, weight, ref_hidden, ref_weight, ref_bias) if has_ref_head else []
        ref_logps = _reference_logps(hidden, ref_chosen_logps, ref_rejected_logps) if has_ref_logps else None
        keep, token, sequence, scalars = self._rows(chosen, rejected, nll_labels, logit_rows, ref_logps)
        n_pairs = hidden.shape[0] // 2
        group = torch.arange(2 * n_pairs, device=hidden.device) % max(n_pairs, 1)
        batch, _ = sequence_batch(
            keep,
            group,
            token=token,
            sequence=sequence,
            scalars=scalars,
            extra=extra,
            host_checks=label_checks,
        )
        return self.run(hidden.reshape(-1, hidden.shape[-1]), weight, bias, batch)

    def _check_labels(self, hidden, vocab: int, chosen, rejected, nll_labels) -> list:
        """Check the label tensors; their range checks are deferred to ``sequence_batch``'s one host sync
        (raising there, before any use)."""
        opts = self.options
        label_checks = []
        shape = torch.Size((hidden.shape[0] // 2, hidden.shape[1]))
        dev = hidden.device
        check_labels(chosen, shape, vocab, opts.ignore_index, "chosen", defer=label_checks, device=dev)
        check_labels(rejected, shape, vocab, opts.ignore_index, "rejected", defer=label_checks, device=dev)
        if nll_labels is not None:
            if not (self.uses_nll and opts.nll_coef != 0):
                raise ValueError(
                    f"{type(self).__name__} has no NLL term with these options: nll_labels must be None"
                )
            check_labels(
                nll_labels, shape, vocab, opts.ignore_index, "nll_labels", defer=label_checks, device=dev
            )
        return label_checks

    def _rows(self, chosen, rejected, nll_labels, logit_rows, ref_logps):
        """The rows that take part (2B, T), their per-row tensors (2B, T), the per-sequence tensors (2B,) and
        the batch's normalisers."""
        opts = self.options
        n_pairs, t = chosen.shape
        dev = chosen.device
        labels = torch.cat([chosen, rejected]).long()  # (2B, T)
        pref_mask = labels != opts.ignore_index
        keep = pref_mask
        nll = nll_mask = n_nll_tokens = None
        if self.uses_nll and opts.nll_coef != 0:
            nll = (chosen if nll_labels is None else nll_labels).long()
            nll = torch.cat([nll, torch.full_like(nll, opts.ignore_index)])
            nll_mask = nll != opts.ignore_index
            keep = keep | nll_mask
            n_nll_tokens = nll_mask.sum().clamp(min=1).float()
        if logit_rows is None:
            logit_mask = pref_mask
        else:
            if not isinstance(logit_rows, Tensor) or logit_rows.shape != (2 * n_pairs, t):
                raise ValueError(
                    f"logit_rows must be a (2B, T)=({2 * n_pairs}, {t}) tensor, "
                    f"got {getattr(logit_rows, 'shape', type(logit_rows))}"
                )
            logit_mask = logit_rows.to(dev).bool()
            keep = keep | logit_mask
        token = PreferenceRows(
            labels=labels.masked_fill(~pref_mask, 0),
            pref_mask=pref_mask.float(),
            pref_weight=self.token_weights(pref_mask[:n_pairs], pref_mask[n_pairs:]),
            logit_mask=logit_mask.float(),
            nll_labels=None if nll is None else nll.masked_fill(~nll_mask, 0),
            nll_mask=None if nll is None else nll_mask.float(),
        )
        n_tok = pref_mask.sum(1).float()
        n_logit = logit_mask.sum(1).float()
        # Means over pairs; a batch of no pairs gives loss and metrics 0 (sums of nothing), not 0/0.
        scalars = PreferenceScalars(
            n_pairs=to_scalar(max(n_pairs, 1), dev),
            n_chosen_tokens=n_tok[:n_pairs].sum().clamp(min=1),
            n_rejected_tokens=n_tok[n_pairs:].sum().clamp(min=1),
            n_tokens=n_tok.sum().clamp(min=1),
            n_chosen_logit_rows=n_logit[:n_pairs].sum().clamp(min=1),
            n_rejected_logit_rows=n_logit[n_pairs:].sum().clamp(min=1),
            n_nll_tokens=n_nll_tokens,
        )
        return keep, token, PreferenceSequences(n_tokens=n_tok, ref_logps=ref_logps), scalars


def _reference_head(hidden, weight, ref_hidden, ref_weight, ref_bias) -> list[ExtraHead]:
    """The reference model's head, checked against the policy's, as the batch's extra head (no grad)."""
    if ref_hidden is None or ref_weight is None:
        raise ValueError("a reference head needs both ref_hidden and ref_weight")
    check_head(ref_hidden, ref_weight, ref_bias, "ref_hidden")
    if ref_hidden.shape[:2] != hidden.shape[:2]:
        raise ValueError(
            f"ref_hidden rows {tuple(ref_hidden.shape[:2])} must equal hidden's {tuple(hidden.shape[:2])}"
        )
    if ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"ref_weight vocab {ref_weight.shape[0]} must equal weight's {weight.shape[0]}")
    if ref_hidden.device != hidden.device:
        raise ValueError(f"ref_hidden is on {ref_hidden.device} but hidden is on {hidden.device}")
    ref_b = None if ref_bias is None else ref_bias.detach()
    return [ExtraHead(ref_hidden.detach().reshape(-1, ref_hidden.shape[-1]), ref_weight.detach(), ref_b)]


def _reference_logps(hidden, ref_chosen_logps, ref_rejected_logps) -> Tensor:
    """The precomputed reference sequence log-probs, checked, as one (2B,) fp32 tensor without grad."""
    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError("give both ref_chosen_logps and ref_rejected_logps")
    n_pairs = hidden.shape[0] // 2
    for arg, v in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
        if not isinstance(v, Tensor) or v.shape != (n_pairs,):
            raise ValueError(f"{arg} must be a ({n_pairs},) tensor, got {getattr(v, 'shape', type(v))}")
        if v.device != hidden.device:
            raise ValueError(f"{arg} is on {v.device} but hidden is on {hidden.device}")
    return torch.cat([ref_chosen_logps, ref_rejected_logps]).detach().float()


# --------------------------------------------------------------------------------------------------
# The CUDA steps: the row statistics in one read (``chunkloss.kernels.logprob``), the gradient in one more
# read and a write.
def preference_stats(opts: PreferenceOptions, logits, extra_logits, token):
    """``STATS``: ``preference_token_stats``, and the rows' statistics for ``SEQ_PASS2`` on these logits."""
    rows = kernel_row_statistics(logits, token.labels, **_row_request(token, opts))
    return _columns(rows, token, opts), rows


def preference_pass2(opts: PreferenceOptions, logits, extra_logits, token, coef, rows=None):
    """``SEQ_PASS2``: ``grad((preference_token_stats * coef).sum())`` over the logits. Only the LOGP, LOGP_RAW
    and NLL columns carry a gradient (the others are detached or the reference's). ``rows``: the stats step's
    statistics of these logits in one pass, else read again."""
    from chunkloss.kernels.logprob import row_grad_

    a = coef[:, LOGP] * token.pref_weight + coef[:, LOGP_RAW] * token.pref_mask
    nll = {}
    if token.nll_labels is not None:
        nll = dict(labels2=token.nll_labels, coef2=(coef[:, NLL] * token.nll_mask).float().contiguous())
    return row_grad_(
        logits,
        token.labels,
        a.float().contiguous(),
        **nll,
        **saved_statistics(rows),
        logit_scale=opts.logit_scale,
        softcap=opts.softcap,
    )


register_gpu_steps(
    FusedLinearPreferenceLoss,
    {StepKind.STATS: preference_stats, StepKind.SEQ_PASS2: preference_pass2},
    math=("token_stats",),
)
