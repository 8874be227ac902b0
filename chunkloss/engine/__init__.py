"""The chunk loop every chunkloss loss runs on."""

from chunkloss.engine._core import Batch, FusedLinearBase, FusedOptions, Head, segment_sum, sequence_batch

__all__ = ["Batch", "FusedLinearBase", "FusedOptions", "Head", "segment_sum", "sequence_batch"]
