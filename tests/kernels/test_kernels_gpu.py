"""Kernels at real shapes on a CUDA device (bf16 and fp16) vs the fp32 reference, and int64 offsets.

Run: ``pytest -m gpu tests/kernels -q``.
"""

import pytest
import torch

from chunkloss.kernels import (
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
from chunkloss.kernels._utils import norm_launch_options
from tests.kernels.test_kernels import assert_close3, rope_tables
from tests.tolerances import assert_close_to_ref

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


def three_way(fn_ours, fn_ref, masters, dtype, in_place=False):
    """(ref fp32, torch dtype, ours dtype) outputs and gradients for inputs built from fp32 masters."""
    results, upstream = [], None
    for fn, dt in ((fn_ref, torch.float32), (fn_ref, dtype), (fn_ours, dtype)):
        inputs = [m.to(dt).requires_grad_(True) for m in masters]
        out = fn(*[i * 1 for i in inputs]) if in_place and fn is fn_ours else fn(*inputs)
        if upstream is None:
            upstream = torch.randn_like(out, dtype=torch.float32)
        grads = torch.autograd.grad(out, inputs, upstream.to(out.dtype))
        results.append((out, grads))
    (ref, ref_g), (tch, tch_g), (ours, ours_g) = results
    assert_close3(ours, tch, ref, dtype, "output")
    for i, (a, b, c) in enumerate(zip(ours_g, tch_g, ref_g)):
        assert_close3(a, b, c, dtype, f"grad {i}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
def test_rms_norm_4096(casting, offset, dtype):
    x = torch.randn(4096, 4096, device="cuda")
    w = torch.randn(4096, device="cuda") * 0.3 + (0.0 if offset else 1.0)
    three_way(
        lambda x, w: rms_norm(x, w, 1e-6, offset, casting, in_place=True),
        lambda x, w: rms_norm_ref(x, w, 1e-6, offset, casting),
        [x, w],
        dtype,
        in_place=True,
    )


@pytest.mark.parametrize("width", [2048, 8192, 16384, 5120 + 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_hidden_sizes(width, dtype):
    x = torch.randn(1024, width, device="cuda")
    w = torch.randn(width, device="cuda") * 0.3 + 1.0
    b = torch.randn(width, device="cuda") * 0.3
    three_way(rms_norm, rms_norm_ref, [x, w], dtype)
    three_way(layer_norm, layer_norm_ref, [x, w, b], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_n,block_m", [(1024, 1), (4096, 2)])
@pytest.mark.parametrize("width", [5120 + 7, 16384])
def test_norms_looped_configs(width, block_n, block_m, dtype):
    """The looped path forced at several tiles; one backward program per SM gives each ~16 rows, so the dW/dB
    partial rows are read back and added to across row steps."""
    x = torch.randn(2048, width, device="cuda") + 0.5
    w = torch.randn(width, device="cuda") * 0.3 + 1.0
    b = torch.randn(width, device="cuda") * 0.3
    with norm_launch_options(
        max_fused_cols=0, loop_block_n=block_n, loop_block_m=block_m, loop_bwd_programs_per_sm=1
    ):
        three_way(
            lambda x, w: rms_norm(x, w, 1e-6, 0.0, "llama", in_place=True),
            lambda x, w: rms_norm_ref(x, w, 1e-6, 0.0, "llama"),
            [x, w],
            dtype,
            in_place=True,
        )
        three_way(
            lambda x, w: rms_norm(x, w, 1e-6, 1.0, "gemma"),
            lambda x, w: rms_norm_ref(x, w, 1e-6, 1.0, "gemma"),
            [x, w],
            dtype,
        )
        three_way(layer_norm, layer_norm_ref, [x, w, b], dtype)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("width", [2048, 4096 + 3])
def test_norms_pipelined_backward_equals_plain(width, stages):
    """The software-pipelined row loop of the fused backward (bwd_stages > 0, GPU only) does the same
    arithmetic in the same order as the plain loop: equal bits, and 3000 rows leave a partial last step."""
    x = torch.randn(3000, width, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(width, device="cuda") * 0.3 + 1.0).to(torch.bfloat16)
    b = (torch.randn(width, device="cuda") * 0.3).to(torch.bfloat16)
    dy = torch.randn_like(x)
    for fn, params in ((lambda x, w, b: rms_norm(x, w, 1e-6), (x, w)), (layer_norm, (x, w, b))):
        grads = []
        for knobs in (dict(bwd_stages=0, bwd_stages_wide=0), dict(bwd_stages=stages, bwd_stages_wide=stages)):
            with norm_launch_options(**knobs):
                inputs = [p.clone().requires_grad_() for p in (x, w, b)]
                out = fn(*inputs)
                grads.append(torch.autograd.grad(out, inputs[: len(params)], dy))
        for a, c in zip(*grads):
            torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_layer_norm_looped_large_mean():
    """Width 16384 takes the looped path by default; a mean 300 standard deviations from zero must not cost
    precision (E[x^2] - mean^2 in fp32 would be off by ~5e-3 in a variance of 1)."""
    x = torch.randn(256, 16384, device="cuda", dtype=torch.float64) + 300.0
    w = torch.randn(16384, device="cuda", dtype=torch.float64) * 0.3 + 1.0
    ref = torch.nn.functional.layer_norm(x, (16384,), w, None, 1e-5)
    plain = torch.nn.functional.layer_norm(x.float(), (16384,), w.float(), None, 1e-5)
    assert_close_to_ref(layer_norm(x.float(), w.float()), ref, plain, "layer_norm", dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_4096(dtype):
    x = torch.randn(4096, 4096, device="cuda") + 1.0
    w = torch.randn(4096, device="cuda") * 0.3 + 1.0
    b = torch.randn(4096, device="cuda") * 0.3
    three_way(layer_norm, layer_norm_ref, [x, w, b], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ours,ref", [(swiglu, swiglu_ref), (geglu, geglu_ref)], ids=["swiglu", "geglu"])
def test_glu_2048x14336(ours, ref, dtype):
    a = torch.randn(2048, 14336, device="cuda") * 3
    b = torch.randn(2048, 14336, device="cuda")
    three_way(ours, ref, [a, b], dtype)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_llama_shape(dtype, in_place):
    batch, seq, n_q, n_k, head_dim = 2, 1024, 32, 8, 128
    cos, sin, _ = rope_tables(batch, seq, head_dim, "batched")
    q_proj = torch.randn(batch, seq, n_q * head_dim, device="cuda")
    k_proj = torch.randn(batch, seq, n_k * head_dim, device="cuda")
    outs = []
    for dt, fn in (
        (torch.float32, apply_rotary_pos_emb_ref),
        (dtype, apply_rotary_pos_emb_ref),
        (dtype, apply_rotary_pos_emb),
    ):
        qp, kp = q_proj.to(dt).requires_grad_(), k_proj.to(dt).requires_grad_()
        q = (qp * 1).view(batch, seq, n_q, head_dim).transpose(1, 2)
        k = (kp * 1).view(batch, seq, n_k, head_dim).transpose(1, 2)
        kwargs = {"in_place": in_place} if fn is apply_rotary_pos_emb else {}
        qe, ke = fn(q, k, cos.cuda().to(dt), sin.cuda().to(dt), **kwargs)
        torch.manual_seed(1)
        gq = torch.randn(batch, seq, n_q, head_dim, device="cuda").transpose(1, 2).to(dt)
        gk = torch.randn_like(ke)
        outs.append((qe, ke, *torch.autograd.grad((qe, ke), (qp, kp), (gq, gk))))
    ref, tch, ours = outs
    for i, name in enumerate(["q_embed", "k_embed", "dq", "dk"]):
        assert_close3(ours[i], tch[i], ref[i], dtype, name)


def _free_gib():
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


@pytest.mark.parametrize("width", [4096, 16384])  # fused and looped path
def test_rms_norm_int64_row_offsets(width):
    """Rows x width past 2^31 elements: the last rows must be normalised where they belong."""
    rows = 2**31 // width + 64
    if _free_gib() < 4 * rows * width * 2 / 2**30 + 2:
        pytest.fail("needs ~18 GiB of free GPU memory")
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    y = rms_norm(x, w)
    tail = slice(rows - 64, rows)
    # Wrong rows would be off by O(1); the tail against the fp32 reference, as the three-way tests.
    x32, w32 = x[tail].detach().float(), w.float()
    assert_close_to_ref(y[tail], rms_norm_ref(x32, w32), rms_norm_ref(x[tail].detach(), w), "y tail")
    g = torch.zeros_like(y)
    g[tail] = 1.0
    (dx,) = torch.autograd.grad(y, (x,), g)
    xt, xt32 = x[tail].detach().requires_grad_(True), x32.requires_grad_(True)
    (dx_bf16,) = torch.autograd.grad(rms_norm_ref(xt, w), (xt,), g[tail])
    (dx_ref,) = torch.autograd.grad(rms_norm_ref(xt32, w32), (xt32,), g[tail].float())
    assert_close_to_ref(dx[tail], dx_ref, dx_bf16, "dx tail")


def test_glu_int64_offsets():
    n = 2**31 + 4096
    a = torch.randn(n // 4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    c = swiglu(a, b)
    ref = swiglu_ref(a[-8:].float(), b[-8:].float())
    assert_close_to_ref(c[-8:], ref, swiglu_ref(a[-8:], b[-8:]), "tail")
