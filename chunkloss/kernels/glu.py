"""Gated activations ``act(a) * b``: SwiGLU (``act = silu``) and GeGLU (``act = gelu_tanh`` or ``gelu``).

SwiGLU equals ``transformers``' ``ACT2FN["silu"](a) * b`` (Llama, Mistral, Qwen MLPs), GeGLU equals
``ACT2FN["gelu_pytorch_tanh"](a) * b`` (Gemma MLPs) or ``ACT2FN["gelu"](a) * b`` (exact, erf-based).
The activation is computed in fp32 and rounded once.
The forward saves only ``a`` and ``b``; the backward recomputes ``act(a)`` and ``act'(a)``.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from ._utils import cdiv, custom_op

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_ACT_ID = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


def swiglu_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b`` ((..., I), (..., I) -> (..., I)), as LlamaMLP computes it."""
    return F.silu(a) * b


def geglu_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.gelu(a, approximate="tanh") * b`` ((..., I), (..., I) -> (..., I)), as GemmaMLP computes it."""
    return F.gelu(a, approximate="tanh") * b


def glu_ref(a: torch.Tensor, b: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(a) * b`` for ``activation`` in :data:`ACTIVATIONS` ("gelu" is the exact, erf-based GELU)."""
    if activation == "silu":
        return F.silu(a) * b
    if activation == "gelu_tanh":
        return F.gelu(a, approximate="tanh") * b
    if activation == "gelu":
        return F.gelu(a) * b
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


@dataclass(frozen=True)
class GLUOptions:
    activation: str = "silu"
    in_place: bool = False  # backward writes da, db over the saved a, b


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# act(a) and act'(a) in fp32, with s = sigmoid(a) and, for gelu_tanh, u = k0 * (a + 0.044715 a^3):
#   silu(a) = a s,                 silu'(a) = s (1 + a (1 - s))
#   gelu_tanh(a) = 0.5 a (1 + t),  gelu_tanh'(a) = 0.5 (1 + t) + 0.5 a (1 - t^2) k0 (1 + 3 0.044715 a^2)
#   with t = tanh(u);
#   gelu(a) = a c,  gelu'(a) = c + a exp(-a^2 / 2) / sqrt(2 pi),  with c = 0.5 (1 + erf(a / sqrt 2)).
# tanh(u) = 2 sigmoid(2u) - 1, which every backend (and the interpreter) provides and is stable for large |u|.
@triton.jit
def _act_and_grad(a, ACT: tl.constexpr, K0: tl.constexpr):
    if ACT == 0:
        s = tl.sigmoid(a)
        return a * s, s * (1.0 + a * (1.0 - s))
    elif ACT == 1:
        t = 2.0 * tl.sigmoid(2.0 * K0 * (a + 0.044715 * a * a * a)) - 1.0
        act = 0.5 * a * (1.0 + t)
        dact = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * K0 * (1.0 + 3.0 * 0.044715 * a * a)
        return act, dact
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(a * 0.7071067811865476))  # 1 / sqrt(2); 0.3989... = 1 / sqrt(2 pi)
        return a * cdf, cdf + a * tl.exp(-0.5 * a * a) * 0.3989422804014327


@triton.jit
def _glu_fwd_kernel(
    A,  # (n,) gate input, flat contiguous
    B,  # (n,) up input, flat contiguous
    C,  # (n,) output act(a) * b
    n_elements,
    ACT: tl.constexpr,  # 0 silu, 1 gelu_tanh, 2 gelu (erf)
    K0: tl.constexpr,  # sqrt(2 / pi)
    BLOCK_SIZE: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(a, ACT, K0)
    tl.store(C + offs, (act * b).to(C.dtype.element_ty), mask=mask)


# Backward of c = act(a) * b:  da = dc * b * act'(a),  db = dc * act(a); with WRITE_C also c itself, for a
# caller that did not keep it (the gated MLP's down-projection weight gradient).
@triton.jit
def _glu_bwd_kernel(
    DC,  # (n,) upstream gradient
    A,  # (n,) saved gate input
    B,  # (n,) saved up input
    DA,  # (n,) gate gradient (may alias A)
    DB,  # (n,) up gradient (may alias B)
    C,  # (n,) act(a) * b, written when WRITE_C (may alias DC)
    n_elements,
    ACT: tl.constexpr,
    K0: tl.constexpr,
    WRITE_C: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    dc = tl.load(DC + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(a, ACT, K0)
    tl.store(DA + offs, (dc * b * dact).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dc * act).to(DB.dtype.element_ty), mask=mask)
    if WRITE_C:
        tl.store(C + offs, (act * b).to(C.dtype.element_ty), mask=mask)


# Elementwise: big tiles so each thread issues wide vector loads (the sweep behind these values is in
# docs/design.md, "Kernel launch parameters").
BLOCK_SIZE = 2048
NUM_WARPS = 16


def _glu_fwd(a, b, opts: GLUOptions):
    """``c = act(a) * b`` and the contiguous ``a``, ``b`` it read."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert opts.activation in ACTIVATIONS, opts.activation
    a, b = a.contiguous(), b.contiguous()
    if torch.compiler.is_compiling():
        return glu_fwd_op(a.detach(), b.detach(), opts.activation), a, b
    return _glu_fwd_launch(a, b, opts.activation), a, b


def _glu_fwd_launch(a, b, activation):
    c = torch.empty_like(a)
    n = a.numel()
    _glu_fwd_kernel[(cdiv(n, BLOCK_SIZE),)](
        a,
        b,
        c,
        n,
        ACT=_ACT_ID[activation],
        K0=_SQRT_2_OVER_PI,
        BLOCK_SIZE=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )
    return c


def _glu_bwd(dc, a, b, opts: GLUOptions, c: torch.Tensor | None = None):
    """``(da, db, c)``: ``da, db`` (over ``a``, ``b`` with ``opts.in_place``) and, with ``c`` (which may be
    ``dc``), ``act(a) * b`` written into it (else None). ``a``, ``b`` and ``c`` contiguous. Under
    ``torch.compile`` every output is a new tensor."""
    dc = dc.contiguous()
    if torch.compiler.is_compiling():
        da, db, c_new = glu_bwd_op(dc.detach(), a.detach(), b.detach(), opts.activation, c is not None)
        return da, db, (c_new if c is not None else None)
    da, db = (a, b) if opts.in_place else (torch.empty_like(a), torch.empty_like(b))
    _glu_bwd_launch(dc, a, b, da, db, c, opts.activation)
    return da, db, c


def _glu_bwd_launch(dc, a, b, da, db, c, activation):
    n = a.numel()
    _glu_bwd_kernel[(cdiv(n, BLOCK_SIZE),)](
        dc,
        a,
        b,
        da,
        db,
        dc if c is None else c,
        n,
        ACT=_ACT_ID[activation],
        K0=_SQRT_2_OVER_PI,
        WRITE_C=c is not None,
        BLOCK_SIZE=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )


# The launches as custom ops with new outputs, which torch.compile calls without tracing into Triton (the
# interpreter included): the Functions use them while compiling and the in-place launches otherwise. Their
# inputs are passed detached: the Functions' backwards are written out, and autograd's fallback for custom ops
# stays out of the trace.
@custom_op("glu_fwd")
def glu_fwd_op(a: torch.Tensor, b: torch.Tensor, activation: str) -> torch.Tensor:
    return _glu_fwd_launch(a.contiguous(), b.contiguous(), activation)


@glu_fwd_op.register_fake
def _(a, b, activation):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@custom_op("glu_bwd")
def glu_bwd_op(
    dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, activation: str, write_c: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b = a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    c = torch.empty_like(dc if write_c else a[:0])
    _glu_bwd_launch(dc.contiguous(), a, b, da, db, c if write_c else None, activation)
    return da, db, c


@glu_bwd_op.register_fake
def _(dc, a, b, activation, write_c):
    new = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return new(a), new(b), new(dc if write_c else a[:0])


class GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, opts: GLUOptions):
        c, a, b = _glu_fwd(a, b, opts)
        ctx.save_for_backward(a, b)
        ctx.opts = opts
        return c

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        if not any(ctx.needs_input_grad[:2]):
            return None, None, None
        # One pass writes both gradients; the unneeded one is dropped (it costs one store, not a second read).
        da, db, _ = _glu_bwd(dc, a, b, ctx.opts)
        return (da if ctx.needs_input_grad[0] else None), (db if ctx.needs_input_grad[1] else None), None


def _glu(a, b, activation, in_place):
    shape = a.shape
    opts = GLUOptions(activation, in_place)
    c = GLUFunction.apply(a.reshape(-1, shape[-1]), b.reshape(-1, shape[-1]), opts)
    return c.view(shape)


def swiglu(a: torch.Tensor, b: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """Triton ``F.silu(a) * b``.

    Args:
        a: (..., I) gate projection.
        b: (..., I) up projection, same shape and dtype.
        in_place: the backward writes da and db over the saved ``a`` and ``b`` (saves two (..., I) buffers).
            Only safe when nothing else reads ``a``/``b`` after the backward (e.g. fresh projections inside an
            MLP) and the graph is not backwarded twice.

    Returns:
        (..., I) in ``a.dtype``.
    """
    return _glu(a, b, "silu", in_place)


def geglu(a: torch.Tensor, b: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """Triton ``F.gelu(a, approximate="tanh") * b``; arguments as :func:`swiglu`."""
    return _glu(a, b, "gelu_tanh", in_place)


class GLU(nn.Module):
    """``act(a) * b`` as a module (no parameters).

    Args:
        activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
        in_place: see :func:`swiglu`.
    """

    def __init__(self, activation: str = "silu", in_place: bool = False):
        super().__init__()
        assert activation in ACTIVATIONS, activation
        self.activation, self.in_place = activation, in_place

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _glu(a, b, self.activation, self.in_place)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class SwiGLU(GLU):
    """``F.silu(a) * b`` as a module."""

    def __init__(self, in_place: bool = False):
        super().__init__("silu", in_place)


class GeGLU(GLU):
    """``F.gelu(a, approximate="tanh") * b`` as a module."""

    def __init__(self, in_place: bool = False):
        super().__init__("gelu_tanh", in_place)
