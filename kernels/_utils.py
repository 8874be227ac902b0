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
