"""LoRA adapters inside the fused projections vs PEFT's math in fp64: outputs, every gradient, the GEMMs run.

Three-way check (tests/tolerances.py): ``err(ours) <= K * err(torch in the same dtypes) + atol`` against the
fp64 reference. The reference is the ``*_ref`` function (PEFT's ``lora.Linear.forward`` op for op) on fp64
copies of the inputs; "torch in the same dtypes" is that function on the dtypes under test. Dropout masks are
the same in all three runs: each starts from one seed and draws them as PEFT does, in the same order. CPU
runs go through TRITON_INTERPRET=1, whose truncating bf16 stores (tests/tolerances.py) make the attention
input's bf16 adapter gradients the closest to their bound, as its base weight gradients are.
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chunkloss.kernels import FrozenWeight, LoraAdapter, lora_linear, lora_linear_ref
from chunkloss.kernels.attention_input import attention_input, attention_input_ref
from chunkloss.kernels.mlp import gated_mlp, gated_mlp_ref
from tests.kernels import test_attention_input as attn
from tests.kernels.compiled import compiled_matches_eager, in_fresh_process
from tests.tolerances import assert_close_to_ref

# (base dtype, adapter dtype): fp32; bf16; PEFT's default for a bf16 model, fp32 adapters on a bf16 base.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
DTYPE_IDS = ["fp32", "bf16", "bf16-base-fp32-adapters"]
SEED = 7  # every run of one comparison draws its dropout masks from this seed


def adapter_masters(in_features, out_features, rank, scaling, dropout_p, gen):
    """fp32 (a, b, scaling, p); b is nonzero (PEFT starts it at zero, which would hide a's gradient path)."""
    a = torch.randn(rank, in_features, generator=gen, device="cpu") * in_features**-0.5
    b = torch.randn(out_features, rank, generator=gen, device="cpu") * rank**-0.5
    return a, b, scaling, dropout_p


def run(fn, base, adapters, dtypes, dys, trainable, device=None, cast_before_add=False, **kw):
    """Outputs and the gradients of every leaf that requires grad, of ``fn(**base, adapters=...)``.

    ``base``: fp32 masters of the base tensors, cast to ``dtypes[0]`` (those named in ``trainable`` require
    grad); ``adapters``: per projection ``(a, b, scaling, p)`` masters or None, cast to ``dtypes[1]``, built
    with ``cast_before_add``; ``dys``: the upstream gradients, or None for the outputs alone.
    """
    base_dtype, adapter_dtype = dtypes
    device = device or torch.get_default_device()  # CUDA where tests/kernels/conftest.py makes it the default
    leaves = {k: v.to(device, base_dtype).requires_grad_(k in trainable) for k, v in base.items()}
    built = []
    for i, spec in enumerate(adapters):
        if spec is None:
            built.append(None)
            continue
        a, b, scaling, p = spec
        leaves[f"a{i}"] = a.to(device=device, dtype=adapter_dtype).requires_grad_(True)
        leaves[f"b{i}"] = b.to(device=device, dtype=adapter_dtype).requires_grad_(True)
        built.append(LoraAdapter(leaves[f"a{i}"], leaves[f"b{i}"], scaling, p, cast_before_add))
    torch.manual_seed(SEED)
    outs = fn(**leaves_by_role(leaves), adapters=tuple(built), **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if dys is None:
        return outs, None
    wrt = {k: v for k, v in leaves.items() if v.requires_grad}
    upstream = [d.to(device, o.dtype) for d, o in zip(dys, outs, strict=True)]
    grads = torch.autograd.grad(outs, list(wrt.values()), upstream)
    return outs, dict(zip(wrt, grads, strict=True))


def leaves_by_role(leaves):
    return {k: v for k, v in leaves.items() if not (k[0] in "ab" and k[1:].isdigit())}


@contextlib.contextmanager
def masks_drawn_in(dtype):
    """``torch.native_dropout`` draws its mask on a tensor of ``dtype``: CUDA's kernel spends its random
    numbers by vector width, so the fp64 reference takes the masks of the run in ``dtype`` this way."""
    real = torch.native_dropout

    def native_dropout(x, p, train):
        mask = real(x.to(dtype), p, train)[1]
        return torch.ops.aten.native_dropout_backward(x, mask, 1.0 / (1.0 - p)), mask

    torch.native_dropout = native_dropout
    try:
        yield
    finally:
        torch.native_dropout = real


def check_three_way(ours, ref, base, adapters, dtypes, trainable, device=None, mask_dtype=None, **kw):
    """Outputs and every gradient of ``ours`` against ``ref`` in fp64; ``ref`` in ``dtypes`` sets the bar.
    The fp64 reference draws its dropout masks on ``mask_dtype`` (default: the adapters' dtype)."""
    probe, _ = run(ref, base, adapters, (torch.float64, torch.float64), None, (), device, **kw)
    g = torch.Generator().manual_seed(1)
    dys = [torch.randn(o.shape, generator=g, dtype=torch.float64, device="cpu") for o in probe]
    with masks_drawn_in(mask_dtype or dtypes[1]):  # PEFT drops the input cast to the adapters' dtype
        out_ref, g_ref = run(ref, base, adapters, (torch.float64,) * 2, dys, trainable, device, **kw)
    out_tch, g_tch = run(ref, base, adapters, dtypes, dys, trainable, device, **kw)
    out, grads = run(ours, base, adapters, dtypes, dys, trainable, device, **kw)
    # The bf16 row of the table for everything computed from bf16 activations, fp32 adapters' gradients too.
    row = dtypes[0]
    same = None if row == torch.float32 and dtypes[1] == torch.float32 else out_tch
    for i, (o, r) in enumerate(zip(out, out_ref, strict=True)):
        assert o.dtype == out_tch[i].dtype and o.shape == r.shape
        assert_close_to_ref(o, r, None if same is None else same[i], f"out{i}", dtype=row)
    assert set(grads) == set(g_ref)
    for name in g_ref:
        assert grads[name].dtype == g_tch[name].dtype, name
        assert_close_to_ref(
            grads[name], g_ref[name], None if same is None else g_tch[name], f"d{name}", dtype=row
        )


def _randn(*size, gen):
    return torch.randn(*size, generator=gen, device="cpu")


def linear_case(rank, bias, p, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    in_f, out_f = 31, 23
    base = {"x": _randn(3, 7, in_f, gen=gen), "weight": _randn(out_f, in_f, gen=gen) * in_f**-0.5}
    if bias:
        base["bias"] = _randn(out_f, gen=gen) * 0.3
    return base, [adapter_masters(in_f, out_f, rank, 2.0, p, gen)]


def _lora_linear(x, weight, bias=None, adapters=(None,), ref=False):
    return (lora_linear_ref if ref else lora_linear)(x, weight, bias, adapters[0])


def _lora_linear_ref(**kw):
    return _lora_linear(**kw, ref=True)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("rank,bias", [(1, True), (16, False)])
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_lora_linear_matches_peft_math(dtypes, rank, bias, dropout_p):
    base, adapters = linear_case(rank, bias, dropout_p)
    check_three_way(_lora_linear, _lora_linear_ref, base, adapters, dtypes, trainable={"x"})


@pytest.mark.parametrize("dtypes", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_lora_linear_trainable_base(dtypes):
    """A base that requires grad gets its weight and bias gradients beside the adapter's."""
    base, adapters = linear_case(4, True, 0.1)
    check_three_way(_lora_linear, _lora_linear_ref, base, adapters, dtypes, trainable={"x", "weight", "bias"})


# attention_input: (shape as tests/kernels/test_attention_input.py, rank, which of q/k/v get an adapter).
# All three at rank 16, the k/v width; PEFT's default targets (q and v) at rank 1 on the odd shape with a
# single kv head.
ATTN_CASES = [(attn.SHAPES[0], 16, (True, True, True)), (attn.SHAPES[1], 1, (True, False, True))]


def attention_case(shape, rank, present, p):
    tensors, cos, sin, head_dim = attn.make_inputs(shape, bias=False)
    gen = torch.Generator().manual_seed(2)
    hidden = shape[2]
    # k's adapter has no dropout: adapters with and without one side by side
    adapters = []
    for i, (w, on) in enumerate(zip(("w_q", "w_k", "w_v"), present, strict=True)):
        spec = adapter_masters(hidden, tensors[w].shape[0], rank, 2.0 / (i + 1), 0.0 if i == 1 else p, gen)
        adapters.append(spec if on else None)
    return tensors, adapters, {"cos": cos, "sin": sin, "head_dim": head_dim}


def _tables(tables, dtype):
    return {"cos": tables["cos"].to(dtype), "sin": tables["sin"].to(dtype), "head_dim": tables["head_dim"]}


def _attention(fn, **fixed):
    def call(x, norm_weight, w_q, w_k, w_v, adapters, tables):
        t = _tables(tables, x.dtype)
        return fn(
            x,
            norm_weight,
            w_q,
            w_k,
            w_v,
            t["cos"],
            t["sin"],
            head_dim=t["head_dim"],
            adapters=adapters,
            **fixed,
        )

    return call


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("case", ATTN_CASES, ids=["qkv-r16", "qv-r1-odd"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_attention_input_matches_peft_math(dtypes, case, dropout_p):
    base, adapters, tables = attention_case(*case, dropout_p)
    check_three_way(
        _attention(attention_input),
        _attention(attention_input_ref),
        base,
        adapters,
        dtypes,
        trainable={"x"},
        tables=tables,
    )


@pytest.mark.parametrize("norm_recompute", [False, True])
def test_attention_input_trainable_norm_and_base(norm_recompute):
    """Norm weight and projection weights that require grad get theirs, with the norm recomputed or kept."""
    base, adapters, tables = attention_case(*ATTN_CASES[0], 0.1)
    ours = _attention(attention_input, norm_recompute=norm_recompute)
    check_three_way(
        ours,
        _attention(attention_input_ref),
        base,
        adapters,
        (torch.float32, torch.float32),
        trainable={"x", "norm_weight", "w_k"},
        tables=tables,
    )


# gated_mlp: (tokens, H, I, rank, which of gate/up/down get an adapter, activation, bias, recompute).
MLP_CASES = [
    (37, 40, 45, 16, (True, True, True), "silu", True, True),  # odd sizes, every projection, h replayed
    (32, 32, 48, 1, (False, True, True), "gelu_tanh", False, False),  # g and u saved, no gate adapter
]


def mlp_case(n, hidden, inter, rank, present, p):
    gen = torch.Generator().manual_seed(3)
    base = {
        "x": _randn(n, hidden, gen=gen),
        "w_gate": _randn(inter, hidden, gen=gen) * hidden**-0.5,
        "w_up": _randn(inter, hidden, gen=gen) * hidden**-0.5,
        "w_down": _randn(hidden, inter, gen=gen) * inter**-0.5,
    }
    sides = ((hidden, inter), (hidden, inter), (inter, hidden))
    adapters = [
        adapter_masters(i, o, rank, 1.5, p, gen) if on else None
        for (i, o), on in zip(sides, present, strict=True)
    ]
    return base, adapters


def _mlp(fn, **fixed):
    def call(x, w_gate, w_up, w_down, adapters, bias_seed=None, **kw):
        biases = {}
        if bias_seed is not None:  # biases in the base dtype, from a fixed generator
            gen = torch.Generator().manual_seed(bias_seed)
            sizes = (("b_gate", w_gate.shape[0]), ("b_up", w_up.shape[0]), ("b_down", w_down.shape[0]))
            for name, size in sizes:
                biases[name] = (_randn(size, gen=gen) * 0.3).to(device=x.device, dtype=x.dtype)
        return fn(x, w_gate, w_up, w_down, adapters=adapters, **biases, **fixed, **kw)

    return call


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("case", MLP_CASES, ids=["all-r16-odd", "up-down-r1-saved"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_gated_mlp_matches_peft_math(dtypes, case, dropout_p):
    n, hidden, inter, rank, present, activation, bias, recompute = case
    base, adapters = mlp_case(n, hidden, inter, rank, present, dropout_p)
    check_three_way(
        _mlp(gated_mlp, recompute=recompute),
        _mlp(gated_mlp_ref),
        base,
        adapters,
        dtypes,
        trainable={"x"},
        activation=activation,
        bias_seed=4 if bias else None,
    )


def test_gated_mlp_trainable_base():
    base, adapters = mlp_case(*MLP_CASES[0][:5], 0.1)
    check_three_way(
        _mlp(gated_mlp),
        _mlp(gated_mlp_ref),
        base,
        adapters,
        (torch.float32, torch.float32),
        trainable={"x", "w_gate", "w_down"},
    )


# A rank above a projection's smaller side (PEFT accepts one; the update is then of rank min(in, out) at
# most, the adapter's products keep their shapes): fn -> (rank, the base tensors that require grad).
# lora_linear: 40 > 31 x 23; attention_input on SHAPES[0]: 24 > k and v's 16 (q's 32 x 48 keeps a rank
# below its sides, in the same shared GEMM); gated_mlp on MLP_CASES[0]: 48 > gate and up's 45 x 40 and
# down's 40 x 45.
RANK_ABOVE = {
    "lora_linear": (40, {"x", "weight", "bias"}),
    "attention_input": (24, {"x", "norm_weight", "w_q", "w_k", "w_v"}),
    "gated_mlp": (48, {"x", "w_gate", "w_up", "w_down"}),
}


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("fn", list(RANK_ABOVE))
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_rank_above_the_smaller_side(dtypes, fn, dropout_p):
    """Outputs and every gradient (input, base weights, norm weight and adapters) at a rank above the
    projections' smaller side, with and without dropout (the shared GEMM and one per adapter)."""
    rank, trainable = RANK_ABOVE[fn]
    if fn == "lora_linear":
        base, adapters = linear_case(rank, True, dropout_p)
        ours, ref, kw = _lora_linear, _lora_linear_ref, {}
    elif fn == "attention_input":
        base, adapters, tables = attention_case(attn.SHAPES[0], rank, (True, True, True), dropout_p)
        ours, ref, kw = _attention(attention_input), _attention(attention_input_ref), {"tables": tables}
    else:
        n, hidden, inter, _, present, activation, _, recompute = MLP_CASES[0]
        base, adapters = mlp_case(n, hidden, inter, rank, present, dropout_p)
        ours, ref = _mlp(gated_mlp, recompute=recompute), _mlp(gated_mlp_ref)
        kw = {"activation": activation, "bias_seed": 4}
    sides = [(spec[0].shape[1], spec[1].shape[0]) for spec in adapters if spec is not None]
    assert any(rank > min(side) for side in sides), sides
    check_three_way(ours, ref, base, adapters, dtypes, trainable=trainable, **kw)


@pytest.mark.parametrize("fn", ["lora_linear", "gated_mlp", "attention_input"])
def test_bf16_base_fp32_adapters_under_autocast(fn):
    """Under bf16 autocast PEFT's lora_A/lora_B run in bf16 on fp32 adapters; the gradients come back fp32."""
    if fn == "lora_linear":
        base, adapters = linear_case(8, True, 0.1)
        ours, ref, kw = _lora_linear, _lora_linear_ref, {}
    elif fn == "gated_mlp":
        base, adapters = mlp_case(*MLP_CASES[0][:5], 0.1)
        ours, ref, kw = _mlp(gated_mlp), _mlp(gated_mlp_ref), {}
    else:
        base, adapters, tables = attention_case(*ATTN_CASES[0], 0.1)
        ours, ref, kw = _attention(attention_input), _attention(attention_input_ref), {"tables": tables}

    def autocast(fn):
        def call(**args):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(**args)

        return call

    check_three_way(
        autocast(ours), autocast(ref), base, adapters, (torch.bfloat16, torch.float32), trainable={"x"}, **kw
    )


class _GemmShapes(TorchDispatchMode):
    """The output shapes of the matrix products run while it is active."""

    OPS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm}

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.OPS:
            self.shapes.append(tuple(out.shape))
        return out


def _backward_gemms(fn, base, adapters, trainable, **kw):
    """Output shapes of the backward's matrix products."""
    outs, _ = run(fn, base, adapters, (torch.float32, torch.float32), None, trainable, **kw)
    loss = sum(o.float().square().sum() for o in outs)
    with _GemmShapes() as mode:
        loss.backward()
    return mode.shapes


@pytest.mark.parametrize("fn", ["lora_linear", "gated_mlp", "attention_input"])
def test_frozen_base_runs_no_weight_gradient_gemm(fn):
    """With the base frozen no product of a base weight's shape runs; with it trainable, exactly one does."""
    if fn == "lora_linear":
        base, adapters = linear_case(4, False, 0.0)
        ours, kw, weights = _lora_linear, {}, {"weight": (23, 31)}
    elif fn == "gated_mlp":
        base, adapters = mlp_case(*MLP_CASES[0][:5], 0.0)
        ours, kw, weights = _mlp(gated_mlp), {}, {"w_gate": (45, 40), "w_down": (40, 45)}
    else:
        base, adapters, tables = attention_case(*ATTN_CASES[0], 0.0)
        ours, kw = _attention(attention_input), {"tables": tables}
        weights = {"w_q": (64, 48)}  # one GEMM for the concatenated [Wq; Wk; Wv]
    frozen = _backward_gemms(ours, base, adapters, {"x"}, **kw)
    assert frozen and not set(weights.values()) & set(frozen), frozen
    trained = _backward_gemms(ours, base, adapters, {"x", *weights}, **kw)
    for shape in weights.values():
        assert trained.count(shape) == 1, trained
    assert len(trained) == len(frozen) + len(weights)


def test_adapters_share_one_gemm_without_dropout():
    """q, k and v adapters without dropout: one down-product GEMM in the forward, one for the three dA."""
    base, adapters, tables = attention_case(*ATTN_CASES[0], 0.0)
    hidden, rank = attn.SHAPES[0][2], ATTN_CASES[0][1]
    with _GemmShapes() as mode:
        run(
            _attention(attention_input),
            base,
            adapters,
            (torch.float32, torch.float32),
            None,
            {"x"},
            tables=tables,
        )
    n = attn.SHAPES[0][0] * attn.SHAPES[0][1]
    assert mode.shapes.count((n, 3 * rank)) == 1, mode.shapes
    shapes = _backward_gemms(_attention(attention_input), base, adapters, {"x"}, tables=tables)
    assert shapes.count((3 * rank, hidden)) == 1 and (rank, hidden) not in shapes, shapes


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs, parameters excluded."""
    storages = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_gated_mlp_saves_the_input_the_small_products_and_the_masks(dropout_p):
    """Recompute mode keeps x (N, H); with dropout also each adapter's t (N, r) and its bool mask (without,
    the backward computes the t's again from x)."""
    n, hidden, inter, rank = 19, 24, 40, 4
    gen = torch.Generator().manual_seed(0)
    device = torch.get_default_device()

    def param(*size):
        return torch.nn.Parameter(_randn(*size, gen=gen).to(device))

    params = [param(*s) for s in ((inter, hidden),) * 2 + ((hidden, inter),)]
    adapters = tuple(
        LoraAdapter(param(rank, i), param(o, rank), 2.0, dropout_p)
        for i, o in ((hidden, inter), (hidden, inter), (inter, hidden))
    )
    x = torch.randn(n, hidden, requires_grad=True)
    saved = saved_bytes(lambda: gated_mlp(x, *params, adapters=adapters))
    small = 4 * (n * 2 * rank + n * rank) + n * (2 * hidden + inter) if dropout_p else 0
    assert saved == 4 * n * hidden + small


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_hand_computed_case(dropout_p):
    """y = x·Wᵀ + s·(xd·Aᵀ)·Bᵀ and its gradients written out for x = (1, 2), W = I, A = (1 1), B = (1 -1)ᵀ,
    s = 0.5, dy = (1, 0); with dropout, xd = 2·mask ⊙ x for the mask the seed draws."""
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    a = torch.tensor([[1.0, 1.0]], requires_grad=True)
    b = torch.tensor([[1.0], [-1.0]], requires_grad=True)
    torch.manual_seed(SEED)
    keep = torch.ones(1, 2) if dropout_p == 0 else torch.native_dropout(x, dropout_p, True)[1].float()
    xd = x.detach() * keep / (1 - dropout_p)
    t = xd.sum()  # xd·Aᵀ
    torch.manual_seed(SEED)
    y = lora_linear(x, torch.eye(2), None, LoraAdapter(a, b, 0.5, dropout_p))
    torch.testing.assert_close(y, torch.tensor([[1.0 + 0.5 * t, 2.0 - 0.5 * t]]), rtol=0, atol=0)
    y.backward(torch.tensor([[1.0, 0.0]]))
    # dt = s·dy·B = 0.5; dA = dt·xd; dB = s·dyᵀ·t; dx = dy·W + mask/(1 - p) ⊙ (dt·A)
    torch.testing.assert_close(a.grad, 0.5 * xd, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, torch.tensor([[0.5 * t], [0.0]]), rtol=0, atol=0)
    dx = torch.tensor([[1.0, 0.0]]) + 0.5 * keep / (1 - dropout_p)
    torch.testing.assert_close(x.grad, dx, rtol=0, atol=0)


def test_no_adapters_is_the_plain_function():
    base, _ = linear_case(4, True, 0.0)
    y = lora_linear(base["x"], base["weight"], base["bias"])
    assert torch.equal(y, torch.nn.functional.linear(base["x"], base["weight"], base["bias"]))
    base, adapters, tables = attention_case(*ATTN_CASES[0], 0.0)
    call = _attention(attention_input)
    outs = [call(**base, adapters=a, tables=tables) for a in (None, (None, None, None))]
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def _adapter(in_f, out_f, rank, dtype=torch.float32, **kw):
    return LoraAdapter(torch.zeros(rank, in_f, dtype=dtype), torch.zeros(out_f, rank, dtype=dtype), 1.0, **kw)


def test_bad_adapters_raise_one_line_errors():
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="lora_linear: the weight adapter: rank must be at least 1, got 0"):
        lora_linear(x, w, adapter=_adapter(8, 6, 0))
    with pytest.raises(ValueError, match=r"a must be \(r, 8\) and b \(6, r\)"):
        lora_linear(x, w, adapter=_adapter(6, 8, 2))
    with pytest.raises(TypeError, match="a and b must share a floating-point dtype"):
        lora_linear(x, w, adapter=LoraAdapter(torch.zeros(2, 8), torch.zeros(6, 2).bfloat16(), 1.0))
    with pytest.raises(ValueError, match="on the input's device"):
        meta = LoraAdapter(torch.zeros(2, 8, device="meta"), torch.zeros(6, 2, device="meta"), 1.0)
        lora_linear(x, w, adapter=meta)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        lora_linear(x, w, adapter=_adapter(8, 6, 2, dropout_p=1.0))
    with pytest.raises(TypeError, match="must be a LoraAdapter or None"):
        lora_linear(x, w, adapter=(torch.zeros(2, 8), torch.zeros(6, 2)))
    base, _, tables = attention_case(*ATTN_CASES[0], 0.0)
    call = _attention(attention_input)
    with pytest.raises(ValueError, match="attention_input: the k adapter: a must be"):
        call(**base, adapters=(None, _adapter(48, 32, 2), None), tables=tables)
    with pytest.raises(TypeError, match="the adapters of q, k, v must share a dtype"):
        call(**base, adapters=(_adapter(48, 32, 2), None, _adapter(48, 16, 2, torch.bfloat16)), tables=tables)
    with pytest.raises(ValueError, match="adapters must be a tuple of 3"):
        call(**base, adapters=(_adapter(48, 32, 2),), tables=tables)
    mlp_base, _ = mlp_case(5, 8, 12, 1, (False,) * 3, 0.0)
    with pytest.raises(ValueError, match="gated_mlp: the down adapter: rank must be at least 1"):
        gated_mlp(*mlp_base.values(), adapters=(None, None, _adapter(12, 8, 0)))
    with pytest.raises(ValueError, match="gated_mlp: adapters must be a tuple of 3"):
        gated_mlp(*mlp_base.values(), adapters=(None, None))


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", DTYPES[1:], ids=DTYPE_IDS[1:])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_real_widths_gpu(dtypes, dropout_p):
    """Llama-3.2-1B's widths (H = 2048, 32/8 heads of 64, I = 8192), r = 16, on 2 sequences of 1031 tokens."""
    shape = (2, 1031, 2048, 32, 8, 64, 64)
    base, adapters, tables = attention_case(shape, 16, (True, True, True), dropout_p)
    tables = {k: v.cuda() if torch.is_tensor(v) else v for k, v in tables.items()}
    check_three_way(
        _attention(attention_input),
        _attention(attention_input_ref),
        base,
        adapters,
        dtypes,
        trainable={"x"},
        device="cuda",
        tables=tables,
    )
    base, adapters = mlp_case(2062, 2048, 8192, 16, (True, True, True), dropout_p)
    check_three_way(
        _mlp(gated_mlp), _mlp(gated_mlp_ref), base, adapters, dtypes, trainable={"x"}, device="cuda"
    )
    base, adapters = linear_case(16, False, dropout_p)
    check_three_way(_lora_linear, _lora_linear_ref, base, adapters, dtypes, trainable={"x"}, device="cuda")


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("fn", ["lora_linear", "gated_mlp", "attention_input"])
@in_fresh_process
def test_compiles_without_graph_breaks(fn, dropout_p):
    """torch.compile of a call with adapters runs as one graph, forward and backward, with eager's results
    (compared without dropout: compiled code draws its dropout masks from other random numbers)."""
    if fn == "lora_linear":
        base, specs = linear_case(4, True, dropout_p)
        call = _lora_linear
    elif fn == "gated_mlp":
        base, specs = mlp_case(*MLP_CASES[0][:4], (True, False, True), dropout_p)
        call = _mlp(gated_mlp)
    else:
        base, specs, tables = attention_case(*ATTN_CASES[1], dropout_p)
        call = _attention(attention_input, norm_recompute=True)
    device = torch.get_default_device()
    names = list(base)
    adapters = [
        None if s is None else (s[0].to(device).requires_grad_(), s[1].to(device).requires_grad_(), *s[2:])
        for s in specs
    ]
    leaves = [base[k].to(device).requires_grad_(k == "x") for k in names]
    extra = {"tables": tables} if fn == "attention_input" else {}

    def model(*tensors):
        it = iter(tensors[len(names) :])
        built = tuple(None if s is None else LoraAdapter(next(it), next(it), s[2], s[3]) for s in adapters)
        return call(**dict(zip(names, tensors[: len(names)], strict=True)), adapters=built, **extra)

    flat = [t for s in adapters if s is not None for t in s[:2]]
    compiled_matches_eager(model, [*leaves, *flat], values=dropout_p == 0)


# QLoRA: a frozen base given as a FrozenWeight (chunkloss/kernels/frozen.py), loaded for each GEMM and never
# saved.
# fn -> (the base weights given as FrozenWeight, loads in the forward, loads in the backward)
FROZEN = {
    "lora_linear": (("weight",), 1, 1),
    "gated_mlp": (("w_gate", "w_up", "w_down"), 3, 3),  # backward: dh, then dx = dg·Wg + du·Wu
    "gated_mlp-recompute": (("w_gate", "w_up", "w_down"), 3, 5),  # and the replay of g and u
    "attention_input": (("w_q", "w_k", "w_v"), 3, 3),  # one stacked [Wq; Wk; Wv] each way
}


def _frozen_case(fn, p):
    if fn == "lora_linear":
        base, adapters = linear_case(4, True, p)
        return base, adapters, _lora_linear, {}
    if fn.startswith("gated_mlp"):
        base, adapters = mlp_case(*MLP_CASES[0][:5], p)
        return base, adapters, _mlp(gated_mlp, recompute=fn.endswith("recompute")), {}
    base, adapters, tables = attention_case(*ATTN_CASES[0], p)
    return base, adapters, _attention(attention_input), {"tables": tables}


def _frozen_run(fn, as_frozen: bool):
    """Outputs, gradients (of x and the adapters), the loads per pass and the bytes saved for the backward,
    with the base weights as frozen Parameters or as FrozenWeights loading copies of them."""
    base, specs, call, kw = _frozen_case(fn, 0.1)
    names, _, _ = FROZEN[fn]
    device = torch.get_default_device()
    loads = []

    def frozen(w):
        def load():
            loads.append(tuple(w.shape))
            return w.clone()

        return FrozenWeight(load, tuple(w.shape), w.dtype, w.device)

    args = {k: torch.nn.Parameter(v.to(device), requires_grad=k == "x") for k, v in base.items()}
    x = args["x"]
    if as_frozen:
        args.update({k: frozen(args[k].detach()) for k in names})
    leaves = [(s[0].to(device).requires_grad_(), s[1].to(device).requires_grad_()) for s in specs]
    adapters = tuple(LoraAdapter(a, b, s[2], s[3]) for (a, b), s in zip(leaves, specs, strict=True))
    outs = []

    def forward():
        torch.manual_seed(SEED)
        out = call(**args, adapters=adapters, **kw)
        outs.extend(out if isinstance(out, tuple) else (out,))

    saved = saved_bytes(forward)
    n_forward = len(loads)
    wrt = [x, *(t for pair in leaves for t in pair)]
    grads = torch.autograd.grad([o.float().square().sum() for o in outs], wrt)
    return outs, grads, (n_forward, len(loads) - n_forward), saved


@pytest.mark.parametrize("fn", list(FROZEN))
def test_frozen_weight_is_loaded_per_gemm_and_never_saved(fn):
    """A base weight given as a FrozenWeight: the outputs and gradients of the same call on the tensor it
    loads, bit for bit; loaded right before each GEMM that reads it (forward; the backward's dx or dh, and the
    replay); the backward keeps none of the loaded weights (it saves what it saves for a frozen Parameter)."""
    outs, grads, _, saved = _frozen_run(fn, as_frozen=False)
    outs_f, grads_f, loads, saved_f = _frozen_run(fn, as_frozen=True)
    for a, b in zip((*outs, *grads), (*outs_f, *grads_f), strict=True):
        assert torch.equal(a, b)
    assert loads == FROZEN[fn][1:], loads
    assert saved_f == saved, (saved_f, saved)


def test_frozen_weight_without_adapters_runs_the_function():
    """No adapter (PEFT's disabled adapters, DPO's reference): a FrozenWeight still goes through lora_linear's
    Function, which keeps only what the input gradient needs."""
    base, _ = linear_case(4, True, 0.0)
    w = base["weight"].to(torch.get_default_device())
    frozen = FrozenWeight(w.clone, tuple(w.shape), w.dtype, w.device)
    x = base["x"].to(w.device).requires_grad_()
    saved = saved_bytes(lambda: lora_linear(x, frozen, None).sum().backward())
    assert saved == 0 and x.grad is not None
    torch.testing.assert_close(x.grad, torch.ones(3, 7, w.shape[0], device=w.device) @ w, rtol=0, atol=0)


@pytest.mark.parametrize("fn", ["lora_linear", "gated_mlp", "attention_input"])
def test_cast_before_add_matches_pefts_4bit_math(fn):
    """PEFT's Linear4bit casts the update to the base's dtype before adding it: fp32 adapters on a bf16 base,
    with dropout, against the fp64 reference of that order."""
    base, adapters, ours, kw = _frozen_case(fn, 0.1)
    ref = {
        "lora_linear": _lora_linear_ref,
        "gated_mlp": _mlp(gated_mlp_ref),
        "attention_input": _attention(attention_input_ref),
    }[fn]
    check_three_way(
        ours,
        ref,
        base,
        adapters,
        (torch.bfloat16, torch.float32),
        trainable={"x"},
        cast_before_add=True,
        **kw,
    )


def test_cast_before_add_is_pefts_op_order():
    """lora_linear's forward with cast_before_add runs lora_linear_ref's ops (PEFT's Linear4bit) bit for bit:
    fp32 adapters on a bf16 base, where adding before or after the cast rounds differently."""
    base, specs = linear_case(4, True, 0.0)
    device = torch.get_default_device()
    x, w, bias = (base[k].to(device, torch.bfloat16) for k in ("x", "weight", "bias"))
    a, b, s, _ = specs[0]

    def adapter(cast):
        return LoraAdapter(a.to(device), b.to(device), s, cast_before_add=cast)

    y = lora_linear(x, w, bias, adapter(True))
    assert torch.equal(y, lora_linear_ref(x, w, bias, adapter(True)))
    assert not torch.equal(y, lora_linear_ref(x, w, bias, adapter(False)))


def test_bad_frozen_weights_raise_one_line_errors():
    x = torch.randn(2, 8)
    packed = torch.zeros(24, 1, dtype=torch.uint8)  # a 4-bit weight's storage (Params4bit), not its values
    with pytest.raises(
        TypeError,
        match=r"lora_linear: weight must be a floating-point tensor or a "
        r"FrozenWeight, got torch.uint8 \(a packed quantised weight",
    ):
        lora_linear(x, packed)
    wrong = FrozenWeight(lambda: torch.zeros(8, 6), (6, 8), torch.float32, x.device)
    with pytest.raises(
        ValueError,
        match=r"load\(\) must return a \(6, 8\) torch.float32 tensor, got "
        r"\(8, 6\) ",
    ):
        lora_linear(x, wrong)
    with pytest.raises(ValueError, match=r"shape must be \(out, in\)"):
        FrozenWeight(lambda: torch.zeros(6), (6,), torch.float32, x.device)
    mlp_base, _ = mlp_case(5, 8, 12, 1, (False,) * 3, 0.0)
    with pytest.raises(TypeError, match="gated_mlp: w_up must be a floating-point tensor"):
        gated_mlp(mlp_base["x"], mlp_base["w_gate"], packed, mlp_base["w_down"])


@pytest.mark.gpu
@pytest.mark.parametrize("fn", ["lora_linear", "gated_mlp", "attention_input"])
def test_cast_before_add_under_cuda_autocast_gpu(fn):
    """Under CUDA's autocast PEFT's Linear4bit casts nothing: dropout draws its masks on the bf16 input (CUDA
    spends its random numbers by vector width, so masks drawn on an fp32 copy would be other masks)."""
    base, adapters, ours, kw = _frozen_case(fn, 0.1)
    ref = {
        "lora_linear": _lora_linear_ref,
        "gated_mlp": _mlp(gated_mlp_ref),
        "attention_input": _attention(attention_input_ref),
    }[fn]

    def autocast(fn):
        def call(**args):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(**args)

        return call

    check_three_way(
        autocast(ours),
        autocast(ref),
        base,
        adapters,
        (torch.bfloat16, torch.float32),
        trainable={"x"},
        device="cuda",
        cast_before_add=True,
        mask_dtype=torch.bfloat16,
        **kw,
    )
