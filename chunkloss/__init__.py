"""chunkloss: chunked fused LM-head losses for post-training without materialised logits."""

from chunkloss.base import Batch, FusedLinearBase, FusedOptions, Head
from chunkloss.losses import CrossEntropyOptions, FusedLinearCrossEntropyLoss

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "CrossEntropyOptions",
    "FusedLinearBase",
    "FusedLinearCrossEntropyLoss",
    "FusedOptions",
    "Head",
]
