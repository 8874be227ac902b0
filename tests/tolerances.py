"""The one tolerance rule of the test suite, and its table.

Every result of chunkloss (a loss, a metric, a gradient, a kernel's output) is compared with a reference
computed in fp32 (or fp64) by plain PyTorch, and must satisfy::

    err(ours) <= k * err(torch in the same dtype) + atol

where ``err(x) = max|x - ref| / max|ref|``: the largest deviation from the reference, measured on the
scale of the reference's largest value (for a single number, on the scale of ``max(|ref|, 1)``: losses and
metrics are sums of O(1) terms, and one near 0 got there by cancellation, as DPO's reward margin or GRPO's
``vespo`` loss do). Measuring on the tensor's scale, not element by element, keeps the
check strict for every element of normal size while the rounding of a near-zero element (a relative error
of 1% on a value of 1e-7) cannot fail it; a test that only passes on the CPU it was tuned on is a test of
that CPU's GEMM blocking.

- ``err(torch in the same dtype)`` is what plain PyTorch gets when it runs the same math in the dtype of
  the inputs (bf16 logits, a bf16 GEMM). Where the inputs are fp32, the reference *is* PyTorch in that
  dtype, that term is 0, and the check is ``err(ours) <= atol``.
- ``k`` bounds how much worse than PyTorch we may round. Summing in another order or rounding once where
  PyTorch rounds after each op can be worse on a given element; ``k = 2`` covers that with margin.
- ``atol`` is the error scale of the dtype for results PyTorch happens to get (nearly) exactly, such as a
  sum of few terms or a bf16 GEMM output that both sides round the same way.

How ``k`` and ``atol`` were chosen (largest ``err`` over 8,000 comparisons of tests/losses and tests/kernels,
torch 2.13, CPU):

- fp32: ours against the fp32 reference differs by summation order only (chunked sums, the fp32
  weight-gradient accumulator, a Triton kernel's reduction order). Largest measured err: 2.3e-5 relative
  (under 2e-5 on the scale of 1) on GRPO's ``vespo`` loss, a sum of terms that cancel; every other loss,
  gradient and metric is under 5e-6, most under 1e-6. ``atol = 5e-5``: 2.5x the largest, far below the
  1e-2 and more that a wrong token, row or normaliser costs.
- bf16: err(ours) / err(torch bf16) measured up to 1.65 on the losses (GRPO's loss, where torch's own error
  is small) and 1.1 on their gradients (the weight gradient: both are one bf16 rounding of the same GEMM
  output); ``k = 2``. Triton's CPU interpreter truncates fp32 -> bf16 where torch and GPUs round to
  nearest, which doubles a kernel's rounding error on CPU (the layer-norm kernel's dx: 1.14e-2 where
  torch's is 4.3e-3). ``atol = 8e-3``, two bf16 ulps at the reference's largest value (2^-8 = 3.9e-3),
  covers that and results torch rounds exactly; the largest err measured is 0.69 of its bound.
- fp16: as bf16 with fp16's ulp (2^-11 = 4.9e-4): ``k = 2``, ``atol = 1e-3`` (two ulps).

Set ``CHUNKLOSS_TEST_ERRORS=<file>`` to append every comparison's dtype and errors to ``<file>`` (how the
numbers above are measured).
"""

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    """``err(ours) <= k * err(torch same dtype) + atol`` (errors relative to the reference's max value)."""

    k: float
    atol: float


TOLERANCES = {
    torch.float32: Tol(k=2.0, atol=5e-5),
    torch.bfloat16: Tol(k=2.0, atol=8e-3),
    torch.float16: Tol(k=2.0, atol=1e-3),
}


def err(x, ref, scale: float = 0.0) -> float:
    """``max|x - ref| / max(max|ref|, scale)`` in fp64; ``|x - ref| / max(|ref|, 1)`` for a single number.

    Positions where both are NaN, or both are the same infinity, count as equal."""
    x, ref = torch.as_tensor(x).detach().double().cpu(), torch.as_tensor(ref).detach().double().cpu()
    assert x.shape == ref.shape, f"shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    same = (x == ref) | (x.isnan() & ref.isnan())
    diff = torch.where(same, 0.0, (x - ref).abs())
    if diff.numel() == 0:
        return 0.0
    finite = ref[ref.isfinite()]
    scale = max(finite.abs().max().item() if finite.numel() else 0.0, scale)
    if ref.numel() == 1:
        scale = max(scale, 1.0)
    worst = diff.max().item()
    return worst / scale if scale > 0 else worst


rel_err = err  # the name the GPU test files use


def _record(name, dtype, e_ours, e_torch):
    path = os.environ.get("CHUNKLOSS_TEST_ERRORS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?")
        with open(path, "a") as f:
            f.write(f"{test}\t{name}\t{dtype}\t{e_ours:.3e}\t{e_torch:.3e}\n")


def assert_close_to_ref(
    ours, ref, same_dtype_torch=None, name="", k=None, atol=None, *, dtype=None, scale=0.0
):
    """Asserts ``err(ours) <= k * err(same_dtype_torch) + atol`` against ``ref``.

    Args:
        ours: chunkloss's result (tensor or number; a tuple or list is compared element by element).
        ref: the fp32/fp64 reference.
        same_dtype_torch: plain PyTorch's result in the inputs' low-precision dtype; ``None`` where the inputs
            are fp32 (the reference is then PyTorch in that dtype and its error is 0).
        name: what is compared, for the message.
        k, atol: override the table's values (say why where you do).
        dtype: the dtype whose row of ``TOLERANCES`` applies; defaults to that of ``same_dtype_torch``, else
            of ``ours`` (fp64, a result upcast for the comparison, takes the fp32 row).
        scale: the magnitude errors are measured on where the reference's largest value is not it (entries
            that all cancel to near 0, of a quantity whose size is known).
    """
    assert ours is not None and ref is not None, name
    if isinstance(ours, (tuple, list)):
        assert len(ours) == len(ref), name
        for i, (o, r) in enumerate(zip(ours, ref)):
            t = None if same_dtype_torch is None else same_dtype_torch[i]
            assert_close_to_ref(o, r, t, f"{name}[{i}]", k, atol, dtype=dtype, scale=scale)
        return
    ours_t, ref_t = torch.as_tensor(ours), torch.as_tensor(ref)
    if dtype is None:
        dtype = torch.as_tensor(same_dtype_torch if same_dtype_torch is not None else ours).dtype
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    k = tol.k if k is None else k
    atol = tol.atol if atol is None else atol
    e_ours = err(ours_t, ref_t, scale)
    e_torch = 0.0 if same_dtype_torch is None else err(same_dtype_torch, ref_t, scale)
    _record(name, dtype, e_ours, e_torch)
    assert e_ours <= k * e_torch + atol, (
        f"{name}: err {e_ours:.3g} > {k:g} * torch's {e_torch:.3g} + {atol:g} ({dtype})"
    )
