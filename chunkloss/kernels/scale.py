"""``t *= s`` in place, skipped on the device when ``s == 1``: the engine's backward.

The chunked losses compute their gradients in forward, and backward only multiplies them by the incoming
``grad_output`` (``chunkloss.engine.function.scale_grad``). That is almost always exactly 1
(``loss.backward()``), yet ``t.mul_(s)`` reads and writes the whole gradient (at Llama-3 head sizes the bf16
weight gradient is 128256 x 4096, 1.05 GB), every step. The host cannot look at ``s`` without waiting for the
stream, so the device does: every program of the kernel first loads ``s`` and returns when it is 1, before
touching ``t``; otherwise the programs scale ``t`` in a grid-stride loop.

The numerics are those of ``t.mul_(s.to(t.dtype))`` bit for bit: ``s`` is rounded once to ``t``'s dtype,
the product of the two is taken in fp32 (exact for bf16 and fp16 operands outside fp32's subnormal range:
their 8- and 11-bit significands multiply into at most 22 bits) and rounded to ``t``'s dtype, which is what
PyTorch's elementwise ``mul`` does for low-precision tensors (fp32 ``opmath``). The fp32 -> bf16 rounding is
written out in integer operations because Triton's interpreter truncates, so the CPU tests check the same
arithmetic the GPU runs. The skip compares the *rounded*
``s`` with 1, where multiplying would leave every value as it is; NaN is not 1, so a NaN or inf ``s``
multiplies and propagates as with ``mul_``. (The only bits a multiplication by 1 could change are NaN
payloads in ``t``, which the skip leaves as they are.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._utils import cdiv, num_sms

__all__ = ["scale_", "scale_ref"]

# Elements per step of a program, warps per program and programs per SM of the grid-stride loop: a few
# programs per SM, not one per block, so that at s == 1 only a few hundred programs load s and exit
# (docs/design.md, "Triton kernels").
BLOCK = 4096
NUM_WARPS = 8
PROGRAMS_PER_SM = 4

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scale_ref(t: Tensor, s: Tensor) -> Tensor:
    """``t · s`` as a new tensor, with the numerics of ``t.mul_(s.to(t.dtype))`` (what the engine did
    before this kernel, and does off CUDA)."""
    return t * s.to(t.dtype)


@triton.jit
def _bf16_rtne(p):
    """fp32 -> bf16 rounded to nearest, ties to even, NaN to 0x7FC0: c10::BFloat16's rounding, by hand
    because the interpreter truncates (Triton 3.x). On a GPU this equals ``cvt.rn.bf16.f32`` (but for NaN
    payloads) and its few integer operations are hidden under the memory traffic."""
    b = p.to(tl.uint32, bitcast=True)
    r = ((b + (0x7FFF + ((b >> 16) & 1))) >> 16).to(tl.uint16)
    r = tl.where(p != p, 0x7FC0, r).to(tl.uint16)
    return r.to(tl.bfloat16, bitcast=True)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """``x`` (fp32, bf16 or fp16) rounded once to ``dtype``."""
    if dtype == tl.bfloat16:
        return _bf16_rtne(x.to(tl.float32))
    else:
        return x.to(dtype)


@triton.jit
def _scale_kernel(
    X,  # (n,) contiguous, scaled in place
    S,  # one element, any of fp32 / bf16 / fp16
    n,
    BLOCK: tl.constexpr,
):
    dtype = X.dtype.element_ty
    s = _round(tl.load(S), dtype)  # s.to(t.dtype)
    if s == 1.0:  # NaN == 1 is false: NaN and inf multiply
        return
    s = s.to(tl.float32)
    # int64 offsets: n may exceed 2**31 (a 262144 x 16384 head), and start + step must not wrap near n.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    cols = tl.arange(0, BLOCK)
    while start < n:  # plain loop: a pipelined tl.range gained at most 1% (see the sweep above)
        offs = start + cols
        mask = offs < n
        x = tl.load(X + offs, mask=mask)
        tl.store(X + offs, _round(x.to(tl.float32) * s, dtype), mask=mask)
        start += step


# The kernel is compiled for a GPU, or run by the interpreter when TRITON_INTERPRET=1 was set at import.
_INTERPRETED = not isinstance(_scale_kernel, triton.runtime.JITFunction)


def scale_(t: Tensor, s: Tensor, *, use_triton: bool | None = None) -> Tensor:
    """Multiply ``t`` in place by the one-element tensor ``s`` (on ``t``'s device) and return ``t``; bit for
    bit ``t.mul_(s.to(t.dtype))``.

    ``use_triton=None`` (auto) runs the kernel on CUDA, which leaves ``t`` untouched when ``s`` is 1 without
    a host sync. Off CUDA it multiplies in PyTorch, skipping the multiply when ``s`` is 1 (reading a CPU
    tensor costs no sync); ``use_triton=True`` runs the kernel on a CPU tensor through the Triton
    interpreter (``TRITON_INTERPRET=1``), for tests. A non-contiguous ``t``, or an ``s`` that autograd
    records (``create_graph=True``), is multiplied by ``mul_`` on any device.
    """
    _check(t, s)
    if use_triton is None:
        use_triton = t.is_cuda
    elif use_triton and not t.is_cuda and not _INTERPRETED:
        raise ValueError(
            f"the Triton kernel takes a {t.device.type} tensor only through the interpreter: "
            "set TRITON_INTERPRET=1 before importing chunkloss.kernels.scale"
        )
    if not use_triton or not t.is_contiguous() or (s.requires_grad and torch.is_grad_enabled()):
        s = s.to(t.dtype)
        if t.device.type == "cpu" and not s.requires_grad and bool(s == 1):
            return t
        return t.mul_(s)
    n = t.numel()
    if n == 0:
        return t
    # A few programs per SM, each striding over the tensor: enough loads in flight to saturate HBM, and
    # with s == 1 a launch of ~500 programs that each read one value and exit (a few us for 1 GB).
    grid = (min(cdiv(n, BLOCK), num_sms(t.device) * PROGRAMS_PER_SM),)
    _scale_kernel[grid](t, s, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return t


def _check(t: Tensor, s: Tensor) -> None:
    if not isinstance(t, Tensor) or not isinstance(s, Tensor):
        raise TypeError(f"scale_ takes two tensors, got {type(t).__name__} and {type(s).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"t must be float32, bfloat16 or float16, got {t.dtype}")
    if s.dtype not in _DTYPES:
        raise TypeError(f"s must be float32, bfloat16 or float16, got {s.dtype}")
    if s.numel() != 1:
        raise ValueError(f"s must hold one element, got shape {tuple(s.shape)}")
    if s.device != t.device:
        raise ValueError(f"s must be on t's device ({t.device}), got {s.device}")
