"""CE, GRPO (dapo) and JSD forward + backward at fixed chunk sizes, in one process on the same inputs.

    python -m benchmarks.chunk_sweep [--out chunk_sweep.json] [--only ce,ce32768,grpo,jsd]
                                     [--sizes auto,4096,...]

Which row counts run fastest is a property of cuBLAS on the GPU; the automatic chunk size (from
``logits_budget_mb``) is checked against it here rather than assumed.
"""

import argparse
import json

import torch

from benchmarks import cases_ce, cases_grpo, cases_jsd
from benchmarks.harness import PEAK_TFLOPS, measure
from chunkloss import FusedLinearCrossEntropyLoss
from chunkloss.losses.grpo import FusedLinearGRPOLoss
from chunkloss.losses.jsd import FusedLinearJSDLoss

H, V = 4096, 128256
GiB = 2**30


def _ce(cs, acc):
    f = FusedLinearCrossEntropyLoss(chunk_size=cs, accum_dtype=acc)
    return lambda i: f(i["hidden"], i["weight"], i["labels"])


def _grpo(cs):
    f = FusedLinearGRPOLoss(loss_type="dapo", beta=cases_grpo.BETA, chunk_size=cs)
    return lambda i: f(i["hidden"], i["weight"], i["ids"], i["mask"], i["adv"], old_logps=i["old"],
                       ref_logps=i["ref"])  # fmt: skip


def _jsd(cs):
    f = FusedLinearJSDLoss(beta=cases_jsd.BETA, chunk_size=cs)
    return lambda i: f(i["student_hidden"], i["student_weight"], i["teacher_hidden"], i["teacher_weight"],
                       i["labels"])  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--only", default="ce,grpo,jsd", help="comma list of: ce (N=8192), ce32768, grpo, jsd")
    p.add_argument("--sizes", default=None, help="chunk sizes for every case ('auto': automatic)")
    a = p.parse_args(argv)
    only = set(a.only.split(","))
    if only - {"ce", "ce32768", "grpo", "jsd"}:
        p.error(f"--only: unknown cases {sorted(only - {'ce', 'ce32768', 'grpo', 'jsd'})}")
    given = None if a.sizes is None else tuple(None if s == "auto" else int(s) for s in a.sizes.split(","))
    dev = torch.device("cuda")
    rows = []

    def run(name, floor_flops, inputs, make_fn, sizes):
        floor_ms = floor_flops / (PEAK_TFLOPS * 1e12) * 1e3
        for cs in given or sizes:
            r = measure(make_fn(cs), inputs, repeats=a.repeats)
            row = dict(case=name, chunk_size=cs, ms=r["ms"], x_floor=r["ms"] / floor_ms,
                       beyond_grads_gib=r["extra_beyond_grads_bytes"] / GiB)  # fmt: skip
            rows.append(row)
            print(f"{name:26s} chunk={cs!s:5s} {row['ms']:8.2f} ms  {row['x_floor']:.3f}x floor  "
                  f"beyond grads {row['beyond_grads_gib']:.2f} GiB", flush=True)  # fmt: skip

    n = 8192
    for case, n_ce in (("ce", n), ("ce32768", 32768)):
        if case not in only:
            continue
        inp = cases_ce._inputs(n_ce)(dev)
        n_valid = int((inp["labels"] != -100).sum())
        for acc, tag in ((torch.float32, "fp32"), (None, "bf16")):
            run(f"ce N={n_ce} accum={tag}", 6 * n_valid * H * V, inp, lambda cs, acc=acc: _ce(cs, acc),
                (None, 1024, 1536, 1792, 2048, 2560, 3072, 4096))  # fmt: skip
        del inp
    if "grpo" in only:
        b, t = 2, 16384
        inp = cases_grpo._inputs(b, t)(dev)
        sizes = (None, 1536, 1792, 2048, 2560, 3072)
        run(f"grpo dapo B={b} T={t}", 6 * b * (t - t // 8) * H * V, inp, _grpo, sizes)
        del inp
    if "jsd" in only:
        inp = cases_jsd._inputs(n)(dev)
        run(f"jsd N={n}", 8 * n * H * V, inp, _jsd, (None, 768, 896, 1024, 1280, 1536, 2048))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
