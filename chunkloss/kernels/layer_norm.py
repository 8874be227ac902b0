"""LayerNorm: ``y = (x - mean(x)) / sqrt(var(x) + eps) * w + b``, forward and backward in Triton.

Equals ``torch.nn.functional.layer_norm(x, (D,), w, b, eps)`` (statistics and affine in fp32, one cast to
``x.dtype``). The forward stores the mean and reciprocal standard deviation of each row; the backward
recomputes the normalised row from ``x``.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from . import _utils
from ._norm import column_block
from ._utils import lastdim_contiguous, norm_bwd_plan, norm_dx_buffer, norm_fwd_plan


def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """Pure-PyTorch LayerNorm over the last dimension (``nn.LayerNorm``'s computation).

    Args:
        x: (..., D) input.
        weight: (D,) scale.
        bias: (D,) shift or None.
        eps: added to the variance.

    Returns:
        (..., D) in ``x.dtype``.
    """
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@dataclass(frozen=True)
class LayerNormOptions:
    eps: float = 1e-5
    in_place: bool = False  # backward writes dx over dy: only when dy feeds no other node


_options = functools.lru_cache(maxsize=64)(LayerNormOptions)  # one instance per option set, not one per call


# Forward, per row:  mean = sum(x) / D,  rstd = 1 / sqrt(sum((x - mean)^2) / D + eps),
#   xhat = (x - mean) * rstd,  y = xhat * w + b.
# Fused (rows of one register tile): BLOCK_M rows per program. Looped (LOOPED, rows wider than one register
# tile, ``NormLaunchOptions.max_fused_cols``): one row per program. Pass 1 reads the row in column blocks of
# BLOCK_N and merges each block's exact statistics into the running ones (Chan et al.'s parallel variance; no
# E[x^2] - mean^2 cancellation when |mean| >> std): a block of n_b columns with mean m_b and
# M2_b = sum((x - m_b)^2), after n_a columns with mean m and M2, gives
#   delta = m_b - m,  m += delta * n_b / (n_a + n_b),  M2 += M2_b + delta^2 * n_a * n_b / (n_a + n_b).
# Then rstd = 1 / sqrt(M2 / D + eps); pass 2 writes y block by block, re-reading x from L2.
@triton.jit
def _layer_norm_fwd_kernel(
    X,  # (N, D) input, rows stride_x apart
    Y,  # (N, D) output, contiguous
    W,  # (D,) weight
    B,  # (D,) bias (unused when HAS_BIAS is False)
    STATS,  # (N, 2) fp32 mean and rstd of each row, saved for the backward
    stride_x,
    stride_y,
    n_rows,
    n_cols,
    eps,
    HAS_BIAS: tl.constexpr,
    LOOPED: tl.constexpr,  # rows wider than one register tile: the looped forward
    BLOCK_M: tl.constexpr,  # rows per program (fused; >1 only for short rows)
    BLOCK_N: tl.constexpr,  # power of two >= D (fused) or columns per step (looped)
):
    if LOOPED:
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        y_row = Y + row * stride_y
        cols = tl.arange(0, BLOCK_N)
        mean = 0.0
        m2 = 0.0
        start = 0
        while start < n_cols:
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            n_a = start * 1.0  # columns merged so far, as fp32
            n_b = tl.minimum(n_cols - start, BLOCK_N) * 1.0
            mean_b = tl.sum(x, axis=0) / n_b
            xc = tl.where(mask, x - mean_b, 0.0)
            delta = mean_b - mean
            mean += delta * (n_b / (n_a + n_b))
            m2 += tl.sum(xc * xc, axis=0) + delta * delta * (n_a * n_b / (n_a + n_b))
            start += BLOCK_N
        rstd = 1.0 / tl.sqrt(m2 / n_cols + eps)
        start = 0
        while start < n_cols:
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * rstd * tl.load(W + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(B + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, y.to(Y.dtype.element_ty), mask=mask)
            start += BLOCK_N
        tl.store(STATS + 2 * row, mean)
        tl.store(STATS + 2 * row + 1, rstd)
    else:
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
        y = xc * rstd[:, None] * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(STATS + 2 * rows, mean, mask=row_mask)
        tl.store(STATS + 2 * rows + 1, rstd, mask=row_mask)


@triton.jit
def _partial_rows(PARTIALS, pid, n_cols, HAS_DW: tl.constexpr):
    """This program's rows of the dW and dB partial sums (buffer 0 holds dW when it is needed, then dB)."""
    dw_row = PARTIALS + pid.to(tl.int64) * n_cols
    if HAS_DW:
        db_row = dw_row + tl.num_programs(0).to(tl.int64) * n_cols
    else:
        db_row = dw_row
    return dw_row, db_row


# Backward, per row, with wdy = w * dy:
#   dx = rstd * (wdy - xhat * sum(wdy * xhat) / D - sum(wdy) / D)
#   dw = sum over rows of dy * xhat,  db = sum over rows of dy; each program sums its contiguous block of
#   rows into one fp32 row of each partial buffer in PARTIALS, the launcher adds the partials.
@triton.jit
def _layer_norm_bwd_rows(
    DY,
    X,
    STATS,
    DX,
    w,
    rows,
    row_mask,
    cols,
    col_mask,
    stride_dy,
    stride_x,
    stride_dx,
    n_cols,
    HAS_DX: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
):
    """dx of BLOCK_M rows, and their column sums of dy * xhat and of dy (zeros when not needed)."""
    mask = row_mask[:, None] & col_mask[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(STATS + 2 * rows, mask=row_mask, other=0.0)
    rstd = tl.load(STATS + 2 * rows + 1, mask=row_mask, other=0.0)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    if HAS_DX:
        wdy = dy * w[None, :]
        c1 = tl.sum(wdy * xhat, axis=1) / n_cols
        c2 = tl.sum(wdy, axis=1) / n_cols
        dx = rstd[:, None] * (wdy - xhat * c1[:, None] - c2[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    dw = tl.zeros_like(w)
    db = tl.zeros_like(w)
    if HAS_DW:
        dw = tl.sum(dy * xhat, axis=0)
    if HAS_DB:
        db = tl.sum(dy, axis=0)
    return dw, db


# The backward: each program steps through its contiguous block of rows BLOCK_M at a time. Fused (rows of one
# register tile): ``_layer_norm_bwd_rows`` per step, the column sums kept in registers. Looped (LOOPED, rows
# wider than one register tile): the same math in two passes over column blocks of BLOCK_N per step:
#   pass 1 (only when dx is needed):  c1 = rstd * sum(wdy * (x - mean)) / D  ( = sum(wdy * xhat) / D ),
#     c2 = sum(wdy) / D, each accumulated in an fp32 (BLOCK_M, BLOCK_N) tile and reduced once;
#   pass 2:  dx = rstd * (wdy - xhat * c1 - c2), written block by block, and sum(dy * xhat), sum(dy) over the
#     BLOCK_M rows added into the program's own rows of the partial buffers (in memory: whole fp32 rows
#     do not fit in registers; the first step stores instead of adding).
# Pass 2 re-reads dy and x, which pass 1 has just brought into L2.
@triton.jit
def _layer_norm_bwd_kernel(
    DY,  # (N, D) upstream gradient, rows stride_dy apart
    X,  # (N, D) forward input, rows stride_x apart
    W,  # (D,) weight
    STATS,  # (N, 2) fp32 mean and rstd from the forward
    DX,  # (N, D) input gradient (may alias DY), rows stride_dx apart
    PARTIALS,  # (HAS_DW + HAS_DB, n_programs, D) fp32 per-program sums of dy * xhat (if HAS_DW), then of dy
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    rows_per_program,  # a multiple of BLOCK_M
    HAS_DX: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    LOOPED: tl.constexpr,  # rows wider than one register tile: the looped backward
    BLOCK_M: tl.constexpr,  # rows per step
    BLOCK_N: tl.constexpr,  # the whole row (fused) or columns per step (looped)
    STAGES: tl.constexpr,  # fused, > 0: software-pipelined row loop (GPU); 0: a while loop (the interpreter)
):
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    if HAS_DW or HAS_DB:
        dw_row, db_row = _partial_rows(PARTIALS, pid, n_cols, HAS_DW)
    if LOOPED:
        start = row_start
        while start < row_end:
            rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
            row_mask = rows < row_end
            mean = tl.load(STATS + 2 * rows, mask=row_mask, other=0.0)
            rstd = tl.load(STATS + 2 * rows + 1, mask=row_mask, other=0.0)
            dy_rows = DY + rows[:, None] * stride_dy
            x_rows = X + rows[:, None] * stride_x
            if HAS_DX:
                acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                col0 = 0
                while col0 < n_cols:
                    col, col_mask, mask, dy, x = column_block(dy_rows, x_rows, row_mask, col0, cols, n_cols)
                    wdy = dy * tl.load(W + col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                    acc1 += wdy * (x - mean[:, None])
                    acc2 += wdy
                    col0 += BLOCK_N
                c1 = tl.sum(acc1, axis=1) * rstd / n_cols
                c2 = tl.sum(acc2, axis=1) / n_cols
            col0 = 0
            while col0 < n_cols:
                col, col_mask, mask, dy, x = column_block(dy_rows, x_rows, row_mask, col0, cols, n_cols)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
                if HAS_DX:
                    wdy = dy * tl.load(W + col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                    dx = rstd[:, None] * (wdy - xhat * c1[:, None] - c2[:, None])
                    tl.store(
                        DX + rows[:, None] * stride_dx + col[None, :], dx.to(DX.dtype.element_ty), mask=mask
                    )
                # The first row step starts the partial sums: what the buffer held is read and dropped (a
                # where, not a load mask: Triton 3.9's interpreter refuses a mask built from a scalar
                # comparison).
                not_first = start > row_start
                if HAS_DW:
                    dw = tl.where(not_first, tl.load(dw_row + col, mask=col_mask, other=0.0), 0.0)
                    tl.store(dw_row + col, dw + tl.sum(dy * xhat, axis=0), mask=col_mask)
                if HAS_DB:
                    db = tl.where(not_first, tl.load(db_row + col, mask=col_mask, other=0.0), 0.0)
                    tl.store(db_row + col, db + tl.sum(dy, axis=0), mask=col_mask)
                col0 += BLOCK_N
            if HAS_DW or HAS_DB:
                # The next step's loads of the partial rows may come from other threads than this step's
                # stores.
                tl.debug_barrier()
            start += BLOCK_M
    else:
        col_mask = cols < n_cols
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if STAGES > 0:
            # tl.range prefetches the next steps' rows while this one computes; the interpreter cannot run it
            # (its scalar arguments are not indices).
            for step in tl.range(0, rows_per_program // BLOCK_M, num_stages=STAGES):
                rows = row_start + step * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
                dw, db = _layer_norm_bwd_rows(
                    DY,
                    X,
                    STATS,
                    DX,
                    w,
                    rows,
                    rows < row_end,
                    cols,
                    col_mask,
                    stride_dy,
                    stride_x,
                    stride_dx,
                    n_cols,
                    HAS_DX,
                    HAS_DW,
                    HAS_DB,
                )
                dw_acc += dw
                db_acc += db
        else:
            start = row_start
            while start < row_end:
                rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
                start += BLOCK_M
                dw, db = _layer_norm_bwd_rows(
                    DY,
                    X,
                    STATS,
                    DX,
                    w,
                    rows,
                    rows < row_end,
                    cols,
                    col_mask,
                    stride_dy,
                    stride_x,
                    stride_dx,
                    n_cols,
                    HAS_DX,
                    HAS_DW,
                    HAS_DB,
                )
                dw_acc += dw
                db_acc += db
        if HAS_DW:
            tl.store(dw_row + cols, dw_acc, mask=col_mask)
        if HAS_DB:
            tl.store(db_row + cols, db_acc, mask=col_mask)


def _layer_norm_fwd(x, weight, bias, opts: LayerNormOptions):
    assert x.ndim == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    assert bias is None or bias.shape == weight.shape, bias.shape
    x = lastdim_contiguous(x)
    n_rows, n_cols = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    stats = torch.empty((n_rows, 2), dtype=torch.float32, device=x.device)  # mean, rstd: one allocation
    plan = norm_fwd_plan(n_rows, n_cols, _utils.NORM_LAUNCH.get(x.device))
    _layer_norm_fwd_kernel[(plan.n_programs,)](
        x,
        y,
        weight,
        bias,
        stats,
        x.stride(0),
        y.stride(0),
        n_rows,
        n_cols,
        opts.eps,
        HAS_BIAS=bias is not None,
        LOOPED=plan.looped,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        num_warps=plan.num_warps,
    )
    return y, x, stats


def _layer_norm_bwd(
    dy, x, weight, stats, opts: LayerNormOptions, needs_dx: bool, needs_dw: bool, needs_db: bool
):
    n_rows, n_cols = x.shape
    dy = lastdim_contiguous(dy)
    dx = norm_dx_buffer(dy, x, needs_dx, opts.in_place)
    plan = norm_bwd_plan(n_rows, n_cols, x.device, _utils.NORM_LAUNCH.get(x.device))
    # dW and dB partials in one buffer, so one reduction and one cast serve both.
    n_partials = needs_dw + needs_db
    partials = None
    if n_partials:
        partials = torch.empty((n_partials, plan.n_programs, n_cols), dtype=torch.float32, device=x.device)
    _layer_norm_bwd_kernel[(plan.n_programs,)](
        dy,
        x,
        weight,
        stats,
        dx,
        partials,
        dy.stride(0),
        x.stride(0),
        dx.stride(0) if needs_dx else 0,
        n_rows,
        n_cols,
        plan.rows_per_program,
        HAS_DX=needs_dx,
        HAS_DW=needs_dw,
        HAS_DB=needs_db,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        num_warps=plan.num_warps,
        **plan.switches,
    )
    if not n_partials:
        return dx, None, None
    sums = partials.sum(1).to(weight.dtype)
    if n_partials == 2:
        dw, db = sums.unbind(0)
        return dx, dw, db
    return (dx, sums[0], None) if needs_dw else (dx, None, sums[0])


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, opts: LayerNormOptions):
        y, x, stats = _layer_norm_fwd(x, weight, bias, opts)
        ctx.save_for_backward(x, weight, stats)
        ctx.opts = opts
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        if not any(ctx.needs_input_grad[:3]):
            return None, None, None, None
        dx, dw, db = _layer_norm_bwd(dy, x, weight, stats, ctx.opts, *ctx.needs_input_grad[:3])
        return dx, dw, db, None


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    in_place: bool = False,
) -> torch.Tensor:
    """Triton LayerNorm over the last dimension; equals ``F.layer_norm(x, (D,), weight, bias, eps)``.

    Args:
        x: (..., D) input; rows may be strided, a non-unit last stride is copied.
        weight: (D,) scale.
        bias: (D,) shift or None.
        eps: added to the variance. Default 1e-5.
        in_place: let the backward write dx over the incoming gradient; only safe when that gradient tensor
            feeds no other node (see :func:`chunkloss.kernels.rms_norm`).

    Returns:
        (..., D) in ``x.dtype``.
    """
    if torch.compiler.is_compiling():  # traced as the reference, which Inductor fuses (see rms_norm)
        return layer_norm_ref(x, weight, bias, eps)
    opts = _options(eps, in_place)
    if x.ndim == 2:  # no reshape/view pair: each would add an autograd node
        return LayerNormFunction.apply(x, weight, bias, opts)
    shape = x.shape
    return LayerNormFunction.apply(x.reshape(-1, shape[-1]), weight, bias, opts).view(shape)


class LayerNorm(nn.Module):
    """Drop-in ``nn.LayerNorm(hidden_size, eps, bias=bias)`` over the last dimension.

    Args:
        hidden_size: D.
        eps: added to the variance.
        bias: learn a shift.
        in_place: see :func:`layer_norm`.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        in_place: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None
        self.eps, self.in_place = eps, in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.in_place)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, bias={self.bias is not None}"
