"""Forward + backward of the Triton row kernels vs PyTorch, torch.compile and Liger, on one CUDA GPU.

For each case: median time of one autograd call (forward, then ``torch.autograd.grad``) after warm-up,
the memory that call allocates (outputs and gradients included), the minimal bytes it must move, and the
bandwidth floor ``bytes / 3.0 TB/s`` (H100 HBM3). Writes ``kernels.json`` (stamped with date, GPU and
versions), ``kernels.md`` and ``kernels.png`` under ``--out``.

    python -m benchmarks.bench_kernels [--out benchmarks/results]
"""

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import command, peak_extra, stamp
from benchmarks.report import write_set

PEAK_BW = 3.0e12  # bytes/s, H100 SXM HBM3
IMPLS = ("torch", "compile", "liger", "ours")


def _liger():
    """Liger's counterparts, or {} when liger_kernel is missing or its API differs."""
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        print(f"liger_kernel unavailable: {exc!r}", file=sys.stderr)
        return {}

    # Liger's autograd Functions on our leaves (its modules would wrap the weight in a new Parameter).
    return {
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", True),
        "layer_norm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5),
        "swiglu": LigerSiLUMulFunction.apply,
        "geglu": LigerGELUMulFunction.apply,
        "rope": lambda q, k, cos, sin: liger_rotary_pos_emb(q, k, cos, sin),
    }


def rope_inputs(batch, seq, n_q, n_k, head_dim, dtype=torch.bfloat16):
    """q, k (B, T, H, D) leaves (passed to RoPE as (B, H, T, D) views, like a projection output) and
    transformers-style (B, T, D) cos / sin tables."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    freqs = torch.arange(seq, device="cuda").float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(batch, seq, head_dim)
    q = torch.randn(batch, seq, n_q, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seq, n_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    return [q, k, emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()]


def make_cases():
    """(name, op, input factory, minimal bytes) for every case; factories build fresh bf16 inputs."""
    dt, e = torch.bfloat16, 2
    cases = []
    for width in (2048, 4096, 8192, 16384):
        rows = 16384
        # norm fwd: read x, write y; bwd: read dy and x, write dx (w, b, stats are O(rows + width)).
        nbytes = 5 * rows * width * e

        def norm_inputs(rows=rows, width=width, bias=False):
            x = torch.randn(rows, width, device="cuda", dtype=dt, requires_grad=True)
            w = (torch.randn(width, device="cuda") * 0.1 + 1).to(dt).requires_grad_()
            if not bias:
                return [x, w]
            return [x, w, (torch.randn(width, device="cuda") * 0.1).to(dt).requires_grad_()]

        cases.append((f"RMSNorm {rows}x{width}", "rms_norm", norm_inputs, nbytes))
        cases.append((f"LayerNorm {rows}x{width}", "layer_norm", lambda f=norm_inputs: f(bias=True), nbytes))
    for op, name in (("swiglu", "SwiGLU"), ("geglu", "GeGLU")):
        rows, inter = 8192, 14336

        def glu_inputs(rows=rows, inter=inter):
            return [torch.randn(rows, inter, device="cuda", dtype=dt, requires_grad=True) for _ in range(2)]

        # fwd: read a, b, write c; bwd: read dc, a, b, write da, db.
        cases.append((f"{name} {rows}x{inter}", op, glu_inputs, 8 * rows * inter * e))
    batch, seq, n_q, n_k, head_dim = 4, 4096, 32, 8, 128

    # fwd: read q, k, write q, k; bwd: the same on their gradients (cos/sin are O(B T D)).
    rope = functools.partial(rope_inputs, batch, seq, n_q, n_k, head_dim, dt)
    nbytes = 4 * batch * seq * (n_q + n_k) * head_dim * e
    return cases + [(f"RoPE B={batch} T={seq} {n_q}/{n_k}x{head_dim}", "rope", rope, nbytes)]


def implementations(liger):
    from chunkloss import kernels as ck

    refs = {
        "rms_norm": lambda x, w: ck.rms_norm_ref(x, w, 1e-6),
        "layer_norm": ck.layer_norm_ref,
        "swiglu": ck.swiglu_ref,
        "geglu": ck.geglu_ref,
        "rope": lambda q, k, cos, sin: ck.apply_rotary_pos_emb_ref(q, k, cos, sin),
    }
    # Ours as patch() uses them: gradients written over buffers nobody else reads (Liger does the same).
    ours = {
        "rms_norm": lambda x, w: ck.rms_norm(x, w, 1e-6, in_place=True),
        "layer_norm": lambda x, w, b: ck.layer_norm(x, w, b, in_place=True),
        "swiglu": lambda a, b: ck.swiglu(a, b, in_place=True),
        "geglu": lambda a, b: ck.geglu(a, b, in_place=True),
        "rope": lambda q, k, cos, sin: ck.apply_rotary_pos_emb(q, k, cos, sin, in_place=True),
    }
    compiled = {op: torch.compile(fn, dynamic=False) for op, fn in refs.items()}
    return {"torch": refs, "compile": compiled, "liger": liger, "ours": ours}


def step_fn(op, fn, inputs):
    """One forward + backward; RoPE inputs are (B, T, H, D) leaves handed over as (B, H, T, D) views."""
    if op == "rope":
        q, k, cos, sin = inputs
        grads = [torch.randn(x.shape, device="cuda", dtype=x.dtype).transpose(1, 2) for x in (q, k)]

        def step():
            qe, ke = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            torch.autograd.grad((qe, ke), (q, k), grads)

        return step
    leaves = [t for t in inputs if t.requires_grad]
    probe = fn(*inputs)
    grad = torch.randn_like(probe)
    del probe

    def step():
        torch.autograd.grad(fn(*inputs), leaves, grad)

    return step


def measure(step) -> dict:
    """``ms`` (eager), ``graph_ms`` (CUDA graph, or None) and ``peak_extra_mib`` of one step.

    Eager: ``do_bench`` launches the step back to back, so where the host's launch work (Python, autograd,
    the launchers) takes longer than the GPU's, the time is the host's. Graph: the same step captured once
    in a CUDA graph and replayed, which times the GPU work alone, as in a model where the host runs ahead.
    """
    import triton.testing

    step()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    peak = peak_extra(step)[1] / 2**20
    graph_ms = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        graph_ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
        del graph
    except Exception as exc:  # noqa: BLE001 - an implementation that cannot be captured keeps its eager time
        print(f"  (no CUDA graph: {type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
    torch.cuda.synchronize()
    return {"ms": ms, "graph_ms": graph_ms, "peak_extra_mib": peak}


def _fmt(ms):
    return "n/a" if ms is None else f"{ms:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; CPU timings would mean nothing.", file=sys.stderr)
        return 2
    torch._dynamo.config.cache_size_limit = 64
    torch.manual_seed(0)
    impls = implementations(_liger())
    rows = []
    start = time.time()
    for name, op, make_inputs, nbytes in make_cases():
        floor_ms = nbytes / PEAK_BW * 1e3
        row = {"case": name, "op": op, "bytes": nbytes, "floor_ms": floor_ms}
        for impl in IMPLS:
            fn = impls[impl].get(op)
            if fn is None:
                continue
            inputs = make_inputs()
            try:
                row[impl] = measure(step_fn(op, fn, inputs))
            except Exception as exc:  # noqa: BLE001 - record and go on: one failing baseline is not fatal
                print(f"{name} / {impl}: {exc!r}", file=sys.stderr)
            finally:
                del inputs
                torch.cuda.empty_cache()
        rows.append(row)
        timings = [f"{i} {row[i]['ms']:6.3f}/{_fmt(row[i]['graph_ms'])} ms" for i in IMPLS if i in row]
        print(" | ".join([f"{name:<34}", f"floor {floor_ms:6.3f} ms", *timings]), flush=True)
    st = stamp(command=command("bench_kernels", argv))
    data = {"stamp": st, "peak_bw": PEAK_BW, "dtype": "bfloat16", "rows": rows}
    write_set(args.out, "kernels", data)
    print(f"wrote {Path(args.out) / 'kernels'}.json, .md and .png in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
