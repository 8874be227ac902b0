"""What tests and benchmarks use beside the library: the unchunked fp32 references of every loss
(:mod:`chunkloss.testing.reference`) and the seam that picks which per-chunk steps the losses build
(:func:`select_steps`, :func:`steps_of`). Nothing in the rest of chunkloss imports this package."""

from chunkloss.testing.steps import select_steps, steps_of

__all__ = ["select_steps", "steps_of"]
