"""The engine's three chunk GEMMs, in its own layouts, over chunk sizes: does cuBLAS run some sizes much
better?

PYTHONPATH=. python benchmarks/results/dev/s13/probe_chunk_gemms.py OUT_DIR [sizes]

Per chunk size C (rows): logits ``x @ W.T`` ([C, V] out), grad_hidden ``g @ W``, grad_weight accumulated
in fp32 (``torch.addmm(acc, g.T, x, out_dtype=fp32, out=acc)``, the engine's ``_accumulate_weight_grad``)
and the fp32 first contribution (beta=0), each as ms and × its ideal time at 800 TFLOP/s (triton do_bench
medians). ``g`` is a real logits gradient (softmax minus one-hot, over C), as in
``benchmarks.gemm_ceiling``."""

import json
import pathlib
import sys

import torch
import triton.testing

from benchmarks.gemm_ceiling import H, V, chunk_operands

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
default = list(range(2048, 6145, 256)) + [3328, 3456, 3584, 3712, 3840, 3968, 7022, 8192]
sizes = [int(s) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else sorted(set(default))


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


w = (torch.randn(V, H, device="cuda") * 0.02).bfloat16()
acc = torch.zeros(V, H, device="cuda")
rows = []
for c in sizes:
    x, g = chunk_operands(c, w)
    out_logits = torch.empty(c, V, device="cuda", dtype=torch.bfloat16)
    out_h = torch.empty(c, H, device="cuda", dtype=torch.bfloat16)
    ideal = 2 * c * H * V / 800e12 * 1e3
    r = {"C": c, "ideal_ms": ideal}
    r["logits"] = bench(lambda: torch.mm(x, w.t(), out=out_logits))
    r["grad_hidden"] = bench(lambda: torch.mm(g, w, out=out_h))
    r["grad_w_acc"] = bench(lambda: torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc))
    r["grad_w_first"] = bench(lambda: torch.addmm(acc, g.t(), x, beta=0.0, out_dtype=torch.float32, out=acc))
    r["grad_w_bf16_out"] = bench(lambda: g.t() @ x)
    rows.append(r)
    print(
        f"C={c}: "
        + ", ".join(f"{k} {r[k]:.3f} ({r[k] / ideal:.3f}x)" for k in r if k not in ("C", "ideal_ms")),
        flush=True,
    )
(out / "chunk_gemms.json").write_text(
    json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
)
