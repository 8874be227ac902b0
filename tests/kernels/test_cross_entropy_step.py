"""The cross-entropy chunk step kernel (per-row loss and metrics, dL/dlogits written over the logits) against
(a) its fp32 PyTorch reference ``cross_entropy_step_ref`` and (b) the step it replaces in the engine,
``torch.func.grad_and_value`` of ``chunkloss.losses.cross_entropy.cross_entropy_chunk``.

On CPU the kernel runs through TRITON_INTERPRET=1 at small shapes with a column block forced small enough that
the online reductions cross 2-3 blocks, the last one masked; on a GPU the same grid runs there, and the real
vocabulary is checked and timed in the ``gpu`` tests.

Kernel, reference and ``cross_entropy_chunk`` all compute in fp32 from the same (possibly 16-bit) logits and
round the gradient once, so they differ only in the order of the sums and in ``exp``/``log``/``tanh``
(tests/tolerances.py's fp32 row; largest errors measured over this grid on CPU given below). The
low-precision check is STYLE.md's three-way one taken element by element: ours and torch's gradient must each
lie within the same few-ulp bound of the fp32 reference (a norm ratio err(ours)/err(torch) <= 2 fails under
the interpreter, whose fp32 -> bf16 cast truncates where torch rounds to nearest).
"""

import pytest
import torch

import chunkloss.kernels.cross_entropy as ce
from chunkloss.losses.common import LabelRows, Normalisers
from chunkloss.losses.cross_entropy import CrossEntropyOptions, cross_entropy_chunk
from tests.tolerances import assert_close_to_ref

# Measured over this grid on CPU with seeds 0-5 (largest values given). Per-row fp32 outputs (loss, z_loss,
# entropy), absolute: kernel vs reference 2.1e-5, on entropies, where lse - Σ p·z cancels two numbers near
# max|z| (up to 57 here, ulp 3.8e-6); kernel and reference are each 1.8e-5 or less from fp64.
# fp32 gradient, in gradient units w_i·logit_scale/(normaliser·temperature) (see gradient_unit): 1.9e-6,
# at the label of rows with p_y ≈ 1 where p_y·(1 + 2λ·lse) - 1 cancels (the reference is as far from fp64).
GRAD32_TOL = 1e-5
# bf16 / fp16 gradient against the unrounded fp32 reference: one unit in the last place of the reference value
# in that dtype, plus GRAD32_TOL gradient units. The interpreter truncates fp32 -> bf16 (measured 0.996 ulp);
# a GPU, like torch (0.495 ulp), rounds to nearest, within half a unit (fp16 also in the interpreter: 0.49).
LOW_PRECISION_ULPS = 1.0

SWITCHES = dict(
    label_smoothing=0.1,
    lse_square_scale=1e-4,
    softcap=30.0,
    temperature=0.7,
    logit_scale=0.5,
    grad_scale=True,
)
# Six rows that put every pair of the six switches in all four on/off combinations (a covering array of
# strength 2): all off, all on, and four rows in which each switch is on twice, no two switches in the same
# two rows. The rows in WITH_METRICS ask for accuracy and entropy too (with and without the scalings).
_ROWS = {
    "plain": ("label_smoothing", "lse_square_scale", "softcap", "temperature", "logit_scale", "grad_scale"),
    "all": (),
    "smooth-zloss-softcap": ("temperature", "logit_scale", "grad_scale"),
    "smooth-temp-scale": ("lse_square_scale", "softcap", "grad_scale"),
    "zloss-temp-weights": ("label_smoothing", "softcap", "logit_scale"),
    "softcap-scale-weights": ("label_smoothing", "lse_square_scale", "temperature"),
}
OPTIONS = {name: {k: v for k, v in SWITCHES.items() if k not in off} for name, off in _ROWS.items()}
WITH_METRICS = {"plain", "all", "smooth-zloss-softcap", "zloss-temp-weights"}
# (C, V, BLOCK_V): one row, a few rows, an odd number past 16; 3, 3 and 2 column blocks, the last one masked.
SHAPES = [(1, 37, 16), (3, 130, 64), (17, 1000, 512)]
# Every option row at the two small shapes; the 17-row shape, where the interpreter's time goes (it grows with
# rows x blocks), with all switches off and all on.
CASES = [(name, shape) for name in OPTIONS for shape in SHAPES if shape[0] < 17 or name in ("plain", "all")]
DTYPES = [torch.float32, torch.bfloat16]


def make_inputs(c, v, dtype, weights):
    logits = (4 * torch.randn(c, v)).to(dtype)
    logits[0, v // 2] = 40.0  # the row's max in a later block (softcap 30 saturates it)
    labels = torch.randint(0, v, (c,))
    labels[1::2] = logits[1::2].float().argmax(-1)  # half the rows right: 'correct' takes both values
    normaliser = torch.full((), 2.0 * c + 1)
    grad_scale = 2 * torch.rand(c) if weights else None
    return logits, labels, normaliser, grad_scale


def chunk_step(logits, labels, normaliser, grad_scale, opts):
    """The engine's token step (eager): grad_and_value of cross_entropy_chunk, metrics summed over rows; with
    per-row weights, of ``Σ_i w_i·ℓ_i / normaliser`` from the per-row losses (as the engine's ``TOKEN_ROWS``
    step weights them)."""
    token = LabelRows(labels)
    scalars = Normalisers(normaliser, n_valid=torch.ones(()))  # n_valid 1: metrics are plain sums

    def step(z):
        loss, metrics = cross_entropy_chunk(z, [], token, scalars, opts)
        if grad_scale is not None:
            loss = (metrics["loss"] * grad_scale).sum() / normaliser
        return loss, {k: m.detach() for k, m in metrics.items()}

    grad, (loss, metrics) = torch.func.grad_and_value(step, has_aux=True)(logits)
    return grad, loss, metrics


def chunk_options(kw, metrics):
    return CrossEntropyOptions(
        reduction="none",  # the per-row loss comes back as metrics["loss"]; the summed loss is unchanged
        label_smoothing=kw.get("label_smoothing", 0.0),
        lse_square_scale=kw.get("lse_square_scale", 0.0),
        softcap=kw.get("softcap"),
        temperature=kw.get("temperature", 1.0),
        logit_scale=kw.get("logit_scale", 1.0),
        return_token_accuracy=metrics,
        return_entropy=metrics,
    )


def gradient_unit(normaliser, grad_scale, kw, c):
    """(C, 1) w_i·logit_scale / (normaliser·temperature): the size of dL/dx for a unit dℓ/dz, the scale of
    the terms p·(1 + 2λ·lse), (1-ε)·[j = y] and ε/V before they cancel (near the label when p_y ≈ 1)."""
    w = torch.ones(c) if grad_scale is None else grad_scale
    unit = w * kw.get("logit_scale", 1.0) / (normaliser * kw.get("temperature", 1.0))
    return unit.unsqueeze(-1)


def grad_errors(ours, ref32, unit):
    """Largest |ours - ref32| in gradient units (see gradient_unit), and in units of the spacing of
    ``ours.dtype`` at each reference value after GRAD32_TOL gradient units are taken off."""
    info = torch.finfo(ours.dtype)
    ours, ref32 = ours.float(), ref32.float()
    diff = (ours - ref32).abs()
    fp32 = (diff / unit).nan_to_num(0.0).max().item()  # 0/0 in rows of weight 0
    _, exponent = torch.frexp(
        ref32
    )  # |ref| = m·2^e with m in [0.5, 1): spacing eps·2^(e-1), subnormals eps·tiny
    spacing = torch.ldexp(torch.full_like(ref32, info.eps), exponent - 1).clamp_min(info.eps * info.tiny)
    ulps = ((diff - GRAD32_TOL * unit).clamp_min(0) / spacing).max().item()
    return fp32, ulps


def check_grad(ours, ref32, unit, what):
    fp32, ulps = grad_errors(ours, ref32, unit)
    if ours.dtype == torch.float32:
        assert fp32 <= GRAD32_TOL, f"{what}: fp32 gradient off by {fp32:.2e} gradient units"
    else:
        assert ulps <= LOW_PRECISION_ULPS, f"{what}: {ours.dtype} gradient off by {ulps:.3f} ulp"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, shape", CASES, ids=[f"{name}-{c}x{v}" for name, (c, v, _) in CASES])
def test_cross_entropy_step(name, shape, dtype, monkeypatch):
    check_step(name, shape, dtype, monkeypatch)


@pytest.mark.parametrize("name, shape", [("plain", SHAPES[0]), ("all", SHAPES[1])], ids=["plain", "all"])
def test_cross_entropy_step_fp16(name, shape, monkeypatch):
    check_step(name, shape, torch.float16, monkeypatch)


def check_step(name, shape, dtype, monkeypatch):
    c, v, block = shape
    monkeypatch.setattr(ce, "BLOCK_V", block)
    kw = dict(OPTIONS[name])
    metrics = name in WITH_METRICS
    logits, labels, normaliser, grad_scale = make_inputs(c, v, dtype, kw.pop("grad_scale", False))
    flags = dict(want_accuracy=metrics, want_entropy=metrics)
    unit = gradient_unit(normaliser, grad_scale, kw, c)

    ours_grad = logits.clone()
    ours = ce.cross_entropy_step(ours_grad, labels, normaliser, grad_scale, **kw, **flags)
    ref_grad = logits.to(torch.float32, copy=True)  # the reference upcasts anyway: its gradient unrounded
    ref = ce.cross_entropy_step_ref(ref_grad, labels, normaliser, grad_scale, **kw, **flags)

    # (a) the reference, output by output.
    assert ours.keys() == ref.keys()
    expected = {"loss"} | ({"z_loss"} if "lse_square_scale" in kw else set())
    assert set(ours) == expected | ({"correct", "entropy"} if metrics else set())
    for key, value in ours.items():
        assert value.shape == (c,) and value.dtype == torch.float32, key
        if key == "correct":
            assert torch.equal(value, ref[key])
        else:
            assert_close_to_ref(value, ref[key], name=key)
    if metrics and c > 1:
        assert 0 < ours["correct"].sum() < c
    assert ours_grad.dtype == dtype
    check_grad(ours_grad, ref_grad, unit, "vs reference")

    # (b) grad_and_value of cross_entropy_chunk, the engine's step today.
    torch_grad, loss, torch_metrics = chunk_step(
        logits, labels, normaliser, grad_scale, chunk_options(kw, metrics)
    )
    w = torch.ones(c) if grad_scale is None else grad_scale
    assert_close_to_ref((ours["loss"] * w).sum() / normaliser, loss)
    assert_close_to_ref(ours["loss"], torch_metrics.pop("loss"))
    names = {"z_loss": "z_loss", "correct": "mean_token_accuracy", "entropy": "entropy"}
    assert {names[k] for k in ours if k != "loss"} == set(torch_metrics)
    for key, value in ours.items():
        if key != "loss":
            summed = torch_metrics[names[key]]
            assert_close_to_ref(value.sum(), summed)
    assert torch_grad.dtype == dtype
    check_grad(torch_grad, ref_grad, unit, "torch vs reference")  # the bound holds for torch's own step too
    check_grad(ours_grad, torch_grad.float(), unit, "vs torch")


def test_argmax_takes_the_first_maximum(monkeypatch):
    """'correct' compares the label with the first index of the row's max, as torch.argmax does, within a
    block and across blocks."""
    monkeypatch.setattr(ce, "BLOCK_V", 16)
    logits = torch.randn(4, 40).bfloat16()
    logits[:, [3, 5, 20]] = 9.0  # ties inside block 0 and across blocks 0 and 1
    labels = torch.tensor([3, 5, 20, 0])
    out = ce.cross_entropy_step(logits, labels, torch.ones(()), want_accuracy=True)
    assert out["correct"].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_overwrites_logits_and_empty_chunk():
    logits = torch.randn(3, 50)
    buffer = logits.data_ptr()
    ce.cross_entropy_step(logits, torch.tensor([1, 2, 3]), torch.ones(()))
    assert logits.data_ptr() == buffer
    assert_close_to_ref(logits.sum(-1), torch.zeros(3))  # Σ_j (p_j - [j = y]) = 0
    out = ce.cross_entropy_step(torch.empty(0, 50), torch.empty(0, dtype=torch.long), torch.ones(()))
    assert out["loss"].shape == (0,)


# Each entry builds its bad argument when the test runs, on the test's device.
BAD_ARGUMENTS = {
    "transposed logits": (
        lambda: dict(logits=torch.randn(50, 4).t()),
        ValueError,
        "logits must be contiguous",
    ),
    "fp64 logits": (lambda: dict(logits=torch.randn(4, 50).double()), TypeError, "logits must be"),
    "3-d logits": (lambda: dict(logits=torch.randn(4, 50, 1)), ValueError, "logits must be"),
    "int32 labels": (
        lambda: dict(labels=torch.zeros(4, dtype=torch.int32)),
        TypeError,
        "labels must be int64",
    ),
    "short labels": (lambda: dict(labels=torch.zeros(3, dtype=torch.long)), ValueError, "labels must be"),
    "1-d normaliser": (lambda: dict(normaliser=torch.ones(1)), TypeError, "normaliser"),
    "float normaliser": (lambda: dict(normaliser=1.0), TypeError, "normaliser"),
    "fp64 grad_scale": (lambda: dict(grad_scale=torch.ones(4).double()), TypeError, "grad_scale"),
    "strided grad_scale": (lambda: dict(grad_scale=torch.ones(8)[::2]), ValueError, "grad_scale"),
    "label_smoothing": (lambda: dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    "temperature": (lambda: dict(temperature=0.0), ValueError, "temperature"),
    "softcap": (lambda: dict(softcap=0.0), ValueError, "softcap"),
    "lse_square_scale": (lambda: dict(lse_square_scale=-1.0), ValueError, "lse_square_scale"),
}


@pytest.mark.parametrize("bad", list(BAD_ARGUMENTS))
@pytest.mark.parametrize("fn", [ce.cross_entropy_step, ce.cross_entropy_step_ref], ids=["kernel", "ref"])
def test_rejects_bad_arguments(fn, bad):
    change, error, match = BAD_ARGUMENTS[bad]
    args = dict(logits=torch.randn(4, 50), labels=torch.zeros(4, dtype=torch.long), normaliser=torch.ones(()))
    args |= change()
    with pytest.raises(error, match=match):
        fn(**args)


def _compiled_chunk_step(opts):
    """The engine's compiled token step: grad_and_value of cross_entropy_chunk, gradient copied over the
    logits (the TOKEN step of chunkloss.engine.steps)."""

    def step(logits, token, scalars):
        def loss_fn(z):
            loss, metrics = cross_entropy_chunk(z, [], token, scalars, opts)
            return loss, {k: m.detach() for k, m in metrics.items()}

        grad, (loss, metrics) = torch.func.grad_and_value(loss_fn, has_aux=True)(logits)
        logits.copy_(grad)
        return loss, metrics

    return torch.compile(step)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["plain", "all"])
def test_cross_entropy_step_real_vocab(name):
    """Llama-3 vocabulary, bf16, a 4096-row chunk: against the reference, and timed beside the compiled
    grad_and_value step it replaces (two reads and one write of the logits against three and one)."""
    import triton

    kw = dict(OPTIONS[name])
    logits, labels, normaliser, grad_scale = make_inputs(
        4096, 128256, torch.bfloat16, kw.pop("grad_scale", False)
    )
    flags = dict(want_accuracy=True, want_entropy=True)
    ours_grad = logits.clone()
    ours = ce.cross_entropy_step(ours_grad, labels, normaliser, grad_scale, **kw, **flags)
    ref_grad = logits.to(torch.float32, copy=True)
    ref = ce.cross_entropy_step_ref(ref_grad, labels, normaliser, grad_scale, **kw, **flags)
    for key, value in ours.items():
        if key == "correct":
            assert torch.equal(value, ref[key])
        else:
            assert_close_to_ref(value, ref[key], name=key)
    check_grad(ours_grad, ref_grad, gradient_unit(normaliser, grad_scale, kw, 4096), "vs reference")
    del ref_grad, ref

    opts = chunk_options(kw, True)
    token = LabelRows(labels)
    scalars = Normalisers(normaliser, n_valid=torch.ones((), device="cuda"))
    compiled = _compiled_chunk_step(opts)
    buf = logits.clone()  # both overwrite their input with a gradient each call; the values do not matter
    t_ours = triton.testing.do_bench(
        lambda: ce.cross_entropy_step(buf, labels, normaliser, grad_scale, **kw, **flags)
    )
    t_compiled = triton.testing.do_bench(lambda: compiled(buf, token, scalars))
    gbps = 3 * buf.numel() * buf.element_size() / t_ours / 1e6
    print(
        f"\ncross_entropy_step 4096x128256 bf16, options {name} + accuracy + entropy: kernel {t_ours:.3f} ms"
        f" ({gbps:.0f} GB/s for 2 reads and 1 write), compiled grad_and_value {t_compiled:.3f} ms"
    )


@pytest.mark.gpu
def test_cross_entropy_step_offsets_past_2_31():
    """C·V > 2^31: the last rows (read and written through int64 offsets) against the reference."""
    c, v = 16800, 128256  # 2.15e9 elements, 4.3 GB in bf16
    logits = torch.randn(c, v, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, v, (c,), device="cuda")
    tail = logits[-8:].float()
    ours = ce.cross_entropy_step(logits, labels, torch.ones((), device="cuda"))
    ref = ce.cross_entropy_step_ref(tail, labels[-8:], torch.ones((), device="cuda"))
    assert_close_to_ref(ours["loss"][-8:], ref["loss"])
    check_grad(logits[-8:], tail, torch.ones(8, 1, device="cuda"), "last rows")
