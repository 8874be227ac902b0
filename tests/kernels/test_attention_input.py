"""RMSNorm + q/k/v projections + RoPE in one Function vs its fp64 reference: outputs, every gradient, errors.

Three-way check (tests/tolerances.py): ``err(ours) <= K * err(torch in the same dtype) + atol`` against the
fp64 reference (transformers' Llama math op for op). CPU runs go through TRITON_INTERPRET=1.
"""

import pytest
import torch

from chunkloss.kernels import apply_rotary_pos_emb
from chunkloss.kernels.attention_input import attention_input, attention_input_ref
from tests.kernels.compiled import compiled_matches_eager, in_fresh_process
from tests.tolerances import assert_close_to_ref

LEAVES = ("x", "norm_weight", "w_q", "w_k", "w_v")
# (B, T, H, q heads, kv heads, head_dim, rotary dims): grouped-query, an odd width, a single kv head, a
# partial rotary (Phi-like: the last head_dim - R dims pass through).
SHAPES = [(2, 5, 48, 4, 2, 8, 8), (1, 7, 40, 5, 1, 8, 8), (2, 3, 32, 2, 2, 16, 8)]


def make_inputs(shape, bias, device=None):
    b, t, hidden, hq, hkv, d, rot = shape
    device = device or torch.get_default_device()  # CUDA where tests/kernels/conftest.py makes it the default
    g = torch.Generator().manual_seed(0)

    def rand(*size, scale=1.0, shift=0.0):
        return (torch.randn(*size, generator=g, device="cpu") * scale + shift).to(device)

    tensors = {
        "x": rand(b, t, hidden),
        "norm_weight": rand(hidden, scale=0.1, shift=1.0),
        "w_q": rand(hq * d, hidden, scale=hidden**-0.5),
        "w_k": rand(hkv * d, hidden, scale=hidden**-0.5),
        "w_v": rand(hkv * d, hidden, scale=hidden**-0.5),
    }
    if bias:  # Qwen2's q/k/v biases
        for name, w in (("b_q", "w_q"), ("b_k", "w_k"), ("b_v", "w_v")):
            tensors[name] = rand(tensors[w].shape[0], scale=0.3)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64, device="cpu") / rot)
    freqs = torch.arange(t, dtype=torch.float64, device="cpu")[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(b, t, rot)
    return tensors, emb.cos().to(device), emb.sin().to(device), d


def run(fn, masters, tables, dtype, dys, **kw):
    """q, k, v and the gradients of every input (dict order) of ``fn`` on ``masters`` cast to ``dtype``."""
    leaves = {k: v.to(dtype).requires_grad_(True) for k, v in masters.items()}
    cos, sin, head_dim = tables
    args = [leaves[k] for k in LEAVES]
    biases = {k: v for k, v in leaves.items() if k.startswith("b_")}
    outs = fn(*args, cos.to(dtype), sin.to(dtype), head_dim=head_dim, **biases, **kw)
    grads = torch.autograd.grad(outs, list(leaves.values()), [d.to(dtype) for d in dys])
    return outs, dict(zip(leaves, grads, strict=True))


def check_three_way(shape, dtype, bias=False, device=None, **kw):
    device = device or torch.get_default_device()
    masters, cos, sin, head_dim = make_inputs(shape, bias, device)
    tables = (cos, sin, head_dim)
    probe = attention_input_ref(*(masters[k] for k in LEAVES), cos, sin, head_dim=head_dim)
    g = torch.Generator().manual_seed(1)
    dys = [torch.randn(o.shape, generator=g, dtype=torch.float64, device="cpu").to(device) for o in probe]
    ref, g_ref = run(attention_input_ref, masters, tables, torch.float64, dys, **kw)
    tch, g_tch = run(attention_input_ref, masters, tables, dtype, dys, **kw)
    ours, g_ours = run(attention_input, masters, tables, dtype, dys, **kw)
    for name, o, r, t in zip("qkv", ours, ref, tch, strict=True):
        assert o.shape == r.shape and o.dtype == dtype, name
        assert_close_to_ref(o, r, None if dtype == torch.float32 else t, name)
    for name in g_ref:
        same_dtype = None if dtype == torch.float32 else g_tch[name]
        assert_close_to_ref(g_ours[name], g_ref[name], same_dtype, f"d{name}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(dtype, shape):
    check_three_way(shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biases_and_gemma_norm(dtype):
    check_three_way(SHAPES[0], dtype, bias=True)
    check_three_way(SHAPES[1], dtype, offset=1.0, casting="gemma")


def test_frozen_inputs_and_shared_tables():
    """Only the gradients asked for are computed; (1, T, R) tables serve every sequence."""
    masters, cos, sin, head_dim = make_inputs(SHAPES[0], bias=False)
    x, norm_weight, w_q, w_k, w_v = (masters[k] for k in LEAVES)
    w_k.requires_grad_(True)
    q, k, v = attention_input(x, norm_weight, w_q, w_k, w_v, cos[:1], sin[:1], head_dim=head_dim)
    q_ref, k_ref, v_ref = attention_input_ref(x, norm_weight, w_q, w_k, w_v, cos, sin, head_dim=head_dim)
    assert_close_to_ref((q, k, v), (q_ref, k_ref, v_ref))
    (dw,) = torch.autograd.grad(k.square().sum(), [w_k])
    (dw_ref,) = torch.autograd.grad(k_ref.square().sum(), [w_k])
    assert_close_to_ref(dw, dw_ref)


def test_backward_twice_with_retain_graph():
    masters, cos, sin, head_dim = make_inputs(SHAPES[0], bias=False)
    leaves = [masters[k].requires_grad_(True) for k in LEAVES]
    q, k, v = attention_input(*leaves, cos, sin, head_dim=head_dim)
    loss = q.sum() + 2 * k.sum() + 3 * v.sum()
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    for a, b in zip(torch.autograd.grad(loss, leaves), first, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _saved_bytes_and_grads(norm_recompute):
    masters, cos, sin, head_dim = make_inputs(SHAPES[0], bias=True)
    leaves = {k: v.clone().requires_grad_(True) for k, v in masters.items()}
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        biases = {k: v for k, v in leaves.items() if k.startswith("b_")}
        outs = attention_input(
            *(leaves[k] for k in LEAVES), cos, sin, head_dim=head_dim, **biases, norm_recompute=norm_recompute
        )
    params = {leaves[k].untyped_storage().data_ptr() for k in leaves if k != "x"}
    saved = sum(n for ptr, n in storages.items() if ptr not in params)
    loss = sum((o * (i + 1)).square().sum() for i, o in enumerate(outs))
    return saved, torch.autograd.grad(loss, list(leaves.values()))


def test_norm_recompute_keeps_less_and_gives_the_same_bits():
    """Without h the backward runs the same norm kernel on the same x: the gradients are bit-identical."""
    saved_keep, grads_keep = _saved_bytes_and_grads(False)
    saved, grads = _saved_bytes_and_grads(True)
    b, t, hidden = SHAPES[0][:3]
    assert saved_keep - saved == b * t * hidden * 4  # the fp32 h
    for a, g in zip(grads, grads_keep, strict=True):
        assert torch.equal(a, g)


def test_autocast_that_would_cast_is_refused():
    masters, cos, sin, head_dim = make_inputs(SHAPES[0], bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="under autocast"):
        attention_input(*(masters[k] for k in LEAVES), cos, sin, head_dim=head_dim)
    bf16 = [masters[k].bfloat16() for k in LEAVES]  # already in the autocast dtype: runs as without autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = attention_input(*bf16, cos.bfloat16(), sin.bfloat16(), head_dim=head_dim)
    outside = attention_input(*bf16, cos.bfloat16(), sin.bfloat16(), head_dim=head_dim)
    for a, o in zip(inside, outside, strict=True):
        assert torch.equal(a, o)


def test_bad_arguments_raise_one_line_errors():
    masters, cos, sin, head_dim = make_inputs(SHAPES[0], bias=False)
    x, norm_weight, w_q, w_k, w_v = (masters[k] for k in LEAVES)
    with pytest.raises(ValueError, match=r"x \(B, T, H\)"):
        attention_input(x[0], norm_weight, w_q, w_k, w_v, cos, sin)
    with pytest.raises(ValueError, match="w_k must be"):
        attention_input(x, norm_weight, w_q, w_k[:, :-1], w_v, cos, sin)
    with pytest.raises(ValueError, match="bias of w_v"):
        attention_input(x, norm_weight, w_q, w_k, w_v, cos, sin, b_v=torch.zeros(3))
    with pytest.raises(ValueError, match="cos and sin"):
        attention_input(x, norm_weight, w_q, w_k, w_v, cos[:, :-1], sin[:, :-1])
    with pytest.raises(TypeError, match="share a dtype"):
        attention_input(x.double(), norm_weight, w_q, w_k, w_v, cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_widths_gpu(dtype):
    """Llama-3.2-1B's attention input (H = 2048, 32/8 heads of 64) on 3 sequences of 1031 tokens."""
    check_three_way((3, 1031, 2048, 32, 8, 64, 64), dtype, device="cuda")


@pytest.mark.parametrize("norm_recompute", [False, True])
@in_fresh_process
def test_compiles_without_graph_breaks(norm_recompute):
    """attention_input and the standalone RoPE compile as one graph (the Triton launches are custom ops there)
    and give eager's results; partial rotary dims included."""
    masters, cos, sin, head_dim = make_inputs(SHAPES[2], bias=True)
    x, norm_weight, w_q, w_k, w_v = (masters[k].requires_grad_(k in ("x", "norm_weight")) for k in LEAVES)

    def call(x, norm_weight):
        return attention_input(
            x,
            norm_weight,
            w_q,
            w_k,
            w_v,
            cos,
            sin,
            head_dim=head_dim,
            b_k=masters["b_k"],
            norm_recompute=norm_recompute,
        )

    compiled_matches_eager(call, [x, norm_weight])
    q, k = torch.randn(2, 2, 3, 16, requires_grad=True), torch.randn(2, 2, 3, 16, requires_grad=True)
    compiled_matches_eager(
        lambda q, k: apply_rotary_pos_emb(q * 1, k * 1, cos, sin, in_place=norm_recompute), [q, k]
    )
