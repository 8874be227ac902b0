"""torch.compile of a kernel call against the same call in eager mode, each test in a fresh process."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.tolerances import assert_close_to_ref

_CHILD = "CHUNKLOSS_COMPILE_TEST_CHILD"
_ROOT = Path(__file__).resolve().parents[2]


def in_fresh_process(test):
    """Runs the decorated test in a child pytest process of its own.

    With earlier compilations in the same process, torch 2.13's CPU build has failed in the dispatch of a
    custom op on fake tensors while tracing: a segfault, or (in a process shared with other tests, sometimes)
    ``schema_.has_value() INTERNAL ASSERT FAILED`` for ``chunkloss::glu_fwd``. Alone in a process it passes.
    """

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if os.environ.get(_CHILD):
            return test(*args, **kwargs)
        node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node]
        env = {**os.environ, _CHILD: "1"}
        done = subprocess.run(command, env=env, cwd=_ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

    return wrapper


def compiled_matches_eager(fn, inputs, seed=0, values=True):
    """``fn`` compiled whole (``fullgraph=True``: a graph break fails) gives eager's outputs and gradients
    (fp32 inputs): within the fp32 tolerance (AOTAutograd may decompose an op, e.g. ``addmm`` with ``alpha``,
    and round differently), or with ``values=False`` (random numbers drawn differently) the same shapes and
    dtypes.

    ``aot_eager`` traces the forward and the backward as torch.compile does and runs them op by op, so the
    check needs no C++ or GPU compiler; the Triton launches are custom ops it does not trace into.
    """
    torch._dynamo.reset()
    results = []
    for run_fn in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        torch.manual_seed(seed)
        outs = run_fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = sum((o.float() * (i + 1)).square().sum() for i, o in enumerate(outs))
        results.append((outs, torch.autograd.grad(loss, [t for t in inputs if t.requires_grad])))
    (eager, g_eager), (compiled, g_compiled) = results
    for a, b in zip((*eager, *g_eager), (*compiled, *g_compiled), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        if values:
            assert_close_to_ref(b, a, name="compiled")
