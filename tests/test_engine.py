"""The engine itself: recompilation across shapes, compiler fallbacks, retain_graph refusal (extension by
subclassing: tests/test_custom_losses.py)."""

import contextlib
import inspect
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chunkloss import FusedLinearCrossEntropyLoss
from chunkloss._compat import torch as torch_compat
from chunkloss.engine import compiled, loop, plan, weight_grad
from tests.tolerances import assert_close_to_ref


def test_at_most_two_graphs_as_batch_and_length_vary():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    weight = torch.randn(97, 16, requires_grad=True)
    fn = FusedLinearCrossEntropyLoss(chunk_size=64)
    for b, t in [(2, 33), (3, 50), (1, 71), (4, 29), (2, 90)]:
        hidden = torch.randn(b, t, 16, requires_grad=True)
        labels = torch.randint(0, 97, (b, t))
        labels[:, : t // 4] = -100
        fn(hidden, weight, labels).backward()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= frames <= 2, torch._dynamo.utils.counters["stats"]


def test_each_option_set_compiles_its_own_step():
    """Losses with different options each get a compiled step of their own: dynamo's recompilation limit
    (here lowered to 1) is counted per option set, not across every loss in the process, past which dynamo
    would silently run the step eagerly. Equal options share one compiled step."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    weight = torch.randn(97, 16, requires_grad=True)
    hidden = torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 97, (40,))
    with torch._dynamo.config.patch(recompile_limit=1):
        for smoothing in (0.0, 0.1, 0.2, 0.1):
            FusedLinearCrossEntropyLoss(label_smoothing=smoothing)(hidden, weight, labels).backward()
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 3, counters["stats"]
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 3, counters["frames"]


def test_backward_twice_is_refused():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    loss = FusedLinearCrossEntropyLoss(compile=False)(hidden, weight, torch.randint(0, 10, (4,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


@pytest.mark.parametrize(
    "error",
    [
        # torch 2.13's CPU inductor
        lambda: torch._dynamo.exc.BackendCompilerFailed(None, KeyError("buf9"), None),
        # torch 2.11's dynamo formatting a guard without a source location (the compiled seq_coef on an H100)
        lambda: torch._dynamo.exc.InternalTorchDynamoError("AttributeError: 'NoneType' has no 'filename'"),
    ],
    ids=["backend", "dynamo"],
)
def test_compiler_failure_falls_back_to_eager(monkeypatch, error):
    """A step the compiler cannot build runs eagerly from then on, with a RuntimeWarning, and gives the eager
    result; the compiler is not asked again."""
    calls = []

    def failing_compile(fn):
        def compiled(*args):
            calls.append(1)
            raise error()

        return compiled

    monkeypatch.setattr(compiled.torch, "compile", failing_compile)
    step = compiled.RowDynamic(lambda logits, k: logits * k)
    x = torch.arange(6.0).reshape(3, 2)
    with pytest.warns(RuntimeWarning, match="runs eagerly from now on"):
        out = step(x, 2.0)
    torch.testing.assert_close(out, x * 2.0)
    torch.testing.assert_close(step(x, 3.0), x * 3.0)
    assert len(calls) == 1


@pytest.fixture
def engine_calls(monkeypatch):
    """Counts the engine's projections (``project_head``) and fp32 weight-gradient accumulations."""
    calls = {"project": 0, "accumulate": 0}
    real_project, real_acc = loop.project_head, weight_grad.accumulate_weight_grad

    def project(*a):
        calls["project"] += 1
        return real_project(*a)

    def accumulate(*a, **kw):
        calls["accumulate"] += 1
        return real_acc(*a, **kw)

    monkeypatch.setattr(loop, "project_head", project)
    monkeypatch.setattr(weight_grad, "accumulate_weight_grad", accumulate)
    return calls


def _bf16_head(n, v=1024, h=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) * 0.05).to(torch.bfloat16)
    return hidden, weight, g


def one_chunk_on_cpu(monkeypatch):
    """The one-chunk rule is for CUDA (one GEMM into bf16); on CPU tensors the engine takes it when asked."""
    monkeypatch.setattr(plan, "ONE_CHUNK_DEVICES", (*plan.ONE_CHUNK_DEVICES, "cpu"))


@pytest.mark.parametrize(
    "valid, chunks, rule_on, bias, reduction",
    [
        (900, 1, True, False, "mean"),
        (900, 1, True, True, "none"),  # the bias's own accumulator; per-row losses rerun the loop in backward
        (1100, 3, True, False, "mean"),
        (900, 2, False, False, "mean"),
    ],
)
def test_rows_that_fit_the_accumulator_run_as_one_chunk(
    engine_calls, monkeypatch, valid, chunks, rule_on, bias, reduction
):
    """Automatic chunks with an fp32 accumulator of a bf16 weight (V=1024, H=512): all the call's rows run as
    one chunk (one GEMM in bf16, no accumulator) while their logits fit the accumulator's 4·V·H bytes, here
    1024 rows; beyond that, chunks of the 1 MiB budget (512 rows) accumulate in fp32. The gradients are the
    same. CPU tensors keep the budget's chunks unless the rule is switched on for them."""
    if rule_on:
        one_chunk_on_cpu(monkeypatch)
    hidden, weight, g = _bf16_head(1200)
    b = (torch.randn(weight.shape[0], generator=g) * 0.1).to(torch.bfloat16) if bias else None
    labels = torch.randint(0, weight.shape[0], (hidden.shape[0],), generator=g)
    labels[valid:] = -100

    def run(**opts):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, b) if t is not None]
        bias_leaf = leaves[2] if bias else None
        out = FusedLinearCrossEntropyLoss(reduction=reduction, **opts)(*leaves[:2], labels, bias=bias_leaf)
        out.sum().backward()
        return out.detach(), [t.grad for t in leaves]

    loss, grads = run(logits_budget_mb=1)
    # The per-row path evaluates in forward without gradients (no accumulator, so the budget's 512-row chunks:
    # 2 projections) and reruns the loop with them in backward.
    forward_only = 2 if reduction == "none" else 0
    expected = {"project": forward_only + chunks, "accumulate": 0 if chunks == 1 else chunks}
    assert engine_calls == expected, engine_calls
    # One chunk and chunks of 256 rows accumulated in fp32, each against the fp32 reference.
    ref = _plain_cross_entropy(hidden, weight, b, labels, reduction, torch.float32)
    low = _plain_cross_entropy(hidden, weight, b, labels, reduction, torch.bfloat16)
    for chunking, (out, out_grads) in {"one chunk": (loss, grads), "256 rows": run(chunk_size=256)}.items():
        for i, (o, r, t) in enumerate(zip([out, *out_grads], [ref[0], *ref[1]], [low[0], *low[1]])):
            assert_close_to_ref(o, r, t, f"{chunking}: {['loss', 'hidden', 'weight', 'bias'][i]}")


def _plain_cross_entropy(hidden, weight, bias, labels, reduction, dtype):
    """Plain PyTorch on the leaves cast to ``dtype`` (fp32: the reference; bf16: PyTorch's own error)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias) if t is not None]
    logits = leaves[0] @ leaves[1].t() + (leaves[2] if bias is not None else 0)
    out = torch.nn.functional.cross_entropy(logits, labels, reduction=reduction)
    out.sum().backward()
    return out.detach(), [t.grad for t in leaves]


def test_sequence_loss_one_chunk_only_in_one_pass(engine_calls, monkeypatch):
    """A sequence loss takes all its rows as one chunk only where it then runs in one pass (its one
    weight-gradient contribution): DPO's 4 pairs of 112 completion rows do. GRPO's entropy mask needs every
    row's entropy before any gradient (two passes, which may contribute twice) and keeps the budget's
    512-row chunks in pass 1."""
    from chunkloss import FusedLinearDPOLoss, FusedLinearGRPOLoss

    one_chunk_on_cpu(monkeypatch)
    hidden, weight, g = _bf16_head(8 * 128)
    chosen, rejected = (torch.randint(0, 1024, (4, 128), generator=g) for _ in range(2))
    chosen[:, :16] = rejected[:, :16] = -100
    x, w = hidden.view(8, 128, -1).requires_grad_(), weight.clone().requires_grad_()
    FusedLinearDPOLoss(logits_budget_mb=1)(x, w, chosen, rejected).backward()
    assert engine_calls == {"project": 1, "accumulate": 0}, engine_calls

    engine_calls.update(project=0, accumulate=0)
    ids = torch.randint(0, 1024, (8, 112), generator=g)
    mask, adv = torch.ones(8, 112), torch.randn(8, generator=g)
    x = hidden.view(8, 128, -1)[:, :112].contiguous().requires_grad_()
    FusedLinearGRPOLoss(top_entropy_quantile=0.2, logits_budget_mb=1)(x, w, ids, mask, adv).backward()
    assert engine_calls["project"] >= 3, engine_calls  # pass 1: the 896 rows in two chunks; then pass 2


class _Ops(TorchDispatchMode):
    """Records (op, output shape) of every aten op that runs inside it."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.ops.append((func.overloadpacket.__name__, tuple(out.shape)))
        return out


@pytest.mark.parametrize("kind", ["ce", "dpo-two-passes"])
@pytest.mark.parametrize("frozen", [False, True])
def test_frozen_head_costs_no_weight_gradient_work(kind, frozen):
    """A head whose weight needs no gradient (LoRA, a frozen LM head): no weight-gradient GEMM and no (V, H)
    accumulator, only the projection and the hidden gradient per chunk. With a trainable weight the same count
    finds them (the check can fail)."""
    from chunkloss import FusedLinearDPOLoss

    v, h = 37, 16
    weight = torch.randn(v, h).requires_grad_(not frozen)
    if kind == "ce":
        hidden = torch.randn(3, 20, h, requires_grad=True)
        labels = torch.randint(0, v, (3, 20))
        loss_fn, args = FusedLinearCrossEntropyLoss(chunk_size=16, compile=False), (labels,)
    else:
        hidden = torch.randn(4, 10, h, requires_grad=True)
        chosen, rejected = torch.randint(0, v, (2, 2, 10))
        loss_fn, args = FusedLinearDPOLoss(chunk_size=6, compile=False), (chosen, rejected)
    with _Ops() as mode:
        loss_fn(hidden, weight, *args).backward()
    gemms = {"mm", "addmm", "addmm_"}
    weight_sized = [op for op, shape in mode.ops if shape == (v, h)]
    assert hidden.grad is not None and (weight.grad is None) == frozen
    if frozen:
        # Per chunk: the projection (C, V) and the hidden gradient (C, H); nothing of the weight's size.
        assert weight_sized == [], weight_sized
        assert all(shape[1] in (v, h) and shape[0] != v for op, shape in mode.ops if op in gemms), mode.ops
    else:
        assert gemms & set(weight_sized), weight_sized


def test_autocast_casts_the_declared_head_arguments_only():
    """Under autocast the arguments named in ``head_args`` are cast, whatever their names, and no other
    (here an fp32 tensor called ``ref_weight`` that the loss does not declare a head's)."""
    from chunkloss.engine import FusedLinearBase

    seen = {}

    class Probe(FusedLinearBase):
        head_args = ("h", "w")

        def forward(self, h, w, ref_weight):
            seen.update(h=h.dtype, w=w.dtype, ref_weight=ref_weight.dtype)
            return h.sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        Probe()(torch.randn(2, 3), torch.randn(4, 3), ref_weight=torch.randn(4, 3))
    assert seen == {"h": torch.bfloat16, "w": torch.bfloat16, "ref_weight": torch.float32}


@pytest.mark.parametrize("autocast", [False, True])
def test_call_traces_into_one_graph(autocast, monkeypatch):
    """``__call__`` (the positional-argument check, the device and autocast handling, the casts of the head
    arguments) compiles with ``fullgraph=True``, where any graph break raises; the forward here is plain
    PyTorch, so only the call path is traced. The forward's signature is read when the class is created and
    never at a call: dynamo traces ``functools.cache``'d functions afresh, and ``inspect.signature`` has
    broken the graph."""
    from chunkloss.engine import FusedLinearBase
    from chunkloss.engine import loss as loss_module

    class Probe(FusedLinearBase):
        def forward(self, hidden, weight, labels, *, bias=None):
            logits = torch.nn.functional.linear(hidden, weight, bias)
            return torch.nn.functional.cross_entropy(logits.float(), labels)

    probe = Probe()

    def signature(*args, **kwargs):
        raise AssertionError("inspect.signature called by a loss's call")

    no_signature = types.SimpleNamespace(Parameter=inspect.Parameter, signature=signature)
    monkeypatch.setattr(loss_module, "inspect", no_signature)

    def call(hidden, weight, labels, bias):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return probe(hidden, weight, labels, bias=bias)

    inputs = torch.randn(6, 8), torch.randn(11, 8), torch.randint(0, 11, (6,)), torch.randn(11)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(call, fullgraph=True, backend="eager")(*inputs), call(*inputs))


# Past the breaks: the chunk loop reads the saved-tensor hooks through a builtin dynamo warns it cannot trace.
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin:UserWarning")
def test_call_breaks_the_graph_only_inside_the_loss():
    """Compiled around a library loss, the graph breaks where the loss itself syncs with the host (its label
    check) or builds its batch, not in ``FusedLinearBase.__call__`` nor in ``inspect``."""
    loss_fn = FusedLinearCrossEntropyLoss(compile=False)
    hidden, weight = torch.randn(2, 5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda h, w, y: loss_fn(h, w, y))(hidden, weight, labels)
    where = [(r.user_stack[-1].filename, r.user_stack[-1].name) for r in explained.break_reasons]
    assert where and where[0][1] == "check_labels", where
    assert not [w for w in where if w[0].endswith(("engine/loss.py", "inspect.py"))], where


def test_loss_runs_under_saved_tensor_hooks():
    """Activation offloading packs saved tensors through saved-tensor hooks around the whole step, and
    ``torch.func`` (the eager steps) refuses to run under them: the chunk loop runs without the hooks and
    puts them back, so the loss, its gradients and what the surrounding graph saves are as without them."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 11, 16), torch.randn(40, 16)
    labels = torch.randint(0, 40, (3, 11))
    loss_fn = FusedLinearCrossEntropyLoss(chunk_size=5, compile=False)

    def run(hooked: bool):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        packed = []

        def pack(t):
            packed.append(t.shape)
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks if hooked else contextlib.nullcontext():
            loss = loss_fn((h * 2).tanh(), w, labels)  # tanh saves its output through the hooks
            loss.backward()
        assert torch_compat.top_saved_tensor_hooks() is None
        return loss, h.grad, w.grad, packed

    plain, hooked = run(False), run(True)
    for a, b in zip(plain[:3], hooked[:3]):
        assert torch.equal(a, b)
    assert (3, 11, 16) in hooked[3]  # the hooks still saw the graph around the loss
