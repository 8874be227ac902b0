"""``chunkloss.kernels.weight_grad.finish_weight_grad``: ``(s·acc + gᵀ·x).to(dtype)`` in one pass.

Without a GPU the kernel runs on CPU through TRITON_INTERPRET=1 at small odd shapes with small tiles
(several tiles per axis, masked edges, several K steps); the ``gpu`` test runs the engine's shapes (Llama-3
head, K up to ``MAX_ROWS``). Every element must be the exactly summed value rounded once to the output
dtype, give or take the fp32 rounding of the sum: within one unit in the last place of the output dtype of
the fp64 result plus the standard error bound of an fp32 sum of K + 1 terms.
"""

import pytest
import torch

import chunkloss.kernels.weight_grad as wg

LOW = [torch.bfloat16, torch.float16]


@pytest.fixture
def small_tiles(monkeypatch):
    if not torch.cuda.is_available() and not wg._INTERPRETED:
        pytest.skip("CPU tensors reach the Triton kernel only under TRITON_INTERPRET=1")
    monkeypatch.setattr(wg, "BLOCK_V", 32)
    monkeypatch.setattr(wg, "BLOCK_V_NO_K", 16)
    monkeypatch.setattr(wg, "BLOCK_H", 16)
    monkeypatch.setattr(wg, "BLOCK_K", 16)


def exact(acc, g, x, s):
    """fp64 ``s·acc + gᵀ·x`` (the value every output element rounds) and the fp32 sum's error bound,
    (K + 2)·2⁻²⁴·(|s·acc| + Σ_k |g[k, v]|·|x[k, h]|) (the standard bound on a dot product summed in fp32)."""
    out, mag, k = 0.0, 0.0, 0
    if acc is not None:
        out = acc.double() * (s.double() if s is not None else 1.0)
        mag = out.abs()
    if g is not None:
        out = out + g.double().t() @ x.double()
        mag = mag + g.double().abs().t() @ x.double().abs()
        k = g.shape[0]
    return out, (k + 2) * 2.0**-24 * mag


def assert_within_one_ulp(out, want, dtype):
    """|out − value| ≤ one ulp of ``dtype`` at the value's magnitude plus the fp32 sum's error bound: the
    exact value rounded once, with the fp32 sum's own rounding before it."""
    value, bound = want
    assert out.dtype == dtype and not out.isnan().any()
    mag = value.abs().clamp_min(torch.finfo(dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - {torch.bfloat16: 7, torch.float16: 10}[dtype])
    err = (out.double() - value).abs()
    bad = err > ulp + bound
    assert not bad.any(), (
        f"{int(bad.sum())} elements off, worst {float((err / (ulp + bound)).max()):.2f}x the bound"
    )


SHAPES = [(123, 31, 0), (123, 31, 5), (70, 47, 33), (1, 1, 1), (64, 16, 16)]  # (V, H, K)
# Without an accumulator there must be rows (K > 0): acc, g and x all absent is refused (test_bad_input).
CASES = [(c, *shape) for c in ("acc", "acc_s", "no_acc") for shape in SHAPES if c != "no_acc" or shape[2]]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("case, v, h, k", CASES, ids=str)
def test_matches_exact_sum_rounded_once(small_tiles, dtype, v, h, k, case):
    g0 = torch.Generator().manual_seed(v * h + k)
    acc = torch.randn(v, h, generator=g0) if case != "no_acc" else None
    s = torch.tensor(0.37) if case == "acc_s" else None
    g = torch.randn(k, v, generator=g0).to(dtype)
    x = torch.randn(k, h, generator=g0).to(dtype)
    rows = (g, x) if k else (None, None)  # K = 0 (with an accumulator): the scale and cast alone
    out = wg.finish_weight_grad(acc, *rows, s, dtype)
    assert_within_one_ulp(out.cpu(), exact(acc, g, x, s), dtype)
    ref = wg.finish_weight_grad_ref(acc, g, x, s, dtype)
    assert_within_one_ulp(ref.cpu(), exact(acc, g, x, s), dtype)  # the reference meets the same bound


def test_strided_rows_and_scale_on_device(small_tiles):
    """``g`` and ``x`` as row slices of wider buffers (the engine passes a chunk's rows), and a NaN scale that
    propagates (as ``acc.mul_(nan)`` would)."""
    dtype = torch.bfloat16
    acc = torch.randn(40, 24)
    gbuf = torch.randn(9, 40 + 8).to(dtype)
    g = gbuf[:, :40]
    xbuf = torch.randn(9, 30).to(dtype)
    x = xbuf[:, 3:27]
    assert g.stride(0) == 48 and x.stride(0) == 30
    out = wg.finish_weight_grad(acc, g, x, torch.tensor(2.5), dtype)
    assert_within_one_ulp(out, exact(acc, g, x, torch.tensor(2.5)), dtype)
    assert wg.finish_weight_grad(acc, None, None, torch.tensor(float("nan")), dtype).isnan().all()


def test_bad_input():
    acc = torch.randn(8, 4)
    g = torch.randn(3, 8).bfloat16()
    x = torch.randn(3, 4).bfloat16()
    with pytest.raises(TypeError, match="dtype"):
        wg.finish_weight_grad(acc, g, x, None, torch.float32)
    with pytest.raises(ValueError, match="together"):
        wg.finish_weight_grad(acc, g, None, None, torch.bfloat16)
    with pytest.raises(ValueError, match="share K"):
        wg.finish_weight_grad(acc, g, x[:2], None, torch.bfloat16)
    with pytest.raises(ValueError, match="does not match"):
        wg.finish_weight_grad(acc[:, :3].contiguous(), g, x, None, torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        wg.finish_weight_grad(acc.double(), g, x, None, torch.bfloat16)
    with pytest.raises(ValueError, match="unit column stride"):
        wg.finish_weight_grad(acc, g.t().contiguous().t(), x, None, torch.bfloat16)
    with pytest.raises(ValueError, match="nothing"):
        wg.finish_weight_grad(None, None, None, None, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 12, 256, wg.MAX_ROWS])
def test_llama3_head_gpu(k):
    """The engine's sizes on a GPU with the default tiles: V=128256, H=4096, a softmax-like gradient."""
    v, h = 128256, 4096
    gen = torch.Generator(device="cuda").manual_seed(k)
    acc = torch.randn(v, h, device="cuda", generator=gen).mul_(1e-3)
    g = torch.randn(k, v, device="cuda", generator=gen).softmax(1).to(torch.bfloat16)
    x = torch.randn(k, h, device="cuda", generator=gen).to(torch.bfloat16)
    s = torch.full((), 0.75, device="cuda")
    out = wg.finish_weight_grad(acc, g if k else None, x if k else None, s, torch.bfloat16)
    assert_within_one_ulp(out, exact(acc, g if k else None, x if k else None, s), torch.bfloat16)
