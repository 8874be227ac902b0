"""How close cuBLAS itself gets to the 800 TFLOP/s floor on this GPU, for the LM head's GEMMs.

The loss benchmarks quote ``× floor`` against 6·N·H·V FLOPs at 800 TFLOP/s. This script times the GEMMs
alone, with no loss in between: large square GEMMs (the device's best case), and the three GEMMs of one
chunk (logits, grad_hidden, grad_weight with an fp32 or bf16 accumulator) at several chunk sizes and in the
layouts the engine could use. The sum of the three best per-chunk GEMMs, over the ideal, is the lowest
``× floor`` any loop over cuBLAS GEMMs can reach at that chunk size.

The logits gradient fed to the backward GEMMs is a real one (softmax minus one-hot of random logits, as the
loss writes it), since an H100's clock under load depends on the data it multiplies.

    python -m benchmarks.gemm_ceiling --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton.testing

H, V = 4096, 128256
PEAK = 800e12


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def tflops(flop: float, ms: float) -> float:
    return flop / ms / 1e9


def square(rows: list[dict]) -> None:
    for n in (4096, 8192, 16384):
        a = (torch.randn(n, n, device="cuda") * 0.5).bfloat16()
        b = (torch.randn(n, n, device="cuda") * 0.02).bfloat16()
        for layout, fn in (("NN", lambda: a @ b), ("TN", lambda: a @ b.t()), ("NT", lambda: a.t() @ b)):
            ms = bench(fn)
            flop = 2 * n**3
            rows.append(dict(case=f"square {n}", gemm=layout, ms=ms, tflops=tflops(flop, ms)))
            print(f"square {n} {layout}: {ms:.3f} ms, {tflops(flop, ms):.0f} TFLOP/s", flush=True)


def chunk_operands(c: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's hidden rows ``x`` (c, H) and a real logits gradient ``g`` (c, V): softmax minus one-hot of
    ``x @ w.T`` over ``c`` rows, in bf16, as the loss writes it."""
    x = (torch.randn(c, H, device="cuda") * 0.5).bfloat16()
    y = torch.randint(0, V, (c,), device="cuda")
    g = torch.softmax((x @ w.t()).float(), -1)
    g[torch.arange(c, device="cuda"), y] -= 1
    return x, (g / c).bfloat16()


def chunk_gemms(rows: list[dict], chunk_rows=(2048, 4096, 8192)) -> None:
    w = (torch.randn(V, H, device="cuda") * 0.02).bfloat16()
    acc32 = torch.zeros(V, H, device="cuda")
    acc32_t = torch.zeros(H, V, device="cuda")
    acc16 = torch.zeros(V, H, device="cuda", dtype=torch.bfloat16)
    for c in chunk_rows:
        x, g = chunk_operands(c, w)
        out_logits = torch.empty(c, V, device="cuda", dtype=torch.bfloat16)
        out_logits_t = torch.empty(V, c, device="cuda", dtype=torch.bfloat16)
        out_h = torch.empty(c, H, device="cuda", dtype=torch.bfloat16)
        flop = 2 * c * H * V
        ideal = flop / PEAK * 1e3
        cases = {
            "logits": {
                "x @ W.T": lambda: torch.mm(x, w.t(), out=out_logits),
                "(W @ x.T).T": lambda: torch.mm(w, x.t(), out=out_logits_t),
            },
            "grad_hidden": {"g @ W": lambda: torch.mm(g, w, out=out_h)},
            "grad_weight fp32 acc": {
                "acc += g.T @ x": lambda: torch.addmm(acc32, g.t(), x, out_dtype=torch.float32, out=acc32),
                "accT += x.T @ g": lambda: torch.addmm(
                    acc32_t, x.t(), g, out_dtype=torch.float32, out=acc32_t
                ),
            },
            "grad_weight bf16 acc": {"acc += g.T @ x": lambda: acc16.addmm_(g.t(), x)},
        }
        best = {}
        for gemm, variants in cases.items():
            for layout, fn in variants.items():
                ms = bench(fn)
                rows.append(
                    dict(
                        case=f"chunk C={c}",
                        gemm=gemm,
                        layout=layout,
                        ms=ms,
                        tflops=tflops(flop, ms),
                        x_ideal=ms / ideal,
                    )  # fmt: skip
                )
                print(f"C={c} {gemm} [{layout}]: {ms:.3f} ms ({ms / ideal:.3f}x ideal, "
                      f"{tflops(flop, ms):.0f} TFLOP/s)", flush=True)  # fmt: skip
                best[gemm] = min(best.get(gemm, float("inf")), ms)
        for acc in ("fp32", "bf16"):
            total = best["logits"] + best["grad_hidden"] + best[f"grad_weight {acc} acc"]
            x_ideal = total / 3 / ideal
            rows.append(dict(case=f"chunk C={c}", gemm=f"3 GEMMs ({acc} acc)", ms=total, x_ideal=x_ideal))
            print(f"C={c} three GEMMs, {acc} accumulator: {total:.3f} ms = {x_ideal:.3f}x the floor")


def chunk_pipeline(rows: list[dict]) -> None:
    """One whole CE chunk (logits GEMM, compiled loss step, grad_hidden and fp32 grad_weight GEMMs) with the
    logits computed as ``x @ W.T`` ([C, V] row-major) or as ``(W @ x.T).T`` (a [C, V] view of [V, C])."""
    from chunkloss import FusedLinearCrossEntropyLoss
    from chunkloss.engine._core import _accumulate_weight_grad

    w = (torch.randn(V, H, device="cuda") * 0.02).bfloat16()
    acc32 = torch.zeros(V, H, device="cuda")
    step = FusedLinearCrossEntropyLoss()._step_fn("token")
    for c in (2048, 4096):
        x = (torch.randn(c, H, device="cuda") * 0.5).bfloat16()
        tok = {"labels": torch.randint(0, V, (c,), device="cuda")}
        n = torch.tensor(float(c), device="cuda")
        sc = {"normaliser": n, "n_valid": n}
        grad_h = torch.empty(c, H, device="cuda", dtype=torch.bfloat16)
        ideal = 6 * c * H * V / PEAK * 1e3
        for layout, project in (("x @ W.T", lambda: x @ w.t()), ("(W @ x.T).T", lambda: (w @ x.t()).t())):
            logits = project()
            parts = {
                "logits": project,
                "loss step": lambda: step(logits, [], tok, sc),
            }
            g = step(project(), [], tok, sc)[0]
            parts["grad_hidden"] = lambda: torch.mm(g, w, out=grad_h)
            parts["grad_weight fp32"] = lambda: _accumulate_weight_grad(acc32, g, x)

            def whole():
                gg = step(project(), [], tok, sc)[0]
                torch.mm(gg, w, out=grad_h)
                _accumulate_weight_grad(acc32, gg, x)

            parts["whole chunk"] = whole
            for name, fn in parts.items():
                ms = bench(fn)
                xi = ms / ideal if name == "whole chunk" else ms / (ideal / 3)
                rows.append(dict(case=f"CE chunk C={c}", gemm=name, layout=layout, ms=ms, x_ideal=xi))
                print(f"CE chunk C={c} [{layout}] {name}: {ms:.3f} ms ({xi:.3f}x ideal)", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--pipeline-only", action="store_true", help="only the whole-chunk layout comparison")
    p.add_argument("--chunk-rows", default="2048,4096,8192", help="chunk sizes of the per-chunk GEMMs")
    p.add_argument("--chunks-only", action="store_true", help="only the per-chunk GEMMs")
    a = p.parse_args(argv)
    chunk_rows = [int(c) for c in a.chunk_rows.split(",") if c]
    rows: list[dict] = []
    gpu = torch.cuda.get_device_name()
    print(gpu, flush=True)
    if not (a.pipeline_only or a.chunks_only):
        square(rows)
    if not a.pipeline_only:
        chunk_gemms(rows, chunk_rows)
    if not a.chunks_only:
        chunk_pipeline(rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gemm_ceiling.json"), "w") as f:
        json.dump({"gpu": gpu, "torch": torch.__version__, "peak_flops": PEAK, "rows": rows}, f, indent=1)
    lines = [
        f"# GEMM ceiling ({gpu}, bf16, cuBLAS via torch {torch.__version__})",
        "",
        "`python -m benchmarks.gemm_ceiling`: the GEMMs alone, triton.testing.do_bench medians. "
        "'× ideal' is the time over the GEMM's FLOPs at 800 TFLOP/s.",
        "",
        "| case | GEMM | layout | ms | TFLOP/s | × ideal |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
        xi = f"{r['x_ideal']:.3f}" if "x_ideal" in r else ""
        lines.append(f"| {r['case']} | {r['gemm']} | {r.get('layout', '')} | {r['ms']:.3f} | {tf} | {xi} |")
    with open(os.path.join(a.out, "gemm_ceiling.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
