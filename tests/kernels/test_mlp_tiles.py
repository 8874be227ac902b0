"""The gated MLP over row tiles (``gated_mlp(..., tile=)``): equal to the untiled block under the tolerance
rule, LoRA adapters included, and no (rows, I) intermediate larger than one tile in the forward or the
backward."""

import pytest
import torch

from chunkloss.kernels import LoraAdapter
from chunkloss.kernels import mlp as mlp_module
from chunkloss.kernels.mlp import gated_mlp, gated_mlp_ref
from tests.kernels.test_mlp import make_inputs, run
from tests.tolerances import assert_close_to_ref

# tile sizes against 37 rows: one row, an odd tile that leaves a short last tile, one that divides, all rows.
TILES = [1, 10, 37 // 2, 64]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_matches_reference(dtype, recompute, tile):
    masters = make_inputs(37, 40, 45, bias=True)
    dy = torch.randn(37, 40)
    y_ref, g_ref = run(gated_mlp_ref, masters, torch.float64, dy)
    y_tch, g_tch = run(gated_mlp_ref, masters, dtype, dy)
    y, g = run(gated_mlp, masters, dtype, dy, recompute=recompute, tile=tile)
    assert_close_to_ref(y, y_ref, y_tch, "y")
    for name in g_ref:
        assert_close_to_ref(g[name], g_ref[name], g_tch[name], f"d{name}")


def lora_leaves(hidden, inter, rank, dtype):
    torch.manual_seed(1)
    shapes = ((rank, hidden), (inter, rank)), ((rank, hidden), (inter, rank)), ((rank, inter), (hidden, rank))
    return [(torch.randn(a) * 0.3, torch.randn(b) * 0.3) for a, b in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_lora_matches_untiled_and_reference(dtype):
    """Frozen base, trainable fp32 adapters on all three projections (PEFT's layout), 3 x 13 tokens."""
    m = make_inputs(39, 24, 40, bias=False)
    x = m["x"].view(3, 13, 24)
    weights = [m[k].to(dtype) for k in ("w_gate", "w_up", "w_down")]
    dy = torch.randn(3, 13, 24)

    def grads(fn, dt, **kw):
        ab = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in lora_leaves(24, 40, 4, dt)]
        xs = x.to(dt).requires_grad_()
        ws = [w.to(dt) for w in weights]
        adapters = tuple(LoraAdapter(a, b, 2.0) for a, b in ab)
        if fn is gated_mlp_ref:
            adapters = tuple(LoraAdapter(a.to(dt), b.to(dt), 2.0) for a, b in ab)
        y = fn(xs, *ws, adapters=adapters, **kw)
        leaves = [xs, *(t for pair in ab for t in pair)]
        return [y, *torch.autograd.grad(y, leaves, dy.to(y.dtype))]

    ref = grads(gated_mlp_ref, torch.float64)
    tch = grads(gated_mlp_ref, dtype)
    for tile in (None, 7):
        ours = grads(gated_mlp, dtype, recompute=True, tile=tile)
        for name, a, r, t in zip(["y", "dx", "dA_g", "dB_g", "dA_u", "dB_u", "dA_d", "dB_d"], ours, ref, tch):
            assert_close_to_ref(a, r, t, f"{name} (tile={tile})")


def test_intermediates_are_one_tile(monkeypatch):
    """Every (rows, I) tensor the GLU kernel reads or writes, forward and backward, has at most ``tile``
    rows."""
    rows_seen = []
    for name in ("_glu_fwd", "_glu_bwd"):
        original = getattr(mlp_module, name)

        def spy(*args, _original=original, **kw):
            rows_seen.append(args[0].shape[0])
            return _original(*args, **kw)

        monkeypatch.setattr(mlp_module, name, spy)
    m = {k: v.requires_grad_() for k, v in make_inputs(50, 16, 24, bias=False).items()}
    gated_mlp(m["x"], m["w_gate"], m["w_up"], m["w_down"], recompute=True, tile=16).sum().backward()
    # The forward in order; the backward from the last tile.
    assert rows_seen == [16, 16, 16, 2] + [2, 16, 16, 16]
    rows_seen.clear()
    gated_mlp(m["x"], m["w_gate"], m["w_up"], m["w_down"], recompute=True).sum().backward()
    assert rows_seen == [50, 50]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("recompute", [True, False])
def test_checkpoint_recompute_stops_before_the_mlp(monkeypatch, recompute, dropout):
    """A pre-norm layer's tail, ``h + mlp(norm(h))``, under non-reentrant checkpointing with LoRA adapters on
    all three projections: with ``recompute`` and no dropout the MLP saves its tensors before it runs, the
    recompute stops there, and the step runs the GLU's forward once per tile (forward only); otherwise twice
    (forward and recompute). The gradients are those of the same layer without checkpointing, bit for bit."""
    calls = []
    original = mlp_module._glu_fwd
    monkeypatch.setattr(mlp_module, "_glu_fwd", lambda *a, **k: calls.append(1) or original(*a, **k))
    m = make_inputs(37, 24, 40, bias=True)

    def step(checkpointed):
        torch.manual_seed(3)  # the same dropout masks in both runs
        ab = [
            (a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in lora_leaves(24, 40, 4, None)
        ]
        x = m["x"].clone().requires_grad_()
        ws = [m[k].clone().requires_grad_() for k in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")]
        adapters = tuple(LoraAdapter(a, b, 2.0, dropout) for a, b in ab)

        def tail(h, *ws):
            h = torch.nn.functional.rms_norm(h, (24,))
            gate, up, down, b_gate, b_up, b_down = ws
            kw = {"b_gate": b_gate, "b_up": b_up, "b_down": b_down, "adapters": adapters}
            return h + gated_mlp(h, gate, up, down, recompute=recompute, tile=10, **kw)

        run = torch.utils.checkpoint.checkpoint if checkpointed else lambda f, *a, **k: f(*a)
        y = run(tail, x, *ws, use_reentrant=False)
        calls.clear()
        leaves = [x, *ws, *(t for pair in ab for t in pair)]
        return torch.autograd.grad(y.square().sum(), leaves), len(calls)

    plain, replays_plain = step(False)
    ckpt, replays_ckpt = step(True)
    assert replays_plain == 0
    assert replays_ckpt == (0 if recompute and not dropout else 4)  # 37 rows in tiles of 10
    for a, b in zip(ckpt, plain, strict=True):
        assert torch.equal(a, b)


def test_held_input_without_grad_gets_no_input_gradient(monkeypatch):
    """Trainable weights, an input without grad (a first layer under frozen embeddings): the held node's
    output needs a gradient for the weights' sake, but no tile computes ``dx`` (one ``grad_input``, for
    ``dh``, per tile), and the weights' gradients are those of the path that saves ``g`` and ``u``."""
    calls = []
    original = mlp_module.grad_input
    monkeypatch.setattr(mlp_module, "grad_input", lambda *a, **k: calls.append(1) or original(*a, **k))
    m = make_inputs(20, 16, 24, bias=False)

    def weight_grads(recompute):
        ws = [m[k].clone().requires_grad_() for k in ("w_gate", "w_up", "w_down")]
        gated_mlp(m["x"], *ws, recompute=recompute, tile=8).square().sum().backward()
        return [w.grad for w in ws]

    held = weight_grads(True)
    assert len(calls) == 3  # 20 rows in tiles of 8
    for a, b in zip(held, weight_grads(False), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("tile", [0, -3, 2.5, True])
def test_bad_tile_is_refused(tile):
    m = make_inputs(4, 8, 12, bias=False)
    with pytest.raises(ValueError, match="tile must be a positive int or None"):
        gated_mlp(m["x"], m["w_gate"], m["w_up"], m["w_down"], tile=tile)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [256, 1000])
def test_tiled_odd_real_widths_gpu(tile):
    """bf16 on CUDA, H = 2000 and I = 5461, 1031 tokens: tiles that divide nothing, each weight's gradient a
    sum over 2 to 5 tiles."""
    masters = make_inputs(1031, 2000, 5461, bias=True, device="cuda")
    dy = torch.randn(1031, 2000, device="cuda")
    y_ref, g_ref = run(gated_mlp_ref, masters, torch.float64, dy)
    y_tch, g_tch = run(gated_mlp_ref, masters, torch.bfloat16, dy)
    y, g = run(gated_mlp, masters, torch.bfloat16, dy, recompute=True, tile=tile)
    assert_close_to_ref(y, y_ref, y_tch, "y")
    for name in g_ref:
        assert_close_to_ref(g[name], g_ref[name], g_tch[name], f"d{name}")
