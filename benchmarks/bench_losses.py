"""GPU benchmark of the chunked losses against every installed peer, on the same inputs in one process.

    python -m benchmarks.bench_losses [--only ce,dpo] [--out benchmarks/results] [--repeats 7]

Loads ``benchmarks/cases_*.py`` (each defines ``cases() -> list[Case]``), times forward+backward of
each implementation with CUDA events (median after warm-up), measures peak extra memory, and writes
``losses.json``, ``losses.md`` and one PNG per loss family (time and memory vs tokens, GEMM floor
drawn) under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import pathlib
import sys
import time

import torch

from benchmarks.harness import PEAK_TFLOPS, measure

HERE = pathlib.Path(__file__).resolve().parent
GiB = 2**30


def _case_modules(only: list[str] | None):
    names = sorted(p.stem for p in HERE.glob("cases_*.py"))
    if only:
        names = [n for n in names if n.removeprefix("cases_") in only]
    return names


def cases_by_name(only: list[str] | None = None) -> dict:
    """Every benchmark case (of the ``cases_*`` files named in ``only``, or all) by its name."""
    modules = [importlib.import_module(f"benchmarks.{m}") for m in _case_modules(only)]
    return {c.name: c for mod in modules for c in mod.cases()}


def run(only=None, repeats=7, out_dir=HERE / "results", impl_filter=None) -> list[dict]:
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
                row = {
                    "case": case.name,
                    "group": case.group,
                    "tokens": case.tokens,
                    "impl": impl,
                    "floor_ms": case.floor_ms,
                    **case.meta,
                }
                try:
                    row.update(measure(fn, inputs, repeats=repeats))
                    row["x_floor"] = row["ms"] / case.floor_ms
                except torch.OutOfMemoryError:
                    row["error"] = "OOM"
                except Exception as e:  # a peer failing is a result, not a crash of the benchmark
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
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
    return (
        f"{r['case']:<28} {r['impl']:<24} {r['ms']:8.2f} ms  {r['x_floor']:5.2f}x floor  "
        f"peak +{r['peak_extra_bytes'] / GiB:6.2f} GiB  "
        f"beyond grads +{r['extra_beyond_grads_bytes'] / GiB:6.2f} GiB  "
        f"loss {r['loss']:.5f}"
    )


def markdown(rows: list[dict], device_name: str) -> str:
    lines = [
        f"# Loss benchmarks ({device_name}, bf16)",
        "",
        "Forward + backward, CUDA events, median after warm-up. "
        f"Floor = GEMM FLOPs / {PEAK_TFLOPS:.0f} TFLOP/s. "
        "Peak = max_memory_allocated during the step minus allocated before it (grads set to None first); "
        "'beyond grads' subtracts the bytes of the gradients the step returns.",
        "",
        "| case | impl | ms | × floor | peak extra GiB | beyond grads GiB | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['impl']} | {r['error']} | | | | |")
        else:
            lines.append(
                f"| {r['case']} | {r['impl']} | {r['ms']:.2f} | {r['x_floor']:.2f} | "
                f"{r['peak_extra_bytes'] / GiB:.2f} | {r['extra_beyond_grads_bytes'] / GiB:.2f} | "
                f"{r['loss']:.5f} |"
            )
    return "\n".join(lines) + "\n"


def plots(rows: list[dict], out_dir: pathlib.Path, prefix: str = "losses") -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for group in sorted({r["group"] for r in rows}):
        g = [r for r in rows if r["group"] == group and "error" not in r]
        if not g:
            continue
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
        for impl in sorted({r["impl"] for r in g}):
            pts = sorted((r["tokens"], r["ms"], r["peak_extra_bytes"] / GiB) for r in g if r["impl"] == impl)
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax_m.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=impl)
        floor = sorted({(r["tokens"], r["floor_ms"]) for r in g})
        ax_t.plot([f[0] for f in floor], [f[1] for f in floor], "k--", label="GEMM floor")
        ax_t.set(xlabel="tokens", ylabel="ms (fwd+bwd)", title=f"{group}: time", xscale="log", yscale="log")
        ax_m.set(xlabel="tokens", ylabel="peak extra GiB", title=f"{group}: memory", xscale="log")
        ax_t.legend(fontsize=7)
        ax_m.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / f"{prefix}_{group}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated case files, e.g. ce,dpo")
    ap.add_argument("--impls", default=None, help="comma-separated implementation names to run")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefix", default="losses")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_losses: no CUDA device; CPU timings would mean nothing, so nothing was run.",
            file=sys.stderr,
        )
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = args.only.split(",") if args.only else None
    impl_filter = set(args.impls.split(",")) if args.impls else None
    rows = run(only, args.repeats, out, impl_filter)
    name = torch.cuda.get_device_name()
    meta = {"device": name, "torch": torch.__version__, "peak_tflops": PEAK_TFLOPS}
    (out / f"{args.prefix}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{args.prefix}.md").write_text(markdown(rows, name))
    plots(rows, out, args.prefix)
    print(markdown(rows, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
