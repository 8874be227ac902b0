"""Sweep ``chunkloss.kernels.weight_grad``'s launch constants on one CUDA GPU and compare it with what the
engine does without it: the last chunk's cuBLAS ``addmm`` into the fp32 accumulator, then the cast to bf16
(``acc.to(bf16)``), at the Llama-3 head (V=128256, H=4096) for K rows of the last contribution (K = 0: the
scale-and-cast alone, as after two-pass DPO's deferred pair).

    python -m benchmarks.tune_weight_grad [--out tune_weight_grad.json] [--ks 0,256,1024,3584]
"""

import argparse
import itertools
import json

import torch


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--ks", default="0,64,256,512,1024,2048,3584")
    p.add_argument("--quick", action="store_true", help="only the default launch constants")
    a = p.parse_args(argv)
    import triton.testing
    from chunkloss.kernels import weight_grad as wg

    v, h = 128256, 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    acc = torch.randn(v, h, device="cuda", generator=gen).mul_(1e-3)
    work = torch.empty_like(acc)
    s = torch.full((), 0.75, device="cuda")
    bw_floor = (4 + 2) * v * h / 3.0e12 * 1e3  # read fp32 acc, write bf16, at 3.0 TB/s
    configs = [(wg.BLOCK_V, wg.BLOCK_H, wg.BLOCK_K, wg.NUM_WARPS, wg.NUM_STAGES)]
    if not a.quick:
        configs += [
            c
            for c in itertools.product((64, 128, 256), (64, 128, 256), (32, 64), (4, 8), (2, 3, 4))
            if c != configs[0] and 64 * 64 < c[0] * c[1] <= 128 * 256
        ]
    results = []
    for k in [int(x) for x in a.ks.split(",")]:
        g = torch.randn(k, v, device="cuda", generator=gen).softmax(1).to(torch.bfloat16)
        x = torch.randn(k, h, device="cuda", generator=gen).to(torch.bfloat16)
        ideal = 2 * k * v * h / 800e12 * 1e3
        ref = wg.finish_weight_grad_ref(acc, g, x, s, torch.bfloat16).float()

        def cublas():
            work.mul_(s)  # the scale (two-pass deferred rows); 1 elsewhere, where it is skipped
            if k:
                torch.addmm(work, g.t(), x, out_dtype=torch.float32, out=work)
            return work.to(torch.bfloat16)

        copy_ms = triton.testing.do_bench(lambda: work.copy_(acc), rep=200)
        base_ms = triton.testing.do_bench(lambda: (work.copy_(acc), cublas()), rep=200) - copy_ms
        # Without the scale: the one-pass last chunk (addmm + cast).
        plain_ms = (
            triton.testing.do_bench(
                lambda: (
                    work.copy_(acc),
                    torch.addmm(work, g.t(), x, out_dtype=torch.float32, out=work) if k else None,
                    work.to(torch.bfloat16),
                ),
                rep=200,
            )
            - copy_ms
        )
        err_base = (cublas().float() - ref).abs().max().item()
        print(
            f"K={k}: cuBLAS scale+addmm+cast {base_ms:.3f} ms, addmm+cast {plain_ms:.3f} ms "
            f"(bandwidth floor of the cast {bw_floor:.3f}, GEMM ideal {ideal:.3f}); max err {err_base:.3g}",
            flush=True,
        )
        timed = []
        for bv, bh, bk, warps, stages in configs:
            kw = dict(block_v=bv, block_h=bh, block_k=bk, num_warps=warps, num_stages=stages)
            try:
                out = wg.finish_weight_grad(acc, g, x, s, torch.bfloat16, **kw)
                err = (out.float() - ref).abs().max().item()
                ms = triton.testing.do_bench(
                    lambda: wg.finish_weight_grad(acc, g, x, s, torch.bfloat16, **kw)  # noqa: B023 - called here
                )
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                print(f"  {kw}: {type(exc).__name__}", flush=True)
                continue
            timed.append((ms, kw, err))
        for ms, kw, err in sorted(timed, key=lambda t: t[0])[:6]:
            print(f"  {ms:.3f} ms  max err {err:.3g}  {kw}", flush=True)
        for ms, kw, err in timed:
            results.append(
                {"k": k, "ms": ms, "max_err": err, "cublas_ms": base_ms, "cublas_plain_ms": plain_ms, **kw}
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
