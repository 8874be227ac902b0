"""Unchunked fp32 PyTorch versions of every chunkloss loss: the ground truth for tests and benchmarks.

Each function materialises the full logits in fp32 and writes the formula the way the upstream
function it mirrors does (named in each docstring). They return ``(loss, metrics)`` with metrics by
the same names the chunked loss reports. Sections are appended per loss; keep one function per loss.
"""

from __future__ import annotations

import math  # noqa: F401  (used by later sections)

import torch
import torch.nn.functional as F
from torch import Tensor

from chunkloss.losses.common import scale_logits


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
    metrics = {}
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
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    labels,
    student_bias=None,
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
    z_s = logits_ref(student_hidden, student_weight, student_bias)
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
    return loss, {"soft_loss": soft, "hard_loss": hard, "entropy": entropy}
