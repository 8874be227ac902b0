"""An FP8 base (chunkloss/kernels/fp8.py) inside lora_linear, attention_input and gated_mlp.

Exactness: each function with its base weights as ``Float8Weight`` against its reference, whose base
products are ``fp8_linear_ref`` (the same quantisation of the same tensors, dequantised and multiplied in the
dtype it runs in), under the one rule of tests/tolerances.py: ``err(ours) <= k * err(torch) + atol`` against
the reference in fp64, ``torch`` being the reference run in the dtype under test. The fp32 case passes that
run too, not 0: quantising is a step function, and an fp64 activation that rounds to another e4m3 value
than its fp32 copy (an fp32 ulp from a rounding midpoint) moves the reference by a step that no summation
order explains; the fp32 reference run takes the same steps as ours.

Accuracy: fp8 against the same layer on its unquantised weights, with the measured figure beside each bound.
"""

import pytest
import torch

from chunkloss.kernels import fp8 as fp8_module
from chunkloss.kernels.attention_input import attention_input, attention_input_ref
from chunkloss.kernels.fp8 import (
    FP8,
    FP8_MAX,
    Float8Linear,
    Float8Weight,
    fp8_linear,
    fp8_linear_ref,
    fp8_refusal,
    quantize_rows,
    quantize_rows_ref,
    scaled_mm_refusal,
)
from chunkloss.kernels.frozen import FrozenWeight
from chunkloss.kernels.lora import lora_linear
from chunkloss.kernels.mlp import gated_mlp, gated_mlp_ref
from tests.kernels import test_lora as lora
from tests.kernels.test_lora import _attention, _lora_linear, _lora_linear_ref, _mlp, masks_drawn_in, run
from tests.tolerances import assert_close_to_ref, err

DTYPES, DTYPE_IDS = lora.DTYPES, lora.DTYPE_IDS


def _randn(*size, gen):
    """Normal samples from a CPU generator, on the default device (CUDA where tests/kernels/conftest.py sets
    it)."""
    return torch.randn(*size, generator=gen, device="cpu").to(torch.get_default_device())


def test_scaled_mm_takes_row_wise_scales_on_this_build():
    """What the kernels rely on: ``torch._scaled_mm`` with (M, 1) and (1, N) fp32 scales on e4m3 operands and
    a bias, bf16 output (fp32 and odd sizes too off CUDA, where the CPU build takes them); it equals the
    dequantised product."""
    g = torch.Generator().manual_seed(0)
    cuda = torch.get_default_device().type == "cuda"
    cases = [(16, 32, 48, torch.bfloat16)]
    if not cuda:
        cases += [(16, 32, 48, torch.float32), (5, 31, 23, torch.bfloat16), (5, 31, 23, torch.float32)]
    for m, k, n, dtype in cases:
        a, b, bias = _randn(m, k, gen=g), _randn(n, k, gen=g), _randn(n, gen=g)
        (aq, sa), (bq, sb) = quantize_rows(a), quantize_rows(b)
        exact = (aq.double() * sa.double()) @ (bq.double() * sb.double()).t() + bias.double()
        y = torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t(), bias=bias.to(dtype), out_dtype=dtype)
        atol = 1e-6 if dtype == torch.float32 else 8e-3  # fp32 accumulation; one bf16 rounding
        assert y.dtype == dtype and err(y, exact) <= atol, (m, k, n, dtype, err(y, exact))


def test_quantize_rows_by_hand():
    """Scale = row max / 448 (1 for a zero row); values exact in e4m3 come back exactly; 448 is the top."""
    w = torch.tensor([[448.0, -224.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0], [1.0, 2.0, -4.0, 0.25]])
    q, s = quantize_rows(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (3, 1)
    assert torch.equal(s.flatten(), torch.tensor([1.0, 1.0, 4.0 / FP8_MAX]))  # scales in fp32
    assert q[0].float().tolist() == [448.0, -224.0, 0.5, 3.0] and q[1].float().abs().sum() == 0
    assert q[2].float().tolist() == [112.0, 224.0, -448.0, 28.0]
    # 0.3 * 448 / 1 = 134.4 lies between e4m3's 128 and 144: round to nearest
    q, _ = quantize_rows(torch.tensor([[1.0, 0.3]]))
    assert q.float().tolist() == [[448.0, 128.0]]


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours and an fp32 ulp either side of each."""
    vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    return torch.cat([vals, mids, torch.nextafter(mids, up), torch.nextafter(mids, down)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_quantize_rows_kernel_equals_torch(dtype):
    """The Triton quantiser (the CUDA path of ``quantize_rows``; through the interpreter on CPU) gives
    ``quantize_rows_ref``'s bytes and scales bit for bit: rows longer than a block and of odd length, a
    strided input, the folded column scale of the input gradient, a zero row, every e4m3 value with the
    rounding midpoints and an fp32 ulp either side of them; a non-finite row gets a non-finite scale."""
    g = torch.Generator().manual_seed(0)
    k = 2500
    wide = torch.logspace(-6, 3, k).to(torch.get_default_device())
    t = (_randn(6, k, gen=g) * wide).to(dtype)
    t[3] = 0
    col = (torch.rand(1, k, generator=g, device="cpu") + 0.5).to(t.device)
    strided = _randn(k, 5, gen=g).to(dtype).t()
    cases = [(t, None), (t, col), (strided, None)]
    if dtype == torch.float32:
        grid = _e4m3_grid().to(t.device)
        cases.append((torch.stack([grid, -grid]), None))  # 448 in each row: scale 1
    for x, cs in cases:
        (q, s), (q_ref, s_ref) = fp8_module._quantize_rows_triton(x, cs), quantize_rows_ref(x, cs)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    bad = _randn(3, 40, gen=g).to(dtype)
    bad[1, 5], bad[2, 7] = float("nan"), float("inf")
    s = fp8_module._quantize_rows_triton(bad, None)[1].flatten()
    assert s[0].isfinite() and not s[1:].isfinite().any()


def test_float8_weight_storage_and_join():
    """One byte per weight and one fp32 scale per row; ``cat`` joins data and scales along the rows."""
    g = torch.Generator().manual_seed(1)
    w1, w2 = _randn(8, 16, gen=g), _randn(4, 16, gen=g) * 5
    f1, f2 = Float8Weight.quantize(w1.bfloat16()), Float8Weight.quantize(w2.bfloat16())
    assert f1.data.element_size() == 1 and f1.dtype == torch.bfloat16 and f1.shape == (8, 16)
    joined = Float8Weight.cat([f1, f2])
    assert torch.equal(joined.dequantize(), torch.cat([f1.dequantize(), f2.dequantize()]))
    assert Float8Weight.cat([f1, FrozenWeight(lambda: w1, (8, 16), torch.float32, w1.device)]) is None
    # Dequantised, the weight is within half an e4m3 step (2^-4 of the value's binade) of the original
    assert err(f1.to(torch.float32).dequantize(), w1.bfloat16().float()) <= 2**-4


def _with_fp8(fn, stored: dict):
    """``fn`` with the base weights named in ``stored`` replaced by their Float8Weight, computing in the dtype
    of the tensor the harness casts for that run (fp64 for the reference)."""

    def call(**kw):
        for name, fw in stored.items():
            kw[name] = fw.to(kw[name].dtype)
        return fn(**kw)

    return call


def check_fp8(ours, ref, base, adapters, dtypes, trainable, fp8_names, **kw):
    """Outputs and every gradient of ``ours`` against ``ref`` in fp64, the base weights ``fp8_names`` as one
    Float8Weight each; the reference run in ``dtypes`` sets the bar (module docstring)."""
    device = torch.get_default_device()
    stored = {k: Float8Weight.quantize(base[k].to(device)) for k in fp8_names}  # the base, quantised once
    ours, ref = _with_fp8(ours, stored), _with_fp8(ref, stored)
    probe, _ = run(ref, base, adapters, (torch.float64, torch.float64), None, (), **kw)
    g = torch.Generator().manual_seed(1)
    dys = [torch.randn(o.shape, generator=g, dtype=torch.float64, device="cpu") for o in probe]
    with masks_drawn_in(dtypes[1]):
        out_ref, g_ref = run(ref, base, adapters, (torch.float64,) * 2, dys, trainable, **kw)
    out_tch, g_tch = run(ref, base, adapters, dtypes, dys, trainable, **kw)
    out, grads = run(ours, base, adapters, dtypes, dys, trainable, **kw)
    row = dtypes[0]
    for i, (o, r) in enumerate(zip(out, out_ref, strict=True)):
        assert o.dtype == out_tch[i].dtype and o.shape == r.shape
        assert_close_to_ref(o, r, out_tch[i], f"out{i}", dtype=row)
    assert set(grads) == set(g_ref) and set(trainable) <= set(grads)
    for name in g_ref:
        assert grads[name].dtype == g_tch[name].dtype, name
        assert_close_to_ref(grads[name], g_ref[name], g_tch[name], f"d{name}", dtype=row)
    return out, grads


def _no_adapters(fn):
    def call(adapters, **kw):
        return fn(**kw)

    return call


@pytest.mark.parametrize("shape", [(3, 7, 31, 23), (1, 1, 16, 32), (2, 5, 64, 48)], ids=["odd", "one", "x16"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fp8_linear_matches_its_reference(dtype, bias, shape):
    """``fp8_linear`` (3-D input, odd and multiple-of-16 sizes, one token, bias on/off): output, dx, dbias."""
    b, t, in_f, out_f = shape
    g = torch.Generator().manual_seed(2)
    base = {"x": _randn(b, t, in_f, gen=g), "weight": _randn(out_f, in_f, gen=g)}
    if bias:
        base["bias"] = _randn(out_f, gen=g) * 0.3

    def ours(x, weight, bias=None):
        return fp8_linear(x, weight, bias)

    def ref(x, weight, bias=None):
        return fp8_linear_ref(x, weight, bias)

    trainable = {"x", "bias"} if bias else {"x"}
    check_fp8(_no_adapters(ours), _no_adapters(ref), base, [], (dtype, dtype), trainable, ["weight"])


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("rank,bias", [(16, False), (1, True)])
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_lora_linear_on_an_fp8_base(dtypes, rank, bias, dropout_p):
    """o_proj: the fp8 base with an adapter (bf16 or fp32, dropout or not); x's and the adapter's grads."""
    base, adapters = lora.linear_case(rank, bias, dropout_p)
    check_fp8(_lora_linear, _lora_linear_ref, base, adapters, dtypes, {"x"}, ["weight"])


# attention_input: (shape of tests/kernels/test_attention_input.py, rank, adapters on q/k/v, fp8 weights).
ATTN_FP8 = [
    (lora.attn.SHAPES[0], 16, (True, True, True), ("w_q", "w_k", "w_v")),  # joined: one GEMM each way
    (lora.attn.SHAPES[1], 1, (True, False, True), ("w_q", "w_v")),  # PEFT's default targets; k in bf16
]


@pytest.mark.parametrize("norm_recompute", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("case", ATTN_FP8, ids=["qkv-joined", "qv-fp8-k-plain-odd"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_attention_input_on_fp8_bases(dtypes, case, dropout_p, norm_recompute):
    """RMSNorm + q/k/v + RoPE on fp8 q/k/v (joined, or beside a plain k): x's, the norm weight's and the
    adapters' gradients."""
    shape, rank, present, names = case
    base, adapters, tables = lora.attention_case(shape, rank, present, dropout_p)
    check_fp8(
        _attention(attention_input, norm_recompute=norm_recompute),
        _attention(attention_input_ref),
        base,
        adapters,
        dtypes,
        {"x", "norm_weight"},
        names,
        tables=tables,
    )


# gated_mlp: (tokens, H, I, rank, adapters on gate/up/down, activation, bias, recompute, tile, dropout)
MLP_FP8 = {
    "recompute-odd": (37, 40, 45, 16, (True, True, True), "silu", True, True, None, 0.0),  # g, u replayed
    "recompute-odd-dropout": (37, 40, 45, 16, (True, True, True), "silu", True, True, None, 0.1),
    "saved": (32, 32, 48, 1, (False, True, True), "gelu_tanh", False, False, None, 0.0),  # g and u saved
    "saved-dropout": (32, 32, 48, 1, (False, True, True), "gelu_tanh", False, False, None, 0.1),
    # tiles of 8 tokens, the last of 5; no dropout (a tile draws its masks per tile, not in the reference's
    # order over all tokens)
    "tiles": (37, 40, 45, 4, (True, True, True), "silu", False, True, 8, 0.0),
}


@pytest.mark.parametrize("case", list(MLP_FP8))
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_gated_mlp_on_fp8_bases(dtypes, case):
    """gate/up/down in fp8 with adapters: recompute, saved pre-activations and tiles; x's and the adapters'
    gradients."""
    n, hidden, inter, rank, present, activation, bias, recompute, tile, dropout_p = MLP_FP8[case]
    base, adapters = lora.mlp_case(n, hidden, inter, rank, present, dropout_p)
    check_fp8(
        _mlp(gated_mlp, recompute=recompute, tile=tile),
        _mlp(gated_mlp_ref),
        base,
        adapters,
        dtypes,
        {"x"},
        ("w_gate", "w_up", "w_down"),
        activation=activation,
        bias_seed=4 if bias else None,
    )


def test_fp8_base_is_kept_not_copied():
    """The Functions keep the Float8Weight, never a dequantised or transposed copy: the saved bytes equal
    those saved for the same call on a frozen bf16 Parameter."""
    base, adapters = lora.mlp_case(*lora.MLP_CASES[0][:5], 0.0)
    names = ("w_gate", "w_up", "w_down")
    device = torch.get_default_device()
    x = base["x"].to(device, torch.bfloat16).requires_grad_()
    ads = tuple(
        lora.LoraAdapter(a.to(device, torch.bfloat16).requires_grad_(), b.to(device, torch.bfloat16), s)
        for a, b, s, _ in adapters
    )
    plain = [torch.nn.Parameter(base[k].to(device, torch.bfloat16), requires_grad=False) for k in names]
    fp8 = [Float8Weight.quantize(w.detach()) for w in plain]
    saved = lora.saved_bytes(lambda: gated_mlp(x, *plain, adapters=ads, recompute=True).sum().backward())
    saved_fp8 = lora.saved_bytes(lambda: gated_mlp(x, *fp8, adapters=ads, recompute=True).sum().backward())
    assert saved_fp8 == saved, (saved_fp8, saved)


def test_fallback_gemm_equals_scaled_mm(monkeypatch, caplog):
    """Where ``_scaled_mm`` cannot take the operands, the dequantised fp32 GEMM gives the same values (both
    accumulate the same products in fp32), and says so once."""
    g = torch.Generator().manual_seed(3)
    w = Float8Weight.quantize(_randn(32, 48, gen=g).bfloat16())  # sides of 16s: _scaled_mm on CUDA too
    x = _randn(9, 48, gen=g).bfloat16().requires_grad_()
    y = fp8_linear(x, w)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    monkeypatch.setattr(fp8_module, "scaled_mm_refusal", lambda *a: "refused here")
    with caplog.at_level("WARNING", logger="chunkloss.kernels"):
        y2 = fp8_linear(x, w)
        (dx2,) = torch.autograd.grad(y2, x, torch.ones_like(y2))
    lines = [r.getMessage() for r in caplog.records if r.name == "chunkloss.kernels"]
    assert lines == [
        "fp8 base: refused here; its GEMM runs on the dequantised operands in fp32 (same values)"
    ]
    assert_close_to_ref(y2, y, name="y", atol=4e-3)  # one bf16 rounding (2^-8 relative) apart at most
    assert_close_to_ref(dx2, dx, name="dx", atol=4e-3)


def test_scaled_mm_refusals_name_the_reason():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert scaled_mm_refusal(cpu, 31, 23, torch.bfloat16) is None
    assert "multiples of 16" in scaled_mm_refusal(cuda, 40, 24, torch.bfloat16)
    assert scaled_mm_refusal(cuda, 4096, 1024, torch.bfloat16) is None
    assert "fp32 output" in scaled_mm_refusal(cuda, 64, 64, torch.float32)
    assert "float64" in scaled_mm_refusal(cpu, 64, 64, torch.float64)


def test_bad_fp8_weights_raise_one_line_errors(monkeypatch):
    w = torch.randn(6, 8)
    for bad in (torch.randn(6), torch.ones(6, 8, dtype=torch.int32), w.to(FP8), [[1.0]]):
        with pytest.raises(TypeError, match=r"^Float8Weight.quantize: weight must be a 2-D floating-point"):
            Float8Weight.quantize(bad)
    nonfinite = w.clone()
    nonfinite[2, 3], nonfinite[4, 0] = float("inf"), float("nan")
    with pytest.raises(ValueError, match=r"^Float8Weight.quantize: the weight has 2 non-finite values"):
        Float8Weight.quantize(nonfinite)
    data, scale = quantize_rows(w)
    with pytest.raises(ValueError, match=r"scale must be a \(6, 1\) float32 tensor"):
        Float8Weight(data, scale[:3], torch.bfloat16)
    with pytest.raises(TypeError, match="data must be a 2-D torch.float8_e4m3fn"):
        Float8Weight(w, scale, torch.bfloat16)
    with pytest.raises(TypeError, match="fp8_linear: weight must be a Float8Weight"):
        fp8_linear(torch.randn(2, 8), w)
    # A device or build without fp8: one line, at quantisation and at construction.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fp8_refusal("cuda:0") == "CUDA compute capability 8.0 has no fp8 GEMM (8.9 or newer needed)"
    monkeypatch.setattr(fp8_module, "fp8_refusal", lambda device: "no fp8 here")
    for make in (lambda: Float8Weight.quantize(w), lambda: Float8Weight(data, scale, torch.bfloat16)):
        with pytest.raises(RuntimeError, match=r"^Float8Weight: no fp8 here$"):
            make()
    monkeypatch.undo()
    monkeypatch.setattr(fp8_module, "FP8", None)
    assert "has no float8_e4m3fn dtype" in fp8_refusal("cpu")


def test_float8_linear_module():
    """``Float8Linear``: uint8 bytes only (a dtype cast of the module passes them by), ``nn.Linear``'s forward
    in fp8 in the input's dtype, no dense ``weight``."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(40, 24, bias=True).bfloat16().requires_grad_(False)
    layer = Float8Linear.from_linear(linear)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in layer.named_buffers()} == {
        "weight_fp8": (torch.uint8, (24, 40)),
        "weight_scale": (torch.uint8, (24, 4)),
    }
    assert [n for n, _ in layer.named_parameters()] == ["bias"]
    x = torch.randn(3, 40).bfloat16()
    y = layer(x)
    assert torch.equal(y, fp8_linear(x, Float8Weight.quantize(linear.weight), linear.bias))
    layer.to(torch.float32)  # the bytes are left as they are; the bias becomes fp32
    assert torch.equal(
        layer.frozen_weight(torch.bfloat16).dequantize(), Float8Weight.quantize(linear.weight).dequantize()
    )
    assert layer(x.float()).dtype == torch.float32
    with pytest.raises(AttributeError, match="has no dense 'weight'"):
        layer.weight
    with pytest.raises(ValueError, match="requires grad"):
        Float8Linear.from_linear(torch.nn.Linear(4, 4))


# Accuracy against the unquantised layer: bf16 weights and activations at Llama-like scales (weights
# ~ N(0, 1/in), unit activations), 64 tokens, the fp64 unquantised layer as the yardstick of bf16's own error.
def _accuracy_case(fn: str):
    """x (64, in), the fp32 weights, the fused call and its fp64 reference on unquantised weights."""
    g = torch.Generator().manual_seed(5)
    if fn == "lora_linear":
        x = _randn(64, 256, gen=g)
        weights = [_randn(192, 256, gen=g) * 256**-0.5]
        return x, weights, lora_linear, torch.nn.functional.linear
    hidden, inter = 128, 352
    x = _randn(64, hidden, gen=g)
    weights = [_randn(inter, hidden, gen=g) * hidden**-0.5 for _ in range(2)]
    weights.append(_randn(hidden, inter, gen=g) * inter**-0.5)
    return x, weights, gated_mlp, gated_mlp_ref


def _output_and_dx(fn, x, weights, dy):
    x = x.to(dy.dtype).requires_grad_()
    y = fn(x, *weights)
    (dx,) = torch.autograd.grad(y, x, dy)
    return y, dx


# fn -> bounds on (output, dx) for the largest error (err) and the norm-wise one (_norm_err); measured beside.
ACCURACY_BOUNDS = {
    "lora_linear": ((0.05, 0.06), (0.05, 0.05)),  # measured err 0.031, 0.039; norm-wise 0.037, 0.036
    "gated_mlp": ((0.11, 0.10), (0.09, 0.09)),  # measured err 0.073, 0.063; norm-wise 0.064, 0.067
}


@pytest.mark.parametrize("fn", list(ACCURACY_BOUNDS))
def test_fp8_accuracy_against_the_unquantised_layer(fn):
    """fp8 against the same bf16 layer on its unquantised weights (torch 2.13, CPU; figures in
    ACCURACY_BOUNDS, bounds about 1.5 times them).

    e4m3 keeps 3 significand bits: rounding a normal sample to it has a norm-wise relative error of 0.026
    (measured on 10^6 values, one scale per row of 4096); x and W both rounded give about √2 times that,
    0.037, which lora_linear's output and dx show. In the MLP the gate and up errors pass through the gating
    into the down projection, which rounds its input and weight again: 0.064 to 0.067. The bf16 layer itself
    is within 0.01 of fp64 here."""
    x, weights, ours, ref = _accuracy_case(fn)
    dy = _randn(64, weights[-1].shape[0], gen=torch.Generator().manual_seed(6))
    y64, dx64 = _output_and_dx(ref, x, [w.double() for w in weights], dy.double())
    y16, dx16 = _output_and_dx(ours, x, [w.bfloat16() for w in weights], dy.bfloat16())
    y8, dx8 = _output_and_dx(ours, x, [Float8Weight.quantize(w.bfloat16()) for w in weights], dy.bfloat16())
    assert err(y16, y64) < 0.01 and err(dx16, dx64) < 0.01
    (out_max, dx_max), (out_norm, dx_norm) = ACCURACY_BOUNDS[fn]
    assert err(y8, y16) <= out_max and err(dx8, dx16) <= dx_max, (err(y8, y16), err(dx8, dx16))
    assert _norm_err(y8, y16) <= out_norm and _norm_err(dx8, dx16) <= dx_norm


def _norm_err(x, ref) -> float:
    """``‖x - ref‖ / ‖ref‖`` (Frobenius), the typical relative error where ``err`` is the largest."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()
