"""chunkloss: chunked fused LM-head losses for post-training without materialised logits."""

from chunkloss.engine import Batch, FusedLinearBase, FusedOptions, Head, segment_sum, sequence_batch
from chunkloss.losses import *  # noqa: F403
from chunkloss.losses import __all__ as _losses_all

__version__ = "0.1.0"

__all__ = ["Batch", "FusedLinearBase", "FusedOptions", "Head", "segment_sum", "sequence_batch", *_losses_all]
