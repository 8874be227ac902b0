"""Tune the launch knobs of RMSNorm / LayerNorm (``chunkloss.kernels._utils.NormKnobs``).

GPU sweep (one CUDA GPU): forward + backward at 16384 rows, bf16, for each configuration of the fused path
(one register tile per row) and of the looped path (two passes over column blocks). Timed inside a CUDA graph
(``triton.testing.do_bench_cudagraph``) so the host's launch overhead, the same for every configuration, does
not hide the kernels' differences; the plain ``do_bench`` time of the defaults is printed beside it:

    python -m benchmarks.tune_norms [--widths 4096 8192] [--paths fused looped] [--out tune_norms.json]

Register report (no GPU needed): compiles every kernel configuration for sm_90 and runs ptxas, printing
registers per thread, spill bytes and how many programs fit on an SM by registers:

    python -m benchmarks.tune_norms --regs
"""

import argparse
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

FUSED_GRID = {  # fused path, rows up to the tile
    "tile_elems": (4096, 8192),
    "warp_scale": (1.0, 2.0),
    "bwd_programs_per_sm": (2, 4, 8, 16),
    "bwd_stages": (0, 2, 3),
}
LOOPED_GRID = {  # looped path; more rows per step mean fewer read-add-writes of the fp32 dW partial row
    "loop_block_n": (512, 1024, 2048, 4096),
    "loop_warps": (4, 8, 16),
    "loop_block_m": (1, 2, 4),
    "loop_bwd_programs_per_sm": (1, 2, 4, 8),
}
ROWS = 16384


def _configs(path: str, width: int):
    """(knob changes) for every configuration of `path` that applies at `width`."""
    grid = FUSED_GRID if path == "fused" else LOOPED_GRID
    for values in itertools.product(*grid.values()):
        changes = dict(zip(grid, values))
        if path == "fused":
            changes["bwd_programs_per_sm_wide"] = changes["bwd_programs_per_sm"]
            changes["bwd_stages_wide"] = changes["bwd_stages"]
            changes["max_fused_cols"] = 1 << 30
        else:
            if changes["loop_block_n"] > width:
                continue
            changes["max_fused_cols"] = 0
        yield changes


def sweep(width, paths, out):
    """Time the defaults and every configuration of `paths` at `width`; print the best five of each."""
    import triton.testing
    from chunkloss.kernels import layer_norm, rms_norm
    from chunkloss.kernels._utils import KNOBS, norm_bwd_plan, norm_fwd_plan, norm_knobs

    x = torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(width, device="cuda") * 0.1 + 1).to(torch.bfloat16).requires_grad_()
    b = (torch.randn(width, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    floor = 5 * ROWS * width * 2 / 3.0e12 * 1e3  # read x, write y; read dy and x, write dx (ms at 3 TB/s)
    steps = {"rms": lambda: torch.autograd.grad(rms_norm(x, w, 1e-6), (x, w), dy),
             "ln": lambda: torch.autograd.grad(layer_norm(x, w, b, 1e-5), (x, w, b), dy)}
    results = []
    default_path = "looped" if width > KNOBS.max_fused_cols else "fused"
    fwd = {"rms": lambda: rms_norm(x, w, 1e-6), "ln": lambda: layer_norm(x, w, b, 1e-5)}
    for op, step in steps.items():
        with torch.no_grad():
            fwd_ms = triton.testing.do_bench_cudagraph(fwd[op], rep=20, return_mode="median")
        print(f"D={width} {op}: forward alone {fwd_ms:.3f} ms (floor {floor * 2 / 5:.3f})", flush=True)
        graph_ms = triton.testing.do_bench_cudagraph(step, rep=20, return_mode="median")
        plain_ms = triton.testing.do_bench(step, warmup=10, rep=50, return_mode="median")
        print(f"D={width} {op}: floor {floor:.3f} ms | defaults ({default_path}): {graph_ms:.3f} ms in a "
              f"graph, {plain_ms:.3f} ms launched from Python", flush=True)
        results.append({"width": width, "op": op, "path": "default", "graph_ms": graph_ms,
                        "plain_ms": plain_ms, "floor_ms": floor})
    for path in paths:
        timed, seen = [], set()
        for changes in _configs(path, width):
            with norm_knobs(**changes) as knobs:
                plans = (norm_fwd_plan(ROWS, width, knobs), norm_bwd_plan(ROWS, width, x.device, knobs))
                if plans in seen:  # e.g. tile_elems below the row width: one row per program either way
                    continue
                seen.add(plans)
                try:
                    times = {op: triton.testing.do_bench_cudagraph(step, rep=10, return_mode="median")
                             for op, step in steps.items()}
                except Exception as exc:  # noqa: BLE001 - e.g. out of resources: skip the configuration
                    print(f"  D={width} {path} {changes}: {type(exc).__name__}", flush=True)
                    continue
            timed.append((times, changes))
            results.append({"width": width, "path": path, "knobs": changes, "floor_ms": floor,
                            **{f"{op}_graph_ms": t for op, t in times.items()}})
        for op in steps:
            timed.sort(key=lambda r, op=op: r[0][op])
            print(f"D={width} {op} {path}: best of {len(timed)}", flush=True)
            for times, changes in timed[:5]:
                knobs = {k: v for k, v in changes.items() if k in FUSED_GRID or k in LOOPED_GRID}
                print(f"   {times[op]:.3f} ms ({floor / times[op]:.0%} of floor)  {knobs}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": ROWS, "results": results}, f, indent=1)
        print(f"wrote {out}")


# Pointer arguments that are fp32 whatever the input dtype; the other UPPER-case pointers are bf16 here.
FP32_POINTERS = {"RSTD", "STATS", "DW_PARTIAL", "PARTIALS"}


def _signature(kernel):
    sig = {}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.isupper():
            sig[p.name] = "*fp32" if p.name in FP32_POINTERS else "*bf16"
        else:
            sig[p.name] = "fp32" if p.name in ("eps", "offset") else "i32"
    return sig


def ptxas_report(kernel, constexprs, num_warps):
    """(registers per thread, spill store bytes, spill load bytes) of `kernel` compiled for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(kernel, _signature(kernel), constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return regs, int(spill.group(1)), int(spill.group(2))


def regs():
    os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even where tests set the interpreter
    rms = importlib.import_module("chunkloss.kernels.rms_norm")
    ln = importlib.import_module("chunkloss.kernels.layer_norm")
    from chunkloss.kernels._utils import KNOBS, norm_bwd_plan, norm_fwd_plan

    def report(name, kernel, constexprs, num_warps):
        r, st, ld = ptxas_report(kernel, constexprs, num_warps)
        per_sm = min(65536 // (max(r, 8) * 32 * num_warps), 64 // num_warps)
        tiles = {k: v for k, v in constexprs.items() if k.startswith("BLOCK")}
        print(f"{name:<30} {str(tiles):<36} warps={num_warps:<3} regs={r:<4} spill st/ld={st}/{ld} B  "
              f"programs/SM by regs={per_sm}", flush=True)

    def kernels(plan_looped, block_m, block_n, warps):
        fwd = {"BLOCK_N": block_n} if plan_looped else {"BLOCK_M": block_m, "BLOCK_N": block_n}
        bwd = {"BLOCK_M": block_m, "BLOCK_N": block_n}
        suffix = "_looped" if plan_looped else ""
        grads = {"HAS_DX": True, "HAS_DW": True}
        report(f"rms fwd{suffix}", getattr(rms, f"_rms_norm_fwd{suffix}_kernel"),
               {"CAST_LLAMA": True, **fwd}, warps)
        report(f"rms bwd{suffix}", getattr(rms, f"_rms_norm_bwd{suffix}_kernel"),
               {"CAST_LLAMA": True, **grads, **bwd}, warps)
        report(f"ln fwd{suffix}", getattr(ln, f"_layer_norm_fwd{suffix}_kernel"),
               {"HAS_BIAS": True, **fwd}, warps)
        report(f"ln bwd{suffix}", getattr(ln, f"_layer_norm_bwd{suffix}_kernel"),
               {**grads, "HAS_DB": True, **bwd}, warps)

    print("Defaults (NormKnobs()) at 16384 rows:")
    for width in (2048, 4096, 8192, 16384):
        f, b = norm_fwd_plan(ROWS, width, KNOBS), norm_bwd_plan(ROWS, width, torch.device("cpu"), KNOBS)
        print(f"D={width}: fwd {f}, bwd {b}")
        kernels(f.looped, b.block_m, b.block_n, b.num_warps)
    print("Looped configurations:")
    for block_n, warps, block_m in itertools.product(*(LOOPED_GRID[k] for k in
                                                       ("loop_block_n", "loop_warps", "loop_block_m"))):
        kernels(True, block_m, block_n, warps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regs", action="store_true", help="ptxas register / spill report, no GPU needed")
    parser.add_argument("--widths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--paths", nargs="+", choices=("fused", "looped"), default=None,
                        help="default: fused up to 8192 columns, looped from 4096 on")
    parser.add_argument("--out", default=None, help="also write every timing to this json file")
    parser.add_argument("--set", nargs="+", default=[], metavar="KNOB=V1,V2",
                        help="replace a knob's values in the grid, e.g. bwd_programs_per_sm=1,2")
    args = parser.parse_args()
    for item in args.set:
        name, values = item.split("=")
        grid = FUSED_GRID if name in FUSED_GRID else LOOPED_GRID
        if name not in grid:
            sys.exit(f"--set: {name} is not a knob of the grid ({sorted(FUSED_GRID) + sorted(LOOPED_GRID)})")
        grid[name] = tuple(type(grid[name][0])(v) for v in values.split(","))
    if args.regs:
        regs()
        return
    if not torch.cuda.is_available():
        sys.exit("tune_norms.py needs a CUDA GPU for the sweep (--regs runs without one).")
    for width in args.widths:
        paths = args.paths or [p for p, ok in (("fused", width <= 8192), ("looped", width >= 4096)) if ok]
        sweep(width, paths, args.out and args.out.replace(".json", f"_{width}.json"))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
