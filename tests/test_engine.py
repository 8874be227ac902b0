"""The engine itself: recompilation across shapes, extension by subclassing, retain_graph refusal."""

import sys
import types
from pathlib import Path

import pytest
import torch

from chunkloss import FusedLinearCrossEntropyLoss


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


# --- The README's extension example: a focal loss in a few lines ----------------------------------
def _readme_example() -> types.ModuleType:
    """The README's "Writing a new loss" code block, run as a module: the test checks the code users read."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    code = text.split("## Writing a new loss", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    module = types.ModuleType("readme_focal_example")
    sys.modules[module.__name__] = module  # dataclasses look their class's module up
    exec(compile(code, "README.md", "exec"), module.__dict__)
    module.lines = [ln for ln in code.splitlines() if ln.strip() and not ln.startswith(("import", "from"))]
    return module


README_EXAMPLE = _readme_example()
FusedLinearFocalLoss = README_EXAMPLE.FusedLinearFocalLoss


def test_readme_example_is_short():
    """The issue's promise: a new loss in at most 15 lines (imports aside)."""
    assert len(README_EXAMPLE.lines) <= 15, README_EXAMPLE.lines


@pytest.mark.parametrize("compile", [False, True])
def test_focal_loss_subclass(compile):
    hidden = torch.randn(3, 11, 8, requires_grad=True)
    weight = torch.randn(29, 8, requires_grad=True)
    labels = torch.randint(0, 29, (3, 11))
    labels[0, :4] = -100
    loss = FusedLinearFocalLoss(chunk_size=5, gamma=2.0, compile=compile)(hidden, weight, labels)
    got = torch.autograd.grad(loss, (hidden, weight))
    logp = torch.log_softmax(hidden @ weight.t(), -1)
    valid = labels != -100
    lp = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)[valid]
    ref = (-((1 - lp.exp()) ** 2) * lp).mean()
    want = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(loss, ref)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


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
    from chunkloss import base

    calls = []

    def failing_compile(fn):
        def compiled(*args):
            calls.append(1)
            raise error()

        return compiled

    monkeypatch.setattr(base.torch, "compile", failing_compile)
    step = base._RowDynamic(lambda logits, k: logits * k)
    x = torch.arange(6.0).reshape(3, 2)
    with pytest.warns(RuntimeWarning, match="runs eagerly from now on"):
        out = step(x, 2.0)
    torch.testing.assert_close(out, x * 2.0)
    torch.testing.assert_close(step(x, 3.0), x * 3.0)
    assert len(calls) == 1
