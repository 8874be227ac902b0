"""Gated MLP block (Llama's ``down(silu(gate(x)) * up(x))``), forward + backward, ours vs the alternatives.

Implementations, all on the same bf16 leaves (``x`` and the three weights need grad):

* ``eager``: transformers' ``LlamaMLP`` math in PyTorch (cuBLAS GEMMs, eager SiLU and product);
* ``compile``: the same function under ``torch.compile``;
* ``cublas_swiglu``: cuBLAS GEMMs + chunkloss's SwiGLU kernel (what ``patch`` ran before the fused MLP);
* ``liger``: cuBLAS GEMMs + Liger's SwiGLU (``LigerSwiGLUMLP``), when ``liger_kernel`` is importable;
* ``ours``: :func:`chunkloss.kernels.gated_mlp`, which saves only ``x`` and replays the gate/up GEMM;
* ``ours_saved``: the same with ``recompute=False`` (``g | u`` saved, no replayed GEMM).

Per implementation: the median time of ``repeats`` forward + backward calls (``torch.autograd.grad`` of
all four leaves) timed with CUDA events after warm-up; the bytes autograd saves for the backward (distinct
storages, weights excluded, ``x`` included); the peak memory of one call minus what was allocated before
it, the output and the gradients included (``render.CALL_PEAK_MEANING``); and the error of ``y`` and every
gradient against an fp32 evaluation of the same math (``max|err| / max|ref|``). Writes the result set
``decoder.json`` (stamped with date, GPU and versions), ``decoder.md`` and ``decoder.png`` under ``--out``
(``benchmarks.render``).

    python -m benchmarks.bench_decoder [--out benchmarks/results] [--smoke]

``--smoke`` runs tiny shapes (on CPU under ``TRITON_INTERPRET=1`` when there is no GPU) to check the
script, not to time anything.
"""

import argparse
import os
import statistics
import sys
import time

if "--smoke" in sys.argv and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read by Triton when chunkloss.kernels is imported

import torch
import torch.nn.functional as F
from chunkloss.kernels import gated_mlp, gated_mlp_ref, swiglu

from benchmarks.harness import PEAK_TFLOPS, stamp
from benchmarks.render import write_set

SHAPES = [(8192, 4096, 14336), (16384, 2048, 8192)]  # (tokens N, hidden H, intermediate I)
SMOKE_SHAPES = [(40, 48, 80)]
GRADS = ("x", "w_gate", "w_up", "w_down")


def _liger_mlp():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        print(f"liger_kernel unavailable: {exc!r}", file=sys.stderr)
        return None

    def liger(x, wg, wu, wd):  # LigerSwiGLUMLP.forward on our leaves
        return F.linear(LigerSiLUMulFunction.apply(F.linear(x, wg), F.linear(x, wu)), wd)

    return liger


def implementations(smoke: bool) -> dict:
    impls = {
        "eager": gated_mlp_ref,
        "cublas_swiglu": lambda x, wg, wu, wd: F.linear(swiglu(F.linear(x, wg), F.linear(x, wu), True), wd),
        "ours": gated_mlp,
        "ours_saved": lambda x, wg, wu, wd: gated_mlp(x, wg, wu, wd, recompute=False),
    }
    if not smoke:  # inductor on CPU needs a C++ toolchain and minutes; the smoke run checks the script only
        impls["compile"] = torch.compile(gated_mlp_ref, dynamic=False)
    liger = _liger_mlp()
    if liger is not None:
        impls["liger"] = liger
    return impls


def make_inputs(n, hidden, inter, device, dtype=torch.bfloat16):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype).requires_grad_(True)

    leaves = {
        "x": rand(n, hidden),
        "w_gate": rand(inter, hidden, scale=hidden**-0.5),
        "w_up": rand(inter, hidden, scale=hidden**-0.5),
        "w_down": rand(hidden, inter, scale=inter**-0.5),
    }
    dy = (torch.randn(n, hidden, generator=gen)).to(device, dtype)
    return leaves, dy


def saved_bytes(fn, leaves) -> int:
    """Distinct storages autograd saves during ``fn()``, the weights excluded."""
    weights = {leaves[k].untyped_storage().data_ptr() for k in GRADS[1:]}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, leaves, dy, warmup, repeats):
    """Median ms of forward + backward, saved bytes, peak bytes of one call, and the last call's outputs."""
    args = [leaves[k] for k in GRADS]

    def step():
        y = fn(*args)
        return y, torch.autograd.grad(y, args, dy)

    device = dy.device
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    saved = saved_bytes(lambda: fn(*args), leaves)
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        out = step()
    result = {"ms": statistics.median(times), "ms_all": times, "saved_bytes": saved, "peak_bytes": peak}
    return result, out


def max_rel_err(x, ref) -> float:
    return float((x.detach().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def reference(leaves, dy):
    """y and the gradients of the same math in fp32."""
    ref_leaves = {k: v.detach().float().requires_grad_(True) for k, v in leaves.items()}
    args = [ref_leaves[k] for k in GRADS]
    y = gated_mlp_ref(*args)
    grads = torch.autograd.grad(y, args, dy.float())
    return [y.detach(), *grads]


def run_shape(n, hidden, inter, impls, device, warmup, repeats) -> list[dict]:
    """One row per implementation: the shape, ``floor_ms`` and :func:`measure`'s fields, or ``error``."""
    leaves, dy = make_inputs(n, hidden, inter, device)
    ref = reference(leaves, dy)
    floor_ms = 18 * n * hidden * inter / (PEAK_TFLOPS * 1e12) * 1e3  # 9 GEMMs of 2·N·H·I FLOPs
    rows = []
    for name, fn in impls.items():
        row = {"case": f"N={n} H={hidden} I={inter}", "N": n, "H": hidden, "I": inter, "impl": name,
               "floor_ms": floor_ms}  # fmt: skip
        rows.append(row)
        try:
            result, (y, grads) = measure(fn, leaves, dy, warmup, repeats)
        except Exception as exc:  # noqa: BLE001 - one failing peer is recorded, not fatal
            oom = isinstance(exc, torch.OutOfMemoryError)
            row["error"] = "OOM" if oom else f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            print(f"N={n} H={hidden} I={inter} / {name}: {exc!r}", file=sys.stderr)
            continue
        result["err"] = {k: max_rel_err(t, r) for k, t, r in zip(("y", *GRADS), (y, *grads), ref)}
        del y, grads
        row.update(result)
        mib, peak = result["saved_bytes"] / 2**20, result["peak_bytes"]
        peak = "" if peak is None else f"  peak +{peak / 2**20:8.1f} MiB"
        err = result["err"]
        print(f"N={n:<6} H={hidden:<5} I={inter:<6} {name:<14} {result['ms']:8.3f} ms  saved {mib:8.1f} MiB"
              f"{peak}  err y {err['y']:.1e} dx {err['x']:.1e}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder of decoder.json, .md and .png")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (CPU works)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_decoder: no CUDA device; use --smoke to check the script on CPU.", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warmup, repeats = (1, 2) if args.smoke else (3, max(args.repeats, 5))
    impls = implementations(args.smoke)
    start = time.time()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows = [row for shape in shapes for row in run_shape(*shape, impls, device, warmup, repeats)]
    command = "python -m benchmarks.bench_decoder " + " ".join(argv if argv is not None else sys.argv[1:])
    data = {"stamp": stamp(command=command.strip()), "dtype": "bfloat16", "warmup": warmup,
            "repeats": repeats, "peak_tflops": PEAK_TFLOPS, "rows": rows}  # fmt: skip
    write_set(args.out, "decoder", data)
    print(f"wrote decoder.json, .md and .png under {args.out} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
