"""GPU benchmark of the chunked losses against every installed peer, on the same inputs in one process.

    python -m benchmarks.bench_losses [--only ce,dpo] [--out benchmarks/results] [--repeats 7]
    python -m benchmarks.bench_losses --only medusa --name medusa    # the multi-token heads' set

Loads ``benchmarks/cases_*.py`` (each defines ``cases() -> list[Case]``; ``cases_medusa`` only when
``--only`` names it), times forward + backward of
each implementation with CUDA events (median after warm-up), measures its peak extra memory
(``report.MEMORY_DEFINITION``), and writes ``<name>.json`` (stamped with date, GPU and versions),
``<name>.md`` and ``<name>.png`` (time and memory per loss family) under ``--out``. A peer that fails or runs
out of memory is recorded as such.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import pathlib
import sys
import time

import torch

from benchmarks.harness import PEAK_TFLOPS, measure_or_error, stamp
from benchmarks.report import write_set

HERE = pathlib.Path(__file__).resolve().parent
GiB = 2**30


def _case_modules(only: list[str] | None):
    names = sorted(p.stem for p in HERE.glob("cases_*.py"))
    if only:
        return [n for n in names if n.removeprefix("cases_") in only]
    return [n for n in names if n != "cases_medusa"]


def run(only=None, repeats=7, impl_filter=None) -> list[dict]:
    """One result row per case and implementation (``harness.measure``'s fields, or ``error``)."""
    device = torch.device("cuda")
    rows = []
    for mod_name in _case_modules(only):
        mod = importlib.import_module(f"benchmarks.{mod_name}")
        for case in mod.cases():
            inputs = case.make_inputs(device)
            for impl, fn in case.impls.items():
                if impl_filter and impl not in impl_filter:
                    continue
                t0 = time.time()
                row = {"case": case.name, "group": case.group, "tokens": case.tokens, "impl": impl,
                       "floor_ms": case.floor_ms, **case.meta}  # fmt: skip
                row.update(measure_or_error(fn, inputs, repeats))
                for t in inputs.values():
                    if isinstance(t, torch.Tensor):
                        t.grad = None
                gc.collect()
                torch.cuda.empty_cache()
                rows.append(row)
                print(_fmt(row), f"[{time.time() - t0:.0f}s]", flush=True)
            del inputs
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:<28} {r['impl']:<24} {r['error']}"
    return (f"{r['case']:<28} {r['impl']:<24} {r['ms']:8.2f} ms  {r['ms'] / r['floor_ms']:5.2f}x GEMM floor  "
            f"peak extra {r['peak_extra_bytes'] / GiB:6.2f} GiB  loss {r['loss']:.5f}")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated case files, e.g. ce,dpo")
    ap.add_argument("--impls", default=None, help="comma-separated implementation names to run")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--name", default="losses", help="losses, losses_<suffix> or medusa: <out>/<name>.json, .md, .png"
    )
    args = ap.parse_args(argv)
    if args.name != "medusa" and args.name.split("_", 1)[0] != "losses":
        ap.error(f"--name must be losses, losses_<suffix> or medusa, got {args.name!r}")
    if not torch.cuda.is_available():
        print("bench_losses: no CUDA device; CPU timings would mean nothing.", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = args.only.split(",") if args.only else None
    impl_filter = set(args.impls.split(",")) if args.impls else None
    rows = run(only, args.repeats, impl_filter)
    command = "python -m benchmarks.bench_losses " + " ".join(argv if argv is not None else sys.argv[1:])
    data = {"stamp": stamp(command=command.strip()), "peak_tflops": PEAK_TFLOPS, "rows": rows}
    write_set(out, args.name, data)
    print((out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
