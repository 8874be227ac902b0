"""Triton pieces shared by the LayerNorm and RMSNorm kernels."""

import triton
import triton.language as tl


@triton.jit
def load_col_block(DY_ROWS, X_ROWS, col0, cols, row_mask, n_cols):
    """Columns ``col0 + cols`` of BLOCK_M rows of dy and x, in fp32 (0 outside the rows and D), with the
    block's column indices, column mask and (BLOCK_M, BLOCK_N) mask. ``DY_ROWS``, ``X_ROWS``: (BLOCK_M, 1)
    pointers to the rows' starts."""
    col = col0 + cols
    col_mask = col < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    dy = tl.load(DY_ROWS + col[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X_ROWS + col[None, :], mask=mask, other=0.0).to(tl.float32)
    return col, col_mask, mask, dy, x
