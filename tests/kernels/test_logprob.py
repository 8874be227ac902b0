"""The no-grad label log-prob kernel (a reference head's per-row statistic) against its fp32 reference.

On CPU the kernel runs through TRITON_INTERPRET=1 at small shapes with a small column block, so the online
max/sum-exp crosses several blocks; on a GPU at the real vocabulary.

Kernel and reference both compute in fp32 from the same (possibly bf16) logits; they differ only in the
order of the sum-exp and in ``exp``/``log`` implementations. Measured on CPU: at most 9.5e-7 absolute on
log-probs of magnitude ~10, inside tests/tolerances.py's fp32 row.
"""

import pytest
import torch

import chunkloss.kernels.logprob as lp
from chunkloss.losses import common
from tests.tolerances import assert_close_to_ref

SCALES = [{}, dict(logit_scale=0.5, softcap=3.0, temperature=0.7), dict(temperature=1.3)]


@pytest.mark.parametrize("scales", SCALES, ids=["plain", "scale-softcap-temp", "temp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c, v", [(1, 37), (5, 130), pytest.param(4, 1000, marks=pytest.mark.slow)])
def test_label_logprob_kernel(c, v, dtype, scales, monkeypatch):
    monkeypatch.setattr(lp, "BLOCK_V", 64)  # V=130 and 1000 take 3 and 16 blocks, the last one masked
    z = (4 * torch.randn(c, v)).to(dtype)
    z[0, :5] = 60.0  # a large logit early in the row moves the running max once, then not again
    y = torch.randint(0, v, (c,))
    y[0] = 2
    assert_close_to_ref(lp.label_logprob_triton(z, y, **scales), lp.label_logprob_ref(z, y, **scales))


def test_label_logprob_kernel_row_stride_and_empty():
    z = torch.randn(6, 100)[:, :90]  # rows with a stride larger than V
    y = torch.randint(0, 90, (6,))
    assert_close_to_ref(lp.label_logprob_triton(z, y), lp.label_logprob_ref(z, y))
    assert lp.label_logprob_triton(z[:0], y[:0]).shape == (0,)
    with pytest.raises(ValueError, match="labels"):
        lp.label_logprob_triton(z, y[:3])


@pytest.mark.parametrize("scales", SCALES[:2], ids=["plain", "scale-softcap-temp"])
def test_nograd_label_logprob_blocks_off_cuda(scales, monkeypatch):
    """Off CUDA the reduction runs in blocks of rows (bounded fp32 temporaries): the values of one block, and
    those of the kernel's reference."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA path is the kernel, tested above")
    z, y = torch.randn(9, 50).bfloat16(), torch.randint(0, 50, (9,))
    monkeypatch.setattr(common, "NOGRAD_BLOCK_ELEMS", 200)  # 4 rows per block: blocks of 4, 4, 1
    blocks = common.nograd_label_logprob(z, y, **scales)
    assert torch.equal(blocks, common.row_statistics(z, y, **scales).logp)
    assert_close_to_ref(blocks, lp.label_logprob_ref(z, y, **scales))


@pytest.mark.gpu
def test_label_logprob_kernel_real_vocab():
    """Llama-3 vocabulary, bf16, a 4096-row chunk; prints the kernel's time beside the compiled reduction it
    replaced (one read of the logits against two or three)."""
    import triton

    z = (3 * torch.randn(4096, 128256, device="cuda")).bfloat16()
    y = torch.randint(0, 128256, (4096,), device="cuda")
    ours = lp.label_logprob_triton(z, y, softcap=30.0)
    assert_close_to_ref(ours, lp.label_logprob_ref(z, y, softcap=30.0))
    compiled = torch.compile(lambda z, y: lp.label_logprob_ref(z, y, softcap=30.0))
    t_ours = triton.testing.do_bench(lambda: lp.label_logprob_triton(z, y, softcap=30.0))
    t_compiled = triton.testing.do_bench(lambda: compiled(z, y))
    gbps = z.numel() * z.element_size() / t_ours / 1e6
    print(
        f"label_logprob 4096x128256 bf16: kernel {t_ours:.3f} ms ({gbps:.0f} GB/s), compiled {t_compiled:.3f}"
    )


# Per-row statistics and the gradient of a loss on them (GRPO's and the preference losses' CUDA steps).
# Statistics against an fp64 evaluation (the fp32 reference's entropy is itself 1.2e-4 off on the row with
# max|z| = 60, where lse - Σ p·z cancels two numbers near 60): measured ≤ 5.3e-6 on CPU (interpreter).
# Gradients against fp64 autograd too (the entropy term p·(z - lse + H) carries the same cancellation): fp32
# within tests/tolerances.py's fp32 row; 16-bit within one unit in the last place of the fp64 value in that
# dtype (the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest).


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of x in its dtype."""
    bits = torch.finfo(x.dtype).bits - {torch.bfloat16: 8, torch.float16: 5, torch.float32: 8}[x.dtype] - 1
    return torch.ldexp(torch.ones_like(x.float()), torch.frexp(x.float())[1] - 1 - bits).clamp(
        min=torch.finfo(x.dtype).tiny
    )


def _stats_fp64(z, y, y2, logit_scale=1.0, softcap=None, temperature=1.0):
    """Every statistic of ``row_stats`` evaluated in float64."""
    z = common.scale_logits(z.double(), logit_scale, softcap, temperature)
    lse = torch.logsumexp(z, -1)
    logp = torch.log_softmax(z, -1)
    return {
        "logp": logp.gather(-1, y[:, None])[:, 0],
        "logp2": logp.gather(-1, y2[:, None])[:, 0],
        "lse": lse,
        "entropy": -(logp.exp() * logp).sum(-1),
        "mean": z.mean(-1),
        "argmax": z.argmax(-1),
        "lse2": torch.logsumexp(2 * z, -1),
    }


def _grad_fp64(z, y, a, labels2=None, coef2=None, coef_entropy=None, **scales):
    x = z.double().requires_grad_(True)
    r = _stats_fp64(x, y, y if labels2 is None else labels2, **scales)
    total = (r["logp"] * a.double()).sum()
    if labels2 is not None:
        total = total + (r["logp2"] * coef2.double()).sum()
    if coef_entropy is not None:
        total = total + (r["entropy"] * coef_entropy.double()).sum()
    return torch.autograd.grad(total, x)[0]


@pytest.mark.parametrize("scales", SCALES, ids=["plain", "scale-softcap-temp", "temp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# V=1: a one-column block. 5 x 130 crosses blocks and masks the last one; 4 x 1000 runs 16 blocks (~5 s a
# case in the interpreter).
@pytest.mark.parametrize("c, v", [(3, 1), (1, 37), (5, 130), pytest.param(4, 1000, marks=pytest.mark.slow)])
def test_row_stats_and_grad(c, v, dtype, scales, monkeypatch):
    monkeypatch.setattr(lp, "BLOCK_V", 64)
    z = (4 * torch.randn(c, v)).to(dtype)
    z[0, :5] = 60.0 if dtype != torch.float16 else 30.0
    y, y2 = torch.randint(0, v, (c,)), torch.randint(0, v, (c,))
    y[0] = min(2, v - 1)
    every = dict(lse=True, entropy=True, mean=True, argmax=True, lse2=True)
    got, ref = lp.row_stats(z, y, y2, **every, **scales), _stats_fp64(z, y, y2, **scales)
    assert set(got) == set(ref)
    for k in ref:
        if k == "argmax":
            assert torch.equal(got[k], ref[k])
        else:
            assert_close_to_ref(got[k].double(), ref[k], name=k)
    a, a2, b = torch.randn(c), torch.randn(c), torch.randn(c)
    for kw in (
        dict(),
        dict(labels2=y2, coef2=a2),
        dict(coef_entropy=b),
        dict(labels2=y2, coef2=a2, coef_entropy=b),
    ):
        expect = _grad_fp64(z, y, a, **kw, **scales)
        # (The fp32 reference row_grad_ref, the eager steps' math, is 2.9e-5 off fp64 on the max|z| = 60 row.)
        saved = dict(lse=got["lse"], entropy=got["entropy"])
        for stats in ({}, saved):  # the row's lse and entropy read again, or handed over
            out = lp.row_grad_(z.clone(), y, a, **kw, **stats, **scales)
            assert out.dtype == dtype
            if dtype == torch.float32:
                assert_close_to_ref(out.double(), expect)
            else:
                assert ((out.double() - expect).abs() <= _ulp(expect.to(dtype)) + 2e-5).all()


def test_row_kernels_bad_input():
    z, y = torch.randn(4, 50), torch.randint(0, 50, (4,))
    with pytest.raises(ValueError, match="coef must be a contiguous float32"):
        lp.row_grad_(z, y, torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="coef_entropy"):
        lp.row_grad_(z, y, torch.ones(4), coef_entropy=torch.ones(8)[::2])
    with pytest.raises(ValueError, match="labels2 and coef2"):
        lp.row_grad_(z, y, torch.ones(4), labels2=y)
    with pytest.raises(ValueError, match="statistics go together"):
        lp.row_grad_(z, y, torch.ones(4), lse=lp.row_stats(z, y, lse=True)["lse"], coef_entropy=torch.ones(4))
    with pytest.raises(ValueError, match="statistics go together"):
        lp.row_grad_(z, y, torch.ones(4), entropy=lp.row_stats(z, y, entropy=True)["entropy"])
    with pytest.raises(TypeError, match="logits must be float32"):
        lp.row_stats(z.double(), y)
    with pytest.raises(ValueError, match="labels2"):
        lp.row_stats(z, y, y[:2])
    with pytest.raises(ValueError, match="temperature"):
        lp.row_stats(z, y, temperature=0.0)
    assert lp.row_grad_(z[:0], y[:0], torch.ones(0)).shape == (0, 50)


@pytest.mark.gpu
def test_row_kernels_real_vocab():
    """Llama-3 vocabulary, bf16, a 4096-row chunk: the GRPO token step's kernels against their references, and
    their time beside the compiled step they replace (printed)."""
    import triton

    c, v = 4096, 128256
    z = (3 * torch.randn(c, v, device="cuda")).bfloat16()
    y = torch.randint(0, v, (c,), device="cuda")
    a, b = torch.randn(c, device="cuda") * 1e-3, torch.randn(c, device="cuda") * 1e-3
    got = lp.row_stats(z, y, lse=True, entropy=True)
    ref = lp.row_stats_ref(z, y, lse=True, entropy=True)
    for k in ref:
        assert_close_to_ref(got[k], ref[k], name=k)
    expect = lp.row_grad_ref(z.clone(), y, a, coef_entropy=b)
    out = lp.row_grad_(z.clone(), y, a, coef_entropy=b, lse=got["lse"], entropy=got["entropy"])
    # Both round an fp32 value to bf16 and the two fp32 values differ in their last bits, so a value near a
    # rounding boundary may land one bf16 ulp apart (half an ulp each way failed on an H100).
    assert ((out.float() - expect.float()).abs() <= _ulp(expect) + 1e-9).all()
    zz = z.clone()
    t_stats = triton.testing.do_bench(lambda: lp.row_stats(z, y, lse=True, entropy=True))
    t_grad = triton.testing.do_bench(
        lambda: lp.row_grad_(zz, y, a, coef_entropy=b, lse=got["lse"], entropy=got["entropy"])
    )
    t_grad2 = triton.testing.do_bench(lambda: lp.row_grad_(zz, y, a, coef_entropy=b))

    def compiled_step(z):
        def f(x):
            r = lp.row_stats_ref(x, y, entropy=True)
            return (r["logp"] * a + r["entropy"] * b).sum()

        g = torch.func.grad(f)(z)
        z.copy_(g)

    compiled = torch.compile(compiled_step)
    t_compiled = triton.testing.do_bench(lambda: compiled(zz))
    print(
        f"row kernels 4096x128256 bf16: stats {t_stats:.3f} ms, grad with stats {t_grad:.3f} ms, "
        f"grad alone {t_grad2:.3f} ms; compiled logp+entropy grad step {t_compiled:.3f} ms"
    )
