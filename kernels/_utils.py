"""Launch heuristics shared by the row kernels."""

import functools

import torch
import triton


def row_block(n_cols: int) -> int:
    """Smallest power of two holding a whole row (rows are normalised in registers, in one pass)."""
    return triton.next_power_of_2(n_cols)


def row_warps(block: int) -> int:
    """More warps for wider rows so each thread keeps roughly 16-32 elements in registers."""
    if block >= 16384:
        return 16
    if block >= 4096:
        return 8
    if block >= 1024:
        return 4
    return 2 if block >= 256 else 1


def rows_per_tile(block_n: int, max_elems: int = 4096) -> int:
    """Several short rows per program so a program still moves a few KB (e.g. Qwen3's per-head norms)."""
    return max(1, min(64, max_elems // block_n))


# Backward programs per SM (the row loop of each is serial). Swept on an H100 at 16384 rows
# (benchmarks/tune_norms.py): 8 was fastest up to width 4096, 2 from 8192 on, where each program's
# row already keeps enough bytes in flight and fewer partial dW rows are summed.
def bwd_programs_per_sm(block_n: int) -> int:
    """Norm backward programs per SM for rows of ``block_n`` columns."""
    return 8 if block_n <= 4096 else 2


@functools.lru_cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on `device` (a small stand-in on CPU / the Triton interpreter)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def lastdim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels index rows through a stride but assume unit stride inside a row."""
    return x if x.stride(-1) == 1 else x.contiguous()


def norm_bwd_grid(n_rows: int, n_cols: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_M, programs, rows per program) of the norms' persistent backward: each program
    takes a contiguous block of rows (a multiple of BLOCK_M) and writes one row of partial dW sums."""
    block_n = row_block(n_cols)
    block_m = rows_per_tile(block_n)
    n_programs = max(1, min(num_sms(device) * bwd_programs_per_sm(block_n), triton.cdiv(n_rows, block_m)))
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, n_programs), block_m) * block_m
    return block_n, block_m, triton.cdiv(n_rows, rows_per_program), rows_per_program


def norm_dx_buffer(dy: torch.Tensor, x: torch.Tensor, needs_dx: bool, in_place: bool) -> torch.Tensor | None:
    """Where the norms' backward writes dx. It may overwrite dy only if the caller promised dy is not
    shared (``in_place``) and the dtypes and layout let the rows line up."""
    if not needs_dx:
        return None
    if in_place and dy.dtype == x.dtype and dy.is_contiguous():
        return dy
    return torch.empty_like(x)
