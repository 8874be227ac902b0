"""Sweep the JSD chunk kernel's launch constants (``chunkloss.kernels.jsd.BLOCK_V`` and ``NUM_WARPS``) on one
CUDA GPU: one engine chunk (2048 rows x V=128256, bf16 student and teacher logits), β ∈ {0, 0.5}, against the
bandwidth floor of its three reads of both rows and one write of the student's.

    python -m benchmarks.tune_jsd [--out tune_jsd.json]
"""

import argparse
import itertools
import json

import torch


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--rows", type=int, default=2048)
    a = p.parse_args(argv)
    import triton.testing
    from chunkloss.kernels import jsd

    from chunkloss.losses.jsd import JSDOptions

    rows, vocab = a.rows, 128256
    floor = 7 * rows * vocab * 2 / 3.0e12 * 1e3  # 3 reads of both rows, 1 write, bf16, at 3.0 TB/s
    g = torch.Generator(device="cuda").manual_seed(0)
    student = torch.randn(rows, vocab, device="cuda", generator=g).mul_(2).to(torch.bfloat16)
    teacher = torch.randn(rows, vocab, device="cuda", generator=g).mul_(2).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    norm = torch.full((), float(rows), device="cuda")
    work = torch.empty_like(student)
    results = []
    defaults = (jsd.BLOCK_V, jsd.NUM_WARPS)
    for beta in (0.5, 0.0):
        opts = JSDOptions(beta=beta)
        timed = []
        for block, warps in itertools.product((2048, 4096, 8192), (8, 16, 32)):
            jsd.BLOCK_V, jsd.NUM_WARPS = block, warps
            try:
                # The step overwrites its input: each call starts from a fresh copy (timed apart, subtracted).
                ms = triton.testing.do_bench(
                    lambda: (work.copy_(student), jsd.jsd_step(work, teacher, labels, norm, opts)), rep=200
                )
            except Exception as exc:  # noqa: BLE001 - e.g. out of resources
                print(f"  beta={beta} {block} x {warps}: {type(exc).__name__}", flush=True)
                continue
            finally:
                jsd.BLOCK_V, jsd.NUM_WARPS = defaults
            timed.append((ms, block, warps))
        copy_ms = triton.testing.do_bench(lambda: work.copy_(student), rep=200)
        print(f"beta={beta}: floor {floor:.3f} ms (copy {copy_ms:.3f} ms subtracted below)", flush=True)
        for ms, block, warps in sorted(timed):
            print(f"  {ms - copy_ms:.3f} ms  BLOCK_V={block} NUM_WARPS={warps}", flush=True)
            results.append(
                {
                    "beta": beta,
                    "block": block,
                    "warps": warps,
                    "ms": ms - copy_ms,
                    "floor_ms": floor,
                    "rows": rows,
                }
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
