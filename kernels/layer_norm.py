"""LayerNorm: ``y = (x - mean(x)) / sqrt(var(x) + eps) * w + b``, forward and backward in Triton.

Equals ``torch.nn.functional.layer_norm(x, (D,), w, b, eps)`` (statistics and affine in fp32, one cast to
``x.dtype``). The forward stores the mean and reciprocal standard deviation of each row; the backward
recomputes the normalised row from ``x``.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from ._utils import lastdim_contiguous, norm_bwd_grid, norm_dx_buffer, row_block, row_warps, rows_per_tile


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


# Forward, per row:  mean = sum(x) / D,  rstd = 1 / sqrt(sum((x - mean)^2) / D + eps),
#   xhat = (x - mean) * rstd,  y = xhat * w + b.
@triton.jit
def _layer_norm_fwd_kernel(
    X,  # (N, D) input, rows stride_x apart
    Y,  # (N, D) output, contiguous
    W,  # (D,) weight
    B,  # (D,) bias (unused when HAS_BIAS is False)
    MEAN,  # (N,) fp32, saved for the backward
    RSTD,  # (N,) fp32, saved for the backward
    stride_x,
    stride_y,
    n_rows,
    n_cols,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program (>1 only for short rows)
    BLOCK_N: tl.constexpr,  # power of two >= D
):
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
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


# Backward, per row, with wdy = w * dy:
#   dx = rstd * (wdy - xhat * sum(wdy * xhat) / D - sum(wdy) / D)
#   dw = sum over rows of dy * xhat,  db = sum over rows of dy; each program sums its contiguous block of
#   rows into one fp32 row of DW_PARTIAL / DB_PARTIAL, the launcher adds the partials.
@triton.jit
def _layer_norm_bwd_kernel(
    DY,  # (N, D) upstream gradient, rows stride_dy apart
    X,  # (N, D) forward input, rows stride_x apart
    W,  # (D,) weight
    MEAN,  # (N,) fp32 from the forward
    RSTD,  # (N,) fp32 from the forward
    DX,  # (N, D) input gradient (may alias DY), rows stride_dx apart
    DW_PARTIAL,  # (n_programs, D) fp32 per-program sums of dy * xhat
    DB_PARTIAL,  # (n_programs, D) fp32 per-program sums of dy
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    rows_per_program,  # a multiple of BLOCK_M
    HAS_DX: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # A while loop rather than range(): the Triton interpreter cannot index range() by a tensor bound.
    start = row_start
    while start < row_end:
        rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
        start += BLOCK_M
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :]
        c1 = tl.sum(wdy * xhat, axis=1) / n_cols
        c2 = tl.sum(wdy, axis=1) / n_cols
        dx = rstd[:, None] * (wdy - xhat * c1[:, None] - c2[:, None])
        if HAS_DX:
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DW:
            dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_DB:
            db_acc += tl.sum(dy, axis=0)
    if HAS_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)
    if HAS_DB:
        tl.store(DB_PARTIAL + pid.to(tl.int64) * n_cols + cols, db_acc, mask=col_mask)


def _layer_norm_fwd(x, weight, bias, opts: LayerNormOptions):
    assert x.ndim == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    assert bias is None or bias.shape == weight.shape, bias.shape
    x = lastdim_contiguous(x)
    n_rows, n_cols = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_n = row_block(n_cols)
    block_m = rows_per_tile(block_n)
    _layer_norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
        x,
        y,
        weight,
        bias,
        mean,
        rstd,
        x.stride(0),
        y.stride(0),
        n_rows,
        n_cols,
        opts.eps,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=row_warps(block_m * block_n),
    )
    return y, x, mean, rstd


def _layer_norm_bwd(
    dy, x, weight, mean, rstd, opts: LayerNormOptions, needs_dx: bool, needs_dw: bool, needs_db: bool
):
    n_rows, n_cols = x.shape
    dy = lastdim_contiguous(dy)
    dx = norm_dx_buffer(dy, x, needs_dx, opts.in_place)
    block_n, block_m, n_programs, rows_per_program = norm_bwd_grid(n_rows, n_cols, x.device)

    def partial(needed):
        return torch.empty((n_programs, n_cols), dtype=torch.float32, device=x.device) if needed else None

    dw_partial, db_partial = partial(needs_dw), partial(needs_db)
    _layer_norm_bwd_kernel[(n_programs,)](
        dy,
        x,
        weight,
        mean,
        rstd,
        dx,
        dw_partial,
        db_partial,
        dy.stride(0),
        x.stride(0),
        dx.stride(0) if needs_dx else 0,
        n_rows,
        n_cols,
        rows_per_program,
        HAS_DX=needs_dx,
        HAS_DW=needs_dw,
        HAS_DB=needs_db,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=row_warps(block_m * block_n),
    )
    dw = dw_partial.sum(0).to(weight.dtype) if needs_dw else None
    db = db_partial.sum(0).to(weight.dtype) if needs_db else None
    return dx, dw, db


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, opts: LayerNormOptions):
        y, x, mean, rstd = _layer_norm_fwd(x, weight, bias, opts)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.opts = opts
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        if not any(ctx.needs_input_grad[:3]):
            return None, None, None, None
        dx, dw, db = _layer_norm_bwd(dy, x, weight, mean, rstd, ctx.opts, *ctx.needs_input_grad[:3])
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
    shape = x.shape
    y = LayerNormFunction.apply(x.reshape(-1, shape[-1]), weight, bias, LayerNormOptions(eps, in_place))
    return y.view(shape)


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
