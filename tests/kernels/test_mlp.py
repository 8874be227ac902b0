"""Fused gated MLP vs its fp64 reference: outputs, every gradient, saved bytes, autocast, errors.

Three-way check (tests/tolerances.py): ``err(ours) <= K * err(torch in the same dtype) + atol`` against the
fp64 reference. CPU runs go through TRITON_INTERPRET=1; the ``gpu`` tests run real, odd widths. The LoRA
adapters inside the block are tested in tests/kernels/test_lora.py.
"""

import pytest
import torch
import transformers

from chunkloss.kernels import swiglu
from chunkloss.kernels.mlp import FusedGatedMLP, gated_mlp, gated_mlp_ref
from tests.kernels.compiled import compiled_matches_eager, in_fresh_process
from tests.tolerances import assert_close_to_ref, err

# (tokens, H, I): odd sizes everywhere, and even ones.
SHAPES = [(37, 40, 45), (32, 32, 48)]
# (activation, bias): each activation once, bias on and off (Llama's mlp_bias puts it on all three).
ACTS = [("silu", False), ("silu", True), ("gelu_tanh", False), ("gelu", True)]


def make_inputs(n, hidden, inter, bias, device=None):
    scale = hidden**-0.5  # unit-variance pre-activations, where the activations bend
    tensors = {
        "x": torch.randn(n, hidden, device=device),
        "w_gate": torch.randn(inter, hidden, device=device) * scale,
        "w_up": torch.randn(inter, hidden, device=device) * scale,
        "w_down": torch.randn(hidden, inter, device=device) * inter**-0.5,
    }
    if bias:
        for name, size in (("b_gate", inter), ("b_up", inter), ("b_down", hidden)):
            tensors[name] = torch.randn(size, device=device) * 0.3
    return tensors


def run(fn, masters, dtype, dy, **kw):
    """Output and gradients of every input (dict order) for `fn` on copies of `masters` in `dtype`."""
    leaves = {k: v.to(dtype).requires_grad_(True) for k, v in masters.items()}
    args = [leaves.pop(k) for k in ("x", "w_gate", "w_up", "w_down")]
    y = fn(*args, **leaves, **kw)
    grads = torch.autograd.grad(y, [*args, *leaves.values()], dy.to(dtype))
    return y, dict(zip(["x", "w_gate", "w_up", "w_down", *leaves], grads))


def check_three_way(masters, dtype, activation, **kw):
    dy = torch.randn(masters["x"].shape[0], masters["w_down"].shape[0], device=masters["x"].device)
    y_ref, g_ref = run(gated_mlp_ref, masters, torch.float64, dy, activation=activation)
    y_tch, g_tch = run(gated_mlp_ref, masters, dtype, dy, activation=activation)
    y, g = run(gated_mlp, masters, dtype, dy, activation=activation, **kw)
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert_close_to_ref(y, y_ref, y_tch, "y")
    for name in g_ref:
        assert_close_to_ref(g[name], g_ref[name], g_tch[name], f"d{name}")


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("activation,bias", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_mlp_matches_reference(dtype, shape, activation, bias, recompute):
    masters = make_inputs(*shape, bias)
    check_three_way(masters, dtype, activation, recompute=recompute)


@pytest.mark.parametrize("recompute", [True, False])
def test_leading_dims_and_frozen_inputs(recompute):
    """(B, T, H) input keeps its shape; a gradient is None exactly when its input does not require grad."""
    m = make_inputs(3 * 7, 24, 40, bias=True)
    x = m["x"].view(3, 7, 24).requires_grad_(False)
    w_gate = m["w_gate"].requires_grad_(True)
    y = gated_mlp(
        x,
        w_gate,
        m["w_up"],
        m["w_down"],
        b_gate=m["b_gate"],
        b_up=m["b_up"],
        b_down=m["b_down"],
        recompute=recompute,
    )
    ref = gated_mlp_ref(
        x, w_gate, m["w_up"], m["w_down"], b_gate=m["b_gate"], b_up=m["b_up"], b_down=m["b_down"]
    )
    assert y.shape == (3, 7, 24)
    assert_close_to_ref(y, ref)
    (dw,) = torch.autograd.grad(y.square().sum(), [w_gate])
    (dw_ref,) = torch.autograd.grad(ref.square().sum(), [w_gate])
    assert_close_to_ref(dw, dw_ref)


def test_one_bias_of_gate_and_up():
    m = make_inputs(9, 16, 20, bias=True)
    y = gated_mlp(m["x"], m["w_gate"], m["w_up"], m["w_down"], b_up=m["b_up"])
    torch.testing.assert_close(y, gated_mlp_ref(m["x"], m["w_gate"], m["w_up"], m["w_down"], b_up=m["b_up"]))


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while `fn` runs, parameters excluded."""
    storages = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("recompute", [True, False])
def test_saved_for_backward_is_the_input_only(recompute):
    n, hidden, inter = 19, 24, 40
    mlp = FusedGatedMLP(hidden, inter, recompute=recompute)
    x = torch.randn(n, hidden, requires_grad=True)
    expected = n * hidden if recompute else n * (hidden + 2 * inter)  # x, or x, g and u
    assert saved_bytes(lambda: mlp(x)) == 4 * expected


def test_backward_twice_with_retain_graph():
    """The kept g, u are read, not overwritten, by the backward: a second backward gives the same result."""
    m = make_inputs(11, 16, 24, bias=False)
    x = m["x"].requires_grad_(True)
    y = gated_mlp(x, m["w_gate"], m["w_up"], m["w_down"], recompute=False)
    first = torch.autograd.grad(y.sum(), [x], retain_graph=True)[0]
    torch.testing.assert_close(torch.autograd.grad(y.sum(), [x])[0], first, rtol=0, atol=0)


def test_module_matches_transformers_llama_mlp():
    config = transformers.LlamaConfig(
        hidden_size=24, intermediate_size=40, num_attention_heads=2, mlp_bias=True
    )
    hf = transformers.models.llama.modeling_llama.LlamaMLP(config)
    ours = FusedGatedMLP(24, 40, bias=True)
    assert ours.load_state_dict(hf.state_dict()) is not None  # the same parameter names and shapes
    x = torch.randn(2, 5, 24, requires_grad=True)
    assert_close_to_ref(ours(x), hf(x))
    assert "recompute=True" in repr(ours)


def test_autocast_casts_operands_like_linear():
    """fp32 parameters under bf16 autocast: bf16 output, fp32 parameter gradients, close to the same math."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = make_inputs(21, 32, 48, bias=False, device=device)
    params = {k: v.requires_grad_(True) for k, v in m.items() if k != "x"}
    with torch.autocast(device, dtype=torch.bfloat16):
        y = gated_mlp(m["x"], params["w_gate"], params["w_up"], params["w_down"])
        ref = gated_mlp_ref(m["x"], params["w_gate"], params["w_up"], params["w_down"])
    assert y.dtype == torch.bfloat16
    (dw,) = torch.autograd.grad(y.float().sum(), [params["w_down"]])
    (dw_ref,) = torch.autograd.grad(ref.float().sum(), [params["w_down"]])
    assert dw.dtype == torch.float32
    assert err(y, ref) < 2e-2 and err(dw, dw_ref) < 2e-2  # both bf16: a few bf16 ulps apart


def test_bad_arguments_raise_one_line_errors():
    m = make_inputs(4, 16, 20, bias=False)
    args = (m["x"], m["w_gate"], m["w_up"], m["w_down"])
    with pytest.raises(ValueError, match="activation must be one of"):
        gated_mlp(*args, activation="relu")
    with pytest.raises(ValueError, match=r"w_down \(H, I\)"):
        gated_mlp(m["x"], m["w_gate"], m["w_up"], m["w_down"].t())
    with pytest.raises(ValueError, match="b_down must have shape"):
        gated_mlp(*args, b_down=torch.zeros(20))
    with pytest.raises(TypeError, match="share a dtype"):
        gated_mlp(m["x"].bfloat16(), *args[1:])
    with pytest.raises(ValueError, match="activation must be one of"):
        FusedGatedMLP(16, 20, activation="tanh")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,activation,bias,recompute",
    [
        (torch.bfloat16, "silu", False, True),
        (torch.bfloat16, "silu", False, False),
        (torch.bfloat16, "gelu_tanh", True, True),
        (torch.float16, "silu", False, True),
    ],
)
def test_gated_mlp_odd_real_widths_gpu(dtype, activation, bias, recompute):
    # H = 2000 and I = 5461 are multiples of no tile; 1031 tokens leave a partial row tile.
    masters = make_inputs(1031, 2000, 5461, bias, device="cuda")
    check_three_way(masters, dtype, activation, recompute=recompute)


@pytest.mark.parametrize("recompute", [True, False])
@in_fresh_process
def test_compiles_without_graph_breaks(recompute):
    """The MLP block and the standalone SwiGLU compile as one graph (the Triton launches are custom ops there)
    and give eager's results."""
    m = make_inputs(13, 24, 40, bias=True)
    x = m["x"].requires_grad_(True)
    w_gate = m["w_gate"].requires_grad_(True)
    compiled_matches_eager(
        lambda x, w_gate: gated_mlp(x, w_gate, m["w_up"], m["w_down"], b_up=m["b_up"], recompute=recompute),
        [x, w_gate],
    )
    a, b = (torch.randn(5, 7, requires_grad=True) for _ in range(2))
    # in_place overwrites a and b in the backward: fresh copies of the leaves
    compiled_matches_eager(lambda a, b: swiglu(a * 1, b * 1, in_place=recompute), [a, b])
