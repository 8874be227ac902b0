"""Peak CUDA memory of a training step beyond the gradients it returns (the GPU memory tests' one measure)."""

import torch


def beyond_grads(loss_fn, leaves) -> tuple[int, torch.Tensor]:
    """``(bytes, loss)``: the peak bytes allocated by ``loss_fn().backward()`` beyond what was allocated
    before it and the gradients it leaves on ``leaves``, after one compiling warm-up step; and that loss.
    The leaves' gradients are cleared before and after."""
    loss_fn().backward()
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = loss_fn()
    loss.backward()
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves)
    beyond = torch.cuda.max_memory_allocated() - before - grads
    for t in leaves:
        t.grad = None
    return beyond, loss.detach()
