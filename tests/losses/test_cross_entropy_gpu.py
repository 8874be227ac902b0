"""Cross-entropy on CUDA at a realistic shape: ours vs the fp32 reference, compared with plain PyTorch's
own error in the same dtype."""

import pytest
import torch
import torch.nn.functional as F

from chunkloss import FusedLinearCrossEntropyLoss
from chunkloss.testing.reference import cross_entropy_ref
from tests.cuda_memory import beyond_grads
from tests.tolerances import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("accum_dtype", [torch.float32, None])
@pytest.mark.parametrize("compile", [True, False])
def test_cross_entropy_cuda(dtype, accum_dtype, compile):
    n, h, v = 4096, 1024, 32000
    hidden = (torch.randn(n, h, device="cuda") * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(dtype).requires_grad_()
    bias = (torch.randn(v, device="cuda") * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[::7] = -100
    leaves = (hidden, weight, bias)

    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref, _ = cross_entropy_ref(ref_leaves[0], ref_leaves[1], labels, ref_leaves[2])
    ref.backward()
    ref_grads = [t.grad for t in ref_leaves]

    pt = F.cross_entropy((hidden @ weight.t() + bias).float(), labels)
    pt_grads = torch.autograd.grad(pt, leaves)

    loss = FusedLinearCrossEntropyLoss(accum_dtype=accum_dtype, compile=compile, chunk_size=1000)(
        hidden, weight, labels, bias=bias
    )
    grads = torch.autograd.grad(loss, leaves)
    # bf16/fp16 loss within 1e-3 relative of the fp32 reference (the bound the README states).
    assert abs(loss.item() - ref.item()) / abs(ref.item()) < 1e-3
    for name, g, gp, gr in zip(("hidden", "weight", "bias"), grads, pt_grads, ref_grads):
        assert g.dtype == dtype
        # Within 2x plain PyTorch's own error in the same dtype (+ a floor for bias sums that
        # PyTorch happens to get nearly exact). bf16-accumulated weight grads get 4x: rounding
        # every chunk's sum to bf16 costs up to log2(#chunks) extra half-ulps.
        k = 2.0 if (accum_dtype is not None or name == "hidden") else 4.0
        assert rel_err(g, gr) <= k * rel_err(gp, gr) + 2e-3, (name, rel_err(g, gr), rel_err(gp, gr))


def test_cross_entropy_cuda_32k_rows_flat_memory():
    """Peak extra memory does not grow with N beyond the output gradient itself."""
    h, v = 1024, 32000
    weight = (torch.randn(v, h, device="cuda") * 0.02).bfloat16().requires_grad_()
    loss_fn = FusedLinearCrossEntropyLoss(chunk_size=1024)
    extra = []
    for n in (4096, 16384):
        hidden = torch.randn(n, h, device="cuda").bfloat16().requires_grad_()
        labels = torch.randint(0, v, (n,), device="cuda")
        extra.append(beyond_grads(lambda: loss_fn(hidden, weight, labels), (hidden, weight))[0])
    assert extra[1] <= extra[0] * 1.1 + 2**20, extra


@pytest.mark.parametrize("accum_dtype", [torch.float32, None])
def test_cross_entropy_cuda_one_logits_chunk_live(accum_dtype):
    """Beyond the gradients (and the fp32 accumulator), the step holds one [C, V] logits chunk at a time:
    the previous chunk is freed before the next is projected."""
    n, h, v, chunk = 8192, 1024, 128256, 1024
    hidden = torch.randn(n, h, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    loss_fn = FusedLinearCrossEntropyLoss(chunk_size=chunk, accum_dtype=accum_dtype)
    beyond = beyond_grads(lambda: loss_fn(hidden, weight, labels), (hidden, weight))[0]
    accumulator = weight.numel() * 4 if accum_dtype == torch.float32 else 0
    one_chunk = chunk * v * 2
    assert beyond <= accumulator + one_chunk * 1.1 + 32 * 2**20, (beyond, accumulator, one_chunk)


def test_cross_entropy_cuda_automatic_chunks_within_memory_budget():
    """Automatic chunks (4096 rows here with fp32 accumulation) stay within 0.5 GiB + 4·V·H bytes beyond the
    gradients at Llama-3-8B's head, and within 0.5 GiB with weight-dtype accumulation."""
    n, h, v = 8192, 4096, 128256
    hidden = torch.randn(n, h, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    for accum_dtype, allowed in ((torch.float32, 4 * v * h + 2**29), (None, 2**29)):
        loss_fn = FusedLinearCrossEntropyLoss(accum_dtype=accum_dtype)
        beyond = beyond_grads(lambda: loss_fn(hidden, weight, labels), (hidden, weight))[0]
        assert beyond <= allowed, (accum_dtype, beyond / 2**30)


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inf_in_hidden_is_nan_as_in_torch_cuda(reduction, compile):
    """The Triton step (compile=True) and the eager one give torch's NaN for a row whose logits hold ±inf."""
    v, h = 257, 64
    weight = torch.rand(v, h, device="cuda") + 0.1
    weight[1, 0] = -1.0  # the first row's label logit is -inf, the others +inf
    hidden = torch.randn(3, h, device="cuda")
    hidden[0, 0] = float("inf")
    labels = torch.tensor([1, 0, 2], device="cuda")
    expect = F.cross_entropy(hidden @ weight.T, labels, reduction=reduction)
    loss = FusedLinearCrossEntropyLoss(compile=compile, reduction=reduction)(hidden, weight, labels)
    torch.testing.assert_close(loss, expect, equal_nan=True)
