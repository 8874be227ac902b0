"""The chunked losses: one file each (options dataclass + per-chunk math + thin module)."""

from chunkloss.losses.cpo import CPOOptions, FusedLinearCPOLoss
from chunkloss.losses.cross_entropy import CrossEntropyOptions, FusedLinearCrossEntropyLoss
from chunkloss.losses.dpo import DPOOptions, FusedLinearDPOLoss
from chunkloss.losses.grpo import FusedLinearGRPOLoss, GRPOOptions
from chunkloss.losses.jsd import FusedLinearJSDLoss, JSDOptions
from chunkloss.losses.kto import FusedLinearKTOLoss, KTOOptions
from chunkloss.losses.multi_token import FusedLinearMultiTokenLoss, MultiTokenOptions
from chunkloss.losses.orpo import FusedLinearORPOLoss, ORPOOptions
from chunkloss.losses.preference import FusedLinearPreferenceLoss, PreferenceOptions
from chunkloss.losses.rloo import FusedLinearRLOOLoss, RLOOOptions
from chunkloss.losses.simpo import FusedLinearSimPOLoss, SimPOOptions

__all__ = [
    "CPOOptions",
    "CrossEntropyOptions",
    "DPOOptions",
    "FusedLinearCPOLoss",
    "FusedLinearCrossEntropyLoss",
    "FusedLinearDPOLoss",
    "FusedLinearGRPOLoss",
    "FusedLinearJSDLoss",
    "FusedLinearKTOLoss",
    "FusedLinearMultiTokenLoss",
    "FusedLinearORPOLoss",
    "FusedLinearPreferenceLoss",
    "FusedLinearRLOOLoss",
    "FusedLinearSimPOLoss",
    "GRPOOptions",
    "JSDOptions",
    "KTOOptions",
    "MultiTokenOptions",
    "ORPOOptions",
    "PreferenceOptions",
    "RLOOOptions",
    "SimPOOptions",
]
