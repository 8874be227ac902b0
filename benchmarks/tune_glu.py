"""Sweep the SwiGLU / GeGLU launch constants (``chunkloss.kernels.glu.BLOCK_SIZE`` and ``NUM_WARPS``) on one
CUDA GPU: forward + backward at 8192 x 14336, bf16, timed in a CUDA graph, beside torch.compile.

    python -m benchmarks.tune_glu [--out tune_glu.json]
"""

import argparse
import itertools
import json

import torch


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import triton.testing
    from chunkloss.kernels import geglu, geglu_ref, glu, swiglu, swiglu_ref

    rows, cols = 8192, 14336
    floor = 8 * rows * cols * 2 / 3.0e12 * 1e3  # fwd: read a, b, write c; bwd: read dc, a, b, write da, db
    x = [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    dc = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    results = []
    for name, ours, ref in (("swiglu", swiglu, swiglu_ref), ("geglu", geglu, geglu_ref)):
        compiled = torch.compile(ref)

        def bench(fn):
            return triton.testing.do_bench_cudagraph(lambda: torch.autograd.grad(fn(*x), x, dc), rep=30)

        base = {"compile": bench(compiled)}
        print(f"{name}: floor {floor:.3f} ms, torch.compile {base['compile']:.3f} ms", flush=True)
        timed = []
        defaults = (glu.BLOCK_SIZE, glu.NUM_WARPS)
        for block, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
            glu.BLOCK_SIZE, glu.NUM_WARPS = block, warps
            try:
                ms = bench(ours)
            except Exception as exc:  # noqa: BLE001 - e.g. out of resources
                print(f"  {block} x {warps}: {type(exc).__name__}", flush=True)
                continue
            finally:
                glu.BLOCK_SIZE, glu.NUM_WARPS = defaults
            timed.append((ms, block, warps))
            results.append({"op": name, "block": block, "warps": warps, "ms": ms, "floor_ms": floor, **base})
        for ms, block, warps in sorted(timed)[:5]:
            print(f"  {ms:.3f} ms  BLOCK_SIZE={block} NUM_WARPS={warps}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
