"""Where the GPU idles inside one chunkloss step, as the harness times it (a sync before each step).

PYTHONPATH=. python benchmarks/results/dev/s13/probe_idle.py OUT_DIR ["ce N=8192,grpo dapo B=16 T=1024"]

Per case: three steps, each after torch.cuda.synchronize() as ``harness.measure`` runs them, under the
profiler (CPU + CUDA, Python stacks). Prints per step the span from the step's start on the host to its
last kernel's end, the kernels' busy time, the idle before the first GEMM and every gap over 50 us with
the kernels around it, and with "stack" writes one gzipped chrome trace per case."""

import gzip
import importlib
import pathlib
import re
import shutil
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.bench_losses import _case_modules
from benchmarks.gemm_share import GEMM

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
wanted = (sys.argv[2] if len(sys.argv) > 2 else "ce N=8192,grpo dapo B=16 T=1024,dpo+ref 8x1024").split(",")
STACK = len(sys.argv) > 3 and sys.argv[3] == "stack"
mods = [importlib.import_module(f"benchmarks.{m}") for m in _case_modules(None)]
cases = {c.name: c for m in mods for c in m.cases()}

for name in wanted:
    case = cases[name]
    inp = case.make_inputs(torch.device("cuda"))
    fn = case.impls["chunkloss"]
    leaves = [t for t in inp.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        for t in leaves:
            t.grad = None
        fn(inp).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=STACK) as prof:
        for i in range(3):
            torch.cuda.synchronize()
            with record_function(f"STEP{i}"):
                step()
            torch.cuda.synchronize()
    evs = list(prof.events())
    kern = sorted(
        (e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    print(f"== {name}")
    for i in range(3):
        mark = next(e for e in evs if e.name == f"STEP{i}" and e.device_type == torch.autograd.DeviceType.CPU)
        t0, t1 = mark.time_range.start, mark.time_range.end
        ks = [k for k in kern if t0 <= k.time_range.start and not k.name.startswith("STEP")]
        nxt = next((e for e in evs if e.name == f"STEP{i + 1}"), None)
        if nxt is not None:
            ks = [k for k in ks if k.time_range.start < nxt.time_range.start]
        end = max(k.time_range.end for k in ks)
        busy = sum(k.time_range.end - k.time_range.start for k in ks)
        first_gemm = next(k for k in ks if GEMM.search(k.name))
        after = [k for k in ks if k.time_range.start >= first_gemm.time_range.start]
        busy_after = sum(k.time_range.end - k.time_range.start for k in after)
        print(
            f"step {i}: idle after the first GEMM "
            f"{(end - first_gemm.time_range.start - busy_after) / 1e3:.2f} ms"
        )
        print(
            f"step {i}: host call {(t1 - t0) / 1e3:.2f} ms, "
            f"span host start -> last kernel {(end - t0) / 1e3:.2f} ms, "
            f"busy {busy / 1e3:.2f}, idle {(end - t0 - busy) / 1e3:.2f}; first kernel at "
            f"+{(ks[0].time_range.start - t0) / 1e3:.3f} ms, "
            f"first GEMM at +{(first_gemm.time_range.start - t0) / 1e3:.3f} ms, "
            f"{len(ks)} kernels"
        )
        cur = t0
        for k in ks:
            gap = k.time_range.start - cur
            if gap > 50:
                print(f"    gap {gap / 1e3:.3f} ms at +{(cur - t0) / 1e3:.3f} before {k.name[:70]}")
            cur = max(cur, k.time_range.end)
    if STACK:
        trace = out / f"trace_{re.sub('[^A-Za-z0-9]+', '_', name)}.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        trace.unlink()
    torch.cuda.empty_cache()
