"""Chunked linear + RLOO loss (Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for
Learning from Human Feedback in LLMs", arXiv:2402.14740), the policy loss of TRL 1.16's ``RLOOTrainer``.

Equals the loss part of ``trl.trainer.rloo_trainer.RLOOTrainer._compute_loss`` (TRL 1.16.0) on the per-token
log-probs ``logp = log_softmax(scale(hidden @ weight.T + bias))[completion_ids]``, ``scale`` being the model's
logit transforms and TRL's temperature (``z·logit_scale``, then ``softcap·tanh(z/softcap)``, then
``/ temperature``, as in :mod:`chunkloss.losses.grpo`)::

    S_s   = Σ_t m_st · logp_st                   the completion's log-prob (completion mask m)
    r_s   = exp(S_s - old_s)                     old_s: the sampling policy's S_s (TRL's inputs["old_logps"])
    ℓ_s   = -min(r_s·A_s, clip(r_s, 1 - ε_low, 1 + ε_high)·A_s)
    L     = (1/B) Σ_s ℓ_s

over the B completions of the call, empty ones included (their S_s is 0: their ℓ_s counts in the value and
has no gradient). The ratio is that of whole sequences, the sum of the token log-ratios: GRPO's
``importance_sampling_level='sequence'`` takes their mean and normalises per token, so this is a loss of its
own rather than a GRPO option. The leave-one-out advantages, their normalisation and the KL penalty
(``beta``: TRL subtracts β·Σ_t(old - ref) from each reward) are the trainer's and reach the loss as
``advantages``. The loss is not divided by the gradient-accumulation steps: transformers'
``Trainer.training_step`` divides it, as it divides TRL's.

Metrics carry TRL's names and are this process's values, before TRL's cross-process reduction: ``entropy``
(the masked token mean), ``clip_ratio/low_mean``, ``clip_ratio/high_mean`` and ``clip_ratio/region_mean``
(means over the B completions of the flags ``r_s < 1 - ε_low and A_s < 0``, ``r_s > 1 + ε_high and A_s > 0``
and either), ``clip_ratio/low_min`` and ``clip_ratio/high_max`` (the first flag's minimum and the second's
maximum over the B completions).

Execution: a sequence loss on the chunk loop, each row's statistics its log-prob and its entropy (no
gradient); one pass where every completion fits in a chunk (3 GEMMs), two otherwise. On CUDA (with
``compile=True``) the statistics and the gradient are the Triton row kernels of ``chunkloss.kernels.logprob``,
as for GRPO.
"""

from __future__ import annotations

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
    check_head,
    check_head_transforms,
    check_positive,
    kernel_row_statistics,
    row_statistics,
    saved_statistics,
    to_scalar,
)
from chunkloss.losses.grpo import nanmax, nanmin
from chunkloss.losses.grpo_batch import check_completions

__all__ = ["FusedLinearRLOOLoss", "RLOOOptions"]


@dataclass(frozen=True)
class RLOOOptions(FusedOptions):
    """The options of :class:`FusedLinearRLOOLoss`, its constructor's keywords (RLOOConfig's names, except
    ``epsilon_low`` for TRL's ``epsilon``).

    Args:
        epsilon_low: lower clip ε of the sequence ratio (TRL's ``epsilon``).
        epsilon_high: upper clip ε; ``None`` means ``epsilon_low``.
        temperature: the logits are divided by it.
        logit_scale: the logits are first multiplied by it (Cohere's ``logit_scale``).
        softcap: final logit softcapping ``c·tanh(z/c)`` after the scale, before the temperature
            (Gemma-2's ``final_logit_softcapping``); ``None`` for off.
    """

    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self):
        super().__post_init__()
        check_positive("temperature", self.temperature)
        check_head_transforms(self)

    @property
    def eps_high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @property
    def scalings(self) -> dict:
        return dict(logit_scale=self.logit_scale, softcap=self.softcap, temperature=self.temperature)


@dataclass
class RLOORows(Rows):
    """Per completion token that takes part."""

    ids: Tensor  # (N,) int64 the sampled token


@dataclass
class RLOOSequences(Sequences):
    """Per completion."""

    adv: Tensor  # (S,) its advantage
    index: Tensor  # (S,) int64 its index in the batch
    old_logps: Tensor | None = None  # (S,) the sampling policy's summed log-prob (None: on-policy)


@dataclass
class RLOOScalars:
    """The batch's tensors."""

    n_valid: Tensor  # 0-d tokens that take part (at least 1)
    n_seqs: Tensor  # 0-d completions (at least 1)
    seq_zeros: Tensor  # (B + 1,) zeros the per-completion clip flags are added into


# --------------------------------------------------------------------------------------------------
# The per-chunk math.
def rloo_token_stats(logits, extra_logits, token: RLOORows, opts: RLOOOptions) -> Tensor:
    """(logp, entropy) per row (C, 2); the entropy is a metric only (no gradient)."""
    rows = row_statistics(logits, token.ids, **opts.scalings, entropy=True)
    return torch.stack([rows.logp, rows.entropy.detach()], dim=1)


def rloo_sequence_loss(
    stats, seq_id, num_seqs, token: RLOORows, sequence: RLOOSequences, scalars: RLOOScalars, opts: RLOOOptions
):
    """TRL's per-sequence PPO-clip loss of the summed log-probs, and its metrics."""
    seq_logp = segment_sum(stats[:, 0], seq_id, num_seqs)  # (S,) empty completions: 0
    old = seq_logp.detach() if sequence.old_logps is None else sequence.old_logps
    coef_1 = torch.exp(seq_logp - old)
    coef_2 = torch.clamp(coef_1, 1 - opts.epsilon_low, 1 + opts.eps_high)
    adv = sequence.adv
    loss = -torch.min(coef_1 * adv, coef_2 * adv).sum() / scalars.n_seqs
    c = coef_1.detach()
    low = ((c < 1 - opts.epsilon_low) & (adv < 0)).float()
    high = ((c > 1 + opts.eps_high) & (adv > 0)).float()
    n = scalars.n_seqs
    metrics = {
        "entropy": stats[:, 1].detach().sum() / scalars.n_valid,
        "clip_ratio/low_mean": low.sum() / n,
        "clip_ratio/high_mean": high.sum() / n,
        "clip_ratio/region_mean": torch.maximum(low, high).sum() / n,
        # Per-completion flags, scattered to their batch index: ``forward`` takes their min / max.
        "low_per_seq": scalars.seq_zeros.index_add(0, sequence.index, low),
        "high_per_seq": scalars.seq_zeros.index_add(0, sequence.index, high),
    }
    return loss, metrics


class FusedLinearRLOOLoss(FusedLinearBase):
    """TRL 1.16 ``RLOOTrainer._compute_loss`` over ``hidden @ weight.T`` without materialising logits.

    Example::

        loss_fn = FusedLinearRLOOLoss(epsilon_low=0.2, epsilon_high=0.28)
        loss = loss_fn(hidden, lm_head.weight, completion_ids, completion_mask, advantages,
                       old_logps=old_logps)  # hidden (B, T, H): row t predicts completion_ids[:, t]
        loss_fn.metrics["clip_ratio/region_mean"]

    Metrics (TRL's names, this process's values; see the module docstring): ``entropy``,
    ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``clip_ratio/low_min``
    and ``clip_ratio/high_max``.
    """

    options_cls = RLOOOptions
    options: RLOOOptions
    token_stats = staticmethod(rloo_token_stats)
    sequence_loss = staticmethod(rloo_sequence_loss)

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
        advantages: Tensor,
        *,
        bias: Tensor | None = None,
        old_logps: Tensor | None = None,
    ) -> Tensor:
        """Args:
            hidden: (B, T, H) the policy's hidden states; row t predicts ``completion_ids[:, t]``.
            weight: (V, H) the head's weight.
            completion_ids: (B, T) the sampled tokens; each must be in [0, V) where the mask is 1.
            completion_mask: (B, T) 0/1, the completion tokens that take part.
            advantages: (B,) one per completion (TRL's leave-one-out advantages).
            bias: (V,) the head's bias, or ``None``.
            old_logps: (B,) the sampling policy's log-prob of each completion, summed over its mask (TRL's
                ``inputs["old_logps"]``); ``None``: on-policy (the current ones, detached).

        Returns:
            The 0-d loss.
        """
        check_head(hidden, weight, bias)
        if hidden.dim() != 3:
            raise ValueError(f"hidden must be (B, T, H), got shape {tuple(hidden.shape)}")
        b, t, h = hidden.shape
        mask, label_checks = check_completions(hidden, weight, completion_ids, completion_mask, None)
        for name, v in (("advantages", advantages), ("old_logps", old_logps)):
            if v is not None:
                _check_per_sequence(v, b, name, hidden.device)
        dev = hidden.device
        token = RLOORows(ids=completion_ids.long())
        sequence = RLOOSequences(
            adv=advantages.float(),
            index=torch.arange(b, device=dev),
            old_logps=None if old_logps is None else old_logps.float(),
        )
        scalars = RLOOScalars(
            n_valid=mask.sum().clamp(min=1).float(),
            n_seqs=to_scalar(max(b, 1), dev),
            # One slot more than there are completions (dropped below): inductor's CPU codegen (torch 2.13)
            # fails on an index_add into a 1-element buffer, i.e. a batch of one completion.
            seq_zeros=torch.zeros(b + 1, device=dev),
        )
        batch, _ = sequence_batch(
            mask,
            torch.arange(b, device=dev),
            token=token,
            sequence=sequence,
            scalars=scalars,
            host_checks=label_checks,
        )
        loss = self.run(hidden.reshape(b * t, h), weight, bias, batch)
        sums = dict(self.chunk_sums)
        sums["clip_ratio/low_min"] = nanmin(sums.pop("low_per_seq")[:b])
        sums["clip_ratio/high_max"] = nanmax(sums.pop("high_per_seq")[:b])
        self.metrics = sums
        return loss


def _check_per_sequence(x, b: int, name: str, device) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != (b,):
        raise ValueError(f"{name} must be (B,)=({b},), one per completion, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but hidden is on {device}")


# --------------------------------------------------------------------------------------------------
# The CUDA steps: the row statistics (``chunkloss.kernels.logprob``) in one read of the logits, the gradient
# in one more read and a write.
def rloo_stats(opts: RLOOOptions, logits, extra_logits, token):
    """``STATS``: ``rloo_token_stats``, and the rows' statistics for ``SEQ_PASS2`` on these logits."""
    rows = kernel_row_statistics(logits, token.ids, **opts.scalings, lse=True, entropy=True)
    return torch.stack([rows.logp, rows.entropy], dim=1), rows


def rloo_pass2(opts: RLOOOptions, logits, extra_logits, token, coef, rows=None):
    """``SEQ_PASS2``: ``grad((rloo_token_stats * coef).sum())`` over the logits (the entropy column carries no
    gradient). ``rows``: the stats step's statistics of these logits in one pass, else read again."""
    from chunkloss.kernels.logprob import row_grad_

    return row_grad_(logits, token.ids, coef[:, 0].contiguous(), **saved_statistics(rows), **opts.scalings)


register_gpu_steps(
    FusedLinearRLOOLoss,
    {StepKind.STATS: rloo_stats, StepKind.SEQ_PASS2: rloo_pass2},
    math=("token_stats",),
)
