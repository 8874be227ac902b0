"""Long context: one sequence (GRPO: one group of completions) per step at growing lengths, per impl.

Implementations (``--impl``), each in its own process, on the same random weights and data:
``chunkloss`` (``chunk_long_context=True``: checkpointing, activation offloading, the tiled MLP),
``chunkloss-gc`` (checkpointing only, the kernels as by default), ``trl``, ``liger``, ``liger-offload``
(TRL + Liger with TRL's ``activation_offloading=True``; SFT only: GRPO's config has no such field) and
``unsloth`` (its loader and ``use_gradient_checkpointing="unsloth"``; ``CHUNKLOSS_UNSLOTH_SITE`` as for
``bench_e2e``). Checkpointing is on for every one.

Per implementation the lengths of ``--seqs`` run in turn until the first OOM, ``--steps`` steps each; a row
holds the median step time after ``--warmup``, the GPU peak (the highest memory allocated during training
minus what was allocated when it began) and the host peak (the process's peak resident memory, pinned
buffers included). ``summary`` holds each implementation's GPU-memory growth per 1k tokens: the least-squares
slope of its peaks over the lengths that ran.

    python -m benchmarks.bench_longctx --shape llama-3.2-1b --task lora --seqs 32768,65536,131072 \\
        --impl chunkloss,chunkloss-gc,liger,liger-offload --out OUT/longctx.json
    TRITON_INTERPRET=1 python -m benchmarks.bench_longctx --shape tiny --task lora --seqs 64,128,256 \\
        --impl chunkloss,trl --steps 2 --warmup 1 --out /tmp/longctx.json          # CPU smoke run

GRPO (``--loss grpo``): ``--seqs`` are completion lengths, 8 completions of one prompt per step.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys

from benchmarks.bench_e2e import child_env, sweep_parser, train
from benchmarks.harness import command, run_worker, split_choices, stamp
from benchmarks.report import longctx_summary, write_json

# impl -> (bench_e2e's implementation, config fields on top of its own)
IMPLS = {"chunkloss": ("chunkloss", {"chunk_long_context": True}), "chunkloss-gc": ("chunkloss", {}),
         "trl": ("trl", {}), "liger": ("liger", {}), "unsloth": ("unsloth", {}),
         "liger-offload": ("liger", {"activation_offloading": True})}  # fmt: skip
GRPO_GROUP = 8  # completions per prompt, all in one step


def run_length(a, seq: int) -> dict:
    """``a.impl`` trained at ``seq`` tokens per sequence (bench_e2e's ``train``, checkpointing on)."""
    impl, extra = IMPLS[a.impl]
    group = GRPO_GROUP if a.loss == "grpo" else 1
    extra = {**extra, "num_generations": GRPO_GROUP} if a.loss == "grpo" else extra
    fields = dict(seq=seq, gc="on", impl=impl, kernels=True, medusa_heads=0, medusa_stage=1, extra=extra)
    r = train(argparse.Namespace(**{**vars(a), **fields, "rows": a.steps * group}), group)
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss: KiB
    return {**r, "impl": a.impl, "tokens": seq * group, "host_peak_gib": host}


def worker(a) -> None:
    if a.gpu_gib:  # a smaller card's memory on a larger one: allocations past it fail as they would there
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.gpu_gib * 2**30 / total))
    rows = []
    for seq in a.seqs:
        r = run_length(a, seq)
        rows.append(r)
        shown = {k: r.get(k) for k in ("step_time_s", "peak_mem_gib", "host_peak_gib", "error")}
        print(f"[bench_longctx] {a.impl} {seq}: {json.dumps(shown)}", flush=True)
        write_json(a.out, rows)
        if r.get("oom") or r.get("error"):
            break


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = sweep_parser(__doc__, task="lora", steps=3, warmup=1, timeout_s=540)
    p.add_argument("--loss", choices=("sft", "grpo"), default="sft")
    p.add_argument("--seqs", default="32768,65536,131072", help="tokens per sequence, in turn until an OOM")
    p.add_argument("--impl", default="chunkloss,chunkloss-gc,liger,liger-offload", help=f"of {tuple(IMPLS)}")
    p.add_argument("--gpu-gib", type=float, default=0, help="cap the GPU memory the process may allocate")
    a = p.parse_args(argv)
    a.seqs = [int(s) for s in a.seqs.split(",") if s]
    impls = split_choices(p, "--impl", a.impl, IMPLS)
    if a.steps <= a.warmup:
        p.error("--steps must leave a timed step after --warmup")
    if a.worker:
        worker(a)
        return 0
    st = stamp(command=command("bench_longctx", argv))
    data = {"stamp": st, "mode": "longctx", "gpu_gib_cap": a.gpu_gib or None, "rows": []}
    for impl in impls:
        env = child_env(IMPLS[impl][0])
        rows, error = run_worker("bench_longctx", [*argv, "--impl", impl], a.timeout_s, env)
        if error:
            print(f"[bench_longctx] {impl}: {error}", flush=True)
        data["rows"] += rows
        data["summary"] = longctx_summary(data["rows"])
        write_json(a.out, data)
    print(f"[bench_longctx] wrote {a.out}: {json.dumps(data['summary'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
