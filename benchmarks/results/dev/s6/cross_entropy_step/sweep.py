"""Sweep chunkloss.kernels.cross_entropy's BLOCK_V x NUM_WARPS at 4096 x 128256 bf16 on one GPU.

python benchmarks/results/dev/s6/cross_entropy_step/sweep.py [BLOCKS] [WARPS]   # e.g. 4096,8192 8,16
"""

import itertools
import sys

import chunkloss.kernels.cross_entropy as ce
import torch
import triton

torch.manual_seed(0)
c, v = 4096, 128256
buf = (4 * torch.randn(c, v, device="cuda")).bfloat16()  # overwritten by each call: the values do not matter
y = torch.randint(0, v, (c,), device="cuda")
n = torch.full((), float(c), device="cuda")
OPTIONS = {
    "plain": {},
    "metrics": dict(want_accuracy=True, want_entropy=True),
    "all": dict(
        label_smoothing=0.1,
        lse_square_scale=1e-4,
        softcap=30.0,
        temperature=0.7,
        logit_scale=0.5,
        want_accuracy=True,
        want_entropy=True,
    ),
}
blocks = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [2048, 4096, 8192, 16384]
warps = [int(w) for w in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4, 8, 16]
tb = 3 * buf.numel() * buf.element_size() / 1e9  # two reads and one write
for name, kw in OPTIONS.items():
    timed = []
    for block, w in itertools.product(blocks, warps):
        ce.BLOCK_V, ce.NUM_WARPS = block, w
        t = triton.testing.do_bench(lambda: ce.cross_entropy_step(buf, y, n, **kw), rep=200)
        timed.append((t, block, w))
        print(f"{name:8s} BLOCK {block:5d} warps {w:2d}: {t:.3f} ms {tb / t:.2f} TB/s(3 passes)", flush=True)
    for t, block, w in sorted(timed)[:3]:
        print(f"  best {name}: {t:.3f} ms BLOCK {block} warps {w}", flush=True)
