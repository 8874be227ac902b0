"""RMSNorm / LayerNorm on the looped path (rows wider than one register tile, two passes over column blocks).

The path normally starts above 8192 columns; ``norm_launch_options`` moves the threshold and the column block
down to 16 so the interpreter runs it at small shapes. Same three-way check against the fp32 reference as the
fused path (tests/kernels/test_kernels.py). On CPU, one backward program per "SM" (4 of them) gives every
program several row steps, so the dW/dB partial rows are added to, not only stored (on a GPU, 13 rows leave
one row per program: tests/kernels/test_kernels_gpu.py covers that case at real shapes).
"""

import pytest
import torch
import torch.nn.functional as F

from chunkloss.kernels import layer_norm, layer_norm_ref, rms_norm, rms_norm_ref
from chunkloss.kernels._utils import (
    NORM_LAUNCH,
    LaunchTable,
    NormLaunchOptions,
    cdiv,
    next_power_of_2,
    norm_bwd_plan,
    norm_fwd_plan,
    norm_launch_options,
)
from tests.kernels.test_kernels import DTYPES, check3, run3
from tests.tolerances import assert_close_to_ref

ROWS = 13  # on CPU: 4 backward programs of 4 rows, the last with 1 (a partial tile when block_m is 2)
# (width, layout): 31 is one full block of 16 and a masked one, 64 four full blocks; rows further apart than
# their width once. A transposed input is copied before the kernel, as on the fused path.
SHAPES = [(31, "strided_rows"), (64, "contiguous")]


@pytest.fixture(params=[1, 2], ids=["block_m1", "block_m2"])
def looped(request):
    """Knobs that send rows wider than 16 columns down the looped path, 16 columns and block_m rows a step."""
    knobs = dict(max_fused_cols=16, loop_block_n=16, loop_block_m=request.param, loop_bwd_programs_per_sm=1)
    with norm_launch_options(**knobs) as current:
        yield current


def assert_looped(knobs, n_rows, n_cols):
    device = torch.empty(0).device  # CUDA when tests/kernels/conftest.py made it the default
    plan = norm_bwd_plan(n_rows, n_cols, device, knobs)
    assert norm_fwd_plan(n_rows, n_cols, knobs).looped and plan.looped and plan.block_n < n_cols
    assert device.type == "cuda" or plan.rows_per_program > plan.block_m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,layout", SHAPES)
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
def test_rms_norm_looped(looped, casting, offset, width, dtype, layout):
    assert_looped(looped, ROWS, width)
    x = torch.randn(ROWS, width) * 3
    w = torch.randn(width) * 0.3 + (0.0 if offset else 1.0)
    results = run3(
        lambda x, w: rms_norm(x, w, 1e-6, offset, casting),
        lambda x, w: rms_norm_ref(x, w, 1e-6, offset, casting),
        [x, w],
        [layout, None],
        dtype,
    )
    check3(results, dtype, ["x", "w"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,layout", SHAPES)
@pytest.mark.parametrize("has_bias", [True, False])
def test_layer_norm_looped(looped, has_bias, width, dtype, layout):
    assert_looped(looped, ROWS, width)
    x = torch.randn(ROWS, width) * 2 + 1.5  # a non-zero mean exercises the centring
    w = torch.randn(width) * 0.3 + 1.0
    b = torch.randn(width) * 0.3
    masters, layouts = ([x, w, b], [layout, None, None]) if has_bias else ([x, w], [layout, None])
    results = run3(layer_norm, layer_norm_ref, masters, layouts, dtype)
    check3(results, dtype, ["x", "w", "b"])


def test_layer_norm_looped_large_mean(looped):
    """Rows whose mean is 300 standard deviations from zero: the block-wise statistics are merged exactly
    (Chan et al.), so the looped variance is as good as the fused path's two-pass one. E[x^2] - mean^2 in fp32
    would be off by ~eps_fp32 * 300^2 = 5e-3 in a variance of 1."""
    x = torch.randn(ROWS, 47, dtype=torch.float64) + 300.0
    w = torch.randn(47, dtype=torch.float64) * 0.3 + 1.0
    ref = F.layer_norm(x, (47,), w, None, 1e-5)
    ours = layer_norm(x.float(), w.float(), None, 1e-5).double()
    assert_close_to_ref(ours, ref)  # fp32 rounding of x ~ 300 is 1.5e-5 / std


@pytest.mark.parametrize(
    "norm,grads", [("rms", "x"), ("rms", "w"), *[("layer", g) for g in ("x", "w", "b", "wb")]]
)  # RMSNorm has no bias
def test_norm_looped_partial_grads(looped, norm, grads):
    """Only some inputs require grad: the kernels skip pass 1 (no dx) or a partial buffer, and the rest stays
    right."""
    torch.manual_seed(1)
    x, w, b, g = torch.randn(ROWS, 45) + 0.5, torch.randn(45) + 1, torch.randn(45), torch.randn(ROWS, 45)
    x.requires_grad_("x" in grads)
    w.requires_grad_("w" in grads)
    b.requires_grad_("b" in grads)
    wanted = [t for t in (x, w, b) if t.requires_grad]
    fn, ref = (rms_norm, rms_norm_ref) if norm == "rms" else (layer_norm, layer_norm_ref)
    args = (x, w) if norm == "rms" else (x, w, b)
    got = torch.autograd.grad(fn(*args), wanted, g)
    expected = torch.autograd.grad(ref(*args), wanted, g)
    assert_close_to_ref(got, expected)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_looped_in_place_backward(looped, norm):
    x = torch.randn(3, 5, 40, requires_grad=True)  # 3-D: rows flattened before the kernel
    w = torch.randn(40, requires_grad=True)

    def fn(x, in_place):
        if norm == "rms":
            return rms_norm(x, w, in_place=in_place)
        return layer_norm(x, w, None, in_place=in_place)

    g = torch.randn(3, 5, 40)
    expected = torch.autograd.grad(fn(x, False), (x, w), g.clone())
    g_buffer = g.clone()
    got = torch.autograd.grad(fn(x, True), (x, w), g_buffer)
    torch.testing.assert_close(got, expected)
    assert not torch.equal(g_buffer, g), "in_place=True should have reused the gradient buffer"


def test_looped_matches_fused():
    """The two paths compute the same function: fp32 outputs and gradients agree to rounding."""
    x = torch.randn(ROWS, 100) + 0.3
    w, b, g = torch.randn(100) + 1, torch.randn(100), torch.randn(ROWS, 100)
    outs = []
    for changes in ({}, {"max_fused_cols": 16, "loop_block_n": 32}):
        with norm_launch_options(**changes):
            xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
            y_rms = rms_norm(xs, ws, 1e-6, 1.0, "gemma")
            y_ln = layer_norm(xs, ws, bs)
            outs.append((y_rms, y_ln, *torch.autograd.grad((y_rms, y_ln), (xs, ws, bs), (g, g))))
    assert_close_to_ref(outs[0], outs[1])


def test_plans_follow_knobs_and_are_cached():
    cpu = torch.device("cpu")
    KNOBS = NORM_LAUNCH.get(cpu)
    assert KNOBS is NORM_LAUNCH.default  # off CUDA: the default row
    default = norm_fwd_plan(8, 20000, KNOBS)
    assert default.looped and default.block_n == KNOBS.loop_block_n
    assert norm_fwd_plan(8, 20000, KNOBS) is default  # cached: the same object back
    with norm_launch_options(max_fused_cols=1 << 15) as knobs:
        fused = norm_fwd_plan(8, 20000, knobs)
        assert not fused.looped and fused.block_n == 32768
    plan = norm_bwd_plan(1000, 300, cpu, KNOBS)
    assert plan.n_programs * plan.rows_per_program >= 1000 > (plan.n_programs - 1) * plan.rows_per_program
    assert plan.rows_per_program % plan.block_m == 0


def test_host_integer_helpers_match_triton():
    import triton

    for n in [1, 2, 3, 31, 32, 33, 1000, 4096, 5127, 16384, 2**31 + 5]:
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 7, 16, 4096):
            assert cdiv(n, d) == triton.cdiv(n, d)


@pytest.mark.parametrize("max_fused_cols", [8192, 16], ids=["fused", "looped"])
def test_norms_zero_rows(max_fused_cols):
    """An empty batch gives empty outputs and zero weight/bias gradients (the plan used to divide by zero)."""
    x, w, b = (torch.randn(*s, requires_grad=True) for s in ((0, 33), (33,), (33,)))
    with norm_launch_options(max_fused_cols=max_fused_cols, loop_block_n=16):
        dx, dw = torch.autograd.grad(rms_norm(x, w), (x, w), torch.randn(0, 33))
        assert dx.shape == (0, 33) and torch.equal(dw, torch.zeros(33))
        dx, dw, db = torch.autograd.grad(layer_norm(x, w, b), (x, w, b), torch.randn(0, 33))
        assert dx.shape == (0, 33) and torch.equal(dw, torch.zeros(33)) and torch.equal(db, torch.zeros(33))


def test_settings_by_capability_and_override():
    """The table picks a row by compute capability (default for any other); ``use`` overrides it inside the
    block only, nests on the setting in force, and is undone by an error too."""
    sm80 = NormLaunchOptions(loop_warps=8)
    settings = LaunchTable("test", NormLaunchOptions(), {(8, 0): sm80})
    assert settings.for_capability((8, 0)) is sm80
    assert settings.for_capability((9, 0)) is settings.default
    assert settings.for_capability(None) is settings.default
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError), settings.use(loop_block_n=16) as outer:
        assert settings.get(cpu) is outer and outer.loop_block_n == 16 and outer.loop_warps == 16
        with settings.use(loop_block_m=2) as inner:
            assert settings.get(cpu) is inner and (inner.loop_block_n, inner.loop_block_m) == (16, 2)
        assert settings.get(cpu) is outer
        raise RuntimeError
    assert settings.get(cpu) is settings.default
    with norm_launch_options(max_fused_cols=16) as forced:  # the norms' helper: one threshold for both norms
        assert NORM_LAUNCH.get(cpu) is forced and forced.rms_max_fused_cols == 16
    assert NORM_LAUNCH.get(cpu) is NORM_LAUNCH.default
