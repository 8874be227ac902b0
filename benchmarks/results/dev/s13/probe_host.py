"""Host time of a chunkloss step's prologue, with no profiler: where do the ~2 ms before the first GEMM go?

PYTHONPATH=. python benchmarks/results/dev/s13/probe_host.py

1. The host time of one tiny elementwise op issued right after ``torch.cuda.synchronize()``, and of the
   same op issued again at once, after an idle GPU and after a GPU that just ran a large GEMM (clocks),
   with Python's garbage collector on and off.
2. CE N=8192 and GRPO B=16 steps as ``harness.measure`` runs them: perf_counter at the step's start, at
   the end of the label check's sync (``Tensor.tolist`` returning) and at the first projection
   (``base._project``)."""

import gc
import statistics
import time

import torch

import chunkloss.base as base
from benchmarks import cases_ce, cases_grpo

labels = torch.randint(0, 1000, (8192,), device="cuda")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)


def first_op(prep, n=30):
    first, second = [], []
    for _ in range(n):
        prep()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        labels != -100
        t1 = time.perf_counter()
        labels != -100
        t2 = time.perf_counter()
        first.append((t1 - t0) * 1e3)
        second.append((t2 - t1) * 1e3)
    return f"first {statistics.median(first):.3f} ms, second {statistics.median(second):.3f} ms"


print("idle GPU:", first_op(lambda: None))
print("after an 8192^3 GEMM:", first_op(lambda: a @ a))
gc.disable()
print("after an 8192^3 GEMM, gc off:", first_op(lambda: a @ a))
gc.enable()

marks = {}
orig_project, orig_tolist = base._project, torch.Tensor.tolist


def project(*args):
    marks.setdefault("project", time.perf_counter())
    return orig_project(*args)


def tolist(self):
    out = orig_tolist(self)
    marks.setdefault("sync", time.perf_counter())
    return out


def timed_steps(fn, inp, leaves, n=12, skip=2) -> list[float]:
    """Medians over steps (after ``skip``) of the ms from a synced step's start to: the label check's sync
    returning, the first projection, forward returning, backward returning, the GPU done."""
    rows = []
    for i in range(n):
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        marks.clear()
        t0 = time.perf_counter()
        loss = fn(inp)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if i >= skip:
            rows.append([marks["sync"] - t0, marks["project"] - t0, t1 - t0, t2 - t0, t3 - t0])
    return [statistics.median(r[k] for r in rows) * 1e3 for k in range(5)]


base._project = project
torch.Tensor.tolist = tolist
for name, case in (("ce N=8192", cases_ce.cases()[0]), ("grpo dapo B=16 T=1024", cases_grpo.cases()[0])):
    inp = case.make_inputs(torch.device("cuda"))
    fn = case.impls["chunkloss"]
    leaves = [t for t in inp.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    on = timed_steps(fn, inp, leaves)
    print(
        f"{name}: sync returns +{on[0]:.3f} ms, first projection +{on[1]:.3f}, "
        f"forward returns +{on[2]:.3f}, backward returns +{on[3]:.3f}, GPU done +{on[4]:.3f}"
    )
    gc.disable()
    off = timed_steps(fn, inp, leaves)
    gc.enable()
    print(f"{name}, gc off: sync returns +{off[0]:.3f} ms, first projection +{off[1]:.3f}")
    torch.cuda.empty_cache()
