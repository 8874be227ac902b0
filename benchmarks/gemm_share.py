"""Where a chunkloss step's time goes: its GEMMs, its row kernels and the rest, per benchmark case.

For each case of ``bench_losses`` (chunkloss's implementation only) this times forward + backward with CUDA
events (median of ``--repeats`` after warm-up, as the harness does) and profiles three more steps, summing the
device time of every kernel by class:

- ``gemm``: cuBLAS's GEMMs and chunkloss's own Triton weight-gradient GEMM (``kernels/weight_grad.py``);
- ``row``: chunkloss's Triton row kernels (the loss step over a chunk's logits, backward's scale);
- ``other``: everything else (gathers, casts, memsets, compiled elementwise graphs, copies).

``gemm / floor`` is the GEMMs' own time over the case's GEMM floor (FLOPs at 800 TFLOP/s): the step can reach
``1.15x`` the floor only if that share plus the rest stays under it. A square 8192³ bf16 GEMM is timed before
and after the cases (triton's do_bench median), so the run records what this card's cuBLAS reaches that day.

python -m benchmarks.gemm_share --out DIR [--only "ce N=8192,jsd N=8192"] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_losses import cases_by_name
from benchmarks.gemm_ceiling import bench
from benchmarks.harness import PEAK_TFLOPS, _grad_leaves, measure

GEMM = re.compile(r"gemm|nvjet|xmma|cutlass|_finish_kernel", re.IGNORECASE)
ROW = re.compile(
    r"_cross_entropy_step_kernel|_row_stats_kernel|_row_grad_kernel|_jsd_step_kernel|_scale_kernel"
)
DEFAULT_CASES = (
    "ce N=8192",
    "ce N=32768",
    "grpo dapo B=16 T=1024",
    "grpo dapo B=2 T=16384",
    "orpo 8x1024",
    "dpo+ref 8x1024",
    "jsd N=8192",
    "jsd N=16384",
)


def kernel_class(name: str) -> str:
    if GEMM.search(name):
        return "gemm"
    if ROW.search(name):
        return "row"
    return "other"


def square_gemm_tflops(n: int = 8192) -> float:
    """cuBLAS's bf16 rate on an n³ GEMM of random data (``gemm_ceiling.bench``: do_bench's median)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / (bench(lambda: a @ b) * 1e-3) / 1e12


def profile_case(case, repeats: int) -> dict:
    inputs = case.make_inputs(torch.device("cuda"))
    fn = case.impls["chunkloss"]
    timed = measure(fn, inputs, repeats=repeats)
    leaves = _grad_leaves(inputs)

    def step():
        for t in leaves:
            t.grad = None
        fn(inputs).backward()

    steps = 3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_class: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = e.device_time / 1e3 / steps
        per_class[kernel_class(e.name)] += ms
        per_kernel[e.name] += ms
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]
    row = {
        "case": case.name,
        "floor_ms": case.floor_ms,
        "ms": timed["ms"],
        "ms_all": timed["ms_all"],
        "x_floor": timed["ms"] / case.floor_ms,
        "gemm_ms": per_class["gemm"],
        "row_ms": per_class["row"],
        "other_ms": per_class["other"],
        "busy_ms": sum(per_class.values()),
        "gemm_x_floor": per_class["gemm"] / case.floor_ms,
        "top_kernels": [{"name": k[:120], "ms": v, "class": kernel_class(k)} for k, v in top],
    }
    return row


def markdown(rows: list[dict], device: str, square: tuple[float, float]) -> str:
    lines = [
        f"# Where the step's time goes ({device}, torch {torch.__version__})",
        "",
        "`python -m benchmarks.gemm_share`: chunkloss forward + backward per case, bf16, H=4096, V=128256. "
        "'step' is the CUDA-event median; the classes are the profiler's device time per step over "
        "three more steps (gemm: cuBLAS and chunkloss's Triton weight-gradient GEMM; row: chunkloss's "
        "row kernels). "
        f"Floor: the GEMMs' FLOPs at {PEAK_TFLOPS:.0f} TFLOP/s. "
        f"cuBLAS 8192³ bf16 on this card: {square[0]:.0f} TFLOP/s before the cases, {square[1]:.0f} after.",
        "",
        "| case | floor ms | step ms | step × floor | gemm ms | gemm × floor | row ms | other ms | busy ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['floor_ms']:.1f} | {r['ms']:.1f} | {r['x_floor']:.3f} | "
            f"{r['gemm_ms']:.1f} | {r['gemm_x_floor']:.3f} | {r['row_ms']:.2f} | {r['other_ms']:.2f} | "
            f"{r['busy_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=",".join(DEFAULT_CASES), help="comma-separated case names")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    wanted = [s.strip() for s in a.only.split(",") if s.strip()]
    by_name = cases_by_name()
    missing = [w for w in wanted if w not in by_name]
    if missing:
        raise SystemExit(f"no benchmark case named {missing}; known: {sorted(by_name)}")
    before = square_gemm_tflops()
    rows = []
    for name in wanted:
        r = profile_case(by_name[name], a.repeats)
        torch.cuda.empty_cache()
        print(
            f"{name}: step {r['ms']:.2f} ms ({r['x_floor']:.3f}x floor {r['floor_ms']:.1f}); "
            f"gemm {r['gemm_ms']:.2f} ({r['gemm_x_floor']:.3f}x), row {r['row_ms']:.2f}, "
            f"other {r['other_ms']:.2f}",
            flush=True,
        )
        for k in r["top_kernels"]:
            print(f"    {k['class']:5s} {k['ms']:8.3f}  {k['name'][:100]}")
        rows.append(r)
    after = square_gemm_tflops()
    device = torch.cuda.get_device_name()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": device, "torch": torch.__version__, "square_8192_tflops": [before, after], "rows": rows}
    (out / "gemm_share.json").write_text(json.dumps(doc, indent=1))
    (out / "gemm_share.md").write_text(markdown(rows, device, (before, after)))
    print(markdown(rows, device, (before, after)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
