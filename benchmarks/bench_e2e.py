"""End-to-end: chunkloss's TRL trainers against TRL's own, on randomly initialised real-shaped models.

* GRPO: ``ChunkedGRPOTrainer`` vs ``GRPOTrainer`` on a Qwen3-0.6B-shaped model (vocab 151936, hidden 1024).
* DPO:  ``ChunkedDPOTrainer`` vs ``DPOTrainer`` on a Llama-3.2-1B-shaped model (vocab 128256, hidden 2048).
* ORPO: ``ChunkedORPOTrainer`` vs ``trl.experimental.orpo.ORPOTrainer`` on the same Llama shape.

Implementations (``--impls``, all three by default): ``trl`` (TRL's trainer), ``chunkloss`` (the chunked
trainer) and ``chunkloss+kernels`` (the chunked trainer with ``chunk_kernels=True``: the model's RMSNorms,
rotary embedding and gated MLPs, and DPO's reference model's, on chunkloss's Triton kernels). The rotary
patch is process-wide, so it is undone after each ``chunkloss+kernels`` run (``unpatch_rotary``) and the
other implementations run on transformers' own.

Per task, first a batch-size sweep: per-device batch sizes grow, the implementations run in turn at each
size, until all have gone out of memory or the task's share of the time budget is spent; each run records the
mean step time (after ``--warmup`` steps), tokens/s and peak CUDA memory. Then each trains ``--curve-steps``
steps from the same initial weights at ``--curve-batch`` and their loss curves are recorded (fewer steps, at
least ``--min-curve-steps``, when the sweep's step times say the full curves would overrun the task's share).
``--time-budget-s`` is split evenly over the tasks still to run, so time one task leaves over goes to the
next. ``e2e.json`` and ``e2e.md`` in ``--out`` are rewritten after every run, so a run that is cut off still
leaves its results; ``e2e.png`` (with matplotlib) after every task.

Every run starts from the same weights: each task's model is initialised once, directly on the device in
its dtype, and each run builds its model on the device and loads that saved copy (kept in host memory, so it
does not count in the peak). DPO's reference model is the same initial weights. The chunked trainers of a
task (with and without the kernels) share one loss module, so its per-chunk step is compiled once per task
rather than once per run (a long training run compiles once too); compilation falls in the warm-up steps
either way.

Nothing is downloaded: the tokenizer is trained locally (``chunkloss.data``); ids it does not know decode to
nothing, so the large random vocabulary is harmless. Layers are trimmed with ``--layers`` to fit the time
budget (the LM head, where the two implementations differ, keeps its full size).

    python -m benchmarks.bench_e2e --out benchmarks/results/e2e                 # H100, ~7 min
    python -m benchmarks.bench_e2e --out /tmp/e2e --tiny                        # CPU smoke run
    TRITON_INTERPRET=1 python -m benchmarks.bench_e2e --out /tmp/e2e --tiny     # ... with the kernels

On a CPU without ``TRITON_INTERPRET=1`` the Triton kernels cannot run, and ``chunkloss+kernels`` is left out
(with a note).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

from chunkloss.data import count_reward, tiny_tokenizer

SHAPES = {
    "qwen3-0.6b": dict(
        family="qwen3", vocab=151936, hidden=1024, inter=3072, layers=28, heads=16, kv=8, head_dim=128
    ),
    "qwen3-1.7b": dict(
        family="qwen3", vocab=151936, hidden=2048, inter=6144, layers=28, heads=16, kv=8, head_dim=128
    ),
    "llama-3.2-1b": dict(
        family="llama", vocab=128256, hidden=2048, inter=8192, layers=16, heads=32, kv=8, head_dim=64
    ),
    "tiny": dict(family="qwen3", vocab=4096, hidden=64, inter=128, layers=1, heads=4, kv=2, head_dim=16),
}
IMPLS = ("trl", "chunkloss", "chunkloss+kernels")
# Where each chunked trainer keeps its loss module(s); shared by a task's runs so it compiles once.
LOSS_ATTR = {"grpo": "_chunk_losses", "dpo": "_dpo_loss", "orpo": "_orpo_loss"}


def build_model(shape: str, layers: int | None, tokenizer, device, dtype, state: dict | None = None):
    """The model, initialised on ``device`` in ``dtype`` (seed 0), then loaded from ``state`` when given."""
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
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if state is not None:
        model.load_state_dict(state)
    return model


def initial_state(shape: str, a, tokenizer, dtype) -> dict:
    """A host copy of the task's initial weights (pinned on CUDA for a fast load)."""
    model = build_model(shape, a.layers, tokenizer, a.device, dtype)
    state, copies = {}, {}
    for k, v in model.state_dict().items():
        key = (v.data_ptr(), v.dtype, tuple(v.shape))  # tied weights: one host copy
        if key not in copies:
            host = v.detach().to("cpu", copy=True)
            copies[key] = host.pin_memory() if a.device == "cuda" else host
        state[k] = copies[key]
    del model
    _cleanup()
    return state


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


def even_id_reward(completion_ids, **kwargs) -> list[float]:
    """Fraction of a completion's token ids that are even. A random model's samples almost all decode to
    nothing the tiny tokenizer knows, so the counting reward alone is the same for every completion of a
    group, the advantages are zero and the loss curves say nothing; this reward varies between samples and
    the policy can learn it."""
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


GRPO_REWARDS = [count_reward, even_id_reward]


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


def make_trainer(task: str, impl: str, model, ref, tokenizer, ds, out_dir: str, batch: int, steps: int, a):
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
    chunk = dict(chunk_compile=not a.no_compile, chunk_kernels=impl == "chunkloss+kernels")
    if task == "grpo":
        from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer
        from trl import GRPOConfig, GRPOTrainer

        cfg = dict(common, num_generations=2, max_completion_length=a.completion_len, temperature=1.0)
        if impl == "trl":
            return GRPOTrainer(
                model, GRPO_REWARDS, GRPOConfig(**cfg), train_dataset=ds, processing_class=tokenizer
            )
        return ChunkedGRPOTrainer(
            model,
            GRPO_REWARDS,
            ChunkedGRPOConfig(**cfg, **chunk),
            train_dataset=ds,
            processing_class=tokenizer,
        )
    if task == "dpo":
        from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer
        from trl import DPOConfig, DPOTrainer

        cfg = dict(common, max_length=a.seq_len, precompute_ref_log_probs=False)
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
    # Objects alive at the last cleanup are frozen (gc.freeze), so this scans only what the run made.
    gc.collect()
    gc.freeze()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _share_loss(trainer, task: str, shared: dict) -> None:
    """Give a chunked trainer the task's first loss module, so its compiled per-chunk step is reused."""
    attr = LOSS_ATTR[task]
    if not hasattr(trainer, attr):
        return
    if task in shared:
        setattr(trainer, attr, shared[task])
    else:
        shared[task] = getattr(trainer, attr)


def run_one(task, impl, shape, batch, steps, a, tokenizer, ds, state, shared):
    """Train ``steps`` steps from ``state``; returns a result dict (``oom`` set when it ran out of memory)."""
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    res = {"task": task, "impl": impl, "batch": batch, "steps": steps}
    trainer = model = ref = None
    t0 = time.perf_counter()
    try:
        model = build_model(shape, a.layers, tokenizer, a.device, dtype, state)
        if task == "dpo":  # the reference is the initial policy
            ref = build_model(shape, a.layers, tokenizer, a.device, dtype, state)
            ref.requires_grad_(False)
        t1 = time.perf_counter()
        run_dir = os.path.join(a.out, "runs", f"{task}-{impl}")
        trainer = make_trainer(task, impl, model, ref, tokenizer, ds, run_dir, batch, steps, a)
        if impl != "trl":
            _share_loss(trainer, task, shared)
        timer = StepTimer()
        trainer.add_callback(timer)
        t2 = time.perf_counter()
        res["build_s"], res["setup_s"] = t1 - t0, t2 - t1
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        res["train_s"] = time.perf_counter() - t2
        res["steps_s"] = sum(timer.times)
        times = timer.times[a.warmup :] or timer.times
        # The median: single steps of 50-90 ms moved by up to 40% between runs with a mean of two.
        res["step_time_s"] = statistics.median(times)
        res["step_times_s"] = times
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        logs = trainer.state.log_history
        res["losses"] = [h["loss"] for h in logs if "loss" in h]
        # GRPO's on-policy loss is ~0 whatever the weights (zero-mean advantages); its reward curve tracks.
        res["rewards"] = [h["reward"] for h in logs if "reward" in h]
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
        if impl == "chunkloss+kernels":
            # The rotary patch is process-wide: the next trl / chunkloss run gets transformers' own again.
            from chunkloss.kernels import unpatch_rotary

            unpatch_rotary()
        del trainer, model, ref
        _cleanup()
    res["wall_s"] = time.perf_counter() - t0
    return res


def _overhead_s(r: dict) -> float:
    """A run's time outside its training steps (model build, trainer setup, cleanup); compilation, in the
    warm-up steps, is left out, since later runs of the task reuse the compiled loss."""
    return max(r["wall_s"] - r["steps_s"], 0.0)


def _predict_s(r: dict | None, batch: int, steps: int) -> float:
    """Wall time of a run at ``batch`` from the same impl's previous run ``r`` (step time taken linear in the
    batch, which overestimates while the GPU is not yet saturated)."""
    if r is None or r["oom"]:
        return 0.0
    return _overhead_s(r) + r["step_time_s"] * batch / r["batch"] * steps


def _fmt(r: dict) -> str:
    if r["oom"]:
        return "OOM"
    mem = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
    tps = r.get("tokens_per_s", math.nan)
    parts = f"build {r['build_s']:.1f} s, setup {r['setup_s']:.1f} s, train {r['train_s']:.1f} s"
    return f"{r['step_time_s']:.3f} s/step, {tps:.0f} tok/s, peak {mem} GiB ({parts})"


def run_task(task, shape, a, tokenizer, results, deadline, t_start):
    """Sweep, then curves, for one task; stops starting runs that would end after ``deadline``."""
    t_task = time.perf_counter()
    sweep_deadline = t_task + a.sweep_share * (deadline - t_task)
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    n = max(64, max(sizes) * a.sweep_steps, a.curve_batch * a.curve_steps)
    ds = counting_dataset(task, n, a.words)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    state = initial_state(shape, a, tokenizer, dtype)
    shared: dict = {}

    def record(kind: str, r: dict) -> None:
        results[kind].append(r)
        results["wall_s"] = time.perf_counter() - t_start
        write_outputs(results, a.out, plot=False)

    last: dict = {impl: None for impl in a.impls}
    alive = dict.fromkeys(a.impls, True)
    for bs in sizes:
        todo = [impl for impl in a.impls if alive[impl]]
        if not todo:
            break
        need = sum(_predict_s(last[impl], bs, a.sweep_steps) for impl in todo)
        if time.perf_counter() + need > sweep_deadline:
            print(f"[sweep] {task}: bs={bs} would need ~{need:.0f} s, past the sweep's share; stopping")
            results["skipped"].append({"task": task, "batch": bs, "impls": todo, "reason": "time budget"})
            break
        for impl in todo:
            r = run_one(task, impl, shape, bs, a.sweep_steps, a, tokenizer, ds, state, shared)
            last[impl] = r
            alive[impl] = not r["oom"]
            record("sweep", r)
            print(f"[sweep] {task} {impl} bs={bs}: {_fmt(r)}", flush=True)

    # Curves: the full --curve-steps unless the sweep's step times at the curve batch say they would overrun.
    steps = a.curve_steps
    ref = [r for r in results["sweep"] if r["task"] == task and not r["oom"]]
    if ref:
        near = min(ref, key=lambda r: (abs(math.log(r["batch"] / a.curve_batch)), -r["batch"]))
        at_near = max(r["step_time_s"] for r in ref if r["batch"] == near["batch"])
        per_step = at_near * a.curve_batch / near["batch"]
        overhead = max(_overhead_s(r) for r in ref)
        n = len(a.impls)
        fit = int((deadline - time.perf_counter() - n * overhead) / (n * per_step))
        if fit < steps:
            steps = max(fit, min(a.min_curve_steps, a.curve_steps))
            print(f"[curve] {task}: {steps} steps fit the task's share (~{per_step:.2f} s/step)")
    for impl in a.impls:
        r = run_one(task, impl, shape, a.curve_batch, steps, a, tokenizer, ds, state, shared)
        record("curves", r)
        print(f"[curve] {task} {impl} bs={a.curve_batch} steps={steps}: {_fmt(r)}; "
              f"losses {[round(x, 4) for x in r.get('losses', [])[:5]]}...", flush=True)  # fmt: skip
    del state, shared
    gc.unfreeze()
    _cleanup()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default="grpo,dpo,orpo")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from {', '.join(IMPLS)}")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (the real models have 28 / 16)")
    p.add_argument("--batch-sizes", default="2,4,8,16,32,64,128")
    p.add_argument("--sweep-steps", type=int, default=8, help="steps per sweep run, --warmup of them untimed")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (compilation)")
    p.add_argument("--curve-steps", type=int, default=30)
    p.add_argument("--min-curve-steps", type=int, default=10, help="curves never get fewer steps than this")
    p.add_argument("--curve-batch", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=128, help="GRPO max_completion_length")
    p.add_argument("--seq-len", type=int, default=512, help="DPO/ORPO max_length")
    p.add_argument("--words", type=int, default=200, help="words per DPO/ORPO completion")
    p.add_argument("--time-budget-s", type=float, default=360.0,
                   help="for all tasks together, split evenly over the tasks still to run")  # fmt: skip
    p.add_argument("--sweep-share", type=float, default=0.6, help="part of a task's time for its sweep")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, few steps")
    a = p.parse_args(argv)
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.impls = [i for i in a.impls.split(",") if i]
    unknown = sorted(set(a.impls) - set(IMPLS))
    if unknown or not a.impls:
        p.error(f"--impls: unknown {unknown}; choose from {', '.join(IMPLS)}")
    if "chunkloss+kernels" in a.impls and a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("note: chunkloss+kernels left out: on a CPU its Triton kernels need TRITON_INTERPRET=1")
        a.impls.remove("chunkloss+kernels")
        if not a.impls:
            p.error("--impls: nothing left to run")
    grpo_shape, dpo_shape = "qwen3-0.6b", "llama-3.2-1b"
    if a.tiny:
        grpo_shape = dpo_shape = "tiny"
        a.layers, a.batch_sizes, a.sweep_steps, a.warmup = 1, "2,4", 2, 1
        a.curve_steps, a.min_curve_steps, a.curve_batch = 3, 3, 2
        a.completion_len, a.seq_len, a.words = 4, 48, 6
        a.no_compile = True
    os.makedirs(a.out, exist_ok=True)
    t_start = time.perf_counter()
    tokenizer = tiny_tokenizer()
    results = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "args": vars(a),
               "sweep": [], "curves": [], "skipped": []}  # fmt: skip
    tasks = [t for t in a.tasks.split(",") if t]
    _cleanup()
    for i, task in enumerate(tasks):
        share = (a.time_budget_s - (time.perf_counter() - t_start)) / (len(tasks) - i)
        shape = grpo_shape if task == "grpo" else dpo_shape
        run_task(task, shape, a, tokenizer, results, time.perf_counter() + max(share, 0.0), t_start)
        results["wall_s"] = time.perf_counter() - t_start
        write_outputs(results, a.out)
    print(f"wall {results['wall_s']:.0f} s; results in {a.out}")


def write_outputs(results: dict, out: str, plot: bool = True) -> None:
    with open(os.path.join(out, "e2e.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"# End-to-end: chunkloss trainers vs TRL ({results['device']})", "",
             "Ratios: the implementation's over TRL's at the same task and batch (below 1: faster / less).",
             "",
             "| task | impl | batch | step time (s) | tokens/s | peak mem (GiB) | time / trl | mem / trl |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    trl = {(r["task"], r["batch"]): r for r in results["sweep"] if r["impl"] == "trl" and not r["oom"]}
    for r in results["sweep"]:
        if r["oom"]:
            lines.append(f"| {r['task']} | {r['impl']} | {r['batch']} | OOM | | | | |")
            continue
        mem = "" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        tps = r.get("tokens_per_s")
        t = trl.get((r["task"], r["batch"])) if r["impl"] != "trl" else None
        t_ratio = "–" if t is None else f"{r['step_time_s'] / t['step_time_s']:.2f}"
        has_mem = t is not None and r["peak_mem_gib"] is not None and t["peak_mem_gib"] is not None
        m_ratio = f"{r['peak_mem_gib'] / t['peak_mem_gib']:.2f}" if has_mem else "–"
        lines.append(f"| {r['task']} | {r['impl']} | {r['batch']} | {r['step_time_s']:.3f} | "
                     f"{'' if tps is None else f'{tps:.0f}'} | {mem} | {t_ratio} | {m_ratio} |")  # fmt: skip
    for s in results.get("skipped", []):
        lines.append(f"\n{s['task']}: sweep stopped before batch {s['batch']} ({s['reason']}).")
    lines += ["", "## Curves (first and last logged loss, and reward where the trainer logs one)", "",
              "| task | impl | batch | steps | first loss | last loss | first reward | last reward |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["curves"]:
        ls = r.get("losses") or [math.nan]
        rw = r.get("rewards") or [math.nan]
        row = f"| {r['task']} | {r['impl']} | {r['batch']} | {r['steps']}"
        lines.append(f"{row} | {ls[0]:.4f} | {ls[-1]:.4f} | {rw[0]:.4f} | {rw[-1]:.4f} |")
    lines.append(f"\nWall time: {results.get('wall_s', math.nan):.0f} s")
    with open(os.path.join(out, "e2e.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tasks = sorted({r["task"] for r in results["curves"] + results["sweep"]})
    if not tasks:
        return
    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 8), squeeze=False)
    style = {impl: ls for impl, ls in zip(IMPLS, ("-", "--", ":"), strict=True)}  # equal curves overlap
    for j, task in enumerate(tasks):
        key = "rewards" if any(r.get("rewards") for r in results["curves"] if r["task"] == task) else "losses"
        for r in results["curves"]:
            if r["task"] == task and r.get(key):
                axes[0][j].plot(r[key], label=r["impl"], linestyle=style.get(r["impl"], "-"))
        axes[0][j].set_title(f"{task}: {'reward' if key == 'rewards' else 'loss'}")
        for impl in IMPLS:
            pts = [
                (r["batch"], r["peak_mem_gib"])
                for r in results["sweep"]
                if r["task"] == task and r["impl"] == impl and not r["oom"] and r["peak_mem_gib"] is not None
            ]
            if pts:
                axes[1][j].plot(*zip(*pts), marker="o", label=impl, linestyle=style[impl])
        axes[1][j].set_xscale("log", base=2)
        axes[1][j].set_xlabel("per-device batch")
        axes[1][j].set_title(f"{task}: peak memory (GiB)")
        for ax in (axes[0][j], axes[1][j]):
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "e2e.png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
