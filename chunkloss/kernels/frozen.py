"""A frozen base weight that the fused projections materialise for each GEMM instead of keeping.

QLoRA (arXiv:2305.14314) stores a projection's weight in 4 bits and trains adapters on it; the full-precision
weight exists only for the GEMM that reads it. :class:`FrozenWeight` hands the kernels that weight as a
``load`` callable (for a bitsandbytes 4-bit base, ``dequantize_4bit(weight.data, weight.quant_state)``):
``lora_linear``, ``attention_input`` and ``gated_mlp`` call it right before each GEMM that reads the weight,
once in the forward and once in the backward's input gradient (twice for gate/up replayed by ``gated_mlp``'s
recompute mode), and drop the result after the GEMM. The autograd Functions keep the :class:`FrozenWeight`
itself, never its materialised tensor, so a 4-bit base costs the backward no full-precision copy.

Every function that takes a :class:`FrozenWeight` equals the same function given ``weight.load()``, frozen.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class FrozenWeight:
    """A frozen (out, in) weight given by the callable that materialises it.

    Args:
        load: returns the weight, a fresh (out, in) tensor of ``dtype`` on ``device``; called once per GEMM.
        shape: (out, in).
        dtype: the dtype ``load`` returns: the dtype of the GEMMs that read it.
        device: the device ``load`` returns it on.
    """

    load: Callable[[], torch.Tensor]
    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    ndim = 2

    def __post_init__(self):
        if len(self.shape) != 2:
            raise ValueError(f"FrozenWeight: shape must be (out, in), got {tuple(self.shape)}")
        object.__setattr__(self, "shape", torch.Size(self.shape))
        object.__setattr__(self, "device", torch.device(self.device))

    def to(self, dtype: torch.dtype) -> "FrozenWeight":
        """This weight loaded in ``dtype`` (as ``Tensor.to``, under autocast)."""
        if dtype == self.dtype:
            return self
        return FrozenWeight(lambda: self.load().to(dtype), self.shape, dtype, self.device)


Weight = torch.Tensor | FrozenWeight


def check_weights(where: str, names: tuple[str, ...], weights) -> None:
    """Each weight a floating-point tensor or a :class:`FrozenWeight`: a packed quantised weight (a
    bitsandbytes ``Params4bit``, uint8) is refused with one line instead of reaching a GEMM."""
    for name, w in zip(names, weights, strict=True):
        if isinstance(w, FrozenWeight):
            continue
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            got = w.dtype if isinstance(w, torch.Tensor) else type(w).__name__
            raise TypeError(
                f"{where}: {name} must be a floating-point tensor or a FrozenWeight, got "
                f"{got} (a packed quantised weight goes in a FrozenWeight that dequantises "
                f"it)"
            )


def materialize(weight: Weight) -> torch.Tensor:
    """The weight as a tensor: a tensor as it is, a :class:`FrozenWeight` loaded (and checked)."""
    if not isinstance(weight, FrozenWeight):
        return weight
    w = weight.load()
    if not isinstance(w, torch.Tensor) or w.shape != weight.shape or w.dtype != weight.dtype:
        got = f"{tuple(w.shape)} {w.dtype}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(
            f"FrozenWeight.load() must return a {tuple(weight.shape)} {weight.dtype} tensor, got {got}"
        )
    return w


def stacked(weights) -> torch.Tensor:
    """``torch.cat`` of the weights along their output dimension (one GEMM reads them all)."""
    return torch.cat([materialize(w) for w in weights])


def split_frozen(weights) -> tuple[tuple, tuple]:
    """``(tensors, frozen)``: each weight in the first tuple when it is a tensor (None otherwise), in the
    second when it is a :class:`FrozenWeight`: what an autograd Function saves, what it keeps on ``ctx``."""
    frozen = tuple(w if isinstance(w, FrozenWeight) else None for w in weights)
    return tuple(None if f is not None else w for w, f in zip(weights, frozen, strict=True)), frozen


def joined(tensors, frozen) -> tuple:
    """The weights again from :func:`split_frozen`'s two tuples."""
    return tuple(f if f is not None else t for t, f in zip(tensors, frozen, strict=True))
