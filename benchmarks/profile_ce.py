"""Kernel-level breakdown of one loss forward+backward on the GPU (H=4096, V=128256, bf16): cross-entropy at
N tokens with 1/7 ignored (``benchmarks/cases_ce.py``), or GRPO dapo at B x T (``benchmarks/cases_grpo.py``).

python -m benchmarks.profile_ce [--chunk-size C] [--n 8192]
python -m benchmarks.profile_ce --loss grpo [--b 16 --t 1024]
python -m benchmarks.profile_ce --case "jsd N=8192"   # any bench_losses case, its chunkloss impl
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import cases_ce, cases_grpo
from chunkloss import FusedLinearCrossEntropyLoss


def host_overhead(f) -> None:
    """Wall time of a tiny call (the host's share of every call) and the host syncs it makes."""
    import time
    import warnings

    h = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 1024, (64,), device="cuda")
    y[::7] = -100
    for _ in range(5):
        f(h, w, y).backward()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        f(h, w, y).backward()
    torch.cuda.synchronize()
    print(f"tiny call (N=64, H=256, V=1024): {(time.perf_counter() - t) / 50 * 1e3:.3f} ms wall per fwd+bwd")
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(h, w, y).backward()
    torch.cuda.set_sync_debug_mode(0)
    print(f"host syncs per call: {len(caught)}")
    for c in caught:
        print("  ", str(c.message)[:100], c.filename.split("/")[-1], c.lineno)


def _case(name: str):
    from benchmarks.bench_losses import cases_by_name

    case = cases_by_name().get(name)
    if case is None:
        raise SystemExit(f"no benchmark case named {name!r}")
    return case


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--loss", choices=("ce", "grpo"), default="ce")
    p.add_argument("--b", type=int, default=16)
    p.add_argument("--t", type=int, default=1024)
    p.add_argument("--case", default=None, help="a bench_losses case by name, e.g. 'jsd N=8192'")
    a = p.parse_args(argv)
    if a.case is not None and a.chunk_size is not None:
        p.error("--chunk-size applies to --loss; a --case runs its chunkloss impl as bench_losses builds it")
    if a.case is not None:
        case = _case(a.case)
        inp = case.make_inputs(torch.device("cuda"))
        f = None
        impl = case.impls["chunkloss"]

        def call():
            return impl(inp)

        args = ()
    elif a.loss == "ce":
        inp = cases_ce._inputs(a.n)(torch.device("cuda"))
        f = FusedLinearCrossEntropyLoss(chunk_size=a.chunk_size)
        call = f
        args = (inp["hidden"], inp["weight"], inp["labels"])
    else:
        inp = cases_grpo._inputs(a.b, a.t)(torch.device("cuda"))
        f = cases_grpo.FusedLinearGRPOLoss(loss_type="dapo", beta=cases_grpo.BETA, chunk_size=a.chunk_size)

        def call(*args):
            return f(*args, old_logps=inp["old"], ref_logps=inp["ref"])

        args = (inp["hidden"], inp["weight"], inp["ids"], inp["mask"], inp["adv"])

    def step():
        for t in inp.values():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.grad = None
        call(*args).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in events) / 3 / 1e3
    t0 = min(e.time_range.start for e in events)
    t1 = max(e.time_range.end for e in events)
    print(f"GPU busy per step {busy:.2f} ms; span of 3 steps {(t1 - t0) / 1e3 / 3:.2f} ms per step")
    events.sort(key=lambda e: e.time_range.start)
    end = events[0].time_range.end
    for prev, e in zip(events, events[1:]):
        gap = e.time_range.start - max(end, prev.time_range.end)
        end = max(end, prev.time_range.end)
        if gap > 30:
            print(f"  idle {gap / 1e3:.3f} ms  after {prev.name[:50]}  before {e.name[:50]}")
    if f is not None and a.loss == "ce":
        host_overhead(f)
    else:
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        torch.cuda.set_sync_debug_mode(0)
        print(f"host syncs per step: {len(caught)}")
        for c in caught:
            print("  ", str(c.message)[:100], c.filename.split("/")[-1], c.lineno)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
