import chunkloss.kernels.logprob as lp
import torch
import triton

z = (3 * torch.randn(4096, 128256, device="cuda")).bfloat16()
y = torch.randint(0, 128256, (4096,), device="cuda")
ref = lp.label_logprob_ref(z, y)
for block in [2048, 4096, 8192, 16384]:
    for warps in [4, 8, 16]:
        lp.BLOCK_V, lp.NUM_WARPS = block, warps
        out = lp.label_logprob_triton(z, y)
        err = (out - ref).abs().max().item()
        t = triton.testing.do_bench(lambda: lp.label_logprob_triton(z, y), rep=200)
        gbps = z.numel() * 2 / t / 1e6
        print(f"BLOCK {block:5d} warps {warps:2d}: {t:.3f} ms  {gbps:.0f} GB/s  err {err:.2e}", flush=True)
