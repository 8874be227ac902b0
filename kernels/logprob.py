"""Label log-probabilities of a no-grad head's logits, in one read of the logits.

A reference model's (or a teacher's) head only enters a preference or GRPO loss through
``log softmax(scale(z))[label]`` per row. Under ``torch.compile`` that reduction is one more compiled
graph per loss and reads the ``[C, V]`` logits two or three times (max, then sum-exp with the label
pick); here each row is read once with an online max and sum-exp, and nothing of size ``[C, V]`` is
allocated. ``scale`` is the model-side transform of ``chunkloss.losses.common.scale_logits``:
``· logit_scale``, then ``softcap·tanh(z / softcap)``, then ``/ temperature``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from chunkloss.losses.common import scaled_label_logprob

from ._utils import next_power_of_2

__all__ = ["label_logprob_ref", "label_logprob_triton"]

# Columns per step of a row's online reduction and warps per row, swept on an H100 at 4096 x 128256 bf16
# (benchmarks/results/dev/s6/sweep_logprob.log): 8192 x 8 warps 0.364 ms (2.89 TB/s); 2048-16384 columns with
# 4-8 warps all within 0.37-0.43 ms, 16 warps slower at small blocks.
BLOCK_V = 8192
NUM_WARPS = 8


# The fp32 reference of the kernel: the formula the losses use off CUDA.
label_logprob_ref = scaled_label_logprob


@triton.jit
def _scaled(x, LOGIT_SCALE: tl.constexpr, SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr):
    z = x.to(tl.float32) * LOGIT_SCALE
    if SOFTCAP > 0:
        # c·tanh(z/c) with tanh(u) = 2·sigmoid(2u) - 1 (the interpreter has no libdevice tanh).
        z = SOFTCAP * (2.0 * tl.sigmoid(2.0 * z / SOFTCAP) - 1.0)
    return z / TEMPERATURE


@triton.jit
def _label_logprob_kernel(
    Z,  # (C, V) logits, rows contiguous
    Y,  # (C,) labels
    OUT,  # (C,) fp32
    V,
    stride_row,
    LOGIT_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,  # 0 for none
    TEMPERATURE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_row
    cols = tl.arange(0, BLOCK)
    # Running max and sum of exp(z - m) of the row, moved once per block (per-lane running values cost a
    # second exp and more ALU work per element: 0.72 ms for a 4096 x 128256 bf16 chunk on an H100, 1.45 TB/s).
    m = -float("inf")
    s = 0.0
    start = 0
    while start < V:  # a while loop: the interpreter cannot take range() over a runtime int
        mask = start + cols < V
        z = _scaled(tl.load(base + start + cols, mask=mask, other=0.0), LOGIT_SCALE, SOFTCAP, TEMPERATURE)
        z = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, 0))  # finite: every block holds a column < V
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
        start += BLOCK
    y = tl.load(Y + row).to(tl.int64)
    z_y = _scaled(tl.load(base + y), LOGIT_SCALE, SOFTCAP, TEMPERATURE)
    tl.store(OUT + row, z_y - (m + tl.log(s)))


def label_logprob_triton(
    logits: Tensor,
    labels: Tensor,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """``log_softmax(scale(logits))[i, labels[i]]`` (C,) in fp32, without grad, for CUDA tensors (or CPU ones
    under ``TRITON_INTERPRET=1``); ``chunkloss.losses.common.nograd_label_logprob`` calls it on CUDA.

    Labels must be in ``[0, V)``: the losses have checked them, and no check here may sync.
    """
    _check(logits, labels)
    c, v = logits.shape
    out = torch.empty(c, dtype=torch.float32, device=logits.device)
    if c == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    _label_logprob_kernel[(c,)](
        logits,
        labels,
        out,
        v,
        logits.stride(0),
        LOGIT_SCALE=float(logit_scale),
        SOFTCAP=float(softcap or 0.0),
        TEMPERATURE=float(temperature),
        BLOCK=min(BLOCK_V, next_power_of_2(v)),
        num_warps=NUM_WARPS,
    )
    return out


def _check(logits: Tensor, labels: Tensor) -> None:
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be (C, V) and labels (C,), got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
