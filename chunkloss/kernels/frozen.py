"""A frozen base weight that the fused projections materialise for each GEMM instead of keeping.

QLoRA (arXiv:2305.14314) stores a projection's weight in 4 bits and trains adapters on it; the full-precision
weight exists only for the GEMM that reads it. :class:`FrozenWeight` hands the kernels that weight as a
``load`` callable (for a bitsandbytes 4-bit base, ``dequantize_4bit(weight.data, weight.quant_state)``):
``lora_linear``, ``attention_input`` and ``gated_mlp`` call it right before each GEMM that reads the weight,
once in the forward and once in the backward's input gradient (twice for gate/up replayed by ``gated_mlp``'s
recompute mode), and drop the result after the GEMM. The autograd Functions keep the :class:`FrozenWeight`
itself, never its materialised tensor, so a 4-bit base costs the backward no full-precision copy.

Every function that takes a :class:`FrozenWeight` equals the same function given ``weight.load()``, frozen,
but for a weight that runs its own GEMMs (``own_gemm``: :class:`~chunkloss.kernels.fp8.Float8Weight`, whose
products run in fp8): the kernels read a weight through :func:`linear`, :func:`grad_input` and their joined
forms, which call such a weight's methods and give any other weight to ``F.linear`` and ``mm`` as before.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    own_gemm = False  # runs its own products (linear, grad_input); else it is loaded for F.linear and mm

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

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, W, bias)``, W loaded for it."""
        return F.linear(x, materialize(self), bias)

    def grad_input(self, g: torch.Tensor) -> torch.Tensor:
        """``g·W``, W loaded for it."""
        return g @ materialize(self)

    def linear_ref(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """What the references compute for ``F.linear(x, W, bias)``: the same."""
        return F.linear(x, materialize(self), bias)

    @classmethod
    def cat(cls, weights) -> "FrozenWeight | None":
        """One weight of the same kind for ``weights`` joined along the output dimension; here None (the
        weights are loaded and stacked instead)."""
        return None


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


def _own(weight: Weight) -> bool:
    return isinstance(weight, FrozenWeight) and weight.own_gemm


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (N, in); a :class:`FrozenWeight` loaded for it, or its own GEMM."""
    return weight.linear(x, bias) if isinstance(weight, FrozenWeight) else F.linear(x, weight, bias)


def grad_input(g: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``g·weight`` for g (N, out): the input gradient of :func:`linear`."""
    return weight.grad_input(g) if isinstance(weight, FrozenWeight) else g @ weight


def add_grad_input_(out: torch.Tensor, g: torch.Tensor, weight: Weight) -> None:
    """``out += g·weight`` in place (one ``addmm_`` unless the weight runs its own GEMM)."""
    if _own(weight):
        out.add_(weight.grad_input(g))
    else:
        out.addmm_(g, materialize(weight))


def linear_ref(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The references' ``F.linear(x, weight, bias)`` (a weight with its own GEMMs gives its own reference)."""
    return weight.linear_ref(x, bias) if isinstance(weight, FrozenWeight) else F.linear(x, weight, bias)


def _joined(weights):
    """The weights as one weight with its own GEMMs (all of one such kind), or None."""
    return type(weights[0]).cat(weights) if all(map(_own, weights)) else None


def joined_linear(x: torch.Tensor, weights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x·[W_1; W_2; ...]ᵀ + bias`` (N, Σ out) in one GEMM: the weights stacked (FrozenWeights loaded), or
    joined by their own kind (:meth:`FrozenWeight.cat`). Weights with their own GEMMs among others run one
    GEMM each, their outputs concatenated."""
    if not any(map(_own, weights)):
        return F.linear(x, stacked(weights), bias)
    joined = _joined(weights)
    if joined is not None:
        return joined.linear(x, bias)
    biases = (None,) * len(weights) if bias is None else bias.split([w.shape[0] for w in weights])
    return torch.cat([linear(x, w, b) for w, b in zip(weights, biases, strict=True)], dim=1)


def joined_grad_input(g: torch.Tensor, weights) -> torch.Tensor:
    """``g·[W_1; W_2; ...]`` (N, in) for g (N, Σ out): the input gradient of :func:`joined_linear`, computed
    as it computed the forward (one GEMM, or one per weight summed)."""
    if not any(map(_own, weights)):
        return g @ stacked(weights)
    joined = _joined(weights)
    if joined is not None:
        return joined.grad_input(g)
    parts = g.split([w.shape[0] for w in weights], dim=1)
    out = grad_input(parts[0], weights[0])
    for part, w in zip(parts[1:], weights[1:], strict=True):
        add_grad_input_(out, part, w)
    return out


def joined_linear_ref(x: torch.Tensor, weights, biases) -> list[torch.Tensor]:
    """The references' outputs of the projections ``weights`` (biases, each or None) of one input: each its
    own :func:`linear_ref`, or one joined reference where :func:`joined_linear` joins them."""
    joined = _joined(weights)
    if joined is None:
        return [linear_ref(x, w, b) for w, b in zip(weights, biases, strict=True)]
    if any(b is not None for b in biases):
        biases = [
            torch.zeros(w.shape[0], dtype=x.dtype, device=x.device) if b is None else b
            for w, b in zip(weights, biases, strict=True)
        ]
    bias = None if biases[0] is None else torch.cat(biases)
    return list(joined.linear_ref(x, bias).split([w.shape[0] for w in weights], dim=-1))
