"""The losses' per-chunk steps on CUDA: Triton kernels of ``chunkloss.kernels`` instead of compiled graphs.

Each adapter turns a loss's options into the kernel's plain arguments and returns what the step kind returns
(``chunkloss.engine.steps``); each computes its loss's own math (``math`` below), so a subclass that
replaces that math keeps the compiled steps. Triton is imported only when a step first runs on CUDA.

==========================  ==========================  ==================================================
loss                        steps                       kernel
==========================  ==========================  ==================================================
cross-entropy, multi-token  TOKEN, TOKEN_ROWS           ``kernels/cross_entropy.py`` (two reads per row)
DFT (SFT)                   TOKEN                       ``kernels/logprob.py`` (statistics, gradient)
JSD                         TOKEN                       ``kernels/jsd.py`` (three reads of each head)
preference (DPO, ORPO, …)   STATS, SEQ_PASS2            ``kernels/logprob.py`` (row statistics, gradient)
GRPO                        TOKEN, TOKEN_VALUE,         ``kernels/logprob.py``, the loss on the (C,)
                            STATS, SEQ_PASS2            statistics in between
==========================  ==========================  ==================================================
"""

from __future__ import annotations

import functools

import torch

from chunkloss.engine import StepKind, register_gpu_steps
from chunkloss.losses import cross_entropy, dft, grpo, jsd, multi_token, preference
from chunkloss.losses.preference import LOGP, LOGP_RAW, NLL

__all__: list[str] = []


# --------------------------------------------------------------------------------------------------
# Cross-entropy: one kernel reads the chunk's logits twice and writes the gradient over them.
def _cross_entropy_rows(opts: cross_entropy.CrossEntropyOptions, logits, token, normaliser, row_weight=None):
    from chunkloss.kernels.cross_entropy import cross_entropy_step

    same = ("label_smoothing", "lse_square_scale", "softcap", "temperature", "logit_scale")
    return cross_entropy_step(
        logits,
        token["labels"],
        normaliser,
        None if row_weight is None else row_weight.float(),
        **{name: getattr(opts, name) for name in same},
        want_accuracy=opts.return_token_accuracy,
        want_entropy=opts.return_entropy,
    )


def cross_entropy_token(opts, logits, extra_logits, token, scalars):
    """``TOKEN``: ``grad_and_value(cross_entropy_chunk)``."""
    rows = _cross_entropy_rows(opts, logits, token, scalars["normaliser"])
    return (logits, *cross_entropy._chunk_sums(rows, token, scalars, opts))


def cross_entropy_token_rows(opts, logits, extra_logits, token, scalars, row_weight):
    """``TOKEN_ROWS`` (reduction='none', normaliser 1): the gradient of ``Σ_i w_i·ℓ_i``."""
    _cross_entropy_rows(opts, logits, token, scalars["normaliser"], row_weight)
    return logits


def multi_token_token(opts, logits, extra_logits, token, scalars):
    """Multi-token heads' ``TOKEN``: the cross-entropy kernel, each row weighted by its head's ``w_k/n_k``."""
    rows = _cross_entropy_rows(opts, logits, token, scalars["one"], token["row_weight"])
    return (logits, *multi_token._head_sums(rows, token, scalars, opts))


def multi_token_token_rows(opts, logits, extra_logits, token, scalars, row_weight):
    """Multi-token heads' ``TOKEN_ROWS`` (reduction='none'): the gradient of ``Σ_i row_weight_i·w_k·ℓ_i``."""
    _cross_entropy_rows(opts, logits, token, scalars["one"], row_weight * token["row_weight"])
    return logits


def dft_token(opts, logits, extra_logits, token, scalars):
    """The "token" step on CUDA: the rows' statistics from ``chunkloss.kernels.logprob`` (one read of the
    logits), the loss on them, and ``dL/dlogits = -sg(p_y)/n · (onehot - p)`` written in place (one more
    read)."""
    from chunkloss.kernels.logprob import row_grad_from_loss_, row_stats  # Triton is imported only on CUDA

    rows = row_stats(logits, token["labels"], **dft.row_kw(opts))
    with torch.enable_grad():
        rows["logp"].requires_grad_(True)
        loss, metrics = dft.dft_sums(rows, token, scalars, opts)
    scalings = dict(logit_scale=opts.logit_scale, softcap=opts.softcap, temperature=opts.temperature)
    row_grad_from_loss_(logits, token["labels"], rows, loss, **scalings)
    return logits, loss.detach(), metrics


# --------------------------------------------------------------------------------------------------
# JSD: one kernel reads both heads' logits three times, with no fp32 copy.
_JSD_KERNEL_OPTIONS = (
    "beta", "temperature", "weight_soft_loss", "weight_hard_loss",
    "student_logit_scale", "student_softcap", "teacher_logit_scale", "teacher_softcap",
)  # fmt: skip


def jsd_token(opts: jsd.JSDOptions, logits, extra_logits, token, scalars):
    """``TOKEN``: ``grad_and_value(jsd_chunk)``."""
    from chunkloss.kernels.jsd import jsd_step

    kernel_args = {name: getattr(opts, name) for name in _JSD_KERNEL_OPTIONS}
    rows = jsd_step(logits, extra_logits[0], token["labels"], scalars["normaliser"], **kernel_args)
    return (logits, *jsd._chunk_sums(rows, scalars, opts))


# --------------------------------------------------------------------------------------------------
# Preference losses: the row statistics in one read, the gradient in one more read and a write.
def preference_stats(opts: preference.PreferenceOptions, logits, extra_logits, token):
    """``STATS``: ``preference_token_stats``, and the rows' statistics for ``SEQ_PASS2`` on these logits."""
    from chunkloss.kernels.logprob import row_stats

    rows = row_stats(logits, token["labels"], **preference._row_request(token, opts))
    return preference._columns(rows, token, opts), rows


def preference_pass2(opts: preference.PreferenceOptions, logits, extra_logits, token, coef, rows=None):
    """``SEQ_PASS2``: ``grad((preference_token_stats * coef).sum())`` over the logits. Only the LOGP, LOGP_RAW
    and NLL columns carry a gradient (the others are detached or the reference's). ``rows``: the stats step's
    statistics of these logits in one pass, else read again."""
    from chunkloss.kernels.logprob import row_grad_

    a = coef[:, LOGP] * token["pref_weight"] + coef[:, LOGP_RAW] * token["pref_mask"]
    nll = {}
    if "nll_labels" in token:
        nll = dict(labels2=token["nll_labels"], coef2=(coef[:, NLL] * token["nll_mask"]).float().contiguous())
    return row_grad_(logits, token["labels"], a.float().contiguous(), **nll, stats=rows,
                     logit_scale=opts.logit_scale, softcap=opts.softcap)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# GRPO: the row statistics, the loss on the (C,) statistics, the gradient written in place.
def _grpo_scalings(opts: grpo.GRPOOptions) -> dict:
    return dict(logit_scale=opts.logit_scale, softcap=opts.softcap, temperature=opts.temperature)


def grpo_token(opts: grpo.GRPOOptions, logits, extra_logits, token, scalars, grad: bool = True):
    """``TOKEN`` (``grad``) or ``TOKEN_VALUE``: ``grad_and_value(grpo_chunk)``."""
    from chunkloss.kernels.logprob import row_grad_from_loss_, row_stats

    logp, ent, ref, rows = grpo._row_logprobs(logits, extra_logits, token, opts, row_stats)
    with torch.enable_grad():
        logp.requires_grad_(grad)
        ent.requires_grad_(grad and opts.entropy_coef != 0)
        old = token["old_logps"] if "old_logps" in token else logp.detach()
        loss, m = grpo._row_loss(logp, ent, ref, logp - old, token, scalars, opts)
    metrics = grpo._token_shaped_metrics(m, token, scalars)
    if not grad:
        return None, loss, metrics
    row_grad_from_loss_(logits, token["ids"], rows, loss, **_grpo_scalings(opts))
    return logits, loss.detach(), metrics


def grpo_stats(opts: grpo.GRPOOptions, logits, extra_logits, token):
    """``STATS``: ``grpo_token_stats``, and the rows' statistics for ``SEQ_PASS2`` on these logits."""
    from chunkloss.kernels.logprob import row_stats

    logp, ent, ref, rows = grpo._row_logprobs(logits, extra_logits, token, opts, row_stats)
    return torch.stack([logp, ent] if ref is None else [logp, ent, ref], dim=1), rows


def grpo_pass2(opts: grpo.GRPOOptions, logits, extra_logits, token, coef, rows=None):
    """``SEQ_PASS2``: ``grad((grpo_token_stats * coef).sum())`` over the logits (the reference column carries
    no gradient, the entropy one only with the entropy bonus). ``rows``: as for ``preference_pass2``."""
    from chunkloss.kernels.logprob import row_grad_

    coef_ent = coef[:, 1].contiguous() if opts.entropy_coef != 0 else None
    a = coef[:, 0].contiguous()
    return row_grad_(logits, token["ids"], a, coef_entropy=coef_ent, stats=rows, **_grpo_scalings(opts))


# --------------------------------------------------------------------------------------------------
# The two users of the cross-entropy kernel: a chunk's loss and its per-row losses.
for loss_cls, token_step, token_rows_step in (
    (cross_entropy.FusedLinearCrossEntropyLoss, cross_entropy_token, cross_entropy_token_rows),
    (multi_token.FusedLinearMultiTokenLoss, multi_token_token, multi_token_token_rows),
):
    steps = {StepKind.TOKEN: token_step, StepKind.TOKEN_ROWS: token_rows_step}
    register_gpu_steps(loss_cls, steps, math=("chunk_loss",))
# DFT is a cross-entropy subclass: its step runs on the row kernels, never the cross-entropy kernel.
register_gpu_steps(dft.FusedLinearDFTLoss, {StepKind.TOKEN: dft_token}, math=("chunk_loss",))
register_gpu_steps(jsd.FusedLinearJSDLoss, {StepKind.TOKEN: jsd_token}, math=("chunk_loss",))
register_gpu_steps(
    preference.FusedLinearPreferenceLoss,
    {StepKind.STATS: preference_stats, StepKind.SEQ_PASS2: preference_pass2},
    math=("token_stats",),
)
register_gpu_steps(
    grpo.FusedLinearGRPOLoss,
    {
        StepKind.TOKEN: grpo_token,
        StepKind.TOKEN_VALUE: functools.partial(grpo_token, grad=False),
        StepKind.STATS: grpo_stats,
        StepKind.SEQ_PASS2: grpo_pass2,
    },
    math=("chunk_loss", "token_stats"),
)
