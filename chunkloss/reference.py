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
