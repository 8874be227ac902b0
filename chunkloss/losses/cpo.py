"""Chunked linear + CPO (Xu et al., arXiv:2401.08417) and its AlphaPO reward transform (arXiv:2501.03884).

Equals ``trl.experimental.cpo.CPOTrainer`` (TRL 1.16: ``cpo_loss`` and ``get_batch_loss_metrics``)::

    u = ℓ_c - ℓ_r                     (alpha = 0)
    u = ρ_c - ρ_r,  ρ = (1 - e^{-α ℓ}) / α    (AlphaPO, alpha ≠ 0)
    sigmoid: -(1-ε)·logσ(β u) - ε·logσ(-β u)      hinge: relu(1 - β u)
    ipo: (u - 1/(2β))²                            simpo: sigmoid with u - γ/β
    L = mean_pairs loss + cpo_alpha · NLL_chosen

ℓ is the summed completion log-prob, or its mean for ``ipo`` and ``simpo`` (as TRL). The NLL is the
mean cross-entropy of the chosen rows over ``nll_labels`` (default: ``chosen``). Metrics: rewards/*
(β·ℓ, or β·ρ under AlphaPO), logps/*, logits/*, nll_loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkloss.losses.common import check_choice, check_range
from chunkloss.losses.preference import FusedLinearPreferenceLoss, PreferenceOptions

__all__ = ["CPO_LOSS_TYPES", "CPOOptions", "FusedLinearCPOLoss"]

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


@dataclass(frozen=True)
class CPOOptions(PreferenceOptions):
    """The options of :class:`FusedLinearCPOLoss`, its constructor's keywords (names and defaults of TRL
    1.16's ``CPOConfig``).

    Args:
        beta: β of the loss and the rewards.
        loss_type: 'sigmoid', 'hinge', 'ipo' or 'simpo'.
        label_smoothing: ε in [0, 0.5] of sigmoid and simpo.
        cpo_alpha: weight of the NLL term over the chosen rows.
        simpo_gamma: γ, SimPO's target margin.
        alpha: AlphaPO's α (0: plain log-prob rewards).
        ignore_index: label value of prompt and padding tokens (their rows cost no GEMM).
        logit_scale: the logits are multiplied by it (Cohere's ``logit_scale``).
        softcap: final logit softcapping ``c·tanh(z/c)`` after the scale (Gemma-2), ``None`` for off.
        return_token_metrics: also report ``entropy`` and ``mean_token_accuracy`` (one more reduction
            over V per row).
    """

    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_choice("loss_type", self.loss_type, CPO_LOSS_TYPES)
        check_range("label_smoothing", self.label_smoothing, 0, 0.5)

    @property
    def avg_logps(self) -> bool:
        return self.loss_type in ("ipo", "simpo")

    @property
    def nll_coef(self) -> float:
        return self.cpo_alpha


def cpo_pair_loss(pair, scalars, opts: CPOOptions):
    """Per-pair loss of ``CPOTrainer.cpo_loss`` (TRL 1.16)."""
    beta, eps = opts.beta, opts.label_smoothing
    chosen, rejected = pair.chosen, pair.rejected
    if opts.alpha != 0.0:
        chosen = (1 - torch.exp(-opts.alpha * chosen)) / opts.alpha  # (1 - p^-α)/α
        rejected = (1 - torch.exp(-opts.alpha * rejected)) / opts.alpha
    u = chosen - rejected
    if opts.loss_type == "hinge":
        loss = torch.relu(1 - beta * u)
    elif opts.loss_type == "ipo":
        loss = (u - 1 / (2 * beta)) ** 2
    else:
        if opts.loss_type == "simpo":
            u = u - opts.simpo_gamma / beta
        loss = -F.logsigmoid(beta * u) * (1 - eps) - F.logsigmoid(-beta * u) * eps
    return loss, beta * chosen, beta * rejected, {}


class FusedLinearCPOLoss(FusedLinearPreferenceLoss):
    """CPO over the chunked LM head (``nll_labels`` gives the NLL its own targets).

    Example::

        loss_fn = FusedLinearCPOLoss(beta=0.1, cpo_alpha=1.0)
        loss = loss_fn(hidden, lm_head.weight, chosen, rejected)   # hidden (2B, T, H)

    Metrics (TRL's names): ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``;
    ``nll_loss`` when ``cpo_alpha`` ≠ 0; with ``return_token_metrics`` also ``entropy`` and
    ``mean_token_accuracy``.
    """

    options_cls = CPOOptions
    options: CPOOptions
    uses_nll = True
    pair_loss = staticmethod(cpo_pair_loss)

    @staticmethod
    def margin_power(opts: CPOOptions) -> int | None:
        """Every CPO loss type is a function of ``chosen - rejected`` (means for ipo/simpo), unless AlphaPO
        transforms each side or an NLL term trains the chosen rows on their own."""
        if opts.alpha != 0.0 or opts.cpo_alpha != 0.0:
            return None
        return int(opts.avg_logps)
