"""Multi-GPU scale: chunkloss's trainers, TRL's and TRL + Liger's at a real model size under FSDP2 or ZeRO-3.

Under ``accelerate launch`` (configs/accelerate/fsdp2.yaml or zero3.yaml) this trains a randomly initialised
model of a real shape (``--model``: ``qwen3-4b``, ``llama3-8b``, or ``tiny`` for a CPU check) with ``--impl``
``chunked`` (``Chunked{SFT,DPO,GRPO}Trainer`` with ``chunk_kernels`` as ``--kernels`` says, on by default),
``trl`` (TRL's trainers) or ``liger`` (TRL's with ``use_liger_kernel=True``), for each per-GPU batch of
``--batch-sizes`` in turn until the first OOM, a fresh model (same seed) and trainer per batch. The run folder
``OUT`` gets ``setting.json``, ``batch_<B>.started`` and ``batch_<B>.json`` (:func:`run_batch`'s result).
Sequences are ``--seq-len`` tokens (a DPO batch of B pairs trains 2·B sequences); GRPO's completions are fixed
tokens filling the sequence (``harness.fixed_completions``). An OOM writes
``batch_<B>.oom.rank<R>.json`` and ends the rank (status 3, so the launcher ends the others); a batch
predicted not to fit ``--time-budget-s`` writes ``batch_<B>.skipped.json``. ``--remaining``, ``--summary``
and ``--head-memory``: see their help. ``benchmarks/multigpu_scale.sh`` runs it all::

    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 \\
        -m benchmarks.multigpu_scale --trainer sft --impl chunked --model qwen3-4b --seq-len 2048 \\
        --batch-sizes 1,2,4,8,16,32,64 --out DIR/sft_fsdp2_chunked
    python -m benchmarks.multigpu_scale --summary DIR
"""

from __future__ import annotations

import time

_T0 = time.monotonic()  # the time budget counts from the start of the process, imports included

import os  # noqa: E402

# Before anything can initialise NCCL: NVLink multicast (NVLS) stays off on the shared H200 hosts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.harness import make_trainer  # noqa: E402
from benchmarks.report import fullest, write_json, write_set  # noqa: E402

MODELS = {
    "tiny": {**harness.SHAPES["tiny"], "family": "qwen3"},
    "qwen3-4b": harness.SHAPES["qwen3-4b"],
    "llama3-8b": harness.SHAPES["llama-3.1-8b"],
}  # fmt: skip
IMPLS = {"chunked": "chunkloss", "trl": "trl", "liger": "liger"}  # --impl -> harness.make_trainer's name
DEFAULT_BATCHES = [1, 2, 4, 8, 16, 32, 64]
SEED = 0
RESULT, PROFILE = "multigpu_scale", "profile_multigpu"
COMMAND = "bash benchmarks/multigpu_scale.sh OUT"
# A run's fields in the summary, in this order.
SUMMARY_KEYS = (
    "trainer", "backend", "impl", "model", "seq_len", "world", "gradient_checkpointing", "dtype",
    "chunk_compile", "kernels", "batch", "steps", "warmup", "status", "oom_ranks", "reason", "skipped",
    "error",
    "median_step_time_s", "step_times_s", "tokens_per_step", "tokens_per_s", "tokens_per_s_per_gpu",
    "peak_memory_gib", "peak_memory_gib_at_oom", "allocated_before_gib", "train_begin_allocated_gib_rank0",
    "distributed_type", "build_s", "setup_s", "train_s", "wall_s", "losses",
)  # fmt: skip
# Memory a batch may find still allocated from the earlier batches of its process before the summary names it.
LEFTOVER_GIB = 0.5


def backend_name() -> str:
    """The backend ``accelerate launch`` set up for this process: ``fsdp2`` (or ``fsdp1``), ``zero<stage>``,
    or ``none`` (one process without a sharding backend)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return f"zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '3')}"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return f"fsdp{os.environ.get('FSDP_VERSION', '1')}"
    return "none"


def head_memory(model: str, weight_bytes: int = 2) -> dict:
    """What the chunked LM head holds on every rank for ``model``'s shape, in bytes and GiB: the gathered
    (V, H) weight, the fp32 weight-gradient accumulator, the weight-dtype gradient handed to autograd, and
    the most rows one call may hold in a single chunk, which needs no accumulator (a compiled step on CUDA
    without an extra head, as ``chunkloss.engine.plan.chunk_rows`` decides)."""
    from chunkloss.engine.options import default_chunk_size

    s = MODELS[model]
    v, h = s["vocab"], s["hidden"]
    out = {"vocab": v, "hidden": h, "tied": s["tied"], "weight_bytes": weight_bytes}
    entry_bytes = dict(gathered_weight=weight_bytes, fp32_accumulator=4, weight_grad=weight_bytes)
    for key, per_entry in entry_bytes.items():
        out[f"{key}_bytes"] = v * h * per_entry
        out[f"{key}_gib"] = v * h * per_entry / 2**30
    out["one_chunk_max_rows"] = default_chunk_size(v, weight_bytes, v * h * 4 // 2**20, grad_in_place=True)
    return out


def build_model(model: str, tokenizer, seq_len: int):
    """``model``'s shape with random weights from ``SEED`` on this rank's GPU (``harness.random_model``)."""
    return harness.random_model(
        MODELS[model], SEED, tokenizer, max_position_embeddings=max(4096, 2 * seq_len)
    )


def build_trainer(a, impl: str, model, tokenizer, batch: int, rows: int, **options):
    """``a.trainer``'s trainer of ``impl`` (``IMPLS``) on ``model``: ``rows`` counting examples of
    ``a.seq_len`` tokens, ``a.steps`` steps at per-GPU ``batch``; ``options``: more of
    ``harness.make_trainer``'s. DPO's and KTO's reference is the initial policy, given: TRL would load it from
    the policy's path, which a random model lacks."""
    ds = harness.counting_dataset(a.trainer, rows, a.seq_len)
    ref = copy.deepcopy(model).requires_grad_(False) if a.trainer in ("dpo", "kto") else None
    run = dict(batch=batch, steps=a.steps, seq=a.seq_len, gc=a.gradient_checkpointing, ref=ref)
    return make_trainer(
        a.trainer, IMPLS[impl], model, tokenizer, ds, out_dir=str(a.out / "trainer"), **run, **options
    )


class TokenCount:
    """Non-padding tokens of the policy's forwards with gradients on (the training forwards; generation,
    reference and no-grad scoring forwards are not counted), summed per training step: the ``input_ids``, or
    the sum of an ``attention_mask`` of (B, T) padding."""

    def __init__(self, model):
        self.current = 0
        self.per_step: list[int] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids, mask = kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask")
        if torch.is_grad_enabled() and ids is not None:
            self.current += int(mask.sum()) if mask is not None and mask.dim() == 2 else ids.numel()

    def end_step(self) -> None:
        self.per_step.append(self.current)
        self.current = 0

    def remove(self) -> None:
        self._handle.remove()


def _setting(a) -> dict:
    """What a run is: the fields of ``setting.json``, the first of every batch's result."""
    cuda, chunked = torch.cuda.is_available(), a.impl == "chunked"
    out = dict(trainer=a.trainer, backend=backend_name(), impl=a.impl, model=a.model, seq_len=a.seq_len)
    out.update(world=int(os.environ.get("WORLD_SIZE", "1")), gradient_checkpointing=a.gradient_checkpointing)
    out.update(chunk_compile=chunked and a.chunk_compile and cuda)
    kernels = chunked and a.kernels == "on" and harness.kernels_available()
    return {**out, "kernels": kernels, "dtype": "bfloat16" if cuda else "float32", "profile": a.profile}


def _train(batch: int, a, tokenizer, t0: float) -> dict:
    """Build the model and trainer, train ``a.steps`` steps at per-GPU ``batch``, measure them (``t0``: the
    batch's start). What it builds lives in this frame only: ``run_batch`` collects it once it returns."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = build_model(a.model, tokenizer, a.seq_len)
    t1 = time.perf_counter()
    rows, options = max(2 * batch * world, 8), dict(kernels=a.kernels == "on", chunk_compile=a.chunk_compile)
    trainer = build_trainer(a, a.impl, model, tokenizer, batch, rows, **options)
    tokens = TokenCount(model)
    timer = harness.step_timer(after_step=tokens.end_step)
    trainer.add_callback(timer)
    prof = harness.profile_steps(trainer, a.warmup) if a.profile else None
    t2 = time.perf_counter()
    trainer.train()
    t3 = time.perf_counter()
    tokens.remove()
    timed = timer.times[a.warmup :] or timer.times
    median = statistics.median(timed)
    parts = {} if prof is None else {"parts": harness.kernel_time(prof, sum(timed), len(timed))}
    acc, n = trainer.accelerator, trainer.accelerator.num_processes
    # Collective (every rank calls both): the timed steps' tokens on all ranks, and peak memory per rank.
    skip = len(timer.times) - len(timed)
    mine = torch.tensor([float(sum(tokens.per_step[skip:])), float(len(timed))], device=acc.device)
    total = acc.gather(mine[None]).reshape(-1, 2).sum(0).tolist()
    per_step = total[0] / max(total[1] / n, 1)
    out = dict(backend=backend_name(), distributed_type=str(acc.distributed_type), world=n)
    out.update(
        build_s=t1 - t0, setup_s=t2 - t1, train_s=t3 - t2, steps_s=sum(timer.times), step_times_s=timer.times
    )
    out.update(median_step_time_s=median, tokens_per_step=per_step, tokens_per_s=per_step / median)
    out.update(tokens_per_s_per_gpu=per_step / median / n, peak_memory_gib=harness.peak_memory_gib(trainer))
    out["train_begin_allocated_gib_rank0"] = timer.allocated_before / 2**30
    out["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {**out, **parts}


def run_batch(batch: int, a, tokenizer) -> dict:
    """Train ``a.steps`` steps at per-GPU ``batch``; the result on every rank (``oom`` set when this rank ran
    out of memory; peak memory and tokens gathered over ranks otherwise). The batch's model, optimizer and
    trainer are freed before it returns."""
    cuda = torch.cuda.is_available()
    res = {**_setting(a), "batch": batch, "steps": a.steps, "warmup": a.warmup, "oom": False}
    if cuda:  # what earlier batches of this process left allocated (0 unless something of theirs lives on)
        res["allocated_before_gib"] = torch.cuda.memory_allocated() / 2**30
    t0 = time.perf_counter()
    try:
        res.update(_train(batch, a, tokenizer, t0))
    except Exception as e:  # noqa: BLE001 - an OOM ends the sweep; anything else is raised
        if not harness.is_oom(e):
            raise
        res.update(oom=True, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        if cuda:
            res["peak_memory_gib_at_oom"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        # Nothing outside the batch holds its model now, but the model refers to itself (its forward is a
        # method bound to it): only a collection frees it, with the optimizer and accelerator that hold it.
        harness.free_memory()
    res["wall_s"] = time.perf_counter() - t0
    return res


def _rank0_says(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a broadcast once the process group exists), so that all ranks take
    the same branch."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    t = torch.tensor([float(flag)], device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def sweep(a) -> None:
    """Every batch of ``a.batch_sizes`` in turn until an OOM or the time budget; each result is written to
    ``a.out`` as soon as it is known, beside ``setting.json`` (what the run is)."""
    from chunkloss.data import tiny_tokenizer

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    harness.record_pid(a.out)
    if rank == 0:
        write_json(a.out / "setting.json", {**_setting(a), "batch_sizes": a.batch_sizes})
    tokenizer = tiny_tokenizer()
    st, nvls, prev = harness.stamp(gpus=world), os.environ.get("NCCL_NVLS_ENABLE"), None
    for batch in a.batch_sizes:
        if a.time_budget_s and prev is not None:
            left = a.time_budget_s - (time.monotonic() - _T0)
            # The previous batch's time outside the steps, plus its step time scaled linearly in the batch.
            steps_s = prev["median_step_time_s"] * batch / prev["batch"] * a.steps
            need = max(prev["wall_s"] - prev["steps_s"], 0.0) + steps_s
            if _rank0_says(need > left):
                if rank == 0:
                    reason = f"time budget: {need:.0f} s predicted, {left:.0f} s left"
                    skipped = {**_setting(a), "batch": batch, "skipped": reason}
                    write_json(a.out / f"batch_{batch}.skipped.json", skipped)
                    print(f"[multigpu_scale] batch {batch}: skipped ({reason})", flush=True)
                break
        if rank == 0:
            (a.out / f"batch_{batch}.started").write_text(f"{time.time():.0f}\n")
        r = run_batch(batch, a, tokenizer)
        r.update(stamp=st, nccl_nvls_enable=nvls, head_memory=head_memory(a.model))
        if r["oom"]:
            write_json(a.out / f"batch_{batch}.oom.rank{rank}.json", {**r, "rank": rank})
            print(f"[multigpu_scale] batch {batch}: out of memory on rank {rank}: {r['error']}", flush=True)
            if world > 1:
                # The other ranks may wait in a collective this rank will never join: end the process now,
                # and the launcher ends them.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(3)
            break
        if rank == 0:
            write_json(a.out / f"batch_{batch}.json", r)
            peaks = [round(m["allocated"], 2) for m in r["peak_memory_gib"] or []] or "n/a"
            speed = f"{r['median_step_time_s']:.3f} s/step, {r['tokens_per_s']:.0f} tokens/s"
            print(f"[multigpu_scale] batch {batch}: {speed}, peak GiB per rank {peaks}", flush=True)
        prev = r


def remaining(run_dir: Path, batches: list[int]) -> list[int]:
    """The batches of ``batches`` (the list the last launch in ``run_dir`` was given) still to run: none once
    a batch ran out of memory or was skipped for time, or when the launch failed at its first batch (it made
    no progress, so another launch would fail the same way)."""
    if any(run_dir.glob("batch_*.oom.rank*.json")) or any(run_dir.glob("batch_*.skipped.json")):
        return []
    rest = [b for b in batches if not (run_dir / f"batch_{b}.json").exists()]
    return [] if not rest or rest[0] == batches[0] else rest


def _batch_of(path: Path) -> int:
    return int(re.match(r"batch_(\d+)", path.name).group(1))


def collect(folder: Path) -> tuple[list[dict], list[str]]:
    """Every batch result under ``folder`` (a run folder with its ``setting.json`` per trainer, backend and
    implementation), as rows with ``status`` ok, oom, skipped or failed (a batch started without a result);
    and notes on the failures, with the reason from the driver's ``<run>.error`` (the latest of a run's
    launches), and on launches that left no run folder."""
    runs, notes = [], []
    run_dirs = sorted(p for p in folder.iterdir() if (p / "setting.json").exists())
    for run_dir in run_dirs:
        setting = json.loads((run_dir / "setting.json").read_text())
        setting.pop("batch_sizes", None)
        by_batch: dict[int, dict] = {}
        for f in run_dir.glob("batch_*.json"):
            b, r = _batch_of(f), json.loads(f.read_text())
            if f.name.endswith(".skipped.json"):
                by_batch[b] = {**setting, **r, "status": "skipped"}
            elif ".oom.rank" in f.name:
                ranks = sorted({*by_batch.get(b, {}).get("oom_ranks", []), r["rank"]})
                by_batch[b] = {**setting, **r, "status": "oom", "oom_ranks": ranks}
            else:
                by_batch[b] = {**setting, **r, "status": "ok"}
        for f in run_dir.glob("batch_*.started"):
            b = _batch_of(f)
            if b not in by_batch:
                errors = sorted(folder.glob(f"{run_dir.name}*.error"), key=lambda e: e.stat().st_mtime)
                why = "no result and no error file"
                if errors:
                    why = harness.failure_reason(errors[-1].read_text())
                by_batch[b] = {**setting, "batch": b, "status": "failed", "reason": why}
                notes.append(f"{run_dir.name}, batch {b}: {why}")
        for b in sorted(by_batch):
            runs.append({**by_batch[b], "run": run_dir.name})
            left = by_batch[b].get("allocated_before_gib") or 0.0
            if left > LEFTOVER_GIB:
                notes.append(
                    f"{run_dir.name}, batch {b}: started with {left:.2f} GiB left allocated by "
                    "earlier batches of its process (its peak memory counts them)"
                )
    # Launches that left no run folder (a backend that does not import, a crash while starting).
    seen = {p.name for p in run_dirs}
    for err in sorted(folder.glob("*.error")):
        name = err.name.split(".")[0]
        if name not in seen:
            notes.append(f"{name}: {harness.failure_reason(err.read_text())}")
    return runs, notes


def profile_row(r: dict) -> dict:
    """A profiled run as a row of the ``profile`` sets: rank 0's kernel time per step by kind."""
    gc = "on" if r["gradient_checkpointing"] else "off"
    case = (
        f"{r['model']} {r['trainer']} {r['backend']} x{r['world']} {r['seq_len']} tok gc {gc} b={r['batch']}"
    )
    error = None if r["status"] == "ok" else r["status"]
    time_ms = r["median_step_time_s"] * 1e3 if r.get("median_step_time_s") else None
    parts, peak = r.get("parts", {}), fullest(r.get("peak_memory_gib"))
    return dict(case=case, impl=r["impl"], ms=time_ms, error=error, parts=parts, peak_mem_gib=peak)


def summary(folder: Path) -> dict:
    """Gather every run under ``folder`` into the result set ``folder/multigpu_scale`` (json, md, png),
    stamped with the first run's date, GPUs and versions; the profiled runs into ``folder/PROFILE``."""
    runs, notes = collect(folder)
    ok = [r for r in runs if r.get("stamp")]
    st = dict(ok[0]["stamp"]) if ok else harness.stamp()
    st["command"] = COMMAND
    if profiled := [profile_row(r) for r in runs if r.get("profile")]:
        prof_stamp = {**st, "command": f"CHUNKLOSS_PROFILE=1 {COMMAND}"}
        write_set(folder, PROFILE, {"stamp": prof_stamp, "mode": "profile", "rows": profiled})
    rows = [{k: r[k] for k in SUMMARY_KEYS if k in r} for r in runs if not r.get("profile")]
    memory = {m: head_memory(m) for m in sorted({r["model"] for r in rows if r.get("model") in MODELS})}
    data = {"stamp": st, "num_generations": harness.NUM_GENERATIONS, "head_memory": memory}
    data.update(runs=rows, notes=notes)
    write_set(folder, RESULT, data)
    return data


def _batches(text: str) -> list[int]:
    out = [int(b) for b in re.split(r"[,\s]+", text.strip()) if b]
    if not out or any(b <= 0 for b in out):
        raise argparse.ArgumentTypeError(f"positive batch sizes, comma-separated: {text!r}")
    return out


def multigpu_parser(doc: str, model: str, out: str) -> argparse.ArgumentParser:
    """The arguments of multigpu_scale and multigpu_parity: ``model``, ``--model``'s default; ``out``,
    ``--out``'s help."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--trainer", choices=harness.MULTIGPU_TRAINERS)
    p.add_argument("--model", choices=tuple(MODELS), default=model)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (a real shape)")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")
    p.add_argument("--out", type=Path, help=out)
    return p


def main(argv: list[str] | None = None) -> int:
    p = multigpu_parser(__doc__, model="qwen3-4b", out="run folder")
    p.add_argument("--impl", choices=tuple(IMPLS), default="chunked")
    p.add_argument("--kernels", choices=("on", "off"), default="on", help="chunked: chunk_kernels")
    p.add_argument("--batch-sizes", type=_batches, default=DEFAULT_BATCHES, help="per-GPU, e.g. 1,2,4")
    p.add_argument("--steps", type=int, default=7, help="training steps per batch")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median step time")
    p.add_argument("--no-chunk-compile", dest="chunk_compile", action="store_false", help="eager chunk step")
    p.add_argument("--profile", action="store_true", help="torch.profiler over the timed steps (rank 0's)")
    p.add_argument("--time-budget-s", type=float, default=0.0, help="from the process start; 0: none")
    p.add_argument("--remaining", type=Path, metavar="RUN_DIR", help="print the batches RUN_DIR still lacks")
    p.add_argument("--summary", type=Path, metavar="DIR", help=f"write DIR/{RESULT}.{{json,md,png}} from DIR")
    p.add_argument("--head-memory", action="store_true", help="print the head's memory per rank per shape")
    a = p.parse_args(argv)
    if a.head_memory:
        print(json.dumps({m: head_memory(m) for m in MODELS}, indent=1))
        return 0
    if a.remaining:
        print(",".join(map(str, remaining(a.remaining, a.batch_sizes))))
        return 0
    if a.summary:
        summary(a.summary)
        print((a.summary / f"{RESULT}.md").read_text())
        return 0
    if a.trainer is None or a.out is None:
        p.error("--trainer and --out are required (except with --summary, --remaining or --head-memory)")
    if a.warmup >= a.steps:
        p.error("--warmup must be below --steps")
    sweep(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
