"""A frozen base weight stored in float8 e4m3 with one fp32 scale per output row, and its two GEMMs.

Storage, quantised once: ``s_w[o] = max_i |W[o, i]| / 448`` (448 is e4m3's largest finite value; 1 for a row
of zeros) and ``Wq = round_e4m3(W / s_w)``, so ``W ≈ s_w ⊙ Wq``: one byte per weight and four per row.

Forward ``y = x·Wᵀ + b`` with ``x`` (M, in) quantised per row on the fly the same way (``s_x[m]``,
``xq``)::

    y[m, o] = s_x[m] · s_w[o] · Σ_i xq[m, i] · Wq[o, i]
            = scaled_mm(xq, Wqᵀ, scale_a=s_x (M, 1), scale_b=s_wᵀ (1, out), bias=b)

Input gradient ``dx = g·W`` for the upstream ``g`` (M, out): the contraction now runs over W's rows, where its
scales sit, and ``scaled_mm``'s ``scale_b`` scales the output's columns, not the contraction index. So the
row scales are folded into the gradient before it is quantised::

    dx[m, i] = Σ_o g[m, o] · s_w[o] · Wq[o, i] = Σ_o g'[m, o] · Wq[o, i],   g' = g ⊙ s_wᵀ
    g' ≈ s_g ⊙ gq (per row, as x)  ->  dx = scaled_mm(gq, Wq, scale_a=s_g (M, 1), scale_b=ones(1, in))

The weight gets no gradient (it is frozen by construction). Both products accumulate in fp32 and round once
to the compute dtype. :func:`fp8_linear_ref` is the same scheme in plain PyTorch: the same quantisation of the
same tensors, dequantised and multiplied in the dtype it is given (fp64 in the tests), with the same backward;
the kernels and it differ by the GEMM's summation order and rounding only.

Where ``scaled_mm`` cannot take the shapes or dtype (:func:`scaled_mm_refusal`: on CUDA, ``in`` and ``out``
not multiples of 16, or an fp32/fp64 output; on CPU, an fp64 output), the same quantised operands are
dequantised and multiplied in fp32: the same values, the GEMM's speed not fp8's.

``scaled_mm`` is torch's private fp8 GEMM (torchao's float8 training calls it too), reached through
``chunkloss._compat.torch`` (the one layer below the kernels); ``tests/kernels/test_fp8.py`` checks first
that this build takes it with row-wise scales.

A group of weights read by one input (q, k and v) joins as one :class:`Float8Weight`
(:meth:`Float8Weight.cat`: the data and the scales concatenated along the output dimension), so one GEMM
serves the group each way, and its input gradient is quantised with one scale per row over all the group's
columns.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from chunkloss._compat import torch as torch_compat

from .frozen import FrozenWeight

_log = logging.getLogger("chunkloss.kernels")

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # e4m3fn's largest finite value
MIN_CUDA_CAPABILITY = (8, 9)  # Ada and Hopper: the first with fp8 tensor cores


def fp8_refusal(device: torch.device | str) -> str | None:
    """Why float8 weights cannot run on ``device`` with this build, or None when they can."""
    device = torch.device(device)
    if FP8 is None or not torch_compat.has_scaled_mm():
        return f"this torch {torch.__version__} has no float8_e4m3fn dtype or fp8 scaled matmul"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CUDA_CAPABILITY:
            got = ".".join(map(str, capability))
            return f"CUDA compute capability {got} has no fp8 GEMM (8.9 or newer needed)"
    elif device.type not in ("cpu", "meta"):
        return f"no fp8 GEMM on {device.type}"
    return None


def scaled_mm_refusal(device: torch.device, k: int, n: int, dtype: torch.dtype) -> str | None:
    """Why the fp8 GEMM (``scaled_mm``) cannot compute an (M, k)·(k, n) product in ``dtype`` on ``device``,
    or None.

    cuBLASLt's fp8 GEMM needs k and n multiples of 16, and row-wise scales give bf16 or fp16 outputs only
    (fp32 on some Hopper builds, not relied on); the CPU build takes any shape and bf16, fp16 or fp32."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"{dtype} output"
    if device.type == "cuda":
        if dtype == torch.float32:
            return "fp32 output with row-wise scales"
        if k % 16 or n % 16:
            return f"a ({k} x {n}) operand: cuBLASLt's fp8 GEMM needs multiples of 16"
    return None


def quantize_rows(
    t: torch.Tensor, col_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_ref`'s values, on CUDA from one kernel (:func:`_quantize_rows_kernel`: ``t`` read
    twice, one byte written per element, where PyTorch makes five passes over an fp32 copy)."""
    if t.is_cuda and t.ndim == 2 and t.dtype in _KERNEL_DTYPES and t.numel():
        return _quantize_rows_triton(t, col_scale)
    return quantize_rows_ref(t, col_scale)


def quantize_rows_ref(
    t: torch.Tensor, col_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tq, scale)``: ``t`` (M, K) as e4m3 with one fp32 scale per row, ``t ≈ scale ⊙ tq``; with
    ``col_scale`` (1, K) fp32, ``t ⊙ col_scale`` (taken in fp32) is quantised instead.

    ``scale = max|t[m, :]| / 448``, 1 for a row of zeros; computed in fp32 whatever ``t``'s dtype, so an fp64
    reference and an fp32 run quantise fp32 values alike. A non-finite row gives a non-finite scale (NaN
    downstream, as the unquantised GEMM would give)."""
    t32 = t.float() if col_scale is None else t.float() * col_scale
    amax = t32.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    tq = (t32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return tq, scale


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_QUANT_BLOCK = 1024
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _e4m3_rtne(v):
    """fp32 ``v`` (|v| <= 448) -> the e4m3fn byte rounded to nearest, ties to even, in integer operations
    (Triton's interpreter converts to fp8 wrongly; on a GPU this equals ``cvt.rn.satfinite.e4m3``). Normal
    range (|v| >= 2^-6): fp32's bits rounded to 3 mantissa bits, the exponent rebiased from 127 to 7.
    Subnormals: ``m = rtne(|v| · 2^9)``, whose byte is ``m`` (8 gives 2^-6, the first normal, as it must)."""
    b = v.to(tl.uint32, bitcast=True)
    a = b & 0x7FFFFFFF
    normal = ((a + (0x7FFFF + ((a >> 20) & 1))) >> 20) - 960
    e = (a >> 23).to(tl.int32)
    shift = tl.maximum(tl.minimum(141 - e, 31), 1).to(tl.uint32)  # read for subnormals only (21..31)
    mant = (a & 0x7FFFFF) | 0x800000
    sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
    mag = tl.where(a >= (121 << 23), normal, tl.where(a == 0, 0, sub))
    return (((b >> 24) & 0x80) | mag).to(tl.uint8)


@triton.jit
def _quantize_rows_kernel(
    t_ptr, cs_ptr, q_ptr, s_ptr, K, stride_m, stride_k, HAS_CS: tl.constexpr, BLOCK: tl.constexpr
):
    """One program per row: the row's amax over ``t`` (times ``cs`` when given) in fp32, then the row divided
    by ``amax / 448`` (IEEE division, as torch's), clamped and rounded to e4m3 (to nearest, ties to even).
    ``poison`` sums ``x · 0``: NaN when the row holds a non-finite value, which the scale then carries."""
    row = tl.program_id(0).to(tl.int64)
    base = t_ptr + row * stride_m
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    poison = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(base + k * stride_k, mask=k < K, other=0.0).to(tl.float32)
        if HAS_CS:
            x = x * tl.load(cs_ptr + k, mask=k < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x))
        poison += x * 0.0
    m = tl.max(amax, axis=0)
    scale = tl.where(m > 0, tl.div_rn(m, _FP8_MAX), 1.0) + tl.sum(poison, axis=0)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(base + k * stride_k, mask=k < K, other=0.0).to(tl.float32)
        if HAS_CS:
            x = x * tl.load(cs_ptr + k, mask=k < K, other=0.0)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -_FP8_MAX), _FP8_MAX)
        tl.store(q_ptr + row * K + k, _e4m3_rtne(q), mask=k < K)


def _quantize_rows_triton(t: torch.Tensor, col_scale: torch.Tensor | None):
    """:func:`quantize_rows` on CUDA in one kernel: what torch's five elementwise passes over an fp32 copy of
    ``t`` compute, reading ``t`` twice and writing one byte per element."""
    m, k = t.shape
    tq = torch.empty(m, k, dtype=FP8, device=t.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=t.device)
    cs = t if col_scale is None else col_scale.reshape(k).float().contiguous()
    _quantize_rows_kernel[(m,)](
        t,
        cs,
        tq.view(torch.uint8),
        scale,
        k,
        t.stride(0),
        t.stride(1),
        HAS_CS=col_scale is not None,
        BLOCK=_QUANT_BLOCK,
    )
    return tq, scale


def _dequantize(tq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale ⊙ tq`` in ``dtype`` (exact in fp32 and fp64: a 4-bit significand times an fp32 scale)."""
    if dtype == torch.float64:
        return tq.double() * scale.double()
    return (tq.float() * scale).to(dtype)


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
    """One warning per reason: the GEMM runs at the speed of a 16-bit one, not fp8's."""
    _log.warning("fp8 base: %s; its GEMM runs on the dequantised operands in fp32 (same values)", reason)


def _scaled_mm(aq, scale_a, bq, scale_b, bias, dtype: torch.dtype) -> torch.Tensor:
    """``(scale_a ⊙ aq)·(bq ⊙ scale_b) + bias`` in ``dtype``: the fp8 GEMM (``scaled_mm``) where it takes
    the operands, else the dequantised operands multiplied in fp32 (see :func:`scaled_mm_refusal`), with one
    warning per reason on the ``chunkloss.kernels`` logger."""
    k, n = bq.shape
    why = scaled_mm_refusal(aq.device, k, n, dtype)
    if why is None:
        if bq.is_cuda:  # column-major, as cuBLASLt's fp8 GEMM takes its second operand (the CPU takes any)
            bq = bq.t().contiguous().t()
        bias = None if bias is None else bias.to(dtype)
        return torch_compat.scaled_mm(aq, bq, scale_a, scale_b, bias, dtype)
    _log_fallback(why)
    y = (aq.float() * scale_a) @ (bq.float() * scale_b)
    if bias is not None:
        y += bias.float()
    return y.to(dtype)


@dataclass(frozen=True, eq=False, init=False)
class Float8Weight(FrozenWeight):
    """A frozen (out, in) weight as e4m3 ``data`` with an fp32 ``scale`` per output row; its GEMMs run in
    fp8 (module docstring) and return ``dtype``.

    A :class:`~chunkloss.kernels.frozen.FrozenWeight`: ``load()`` returns ``scale ⊙ data`` in ``dtype`` (the
    references read it so), and the fused functions keep this object, never a dequantised copy.

    Args:
        data: (out, in) ``torch.float8_e4m3fn``.
        scale: (out, 1) or (out,) fp32, positive.
        dtype: the compute dtype: of the activations, the outputs and the gradients (bf16 for a bf16 model).

    Raises:
        RuntimeError: the device or this torch build has no fp8 GEMM (:func:`fp8_refusal`).
        TypeError / ValueError: data not e4m3 or not 2-D, a scale of another shape, dtype or device.
    """

    data: torch.Tensor
    scale: torch.Tensor

    own_gemm = True

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        why = fp8_refusal(data.device) if isinstance(data, torch.Tensor) else None
        if why is not None:
            raise RuntimeError(f"Float8Weight: {why}")
        if not isinstance(data, torch.Tensor) or data.dtype != FP8 or data.ndim != 2:
            got = (
                f"{data.dtype} {tuple(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
            )
            raise TypeError(f"Float8Weight: data must be a 2-D torch.float8_e4m3fn tensor, got {got}")
        scale = scale.reshape(-1, 1) if isinstance(scale, torch.Tensor) and scale.ndim == 1 else scale
        if (
            not isinstance(scale, torch.Tensor)
            or scale.dtype != torch.float32
            or scale.shape != (data.shape[0], 1)
            or scale.device != data.device
        ):
            got = (
                f"{scale.dtype} {tuple(scale.shape)} on {scale.device}"
                if isinstance(scale, torch.Tensor)
                else scale
            )
            raise ValueError(
                f"Float8Weight: scale must be a ({data.shape[0]}, 1) float32 tensor on {data.device}, "
                f"got {got}"
            )
        if not dtype.is_floating_point or dtype == FP8:
            raise TypeError(f"Float8Weight: dtype must be a compute dtype (bf16, fp16, fp32), got {dtype}")
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "load", self.dequantize)
        object.__setattr__(self, "shape", tuple(data.shape))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "device", data.device)
        self.__post_init__()

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype | None = None) -> Float8Weight:
        """``weight`` (out, in) quantised with one scale per row; ``dtype`` defaults to ``weight.dtype``.

        Raises:
            TypeError: a weight that is not a 2-D floating-point tensor (an fp8 one included).
            ValueError: a non-finite weight (its row's scale would be too).
        """
        if (
            not isinstance(weight, torch.Tensor)
            or weight.ndim != 2
            or not weight.is_floating_point()
            or weight.dtype == FP8
        ):
            got = (
                f"{weight.dtype} {tuple(weight.shape)}"
                if isinstance(weight, torch.Tensor)
                else type(weight).__name__
            )
            raise TypeError(
                f"Float8Weight.quantize: weight must be a 2-D floating-point (out, in) tensor, got {got}"
            )
        why = fp8_refusal(weight.device)
        if why is not None:
            raise RuntimeError(f"Float8Weight: {why}")
        bad = (~torch.isfinite(weight)).sum().item()  # once, at load: a host sync is fine here
        if bad:
            raise ValueError(
                f"Float8Weight.quantize: the weight has {bad} non-finite values; none can be scaled"
            )
        data, scale = quantize_rows(weight.detach())
        return cls(data, scale, weight.dtype if dtype is None else dtype)

    @classmethod
    def cat(cls, weights) -> Float8Weight | None:
        """The weights joined along the output dimension (data and scales concatenated), or None unless all
        are :class:`Float8Weight` of one compute dtype."""
        if not all(isinstance(w, Float8Weight) for w in weights) or len({w.dtype for w in weights}) != 1:
            return None
        if len(weights) == 1:
            return weights[0]
        return cls(
            torch.cat([w.data for w in weights]), torch.cat([w.scale for w in weights]), weights[0].dtype
        )

    def __repr__(self) -> str:
        return f"Float8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def dequantize(self) -> torch.Tensor:
        """``scale ⊙ data`` (out, in) in ``dtype``."""
        return _dequantize(self.data, self.scale, self.dtype)

    def to(self, dtype: torch.dtype) -> Float8Weight:
        """The same fp8 weight computing in ``dtype``."""
        return self if dtype == self.dtype else Float8Weight(self.data, self.scale, dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x·Wᵀ + bias`` (M, out) for x (M, in) in ``dtype``, x quantised per row."""
        xq, sx = quantize_rows(x)
        return _scaled_mm(xq, sx, self.data.t(), self.scale.t(), bias, self.dtype)

    def grad_input(self, g: torch.Tensor) -> torch.Tensor:
        """``g·W`` (M, in) for g (M, out): W's row scales folded into g, which is then quantised per row."""
        gq, sg = quantize_rows(g, col_scale=self.scale.t())
        ones = torch.ones(1, self.shape[1], dtype=torch.float32, device=g.device)
        return _scaled_mm(gq, sg, self.data, ones, None, self.dtype)

    def linear_ref(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`fp8_linear_ref`."""
        return fp8_linear_ref(x, self, bias)


class _Fp8LinearRef(torch.autograd.Function):
    """:func:`fp8_linear_ref`'s math, its backward written as the kernels' (PyTorch ops only)."""

    @staticmethod
    def forward(ctx, x, bias, weight: Float8Weight):
        xq, sx = quantize_rows_ref(x)
        y = F.linear(_dequantize(xq, sx, x.dtype), _dequantize(weight.data, weight.scale, x.dtype), bias)
        ctx.weight, ctx.has_bias = weight, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        w = ctx.weight
        dx = db = None
        if ctx.needs_input_grad[0]:
            gq, sg = quantize_rows_ref(dy, col_scale=w.scale.t())
            dx = _dequantize(gq, sg, dy.dtype) @ _dequantize(w.data, torch.ones_like(w.scale), dy.dtype)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            db = dy.sum(0)
        return dx, db, None


def fp8_linear_ref(x: torch.Tensor, weight: Float8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure PyTorch: ``x`` quantised per row as :func:`quantize_rows` does, both operands dequantised and
    multiplied with ``F.linear`` in ``x``'s dtype; the backward quantises ``g ⊙ s_wᵀ`` per row and multiplies
    it by ``Wq`` in that dtype (module docstring). ``x`` (..., in) -> (..., out)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = _Fp8LinearRef.apply(x2, bias, weight)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_linear(x: torch.Tensor, weight: Float8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for a :class:`Float8Weight` W, on the fp8 GEMM both ways; equals
    :func:`fp8_linear_ref`. ``x`` (..., in) in ``weight.dtype`` -> (..., out); only ``x`` and ``bias`` get
    gradients."""
    from .lora import lora_linear

    if not isinstance(weight, Float8Weight):
        raise TypeError(f"fp8_linear: weight must be a Float8Weight, got {type(weight).__name__}")
    return lora_linear(x, weight, bias)


class Float8Linear(nn.Module):
    """``nn.Linear``'s forward on a frozen float8 weight: ``fp8_linear(x, W, bias)``, in ``x``'s dtype (the
    autocast dtype under autocast).

    Storage: ``weight_fp8`` (out, in) holds the e4m3 bytes and ``weight_scale`` (out, 4) the bytes of the fp32
    row scales, both as ``uint8`` buffers: one byte per weight and nothing else, where keeping a ``weight``
    Parameter beside them would keep the 16-bit copy alive. Bytes, not float tensors, so that a dtype cast of
    the model (``model.to(torch.bfloat16)``, ``.half()``) passes them by instead of turning the e4m3 values
    into bf16 numbers without their scales, and loading a 16-bit checkpoint into the module fails on its
    keys instead of copying 16-bit values into e4m3 unscaled. PEFT's ``save_pretrained`` writes the adapters
    only, whatever the base layers hold. There is no ``weight``: what needs a dense weight (merging an adapter
    into the base) is refused by an ``AttributeError`` that says so; :meth:`dequantize` returns the weight as
    the GEMMs see it.

    Args:
        in_features, out_features: the sizes of ``nn.Linear``.
        bias: a bias Parameter (out,) or None, kept as the linear layer had it.
        dtype: the dtype the weight was quantised from (what :meth:`dequantize` returns).
        device: where the buffers live.
    """

    def __init__(self, in_features: int, out_features: int, bias, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer(
            "weight_fp8", torch.zeros(out_features, in_features, dtype=torch.uint8, device=device)
        )
        self.register_buffer("weight_scale", torch.zeros(out_features, 4, dtype=torch.uint8, device=device))
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8Linear:
        """The layer with ``linear``'s weight quantised (its bias kept); the weight must not require grad."""
        weight = linear.weight
        if weight.requires_grad:
            raise ValueError("Float8Linear: the weight requires grad; only a frozen base is stored in fp8")
        fw = Float8Weight.quantize(weight.detach())
        layer = cls(linear.in_features, linear.out_features, linear.bias, weight.dtype, weight.device)
        layer.weight_fp8.copy_(fw.data.view(torch.uint8))
        layer.weight_scale.copy_(fw.scale.view(torch.uint8))
        return layer

    def frozen_weight(self, dtype: torch.dtype | None = None) -> Float8Weight:
        """The weight for the kernels, computing in ``dtype`` (default: the dtype it was quantised from)."""
        scale = self.weight_scale.view(torch.float32)  # (out, 1)
        return Float8Weight(self.weight_fp8.view(FP8), scale, dtype or self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight (out, in) as the GEMMs see it, ``scale ⊙ e4m3`` in the original dtype."""
        return self.frozen_weight().dequantize()

    def __getattr__(self, name: str):
        if name == "weight":
            raise AttributeError(
                "Float8Linear keeps its frozen weight in float8 (weight_fp8, weight_scale) and has no dense "
                "'weight'; what needs one (merging a LoRA adapter) is not supported on an fp8 base; "
                "dequantize() returns the weight as its GEMMs see it"
            )
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return fp8_linear(x.to(dtype), self.frozen_weight(dtype), bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
