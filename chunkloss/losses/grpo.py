"""Chunked linear + GRPO loss (Shao et al., DeepSeekMath, arXiv:2402.03300), with every loss option of TRL
1.16's ``GRPOTrainer``.

Equals the loss part of ``trl.trainer.grpo_trainer.GRPOTrainer._compute_loss`` (TRL 1.16.0) on the
per-token log-probs ``logp = log_softmax(scale(hidden @ weight.T + bias))[completion_ids]``, ``scale``
being the model's logit transforms and TRL's temperature: ``z·logit_scale``, then ``softcap·tanh(z/softcap)``,
then ``/ temperature`` (as TRL's fused head applies them)::

    w        = exp(logp - old)                     importance_sampling_level='token'
             = exp(mean_t (logp - old))            'sequence' (GSPO, masked mean over the completion)
             = exp(logp - sg(logp) + sg(mean_t(logp - old)))   'sequence_token' (GSPO-token, see below)
    ℓ_t      = -min(w·A, clip(w, 1-ε_low, 1+ε_high)·A)          grpo, bnpo, dr_grpo, dapo, luspo
                 (w first clamped at ``delta`` when set: INTELLECT-2's two-sided clip)
             = -sg(min(w, ε_high))·A·logp                          cispo
             = -σ(τ·(w-1))·4/τ·A,  τ = τ_pos if A>0 else τ_neg    sapo
             = -φ(W)·A·logp, φ(W) = e^λ·W^k·e^{-λW} (no grad)     vespo, W = Π_t w_t (clamped)
    ℓ_t     *= off-policy mask · entropy mask · vLLM IS ratio (not vespo)
    ℓ_t     += β·(exp(ref - logp) - (ref - logp) - 1)·(w if use_bias_correction_kl)    k3 KL

and the sum over the completion mask (``completion_mask · tool_mask``) is normalised as TRL does:

    grpo, sapo       Σ_s (Σ_t ℓ / |s|) / B / GA
    bnpo             Σ ℓ / N_local / GA
    dr_grpo          Σ ℓ / (B · max_completion_length) / GA
    dapo, cispo,     Σ ℓ / (num_items_in_batch / num_processes · GA / steps_per_generation)
    vespo            (``num_items_in_batch``: TRL's global masked-token count of the generation batch)
    luspo            Σ ℓ / B / GA

minus the entropy bonus ``entropy_coef · mean_t H_t / GA`` over the mask (times the entropy mask).
Which term, normaliser and metrics each loss type has is one table, :class:`GRPOLossType`.
``GA`` is the trainer's ``current_gradient_accumulation_steps``; trainer state (GA, process count,
``num_items_in_batch``) comes in as explicit arguments of ``forward``.

``'sequence_token'`` is not in TRL 1.16 (it only has 'token' and 'sequence'): it is the GSPO-token
weight of the GSPO paper (arXiv:2507.18071, eq. 13), equal in value to 'sequence' with per-token
gradients, as Liger names it.

Metrics carry TRL's names and are this process's values, before TRL's cross-process reduction:
``kl`` and ``entropy`` (masked token means), ``clip_ratio/{low_mean,high_mean,region_mean}`` and
``cispo_clip_ratio`` (masked token means, or means over the B sequences when the ratio is per
sequence), ``clip_ratio/low_min`` and ``clip_ratio/high_max`` (min/max over this process's sequences
of the per-sequence mean, NaN-skipping), ``vespo/phi_seq_mean``, and ``policy_loss`` when the
entropy bonus is on. With
``top_entropy_quantile < 1`` the entropy threshold is the quantile of this process's tokens (TRL
gathers every process's tokens first).

Execution: with token-level weights and no per-sequence statistic (no off-policy mask, no entropy
mask, not vespo) the loss is a token loss (one pass, 3 GEMMs). Otherwise it is a sequence loss
(per-row log-prob and entropy as statistics): one pass when each completion fits in a chunk, two
passes otherwise or with the entropy mask (its quantile needs every token's entropy). On CUDA (with
``compile=True``) every per-chunk step is the Triton row kernels of ``chunkloss.kernels.logprob`` (per-row
log-prob and entropy in one read of the logits, the gradient in one more read and a write) with the loss
evaluated on those (C,) statistics in between; elsewhere the compiled or eager ``grad_and_value`` steps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from chunkloss.engine import FusedLinearBase, StepKind, register_gpu_steps, segment_sum, sequence_batch
from chunkloss.losses.common import (
    check_head,
    kernel_row_statistics,
    nograd_label_logprob,
    quantile,
    row_statistics,
    saved_statistics,
    to_scalar,
)
from chunkloss.losses.grpo_batch import (
    GRPORows,
    GRPOScalars,
    GRPOSequences,
    batch_tensors,
    check_advantages_and_ratio,
    check_completions,
    check_trainer_state,
    normaliser,
    reference_head,
)
from chunkloss.losses.grpo_options import (
    CLIP_LOSS_TYPES,
    GLOBAL_COUNT_LOSS_TYPES,
    IS_LEVELS,
    LOG_RATIO_MIN,
    LOSS_TYPES,
    ClipMetrics,
    GRPOLossType,
    GRPOOptions,
    PolicyTerm,
)

__all__ = [
    "CLIP_LOSS_TYPES",
    "FusedLinearGRPOLoss",
    "GLOBAL_COUNT_LOSS_TYPES",
    "GRPOLossType",
    "GRPOOptions",
    "IS_LEVELS",
    "LOSS_TYPES",
    "nanmax",
    "nanmin",
]


# --------------------------------------------------------------------------------------------------
# Per-row math shared by both paths. Every row is a completion token with mask 1.
def _row_logprobs(logits, extra_logits, token, opts: GRPOOptions, stats_fn=row_statistics):
    """(logp, entropy, ref_logp or None, the rows' statistics) of the chunk's rows from its logits;
    ``stats_fn`` is ``common.row_statistics`` (differentiable) or, for the CUDA steps,
    ``common.kernel_row_statistics``."""
    rows = stats_fn(
        logits,
        token.ids,
        logit_scale=opts.logit_scale,
        softcap=opts.softcap,
        temperature=opts.temperature,
        lse=True,
        entropy=True,
    )
    # The entropy only needs a gradient for the entropy bonus.
    ent = rows.entropy if opts.entropy_coef != 0 else rows.entropy.detach()
    ref = None
    if opts.beta != 0.0:
        # A reference head arrives reduced (grpo_ref_stats); otherwise precomputed log-probs.
        ref = token.extra_stats[:, 0] if token.extra_stats is not None else token.ref_logps
    return rows.logp, ent, ref, rows


def grpo_ref_stats(extra_logits, token, opts: GRPOOptions):
    """The reference head's label log-prob per row (C, 1), reduced as soon as it is projected."""
    ref = nograd_label_logprob(extra_logits[0], token.ids, opts.logit_scale, opts.softcap, opts.temperature)
    return ref.unsqueeze(1)


def _gamma_weight(adv, log_w_seq, opts: GRPOOptions):
    """VESPO's φ(W) = exp(λ + k·log W - λ·W), k/λ by the advantage's sign (TRL's get_gamma_weights)."""
    nonneg = adv >= 0
    k = torch.where(nonneg, opts.vespo_k_pos, opts.vespo_k_neg)
    lam = torch.where(nonneg, opts.vespo_lambda_pos, opts.vespo_lambda_neg).clamp(min=1e-4)
    log_phi = lam + k * log_w_seq - lam * torch.exp(log_w_seq)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass
class ClipRows:
    """Per-row values of ``_row_loss`` that :func:`_add_clip_metrics` turns into metrics; ``None`` where the
    loss type has none (or the metric is taken per sequence instead)."""

    low: Tensor | None = None  # (C,) 1.0 where the ratio is clipped below with a negative advantage
    high: Tensor | None = None  # (C,) 1.0 where the ratio is clipped above with a positive advantage
    phi: Tensor | None = None  # (C,) VESPO's φ(W) of the row's sequence


def _row_loss(
    logp,
    ent,
    ref,
    log_w,
    token: GRPORows,
    scalars: GRPOScalars,
    opts: GRPOOptions,
    keep=None,
    phi=None,
    n_bonus=None,
    emask=None,
):
    """Σ over the rows of the normalised TRL per-token loss, its token-shaped metric sums, and the per-row
    values the clip metrics are made of (:class:`ClipRows`)."""
    adv = token.adv
    coef_1 = torch.exp(log_w)
    metrics = {}
    if opts.beta != 0.0:
        d = ref - logp
        kl = torch.exp(d) - d - 1
        if opts.use_bias_correction_kl:
            kl = kl * coef_1
        metrics["kl"] = kl.detach().sum() / scalars.n_valid
    eps_hi = opts.eps_high
    term = opts.loss_type.term
    if term is PolicyTerm.CISPO:
        per = -torch.clamp(coef_1, max=eps_hi).detach() * adv * logp
    elif term is PolicyTerm.SAPO:
        tau = torch.where(adv > 0, opts.sapo_temperature_pos, opts.sapo_temperature_neg)
        per = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
    elif term is PolicyTerm.VESPO:
        per = -phi * adv * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - opts.epsilon_low, 1 + eps_hi)
        if opts.delta is not None:
            coef_1 = torch.clamp(coef_1, max=opts.delta)
        per = -torch.min(coef_1 * adv, coef_2 * adv)
    if keep is not None:
        per = per * keep
    if token.is_ratio is not None and not opts.loss_type.sequence_weight:
        per = per * token.is_ratio
    if opts.beta != 0.0:
        per = per + opts.beta * kl
    loss = (per * token.weight).sum()
    if opts.entropy_coef != 0.0:
        # TRL logs the policy part alone when the bonus is on (before its GA division for the
        # per-sequence / local normalisers).
        metrics["policy_loss"] = loss.detach() * scalars.policy_scale
        eff = ent if emask is None else ent * emask
        n_eff = scalars.n_bonus if n_bonus is None else n_bonus
        loss = loss - scalars.entropy_coef * eff.sum() / n_eff / scalars.grad_accum
    metrics["entropy"] = ent.detach().sum() / scalars.n_valid
    c = coef_1.detach()
    clip_metrics = opts.loss_type.clip_metrics
    clip = ClipRows()
    if clip_metrics is ClipMetrics.CLIP_RATIO:
        clip.low = ((c < 1 - opts.epsilon_low) & (adv < 0)).float()
        clip.high = ((c > 1 + eps_hi) & (adv > 0)).float()
    elif clip_metrics is ClipMetrics.CISPO:
        metrics["cispo_clip_ratio"] = ((c > eps_hi) & (adv > 0)).float().sum() / scalars.n_valid
    elif clip_metrics is ClipMetrics.VESPO_PHI:
        clip.phi = phi
    return loss, metrics, clip


def _add_clip_metrics(metrics: dict, clip: ClipRows, token: GRPORows, scalars: GRPOScalars) -> dict:
    """``metrics`` with the token means of the per-row clip flags and their per-sequence means scattered into
    (B,) vectors (``low_per_seq``, ``high_per_seq``: chunk sums that ``forward`` reduces to
    ``clip_ratio/low_min`` and ``clip_ratio/high_max``), and VESPO's token mean of φ."""
    out = dict(metrics)
    if clip.low is not None:
        out["clip_ratio/low_mean"] = clip.low.sum() / scalars.n_valid
        out["clip_ratio/high_mean"] = clip.high.sum() / scalars.n_valid
        out["clip_ratio/region_mean"] = torch.maximum(clip.low, clip.high).sum() / scalars.n_valid
        zeros = scalars.seq_zeros
        out["low_per_seq"] = zeros.index_add(0, token.seq, clip.low * token.inv_len)
        out["high_per_seq"] = zeros.index_add(0, token.seq, clip.high * token.inv_len)
    if clip.phi is not None:
        out["vespo/phi_seq_mean"] = clip.phi.sum() / scalars.n_valid
    return out


def grpo_chunk(logits, extra_logits, token: GRPORows, scalars: GRPOScalars, opts: GRPOOptions):
    """Token path: token-level weights, nothing per sequence but the normaliser."""
    logp, ent, ref, _ = _row_logprobs(logits, extra_logits, token, opts)
    old = logp.detach() if token.old_logps is None else token.old_logps
    loss, m, clip = _row_loss(logp, ent, ref, logp - old, token, scalars, opts)
    return loss, _add_clip_metrics(m, clip, token, scalars)


def grpo_token_stats(logits, extra_logits, token: GRPORows, opts: GRPOOptions):
    """Sequence path statistics: (logp, entropy[, ref_logp]) per row."""
    logp, ent, ref, _ = _row_logprobs(logits, extra_logits, token, opts)
    cols = [logp, ent] if ref is None else [logp, ent, ref]
    return torch.stack(cols, dim=1)


def grpo_sequence_loss(
    stats, seq_id, num_seqs, token: GRPORows, sequence: GRPOSequences, scalars: GRPOScalars, opts: GRPOOptions
):
    """Sequence path: the per-sequence statistics of TRL, then the per-row loss of the token path."""
    logp, ent = stats[:, 0], stats[:, 1]
    ref = stats[:, 2] if stats.shape[1] > 2 else None
    old = logp.detach() if token.old_logps is None else token.old_logps
    log_ratio = logp - old
    n_rows = sequence.length.clamp(min=1)  # (S,) mask count per sequence
    adv = token.adv
    lw_seq = segment_sum(log_ratio, seq_id, num_seqs) / n_rows
    if opts.importance_sampling_level == "sequence":
        log_w = lw_seq[seq_id]
    elif opts.importance_sampling_level == "sequence_token":
        log_w = logp - logp.detach() + lw_seq.detach()[seq_id]
    else:
        log_w = log_ratio
    keep = None
    if opts.off_policy_mask_threshold is not None:
        samp = old if token.sampling_logps is None else token.sampling_logps
        kl_div = torch.nan_to_num(samp - logp.detach(), nan=0.0)
        avg_kl = segment_sum(kl_div, seq_id, num_seqs) / n_rows
        keep = ((adv >= 0) | (avg_kl[seq_id] <= opts.off_policy_mask_threshold)).float()
    n_bonus = None
    emask = None
    if opts.top_entropy_quantile < 1.0:
        # Two passes: every row of the batch is here.
        e = ent.detach()
        if e.numel():
            # The engine may hand in the threshold (``pass_1_estimates``): the same quantile of the same rows,
            # or, for pass 1's chunks, of the rows seen so far.
            thr = scalars.entropy_threshold
            if thr is None:
                thr = quantile(e, 1 - opts.top_entropy_quantile)
            emask = (e >= thr).float()
        else:
            emask = e
        keep = emask if keep is None else keep * emask
        n_bonus = emask.sum().clamp(min=1.0)
    phi = phi_seq = None
    if opts.loss_type.term is PolicyTerm.VESPO:
        with torch.no_grad():
            slr = (
                segment_sum(torch.clamp(log_ratio.detach(), -20.0, 20.0), seq_id, num_seqs)
                + sequence.vespo_log_is
            )
            lw_v = torch.clamp(slr, LOG_RATIO_MIN, 20.0)
            phi = _gamma_weight(adv, lw_v[seq_id], opts)
            if sequence.adv is not None:
                phi_seq = _gamma_weight(sequence.adv, lw_v, opts)
    loss, m, clip = _row_loss(
        logp, ent, ref, log_w, token, scalars, opts, keep=keep, phi=phi, n_bonus=n_bonus, emask=emask
    )
    seq_clip = opts.importance_sampling_level == "sequence" and sequence.adv is not None
    if phi_seq is not None:
        clip.phi = None
    if seq_clip:
        clip.low = clip.high = None
    out = _add_clip_metrics(m, clip, token, scalars)
    if phi_seq is not None:
        out["vespo/phi_seq_mean"] = phi_seq.sum() / scalars.n_seqs
    clip_metrics = opts.loss_type.clip_metrics
    if seq_clip and clip_metrics is ClipMetrics.CLIP_RATIO:
        # One ratio per sequence: TRL's metrics are over the B sequences (empty ones included).
        c = torch.exp(lw_seq.detach())
        if opts.delta is not None:
            c = torch.clamp(c, max=opts.delta)
        a = sequence.adv
        low = ((c < 1 - opts.epsilon_low) & (a < 0)).float()
        high = ((c > 1 + opts.eps_high) & (a > 0)).float()
        out["clip_ratio/low_mean"] = low.sum() / scalars.n_seqs
        out["clip_ratio/high_mean"] = high.sum() / scalars.n_seqs
        out["clip_ratio/region_mean"] = torch.maximum(low, high).sum() / scalars.n_seqs
        zeros = scalars.seq_zeros
        out["low_per_seq"] = zeros.index_add(0, sequence.index, low)
        out["high_per_seq"] = zeros.index_add(0, sequence.index, high)
    if seq_clip and clip_metrics is ClipMetrics.CISPO:
        # One ratio per sequence: TRL averages the (B, 1) flags over the B sequences (empty ones included).
        c = torch.exp(lw_seq.detach())
        flags = ((c > opts.eps_high) & (sequence.adv > 0)).float()
        out["cispo_clip_ratio"] = flags.sum() / scalars.n_seqs
    return loss, out


class FusedLinearGRPOLoss(FusedLinearBase):
    """TRL 1.16 ``GRPOTrainer._compute_loss`` over ``hidden @ weight.T`` without materialising logits.

    Example::

        loss_fn = FusedLinearGRPOLoss(loss_type="dapo", beta=0.04)
        loss = loss_fn(hidden, lm_head.weight, completion_ids, completion_mask, advantages,
                       ref_logps=ref_logps)     # hidden (B, T, H): row t predicts completion_ids[:, t]
        loss_fn.metrics["clip_ratio/region_mean"]

    Metrics (TRL's names, this process's values; see the module docstring): ``entropy`` always; ``kl`` when
    ``beta`` ≠ 0; ``policy_loss`` when ``entropy_coef`` ≠ 0; ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``clip_ratio/low_min`` and ``clip_ratio/high_max``
    for ``CLIP_LOSS_TYPES``; ``cispo_clip_ratio`` for cispo; ``vespo/phi_seq_mean`` for vespo.
    """

    options_cls = GRPOOptions
    options: GRPOOptions
    head_args = ("hidden", "weight", "bias", "ref_hidden", "ref_weight", "ref_bias")
    chunk_loss = staticmethod(grpo_chunk)
    token_stats = staticmethod(grpo_token_stats)
    sequence_loss = staticmethod(grpo_sequence_loss)
    extra_token_stats = staticmethod(grpo_ref_stats)

    @property
    def needs_global_stats(self) -> bool:
        """Entropy masking needs every token's entropy before the quantile is known: two passes."""
        return self.options.top_entropy_quantile < 1.0

    def pass_1_estimates(self, batch):
        """With the entropy mask, every chunk runs its backward in pass 1 with the quantile of the entropies
        seen so far (see ``FusedLinearBase.pass_1_estimates``), and pass 2 re-projects only the rows on the
        other side of the final threshold: 3 GEMMs and a few rows instead of 4 GEMMs. Only where every row has
        a gradient anyway (``beta != 0``: the KL term; at β = 0 pass 2 already projects only the kept rows)
        and a row's coefficient depends on nothing of the batch but the threshold: token-level ratios, no
        off-policy mask, not vespo (per-sequence statistics), no entropy bonus (normalised by the number of
        kept rows)."""
        o = self.options
        if not (
            o.top_entropy_quantile < 1.0
            and o.beta != 0.0
            and o.entropy_coef == 0.0
            and o.importance_sampling_level == "token"
            and o.off_policy_mask_threshold is None
            and not o.loss_type.sequence_weight
        ):
            return None
        q = 1 - o.top_entropy_quantile

        def estimate(stats: list[Tensor]) -> dict[str, Tensor]:
            return {"entropy_threshold": quantile(torch.cat([s[:, 1] for s in stats]), q)}

        return estimate

    @property
    def is_sequence_loss(self) -> bool:
        """Token-level weights run as a token loss (one pass, three GEMMs); per-sequence ratios, masks or
        quantiles as a sequence loss."""
        return self.options.needs_sequence_path

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
        ref_logps: Tensor | None = None,
        ref_hidden: Tensor | None = None,
        ref_weight: Tensor | None = None,
        ref_bias: Tensor | None = None,
        importance_sampling_ratio: Tensor | None = None,
        sampling_logps: Tensor | None = None,
        tool_mask: Tensor | None = None,
        num_items_in_batch: int | Tensor | None = None,
        num_processes: int = 1,
        gradient_accumulation_steps: int = 1,
        steps_per_generation: int | None = None,
        entropy_coef: float | Tensor | None = None,
    ) -> Tensor:
        """Args:
            hidden: (B, T, H) the policy's hidden states; row t predicts ``completion_ids[:, t]``.
            weight: (V, H) the head's weight.
            completion_ids: (B, T) the sampled tokens; each must be in [0, V) where the mask is 1.
            completion_mask: (B, T) 0/1, the completion tokens that take part.
            advantages: (B,) per sequence or (B, T) per token.
            bias: (V,) the head's bias, or ``None``.
            old_logps: (B, T) the sampling policy's log-probs; ``None``: on-policy (``logp.detach()``).
            ref_logps: (B, T) the reference's log-probs (with ``beta`` ≠ 0), or a reference head instead:
            ref_hidden, ref_weight, ref_bias: (B, T, H_ref), (V, H_ref), (V,), projected without grad in the
                same pass.
            importance_sampling_ratio: vLLM's importance-sampling ratio, (B, T), (B, 1) or (B,).
            sampling_logps: (B, T) the sampler's log-probs for the off-policy mask (default ``old_logps``).
            tool_mask: (B, T) 0/1, folded into the completion mask.
            num_items_in_batch: TRL's global masked-token count (dapo, cispo, vespo); default the local one.
            num_processes: the trainer's process count (dapo, cispo, vespo).
            gradient_accumulation_steps: TRL's ``current_gradient_accumulation_steps``.
            steps_per_generation: TRL's ``steps_per_generation``; ``None`` means
                ``gradient_accumulation_steps``.
            entropy_coef: this call's entropy-bonus coefficient (a float or a 0-d tensor) in place of the
                constructor's, which must be ≠ 0 (it switches the bonus on). A value that changes from step
                to step, such as an adaptive controller's, runs the same compiled step.

        Returns:
            The 0-d loss.
        """
        check_head(hidden, weight, bias)
        if hidden.dim() != 3:
            raise ValueError(f"hidden must be (B, T, H), got shape {tuple(hidden.shape)}")
        spg = gradient_accumulation_steps if steps_per_generation is None else steps_per_generation
        check_trainer_state(num_processes, gradient_accumulation_steps, spg)
        mask, label_checks = check_completions(hidden, weight, completion_ids, completion_mask, tool_mask)
        check_advantages_and_ratio(self.options, hidden, advantages, importance_sampling_ratio)
        extra = reference_head(self.options, hidden, weight, ref_logps, ref_hidden, ref_weight, ref_bias)
        per_token = dict(old_logps=old_logps, ref_logps=None if extra else ref_logps)
        per_token["sampling_logps"] = sampling_logps
        ga = float(gradient_accumulation_steps)
        norm = normaliser(self.options, mask, num_items_in_batch, num_processes, ga, spg)
        token, sequence, scalars = batch_tensors(
            self.options, completion_ids, mask, advantages, per_token, importance_sampling_ratio, norm, ga
        )
        if self.options.entropy_coef != 0.0:
            coef = self.options.entropy_coef if entropy_coef is None else entropy_coef
            scalars.entropy_coef = to_scalar(coef, hidden.device)
        elif entropy_coef is not None:
            raise ValueError(
                "entropy_coef given to the call needs the entropy bonus switched on: construct the loss "
                "with entropy_coef != 0"
            )
        b, t, h = hidden.shape
        batch, _ = sequence_batch(
            mask,
            torch.arange(b, device=hidden.device),
            token=token,
            sequence=sequence,
            scalars=scalars,
            extra=extra,
            host_checks=label_checks,
        )
        loss = self.run(hidden.reshape(b * t, h), weight, bias, batch)
        seq_shaped = self.options.importance_sampling_level == "sequence" and advantages.dim() == 1
        sums = {**_zero_metrics(self.options, hidden.device), **self.chunk_sums}
        self.metrics = _finish_metrics(sums, sequence.length, seq_shaped)
        return loss


def _zero_metrics(opts: GRPOOptions, device) -> dict:
    """The metrics when no row takes part (every completion empty): masked means of nothing are 0."""
    names = ["entropy"] + (["kl"] if opts.beta != 0.0 else [])
    names += ["policy_loss"] if opts.entropy_coef != 0.0 else []
    names += opts.loss_type.clip_metrics.value
    out = {k: torch.zeros((), device=device) for k in names}
    if opts.loss_type.clip_metrics is ClipMetrics.CLIP_RATIO:
        # Extrema over no sequence: TRL's nanmin / nanmax of nothing.
        out["clip_ratio/low_min"] = out["clip_ratio/high_max"] = torch.full((), float("nan"), device=device)
    return out


def _finish_metrics(sums: dict, len_s: Tensor, seq_shaped: bool) -> dict:
    """The metrics from the chunk sums: the per-sequence clip vectors become TRL's low_min / high_max
    (NaN-skipping over this process)."""
    out = {k: v for k, v in sums.items() if k not in ("low_per_seq", "high_per_seq")}
    if "low_per_seq" in sums:
        empty = (len_s == 0) & (not seq_shaped)
        for key, name, extremum in (
            ("low_per_seq", "clip_ratio/low_min", nanmin),
            ("high_per_seq", "clip_ratio/high_max", nanmax),
        ):
            out[name] = extremum(sums[key][: len_s.numel()].masked_fill(empty, float("nan")))
    return out


def nanmin(values: Tensor) -> Tensor:
    """The smallest non-NaN entry of a 1-D ``values``, NaN if there is none (0-d): TRL's ``nanmin``
    (``trl.trainer.utils``), computed on the device with no host sync."""
    return _nan_extremum(values, torch.amin, float("inf"))


def nanmax(values: Tensor) -> Tensor:
    """The largest non-NaN entry of a 1-D ``values``, NaN if there is none (0-d): TRL's ``nanmax``, computed
    on the device with no host sync."""
    return _nan_extremum(values, torch.amax, float("-inf"))


def _nan_extremum(values: Tensor, reduce, neutral: float) -> Tensor:
    if values.numel() == 0:
        return values.new_full((), float("nan"))
    ok = ~torch.isnan(values)
    return torch.where(ok.any(), reduce(torch.where(ok, values, neutral)), float("nan"))


# --------------------------------------------------------------------------------------------------
# The CUDA steps: the row statistics (``chunkloss.kernels.logprob``), the loss on the (C,) statistics, the
# gradient written in place.
def _grpo_scalings(opts: GRPOOptions) -> dict:
    return dict(logit_scale=opts.logit_scale, softcap=opts.softcap, temperature=opts.temperature)


def grpo_token(opts: GRPOOptions, logits, extra_logits, token, scalars, grad: bool = True):
    """``TOKEN`` (``grad``) or ``TOKEN_VALUE``: ``grad_and_value(grpo_chunk)``."""
    from chunkloss.kernels.logprob import row_grad_from_loss_

    logp, ent, ref, rows = _row_logprobs(logits, extra_logits, token, opts, kernel_row_statistics)
    with torch.enable_grad():
        logp.requires_grad_(grad)
        ent.requires_grad_(grad and opts.entropy_coef != 0)
        old = logp.detach() if token.old_logps is None else token.old_logps
        loss, m, clip = _row_loss(logp, ent, ref, logp - old, token, scalars, opts)
    metrics = _add_clip_metrics(m, clip, token, scalars)
    if not grad:
        return None, loss, metrics
    row_grad_from_loss_(
        logits, token.ids, loss, rows.logp, lse=rows.lse, entropy=rows.entropy, **_grpo_scalings(opts)
    )
    return logits, loss.detach(), metrics


def grpo_stats(opts: GRPOOptions, logits, extra_logits, token):
    """``STATS``: ``grpo_token_stats``, and the rows' statistics for ``SEQ_PASS2`` on these logits."""
    logp, ent, ref, rows = _row_logprobs(logits, extra_logits, token, opts, kernel_row_statistics)
    return torch.stack([logp, ent] if ref is None else [logp, ent, ref], dim=1), rows


def grpo_pass2(opts: GRPOOptions, logits, extra_logits, token, coef, rows=None):
    """``SEQ_PASS2``: ``grad((grpo_token_stats * coef).sum())`` over the logits (the reference column carries
    no gradient, the entropy one only with the entropy bonus). ``rows``: as for ``preference_pass2``."""
    from chunkloss.kernels.logprob import row_grad_

    coef_ent = coef[:, 1].contiguous() if opts.entropy_coef != 0 else None
    a = coef[:, 0].contiguous()
    saved = saved_statistics(rows)
    return row_grad_(logits, token.ids, a, coef_entropy=coef_ent, **saved, **_grpo_scalings(opts))


register_gpu_steps(
    FusedLinearGRPOLoss,
    {
        StepKind.TOKEN: grpo_token,
        StepKind.TOKEN_VALUE: functools.partial(grpo_token, grad=False),
        StepKind.STATS: grpo_stats,
        StepKind.SEQ_PASS2: grpo_pass2,
    },
    math=("chunk_loss", "token_stats"),
)
