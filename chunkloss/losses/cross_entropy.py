"""Chunked linear + cross-entropy.

Equals ``torch.nn.functional.cross_entropy(scale(hidden @ weight.T + bias), labels, ...)`` (torch 2.x) with
``ignore_index``, ``reduction`` and ``label_smoothing`` as torch defines them::

    ℓ_i = (1 - ε)·(lse_i - z_{i,y_i}) + ε·(lse_i - mean_j z_ij) + λ·lse_i²

where ``z = scale(logits)`` applies ``logit_scale``, Gemma's ``softcap·tanh(z/softcap)`` and
``/ temperature``, and ``λ·lse²`` is the z-loss of PaLM (arXiv:2204.02311), reported separately as
``z_loss``. ``num_items_in_batch`` divides the summed loss, as transformers' ``ForCausalLMLoss`` does under
gradient accumulation: with it this is the loss ``trl.SFTTrainer`` (TRL 1.16, ``loss_type="nll"``) trains on,
the model's own ``ForCausalLMLoss``. With every label ignored, 'mean' gives 0 (torch gives NaN), and so does
``num_items_in_batch=0`` (a count below 1 divides by 1). A row whose logits hold ±inf gives NaN, as in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from chunkloss.engine import Batch, FusedLinearBase, FusedOptions, StepKind, register_gpu_steps
from chunkloss.losses.common import (
    LabelRows,
    Normalisers,
    check_choice,
    check_head,
    check_labels,
    check_range,
    item_count,
    row_statistics,
)

__all__ = ["CrossEntropyOptions", "FusedLinearCrossEntropyLoss", "cross_entropy_rows"]

_REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class CrossEntropyOptions(FusedOptions):
    """The options of :class:`FusedLinearCrossEntropyLoss`, its constructor's keywords.

    Args:
        ignore_index: label value that takes no part (its row costs no GEMM).
        reduction: 'mean' over non-ignored rows, 'sum', or 'none' (per-row losses, 0 where ignored).
        label_smoothing: ε in [0, 1], as in ``F.cross_entropy``.
        lse_square_scale: λ of the z-loss ``λ·logsumexp²``; 0 turns it off.
        softcap: final logit softcapping ``c·tanh(z/c)`` (Gemma-2), ``None`` for none.
        temperature: the logits are divided by it (after the softcap).
        logit_scale: the logits are multiplied by it first (Cohere).
        return_token_accuracy: report ``mean_token_accuracy`` (TRL's SFT name).
        return_entropy: report ``entropy``, the mean per-token entropy.
    """

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float | None = None
    temperature: float = 1.0
    logit_scale: float = 1.0
    return_token_accuracy: bool = False
    return_entropy: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_choice("reduction", self.reduction, _REDUCTIONS)
        check_range("label_smoothing", self.label_smoothing, 0, 1)
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be positive or None, got {self.softcap}")


def cross_entropy_rows(logits: Tensor, labels: Tensor, opts: CrossEntropyOptions) -> dict[str, Tensor]:
    """Per-row values of a chunk: ``loss`` ℓ_i and, as the options ask, ``z_loss``, ``correct`` (argmax is the
    label), ``entropy``; the one CE formula (the compiled step and the Triton kernel's reference use it)."""
    r = row_statistics(
        logits,
        labels,
        logit_scale=opts.logit_scale,
        softcap=opts.softcap,
        temperature=opts.temperature,
        lse=True,
        mean=opts.label_smoothing > 0,
        entropy=opts.return_entropy,
        argmax=opts.return_token_accuracy,
    )
    lse = r.lse
    per_row = -r.logp
    if opts.label_smoothing > 0:
        per_row = (1 - opts.label_smoothing) * per_row + opts.label_smoothing * (lse - r.mean)
    rows = {}
    if opts.lse_square_scale > 0:
        rows["z_loss"] = opts.lse_square_scale * lse.square()
        per_row = per_row + rows["z_loss"]
    rows["loss"] = per_row
    if opts.return_token_accuracy:
        rows["correct"] = (r.argmax == labels).float()
    if opts.return_entropy:
        rows["entropy"] = r.entropy
    return rows


def cross_entropy_chunk(
    logits, extra_logits, token: LabelRows, scalars: Normalisers, opts: CrossEntropyOptions
):
    """Loss of one chunk: Σ_i w_i·ℓ_i / normaliser, and metrics as sums over the chunk."""
    return _chunk_sums(cross_entropy_rows(logits, token.labels, opts), token, scalars, opts)


def _chunk_sums(rows: dict[str, Tensor], token: LabelRows, scalars: Normalisers, opts: CrossEntropyOptions):
    """The chunk's loss and metric sums from its per-row values (``loss`` ℓ_i and, as asked, ``z_loss``,
    ``correct``, ``entropy``); shared by the compiled step and the Triton one."""
    per_row = rows["loss"]
    loss = per_row.sum() / scalars.normaliser
    metrics = {}
    if "z_loss" in rows:
        metrics["z_loss"] = rows["z_loss"].sum() / scalars.n_valid
    if opts.reduction == "none":
        metrics["loss"] = per_row
    if "correct" in rows:
        metrics["mean_token_accuracy"] = rows["correct"].sum() / scalars.n_valid
    if "entropy" in rows:
        metrics["entropy"] = rows["entropy"].sum() / scalars.n_valid
    return loss, metrics


class FusedLinearCrossEntropyLoss(FusedLinearBase):
    """``F.cross_entropy(hidden @ weight.T + bias, labels)`` without materialising the logits.

    Example::

        loss_fn = FusedLinearCrossEntropyLoss(label_smoothing=0.1)
        loss = loss_fn(hidden, lm_head.weight, labels)   # hidden (B, T, H), labels (B, T) already shifted
        loss_fn.metrics["num_tokens"]

    Metrics (``self.metrics`` after each call, detached 0-d tensors): ``num_tokens`` (the labelled rows of
    the call) always; ``z_loss`` (mean λ·lse² over labelled rows) when ``lse_square_scale`` > 0;
    ``mean_token_accuracy`` with ``return_token_accuracy``; ``entropy`` with ``return_entropy``.
    """

    options_cls = CrossEntropyOptions
    options: CrossEntropyOptions
    chunk_loss = staticmethod(cross_entropy_chunk)

    @property
    def token_outputs(self) -> tuple[str, ...]:
        """``("loss",)`` with reduction='none': the per-row losses are the output."""
        return ("loss",) if self.options.reduction == "none" else ()

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        *,
        bias: Tensor | None = None,
        num_items_in_batch: int | Tensor | None = None,
    ) -> Tensor:
        """Args:
            hidden: (..., H) hidden states.
            weight: (V, H) the head's weight.
            labels: (...) integer targets, already shifted; ``ignore_index`` marks rows that take no part.
            bias: (V,) the head's bias, or ``None``.
            num_items_in_batch: divides the summed loss instead of the labelled-row count (transformers'
                normaliser under gradient accumulation); ignored with ``reduction='none'``.

        Returns:
            The loss: 0-d, or ``labels``' shape with ``reduction='none'``.
        """
        opts = self.options
        check_head(hidden, weight, bias)
        rows = check_labels(
            labels, hidden.shape[:-1], weight.shape[0], opts.ignore_index, rows=True, device=hidden.device
        )
        x = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        n_valid = torch.full((), float(max(rows.numel(), 1)), device=x.device)
        if num_items_in_batch is not None and opts.reduction != "none":
            normaliser = item_count(num_items_in_batch, x.device)
        elif opts.reduction == "mean":
            normaliser = n_valid
        else:
            normaliser = torch.ones((), device=x.device)
        batch = Batch(
            rows=rows,
            token=LabelRows(labels=y[rows].long()),
            scalars=Normalisers(normaliser=normaliser, n_valid=n_valid),
            num_rows=x.shape[0],
            all_rows=rows.numel() == x.shape[0],
        )
        out = self.run(x, weight, bias, batch)
        # A call with no labelled row never runs a chunk: its asked-for means are 0, not missing.
        zero = torch.zeros((), device=x.device)
        self.metrics = {
            "num_tokens": torch.full((), float(rows.numel()), device=x.device),
            **{k: self.metrics.get(k, zero) for k in _metric_names(opts)},
        }
        return out.view(labels.shape) if opts.reduction == "none" else out


def _metric_names(opts: CrossEntropyOptions) -> list[str]:
    """The means in ``metrics`` besides ``num_tokens``, as the options ask."""
    asked = (
        ("z_loss", opts.lse_square_scale > 0),
        ("mean_token_accuracy", opts.return_token_accuracy),
        ("entropy", opts.return_entropy),
    )
    return [name for name, on in asked if on]


# --------------------------------------------------------------------------------------------------
# The CUDA steps: one Triton kernel (``chunkloss.kernels.cross_entropy``) reads the chunk's logits twice and
# writes the gradient over them. Triton is imported only when a step first runs on CUDA.
def cross_entropy_kernel_rows(opts: CrossEntropyOptions, logits, labels, normaliser, row_weight=None):
    """The kernel's per-row values (``cross_entropy_rows``' names), the gradient written over ``logits``."""
    from chunkloss.kernels.cross_entropy import cross_entropy_step

    same = ("label_smoothing", "lse_square_scale", "softcap", "temperature", "logit_scale")
    return cross_entropy_step(
        logits,
        labels,
        normaliser,
        None if row_weight is None else row_weight.float(),
        **{name: getattr(opts, name) for name in same},
        want_accuracy=opts.return_token_accuracy,
        want_entropy=opts.return_entropy,
    )


def cross_entropy_token(opts, logits, extra_logits, token, scalars):
    """``TOKEN``: ``grad_and_value(cross_entropy_chunk)``."""
    rows = cross_entropy_kernel_rows(opts, logits, token.labels, scalars.normaliser)
    return (logits, *_chunk_sums(rows, token, scalars, opts))


def cross_entropy_token_rows(opts, logits, extra_logits, token, scalars, row_weight):
    """``TOKEN_ROWS`` (reduction='none', normaliser 1): the gradient of ``Σ_i w_i·ℓ_i``."""
    cross_entropy_kernel_rows(opts, logits, token.labels, scalars.normaliser, row_weight)
    return logits


register_gpu_steps(
    FusedLinearCrossEntropyLoss,
    {StepKind.TOKEN: cross_entropy_token, StepKind.TOKEN_ROWS: cross_entropy_token_rows},
    math=("chunk_loss",),
)
