"""Chunked generalized Jensen-Shannon divergence between a student head and a teacher head.

Distillation loss of GKD (Agarwal et al., arXiv:2306.13649, Eq. 1) as TRL 1.16 writes it in
``GKDTrainer.generalized_jsd_loss`` (trl/experimental/gkd) and in the ``DistillationTrainer``'s
``_chunked_divergence_loss`` (trl/trainer/distillation_trainer.py, trl/kernels/chunked_divergence.py)::

    M      = (1 - β)·S + β·T                                 (log M by logaddexp, in log space)
    jsd_i  = β·KL(T_i ‖ M_i) + (1 - β)·KL(S_i ‖ M_i)         0 < β < 1
    jsd_i  = KL(T_i ‖ S_i)                                    β = 0  (forward KL)
    jsd_i  = KL(S_i ‖ T_i)                                    β = 1  (reverse KL)

with ``S = softmax(z_s / τ)``, ``T = softmax(z_t / τ)`` and each head's logits first passed through
its own ``logit_scale`` and final softcapping (``scale_logits``). The endpoints are TRL's: the
mixture's limit at β → 0 is 0, not KL(T‖S), so β = 0 and β = 1 are separate branches, exact and
free of ``log 0``. Each KL is summed over the vocabulary; the loss is::

    loss = weight_soft·Σ_i jsd_i / D + weight_hard·Σ_i CE(z_s,i, y_i) / D

where D is ``num_items_in_batch`` when given (gradient accumulation, as both TRL trainers do; a count of 0
divides by 1), else
the number of rows with a label (``reduction='batchmean'``, both trainers' default), 1 for 'sum',
or rows·V for 'mean' (GKD's ``jsd.mean()`` over elements). The hard-label cross-entropy is the one
Liger's ``LigerFusedLinearJSDLoss`` adds: on the student's scaled logits *without* the temperature.

Temperature: GKD calls ``generalized_jsd_loss`` with its default ``temperature=1.0`` (its
``args.temperature`` is a sampling temperature only), while ``DistillationTrainer`` passes
``args.temperature`` to the divergence. ``temperature`` defaults to 1.0 here, GKD's behaviour; set it
to the trainer's ``args.temperature`` to mirror ``DistillationTrainer``.

Rows whose label is ``ignore_index`` take no part (their rows cost no GEMM). The teacher is
projected without grad chunk by chunk in the same pass; it receives no gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from chunkloss.engine import Batch, ExtraHead, FusedLinearBase, FusedOptions, StepKind, register_gpu_steps
from chunkloss.losses.common import (
    LabelRows,
    Normalisers,
    check_head,
    check_labels,
    check_range,
    item_count,
    pick,
    scale_logits,
)

__all__ = ["FusedLinearJSDLoss", "JSDOptions", "jsd_chunk", "jsd_rows"]

_REDUCTIONS = ("batchmean", "sum", "mean")


@dataclass(frozen=True)
class JSDOptions(FusedOptions):
    """The options of :class:`FusedLinearJSDLoss`, its constructor's keywords.

    Args:
        beta: β in [0, 1]; 0 is forward KL(T‖S), 1 reverse KL(S‖T), TRL's convention.
        temperature: τ dividing both heads' logits in the divergence (not in the hard loss).
        weight_hard_loss: weight of the student's cross-entropy on the labels.
        weight_soft_loss: weight of the divergence.
        ignore_index: label value that takes no part (its row costs no GEMM).
        reduction: 'batchmean' (sum over vocabulary, mean over labelled rows), 'sum', or 'mean' (mean over
            rows and vocabulary, GKD's ``reduction='mean'``). ``num_items_in_batch`` overrides it.
        student_logit_scale, teacher_logit_scale: multipliers of each head's logits (Cohere, Granite).
        student_softcap, teacher_softcap: each head's final logit softcapping (Gemma-2), ``None`` for
            none.
    """

    beta: float = 0.5
    temperature: float = 1.0
    weight_hard_loss: float = 0.0
    weight_soft_loss: float = 1.0
    ignore_index: int = -100
    reduction: str = "batchmean"
    student_logit_scale: float = 1.0
    teacher_logit_scale: float = 1.0
    student_softcap: float | None = None
    teacher_softcap: float | None = None

    def __post_init__(self):
        super().__post_init__()
        check_range("beta", self.beta, 0, 1)
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.reduction not in _REDUCTIONS:
            raise ValueError(
                f"reduction must be one of {_REDUCTIONS}, got {self.reduction!r} "
                "(TRL's per-element 'none' would materialise the [N, V] divergence)"
            )
        for name in ("student_softcap", "teacher_softcap"):
            cap = getattr(self, name)
            if cap is not None and cap <= 0:
                raise ValueError(f"{name} must be positive or None, got {cap}")


def jsd_rows(logits: Tensor, teacher_logits: Tensor, labels: Tensor, opts: JSDOptions) -> dict[str, Tensor]:
    """Per-row fp32 terms of one chunk by name: ``"soft"`` (jsd_i), ``"hard"`` (the student's CE on the label,
    when ``weight_hard_loss`` ≠ 0) and ``"entropy"`` (of S at τ). The one formula of the compiled step and of
    the Triton step's reference (``chunkloss.kernels.jsd``)."""
    z_s = scale_logits(logits.float(), opts.student_logit_scale, opts.student_softcap)
    z_t = scale_logits(teacher_logits.float(), opts.teacher_logit_scale, opts.teacher_softcap)
    log_s = torch.log_softmax(z_s / opts.temperature if opts.temperature != 1.0 else z_s, dim=-1)
    log_t = torch.log_softmax(z_t / opts.temperature if opts.temperature != 1.0 else z_t, dim=-1)
    beta = opts.beta
    if beta == 0.0:
        soft = (log_t.exp() * (log_t - log_s)).sum(-1)
    elif beta == 1.0:
        soft = (log_s.exp() * (log_s - log_t)).sum(-1)
    else:
        log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
        soft = (beta * (log_t.exp() * (log_t - log_m)) + (1 - beta) * (log_s.exp() * (log_s - log_m))).sum(-1)
    rows = {"soft": soft, "entropy": -(log_s.exp() * log_s).sum(-1)}
    if opts.weight_hard_loss != 0.0:
        # lse - z_y rather than F.cross_entropy: its gradient stays pointwise under compile (see pick).
        rows["hard"] = torch.logsumexp(z_s, dim=-1) - pick(z_s, labels)
    return rows


def _chunk_sums(rows: dict[str, Tensor], scalars: Normalisers, opts: JSDOptions):
    """The chunk's loss (weighted, over the global normaliser) and metric sums from its per-row terms."""
    normaliser = scalars.normaliser
    soft = rows["soft"].sum() / normaliser
    loss = opts.weight_soft_loss * soft
    metrics = {"soft_loss": soft}
    if "hard" in rows:
        hard = rows["hard"].sum() / normaliser
        loss = loss + opts.weight_hard_loss * hard
        metrics["hard_loss"] = hard
    metrics["entropy"] = rows["entropy"].sum() / scalars.n_valid
    return loss, metrics


def jsd_chunk(logits, extra_logits, token: LabelRows, scalars: Normalisers, opts: JSDOptions):
    """Loss of one chunk: the weighted divergence and hard loss summed over rows, divided by the
    global normaliser; metrics are the same sums, unweighted."""
    return _chunk_sums(jsd_rows(logits, extra_logits[0], token.labels, opts), scalars, opts)


class FusedLinearJSDLoss(FusedLinearBase):
    """Generalized JSD between a student and a teacher LM head, without materialising either
    ``[N, V]`` logits. Gradients flow to the student's hidden, weight and bias only.

    Example::

        loss_fn = FusedLinearJSDLoss(beta=0.5)
        loss = loss_fn(student_hidden, student.lm_head.weight, teacher_hidden, teacher.lm_head.weight, labels)
        loss_fn.metrics["soft_loss"], loss_fn.metrics["entropy"]

    Metrics: ``num_tokens`` (the labelled rows of the call), ``soft_loss`` (the divergence, normalised like
    the loss), ``entropy`` (mean student entropy at τ over labelled rows, the DistillationTrainer's logged
    ``entropy``), and ``hard_loss`` (the hard-label cross-entropy) when ``weight_hard_loss`` ≠ 0.
    """

    options_cls = JSDOptions
    options: JSDOptions
    head_args = ("hidden", "weight", "bias", "teacher_hidden", "teacher_weight", "teacher_bias")
    chunk_loss = staticmethod(jsd_chunk)

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        teacher_hidden: Tensor,
        teacher_weight: Tensor,
        labels: Tensor,
        *,
        bias: Tensor | None = None,
        teacher_bias: Tensor | None = None,
        num_items_in_batch: int | Tensor | None = None,
    ) -> Tensor:
        """Args:
            hidden: (..., H) the student's hidden states.
            weight: (V, H) the student's head weight.
            teacher_hidden: (..., H_t) the teacher's hidden states, same leading shape (no grad).
            teacher_weight: (V, H_t) the teacher's head weight (no grad).
            labels: (...) integer targets, already shifted; ``ignore_index`` marks rows that take no part.
            bias: (V,) the student's head bias, or ``None``.
            teacher_bias: (V,) the teacher's head bias, or ``None``.
            num_items_in_batch: divides the summed loss instead of the reduction's normaliser (gradient
                accumulation, as TRL's trainers pass it).

        Returns:
            The 0-d loss.
        """
        opts = self.options
        _check_heads(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias)
        vocab = weight.shape[0]
        rows = check_labels(
            labels, hidden.shape[:-1], vocab, opts.ignore_index, rows=True, device=hidden.device
        )
        x = hidden.reshape(-1, hidden.shape[-1])
        x_t = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
        y = labels.reshape(-1)
        n_valid = torch.full((), float(max(rows.numel(), 1)), device=x.device)
        if num_items_in_batch is not None:
            normaliser = item_count(num_items_in_batch, x.device)
        elif opts.reduction == "batchmean":
            normaliser = n_valid
        elif opts.reduction == "mean":
            normaliser = n_valid * vocab
        else:
            normaliser = torch.ones((), device=x.device)
        teacher = ExtraHead(
            x_t, teacher_weight.detach(), None if teacher_bias is None else teacher_bias.detach()
        )
        batch = Batch(
            rows=rows,
            token=LabelRows(labels=y[rows].long()),
            scalars=Normalisers(normaliser=normaliser, n_valid=n_valid),
            extra=[teacher],
            num_rows=x.shape[0],
            all_rows=rows.numel() == x.shape[0],
        )
        loss = self.run(x, weight, bias, batch)
        # No labelled row: the loop never ran; report zeros rather than missing metrics.
        names = ("soft_loss", "entropy") + (("hard_loss",) if opts.weight_hard_loss != 0.0 else ())
        zero = torch.zeros((), device=x.device)
        self.metrics = {
            "num_tokens": torch.full((), float(rows.numel()), device=x.device),
            **{k: self.metrics.get(k, zero) for k in names},
        }
        return loss


def _check_heads(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias) -> None:
    """The student's and the teacher's heads, each checked, and checked against each other."""
    check_head(hidden, weight, bias)
    try:
        check_head(teacher_hidden, teacher_weight, teacher_bias, name="teacher_hidden")
    except (TypeError, ValueError) as e:
        raise type(e)(f"teacher head: {e}") from None
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"student and teacher vocabularies differ: weight has V={weight.shape[0]}, "
            f"teacher_weight has V={teacher_weight.shape[0]}"
        )
    if teacher_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"teacher_hidden leading shape {tuple(teacher_hidden.shape[:-1])} must equal "
            f"hidden's {tuple(hidden.shape[:-1])}"
        )
    if teacher_hidden.device != hidden.device:
        raise ValueError(f"teacher_hidden is on {teacher_hidden.device}, hidden on {hidden.device}")


# --------------------------------------------------------------------------------------------------
# The CUDA step: one kernel (``chunkloss.kernels.jsd``) reads both heads' logits three times, with no fp32
# copy.
_JSD_KERNEL_OPTIONS = (
    "beta", "temperature", "weight_soft_loss", "weight_hard_loss",
    "student_logit_scale", "student_softcap", "teacher_logit_scale", "teacher_softcap",
)  # fmt: skip


def jsd_token(opts: JSDOptions, logits, extra_logits, token, scalars):
    """``TOKEN``: ``grad_and_value(jsd_chunk)``."""
    from chunkloss.kernels.jsd import jsd_step

    kernel_args = {name: getattr(opts, name) for name in _JSD_KERNEL_OPTIONS}
    rows = jsd_step(logits, extra_logits[0], token.labels, scalars.normaliser, **kernel_args)
    return (logits, *_chunk_sums(rows, scalars, opts))


register_gpu_steps(FusedLinearJSDLoss, {StepKind.TOKEN: jsd_token}, math=("chunk_loss",))
