"""Chunked linear + KTO (Ethayarajh et al., arXiv:2402.01306) and its unpaired APO-zero variant.

Equals the loss of ``trl.KTOTrainer._compute_loss`` (TRL 1.16, ``trl/trainer/kto_trainer.py``) on the policy's
sequence log-probs ``ℓ_i = Σ_t log π(y_it)`` over the completion tokens of B completions, each labelled
desirable (D) or undesirable (U), and the reference's precomputed ``ℓ_ref,i``::

    r_i  = ℓ_i - ℓ_ref,i                                          (log-ratio; reward β·r_i, no grad)
    z    = max(0, mean_p mean_j (ℓ'_j - ℓ'_ref,j))                 (no grad: TRL's ``kl``)
    kto                 D: λ_D·(1 - σ(β(r_i - z)))   U: λ_U·(1 - σ(β(z - r_i)))
    apo_zero_unpaired   D: λ_D·(1 - σ(β·r_i))        U: λ_U·σ(β·r_i)
    L    = mean of the B per-completion losses

``z`` is the KL term estimated from mismatched completions: ``ℓ'`` and ``ℓ'_ref`` are the policy's and the
reference's sequence log-probs of the KL batch (each prompt paired with another example's completion), given
as tensors; the policy's carry no gradient (TRL computes them under ``no_grad``). The mean over the batch is
detached, gathered across processes (``kl_gather``, TRL's ``accelerator.gather_for_metrics``), averaged and
clamped at 0. ``apo_zero_unpaired`` (APO, arXiv:2408.06266) has no KL term (z = 0). λ_D, λ_U are
``desirable_weight`` and ``undesirable_weight``.

Each completion is a sequence of its own (a group of one): chunks need not follow the desirable/undesirable
split, which is a per-sequence flag read in ``sequence_loss``; its normalisers (counts of each side, of their
completion tokens) are computed once per call. Rows are the completion tokens of the B·T positions, projected
chunk by chunk: one pass when every completion fits in a chunk, two passes otherwise (memory flat in T).

Metrics (TRL's names): ``rewards/chosen`` and ``rewards/rejected`` (mean β·r over the desirable / undesirable
completions), ``rewards/margins`` (their difference), ``logps/chosen`` and ``logps/rejected`` (mean ℓ),
``logits/chosen`` and ``logits/rejected`` (mean logit over each side's completion tokens), ``kl`` (z), and
with ``return_token_metrics`` ``entropy`` (mean over every completion token). A side with no completion reads
0 (TRL leaves its metrics out of that step's log).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from chunkloss.engine import (
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
    check_choice,
    check_head,
    check_head_transforms,
    check_labels,
    check_positive,
    kernel_row_statistics,
    row_statistics,
    saved_statistics,
    to_scalar,
)

__all__ = ["FusedLinearKTOLoss", "KTOOptions", "KTO_LOSS_TYPES"]

#: The loss types of ``trl.KTOConfig`` 1.16.
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")

# Columns of the per-row statistics.
LOGP, MEAN_LOGIT, ENTROPY = range(3)


@dataclass(frozen=True)
class KTOOptions(FusedOptions):
    """The options of :class:`FusedLinearKTOLoss`, its constructor's keywords (names and defaults of
    ``trl.KTOConfig`` 1.16).

    Args:
        beta: β of the loss and the rewards.
        loss_type: 'kto' or 'apo_zero_unpaired' (``KTO_LOSS_TYPES``).
        desirable_weight: λ_D, the weight of each desirable completion's loss.
        undesirable_weight: λ_U, the weight of each undesirable completion's loss.
        ignore_index: label value of prompt and padding tokens (their rows cost no GEMM).
        logit_scale: the logits are multiplied by it (Cohere's ``logit_scale``).
        softcap: final logit softcapping ``c·tanh(z/c)`` after the scale (Gemma-2), ``None`` for off.
        return_token_metrics: also report ``entropy`` (mean over every completion token), as KTOTrainer
            logs it; one more reduction over V per row.
    """

    beta: float = 0.1
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    ignore_index: int = -100
    logit_scale: float = 1.0
    softcap: float | None = None
    return_token_metrics: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_choice("loss_type", self.loss_type, KTO_LOSS_TYPES)
        check_positive("beta", self.beta)
        check_head_transforms(self)


@dataclass
class KTORows(Rows):
    """Per completion token."""

    labels: Tensor  # (N,) int64 next-token labels


@dataclass
class KTOSequences(Sequences):
    """Per completion."""

    desirable: Tensor  # (S,) bool: TRL's ``label``
    ref_logps: Tensor  # (S,) fp32 reference sequence log-probs


@dataclass
class KTOScalars:
    """The batch's normalisers (each at least 1) and its KL term."""

    n_seqs: Tensor
    n_desirable: Tensor
    n_undesirable: Tensor
    n_desirable_tokens: Tensor
    n_undesirable_tokens: Tensor
    n_tokens: Tensor
    kl: Tensor  # z of the module docstring (no grad)


def _row_request(opts: KTOOptions) -> dict:
    """What the statistics read of a row (``row_statistics`` arguments)."""
    return dict(
        logit_scale=opts.logit_scale,
        softcap=opts.softcap,
        lse=True,  # for the CUDA pass-2 step on the same logits
        mean=True,
        entropy=opts.return_token_metrics,
    )


def _columns(rows: RowStats, opts: KTOOptions) -> Tensor:
    """The (C, 3) statistics: label log-prob, mean logit and entropy (the last two without grad)."""
    lp = rows.logp
    entropy = rows.entropy.detach() if opts.return_token_metrics else torch.zeros_like(lp)
    return torch.stack([lp, rows.mean.detach(), entropy], dim=1)


def kto_token_stats(logits, extra_logits, token: KTORows, opts: KTOOptions) -> Tensor:
    """Per-row statistics (C, 3) of one chunk: columns ``LOGP``, ``MEAN_LOGIT``, ``ENTROPY``."""
    return _columns(row_statistics(logits, token.labels, **_row_request(opts)), opts)


def kto_completion_losses(logratios: Tensor, desirable: Tensor, kl: Tensor, opts: KTOOptions) -> Tensor:
    """Per-completion loss of ``trl.KTOTrainer._compute_loss`` (TRL 1.16), weighted by its side's weight."""
    beta = opts.beta
    if opts.loss_type == "kto":
        chosen = 1 - torch.sigmoid(beta * (logratios - kl))
        rejected = 1 - torch.sigmoid(beta * (kl - logratios))
    else:  # apo_zero_unpaired
        chosen = 1 - torch.sigmoid(beta * logratios)
        rejected = torch.sigmoid(beta * logratios)
    return torch.where(desirable, opts.desirable_weight * chosen, opts.undesirable_weight * rejected)


def kto_sequence_loss(stats, seq_id, num_seqs, token, sequence: KTOSequences, scalars: KTOScalars, opts):
    """Loss of whole completions from their rows' statistics: the sum of the per-completion losses over the
    batch's B, and the metrics as sums over each side divided by that side's count."""
    s = segment_sum(stats, seq_id, num_seqs)
    logps, d = s[:, LOGP], sequence.desirable
    logratios = logps - sequence.ref_logps
    loss = kto_completion_losses(logratios, d, scalars.kl, opts).sum() / scalars.n_seqs
    rewards, logps = opts.beta * logratios.detach(), logps.detach()
    zero = torch.zeros_like(rewards)

    def side(x: Tensor, want: bool) -> Tensor:
        return torch.where(d if want else ~d, x, zero).sum()

    reward_c = side(rewards, True) / scalars.n_desirable
    reward_r = side(rewards, False) / scalars.n_undesirable
    metrics = {
        "rewards/chosen": reward_c,
        "rewards/rejected": reward_r,
        "rewards/margins": reward_c - reward_r,
        "logps/chosen": side(logps, True) / scalars.n_desirable,
        "logps/rejected": side(logps, False) / scalars.n_undesirable,
        "logits/chosen": side(s[:, MEAN_LOGIT], True) / scalars.n_desirable_tokens,
        "logits/rejected": side(s[:, MEAN_LOGIT], False) / scalars.n_undesirable_tokens,
    }
    if opts.return_token_metrics:
        metrics["entropy"] = s[:, ENTROPY].sum() / scalars.n_tokens
    return loss, metrics


class FusedLinearKTOLoss(FusedLinearBase):
    """KTO of ``trl.KTOTrainer`` (TRL 1.16) over the chunked LM head.

    Example::

        loss_fn = FusedLinearKTOLoss(beta=0.1, desirable_weight=1.0, undesirable_weight=1.33)
        loss = loss_fn(hidden, lm_head.weight, labels, desirable,      # hidden (B, T, H), labels (B, T)
                       ref_logps=ref_logps, kl_logps=kl_logps, ref_kl_logps=ref_kl_logps)   # (B,) each
        loss_fn.metrics["kl"]

    Metrics (TRL's names): ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected``, ``logits/chosen``, ``logits/rejected``, ``kl``; with ``return_token_metrics`` also
    ``entropy``.
    """

    options_cls = KTOOptions
    options: KTOOptions
    token_stats = staticmethod(kto_token_stats)
    sequence_loss = staticmethod(kto_sequence_loss)

    def rows_in_pass_1(self, batch):
        """The last completion's rows: they reach the loss through its summed log-prob alone (the other
        columns carry no gradient), multiplier 1. See ``FusedLinearBase.rows_in_pass_1``."""
        n = batch.last_seq_rows
        return LOGP, n, torch.ones(n, device=batch.rows.device)

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        desirable: Tensor,
        *,
        bias: Tensor | None = None,
        ref_logps: Tensor,
        kl_logps: Tensor | None = None,
        ref_kl_logps: Tensor | None = None,
        kl_gather: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """Args:
            hidden: (B, T, H) the hidden states before each label.
            weight: (V, H) the head's weight.
            labels: (B, T) next-token labels, already shifted; ``ignore_index`` on prompt and padding.
            desirable: (B,) bool (TRL's ``label``): the completion is desirable.
            bias: (V,) the head's bias, or ``None``.
            ref_logps: (B,) the reference's sequence log-probs of the completions (no grad).
            kl_logps, ref_kl_logps: (B',) the policy's and the reference's sequence log-probs of the KL batch
                (no grad); required by ``loss_type='kto'``, refused by ``'apo_zero_unpaired'``.
            kl_gather: maps this process's 0-d KL mean to every process's (P,), e.g. accelerate's
                ``gather_for_metrics``; ``None``: this process's alone.

        Returns:
            The 0-d loss.
        """
        check_head(hidden, weight, bias)
        if hidden.dim() != 3:
            raise ValueError(f"hidden must be (B, T, H), got {tuple(hidden.shape)}")
        opts, dev = self.options, hidden.device
        n_seq = hidden.shape[0]
        label_checks = []
        check_labels(
            labels, hidden.shape[:2], weight.shape[0], opts.ignore_index, defer=label_checks, device=dev
        )
        desirable = _per_completion("desirable", desirable, n_seq, dev).bool()
        ref_logps = _per_completion("ref_logps", ref_logps, n_seq, dev).detach().float()
        keep = labels != opts.ignore_index
        scalars = _scalars(keep, desirable, self._kl(kl_logps, ref_kl_logps, kl_gather, dev))
        token = KTORows(labels=labels.long().masked_fill(~keep, 0))
        sequence = KTOSequences(desirable=desirable, ref_logps=ref_logps)
        group = torch.arange(n_seq, device=dev)
        batch, _ = sequence_batch(
            keep, group, token=token, sequence=sequence, scalars=scalars, host_checks=label_checks
        )
        loss = self.run(hidden.reshape(-1, hidden.shape[-1]), weight, bias, batch)
        self.metrics["kl"] = scalars.kl
        return loss

    def _kl(self, kl_logps, ref_kl_logps, kl_gather, device) -> Tensor:
        """TRL's ``kl``: the KL batch's mean log-ratio, detached, gathered, averaged and clamped at 0."""
        given = kl_logps is not None or ref_kl_logps is not None
        if self.options.loss_type != "kto":
            if given:
                raise ValueError(
                    f"loss_type={self.options.loss_type!r} has no KL term: kl_logps must be None"
                )
            return torch.zeros((), device=device)
        if kl_logps is None or ref_kl_logps is None:
            raise ValueError("loss_type='kto' needs the KL batch's kl_logps and ref_kl_logps")
        if not isinstance(kl_logps, Tensor) or kl_logps.dim() != 1 or not kl_logps.numel():
            raise ValueError(
                f"kl_logps must be a (B',) tensor, B' >= 1, got {getattr(kl_logps, 'shape', kl_logps)}"
            )
        _per_completion("kl_logps", kl_logps, kl_logps.shape[0], device)
        _per_completion("ref_kl_logps", ref_kl_logps, kl_logps.shape[0], device)
        kl = (kl_logps.float() - ref_kl_logps.float()).mean().detach()
        if kl_gather is not None:
            kl = kl_gather(kl)
        return kl.float().mean().clamp(min=0)


def _scalars(keep: Tensor, desirable: Tensor, kl: Tensor) -> KTOScalars:
    """The normalisers of completions ``keep`` (B, T) (the rows that take part), on the device (no sync)."""
    n_tok = keep.sum(1).float()
    return KTOScalars(
        n_seqs=to_scalar(max(keep.shape[0], 1), keep.device),
        n_desirable=desirable.sum().clamp(min=1).float(),
        n_undesirable=(~desirable).sum().clamp(min=1).float(),
        n_desirable_tokens=(n_tok * desirable).sum().clamp(min=1),
        n_undesirable_tokens=(n_tok * ~desirable).sum().clamp(min=1),
        n_tokens=n_tok.sum().clamp(min=1),
        kl=kl,
    )


def _per_completion(name: str, value, n: int, device) -> Tensor:
    """``value`` checked as an (n,) tensor on ``device``."""
    if not isinstance(value, Tensor) or value.shape != (n,):
        raise ValueError(f"{name} must be a ({n},) tensor, got {getattr(value, 'shape', type(value))}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but hidden is on {device}")
    return value


# --------------------------------------------------------------------------------------------------
# The CUDA steps: the row statistics in one read (``chunkloss.kernels.logprob``), the gradient in one more
# read and a write.
def kto_stats(opts: KTOOptions, logits, extra_logits, token):
    """``STATS``: ``kto_token_stats``, and the rows' statistics for ``SEQ_PASS2`` on these logits."""
    rows = kernel_row_statistics(logits, token.labels, **_row_request(opts))
    return _columns(rows, opts), rows


def kto_pass2(opts: KTOOptions, logits, extra_logits, token, coef, rows=None):
    """``SEQ_PASS2``: ``grad((kto_token_stats * coef).sum())`` over the logits; only the ``LOGP`` column
    carries a gradient. ``rows``: the stats step's statistics of these logits in one pass, else read again."""
    from chunkloss.kernels.logprob import row_grad_

    a = coef[:, LOGP].float().contiguous()
    saved = saved_statistics(rows)
    return row_grad_(logits, token.labels, a, **saved, logit_scale=opts.logit_scale, softcap=opts.softcap)


register_gpu_steps(
    FusedLinearKTOLoss,
    {StepKind.STATS: kto_stats, StepKind.SEQ_PASS2: kto_pass2},
    math=("token_stats",),
)
