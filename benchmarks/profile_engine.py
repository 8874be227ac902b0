"""Where the time of one chunk goes: each GEMM, the compiled loss step, gathers, at several chunk sizes.

python -m benchmarks.profile_engine
"""

import torch
import triton.testing

from chunkloss import FusedLinearCrossEntropyLoss
from chunkloss.engine._core import _accumulate_weight_grad

H, V = 4096, 128256


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    dev = "cuda"
    w = (torch.randn(V, H, device=dev) * 0.02).bfloat16()
    acc32 = torch.zeros(V, H, device=dev)
    acc16 = torch.zeros(V, H, device=dev, dtype=torch.bfloat16)
    loss = FusedLinearCrossEntropyLoss()
    for c in (1024, 2048, 4096):
        x = torch.randn(c, H, device=dev).bfloat16()
        y = torch.randint(0, V, (c,), device=dev)
        logits = x @ w.t()
        g = torch.randn_like(logits)
        step = loss._step_fn("token")
        tok = {"labels": y}
        sc = {"normaliser": torch.tensor(float(c), device=dev), "n_valid": torch.tensor(float(c), device=dev)}
        flop = 2 * c * H * V
        t = {
            "fwd gemm": bench(lambda: x @ w.t()),
            "loss step (compiled)": bench(lambda: step(logits, [], tok, sc)),
            "grad_h gemm": bench(lambda: g @ w),
            "grad_W fp32 acc": bench(lambda: _accumulate_weight_grad(acc32, g, x)),
            "grad_W bf16 acc": bench(lambda: _accumulate_weight_grad(acc16, g, x)),
            "index_select x": bench(lambda: x.index_select(0, torch.arange(c, device=dev))),
        }
        ideal = flop / 800e12 * 1e3
        print(
            f"C={c}: ideal GEMM {ideal:.3f} ms | " + " | ".join(f"{k} {v:.3f}" for k, v in t.items()),
            flush=True,
        )
    # Peak memory of one compiled loss step at C=2048 (the gradient overwrites the logits in place).
    c = 2048
    x = torch.randn(c, H, device=dev).bfloat16()
    y = torch.randint(0, V, (c,), device=dev)
    sc = {"normaliser": torch.tensor(float(c), device=dev), "n_valid": torch.tensor(float(c), device=dev)}
    step = loss._step_fn("token")
    for _ in range(2):
        logits = x @ w.t()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        g, _, _ = step(logits, [], {"labels": y}, sc)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
    print(
        f"loss step C={c}: logits {logits.numel() * 2 / 2**20:.0f} MiB, "
        f"extra peak {extra / 2**20:.0f} MiB, "
        f"in place: {g.data_ptr() == logits.data_ptr()}",
        flush=True,
    )
    for n in (8192,):
        hid = (torch.randn(n, H, device=dev) * 0.5).bfloat16().requires_grad_()
        wl = w.clone().requires_grad_()
        y = torch.randint(0, V, (n,), device=dev)
        for cs in (1024, 2048, 4096, 8192):
            for acc in (torch.float32, None):
                lf = FusedLinearCrossEntropyLoss(chunk_size=cs, accum_dtype=acc)

                def fb():
                    hid.grad = wl.grad = None
                    lf(hid, wl, y).backward()

                ms = bench(fb)
                print(
                    f"N={n} chunk={cs} accum={acc}: {ms:.2f} ms "
                    f"({ms / (6 * n * H * V / 800e12 * 1e3):.2f}x floor)"
                )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        lf = FusedLinearCrossEntropyLoss(chunk_size=2048)
        for _ in range(3):
            hid.grad = wl.grad = None
            lf(hid, wl, y).backward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


if __name__ == "__main__":
    main()
