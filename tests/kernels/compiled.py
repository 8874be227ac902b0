"""torch.compile of a kernel call against the same call in eager mode (each test in a process of its own:
``tests.child_process.in_fresh_process``)."""

import torch

from tests.tolerances import assert_close_to_ref


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
