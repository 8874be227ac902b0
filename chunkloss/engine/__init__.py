"""The chunk loop every chunkloss loss runs on, in parts:

``options``      FusedOptions, the automatic chunk size
``batch``        Batch and Head (what a loss hands the engine), sequence_batch, segment_sum
``loss``         FusedLinearBase: the base class and the contract a loss author implements
``steps``        the per-chunk step kinds (StepKind), how each is built, the registry of Triton steps
``compiled``     how a step is compiled (dynamic rows, eager fallback)
``plan``         chunk size and boundaries, one pass or two
``loop``         the chunk loop (token pass, one-pass and two-pass sequence losses)
``weight_grad``  the weight-gradient accumulator
``function``     the autograd Function

docs/design.md explains each part and the measurement behind it.
"""

from chunkloss.engine.batch import Batch, Head, segment_sum, sequence_batch
from chunkloss.engine.loss import FusedLinearBase
from chunkloss.engine.options import FusedOptions
from chunkloss.engine.steps import StepKind, register_gpu_steps

__all__ = [
    "Batch",
    "FusedLinearBase",
    "FusedOptions",
    "Head",
    "StepKind",
    "register_gpu_steps",
    "segment_sum",
    "sequence_batch",
]
