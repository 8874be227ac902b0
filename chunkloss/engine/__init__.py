"""The chunk loop every chunkloss loss runs on, in parts:

``options``      FusedOptions, the automatic chunk size
``batch``        Batch, Rows, Sequences, ExtraHead (what a loss hands the engine), sequence_batch, segment_sum
``contract``     LossContract: what a loss author implements (the per-chunk math, a few class attributes)
``compiled``     how a step is compiled (dynamic rows, eager fallback)
``steps``        the per-chunk step kinds (StepKind), how each is built, the registry of Triton steps
``plan``         chunk size and boundaries, one pass or two
``weight_grad``  the weight-gradient accumulator
``loop``         the chunk loop (token pass, one-pass and two-pass sequence losses)
``function``     the autograd Function
``loss``         FusedLinearBase: the contract on an ``nn.Module``, the entry point ``run``

Each imports only the ones above it.

docs/design.md explains each part and the measurement behind it.
"""

from chunkloss.engine.batch import (
    Batch,
    ExtraHead,
    Rows,
    Sequences,
    TensorFields,
    segment_sum,
    sequence_batch,
)
from chunkloss.engine.contract import LossContract
from chunkloss.engine.loss import FusedLinearBase
from chunkloss.engine.options import FusedOptions
from chunkloss.engine.steps import StepKind, register_gpu_steps

__all__ = [
    "Batch",
    "FusedLinearBase",
    "FusedOptions",
    "ExtraHead",
    "LossContract",
    "Rows",
    "Sequences",
    "StepKind",
    "TensorFields",
    "register_gpu_steps",
    "segment_sum",
    "sequence_batch",
]
