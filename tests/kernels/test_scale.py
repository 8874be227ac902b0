"""The engine backward's in-place scale (``chunkloss.kernels.scale``) against ``t.mul_(s.to(t.dtype))``.

Without a GPU the kernel runs on CPU through TRITON_INTERPRET=1 at small shapes with a 64-element block, so
each of the interpreter's 16 programs strides over several blocks and the last one is masked; with a GPU
the same small grid runs on CUDA (tests/kernels/conftest.py), and the ``gpu`` tests run at the Llama-3 head
size. Results must equal ``mul_`` bit for bit; NaNs are compared as NaN (their payloads may differ between
devices and are no part of the contract). The inputs hold no subnormals here: the interpreter (Triton 3.x)
flushes bf16 subnormals to zero when it widens them to fp32; the GPU tests include them.
"""

import statistics

import pytest
import torch

import chunkloss.kernels.scale as sc
from chunkloss import FusedLinearCrossEntropyLoss

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 3.0 and -2.0 are exact in every dtype but 3·x rounds in bf16 and fp16; 3.3 rounds itself first.
SCALES = [1.0, 0.5, 3.0, 3.3, -2.0, float("nan"), float("inf"), 0.0]
INT = {4: torch.int32, 2: torch.int16}
# Scaling values up to 2**20 by 3.3 or inf overflows fp16 to inf, and inf·0 or a NaN scale gives NaN, as
# mul_ does; the Triton interpreter computes with numpy, which warns each time. Both are part of what is
# tested.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning"),
]
# Signalling NaNs: any multiplication (even by 1) quiets them, so unchanged bits prove nothing was written.
SNAN = {torch.float32: 0x7F800001, torch.bfloat16: 0x7F81, torch.float16: 0x7C01}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.element_size()])


def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    nan = ours.isnan()
    assert torch.equal(nan, ref.isnan()), "NaNs in different places"
    diff = (bits(ours) != bits(ref)) & ~nan
    assert not diff.any(), f"{int(diff.sum())} elements differ, first at {diff.nonzero()[0].tolist()}"


def data(shape, dtype, device=None) -> torch.Tensor:
    """Normal values over many binades, with ±0 and ±inf."""
    x = torch.randn(shape, device=device) * torch.exp2(torch.randint(-20, 20, shape, device=device).float())
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf")], device=x.device)
    flat[: min(4, flat.numel())] = specials[: flat.numel()]
    return x.to(dtype)


def snans(n, dtype, device=None) -> torch.Tensor:
    return torch.full((n,), SNAN[dtype], dtype=INT[torch.finfo(dtype).bits // 8], device=device).view(dtype)


@pytest.fixture
def small_block(monkeypatch):
    if not torch.cuda.is_available() and not sc._INTERPRETED:
        pytest.skip("CPU tensors reach the Triton kernel only under TRITON_INTERPRET=1")
    monkeypatch.setattr(sc, "BLOCK", 64)


@pytest.mark.parametrize("shape", [(1,), (37,), (64,), (1000,), (41, 123)], ids=str)
@pytest.mark.parametrize("s", SCALES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_mul_bitwise(dtype, s, shape, small_block):
    x = data(shape, dtype)
    s = torch.tensor(s)
    ref = x.clone().mul_(s.to(dtype))
    assert_same_bits(sc.scale_ref(x, s), ref)
    out = sc.scale_(x, s, use_triton=True)
    assert out is x
    assert_same_bits(x, ref)


@pytest.mark.parametrize("s_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_dtype_rounds_first(dtype, s_dtype, small_block):
    """``s`` in any float dtype is rounded once to ``t``'s dtype, as ``s.to(t.dtype)``; one that rounds to 1
    (1 + 2**-9 in bf16) skips, one just above half an ulp of bf16 (1 + 2**-8 + 2**-12) does not."""
    for value in (3.3, 1 + 2**-9, 1 + 2**-8 + 2**-12, 1 - 2**-12):
        s = torch.tensor(value, dtype=s_dtype)
        x = data((300,), dtype)
        ref = x.clone().mul_(s.to(dtype))
        assert_same_bits(sc.scale_(x, s, use_triton=True), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_writes_nothing(dtype, small_block):
    """At s == 1 (also one-element shapes and an s that rounds to 1 in t's dtype) no program stores: the
    signalling NaNs keep their bits."""
    x = snans(1000, dtype)
    before = bits(x).clone()
    for s in (torch.tensor(1.0), torch.ones(1, 1, dtype=torch.float16), torch.tensor(1 + 2**-30)):
        sc.scale_(x, s, use_triton=True)
        assert torch.equal(bits(x), before)
    sc.scale_(x, torch.tensor(2.0), use_triton=True)  # the probe itself: a real multiply changes them
    assert x.isnan().all() and not torch.equal(bits(x), before)


def test_empty(small_block):
    for shape in [(0,), (0, 7)]:
        x = torch.empty(shape, dtype=torch.bfloat16)
        assert sc.scale_(x, torch.tensor(2.0), use_triton=True) is x


def test_bad_inputs():
    x = torch.ones(8)
    with pytest.raises(TypeError, match="t must be float32"):
        sc.scale_(torch.ones(8, dtype=torch.int32), torch.tensor(2.0))
    with pytest.raises(TypeError, match="s must be float32"):
        sc.scale_(x, torch.tensor(2))
    with pytest.raises(TypeError, match="two tensors"):
        sc.scale_(x, 2.0)
    with pytest.raises(ValueError, match="one element"):
        sc.scale_(x, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="one element"):
        sc.scale_(x, torch.tensor([]))
    with pytest.raises(ValueError, match="device"):
        sc.scale_(x, torch.tensor(2.0, device="meta"))


def test_compiled_kernel_refuses_cpu_tensors(monkeypatch):
    monkeypatch.setattr(sc, "_INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        sc.scale_(torch.ones(8, device="cpu"), torch.tensor(2.0, device="cpu"), use_triton=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_paths(dtype):
    """Off the kernel: CPU skips s == 1 (no sync to pay there) and otherwise is ``mul_``; a non-contiguous
    ``t`` is ``mul_`` in place on any device."""
    x = snans(100, dtype, device="cpu")
    before = bits(x).clone()
    assert sc.scale_(x, torch.tensor(1.0, device="cpu")) is x
    assert torch.equal(bits(x), before)
    x = data((100,), dtype, device="cpu")
    ref = x.clone().mul_(torch.tensor(3.3, device="cpu").to(dtype))
    assert_same_bits(sc.scale_(x, torch.tensor(3.3, device="cpu")), ref)
    base = data((20, 30), dtype)  # CUDA where there is one: the fallback inside the CUDA path
    ref = base.clone()
    s = torch.tensor(-2.5, device=base.device)
    ref[:, ::2].mul_(s.to(dtype))
    view = base[:, ::2]
    assert sc.scale_(view, s) is view
    assert_same_bits(base, ref)


def test_records_autograd_when_s_requires_grad():
    """Under ``create_graph=True`` the incoming ``grad_output`` requires grad: ``mul_`` keeps the graph."""
    x = torch.randn(10)
    s = torch.tensor(2.0, requires_grad=True)
    sc.scale_(x, s).sum().backward()
    torch.testing.assert_close(s.grad, x.detach().sum() / 2)


def _ce_grads(device, scale=None):
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cpu")

    hidden = randn(3, 47, 64).bfloat16().to(device).requires_grad_()
    weight = (randn(301, 64) * 0.3).bfloat16().to(device).requires_grad_()
    bias = (randn(301) * 0.1).bfloat16().to(device).requires_grad_()
    labels = torch.randint(0, 301, (3, 47), generator=g, device="cpu").to(device)
    labels[:, :5] = -100
    loss = FusedLinearCrossEntropyLoss(chunk_size=64, compile=False)(hidden, weight, labels, bias=bias)
    (loss if scale is None else loss * scale).backward()
    return [t.grad for t in (hidden, weight, bias)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_engine_grad_output_scales_stored_grads(device):
    """``(loss * 2.5).backward()`` gives the gradients of ``loss.backward()`` times 2.5, rounded once more to
    bf16 (``_scale_grad``'s documented double rounding); the forward is the same, so exactly ``g * 2.5``."""
    plain = _ce_grads(device)
    scaled = _ce_grads(device, 2.5)
    for g, g25 in zip(plain, scaled):
        assert g25.dtype == torch.bfloat16
        assert_same_bits(g25, g * 2.5)
        torch.testing.assert_close(g25.float(), 2.5 * g.float(), rtol=2**-8, atol=0)  # half a bf16 ulp
    nan = _ce_grads(device, torch.tensor(float("nan"), device=device))
    assert all(g.isnan().all() for g in nan)


# ---------------------------------------------------------------------------------------------------------
# CUDA at the Llama-3 head size.
V, H = 128256, 4096


@pytest.mark.gpu
@pytest.mark.parametrize("s", SCALES, ids=str)
def test_matches_mul_bitwise_gpu(s):
    x = data((V, H), torch.bfloat16, device="cuda")
    x.view(-1)[4:1004] = torch.tensor(2.0**-130)  # subnormal in bf16 (and in the fp32 product)
    s = torch.tensor(s, device="cuda")
    ref = x.clone().mul_(s.to(x.dtype))
    sc.scale_(x, s)
    assert_same_bits(x, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_matches_mul_bitwise_gpu_other_dtypes(dtype):
    x = data((32768 + 3, 4096 + 5), dtype, device="cuda")
    x.view(-1)[4:1004] = torch.finfo(dtype).smallest_normal / 8  # subnormals
    for s in (3.3, -2.0, 0.5, 2.0**-10):
        s = torch.tensor(s, device="cuda")
        ref = x.clone().mul_(s.to(dtype))
        assert_same_bits(sc.scale_(x.clone(), s), ref)


@pytest.mark.gpu
def test_int64_offsets_gpu():
    """More than 2**31 elements: offsets past int32 are reached and the tail is masked."""
    x = torch.empty(2**31 + 4099, dtype=torch.bfloat16, device="cuda").normal_()
    s = torch.tensor(3.3, device="cuda")
    ref = x.clone().mul_(s.to(x.dtype))
    sc.scale_(x, s)
    assert_same_bits(x, ref)


@pytest.mark.gpu
def test_no_host_sync_gpu():
    x = torch.randn(1000, device="cuda")
    for s in (1.0, 2.0):
        s = torch.tensor(s, device="cuda")
        sc.scale_(x, s)  # compile outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            sc.scale_(x, s)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def _median_ms(fn, reps=5, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@pytest.mark.gpu
def test_one_skips_work_gpu():
    """At s == 1 the 1 GB weight gradient is neither read nor written (its signalling NaNs survive) and the
    call costs a launch, against ``mul_``'s full pass; at other s the kernel runs at ``mul_``'s speed."""
    x = snans(V * H, torch.bfloat16, device="cuda").view(V, H)
    before = bits(x).clone()
    one, s = torch.ones((), device="cuda"), torch.tensor(2.0, device="cuda")
    sc.scale_(x, one)
    assert torch.equal(bits(x), before)
    del before
    x.normal_()
    t_mul = _median_ms(lambda: x.mul_(one.to(x.dtype)))
    t_skip = _median_ms(lambda: sc.scale_(x, one))
    t_scale = _median_ms(lambda: sc.scale_(x, s))
    gbps = 2 * x.numel() * x.element_size() / t_scale / 1e6
    print(
        f"\n{V}x{H} bf16: mul_ {t_mul:.3f} ms, scale_ s=2 {t_scale:.3f} ms ({gbps:.0f} GB/s), "
        f"s=1 {t_skip:.4f} ms"
    )
    assert t_skip < 0.25 * t_mul
    assert t_scale < 1.25 * t_mul
