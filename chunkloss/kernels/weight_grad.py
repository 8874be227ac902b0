"""The last step of the engine's fp32 weight-gradient accumulator: ``out = (s·acc + gᵀ·x).to(dtype)``.

The chunk loop accumulates ``grad_W`` in fp32 (``acc``, V x H) and hands the weight's dtype to autograd. Done
with PyTorch, the last contribution is a cuBLAS ``addmm`` that reads and writes the whole fp32 accumulator,
and the cast reads it again. cuBLAS cannot
write a bf16 D from an fp32 C, so this kernel does both in one pass over the accumulator: each program loads
one fp32 tile of ``acc``, scales it by ``s`` (a one-element device tensor: the deferred rows' λ of two-pass
sequence losses, read on the device, no host sync), adds the tile of ``gᵀ·x`` over the K rows of the last
chunk with ``tl.dot`` (fp32 accumulation) and stores the tile rounded once to ``out``'s dtype. With K = 0 it
is the scale and cast alone; with ``acc`` None it is ``(gᵀ·x).to(dtype)``.

Numerics: every output element is the fp32 sum ``s·acc + Σ_k g[k, v]·x[k, h]`` rounded once (round to
nearest even, by hand as in ``scale.py`` because the interpreter truncates), i.e. the result of
``acc.mul_(s).addmm_(g.t(), x)`` and ``.to(dtype)`` up to the order of the fp32 additions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._utils import cdiv
from .scale import _round

__all__ = ["finish_weight_grad", "finish_weight_grad_ref"]

# Tile of the output (V rows x H columns), K step, warps and pipeline stages; with K = 0 (the scale and cast
# alone) a 64-row tile streams at the cast's bandwidth (docs/design.md, "The weight-gradient accumulator").
BLOCK_V = 128
BLOCK_V_NO_K = 64
BLOCK_H = 128
BLOCK_K = 32
NUM_WARPS = 4
NUM_STAGES = 4
#: The engine fuses a last contribution of at most this many rows (above it, cuBLAS's addmm and the cast are
#: faster).
MAX_ROWS = 1024

_LOW = (torch.bfloat16, torch.float16)


def finish_weight_grad_ref(
    acc: Tensor | None, g: Tensor | None, x: Tensor | None, s: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """``(s·acc + gᵀ·x).to(dtype)`` in fp32 PyTorch (``acc`` (V, H) fp32 or None, ``g`` (K, V), ``x`` (K, H),
    ``s`` one element or None for 1)."""
    out = None
    if acc is not None:
        out = acc.float() * (s.float() if s is not None else 1.0)
    if g is not None and g.shape[0]:
        d = g.float().t() @ x.float()
        out = d if out is None else out + d
    if out is None:
        out = torch.zeros(g.shape[1], x.shape[1])
    return out.to(dtype)


@triton.jit
def _finish_kernel(
    OUT,  # (V, H) contiguous, bf16 / fp16
    ACC,  # (V, H) contiguous fp32 (unused without HAS_ACC)
    S,  # one element, scales ACC (unused without HAS_S)
    G,  # (K, V) rows of the last chunk's logits gradient, row stride stride_g
    X,  # (K, H) the chunk's hidden rows, row stride stride_x
    V,
    H,
    K,
    stride_g,
    stride_x,
    HAS_ACC: tl.constexpr,
    HAS_S: tl.constexpr,
    UPCAST: tl.constexpr,  # the interpreter's bf16 tl.dot returns garbage (Triton 3.x): fp32 there
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Programs along H vary fastest: the ones running at once share G's column block [K, BLOCK_V] in L2,
    # and X (K x H) is read by every V block.
    pid = tl.program_id(0)
    n_h = tl.cdiv(H, BLOCK_H)
    pid_v = pid // n_h
    pid_h = pid % n_h
    offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_v = offs_v < V
    mask_h = offs_h < H
    tile = offs_v[:, None] * H + offs_h[None, :]
    mask = mask_v[:, None] & mask_h[None, :]
    if HAS_ACC:
        total = tl.load(ACC + tile, mask=mask, other=0.0)
        if HAS_S:
            total = total * tl.load(S).to(tl.float32)
    else:
        total = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        g_ptrs = G + offs_v[:, None] + k[None, :].to(tl.int64) * stride_g  # the [BLOCK_V, BLOCK_K] tile of gᵀ
        gt = tl.load(g_ptrs, mask=mask_v[:, None] & mask_k[None, :], other=0.0)
        x_ptrs = X + k[:, None].to(tl.int64) * stride_x + offs_h[None, :]
        xt = tl.load(x_ptrs, mask=mask_k[:, None] & mask_h[None, :], other=0.0)
        if UPCAST:
            gt, xt = gt.to(tl.float32), xt.to(tl.float32)
        total = tl.dot(gt, xt, total)
    tl.store(OUT + tile, _round(total, OUT.dtype.element_ty), mask=mask)


_INTERPRETED = not isinstance(_finish_kernel, triton.runtime.JITFunction)


def finish_weight_grad(
    acc: Tensor | None,
    g: Tensor | None,
    x: Tensor | None,
    s: Tensor | None,
    dtype: torch.dtype,
    *,
    block_v: int | None = None,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """``(s·acc + gᵀ·x).to(dtype)`` as a new (V, H) tensor, in one pass over ``acc``.

    Args:
        acc: (V, H) contiguous fp32 accumulator, or None (no earlier contribution).
        g: (K, V) logits gradient of the last rows (unit column stride), or None (K = 0).
        x: (K, H) their hidden rows (unit column stride), in ``g``'s dtype.
        s: one-element tensor on the device scaling ``acc`` (None: 1).
        dtype: bf16 or fp16, the weight's dtype.
        block_v, block_h, block_k, num_warps, num_stages: launch overrides.
    """
    if dtype not in _LOW:
        raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
    if (g is None) != (x is None):
        raise ValueError("g and x come together")
    ref = acc if acc is not None else g
    if ref is None:
        raise ValueError("nothing to finish: acc, g and x are all None")
    device = ref.device
    if acc is not None and (acc.dtype != torch.float32 or acc.dim() != 2 or not acc.is_contiguous()):
        raise ValueError("acc must be a contiguous 2-D float32 tensor")
    if g is not None:
        if g.dim() != 2 or x.dim() != 2 or g.shape[0] != x.shape[0] or g.dtype != x.dtype:
            raise ValueError(
                f"g (K, V) and x (K, H) must share K and dtype, got {tuple(g.shape)} {g.dtype} "
                f"and {tuple(x.shape)} {x.dtype}"
            )
        if g.stride(1) != 1 or x.stride(1) != 1:
            raise ValueError("g and x need unit column stride")
        v, h, k = g.shape[1], x.shape[1], g.shape[0]
        if acc is not None and acc.shape != (v, h):
            raise ValueError(f"acc {tuple(acc.shape)} does not match g and x ({v}, {h})")
    else:
        (v, h), k = acc.shape, 0
    out = torch.empty((v, h), dtype=dtype, device=device)
    if out.numel() == 0:
        return out
    bv, bh = block_v or (BLOCK_V if k else BLOCK_V_NO_K), block_h or BLOCK_H
    dummy = out
    grid = (cdiv(v, bv) * cdiv(h, bh),)
    _finish_kernel[grid](
        out,
        acc if acc is not None else dummy,
        s if s is not None else dummy,
        g if g is not None else dummy,
        x if x is not None else dummy,
        v,
        h,
        k,
        g.stride(0) if g is not None else 0,
        x.stride(0) if x is not None else 0,
        HAS_ACC=acc is not None,
        HAS_S=s is not None,
        UPCAST=_INTERPRETED,
        BLOCK_V=bv,
        BLOCK_H=bh,
        BLOCK_K=block_k or BLOCK_K,
        num_warps=num_warps or NUM_WARPS,
        num_stages=num_stages or NUM_STAGES,
    )
    return out
