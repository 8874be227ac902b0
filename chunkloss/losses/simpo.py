"""Chunked linear + SimPO (Meng et al., arXiv:2405.14734).

``-(1-ε)·logσ(β(ℓ̄_c - ℓ̄_r) - γ) - ε·logσ(-(β(ℓ̄_c - ℓ̄_r) - γ))`` with ℓ̄ the mean completion
log-prob: ``trl.experimental.cpo.CPOTrainer`` (TRL 1.16) with ``loss_type="simpo"`` and, as the
paper, no NLL term (``cpo_alpha=0``; set it for CPO-SimPO).
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkloss.losses.cpo import CPOOptions, FusedLinearCPOLoss

__all__ = ["FusedLinearSimPOLoss", "SimPOOptions"]


@dataclass(frozen=True)
class SimPOOptions(CPOOptions):
    """CPO's options with SimPO's defaults: ``loss_type="simpo"``, ``cpo_alpha=0``, γ = ``simpo_gamma``.

    Args:
        beta: β, the reward scale.
        simpo_gamma: γ, the target margin: the loss is ``-logσ(β(ℓ̄_c - ℓ̄_r) - γ)``.
        label_smoothing: ε in [0, 0.5].
        cpo_alpha: weight of an NLL term over the chosen rows (CPO-SimPO; 0 in the paper).
        loss_type: CPO's loss type; 'simpo' is SimPO.
        alpha: AlphaPO's α (0: plain log-prob rewards).
        ignore_index: label value of prompt and padding tokens (their rows cost no GEMM).
        logit_scale: the logits are multiplied by it (Cohere's ``logit_scale``).
        softcap: final logit softcapping ``c·tanh(z/c)`` after the scale (Gemma-2), ``None`` for off.
        return_token_metrics: also report ``entropy`` and ``mean_token_accuracy``.
    """

    loss_type: str = "simpo"
    cpo_alpha: float = 0.0


class FusedLinearSimPOLoss(FusedLinearCPOLoss):
    """SimPO over the chunked LM head: CPO's loss with SimPO's defaults.

    Example::

        loss_fn = FusedLinearSimPOLoss(beta=2.0, simpo_gamma=0.5)
        loss = loss_fn(hidden, lm_head.weight, chosen, rejected)   # hidden (2B, T, H)

    Metrics (TRL's names): ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``;
    ``nll_loss`` when ``cpo_alpha`` ≠ 0; with ``return_token_metrics`` also ``entropy`` and
    ``mean_token_accuracy``.
    """

    options_cls = SimPOOptions
    options: SimPOOptions
