"""DFT (arXiv:2508.05629): ``-Σ sg(p_y)·log p_y / n``, TRL's ``SFTTrainer`` with ``loss_type="dft"``.

A cross-entropy subclass on the same engine; its Triton step is registered in
``chunkloss/losses/gpu_steps.py``.
"""

from __future__ import annotations

from chunkloss.losses.common import row_statistics
from chunkloss.losses.cross_entropy import CrossEntropyOptions, FusedLinearCrossEntropyLoss

__all__ = ["FusedLinearDFTLoss"]


def row_kw(opts: CrossEntropyOptions) -> dict:
    return dict(
        logit_scale=opts.logit_scale,
        softcap=opts.softcap,
        temperature=opts.temperature,
        lse=True,
        entropy=opts.return_entropy,
        argmax=opts.return_token_accuracy,
    )


def dft_sums(rows: dict, token, scalars, opts: CrossEntropyOptions):
    """The chunk's DFT loss and metric sums from its rows' statistics (``row_statistics`` names)."""
    logp = rows["logp"]
    loss = -(logp * logp.detach().exp()).sum() / scalars["normaliser"]
    metrics = {}
    if opts.return_token_accuracy:
        metrics["mean_token_accuracy"] = (rows["argmax"] == token["labels"]).float().sum() / scalars[
            "n_valid"
        ]
    if opts.return_entropy:
        metrics["entropy"] = rows["entropy"].sum() / scalars["n_valid"]
    return loss, metrics


def dft_chunk(logits, extra_logits, token, scalars, opts: CrossEntropyOptions):
    """DFT (arXiv:2508.05629), TRL's ``SFTTrainer`` with ``loss_type="dft"``: ``-sg(p_y)·log p_y`` summed over
    the chunk and divided by the global normaliser; metrics as in the cross-entropy."""
    return dft_sums(row_statistics(logits, token["labels"], **row_kw(opts)), token, scalars, opts)


class FusedLinearDFTLoss(FusedLinearCrossEntropyLoss):
    """Dynamic fine-tuning loss ``-Σ sg(p_y)·log p_y / n`` over the LM head, without materialising the logits.

    Takes :class:`FusedLinearCrossEntropyLoss`'s arguments; ``label_smoothing`` and ``lse_square_scale``
    must be 0 (TRL's DFT has neither).
    """

    chunk_loss = staticmethod(dft_chunk)

    def __init__(self, **options):
        super().__init__(**options)
        if self.options.label_smoothing or self.options.lse_square_scale or self.options.reduction == "none":
            raise ValueError(
                "FusedLinearDFTLoss takes no label_smoothing, lse_square_scale or reduction='none'"
            )
