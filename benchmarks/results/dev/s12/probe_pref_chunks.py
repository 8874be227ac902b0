"""ORPO and DPO+ref 8x1024 (bench_losses' inputs) at fixed chunk sizes, one process, same inputs.

PYTHONPATH=. python benchmarks/results/dev/s12/probe_pref_chunks.py [sizes: auto,4096,6144]
"""

import sys

import torch

from benchmarks import cases_preference as cp
from benchmarks.harness import PEAK_TFLOPS, measure
from chunkloss.losses.dpo import FusedLinearDPOLoss
from chunkloss.losses.orpo import FusedLinearORPOLoss

arg = sys.argv[1] if len(sys.argv) > 1 else "auto,4096,6144"
sizes = [None if s == "auto" else int(s) for s in arg.split(",")]
pairs, t = 8, 1024
n_valid = 2 * pairs * (t - t // 4)
for name, ref, gemms in (("orpo 8x1024", False, 6), ("dpo+ref 8x1024", True, 8)):
    inp = cp._inputs(pairs, t, ref)(torch.device("cuda"))
    floor = gemms * n_valid * cp.H * cp.V / (PEAK_TFLOPS * 1e12) * 1e3
    y = inp["labels"]
    for cs in sizes:
        f = (FusedLinearDPOLoss if ref else FusedLinearORPOLoss)(chunk_size=cs)
        kw = ("ref_hidden", "ref_weight") if ref else ()

        def fn(i, f=f, kw=kw):
            return f(i["hidden"], i["weight"], y[:pairs], y[pairs:], **{k: i[k] for k in kw})

        r = measure(fn, inp, repeats=7)
        print(
            f"{name:16s} chunk={cs!s:5s} {r['ms']:8.2f} ms {r['ms'] / floor:.3f}x floor  beyond grads "
            f"{r['extra_beyond_grads_bytes'] / 2**30:.2f} GiB",
            flush=True,
        )
    del inp
