"""DFT (arXiv:2508.05629): ``-Σ sg(p_y)·log p_y / n``, TRL's ``SFTTrainer`` with ``loss_type="dft"``.

A cross-entropy subclass on the same engine; on CUDA its step runs on the row kernels of
``chunkloss.kernels.logprob`` (registered at the end of this file).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkloss.engine import StepKind, register_gpu_steps
from chunkloss.losses.common import LabelRows, Normalisers, RowStats, kernel_row_statistics, row_statistics
from chunkloss.losses.cross_entropy import CrossEntropyOptions, FusedLinearCrossEntropyLoss

__all__ = ["DFTOptions", "FusedLinearDFTLoss"]


def row_kw(opts: CrossEntropyOptions) -> dict:
    return dict(
        logit_scale=opts.logit_scale,
        softcap=opts.softcap,
        temperature=opts.temperature,
        lse=True,
        entropy=opts.return_entropy,
        argmax=opts.return_token_accuracy,
    )


def dft_sums(rows: RowStats, token: LabelRows, scalars: Normalisers, opts: CrossEntropyOptions):
    """The chunk's DFT loss and metric sums from its rows' statistics."""
    logp = rows.logp
    loss = -(logp * logp.detach().exp()).sum() / scalars.normaliser
    metrics = {}
    if opts.return_token_accuracy:
        metrics["mean_token_accuracy"] = (rows.argmax == token.labels).float().sum() / scalars.n_valid
    if opts.return_entropy:
        metrics["entropy"] = rows.entropy.sum() / scalars.n_valid
    return loss, metrics


def dft_chunk(logits, extra_logits, token: LabelRows, scalars: Normalisers, opts: CrossEntropyOptions):
    """DFT (arXiv:2508.05629), TRL's ``SFTTrainer`` with ``loss_type="dft"``: ``-sg(p_y)·log p_y`` summed over
    the chunk and divided by the global normaliser; metrics as in the cross-entropy."""
    return dft_sums(row_statistics(logits, token.labels, **row_kw(opts)), token, scalars, opts)


@dataclass(frozen=True)
class DFTOptions(CrossEntropyOptions):
    """:class:`~chunkloss.losses.cross_entropy.CrossEntropyOptions` without ``label_smoothing``,
    ``lse_square_scale`` or ``reduction='none'`` (TRL's DFT has none of them)."""

    def __post_init__(self):
        super().__post_init__()
        if self.label_smoothing or self.lse_square_scale or self.reduction == "none":
            raise ValueError(
                "FusedLinearDFTLoss takes no label_smoothing, lse_square_scale or reduction='none'"
            )


class FusedLinearDFTLoss(FusedLinearCrossEntropyLoss):
    """Dynamic fine-tuning loss ``-Σ sg(p_y)·log p_y / n`` over the LM head, without materialising the logits.

    Takes :class:`FusedLinearCrossEntropyLoss`'s arguments; ``label_smoothing`` and ``lse_square_scale``
    must be 0 (TRL's DFT has neither).
    """

    options_cls = DFTOptions
    options: DFTOptions
    chunk_loss = staticmethod(dft_chunk)


# --------------------------------------------------------------------------------------------------
# The CUDA step: the row kernels of ``chunkloss.kernels.logprob``, never the cross-entropy kernel.
def dft_token(opts, logits, extra_logits, token, scalars):
    """``TOKEN``: the rows' statistics from ``chunkloss.kernels.logprob`` (one read of the logits), the loss
    on them, and ``dL/dlogits = -sg(p_y)/n · (onehot - p)`` written in place (one more read)."""
    from chunkloss.kernels.logprob import row_grad_from_loss_  # Triton is imported only on CUDA

    rows = kernel_row_statistics(logits, token.labels, **row_kw(opts))
    with torch.enable_grad():
        rows.logp.requires_grad_(True)
        loss, metrics = dft_sums(rows, token, scalars, opts)
    scalings = dict(logit_scale=opts.logit_scale, softcap=opts.softcap, temperature=opts.temperature)
    row_grad_from_loss_(logits, token.labels, loss, rows.logp, lse=rows.lse, entropy=rows.entropy, **scalings)
    return logits, loss.detach(), metrics


register_gpu_steps(FusedLinearDFTLoss, {StepKind.TOKEN: dft_token}, math=("chunk_loss",))
