"""The chunked losses: one file each (options dataclass + per-chunk math + thin module)."""

from chunkloss.losses.cross_entropy import CrossEntropyOptions, FusedLinearCrossEntropyLoss

__all__ = ["CrossEntropyOptions", "FusedLinearCrossEntropyLoss"]
