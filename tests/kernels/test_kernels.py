"""Triton row kernels vs their fp32 references (CPU through TRITON_INTERPRET=1, small odd shapes).

Three-way check for every output and gradient: ``err(ours) <= k * err(torch_same_dtype) + atol`` against the
fp32 reference, with ``k`` and ``atol`` from tests/tolerances.py.
"""

import warnings

import pytest
import torch

from chunkloss.kernels import (
    ApplyRotaryPosEmb,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_ref,
    geglu,
    geglu_ref,
    layer_norm,
    layer_norm_ref,
    rms_norm,
    rms_norm_ref,
    swiglu,
    swiglu_ref,
)
from chunkloss.kernels.glu import GLU, glu_ref
from chunkloss.kernels.rms_norm import rms_norm_bwd_torch, rms_norm_fwd_torch
from tests.kernels.compiled import compiled_matches_eager
from tests.tolerances import assert_close_to_ref

DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [31, 127, 1000]  # below a warp, just under a power of two, and a wide masked row
LAYOUTS = ["contiguous", "strided_rows", "transposed"]  # row stride > width; last-dim stride != 1


def assert_close3(ours, torch_same, ref, dtype, what):
    """``err(ours) <= k * err(torch_same) + atol`` against the fp32 ``ref``, with ``dtype``'s ``k, atol``."""
    assert_close_to_ref(ours, ref, torch_same, what, dtype=dtype)


def laid_out(master: torch.Tensor, layout: str, dtype) -> torch.Tensor:
    """A (N, D) input with `layout`: a non-leaf view, so gradients are taken w.r.t. the view itself."""
    if layout == "contiguous":
        return master.to(dtype).requires_grad_(True) * 1
    if layout == "strided_rows":
        leaf = torch.cat([master, torch.randn(master.shape[0], 5)], dim=1).to(dtype).requires_grad_(True)
        return leaf[:, : master.shape[1]]
    leaf = master.t().contiguous().to(dtype).requires_grad_(True)
    return leaf.t()


def run3(fn_ours, fn_ref, masters, layouts, dtype, grad_fn=torch.randn_like):
    """Outputs and input gradients of ours (dtype), torch's same ops (dtype) and the fp32 reference."""
    results = []
    upstream = None
    for fn, dt in ((fn_ref, torch.float32), (fn_ref, dtype), (fn_ours, dtype)):
        inputs = [
            laid_out(m, lay, dt) if lay else m.to(dt).requires_grad_(True) for m, lay in zip(masters, layouts)
        ]
        out = fn(*inputs)
        if upstream is None:
            upstream = grad_fn(out.float())
        grads = torch.autograd.grad(out, inputs, upstream.to(out.dtype))
        results.append((out, grads))
    return results


def check3(results, dtype, names):
    (ref, ref_g), (tch, tch_g), (ours, ours_g) = results
    assert ours.shape == ref.shape and ours.dtype == tch.dtype
    assert_close3(ours, tch, ref, dtype, "output")
    for name, a, b, c in zip(names, ours_g, tch_g, ref_g):
        assert_close3(a, b, c, dtype, f"d{name}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
def test_rms_norm(casting, offset, width, dtype, layout):
    x = torch.randn(19, width) * 3
    w = torch.randn(width) * 0.3 + (0.0 if offset else 1.0)
    results = run3(
        lambda x, w: rms_norm(x, w, 1e-6, offset, casting),
        lambda x, w: rms_norm_ref(x, w, 1e-6, offset, casting),
        [x, w],
        [layout, None],
        dtype,
    )
    check3(results, dtype, ["x", "w"])


class _RMSNormTorchMath(torch.autograd.Function):
    """The norm kernels' forward and backward as the PyTorch ops a compiled ``attention_input`` traces."""

    @staticmethod
    def forward(ctx, x, w, offset, casting):
        y, rstd = rms_norm_fwd_torch(x, w, 1e-6, offset, casting)
        ctx.save_for_backward(x, w, rstd)
        ctx.args = offset, casting
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        return *rms_norm_bwd_torch(dy, x, w, rstd, *ctx.args, True, True), None, None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
def test_rms_norm_torch_math(casting, offset, dtype):
    x = torch.randn(19, 127) * 3
    w = torch.randn(127) * 0.3 + (0.0 if offset else 1.0)
    results = run3(
        lambda x, w: _RMSNormTorchMath.apply(x, w, offset, casting),
        lambda x, w: rms_norm_ref(x, w, 1e-6, offset, casting),
        [x, w],
        ["contiguous", None],
        dtype,
    )
    check3(results, dtype, ["x", "w"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("has_bias", [True, False])
def test_layer_norm(has_bias, width, dtype, layout):
    x = torch.randn(19, width) * 2 + 1.5  # a non-zero mean exercises the centring
    w = torch.randn(width) * 0.3 + 1.0
    b = torch.randn(width) * 0.3
    masters, layouts = ([x, w, b], [layout, None, None]) if has_bias else ([x, w], [layout, None])
    results = run3(layer_norm, layer_norm_ref, masters, layouts, dtype)
    check3(results, dtype, ["x", "w", "b"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(
    "ours,ref",
    [
        (swiglu, swiglu_ref),
        (geglu, geglu_ref),
        (lambda a, b: GLU("gelu")(a, b), lambda a, b: glu_ref(a, b, "gelu")),  # exact (erf) GELU
    ],
    ids=["swiglu", "geglu", "geglu_exact"],
)
def test_glu(ours, ref, width, dtype, layout):
    a = torch.randn(19, width) * 3  # covers both tails of the activations
    b = torch.randn(19, width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's exp overflow in the interpreter's sigmoid
        results = run3(ours, ref, [a, b], [layout, "contiguous"], dtype)
    check3(results, dtype, ["a", "b"])


def rope_tables(batch, seq, rot, kind):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    pos = torch.arange(seq).float()[None, :] + torch.arange(batch).float()[:, None] * 3  # distinct per row
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, R), as LlamaRotaryEmbedding builds it
    if kind == "batched":
        return emb.cos(), emb.sin(), None
    if kind == "shared":
        return emb[0].cos(), emb[0].sin(), None  # (T, R)
    table = torch.cat((freqs, freqs), dim=-1).reshape(-1, rot)  # (B * T, R) rows gathered by position_ids
    position_ids = torch.arange(batch * seq).view(batch, seq).flip(-1)
    return table.cos(), table.sin(), position_ids


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rot", [(16, 16), (30, 30), (16, 8)], ids=["full", "odd_width", "partial"])
# Each table form once, with both head layouts covered: (B, H, T, D) views and (B, T, H, D).
@pytest.mark.parametrize("tables,unsqueeze_dim", [("batched", 1), ("shared", 2), ("position_ids", 1)])
def test_rope(tables, unsqueeze_dim, head_dim, rot, dtype, in_place):
    batch, seq, n_q, n_k = 2, 5, 6, 2  # grouped-query: 3 q heads per k head; 6 is not a power of two
    cos, sin, position_ids = rope_tables(batch, seq, rot, tables)
    q_proj = torch.randn(batch, seq, n_q * head_dim)
    k_proj = torch.randn(batch, seq, n_k * head_dim)

    def heads(x, n):  # transformers' q_proj(x).view(B, T, H, D).transpose(1, 2): a non-contiguous view
        x = x.view(batch, seq, n, head_dim)
        return x.transpose(1, 2) if unsqueeze_dim == 1 else x

    outs = []
    for dt, fn in (
        (torch.float32, apply_rotary_pos_emb_ref),
        (dtype, apply_rotary_pos_emb_ref),
        (dtype, apply_rotary_pos_emb),
    ):
        qp, kp = q_proj.to(dt).requires_grad_(), k_proj.to(dt).requires_grad_()
        kwargs = {"in_place": in_place} if fn is apply_rotary_pos_emb else {}
        q, k = heads(qp * 1, n_q), heads(kp * 1, n_k)  # non-leaf, like a projection output
        qe, ke = fn(q, k, cos.to(dt), sin.to(dt), position_ids, unsqueeze_dim, **kwargs)
        if fn is apply_rotary_pos_emb and in_place:
            assert qe.data_ptr() == q.data_ptr() and ke.data_ptr() == k.data_ptr()
        torch.manual_seed(1)
        # A transposed (non-contiguous) upstream gradient, as attention's backward produces.
        gq = torch.randn(qe.shape[::-1]).permute(3, 2, 1, 0).to(dt)
        gk = torch.randn(ke.shape).to(dt)
        dq, dk = torch.autograd.grad((qe, ke), (qp, kp), (gq, gk))
        outs.append((qe, ke, dq, dk))
    ref, tch, ours = outs
    for i, name in enumerate(["q_embed", "k_embed", "dq", "dk"]):
        assert ours[i].shape == ref[i].shape
        assert_close3(ours[i], tch[i], ref[i], dtype, name)


def test_rope_module_matches_function():
    cos, sin, _ = rope_tables(2, 4, 8, "batched")
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 1, 8)  # (B, T, H, D)
    got = ApplyRotaryPosEmb(unsqueeze_dim=2)(q, k, cos, sin)
    for a, b in zip(got, apply_rotary_pos_emb_ref(q, k, cos, sin, unsqueeze_dim=2)):
        torch.testing.assert_close(a, b)


def test_rope_gradient_of_one_output_only():
    cos, sin, _ = rope_tables(2, 4, 8, "batched")
    q = torch.randn(2, 3, 4, 8, requires_grad=True)
    k = torch.randn(2, 1, 4, 8, requires_grad=True)
    qe, _ = apply_rotary_pos_emb(q, k, cos, sin)
    qr, _ = apply_rotary_pos_emb_ref(q, k, cos, sin)
    dq, dk = torch.autograd.grad(qe.sum(), (q, k), allow_unused=True)
    (dq_ref,) = torch.autograd.grad(qr.sum(), (q,))
    torch.testing.assert_close(dq, dq_ref)
    assert dk is None or dk.abs().max() == 0


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_weight_grad_only(norm):
    """x frozen (dx skipped in the kernel), w trained: dw still right."""
    x = torch.randn(9, 45)
    w = (torch.randn(45) + 1).requires_grad_()
    fn, ref = (rms_norm, rms_norm_ref) if norm == "rms" else (layer_norm, layer_norm_ref)
    g = torch.randn(9, 45)
    (dw,) = torch.autograd.grad(fn(x, w), (w,), g)
    (dw_ref,) = torch.autograd.grad(ref(x, w), (w,), g)
    assert_close_to_ref(dw, dw_ref)


def test_no_grad_for_inputs_that_do_not_require_it():
    x = torch.randn(7, 33, requires_grad=True)
    w = torch.randn(33)
    y = rms_norm(x, w)
    assert y.grad_fn is not None
    (dx,) = torch.autograd.grad(y.sum(), (x,))
    assert dx.shape == x.shape
    b = torch.randn(33, requires_grad=True)
    dx, db = torch.autograd.grad(layer_norm(x, w, b).sum(), (x, b))
    torch.testing.assert_close(db, torch.full((33,), 7.0))


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_in_place_backward_matches(norm):
    x = torch.randn(3, 5, 100, requires_grad=True)  # 3-D input: rows flattened before the kernel
    w = torch.randn(100, requires_grad=True)
    if norm == "rms":

        def fn(x, ip):
            return rms_norm(x, w, in_place=ip)
    else:

        def fn(x, ip):
            return layer_norm(x, w, None, in_place=ip)

    g = torch.randn(3, 5, 100)
    expected = torch.autograd.grad(fn(x, False), (x, w), g.clone())
    g_buffer = g.clone()
    got = torch.autograd.grad(fn(x, True), (x, w), g_buffer)
    torch.testing.assert_close(got, expected)
    assert not torch.equal(g_buffer, g), "in_place=True should have reused the gradient buffer"


@pytest.mark.parametrize("ours,ref", [(swiglu, swiglu_ref), (geglu, geglu_ref)], ids=["swiglu", "geglu"])
def test_glu_in_place_backward_matches(ours, ref):
    a = torch.randn(4, 3, 50)
    b = torch.randn(4, 3, 50)
    g = torch.randn(4, 3, 50)
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    expected = torch.autograd.grad(ref(a1, b1), (a1, b1), g)
    a2, b2 = (a * 1).requires_grad_(), (b * 1).requires_grad_()
    got = torch.autograd.grad(ours(a2 * 1, b2 * 1, in_place=True), (a2, b2), g)
    assert_close_to_ref(got, expected)


def test_rms_norm_gemma_offset_matches_transformers():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(6, 40, dtype=torch.bfloat16)
    gemma, llama = GemmaRMSNorm(40, eps=1e-6), LlamaRMSNorm(40, eps=1e-6)
    with torch.no_grad():
        gemma.weight.normal_()
        llama.weight.normal_()
    llama.to(torch.bfloat16)
    torch.testing.assert_close(rms_norm_ref(x, gemma.weight, 1e-6, 1.0, "gemma"), gemma(x), atol=0, rtol=0)
    torch.testing.assert_close(rms_norm_ref(x, llama.weight, 1e-6), llama(x), atol=0, rtol=0)
    # The kernel and transformers round the same fp32 value to bf16, but may differ by one ulp.
    ref = rms_norm_ref(x.float(), gemma.weight.float(), 1e-6, 1.0, "gemma")
    assert_close3(rms_norm(x, gemma.weight, 1e-6, 1.0, "gemma"), gemma(x), ref, torch.bfloat16, "gemma")
    ref = rms_norm_ref(x.float(), llama.weight.float(), 1e-6)
    assert_close3(rms_norm(x, llama.weight, 1e-6), llama(x), ref, torch.bfloat16, "llama")


def test_rope_ref_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

    cos, sin, _ = rope_tables(2, 5, 16, "batched")
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    for got, want in zip(apply_rotary_pos_emb_ref(q, k, cos, sin), hf_rope(q, k, cos, sin)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_compiles_whole_as_its_reference(norm):
    """Under torch.compile the norms trace as their references (no graph break at the launch plan), so the
    compiled call equals eager's reference, output and gradients."""
    x = torch.randn(6, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    if norm == "rms":
        compiled_matches_eager(lambda x, w: rms_norm(x, w, 1e-6, 0.0, "llama"), (x, w))
    else:
        b = torch.randn(40, requires_grad=True)
        compiled_matches_eager(lambda x, w, b: layer_norm(x, w, b, 1e-5), (x, w, b))
