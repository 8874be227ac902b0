"""accelerate's private names that chunkloss uses. Supported: accelerate 1.x (TRL 1.16's requirement)."""

from __future__ import annotations

__all__ = ["has_hf_hook"]


def has_hf_hook(module) -> bool:
    """Whether accelerate attached a hook to ``module`` (device placement, offload): the ``_hf_hook``
    attribute ``accelerate.hooks.add_hook_to_module`` sets (accelerate 0.x and 1.x)."""
    return hasattr(module, "_hf_hook")
