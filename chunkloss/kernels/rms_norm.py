"""RMSNorm: ``y = x / sqrt(mean(x**2) + eps) * (offset + w)``, forward and backward in Triton.

Matches ``transformers``' ``LlamaRMSNorm`` (``casting="llama"``: normalise in fp32, cast to the input
dtype, then multiply by ``w``) and ``GemmaRMSNorm`` (``casting="gemma"``, ``offset=1``: everything in fp32,
``1 + w``, one cast at the end). The forward stores only the reciprocal RMS of each row; the backward
recomputes the normalised row from ``x`` instead of keeping it.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from . import _utils
from ._norm import column_block
from ._utils import lastdim_contiguous, norm_bwd_plan, norm_dx_buffer, norm_fwd_plan

CASTING_MODES = ("llama", "gemma")


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama"
) -> torch.Tensor:
    """Pure-PyTorch RMSNorm, op for op as ``LlamaRMSNorm`` / ``GemmaRMSNorm`` compute it.

    Args:
        x: (..., D) input.
        weight: (D,) scale.
        eps: added to the mean square.
        offset: added to ``weight`` (1.0 for Gemma's ``1 + w``).
        casting: "llama" (cast the normalised row to ``x.dtype`` before scaling) or "gemma" (all in fp32).

    Returns:
        (..., D); dtype of ``weight * x`` for "llama", ``x.dtype`` for "gemma".
    """
    if casting == "llama":
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        w = weight if offset == 0.0 else weight + offset
        return w * h.to(input_dtype)
    if casting == "gemma":
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (offset + weight.float())).type_as(x)
    raise ValueError(f"casting must be one of {CASTING_MODES}, got {casting!r}")


def rms_norm_fwd_torch(x, weight, eps: float, offset: float, casting: str):
    """The forward kernel's math in PyTorch ops, ``(y, rstd)`` of (N, D) rows: what a Function built on the
    kernel runs while ``torch.compile`` traces it (Inductor fuses these ops; no Triton launch is traced)."""
    rstd = torch.rsqrt(x.float().square().mean(-1) + eps)
    xhat = x.float() * rstd[:, None]
    wt = weight.float() + offset
    if casting == "llama":
        return (xhat.to(x.dtype).float() * wt).to(torch.promote_types(x.dtype, weight.dtype)), rstd
    return (xhat * wt).to(x.dtype), rstd


def rms_norm_bwd_torch(dy, x, weight, rstd, offset: float, casting: str, needs_dx: bool, needs_dw: bool):
    """The backward kernel's math in PyTorch ops (see :func:`rms_norm_fwd_torch`): ``(dx, dw)``, each None
    when not needed. ``dx = rstd * (dxhat - xhat * mean(dxhat * xhat))`` with ``dxhat = dy * (w + offset)``;
    ``dw = sum over rows of dy * xhat`` (``xhat`` rounded to ``x``'s dtype first for "llama")."""
    dyf, xhat = dy.float(), x.float() * rstd[:, None]
    dx = dw = None
    if needs_dx:
        dxhat = dyf * (weight.float() + offset)
        dx = (rstd[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
    if needs_dw:
        xhat = xhat.to(x.dtype).float() if casting == "llama" else xhat
        dw = (dyf * xhat).sum(0).to(weight.dtype)
    return dx, dw


@dataclass(frozen=True)
class RMSNormOptions:
    eps: float = 1e-6
    offset: float = 0.0
    casting: str = "llama"
    in_place: bool = False  # backward writes dx over dy: only when dy feeds no other node


_options = functools.lru_cache(maxsize=64)(RMSNormOptions)  # one instance per option set, not one per call


# Forward, per row:  rstd = 1 / sqrt(sum(x^2) / D + eps),  xhat = x * rstd,  wt = w + offset,
#   y = cast(xhat) * wt   ("llama", cast = round to x's dtype)   or   y = xhat * wt   ("gemma").
# Fused (rows of one register tile): BLOCK_M rows per program. Looped (LOOPED, rows wider than one register
# tile, ``NormLaunchOptions.max_fused_cols``): one row per program; pass 1 accumulates x^2 over column blocks
# of BLOCK_N in an fp32 vector and reduces it once; pass 2 computes xhat and y as above, block by block. Pass
# 2 re-reads x, which pass 1 has just brought into L2.
@triton.jit
def _rms_norm_fwd_kernel(
    X,  # (N, D) input, rows stride_x apart
    Y,  # (N, D) output, contiguous
    W,  # (D,) weight
    RSTD,  # (N,) fp32, reciprocal RMS saved for the backward
    stride_x,
    stride_y,
    n_rows,
    n_cols,
    eps,
    offset,
    CAST_LLAMA: tl.constexpr,  # round xhat to X's dtype before the scale
    LOOPED: tl.constexpr,  # rows wider than one register tile: the looped forward
    BLOCK_M: tl.constexpr,  # rows per program (fused; >1 only for short rows)
    BLOCK_N: tl.constexpr,  # power of two >= D (fused) or columns per step (looped)
):
    if LOOPED:
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        y_row = Y + row * stride_y
        cols = tl.arange(0, BLOCK_N)
        sum_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        start = 0
        while start < n_cols:
            x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
            sum_sq += x * x
            start += BLOCK_N
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
        start = 0
        while start < n_cols:
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            wt = tl.load(W + start + cols, mask=mask, other=0.0).to(tl.float32) + offset
            xhat = x * rstd
            if CAST_LLAMA:
                xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
            tl.store(y_row + start + cols, (xhat * wt).to(Y.dtype.element_ty), mask=mask)
            start += BLOCK_N
        tl.store(RSTD + row, rstd)
    else:
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        wt = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        xhat = x * rstd[:, None]
        if CAST_LLAMA:
            xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
        y = xhat * wt[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=row_mask)


# Backward, per row, with dxhat = dy * wt:
#   dx = rstd * (dxhat - xhat * sum(dxhat * xhat) / D)
#   dw = sum over rows of dy * xhat (cast(xhat) for "llama"); each program sums its contiguous block of rows
#   into one fp32 row of DW_PARTIAL, the launcher adds the (n_programs, D) partials.
@triton.jit
def _rms_norm_bwd_rows(
    DY,
    X,
    RSTD,
    DX,
    wt,
    rows,
    row_mask,
    cols,
    col_mask,
    stride_dy,
    stride_x,
    stride_dx,
    n_cols,
    CAST_LLAMA: tl.constexpr,
    HAS_DX: tl.constexpr,
    HAS_DW: tl.constexpr,
):
    """dx of BLOCK_M rows, and their column sums of dy * xhat (zeros when not needed)."""
    mask = row_mask[:, None] & col_mask[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    xhat = x * rstd[:, None]
    if HAS_DX:
        dxhat = dy * wt[None, :]
        c = tl.sum(dxhat * xhat, axis=1) / n_cols
        dx = rstd[:, None] * (dxhat - xhat * c[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    dw = tl.zeros_like(wt)
    if HAS_DW:
        if CAST_LLAMA:
            xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
        dw = tl.sum(dy * xhat, axis=0)
    return dw


# The backward: each program steps through its contiguous block of rows BLOCK_M at a time. Fused (rows of one
# register tile): ``_rms_norm_bwd_rows`` per step, the column sums kept in registers. Looped (LOOPED, rows
# wider than one register tile): the same math in two passes over column blocks of BLOCK_N per step:
#   pass 1 (only when dx is needed):  c = rstd * sum(dxhat * x) / D  ( = sum(dxhat * xhat) / D ),
#     accumulated in an fp32 (BLOCK_M, BLOCK_N) tile and reduced once;
#   pass 2:  dx = rstd * (dxhat - xhat * c), written block by block, and sum(dy * xhat) over the BLOCK_M rows
#     added into the program's own row of DW_PARTIAL (in memory: a whole fp32 row does not fit in registers;
#     the first step stores instead of adding).
# Pass 2 re-reads dy and x, which pass 1 has just brought into L2.
@triton.jit
def _rms_norm_bwd_kernel(
    DY,  # (N, D) upstream gradient, rows stride_dy apart
    X,  # (N, D) forward input, rows stride_x apart
    W,  # (D,) weight
    RSTD,  # (N,) fp32 from the forward
    DX,  # (N, D) input gradient (may alias DY), rows stride_dx apart
    DW_PARTIAL,  # (n_programs, D) fp32 per-program sums of dy * xhat
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    rows_per_program,  # a multiple of BLOCK_M
    offset,
    CAST_LLAMA: tl.constexpr,
    HAS_DX: tl.constexpr,  # x requires grad
    HAS_DW: tl.constexpr,  # weight requires grad
    LOOPED: tl.constexpr,  # rows wider than one register tile: the looped backward
    BLOCK_M: tl.constexpr,  # rows per step
    BLOCK_N: tl.constexpr,  # the whole row (fused) or columns per step (looped)
    STAGES: tl.constexpr,  # fused, > 0: software-pipelined row loop (GPU); 0: a while loop (the interpreter)
):
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    if HAS_DW:
        dw_row = DW_PARTIAL + pid.to(tl.int64) * n_cols
    if LOOPED:
        start = row_start
        while start < row_end:
            rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
            row_mask = rows < row_end
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            dy_rows = DY + rows[:, None] * stride_dy
            x_rows = X + rows[:, None] * stride_x
            if HAS_DX:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                col0 = 0
                while col0 < n_cols:
                    col, col_mask, mask, dy, x = column_block(dy_rows, x_rows, row_mask, col0, cols, n_cols)
                    wt = tl.load(W + col, mask=col_mask, other=0.0).to(tl.float32) + offset
                    acc += dy * wt[None, :] * x
                    col0 += BLOCK_N
                c = tl.sum(acc, axis=1) * rstd / n_cols
            col0 = 0
            while col0 < n_cols:
                col, col_mask, mask, dy, x = column_block(dy_rows, x_rows, row_mask, col0, cols, n_cols)
                xhat = x * rstd[:, None]
                if HAS_DX:
                    wt = tl.load(W + col, mask=col_mask, other=0.0).to(tl.float32) + offset
                    dx = rstd[:, None] * (dy * wt[None, :] - xhat * c[:, None])
                    tl.store(
                        DX + rows[:, None] * stride_dx + col[None, :], dx.to(DX.dtype.element_ty), mask=mask
                    )
                if HAS_DW:
                    if CAST_LLAMA:
                        xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
                    # The first row step starts the partial sums (a where: see the LayerNorm kernel).
                    dw = tl.where(start > row_start, tl.load(dw_row + col, mask=col_mask, other=0.0), 0.0)
                    tl.store(dw_row + col, dw + tl.sum(dy * xhat, axis=0), mask=col_mask)
                col0 += BLOCK_N
            if HAS_DW:
                # The next step's loads of dw_row may come from other threads than this step's stores.
                tl.debug_barrier()
            start += BLOCK_M
    else:
        col_mask = cols < n_cols
        wt = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if STAGES > 0:
            # tl.range prefetches the next steps' rows while this one computes; the interpreter cannot run it
            # (its scalar arguments are not indices).
            for step in tl.range(0, rows_per_program // BLOCK_M, num_stages=STAGES):
                rows = row_start + step * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
                dw_acc += _rms_norm_bwd_rows(
                    DY,
                    X,
                    RSTD,
                    DX,
                    wt,
                    rows,
                    rows < row_end,
                    cols,
                    col_mask,
                    stride_dy,
                    stride_x,
                    stride_dx,
                    n_cols,
                    CAST_LLAMA,
                    HAS_DX,
                    HAS_DW,
                )
        else:
            start = row_start
            while start < row_end:
                rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
                start += BLOCK_M
                dw_acc += _rms_norm_bwd_rows(
                    DY,
                    X,
                    RSTD,
                    DX,
                    wt,
                    rows,
                    rows < row_end,
                    cols,
                    col_mask,
                    stride_dy,
                    stride_x,
                    stride_dx,
                    n_cols,
                    CAST_LLAMA,
                    HAS_DX,
                    HAS_DW,
                )
        if HAS_DW:
            tl.store(dw_row + cols, dw_acc, mask=col_mask)


def _rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, opts: RMSNormOptions):
    assert x.ndim == 2 and weight.ndim == 1 and x.shape[1] == weight.shape[0], (x.shape, weight.shape)
    assert opts.casting in CASTING_MODES, opts.casting
    x = lastdim_contiguous(x)
    n_rows, n_cols = x.shape
    cast_llama = opts.casting == "llama"
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if cast_llama else x.dtype
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    plan = norm_fwd_plan(n_rows, n_cols, _utils.rms_launch_options(_utils.NORM_LAUNCH.get(x.device)))
    _rms_norm_fwd_kernel[(plan.n_programs,)](
        x,
        y,
        weight,
        rstd,
        x.stride(0),
        y.stride(0),
        n_rows,
        n_cols,
        opts.eps,
        opts.offset,
        CAST_LLAMA=cast_llama,
        LOOPED=plan.looped,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        num_warps=plan.num_warps,
    )
    return y, x, rstd


def _rms_norm_bwd(dy, x, weight, rstd, opts: RMSNormOptions, needs_dx: bool, needs_dw: bool):
    n_rows, n_cols = x.shape
    dy = lastdim_contiguous(dy)
    dx = norm_dx_buffer(dy, x, needs_dx, opts.in_place)
    plan = norm_bwd_plan(
        n_rows, n_cols, x.device, _utils.rms_launch_options(_utils.NORM_LAUNCH.get(x.device))
    )
    dw_partial = None
    if needs_dw:
        dw_partial = torch.empty((plan.n_programs, n_cols), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(plan.n_programs,)](
        dy,
        x,
        weight,
        rstd,
        dx,
        dw_partial,
        dy.stride(0),
        x.stride(0),
        dx.stride(0) if needs_dx else 0,
        n_rows,
        n_cols,
        plan.rows_per_program,
        opts.offset,
        CAST_LLAMA=opts.casting == "llama",
        HAS_DX=needs_dx,
        HAS_DW=needs_dw,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        num_warps=plan.num_warps,
        **plan.switches,
    )
    # One reduction kernel, and one cast unless the weight is fp32.
    dw = dw_partial.sum(0).to(weight.dtype) if needs_dw else None
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, opts: RMSNormOptions):
        y, x, rstd = _rms_norm_fwd(x, weight, opts)
        ctx.save_for_backward(x, weight, rstd)
        ctx.opts = opts
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        if not any(ctx.needs_input_grad[:2]):
            return None, None, None
        dx, dw = _rms_norm_bwd(dy, x, weight, rstd, ctx.opts, *ctx.needs_input_grad[:2])
        return dx, dw, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
    in_place: bool = False,
) -> torch.Tensor:
    """Triton RMSNorm; equals :func:`rms_norm_ref` (``LlamaRMSNorm`` / ``GemmaRMSNorm``).

    Args:
        x: (..., D) input, any float dtype; rows may be strided, a non-unit last stride is copied.
        weight: (D,) scale.
        eps: added to the mean square. Default 1e-6.
        offset: added to ``weight`` inside the kernel (1.0 for Gemma). Default 0.
        casting: "llama" or "gemma", see the module docstring.
        in_place: let the backward write dx over the incoming gradient. Only safe when that gradient tensor
            feeds no other node, e.g. a norm whose output goes only into linear layers; wrong otherwise
            (a norm output added to a residual shares its gradient with the residual branch).

    Returns:
        (..., D), dtype as :func:`rms_norm_ref`.
    """
    if torch.compiler.is_compiling():
        # Traced as the reference: Inductor fuses it, and the residual add before it, into one kernel per
        # direction, where a launch of this kernel would break the graph at its launch plan.
        return rms_norm_ref(x, weight, eps, offset, casting)
    opts = _options(eps, offset, casting, in_place)
    if x.ndim == 2:  # no reshape/view pair: each would add an autograd node
        return RMSNormFunction.apply(x, weight, opts)
    shape = x.shape
    return RMSNormFunction.apply(x.reshape(-1, shape[-1]), weight, opts).view(shape)


class RMSNorm(nn.Module):
    """Drop-in ``LlamaRMSNorm`` (defaults) or ``GemmaRMSNorm`` (``offset=1.0, casting="gemma"``, zero init).

    Args:
        hidden_size: D.
        eps: added to the mean square.
        offset: added to the weight (Gemma stores ``w`` and scales by ``1 + w``).
        casting: "llama" or "gemma".
        in_place: see :func:`rms_norm`.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting: str = "llama",
        in_place: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        init = torch.zeros if offset == 1.0 else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps, self.offset, self.casting, self.in_place = eps, offset, casting, in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, self.casting, self.in_place)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}, casting={self.casting}"
