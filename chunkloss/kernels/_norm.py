"""Triton pieces shared by the RMSNorm and LayerNorm kernels."""

import triton
import triton.language as tl


@triton.jit
def column_block(DY_ROWS, X_ROWS, row_mask, col0, cols, n_cols):
    """One step of the looped backwards' column loop: the columns ``col0 + cols`` of BLOCK_M rows.

    Args:
        DY_ROWS, X_ROWS: (BLOCK_M, 1) pointers to the rows of dy and of x.
        row_mask: (BLOCK_M,) the rows that exist.
        col0: the block's first column; cols: ``tl.arange(0, BLOCK_N)``; n_cols: D.

    Returns:
        ``col`` (BLOCK_N,), ``col_mask`` (BLOCK_N,), ``mask`` (BLOCK_M, BLOCK_N), and the block of dy and of x
        in fp32 (0 where masked).
    """
    col = col0 + cols
    col_mask = col < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    dy = tl.load(DY_ROWS + col[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X_ROWS + col[None, :], mask=mask, other=0.0).to(tl.float32)
    return col, col_mask, mask, dy, x
