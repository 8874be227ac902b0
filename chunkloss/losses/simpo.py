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
    """CPO's options with SimPO's defaults: ``loss_type="simpo"``, ``cpo_alpha=0``, γ = ``simpo_gamma``."""

    loss_type: str = "simpo"
    cpo_alpha: float = 0.0


class FusedLinearSimPOLoss(FusedLinearCPOLoss):
    """SimPO over the chunked LM head: CPO's loss with SimPO's defaults."""

    options_cls = SimPOOptions
    options: SimPOOptions
