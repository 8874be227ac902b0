"""End-to-end: chunkloss's TRL trainers against TRL's own, on randomly initialised real-shaped models.

* GRPO: ``ChunkedGRPOTrainer`` vs ``GRPOTrainer`` on a Qwen3-0.6B-shaped model (vocab 151936, hidden 1024).
* DPO:  ``ChunkedDPOTrainer`` vs ``DPOTrainer`` on a Llama-3.2-1B-shaped model (vocab 128256, hidden 2048).
* ORPO: ``ChunkedORPOTrainer`` vs ``trl.experimental.orpo.ORPOTrainer`` on the same Llama shape.

For each pair, per-device batch sizes grow until a run goes out of memory; each run records the mean step
time (after ``--warmup`` steps), tokens/s and peak CUDA memory. Then both trainers of each pair train
``--curve-steps`` steps from the same initial weights at ``--curve-batch`` and their loss curves are
recorded. Writes ``e2e.json``, ``e2e.md`` and ``e2e.png`` (with matplotlib) to ``--out``.

Nothing is downloaded: the tokenizer is trained locally (``chunkloss.data``); ids it does not know decode to
nothing, so the large random vocabulary is harmless. Layers are trimmed with ``--layers`` to fit the time
budget (the LM head, where the two implementations differ, keeps its full size).

    python -m benchmarks.bench_e2e --out benchmarks/results/e2e                 # H100, ~8 min
    python -m benchmarks.bench_e2e --out /tmp/e2e --tiny                        # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

from chunkloss.data import count_reward, tiny_tokenizer

SHAPES = {
    "qwen3-0.6b": dict(
        family="qwen3", vocab=151936, hidden=1024, inter=3072, layers=28, heads=16, kv=8, head_dim=128
    ),
    "llama-3.2-1b": dict(
        family="llama", vocab=128256, hidden=2048, inter=8192, layers=16, heads=32, kv=8, head_dim=64
    ),
    "tiny": dict(family="qwen3", vocab=4096, hidden=64, inter=128, layers=1, heads=4, kv=2, head_dim=16),
}


def build_model(shape: str, layers: int | None, tokenizer, device, dtype):
    s = SHAPES[shape]
    cfg = AutoConfig.for_model(
        s["family"],
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=layers or s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        head_dim=s["head_dim"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)


def counting_dataset(kind: str, n: int, length: int) -> Dataset:
    """Counting prompts with completions of about ``length`` words (long enough for the logits to matter)."""
    prompts, good, bad = [], [], []
    for i in range(n):
        start = i % 20
        prompts.append(f"count {start} to {start + length - 1} :")
        seq = [str((start + j) % 30) for j in range(length)]
        good.append(" " + " ".join(seq))
        bad.append(" " + " ".join(reversed(seq)))
    if kind == "grpo":
        return Dataset.from_dict({"prompt": prompts, "answer": good})
    return Dataset.from_dict({"prompt": prompts, "chosen": good, "rejected": bad})


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self._t0 = 0.0

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kw):
        self._sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self._sync()
        self.times.append(time.perf_counter() - self._t0)


def make_trainer(task: str, impl: str, model, tokenizer, ds, out_dir: str, batch: int, steps: int, a):
    common = dict(
        output_dir=out_dir,
        report_to="none",
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        bf16=a.device == "cuda",
        use_cpu=a.device == "cpu",
        dataloader_num_workers=0,
        seed=0,
    )
    chunk = dict(chunk_compile=not a.no_compile)
    if task == "grpo":
        from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer
        from trl import GRPOConfig, GRPOTrainer

        cfg = dict(common, num_generations=2, max_completion_length=a.completion_len, temperature=1.0)
        if impl == "trl":
            return GRPOTrainer(
                model, count_reward, GRPOConfig(**cfg), train_dataset=ds, processing_class=tokenizer
            )
        return ChunkedGRPOTrainer(
            model,
            count_reward,
            ChunkedGRPOConfig(**cfg, **chunk),
            train_dataset=ds,
            processing_class=tokenizer,
        )
    if task == "dpo":
        from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer
        from trl import DPOConfig, DPOTrainer

        cfg = dict(common, max_length=a.seq_len, precompute_ref_log_probs=False)
        ref = build_model(a.dpo_shape, a.layers, tokenizer, a.device, model.dtype)
        ref.requires_grad_(False)
        if impl == "trl":
            return DPOTrainer(model, ref, DPOConfig(**cfg), train_dataset=ds, processing_class=tokenizer)
        return ChunkedDPOTrainer(model, ref, ChunkedDPOConfig(**cfg, **chunk), train_dataset=ds,
                                 processing_class=tokenizer)  # fmt: skip
    from chunkloss.trainers.orpo import ChunkedORPOConfig, ChunkedORPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    cfg = dict(common, max_length=a.seq_len)
    if impl == "trl":
        return ORPOTrainer(model, ORPOConfig(**cfg), train_dataset=ds, processing_class=tokenizer)
    return ChunkedORPOTrainer(
        model, ChunkedORPOConfig(**cfg, **chunk), train_dataset=ds, processing_class=tokenizer
    )


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _cleanup():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_one(task, impl, shape, batch, steps, a, tokenizer, ds):
    """Train ``steps`` steps; returns a result dict (``oom`` set when it ran out of memory)."""
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    res = {"task": task, "impl": impl, "batch": batch, "steps": steps}
    trainer = model = None
    try:
        model = build_model(shape, a.layers, tokenizer, a.device, dtype)
        run_dir = os.path.join(a.out, "runs", f"{task}-{impl}")
        trainer = make_trainer(task, impl, model, tokenizer, ds, run_dir, batch, steps, a)
        timer = StepTimer()
        trainer.add_callback(timer)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        times = timer.times[a.warmup :] or timer.times
        res["step_time_s"] = sum(times) / len(times)
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        logs = trainer.state.log_history
        res["losses"] = [h["loss"] for h in logs if "loss" in h]
        ntok = [h.get("num_tokens") for h in logs if h.get("num_tokens") is not None]
        if len(ntok) >= 2:
            per_step = (ntok[-1] - ntok[0]) / max(len(ntok) - 1, 1)
            res["tokens_per_s"] = per_step / res["step_time_s"]
        res["oom"] = False
    except Exception as e:  # noqa: BLE001 - an OOM ends the sweep; anything else is reported
        if not _is_oom(e):
            raise
        res["oom"] = True
    finally:
        del trainer, model
        _cleanup()
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default="grpo,dpo,orpo")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (the real models have 28 / 16)")
    p.add_argument("--batch-sizes", default="2,4,8,16,32,64,128")
    p.add_argument("--sweep-steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (compilation)")
    p.add_argument("--curve-steps", type=int, default=30)
    p.add_argument("--curve-batch", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=128, help="GRPO max_completion_length")
    p.add_argument("--seq-len", type=int, default=512, help="DPO/ORPO max_length")
    p.add_argument("--words", type=int, default=200, help="words per DPO/ORPO completion")
    p.add_argument("--time-budget-s", type=float, default=450.0, help="stop sweeping once this much has run")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, few steps")
    a = p.parse_args(argv)
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    grpo_shape, a.dpo_shape = "qwen3-0.6b", "llama-3.2-1b"
    if a.tiny:
        grpo_shape = a.dpo_shape = "tiny"
        a.layers, a.batch_sizes, a.sweep_steps, a.warmup = 1, "2,4", 2, 1
        a.curve_steps, a.curve_batch, a.completion_len, a.seq_len, a.words = 3, 2, 4, 48, 6
        a.no_compile = True
    os.makedirs(a.out, exist_ok=True)
    tokenizer = tiny_tokenizer()
    t_start = time.perf_counter()
    results = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "args": vars(a),
               "sweep": [], "curves": []}  # fmt: skip
    tasks = [t for t in a.tasks.split(",") if t]
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    for task in tasks:
        shape = grpo_shape if task == "grpo" else a.dpo_shape
        ds = counting_dataset(task, 512, a.words)
        # Loss curves first: they are the fidelity half of the benchmark.
        for impl in ("trl", "chunkloss"):
            r = run_one(task, impl, shape, a.curve_batch, a.curve_steps, a, tokenizer, ds)
            results["curves"].append(r)
            print(
                f"[curve] {task} {impl} bs={a.curve_batch} oom={r['oom']} losses={r.get('losses', [])[:5]}..."
            )
        for impl in ("trl", "chunkloss"):
            for bs in sizes:
                if time.perf_counter() - t_start > a.time_budget_s:
                    print(f"[sweep] time budget reached, skipping {task} {impl} bs>={bs}")
                    break
                r = run_one(task, impl, shape, bs, a.sweep_steps, a, tokenizer, ds)
                results["sweep"].append(r)
                print(f"[sweep] {task} {impl} bs={bs}: " + ("OOM" if r["oom"] else
                      f"{r['step_time_s']:.3f} s/step, {r.get('tokens_per_s', float('nan')):.0f} tok/s, "
                      f"peak {r['peak_mem_gib']} GiB"))  # fmt: skip
                if r["oom"]:
                    break
    results["wall_s"] = time.perf_counter() - t_start
    write_outputs(results, a.out)


def write_outputs(results: dict, out: str) -> None:
    with open(os.path.join(out, "e2e.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"# End-to-end: chunkloss trainers vs TRL ({results['device']})", "",
             "| task | impl | batch | step time (s) | tokens/s | peak memory (GiB) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["sweep"]:
        if r["oom"]:
            lines.append(f"| {r['task']} | {r['impl']} | {r['batch']} | OOM | | |")
            continue
        mem = "" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        tps = r.get("tokens_per_s")
        lines.append(f"| {r['task']} | {r['impl']} | {r['batch']} | {r['step_time_s']:.3f} | "
                     f"{'' if tps is None else f'{tps:.0f}'} | {mem} |")  # fmt: skip
    lines += ["", "## Loss curves (first and last logged loss)", "", "| task | impl | batch | first | last |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in results["curves"]:
        ls = r.get("losses") or [math.nan]
        lines.append(f"| {r['task']} | {r['impl']} | {r['batch']} | {ls[0]:.4f} | {ls[-1]:.4f} |")
    lines.append(f"\nWall time: {results['wall_s']:.0f} s")
    with open(os.path.join(out, "e2e.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tasks = sorted({r["task"] for r in results["curves"] + results["sweep"]})
    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 8), squeeze=False)
    for j, task in enumerate(tasks):
        for r in results["curves"]:
            if r["task"] == task and r.get("losses"):
                axes[0][j].plot(r["losses"], label=r["impl"])
        axes[0][j].set_title(f"{task}: loss")
        axes[0][j].legend()
        for impl in ("trl", "chunkloss"):
            pts = [
                (r["batch"], r["peak_mem_gib"])
                for r in results["sweep"]
                if r["task"] == task and r["impl"] == impl and not r["oom"] and r["peak_mem_gib"] is not None
            ]
            if pts:
                axes[1][j].plot(*zip(*pts), marker="o", label=impl)
        axes[1][j].set_xscale("log", base=2)
        axes[1][j].set_xlabel("per-device batch")
        axes[1][j].set_title(f"{task}: peak memory (GiB)")
        axes[1][j].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "e2e.png"), dpi=110)


if __name__ == "__main__":
    main()
