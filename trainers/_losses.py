"""Small token losses the trainers need beyond chunkloss.losses, written on the same engine."""

from __future__ import annotations

from chunkloss.losses.common import entropy_from_logits, label_logprobs, scale_logits
from chunkloss.losses.cross_entropy import CrossEntropyOptions, FusedLinearCrossEntropyLoss

__all__ = ["FusedLinearDFTLoss"]


def dft_chunk(logits, extra_logits, token, scalars, opts: CrossEntropyOptions):
    """DFT (arXiv:2508.05629), TRL's ``SFTTrainer`` with ``loss_type="dft"``: ``-sg(p_y)·log p_y`` summed over
    the chunk and divided by the global normaliser; metrics as in the cross-entropy."""
    z = scale_logits(logits.float(), opts.logit_scale, opts.softcap, opts.temperature)
    labels = token["labels"]
    logp, lse = label_logprobs(z, labels)
    loss = -(logp * logp.detach().exp()).sum() / scalars["normaliser"]
    metrics = {}
    if opts.return_token_accuracy:
        metrics["mean_token_accuracy"] = (z.argmax(-1) == labels).float().sum() / scalars["n_valid"]
    if opts.return_entropy:
        metrics["entropy"] = entropy_from_logits(z, lse).sum() / scalars["n_valid"]
    return loss, metrics


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
