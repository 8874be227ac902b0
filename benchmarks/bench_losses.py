"""GPU benchmark of the chunked losses against every installed peer, on the same inputs in one process.

    python -m benchmarks.bench_losses [--only ce,dpo] [--out benchmarks/results] [--repeats 7]
    python -m benchmarks.bench_losses --only medusa --name medusa    # the multi-token heads' set

Loads ``benchmarks/cases_*.py`` (each defines ``cases() -> list[Case]``; ``cases_medusa`` only when
``--only`` names it), measures each implementation with ``harness.measure`` and writes the set ``<name>``
under ``--out``. A peer that fails or runs out of memory is recorded as such.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
import time

import torch

from benchmarks.harness import PEAK_TFLOPS, command, error_text, free_memory, measure, stamp
from benchmarks.report import GiB, write_set

HERE = pathlib.Path(__file__).resolve().parent


def _case_modules(only: list[str] | None):
    names = sorted(p.stem for p in HERE.glob("cases_*.py"))  # medusa's only when named
    return [n for n in names if (n.removeprefix("cases_") in only if only else n != "cases_medusa")]


def run(only=None, repeats=7) -> list[dict]:
    """One result row per case and implementation (``harness.measure``'s fields, or ``error``)."""
    device = torch.device("cuda")
    rows = []
    for mod_name in _case_modules(only):
        mod = importlib.import_module(f"benchmarks.{mod_name}")
        for case in mod.cases():
            inputs = case.make_inputs(device)
            for impl, fn in case.impls.items():
                t0 = time.time()
                row = dict(case=case.name, group=case.group, tokens=case.tokens, impl=impl)
                row.update(floor_ms=case.floor_ms, **case.meta)
                try:
                    row.update(measure(fn, inputs, repeats=repeats))
                except Exception as e:  # noqa: BLE001 - a peer failing is a result, not the end of the benchmark
                    row["error"] = error_text(e)
                for t in inputs.values():
                    if isinstance(t, torch.Tensor):
                        t.grad = None
                free_memory()
                rows.append(row)
                print(_fmt(row), f"[{time.time() - t0:.0f}s]", flush=True)
            del inputs
            free_memory()
    return rows


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:<28} {r['impl']:<24} {r['error']}"
    return (
        f"{r['case']:<28} {r['impl']:<24} {r['ms']:8.2f} ms  {r['ms'] / r['floor_ms']:5.2f}x GEMM floor  "
        f"peak extra {r['peak_extra_bytes'] / GiB:6.2f} GiB  loss {r['loss']:.5f}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated case files, e.g. ce,dpo")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--name", default="losses", help="losses, losses_<suffix> or medusa: <out>/<name>.*")
    args = ap.parse_args(argv)
    if args.name != "medusa" and args.name.split("_", 1)[0] != "losses":
        ap.error(f"--name must be losses, losses_<suffix> or medusa, got {args.name!r}")
    if not torch.cuda.is_available():
        print("bench_losses: no CUDA device; CPU timings would mean nothing.", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    rows = run(args.only.split(",") if args.only else None, args.repeats)
    data = {"stamp": stamp(command=command("bench_losses", argv)), "peak_tflops": PEAK_TFLOPS, "rows": rows}
    write_set(out, args.name, data)
    print((out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
