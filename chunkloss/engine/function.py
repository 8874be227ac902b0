"""The autograd Function around the chunk loop: the gradients are computed in forward, and backward only
scales them by ``grad_output``; a per-row output (reduction='none') reruns the loop in backward instead."""

from __future__ import annotations

import torch
from torch import Tensor

from chunkloss.engine.batch import Batch
from chunkloss.engine.contract import LossContract
from chunkloss.engine.loop import ChunkLoop

__all__ = ["FusedLinearFunction"]


class FusedLinearFunction(torch.autograd.Function):
    """``(hidden, weight, bias, loss, batch, metrics_out) -> loss`` (0-d) or the per-row output (N,)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, loss_mod: LossContract, batch: Batch, metrics_out: dict):
        grad_enabled = torch.is_grad_enabled() or any(ctx.needs_input_grad[:3])
        need = (
            grad_enabled and ctx.needs_input_grad[0],
            grad_enabled and ctx.needs_input_grad[1],
            grad_enabled and bias is not None and ctx.needs_input_grad[2],
        )
        per_row = ctx.per_row = bool(loss_mod.token_outputs)
        if per_row:
            # The stored-gradient trick needs a scalar output: forward only evaluates, and backward reruns
            # the loop for the gradient of Σ_i grad_output_i·out_i.
            out, _, metric_sums = ChunkLoop(loss_mod, hidden, weight, bias, batch, (False,) * 3).run()
            ctx.loss_mod, ctx.batch, ctx.need = loss_mod, batch, need
            ctx.save_for_backward(hidden, weight, bias)
        else:
            out, grads, metric_sums = ChunkLoop(loss_mod, hidden, weight, bias, batch, need).run()
            ctx.save_for_backward(*grads)
        metrics_out.update(metric_sums)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.per_row:
            hidden, weight, bias = ctx.saved_tensors
            row_weight = grad_output.reshape(-1)[ctx.batch.rows]
            _, grads, _ = ChunkLoop(ctx.loss_mod, hidden, weight, bias, ctx.batch, ctx.need, row_weight).run()
            return (*grads, None, None, None)
        if getattr(ctx, "consumed", False):
            raise RuntimeError(
                "chunkloss computes the gradients in forward and scales them in place in backward; "
                "backward through the same loss twice (retain_graph=True) is not supported"
            )
        ctx.consumed = True
        grad_h, grad_w, grad_b = ctx.saved_tensors if ctx.saved_tensors else (None, None, None)
        # In place: the stored gradients belong to this call alone, and a copy would double their memory.
        return (
            scale_grad(grad_h, grad_output),
            scale_grad(grad_w, grad_output),
            scale_grad(grad_b, grad_output),
            None,
            None,
            None,
        )


def scale_grad(grad: Tensor | None, grad_output: Tensor) -> Tensor | None:
    """``grad · grad_output`` in place, bit for bit ``grad.mul_(grad_output.to(grad.dtype))``. With
    weight-dtype gradients of an fp32 accumulator this rounds twice when ``grad_output`` is not a power of two
    (≤ 1 ulp of the weight's dtype more); at 1 it is exact.

    ``grad_output`` is almost always exactly 1 (``loss.backward()``), yet ``mul_`` would read and write the
    whole gradient. On CUDA ``chunkloss.kernels.scale`` reads ``grad_output`` on the device and its programs
    return at once when it is 1, with no host sync; NaN or inf still multiply. Elsewhere this is ``mul_``
    (Triton is imported only on CUDA)."""
    if grad is None:
        return None
    if grad.is_cuda:
        from chunkloss.kernels.scale import scale_

        return scale_(grad, grad_output)
    return grad.mul_(grad_output.to(grad.dtype))
