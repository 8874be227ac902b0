"""TRL trainers that use the chunked losses: drop-in subclasses of TRL 1.16's trainers.

from chunkloss.trainers import ChunkedGRPOTrainer, ChunkedGRPOConfig
"""

from .distillation import ChunkedDistillationConfig, ChunkedDistillationTrainer
from .dpo import ChunkedDPOConfig, ChunkedDPOTrainer
from .gkd import ChunkedGKDConfig, ChunkedGKDTrainer
from .grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer
from .kto import ChunkedKTOConfig, ChunkedKTOTrainer
from .medusa import ChunkedMedusaConfig, ChunkedMedusaTrainer
from .orpo import ChunkedORPOConfig, ChunkedORPOTrainer
from .rloo import ChunkedRLOOConfig, ChunkedRLOOTrainer
from .sft import ChunkedSFTConfig, ChunkedSFTTrainer

__all__ = [
    "ChunkedDistillationConfig",
    "ChunkedDistillationTrainer",
    "ChunkedDPOConfig",
    "ChunkedDPOTrainer",
    "ChunkedGKDConfig",
    "ChunkedGKDTrainer",
    "ChunkedGRPOConfig",
    "ChunkedGRPOTrainer",
    "ChunkedKTOConfig",
    "ChunkedKTOTrainer",
    "ChunkedMedusaConfig",
    "ChunkedMedusaTrainer",
    "ChunkedORPOConfig",
    "ChunkedORPOTrainer",
    "ChunkedRLOOConfig",
    "ChunkedRLOOTrainer",
    "ChunkedSFTConfig",
    "ChunkedSFTTrainer",
]
