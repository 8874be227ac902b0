"""End-to-end: chunkloss's TRL trainers against TRL's own, on randomly initialised real-shaped models.

* GRPO: ``ChunkedGRPOTrainer`` vs ``GRPOTrainer`` on a Qwen3-0.6B-shaped model (vocab 151936, hidden 1024).
* SFT:  ``ChunkedSFTTrainer`` vs ``SFTTrainer`` on a Llama-3.2-1B-shaped model (vocab 128256, hidden 2048),
  prompt-completion data, so the loss is on the completion only (TRL's default for such data).
* DPO:  ``ChunkedDPOTrainer`` vs ``DPOTrainer`` on the same Llama shape.
* ORPO: ``ChunkedORPOTrainer`` vs ``trl.experimental.orpo.ORPOTrainer`` on the same Llama shape.
* GKD:  ``ChunkedGKDTrainer`` vs ``trl.experimental.gkd.GKDTrainer`` on the same Llama shape, the teacher of
  the same shape and depth with other weights (initialised from another seed, frozen). ``lmbda=0``: off-policy
  only, so no step generates and the step time is the loss path's; ``beta`` is TRL's default (0.5, the JSD).

Implementations (``--impls``; the first three by default): ``trl`` (TRL's trainer), ``chunkloss`` (the
chunked trainer), ``chunkloss+kernels`` (the chunked trainer with ``chunk_kernels=True``: the model's
RMSNorms, rotary embedding and gated MLPs, and DPO's reference model's or GKD's teacher's, on chunkloss's
Triton kernels) and ``chunkloss+kernels+recompute`` (the same with ``chunk_kernels_mlp_recompute=True`` and
``chunk_kernels_norm_recompute=True``: the fused MLP saves only its input and replays its gate/up GEMM in the
backward, and the norms before attention and MLP keep no output). The rotary patch is
process-wide, so it is undone after each run with the kernels (``unpatch_rotary``) and the other
implementations run on transformers' own.

Gradient checkpointing is off unless ``--gradient-checkpointing`` (TRL's configs turn it on by default; here
every implementation gets the same explicit setting); a run with it writes its result sets as
``e2e_<task>_gc``, beside the ones without. SFT, DPO, ORPO and GKD sequences are ``--seq-len`` tokens: by
default each completion has ``--seq-len`` words (a word is at least one token), so every sequence is
truncated to exactly ``--seq-len`` (each run records the length its first training forward saw:
``seq_tokens``, the padded length of the policy's input, ``rows`` and ``mean_tokens`` per row).

Per task, first a batch-size sweep: per-device batch sizes grow, the implementations run in turn at each size,
until all have gone out of memory or the task's share of the time budget is spent; each run records the median
step time after ``--warmup`` steps, tokens/s and peak CUDA memory. The first batch size runs ``--sweep-steps``
steps; later ones time enough steps for at least ``--min-timed-s`` seconds at the step time predicted from the
same implementation's earlier runs (``_step_time_at``), at most ``--max-timed-steps`` and at least
``--sweep-steps`` minus the warm-up (single steps of 50-90 ms moved by up to 40% between runs with 6 timed
steps); the time budget's predictions count those steps. GRPO's steps are mostly generation, the same code in
both trainers; each GRPO run also records the time spent per step in ``_generate_and_score_completions``
(generation, rewards and TRL's no-grad log-probs; ``gen_time_s``, the median) and the rest of the step
(``train_time_s``, the median of step minus generation: the loss path), next to the whole step's
``step_time_s``. Then each implementation trains ``--curve-steps`` steps from the same initial weights at
``--curve-batch`` and their loss curves are recorded (fewer steps, at least ``--min-curve-steps``, when the
sweep's step times say the full curves would overrun the task's share). ``--time-budget-s`` is split evenly
over the tasks still to run, so time one task leaves over goes to the next. Each task's result set,
``e2e_<task>.json`` (stamped with date, GPU and versions) and ``e2e_<task>.md`` in ``--out``, is rewritten
after every run, so a run that is cut off still leaves its results; ``e2e_<task>.png`` after every task. The
md file ends with a summary per implementation against TRL's: the growth of peak memory per added example
(the least-squares slope over the batches that ran), the largest batch that fit, the step-time ratio at each
batch both ran, and how far the loss curve strays from TRL's.

Every run starts from the same weights: each task's model is initialised once, directly on the device in
its dtype, and each run builds its model on the device and loads that saved copy (kept in host memory, so it
does not count in the peak). DPO's reference model is the same initial weights; GKD's teacher is a second
saved copy (seed 1), built per run like DPO's reference. The chunked trainers of a task (with and without the
kernels) share one loss module, so its per-chunk step is compiled once per task rather than once per run (a
long training run compiles once too); compilation falls in the warm-up steps either way.

Nothing is downloaded: the tokenizer is trained locally (``chunkloss.data``); ids it does not know decode to
nothing, so the large random vocabulary is harmless. The models keep their real depth (28 / 16 decoder layers)
unless ``--layers`` trims them to fit a time budget (the LM head, where the implementations differ, keeps its
full size either way); each result records its layer count.

    python -m benchmarks.bench_e2e --out benchmarks/results                     # grpo,dpo,orpo; H100, ~7 min
    python -m benchmarks.bench_e2e --out benchmarks/results --tasks sft,gkd     # the other two
    python -m benchmarks.bench_e2e --out /tmp/e2e --tasks sft --seq-len 1024 --gradient-checkpointing  # *_gc
    python -m benchmarks.bench_e2e --out /tmp/e2e --tiny                        # CPU smoke run
    TRITON_INTERPRET=1 python -m benchmarks.bench_e2e --out /tmp/e2e --tiny     # ... with the kernels

On a CPU without ``TRITON_INTERPRET=1`` the Triton kernels cannot run, and ``chunkloss+kernels`` is left out
(with a note).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback, TrainingArguments

from benchmarks.harness import free_memory, is_oom, random_model, stamp, training_input
from benchmarks.render import write_set
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
IMPLS = ("trl", "chunkloss", "chunkloss+kernels", "chunkloss+kernels+recompute")
DEFAULT_IMPLS = IMPLS[:3]
KERNEL_IMPLS = ("chunkloss+kernels", "chunkloss+kernels+recompute")
TASKS = ("grpo", "sft", "dpo", "orpo", "gkd")
# Where each chunked trainer keeps its loss module(s); shared by a task's runs so it compiles once.
LOSS_ATTR = {
    "grpo": "_chunk_losses",
    "sft": "_chunk_losses",
    "dpo": "_dpo_loss",
    "orpo": "_orpo_loss",
    "gkd": "_chunk_losses",
}
# The trainer method that generates a step's completions, timed apart from the rest of the step.
GEN_ATTR = {"grpo": "_generate_and_score_completions"}
# Words of GRPO's answers: only its counting reward reads them (completions are generated).
GRPO_WORDS = 200
# transformers 5 renamed TrainingArguments' gradient_checkpointing (the old name still works, with a warning).
CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def build_model(
    shape: str, layers: int | None, tokenizer, device, dtype, state: dict | None = None, seed: int = 0
):
    """The model, initialised on ``device`` in ``dtype`` from ``seed``, then loaded from ``state``, if any."""
    s = SHAPES[shape]
    model = random_model(s, device, dtype, seed, tokenizer, num_hidden_layers=layers or s["layers"],
                         max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
    if state is not None:
        model.load_state_dict(state)
    return model


def initial_state(shape: str, a, tokenizer, dtype, seed: int = 0) -> dict:
    """A host copy of the task's initial weights from ``seed`` (pinned on CUDA for a fast load)."""
    model = build_model(shape, a.layers, tokenizer, a.device, dtype, seed=seed)
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
        slips = {(i * 7 + 3) % length, (i * 13 + length // 2) % length}  # two wrong numbers: a pair that
        bad.append(" " + " ".join(str((int(w) + 1) % 30) if j in slips else w  # is not separable at step 1
                                  for j, w in enumerate(seq)))
    if kind == "grpo":
        return Dataset.from_dict({"prompt": prompts, "answer": good})
    if kind == "sft":
        return Dataset.from_dict({"prompt": prompts, "completion": good})
    if kind == "gkd":  # conversational: GKD's ChatML collator splits the prompt from the last message
        msgs = [[{"role": "user", "content": p}, {"role": "assistant", "content": g.strip()}]
                for p, g in zip(prompts, good, strict=True)]  # fmt: skip
        return Dataset.from_dict({"messages": msgs})
    return Dataset.from_dict({"prompt": prompts, "chosen": good, "rejected": bad})


def even_id_reward(completion_ids, **kwargs) -> list[float]:
    """Fraction of a completion's token ids that are even. A random model's samples almost all decode to
    nothing the tiny tokenizer knows, so the counting reward alone is the same for every completion of a
    group, the advantages are zero and the loss curves say nothing; this reward varies between samples and
    the policy can learn it."""
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


GRPO_REWARDS = [count_reward, even_id_reward]


class StepTimer(TrainerCallback):
    """Each training step's wall time and, after :meth:`time_method`, the time spent in that method."""

    def __init__(self):
        self.times: list[float] = []
        self.method_times: list[float] = []
        self._t0 = 0.0
        self._in_method = 0.0
        self._timed = False

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def time_method(self, trainer, name: str) -> None:
        """Time each call of ``trainer.<name>``, synchronised: queued GPU work counts where it was queued."""
        inner = getattr(trainer, name)

        def timed(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._sync()
                self._in_method += time.perf_counter() - t0

        setattr(trainer, name, timed)
        self._timed = True

    def on_step_begin(self, args, state, control, **kw):
        self._sync()
        self._in_method = 0.0
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self._sync()
        self.times.append(time.perf_counter() - self._t0)
        if self._timed:
            self.method_times.append(self._in_method)


def make_trainer(task: str, impl: str, model, ref, tokenizer, ds, out_dir: str, batch: int, steps: int, a):
    """The ``task``'s trainer of ``impl``; ``ref`` is DPO's reference model or GKD's teacher (else None)."""
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
        **{CHECKPOINTING: a.gradient_checkpointing},
    )
    chunk = dict(
        chunk_compile=not a.no_compile,
        chunk_kernels=impl in KERNEL_IMPLS,
        chunk_kernels_mlp_recompute=impl == "chunkloss+kernels+recompute",
        chunk_kernels_norm_recompute=impl == "chunkloss+kernels+recompute",
    )
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
    if task == "sft":
        from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer
        from trl import SFTConfig, SFTTrainer

        cfg = dict(common, max_length=a.seq_len)
        if impl == "trl":
            return SFTTrainer(model, SFTConfig(**cfg), train_dataset=ds, processing_class=tokenizer)
        return ChunkedSFTTrainer(
            model, ChunkedSFTConfig(**cfg, **chunk), train_dataset=ds, processing_class=tokenizer
        )
    if task == "dpo":
        from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer
        from trl import DPOConfig, DPOTrainer

        cfg = dict(common, max_length=a.seq_len, precompute_ref_log_probs=False)
        if impl == "trl":
            return DPOTrainer(model, ref, DPOConfig(**cfg), train_dataset=ds, processing_class=tokenizer)
        return ChunkedDPOTrainer(model, ref, ChunkedDPOConfig(**cfg, **chunk), train_dataset=ds,
                                 processing_class=tokenizer)  # fmt: skip
    if task == "orpo":
        from chunkloss.trainers.orpo import ChunkedORPOConfig, ChunkedORPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        cfg = dict(common, max_length=a.seq_len)
        if impl == "trl":
            return ORPOTrainer(model, ORPOConfig(**cfg), train_dataset=ds, processing_class=tokenizer)
        return ChunkedORPOTrainer(
            model, ChunkedORPOConfig(**cfg, **chunk), train_dataset=ds, processing_class=tokenizer
        )
    if task == "gkd":
        from chunkloss.trainers.gkd import ChunkedGKDConfig, ChunkedGKDTrainer
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        # lmbda=0: off-policy, no step generates. GKDTrainer logs no token count of its own; the Trainer's
        # count of non-padding input tokens gives tokens/s.
        cfg = dict(common, max_length=a.seq_len, lmbda=0.0, include_num_input_tokens_seen="non_padding")
        if impl == "trl":
            return GKDTrainer(model, ref, GKDConfig(**cfg), train_dataset=ds, processing_class=tokenizer)
        return ChunkedGKDTrainer(model, ref, ChunkedGKDConfig(**cfg, **chunk), train_dataset=ds,
                                 processing_class=tokenizer)  # fmt: skip
    raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def _cleanup():
    # Objects alive at the last cleanup are frozen (gc.freeze), so this scans only what the run made.
    free_memory()
    gc.freeze()


def _share_loss(trainer, task: str, shared: dict) -> None:
    """Give a chunked trainer the task's first loss module, so its compiled per-chunk step is reused."""
    attr = LOSS_ATTR[task]
    if not hasattr(trainer, attr):
        return
    if task in shared:
        setattr(trainer, attr, shared[task])
    else:
        shared[task] = getattr(trainer, attr)


class InputProbe:
    """The policy's input in its first forward with gradients on (the training forward; generation and
    reference forwards run without): ``seq_tokens`` (the padded length), ``rows`` and ``mean_tokens``
    (non-padding tokens per row). Removes itself after that forward."""

    def __init__(self, model):
        self.seen: dict = {}
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        seen = training_input(args, kwargs)
        if seen is None:
            return
        ids, mask = seen
        rows, length = ids.shape
        mean = float(mask.sum()) / rows if mask is not None else float(length)
        self.seen = {"seq_tokens": length, "rows": rows, "mean_tokens": mean}
        self._handle.remove()


def run_one(task, impl, shape, batch, steps, a, tokenizer, ds, state, ref_state, shared):
    """Train ``steps`` steps from ``state`` (DPO's reference or GKD's teacher from ``ref_state``); returns a
    result dict (``oom`` set when it ran out of memory)."""
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    layers = a.layers or SHAPES[shape]["layers"]
    res = {"task": task, "impl": impl, "batch": batch, "steps": steps, "layers": layers}
    trainer = model = ref = None
    t0 = time.perf_counter()
    try:
        model = build_model(shape, a.layers, tokenizer, a.device, dtype, state)
        if ref_state is not None:  # DPO's reference (the initial policy) or GKD's teacher, frozen
            ref = build_model(shape, a.layers, tokenizer, a.device, dtype, ref_state)
            ref.requires_grad_(False)
        t1 = time.perf_counter()
        run_dir = os.path.join(a.out, "runs", f"{task}-{impl}")
        trainer = make_trainer(task, impl, model, ref, tokenizer, ds, run_dir, batch, steps, a)
        if impl != "trl":
            _share_loss(trainer, task, shared)
        timer = StepTimer()
        if task in GEN_ATTR:
            timer.time_method(trainer, GEN_ATTR[task])
        trainer.add_callback(timer)
        probe = InputProbe(model)
        t2 = time.perf_counter()
        res["build_s"], res["setup_s"] = t1 - t0, t2 - t1
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        res["train_s"] = time.perf_counter() - t2
        res["steps_s"] = sum(timer.times)
        res.update(probe.seen)
        skip = a.warmup if len(timer.times) > a.warmup else 0
        times = timer.times[skip:]
        # The median: single steps of 50-90 ms moved by up to 40% between runs with a mean of two.
        res["step_time_s"] = statistics.median(times)
        res["step_times_s"] = times
        res["gen_time_s"] = res["train_time_s"] = None
        if timer.method_times:
            gen = timer.method_times[skip:]
            res["gen_times_s"] = gen
            res["gen_time_s"] = statistics.median(gen)
            res["train_time_s"] = statistics.median([t - g for t, g in zip(times, gen, strict=True)])
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        logs = trainer.state.log_history
        res["losses"] = [h["loss"] for h in logs if "loss" in h]
        # GRPO's on-policy loss is ~0 whatever the weights (zero-mean advantages); its reward curve tracks.
        res["rewards"] = [h["reward"] for h in logs if "reward" in h]
        # TRL's own token count where the trainer logs one, else the Trainer's (GKD).
        key = "num_tokens" if any("num_tokens" in h for h in logs) else "num_input_tokens_seen"
        ntok = [h[key] for h in logs if h.get(key) is not None]
        if len(ntok) >= 2:
            per_step = (ntok[-1] - ntok[0]) / max(len(ntok) - 1, 1)
            res["tokens_per_s"] = per_step / res["step_time_s"]
        res["oom"] = False
    except Exception as e:  # noqa: BLE001 - an OOM ends the sweep; anything else is reported
        if not is_oom(e):
            raise
        res["oom"] = True
    finally:
        if impl in KERNEL_IMPLS:
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


def _step_time_at(runs: list[dict], batch: int) -> float:
    """The step time at ``batch`` from the same impl's earlier sweep runs: on the last two runs' log-log line,
    its slope clamped to [0, 1] (from flat, while the GPU is not saturated, to linear in the batch), or the
    last run's own time when it is the only one. Step times bend upwards in the batch on that plot, so this
    tends to underestimate."""
    last = runs[-1]
    slope = 0.0
    if len(runs) >= 2:
        prev = runs[-2]
        slope = math.log(last["step_time_s"] / prev["step_time_s"]) / math.log(last["batch"] / prev["batch"])
        slope = min(max(slope, 0.0), 1.0)
    return last["step_time_s"] * (batch / last["batch"]) ** slope


def _sweep_steps(runs: list[dict], batch: int, a) -> int:
    """Steps of a sweep run at ``batch`` after the same impl's earlier sweep runs ``runs``: ``--warmup``
    untimed, then enough timed steps for ``--min-timed-s`` at :func:`_step_time_at` (which tends to
    underestimate: rather more steps than needed), at least ``--sweep-steps`` minus ``--warmup`` and at most
    ``--max-timed-steps``; ``--sweep-steps`` for the first run."""
    if not runs:
        return a.sweep_steps
    floor = max(a.sweep_steps - a.warmup, 1)
    timed = math.ceil(a.min_timed_s / max(_step_time_at(runs, batch), 1e-6))
    return a.warmup + max(floor, min(timed, a.max_timed_steps))


def _fmt(r: dict) -> str:
    if r["oom"]:
        return "OOM"
    mem = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
    tps = r.get("tokens_per_s", math.nan)
    parts = f"build {r['build_s']:.1f} s, setup {r['setup_s']:.1f} s, train {r['train_s']:.1f} s"
    gen = ""
    if r.get("gen_time_s") is not None:
        gen = f" (generation {r['gen_time_s']:.3f} s, rest {r['train_time_s']:.3f} s)"
    seq = f", {r['rows']} x {r['seq_tokens']} tokens" if "seq_tokens" in r else ""
    return f"{r['step_time_s']:.3f} s/step{gen}, {tps:.0f} tok/s, peak {mem} GiB{seq} ({parts})"


def run_task(task, shape, a, tokenizer, results, deadline, t_start):
    """Sweep, then curves, for one task; stops starting runs that would end after ``deadline``."""
    t_task = time.perf_counter()
    sweep_deadline = t_task + a.sweep_share * (deadline - t_task)
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    # A run whose steps need more rows starts another epoch, between steps (outside their timing).
    n = max(64, max(sizes) * a.sweep_steps, a.curve_batch * a.curve_steps)
    ds = counting_dataset(task, n, a.words or (GRPO_WORDS if task == "grpo" else a.seq_len))
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    state = initial_state(shape, a, tokenizer, dtype)
    ref_state = None
    if task == "dpo":  # the reference is the initial policy
        ref_state = state
    elif task == "gkd":  # the teacher: the same shape, other weights
        ref_state = initial_state(shape, a, tokenizer, dtype, seed=1)
    shared: dict = {}

    def record(kind: str, r: dict) -> None:
        results[kind].append(r)
        results["wall_s"] = time.perf_counter() - t_start
        write_outputs(results, a.out, plot=False)

    runs: dict = {impl: [] for impl in a.impls}  # each impl's sweep runs so far (an OOM ends them)
    alive = dict.fromkeys(a.impls, True)
    for bs in sizes:
        todo = [impl for impl in a.impls if alive[impl]]
        if not todo:
            break
        n_steps = {impl: _sweep_steps(runs[impl], bs, a) for impl in todo}
        need = sum(_predict_s(runs[impl][-1] if runs[impl] else None, bs, n_steps[impl]) for impl in todo)
        if time.perf_counter() + need > sweep_deadline:
            print(f"[sweep] {task}: bs={bs} would need ~{need:.0f} s, past the sweep's share; stopping")
            results["skipped"].append({"task": task, "batch": bs, "impls": todo, "reason": "time budget"})
            break
        for impl in todo:
            r = run_one(task, impl, shape, bs, n_steps[impl], a, tokenizer, ds, state, ref_state, shared)
            runs[impl].append(r)
            alive[impl] = not r["oom"]
            record("sweep", r)
            print(f"[sweep] {task} {impl} bs={bs}: {_fmt(r)}", flush=True)

    # Curves: the full --curve-steps unless the sweep's step times at the curve batch say they would overrun;
    # none with --curve-steps 0 (a sweep-only run).
    steps = a.curve_steps
    ref = [r for r in results["sweep"] if r["task"] == task and not r["oom"]]
    if ref and steps > 0:
        near = min(ref, key=lambda r: (abs(math.log(r["batch"] / a.curve_batch)), -r["batch"]))
        at_near = max(r["step_time_s"] for r in ref if r["batch"] == near["batch"])
        per_step = at_near * a.curve_batch / near["batch"]
        overhead = max(_overhead_s(r) for r in ref)
        n = len(a.impls)
        fit = int((deadline - time.perf_counter() - n * overhead) / (n * per_step))
        if fit < steps:
            steps = max(fit, min(a.min_curve_steps, a.curve_steps))
            print(f"[curve] {task}: {steps} steps fit the task's share (~{per_step:.2f} s/step)")
    for impl in a.impls if steps > 0 else ():
        r = run_one(task, impl, shape, a.curve_batch, steps, a, tokenizer, ds, state, ref_state, shared)
        record("curves", r)
        print(f"[curve] {task} {impl} bs={a.curve_batch} steps={steps}: {_fmt(r)}; "
              f"losses {[round(x, 4) for x in r.get('losses', [])[:5]]}...", flush=True)  # fmt: skip
    del state, ref_state, shared
    gc.unfreeze()
    _cleanup()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default="grpo,dpo,orpo", help=f"comma-separated, from {', '.join(TASKS)}")
    p.add_argument(
        "--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated, from {', '.join(IMPLS)}"
    )
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="decoder layers; 0 (default): the real models' 28 (Qwen3-0.6B) / 16 (Llama-3.2-1B)",
    )
    p.add_argument("--batch-sizes", default="2,4,8,16,32,64,128")
    p.add_argument("--sweep-steps", type=int, default=8,
                   help="steps of the first sweep run, --warmup untimed; later runs no fewer")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (compilation)")
    p.add_argument("--min-timed-s", type=float, default=3.0,
                   help="later sweep runs time at least this many seconds of steps (predicted)")  # fmt: skip
    p.add_argument("--max-timed-steps", type=int, default=40, help="timed steps of a sweep run, at most")
    p.add_argument("--curve-steps", type=int, default=30, help="0: no curves (a sweep-only run)")
    p.add_argument("--min-curve-steps", type=int, default=10, help="curves never get fewer steps than this")
    p.add_argument("--curve-batch", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=128, help="GRPO max_completion_length")
    p.add_argument("--seq-len", type=int, default=512, help="SFT/DPO/ORPO/GKD max_length")
    p.add_argument("--words", type=int, default=0,
                   help=f"words per completion; 0 (default): --seq-len for SFT/DPO/ORPO/GKD (every sequence "
                        f"truncated to --seq-len tokens), {GRPO_WORDS} for GRPO's answers")  # fmt: skip
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="TRL's gradient_checkpointing=True for every implementation; result sets e2e_<task>_gc",
    )
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
    kernels = [i for i in a.impls if i in KERNEL_IMPLS]
    if kernels and a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print(f"note: {', '.join(kernels)} left out: on a CPU the Triton kernels need TRITON_INTERPRET=1")
        a.impls = [i for i in a.impls if i not in KERNEL_IMPLS]
        if not a.impls:
            p.error("--impls: nothing left to run")
    tasks = [t for t in a.tasks.split(",") if t]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        p.error(f"--tasks: unknown {unknown}; choose from {', '.join(TASKS)}")
    grpo_shape, llama_shape = "qwen3-0.6b", "llama-3.2-1b"
    if a.tiny:
        grpo_shape = llama_shape = "tiny"
        a.layers, a.batch_sizes, a.sweep_steps, a.warmup = 1, "2,4", 2, 1
        a.min_timed_s, a.max_timed_steps = 0.05, 4
        a.curve_steps, a.min_curve_steps, a.curve_batch = min(a.curve_steps, 3), 3, 2
        a.completion_len, a.seq_len = 4, 48
        a.no_compile = True
    os.makedirs(a.out, exist_ok=True)
    t_start = time.perf_counter()
    tokenizer = tiny_tokenizer()
    command = "python -m benchmarks.bench_e2e " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {"stamp": stamp(command=command.strip()), "args": vars(a), "models": {}, "sweep": [],
               "curves": [], "skipped": []}  # fmt: skip
    _cleanup()
    for i, task in enumerate(tasks):
        share = (a.time_budget_s - (time.perf_counter() - t_start)) / (len(tasks) - i)
        shape = grpo_shape if task == "grpo" else llama_shape
        results["models"][task] = model_description(shape, a.layers or SHAPES[shape]["layers"], task)
        run_task(task, shape, a, tokenizer, results, time.perf_counter() + max(share, 0.0), t_start)
        results["wall_s"] = time.perf_counter() - t_start
        write_outputs(results, a.out)
    print(f"wall {results['wall_s']:.0f} s; results in {a.out}")


def model_description(shape: str, layers: int, task: str) -> str:
    """One line naming the model shape a task ran on (recorded in its result set)."""
    s = SHAPES[shape]
    name = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-1.7b": "Qwen3-1.7B", "llama-3.2-1b": "Llama-3.2-1B"}.get(
        shape, shape
    )
    text = f"{name} shape ({layers} decoder layers, hidden {s['hidden']}, vocab {s['vocab']}), random weights"
    if task == "gkd":
        text += "; teacher: the same shape, other weights; off-policy (lmbda=0)"
    return text + "."


def write_outputs(results: dict, out: str, plot: bool = True) -> None:
    """Write each task's result set ``e2e_<task>`` (``e2e_<task>_gc`` with gradient checkpointing: json, md
    and, if ``plot``, png) under ``out``."""
    for task in dict.fromkeys(r["task"] for r in results["sweep"] + results["curves"]):
        data = {
            "stamp": results["stamp"],
            "task": task,
            "model": results["models"].get(task, ""),
            "args": results["args"],
            "sweep": [r for r in results["sweep"] if r["task"] == task],
            "curves": [r for r in results["curves"] if r["task"] == task],
            "skipped": [s for s in results["skipped"] if s["task"] == task],
            "wall_s": results.get("wall_s"),
        }
        name = f"e2e_{task}_gc" if results["args"]["gradient_checkpointing"] else f"e2e_{task}"
        write_set(out, name, data, plot=plot)


if __name__ == "__main__":
    main()
