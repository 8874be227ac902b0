"""Unchunked fp32 PyTorch versions of every chunkloss loss: the ground truth for tests and benchmarks.

Each function materialises the full logits in fp32 and writes the formula the way the upstream
function it mirrors does (named in each docstring). They return ``(loss, metrics)`` with metrics by
the same names the chunked loss reports. Sections are appended per loss; keep one function per loss.
"""

from __future__ import annotations

import math  # noqa: F401  (used by later sections)
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from chunkloss.losses.common import scale_logits
from chunkloss.losses.grpo_options import ClipMetrics, GRPOLossType, Normaliser, PolicyTerm


def logits_ref(hidden: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """fp32 logits ``hidden @ weight.T + bias`` (..., V)."""
    z = hidden.float() @ weight.float().t()
    return z + bias.float() if bias is not None else z


# --- cross-entropy -------------------------------------------------------------------------------
def cross_entropy_ref(
    hidden,
    weight,
    labels,
    bias=None,
    *,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    lse_square_scale=0.0,
    softcap=None,
    temperature=1.0,
    logit_scale=1.0,
    num_items_in_batch=None,
):
    """``F.cross_entropy`` on fp32 logits (plus z-loss), as transformers' ``ForCausalLMLoss`` divides
    by ``num_items_in_batch``. 'mean' over zero valid rows gives 0 instead of torch's NaN."""
    z = scale_logits(logits_ref(hidden, weight, bias), logit_scale, softcap, temperature)
    z = z.reshape(-1, z.shape[-1])
    y = labels.reshape(-1)
    valid = y != ignore_index
    per_row = F.cross_entropy(
        z, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    lse = torch.logsumexp(z, -1)
    n_valid = valid.sum().clamp(min=1)
    metrics = {"num_tokens": valid.sum().float()}
    if lse_square_scale > 0:
        z_loss = lse_square_scale * lse.square() * valid
        per_row = per_row + z_loss
        metrics["z_loss"] = z_loss.sum() / n_valid
    per_row = per_row * valid
    if reduction == "none":
        loss = per_row.view(labels.shape)
    elif num_items_in_batch is not None:
        loss = per_row.sum() / num_items_in_batch
    elif reduction == "sum":
        loss = per_row.sum()
    else:
        loss = per_row.sum() / n_valid
    metrics["mean_token_accuracy"] = ((z.argmax(-1) == y) & valid).sum() / n_valid
    p = torch.softmax(z, -1)
    metrics["entropy"] = ((lse - (p * z).sum(-1)) * valid).sum() / n_valid
    return loss, metrics


# --- generalized JSD (distillation) ----------------------------------------------------------------
def jsd_ref(
    hidden,
    weight,
    teacher_hidden,
    teacher_weight,
    labels,
    bias=None,
    teacher_bias=None,
    *,
    beta=0.5,
    temperature=1.0,
    weight_hard_loss=0.0,
    weight_soft_loss=1.0,
    ignore_index=-100,
    reduction="batchmean",
    student_logit_scale=1.0,
    teacher_logit_scale=1.0,
    student_softcap=None,
    teacher_softcap=None,
    num_items_in_batch=None,
):
    """TRL's ``GKDTrainer.generalized_jsd_loss`` on fp32 logits (mixture by ``logsumexp`` of the
    stacked weighted log-probs, ``F.kl_div(..., log_target=True)``), each head first scaled as the
    ``DistillationTrainer`` does, plus Liger's hard-label CE on the student's untempered logits."""
    z_s = logits_ref(hidden, weight, bias)
    z_t = logits_ref(teacher_hidden, teacher_weight, teacher_bias)
    z_s = scale_logits(z_s, student_logit_scale, student_softcap)
    z_t = scale_logits(z_t, teacher_logit_scale, teacher_softcap)
    z_s, z_t = z_s.reshape(-1, z_s.shape[-1]), z_t.reshape(-1, z_t.shape[-1])
    y = labels.reshape(-1)
    valid = y != ignore_index
    log_s = F.log_softmax(z_s / temperature, dim=-1)
    log_t = F.log_softmax(z_t / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(log_s, log_t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(log_t, log_s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=log_s.dtype, device=log_s.device)
        log_m = torch.logsumexp(torch.stack([log_s + torch.log1p(-b), log_t + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(log_m, log_t, reduction="none", log_target=True) + (1 - b) * F.kl_div(
            log_m, log_s, reduction="none", log_target=True
        )
    per_row = jsd.sum(-1) * valid
    n_valid = valid.sum().clamp(min=1)
    if num_items_in_batch is not None:
        denom = num_items_in_batch
    elif reduction == "batchmean":
        denom = n_valid
    elif reduction == "mean":
        denom = n_valid * z_s.shape[-1]
    else:
        denom = 1
    soft = per_row.sum() / denom
    hard = F.cross_entropy(z_s, y, ignore_index=ignore_index, reduction="sum") / denom
    loss = weight_soft_loss * soft + (weight_hard_loss * hard if weight_hard_loss != 0 else 0.0)
    entropy = (-(log_s.exp() * log_s).sum(-1) * valid).sum() / n_valid
    return loss, {"num_tokens": valid.sum().float(), "soft_loss": soft, "hard_loss": hard, "entropy": entropy}


# --------------------------------------------------------------------------------------------------
# GRPO: a transcription of TRL 1.16 GRPOTrainer._compute_loss (trl/trainer/grpo_trainer.py), loss part,
# on (B, T) per-token tensors; tests/losses/test_grpo.py checks it against TRL's own method.
def grpo_logps_ref(hidden, weight, bias, completion_ids, temperature=1.0, logit_scale=1.0, softcap=None):
    """fp32 per-token ``(logp, entropy)`` (B, T) of ``hidden @ weight.T + bias`` times ``logit_scale``,
    softcapped ``softcap·tanh(z/softcap)``, then divided by ``temperature``."""
    z = hidden.float() @ weight.float().t()
    if bias is not None:
        z = z + bias.float()
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, completion_ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _entropy_mask_ref(entropies, mask, top_entropy_quantile):
    """TRL's entropy mask: the completion tokens at or above the (1 - ρ) quantile of their entropies."""
    if top_entropy_quantile >= 1.0:
        return None
    local = entropies.detach()[mask.bool()].float()
    if local.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    thr = torch.quantile(local, 1 - top_entropy_quantile)
    return ((entropies.detach() * mask) >= thr) & mask.bool()


def _vespo_phi_ref(log_ratio, mask, adv, importance_sampling_ratio, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's per-sequence weight φ(W) (B, 1), without grad (TRL's ``get_gamma_weights``)."""
    with torch.no_grad():
        lrc = torch.clamp(log_ratio.detach(), -20.0, 20.0)
        slr = (lrc * mask).sum(-1, keepdim=True)
        if importance_sampling_ratio is not None:
            log_is = torch.clamp(torch.log(importance_sampling_ratio), math.log(1e-8), 20.0)
            slr = slr + log_is.sum(-1, keepdim=True)
        lw = torch.clamp(slr, math.log(1e-8), 20.0)
        nonneg = adv >= 0
        k = torch.where(nonneg, k_pos, k_neg)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
        phi_seq = torch.exp(lam + k * lw - lam * torch.exp(lw))
        return phi_seq.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _grpo_metrics_ref(mask, adv, c1, entropies, kl, loss_type: GRPOLossType, epsilon_low, eps_hi, phi_seq):
    """TRL's logged GRPO metrics of one process (``kl`` when given, ``entropy``, the clip ratios)."""

    def seq_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    def global_mean(x):
        if x.shape[1] == 1:
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum().float().clamp(min=1.0)

    def nan_red(x, fn):
        x = x[~torch.isnan(x)]
        return fn(x) if x.numel() else torch.tensor(float("nan"))

    metrics = {}
    if kl is not None:
        metrics["kl"] = global_mean(kl)
    metrics["entropy"] = global_mean(entropies.detach())
    if loss_type.clip_metrics is ClipMetrics.CLIP_RATIO:
        low = ((c1 < 1 - epsilon_low) & (adv < 0)).float()
        high = ((c1 > 1 + eps_hi) & (adv > 0)).float()
        metrics["clip_ratio/low_mean"] = global_mean(low)
        metrics["clip_ratio/high_mean"] = global_mean(high)
        metrics["clip_ratio/region_mean"] = global_mean(torch.maximum(low, high))
        metrics["clip_ratio/low_min"] = nan_red(seq_mean(low), torch.min)
        metrics["clip_ratio/high_max"] = nan_red(seq_mean(high), torch.max)
    elif loss_type.clip_metrics is ClipMetrics.CISPO:
        metrics["cispo_clip_ratio"] = global_mean(((c1 > eps_hi) & (adv > 0)).float())
    elif loss_type.clip_metrics is ClipMetrics.VESPO_PHI:
        metrics["vespo/phi_seq_mean"] = global_mean(phi_seq)
    return metrics


def _grpo_normalised_ref(
    per_token_loss, mask, loss_type: GRPOLossType, num_items, num_processes, ga, spg, max_len
):
    """The masked per-token loss summed and normalised per ``loss_type``, as TRL 1.16 does."""
    kind = loss_type.normaliser
    if kind is Normaliser.SEQUENCE_MEAN:
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
    if kind is Normaliser.LOCAL_TOKENS:
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / ga
    if kind is Normaliser.MAX_LENGTH:
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len) / ga
    if kind is Normaliser.SEQUENCES:
        return (per_token_loss * mask).sum(-1).mean() / ga
    # Normaliser.GLOBAL_TOKENS
    return (per_token_loss * mask).sum() / (num_items.clamp(min=1.0) / num_processes * ga / spg)


def _grpo_policy_term_ref(
    loss_type: GRPOLossType, logps, log_ratio, coef_1, adv, mask, isr, eps_lo, eps_hi, delta, sapo, vespo
):
    """TRL's per-token policy loss of ``loss_type`` (B, T), the ratio its metrics read (``coef_1``, clamped at
    ``delta`` for the clipped types, as TRL), and VESPO's per-sequence φ (``None`` otherwise).
    ``isr``: the importance-sampling ratio or ``None``; ``sapo``: (temperature_pos, temperature_neg);
    ``vespo``: (k_pos, lambda_pos, k_neg, lambda_neg)."""
    term = loss_type.term
    if term is PolicyTerm.CISPO:
        return -torch.clamp(coef_1, max=eps_hi).detach() * adv * logps, coef_1, None
    if term is PolicyTerm.CLIP:
        coef_2 = torch.clamp(coef_1, 1 - eps_lo, 1 + eps_hi)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        return -torch.min(coef_1 * adv, coef_2 * adv), coef_1, None
    if term is PolicyTerm.SAPO:
        temps = torch.where(adv > 0, *sapo)
        return -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * adv, coef_1, None
    if term is PolicyTerm.VESPO:
        phi_seq = _vespo_phi_ref(log_ratio, mask, adv, isr, *vespo)
        return -phi_seq * adv * logps, coef_1, phi_seq
    raise ValueError(f"unknown policy term {term}")


def grpo_loss_from_logps_ref(
    logps,  # (B, T) with grad
    entropies,  # (B, T)
    completion_mask,  # (B, T)
    advantages,  # (B,) or (B, T)
    *,
    old_logps=None,
    ref_logps=None,
    importance_sampling_ratio=None,
    sampling_logps=None,
    tool_mask=None,
    num_items_in_batch=None,
    num_processes=1,
    gradient_accumulation_steps=1,
    steps_per_generation=None,
    loss_type="dapo",
    beta=0.0,
    epsilon_low=0.2,
    epsilon_high=None,
    delta=None,
    importance_sampling_level="token",
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    use_bias_correction_kl=True,
    off_policy_mask_threshold=None,
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    max_completion_length=None,
    **_,
):
    """TRL 1.16's GRPO loss and its metrics (one process, train mode), in fp32."""
    try:
        loss_type = GRPOLossType(loss_type)
    except ValueError:
        raise ValueError(f"unknown loss_type {loss_type!r}") from None
    mask = completion_mask.float() if tool_mask is None else (completion_mask * tool_mask).float()
    eps_hi = epsilon_low if epsilon_high is None else epsilon_high
    ga = gradient_accumulation_steps
    spg = ga if steps_per_generation is None else steps_per_generation
    num_items = mask.sum() if num_items_in_batch is None else num_items_in_batch
    num_items_in_batch = torch.as_tensor(num_items, dtype=torch.float32)
    entropy_mask = _entropy_mask_ref(entropies, mask, top_entropy_quantile)
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    if off_policy_mask_threshold is not None:
        samp = old if sampling_logps is None else sampling_logps
        kl_div = torch.nan_to_num(samp - logps.detach(), nan=0.0)
        avg = (kl_div * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((adv >= 0) | (avg <= off_policy_mask_threshold)).float()
    log_ratio = logps - old
    if importance_sampling_level == "token":
        log_w = log_ratio
    else:
        seq = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        log_w = seq if importance_sampling_level == "sequence" else logps - logps.detach() + seq.detach()
    coef_1 = torch.exp(log_w)
    if beta != 0.0:
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    sapo = (sapo_temperature_pos, sapo_temperature_neg)
    vespo = (vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
    per_token_loss, coef_1, phi_seq = _grpo_policy_term_ref(
        loss_type,
        logps,
        log_ratio,
        coef_1,
        adv,
        mask,
        importance_sampling_ratio,
        epsilon_low,
        eps_hi,
        delta,
        sapo,
        vespo,
    )
    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_sampling_ratio is not None and not loss_type.sequence_weight:
        isr = importance_sampling_ratio
        per_token_loss = per_token_loss * (isr.unsqueeze(1) if isr.dim() == 1 else isr)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    counts = (num_items_in_batch, num_processes, ga, spg, max_completion_length)
    loss = _grpo_normalised_ref(per_token_loss, mask, loss_type, *counts)
    policy_loss = loss.detach() * (1.0 if loss_type.global_count else ga)
    if entropy_coef != 0.0:
        eff = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - entropy_coef * (entropies * eff).sum() / eff.sum().clamp(min=1.0) / ga

    kl = per_token_kl.detach() if beta != 0.0 else None
    metrics = _grpo_metrics_ref(
        mask,
        adv,
        coef_1.detach(),
        entropies,
        kl,
        loss_type,
        epsilon_low,
        eps_hi,
        phi_seq,
    )
    if entropy_coef != 0.0:
        metrics["policy_loss"] = policy_loss
    return loss, metrics


def grpo_ref(
    hidden,
    weight,
    completion_ids,
    completion_mask,
    advantages,
    bias=None,
    *,
    ref_hidden=None,
    ref_weight=None,
    ref_bias=None,
    ref_logps=None,
    temperature=1.0,
    logit_scale=1.0,
    softcap=None,
    **kw,
):
    """fp32 GRPO loss of the materialised logits (and reference head): (loss, metrics)."""
    tf = dict(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    logp, ent = grpo_logps_ref(hidden, weight, bias, completion_ids, **tf)
    if ref_hidden is not None:
        with torch.no_grad():
            ref_logps, _ = grpo_logps_ref(ref_hidden, ref_weight, ref_bias, completion_ids, **tf)
    return grpo_loss_from_logps_ref(logp, ent, completion_mask, advantages, ref_logps=ref_logps, **kw)


# --- RLOO: a transcription of TRL 1.16 RLOOTrainer._compute_loss (trl/trainer/rloo_trainer.py), loss part --
# tests/losses/test_rloo.py checks it against TRL's own method.
def rloo_loss_from_logps_ref(
    logps, entropies, completion_mask, advantages, *, old_logps=None, epsilon_low=0.2, epsilon_high=None, **_
):
    """TRL 1.16's RLOO loss and its metrics (one process) from per-token ``logps`` (B, T) with grad, in fp32;
    ``old_logps`` (B,) the sampling policy's summed log-probs (``None``: the current ones, detached)."""
    mask = completion_mask.float()
    eps_hi = epsilon_low if epsilon_high is None else epsilon_high
    logps_seq = (logps * mask).sum(1)
    old = logps_seq.detach() if old_logps is None else old_logps
    adv = advantages.float()
    coef_1 = torch.exp(logps_seq - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + eps_hi)
    loss = -torch.min(coef_1 * adv, coef_2 * adv).mean()
    c = coef_1.detach()
    low = ((c < 1 - epsilon_low) & (adv < 0)).float()
    high = ((c > 1 + eps_hi) & (adv > 0)).float()
    metrics = {
        "entropy": (entropies.detach() * mask).sum() / mask.sum().clamp(min=1.0),
        "clip_ratio/low_mean": low.mean(),
        "clip_ratio/low_min": low.min(),
        "clip_ratio/high_mean": high.mean(),
        "clip_ratio/high_max": high.max(),
        "clip_ratio/region_mean": torch.maximum(low, high).mean(),
    }
    return loss, metrics


def rloo_ref(
    hidden,
    weight,
    completion_ids,
    completion_mask,
    advantages,
    bias=None,
    *,
    temperature=1.0,
    logit_scale=1.0,
    softcap=None,
    **kw,
):
    """fp32 RLOO loss of the materialised logits: (loss, metrics)."""
    tf = dict(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    logp, ent = grpo_logps_ref(hidden, weight, bias, completion_ids, **tf)
    return rloo_loss_from_logps_ref(logp, ent, completion_mask, advantages, **kw)


# --- preference losses (DPO, ORPO, CPO, SimPO) ----------------------------------------------------
def _pref_token_logps(hidden, weight, bias, labels, ignore_index, logit_scale=1.0, softcap=None):
    """fp32 logits (times ``logit_scale``, then softcapped), per-token label log-probs (0 where
    ignored) and the label mask of (S, T) labels."""
    z = logits_ref(hidden, weight, bias) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    mask = labels != ignore_index
    logp = torch.log_softmax(z, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    return z, logp, mask


def _pref_logps(
    hidden,
    weight,
    bias,
    chosen,
    rejected,
    ignore_index,
    average,
    ld_alpha=None,
    logit_scale=1.0,
    softcap=None,
):
    """Per-sequence log-probs (2B,) as TRL sums them (``ld_alpha``: DPOTrainer's shared/tail split)."""
    labels = torch.cat([chosen, rejected])
    z, logp, mask = _pref_token_logps(hidden, weight, bias, labels, ignore_index, logit_scale, softcap)
    if ld_alpha is None:
        seq = logp.sum(-1)
    else:
        pos = mask.cumsum(1)
        lens = mask.sum(1)
        c_len, r_len = lens.chunk(2)
        shared = torch.minimum(c_len, r_len).repeat(2).unsqueeze(1)
        seq = (logp * ((pos > 0) & (pos <= shared))).sum(1) + ld_alpha * (logp * (pos > shared)).sum(1)
    n = mask.sum(-1)
    if average:
        seq = seq / n.clamp(min=1)
    return seq, z, logp, mask


def _pref_metrics(seq, reward, z, mask, beta, labels=None, logit_rows=None):
    """TRL's preference metrics (means over pairs; logits/* over completion tokens or ``logit_rows``);
    with ``labels`` (2B, T) also DPOTrainer's entropy (completion tokens) and mean_token_accuracy
    (top-1 over the chosen completion tokens)."""
    c_lp, r_lp = seq.detach().chunk(2)
    rc, rr = reward.detach().chunk(2)
    lmask = mask if logit_rows is None else logit_rows.bool()
    zm = z.detach().mean(-1) * lmask
    mc, mr = lmask.chunk(2)
    extra = {}
    if labels is not None:
        zd = z.detach()
        lp_all = torch.log_softmax(zd, -1)
        ent = -(lp_all.exp() * lp_all).sum(-1)
        extra["entropy"] = (ent * mask).sum() / mask.sum().clamp(min=1)
        top1 = (zd.argmax(-1) == labels) & mask
        extra["mean_token_accuracy"] = top1.chunk(2)[0].sum() / mask.chunk(2)[0].sum().clamp(min=1)
    return extra | {
        "rewards/chosen": rc.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/accuracies": (rc > rr).float().mean(),
        "rewards/margins": (rc - rr).mean(),
        "logps/chosen": c_lp.mean(),
        "logps/rejected": r_lp.mean(),
        "logits/chosen": zm.chunk(2)[0].sum() / mc.sum().clamp(min=1),
        "logits/rejected": zm.chunk(2)[1].sum() / mr.sum().clamp(min=1),
    }


def _f_score_ref(x, kind, alpha):
    """TRL's f-divergence score f'(exp x) of a log-ratio."""
    if kind == "forward_kl":
        return 1 - torch.exp(-x)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(x)
    if kind == "alpha_divergence" and abs(alpha - 1) >= 1e-6:
        return (torch.exp(torch.clamp((alpha - 1) * x, max=80.0)) - 1) / (alpha - 1)
    return x


def _dpo_type_ref(t, p, b, eps, tau):
    """Per-pair loss of one ``loss_type`` of ``DPOTrainer._compute_loss`` (TRL 1.16), from the pair's values
    ``p``."""
    d, lc, lr = p.d, p.lc, p.lr
    if t == "sigmoid":
        return -F.logsigmoid(b * d)
    if t == "hinge":
        return torch.relu(1 - b * d)
    if t == "ipo":
        return (p.sc / p.nc - p.sr / p.nr - 1 / (2 * b)) ** 2
    if t == "exo_pair":
        return torch.sigmoid(b * d) * (F.logsigmoid(b * d) - math.log1p(-eps)) + torch.sigmoid(-b * d) * (
            F.logsigmoid(-b * d) - math.log(eps)
        )
    if t == "nca_pair":
        return -F.logsigmoid(b * lc) - 0.5 * F.logsigmoid(-b * lc) - 0.5 * F.logsigmoid(-b * lr)
    if t == "robust":
        return (-(1 - eps) * F.logsigmoid(b * d) + eps * F.logsigmoid(-b * d)) / (1 - 2 * eps)
    if t == "bco_pair":
        return -F.logsigmoid(b * lc) - F.logsigmoid(-b * lr)
    if t == "sppo_hard":
        return (lc - 0.5 / b) ** 2 + (lr + 0.5 / b) ** 2
    if t in ("aot", "aot_unpaired"):
        x, y = (p.c - p.r, p.ref_c - p.ref_r) if t == "aot" else (lc, lr)
        delta = torch.sort(x, 0)[0] - torch.sort(y, 0)[0]
        return -F.logsigmoid(b * delta) * (1 - eps) - F.logsigmoid(-b * delta) * eps
    if t == "apo_zero":
        return 1 - torch.sigmoid(b * lc) + torch.sigmoid(b * lr)
    if t == "apo_down":
        return torch.sigmoid(b * lc) + 1 - torch.sigmoid(b * (lc - lr))
    if t == "discopop":
        x = b * d
        mod = torch.sigmoid(x / tau)
        return -F.logsigmoid(x) * (1 - mod) + torch.exp(-x) * mod
    if t == "sft":
        return p.sft.expand(p.c.shape[0])
    if t == "sigmoid_norm":
        return -F.logsigmoid(b * (p.sc / p.nc - p.sr / p.nr))
    raise ValueError(t)


def dpo_ref(
    hidden,  # (2B, T, H)
    weight,
    chosen,  # (B, T)
    rejected,
    bias=None,
    *,
    ref_hidden=None,
    ref_weight=None,
    ref_bias=None,
    ref_chosen_logps=None,
    ref_rejected_logps=None,
    beta=0.1,
    loss_type="sigmoid",
    loss_weights=None,
    label_smoothing=0.0,
    f_divergence_type="reverse_kl",
    f_alpha_divergence_coef=0.5,
    ld_alpha=None,
    use_weighting=False,
    discopop_tau=0.05,
    average_log_prob=False,
    ignore_index=-100,
    logit_scale=1.0,
    softcap=None,
    return_token_metrics=False,
    logit_rows=None,
):
    """The loss of ``trl.DPOTrainer._compute_loss`` (TRL 1.16) on fp32 logits, written out per loss
    type; reference-free when no reference is given. ``logit_scale``/``softcap`` transform the policy
    and reference logits alike."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = loss_weights or [1.0] * len(types)
    seq, z, logp, mask = _pref_logps(
        hidden, weight, bias, chosen, rejected, ignore_index, average_log_prob, ld_alpha, logit_scale, softcap
    )
    if ref_hidden is not None:
        with torch.no_grad():
            ref = _pref_logps(
                ref_hidden,
                ref_weight,
                ref_bias,
                chosen,
                rejected,
                ignore_index,
                average_log_prob,
                ld_alpha,
                logit_scale,
                softcap,
            )[0]
    elif ref_chosen_logps is not None:
        ref = torch.cat([ref_chosen_logps, ref_rejected_logps]).float()
    else:
        ref = torch.zeros_like(seq)
    c, r = seq.chunk(2)
    ref_c, ref_r = ref.chunk(2)
    lc, lr = c - ref_c, r - ref_r

    sc = _f_score_ref(lc, f_divergence_type, f_alpha_divergence_coef)
    sr = _f_score_ref(lr, f_divergence_type, f_alpha_divergence_coef)
    mc, mr = mask.chunk(2)
    sft = -logp.chunk(2)[0].sum() / mc.sum().clamp(min=1)
    pair = SimpleNamespace(
        c=c,
        r=r,
        ref_c=ref_c,
        ref_r=ref_r,
        lc=lc,
        lr=lr,
        sc=sc,
        sr=sr,
        d=sc - sr,
        nc=mc.sum(1).clamp(min=1),
        nr=mr.sum(1).clamp(min=1),
        sft=sft,
    )
    loss = 0.0
    for t, wt in zip(types, weights):
        per = _dpo_type_ref(t, pair, beta, label_smoothing, discopop_tau)
        if use_weighting:
            with torch.no_grad():
                lse = torch.logsumexp(z, -1)
                aligned = (logp - (torch.logsumexp(2 * z, -1) - 2 * lse)) * mask
                wts = torch.exp(aligned.sum(1) / mask.sum(1).clamp(min=1))
            per = per * wts.chunk(2)[0] * wts.chunk(2)[1]
        loss = loss + per.mean() * wt
    labels = torch.cat([chosen, rejected]) if return_token_metrics else None
    return loss, _pref_metrics(seq, beta * (seq - ref), z, mask, beta, labels, logit_rows)


def _nll_chosen(z, nll_labels, ignore_index):
    zc = z[: nll_labels.shape[0]]
    valid = nll_labels != ignore_index
    nll = F.cross_entropy(
        zc.reshape(-1, zc.shape[-1]), nll_labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    return nll / valid.sum().clamp(min=1)


def orpo_ref(
    hidden,
    weight,
    chosen,
    rejected,
    bias=None,
    *,
    nll_labels=None,
    beta=0.1,
    ignore_index=-100,
    logit_scale=1.0,
    softcap=None,
    return_token_metrics=False,
    logit_rows=None,
):
    """``ORPOTrainer.get_batch_loss_metrics`` (TRL 1.16) on fp32 logits; ``logits/*`` averaged over
    completion tokens; a pair with an empty completion adds 0 to the odds-ratio term."""
    seq, z, logp, mask = _pref_logps(
        hidden, weight, bias, chosen, rejected, ignore_index, True, logit_scale=logit_scale, softcap=softcap
    )
    c, r = seq.chunk(2)
    valid = (mask.chunk(2)[0].any(1)) & (mask.chunk(2)[1].any(1))
    cs, rs = torch.where(valid, c, -1.0), torch.where(valid, r, -1.0)

    def log1mexp(x):
        return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))

    log_odds = torch.where(valid, (cs - rs) - (log1mexp(cs) - log1mexp(rs)), 0.0)
    ratio = torch.where(valid, F.logsigmoid(log_odds), 0.0)
    nll = _nll_chosen(z, chosen if nll_labels is None else nll_labels, ignore_index)
    loss = nll - (beta * ratio).mean()
    labels = torch.cat([chosen, rejected]) if return_token_metrics else None
    metrics = _pref_metrics(seq, beta * seq, z, mask, beta, labels, logit_rows)
    metrics.update(
        nll_loss=nll.detach(), log_odds_ratio=ratio.detach().mean(), log_odds_chosen=log_odds.detach().mean()
    )
    return loss, metrics


def cpo_ref(
    hidden,
    weight,
    chosen,
    rejected,
    bias=None,
    *,
    nll_labels=None,
    beta=0.1,
    loss_type="sigmoid",
    label_smoothing=0.0,
    cpo_alpha=1.0,
    simpo_gamma=0.5,
    alpha=0.0,
    ignore_index=-100,
    logit_scale=1.0,
    softcap=None,
    return_token_metrics=False,
    logit_rows=None,
):
    """``CPOTrainer.cpo_loss`` + NLL (TRL 1.16) on fp32 logits; SimPO is ``loss_type="simpo"``."""
    seq, z, logp, mask = _pref_logps(
        hidden,
        weight,
        bias,
        chosen,
        rejected,
        ignore_index,
        loss_type in ("ipo", "simpo"),
        logit_scale=logit_scale,
        softcap=softcap,
    )
    c, r = seq.chunk(2)
    if alpha != 0.0:
        c, r = (1 - torch.exp(c).pow(-alpha)) / alpha, (1 - torch.exp(r).pow(-alpha)) / alpha
    u = c - r
    eps = label_smoothing
    if loss_type == "simpo":
        u = u - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        per = -F.logsigmoid(beta * u) * (1 - eps) - F.logsigmoid(-beta * u) * eps
    elif loss_type == "hinge":
        per = torch.relu(1 - beta * u)
    else:
        per = (u - 1 / (2 * beta)) ** 2
    loss = per.mean()
    labels = torch.cat([chosen, rejected]) if return_token_metrics else None
    metrics = _pref_metrics(seq, beta * torch.cat([c, r]), z, mask, beta, labels, logit_rows)
    if cpo_alpha != 0:  # no NLL term: its rows are not even projected
        nll = _nll_chosen(z, chosen if nll_labels is None else nll_labels, ignore_index)
        loss = loss + cpo_alpha * nll
        metrics["nll_loss"] = nll.detach()
    return loss, metrics


# --- KTO ---------------------------------------------------------------------------------------------
def kto_ref(
    hidden,
    weight,
    labels,
    desirable,
    bias=None,
    *,
    ref_logps,
    kl_logps=None,
    ref_kl_logps=None,
    kl_gather=None,
    beta=0.1,
    loss_type="kto",
    desirable_weight=1.0,
    undesirable_weight=1.0,
    ignore_index=-100,
    logit_scale=1.0,
    softcap=None,
    return_token_metrics=False,
):
    """``trl.KTOTrainer._compute_loss`` (TRL 1.16) on fp32 logits, written as it is there: the completions
    split by ``desirable``, the KL term detached, gathered (``kl_gather``), averaged and clamped at 0, the
    losses of both sides concatenated and averaged. A side with no completion gives metrics of 0."""
    z, logp, mask = _pref_token_logps(hidden, weight, bias, labels, ignore_index, logit_scale, softcap)
    logps = logp.sum(-1)
    if loss_type == "kto":
        kl = (kl_logps - ref_kl_logps).mean().detach()
        kl = (kl if kl_gather is None else kl_gather(kl)).mean().clamp(min=0)
    else:
        kl = torch.zeros(())
    chosen_idx = torch.nonzero(desirable.bool()).view(-1)
    rejected_idx = torch.nonzero(~desirable.bool()).view(-1)
    chosen_logratios = logps.index_select(0, chosen_idx) - ref_logps.index_select(0, chosen_idx)
    rejected_logratios = logps.index_select(0, rejected_idx) - ref_logps.index_select(0, rejected_idx)
    if loss_type == "kto":
        chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
        rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    else:  # apo_zero_unpaired
        chosen_losses = 1 - F.sigmoid(beta * chosen_logratios)
        rejected_losses = F.sigmoid(beta * rejected_logratios)
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    loss = losses.nanmean() if losses.numel() else losses.sum()

    def mean(x):
        return x.sum() / max(x.numel(), 1)

    zm = z.detach().mean(-1)
    rewards_c, rewards_r = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    metrics = {
        "rewards/chosen": mean(rewards_c),
        "rewards/rejected": mean(rewards_r),
        "rewards/margins": mean(rewards_c) - mean(rewards_r),
        "logps/chosen": mean(logps.detach().index_select(0, chosen_idx)),
        "logps/rejected": mean(logps.detach().index_select(0, rejected_idx)),
        "logits/chosen": mean(zm.index_select(0, chosen_idx)[mask.index_select(0, chosen_idx)]),
        "logits/rejected": mean(zm.index_select(0, rejected_idx)[mask.index_select(0, rejected_idx)]),
        "kl": kl,
    }
    if return_token_metrics:
        lp_all = torch.log_softmax(z.detach(), -1)
        entropy = -(lp_all.exp() * lp_all).sum(-1)
        metrics["entropy"] = mean(entropy[mask])
    return loss, metrics
