"""The no-grad label log-prob kernel (a reference head's per-row statistic) against its fp32 reference.

On CPU the kernel runs through TRITON_INTERPRET=1 at small shapes with a small column block, so the online
max/sum-exp crosses several blocks; on a GPU at the real vocabulary.

Kernel and reference both compute in fp32 from the same (possibly bf16) logits; they differ only in the
order of the sum-exp and in ``exp``/``log`` implementations. Measured on CPU: at most 9.5e-7 absolute on
log-probs of magnitude ~10, hence ``atol=1e-5, rtol=1e-6`` (a few fp32 ulps of the lse).
"""

import chunkloss.kernels.logprob as lp
import pytest
import torch

from chunkloss.losses import common

TOL = dict(atol=1e-5, rtol=1e-6)
SCALES = [{}, dict(logit_scale=0.5, softcap=3.0, temperature=0.7), dict(temperature=1.3)]


@pytest.mark.parametrize("scales", SCALES, ids=["plain", "scale-softcap-temp", "temp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c, v", [(1, 37), (5, 130), (17, 1000)])
def test_label_logprob_kernel(c, v, dtype, scales, monkeypatch):
    monkeypatch.setattr(lp, "BLOCK_V", 64)  # V=130 and 1000 take 3 and 16 blocks, the last one masked
    z = (4 * torch.randn(c, v)).to(dtype)
    z[0, :5] = 60.0  # a large logit early in the row moves the running max once, then not again
    y = torch.randint(0, v, (c,))
    y[0] = 2
    torch.testing.assert_close(
        lp.label_logprob_triton(z, y, **scales), lp.label_logprob_ref(z, y, **scales), **TOL
    )


def test_label_logprob_kernel_row_stride_and_empty():
    z = torch.randn(6, 100)[:, :90]  # rows with a stride larger than V
    y = torch.randint(0, 90, (6,))
    torch.testing.assert_close(lp.label_logprob_triton(z, y), lp.label_logprob_ref(z, y), **TOL)
    assert lp.label_logprob_triton(z[:0], y[:0]).shape == (0,)
    with pytest.raises(ValueError, match="labels"):
        lp.label_logprob_triton(z, y[:3])


@pytest.mark.parametrize("scales", SCALES[:2], ids=["plain", "scale-softcap-temp"])
def test_nograd_label_logprob_blocks_off_cuda(scales, monkeypatch):
    """Off CUDA the reduction runs in blocks of rows (bounded fp32 temporaries): same values as one block."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA path is the kernel, tested above")
    z, y = torch.randn(9, 50).bfloat16(), torch.randint(0, 50, (9,))
    monkeypatch.setattr(common, "NOGRAD_BLOCK_ELEMS", 200)  # 4 rows per block: blocks of 4, 4, 1
    assert torch.equal(common.nograd_label_logprob(z, y, **scales), lp.label_logprob_ref(z, y, **scales))


@pytest.mark.gpu
def test_label_logprob_kernel_real_vocab():
    """Llama-3 vocabulary, bf16, a 4096-row chunk; prints the kernel's time beside the compiled reduction it
    replaced (one read of the logits against two or three)."""
    import triton

    z = (3 * torch.randn(4096, 128256, device="cuda")).bfloat16()
    y = torch.randint(0, 128256, (4096,), device="cuda")
    ours = lp.label_logprob_triton(z, y, softcap=30.0)
    torch.testing.assert_close(ours, lp.label_logprob_ref(z, y, softcap=30.0), **TOL)
    compiled = torch.compile(lambda z, y: lp.label_logprob_ref(z, y, softcap=30.0))
    t_ours = triton.testing.do_bench(lambda: lp.label_logprob_triton(z, y, softcap=30.0))
    t_compiled = triton.testing.do_bench(lambda: compiled(z, y))
    gbps = z.numel() * z.element_size() / t_ours / 1e6
    print(
        f"label_logprob 4096x128256 bf16: kernel {t_ours:.3f} ms ({gbps:.0f} GB/s), compiled {t_compiled:.3f}"
    )
