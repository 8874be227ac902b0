"""Run every GPU-scale config (``configs/*-qwen3-0.6b.yaml``) on a GPU host with no network.

The configs name hub checkpoints (``Qwen/Qwen3-0.6B``, teacher ``Qwen/Qwen3-1.7B``). An offline host has
neither, so this first saves randomly initialised checkpoints of the same shapes (Qwen3-0.6B: vocab 151936,
hidden 1024, 28 layers; Qwen3-1.7B: hidden 2048, 28 layers) with the locally trained tokenizer, then runs
``chunkloss train CONFIG`` on each config unchanged except for ``--model_name_or_path`` (and the teacher's)
pointing at them and ``--max_steps`` (plus the generation lengths, so every config fits a short run). Each
run's summary (final loss, tokens/s, peak GPU memory) is collected into ``gpu_configs.json``/``.md``.

    python -m benchmarks.gpu_configs --out OUT [--steps 6] [--only sft,dpo]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

# Per trainer: extra overrides that shorten generation so a few steps fit the host's command limit.
SHORTEN = {
    "grpo": ["--max_completion_length", "64"],
    "gkd": ["--max_new_tokens", "64"],
    "distillation": ["--max_completion_length", "64"],
}


def save_checkpoint(name: str, root: Path) -> Path:
    """A random checkpoint of ``bench_e2e.SHAPES[name]`` (bf16) with the local tokenizer, saved once."""
    from benchmarks.bench_e2e import build_model
    from chunkloss.data import tiny_tokenizer

    path = root / name
    if (path / "config.json").exists():
        return path
    tok = tiny_tokenizer()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    build_model(name, None, tok, device, torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", default=None, help="comma-separated trainers (default: every config)")
    ap.add_argument("--timeout-s", type=int, default=150, help="per config")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path("/tmp/chunkloss-ckpt")
    student = save_checkpoint("qwen3-0.6b", ckpt)
    teacher = None
    results = []
    configs = sorted(Path("configs").glob("*-qwen3-0.6b.yaml"))
    for config in configs:
        trainer = config.name.split("-")[0]
        if args.only and trainer not in args.only.split(","):
            continue
        run_out = Path("/tmp/chunkloss-runs") / trainer
        cmd = [sys.executable, "-m", "chunkloss.cli", "train", str(config),
               "--model_name_or_path", str(student), "--max_steps", str(args.steps),
               "--logging_steps", "1", "--output_dir", str(run_out),
               *SHORTEN.get(trainer, [])]
        if trainer in ("gkd", "distillation"):
            teacher = teacher or save_checkpoint("qwen3-1.7b", ckpt)
            cmd += ["--teacher_model_name_or_path", str(teacher)]
        print(f"== {config}: {' '.join(cmd[3:])}", flush=True)
        t0 = time.time()
        with open(out / f"{trainer}.log", "w") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        row = {"config": str(config), "trainer": trainer, "rc": rc, "seconds": round(time.time() - t0, 1),
               "overrides": cmd[4:]}
        summary = run_out / "chunkloss_summary.json"
        if rc == 0 and summary.exists():
            row["summary"] = json.loads(summary.read_text())
        results.append(row)
        print(f"   rc={rc} in {row['seconds']} s", flush=True)
        (out / "gpu_configs.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
             "torch": torch.__version__, "runs": results}, indent=2))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [f"# GPU-scale configs on one {device} (torch {torch.__version__})", "",
             f"`python -m benchmarks.gpu_configs --steps {args.steps}`: each config unchanged except "
             "the model paths (random Qwen3-0.6B / 1.7B-shaped checkpoints saved locally), `--max_steps`, "
             "`--logging_steps 1` and shorter generation for GRPO/GKD/distillation (the json lists the "
             "overrides). "
             "Peak memory is `torch.cuda.max_memory_allocated` of the whole run; tokens/s counts the tiny "
             "counting task's short examples.", "",
             "| config | rc | s | final loss | tokens/s | peak memory |", "|---|---|---|---|---|---|"]
    for r in results:
        s = r.get("summary", {})
        loss = s.get("final_loss")
        tps = s.get("tokens_per_s")
        mem = s.get("peak_memory_mib")
        lines.append(
            f"| {r['config']} | {r['rc']} | {r['seconds']} | {'n/a' if loss is None else f'{loss:.4f}'} "
            f"| {'n/a' if tps is None else f'{tps:.0f}'} | {'n/a' if mem is None else f'{mem:.0f} MiB'} |")
    (out / "gpu_configs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
