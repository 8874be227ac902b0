"""Engine-level A/B of chunk sizes, interleaved, and the host's aten ops before a step's first GEMM.

PYTHONPATH=. python benchmarks/results/dev/s13/probe_ab.py OUT_DIR

Part 1: for each case, chunkloss at automatic chunks and at fixed sizes, each measured
(``harness.measure``, 5 repeats) in 3 interleaved rounds; the median over the rounds' medians. Part 2:
one profiled step (CPU + CUDA, no Python stacks) per case: the host's top-level aten ops from the step's
start to the launch of its first GEMM, by name (count, host ms)."""

import dataclasses
import importlib
import json
import pathlib
import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.bench_losses import _case_modules
from benchmarks.gemm_share import GEMM
from benchmarks.harness import measure
from chunkloss import FusedLinearBase

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
mods = [importlib.import_module(f"benchmarks.{m}") for m in _case_modules(None)]
cases = {c.name: c for m in mods for c in m.cases()}
plan = {
    "grpo dapo B=16 T=1024": [None, 2048, 2560, 3072],
    "ce N=32768": [None, 2048, 3072, 6144],
    "orpo 8x1024": [None, 1536, 3072],
    "dpo+ref 8x1024": [None, 1536, 3072],
}


def loss_of(fn) -> FusedLinearBase:
    cells = [c.cell_contents for c in (fn.__closure__ or ())]
    return next(c for c in cells if isinstance(c, FusedLinearBase))


results = {}
for name, sizes in plan.items():
    case = cases[name]
    inp = case.make_inputs(torch.device("cuda"))
    fn = case.impls["chunkloss"]
    loss = loss_of(fn)
    base = loss.options
    per = defaultdict(list)
    for _ in range(3):
        for cs in sizes:
            loss.options = dataclasses.replace(base, chunk_size=cs)
            per[str(cs)].append(measure(fn, inp, repeats=5)["ms"])
    loss.options = base
    results[name] = {
        k: {"rounds": v, "median": statistics.median(v), "x_floor": statistics.median(v) / case.floor_ms}
        for k, v in per.items()
    }
    print(
        name,
        {
            k: f"{v['median']:.2f} ({v['x_floor']:.3f}x) {[round(x, 1) for x in v['rounds']]}"
            for k, v in results[name].items()
        },
        flush=True,
    )

    # Part 2: host ops before the first GEMM.
    leaves = [t for t in inp.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        for t in leaves:
            t.grad = None
        fn(inp).backward()

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("STEP"):
            step()
        torch.cuda.synchronize()
    evs = list(prof.events())
    mark = next(e for e in evs if e.name == "STEP" and e.device_type == torch.autograd.DeviceType.CPU)
    t0 = mark.time_range.start
    kern = sorted(
        (e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA and GEMM.search(e.name)),
        key=lambda e: e.time_range.start,
    )
    first = kern[0]
    # The CPU op that launched it: the kernel's correlated runtime call lies inside its CPU parent's range.
    launch_t = min(
        (
            e.time_range.start
            for e in evs
            if e.device_type == torch.autograd.DeviceType.CPU
            and e.name in ("aten::mm", "aten::addmm", "aten::matmul")
            and e.time_range.start >= t0
        ),
        default=first.time_range.start,
    )
    top = [
        e
        for e in evs
        if e.device_type == torch.autograd.DeviceType.CPU
        and e.name.startswith("aten::")
        and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
        and t0 <= e.time_range.start < launch_t
    ]
    agg = defaultdict(lambda: [0, 0.0])
    for e in top:
        agg[e.name][0] += 1
        agg[e.name][1] += (e.time_range.end - e.time_range.start) / 1e3
    print(
        f"  host: first mm op at +{(launch_t - t0) / 1e3:.3f} ms, first GEMM runs at "
        f"+{(first.time_range.start - t0) / 1e3:.3f} ms; top-level ops before it: {len(top)}, "
        f"{sum(v[1] for v in agg.values()):.3f} ms"
    )
    for k, (n, ms) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"    {ms:7.3f} ms {n:4d}x {k}")
    torch.cuda.empty_cache()
(out / "ab.json").write_text(json.dumps(results, indent=1))
