"""Sweep the launch heuristics of the RMSNorm/LayerNorm kernels (rows per program, warps, backward
programs per SM) at several widths; prints forward+backward time per configuration.

    python -m benchmarks.tune_norms
"""

import importlib
import itertools

import torch
import triton.testing
from chunkloss.kernels import layer_norm, rms_norm

# The package re-exports functions named like their modules, so take the modules from sys.modules.
ln_mod = importlib.import_module("chunkloss.kernels.layer_norm")
rms_mod = importlib.import_module("chunkloss.kernels.rms_norm")


def main():
    rows = 16384
    base_warps = rms_mod.row_warps
    for width in (2048, 4096, 8192, 16384):
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.zeros(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        floor = 5 * rows * width * 2 / 3.0e12 * 1e3
        results = []
        for max_elems, wscale, ppsm in itertools.product((4096, 8192), (0.5, 1, 2), (2, 4, 8, 16)):
            for mod in (rms_mod, ln_mod):
                mod.rows_per_tile = lambda bn, m=max_elems: max(1, min(64, m // bn))
                mod.row_warps = lambda blk, s=wscale: max(1, min(32, int(base_warps(blk) * s)))
                mod.BWD_PROGRAMS_PER_SM = ppsm

            def rms_step():
                torch.autograd.grad(rms_norm(x, w, eps=1e-6), (x, w), dy)

            def ln_step():
                torch.autograd.grad(layer_norm(x, w, b, eps=1e-5), (x, w, b), dy)

            try:
                t_rms = triton.testing.do_bench(rms_step, warmup=10, rep=40, return_mode="median")
                t_ln = triton.testing.do_bench(ln_step, warmup=10, rep=40, return_mode="median")
            except Exception as e:  # a configuration that does not compile (too many registers)
                print(f"D={width} max_elems={max_elems} warps×{wscale} ppsm={ppsm}: {type(e).__name__}")
                continue
            results.append((t_rms, t_ln, max_elems, wscale, ppsm))
        best_r = min(results)
        best_l = min(results, key=lambda r: r[1])
        print(
            f"D={width} floor {floor:.3f} ms | best RMS {best_r[0]:.3f} ms "
            f"(max_elems={best_r[2]} warps×{best_r[3]} "
            f"ppsm={best_r[4]}) | best LN {best_l[1]:.3f} ms (max_elems={best_l[2]} warps×{best_l[3]} "
            f"ppsm={best_l[4]})",
            flush=True,
        )
        for r in sorted(results)[:5]:
            print("   rms", r)
        for r in sorted(results, key=lambda r: r[1])[:5]:
            print("   ln ", r)


if __name__ == "__main__":
    main()
