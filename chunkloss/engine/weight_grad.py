"""The weight gradient over the chunks: accumulated (fp32 by default) and handed out in the weight's dtype.

Why the accumulator is fp32, when one chunk needs none, and when the last contribution is fused with the
final cast: docs/design.md, "The weight-gradient accumulator".
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["WeightGrad", "accumulate_weight_grad"]


def accumulate_weight_grad(acc: Tensor, g: Tensor, x: Tensor, beta: float = 1.0) -> None:
    """``acc = beta·acc + g.T @ x`` in place, without a [V, H] temporary (beta=0 for the first chunk
    saves zero-filling the accumulator)."""
    if acc.dtype == g.dtype:
        acc.addmm_(g.t(), x, beta=beta)
    elif acc.is_cuda:
        # cuBLAS: bf16/fp16 operands, fp32 output and accumulation.
        torch.addmm(acc, g.t(), x, beta=beta, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(g.t().to(acc.dtype), x.to(acc.dtype), beta=beta)


class WeightGrad:
    """The weight's gradient over the chunks: accumulated in ``accum`` and handed out in the weight's dtype.

    The contribution the loop marks as the last (``add(..., last=True)``) and a scale still pending from
    ``scale`` (the deferred rows' λ of two passes) go into that final tensor without another pass over an
    fp32 accumulator where it is cheaper:

    * a last contribution with nothing before it (one chunk) is one GEMM that writes the weight's dtype; no
      accumulator is allocated. cuBLAS accumulates in fp32 inside the GEMM and rounds once, which is what
      casting an fp32 accumulator would give;
    * on CUDA, with an fp32 accumulator of a bf16/fp16 weight, a last contribution of at most
      ``chunkloss.kernels.weight_grad.MAX_ROWS`` rows, or the pending scale alone, runs
      ``finish_weight_grad``: one pass that reads the accumulator, scales it, adds ``g.T @ x`` and writes the
      weight's dtype (cuBLAS's addmm would read and write the accumulator, and the cast read it again).

    Otherwise the chunk's GEMM accumulates in place (:func:`accumulate_weight_grad`) and ``finish`` casts.
    """

    #: Tests run the fused kernel on CPU tensors through the Triton interpreter.
    fuse_off_cuda = False

    def __init__(self, weight: Tensor, accum: torch.dtype):
        self.weight, self.accum = weight, accum
        self.acc: Tensor | None = None  # allocated at the first contribution that is not the last
        self.s: Tensor | None = None  # pending scale of ``acc``
        self.out: Tensor | None = None  # the finished gradient

    def _fusable(self) -> bool:
        return (
            (self.weight.is_cuda or self.fuse_off_cuda)
            and self.accum == torch.float32
            and self.weight.dtype in (torch.bfloat16, torch.float16)
        )

    def add(self, g: Tensor, x: Tensor, last: bool = False) -> None:
        """``grad_W += g.T @ x``; ``last``: no contribution or scale follows."""
        assert self.out is None, "a weight-gradient contribution after the one marked last"
        if last and self.acc is None:
            if g.dtype == self.weight.dtype and (g.is_cuda or g.dtype == self.accum):
                self.out = g.t() @ x
            else:  # CPU: the accumulator's arithmetic, then one rounding
                self.out = (g.t().to(self.accum) @ x.to(self.accum)).to(self.weight.dtype)
            return
        if last and self._fusable() and g.shape[0] <= _kernels().MAX_ROWS and _unit_rows(g, x):
            self.out = _kernels().finish_weight_grad(self.acc, g, x, self.s, self.weight.dtype)
            self.acc = self.s = None
            return
        if self.acc is None:
            self.acc = torch.empty(self.weight.shape, dtype=self.accum, device=self.weight.device)
            accumulate_weight_grad(self.acc, g, x, beta=0.0)
            return
        if self.s is not None:
            self.acc.mul_(self.s)
            self.s = None
        accumulate_weight_grad(self.acc, g, x)

    def scale(self, lam: Tensor) -> None:
        """Multiply the gradient so far by the one-element tensor ``lam`` (before any later ``add``)."""
        if self.acc is not None:
            self.s = lam if self.s is None else self.s * lam

    def finish(self) -> Tensor:
        """The gradient in the weight's dtype (zeros when no rows took part)."""
        if self.out is not None:
            return self.out
        if self.acc is None:
            return torch.zeros_like(self.weight)
        if self.s is not None:
            if self._fusable():
                return _kernels().finish_weight_grad(self.acc, None, None, self.s, self.weight.dtype)
            self.acc.mul_(self.s)
        return self.acc.to(self.weight.dtype)


def _unit_rows(*ts: Tensor) -> bool:
    """Whether each 2-D tensor's rows are contiguous (unit column stride), as the Triton kernels read them."""
    return all(t.stride(1) == 1 or t.shape[1] <= 1 for t in ts)


def _kernels():
    """``chunkloss.kernels.weight_grad``, imported when first used (Triton is imported only where it runs)."""
    from chunkloss.kernels import weight_grad

    return weight_grad
