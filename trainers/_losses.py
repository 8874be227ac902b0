"""Small token losses the trainers need beyond chunkloss.losses, written on the same engine."""

from __future__ import annotations

import torch

from chunkloss.base import Batch, FusedLinearBase
from chunkloss.losses.common import entropy_from_logits, label_logprobs, scale_logits
from chunkloss.losses.cross_entropy import CrossEntropyOptions, FusedLinearCrossEntropyLoss

__all__ = ["FusedLinearDFTLoss", "FusedLinearMeanLogit"]


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


def mean_logit_chunk(logits, extra_logits, token, scalars, opts):
    """No loss; the metric ``mean_logit``: Σ_rows mean_v z / normaliser (TRL ORPO's ``logits/*`` value)."""
    z = logits.float()
    return z.new_zeros(()), {"mean_logit": z.mean(-1).sum() / scalars["normaliser"]}


class FusedLinearMeanLogit(FusedLinearBase):
    """Mean of the logits over every row and the vocabulary, chunk by chunk, without grad (a metric)."""

    chunk_loss = staticmethod(mean_logit_chunk)

    def forward(self, hidden, weight, bias=None):  # hidden (..., H)
        x = hidden.reshape(-1, hidden.shape[-1])
        batch = Batch(
            rows=torch.arange(x.shape[0], device=x.device),
            scalars={"normaliser": torch.tensor(float(max(x.shape[0], 1)), device=x.device)},
            num_rows=x.shape[0],
            all_rows=True,
        )
        with torch.no_grad():
            self.run(x.detach(), weight.detach(), None if bias is None else bias.detach(), batch)
        return self.metrics["mean_logit"]
