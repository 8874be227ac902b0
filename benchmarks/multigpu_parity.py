"""Multi-GPU parity of the chunked trainers: FSDP2 or DeepSpeed ZeRO-3 on 2 GPUs against 1 GPU.

Under ``accelerate launch`` this trains a tiny random model for 20 steps, saving on rank 0 the full gradients
of the first step (after the backward, before clipping and the optimizer step), the loss curve, the step times
and every GPU's peak memory. ``--single``: the reference, one process on the global batch, launched with the
same accelerate config so that both runs follow one precision recipe. ``--compare`` writes the errors of a
2-process run against the reference; ``--summary DIR`` gathers them into the set ``DIR/multigpu``.
``benchmarks/multigpu_run.sh`` runs it all. GRPO's completions are a fixed function of the prompt and the
completion's index in its group, so both runs train on the same tokens; ``num_iterations=2`` makes every other
loss carry an importance ratio that depends on the weights.
"""

from __future__ import annotations

import os

# Before anything can initialise NCCL: NVLink multicast (NVLS) stays off on the shared H200 hosts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.harness import StepTimer, fixed_completions, record_pid, stamp  # noqa: E402
from benchmarks.report import write_json, write_set  # noqa: E402

STEPS = 20
PER_DEVICE_BATCH = 4
NUM_GENERATIONS = 2
MAX_COMPLETION_LENGTH = 12
TRAINERS = ("sft", "dpo", "grpo")
BACKENDS = ("fsdp2", "zero3")
RUN_KEYS = ("distributed_type", "num_processes", "median_step_time_s", "peak_memory_gib")
WARMUP_STEPS = 3  # step times before this are compilation and allocator warm-up, left out of the median


def _is_deepspeed(trainer) -> bool:
    return str(trainer.accelerator.distributed_type).endswith("DEEPSPEED")


def _full_grad(param, deepspeed: bool) -> torch.Tensor | None:
    """The full gradient of a parameter under ZeRO-3 (partitioned), FSDP2 (a DTensor) or one process.

    Collective under ZeRO-3 and FSDP2: every rank calls it for every parameter, in the same order."""
    if deepspeed:
        from deepspeed.utils import safe_get_full_grad

        g = safe_get_full_grad(param)
    else:
        g = param.grad
        if g is not None and type(g).__name__ == "DTensor":
            g = g.full_tensor()
    # A copy: on CPU in fp32 .float().cpu() would alias the gradient, which clipping then scales in place.
    return None if g is None else g.detach().to("cpu", torch.float32, copy=True)


class GradTap:
    """The full gradients of the first step, after its backward and before clipping and the optimizer step:
    read when ``training_step`` returns (the Trainer clips later), and under DeepSpeed, whose engine clips and
    steps inside ``accelerator.backward``, at the entry of the engine's ``step``."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.grads: dict[str, torch.Tensor] | None = None
        self._inner = trainer.training_step
        trainer.training_step = self._training_step

    def _read(self) -> None:
        ds = _is_deepspeed(self.trainer)
        named = [(n, p) for n, p in self.trainer.model.named_parameters() if p.requires_grad]
        self.grads = {n: g for n, p in named if (g := _full_grad(p, ds)) is not None}

    def _training_step(self, *args, **kwargs):
        if self.grads is None and _is_deepspeed(self.trainer):
            engine = self.trainer.accelerator.deepspeed_engine_wrapped.engine
            step = engine.step

            def tapped_step(*a, **kw):
                if self.grads is None:
                    self._read()
                return step(*a, **kw)

            engine.step = tapped_step
        loss = self._inner(*args, **kwargs)
        if self.grads is None and not _is_deepspeed(self.trainer):
            self._read()
        return loss


def _short_completion(trainer, seed: int) -> list[int]:
    """1 to ``max_completion_length - 1`` digit tokens, closed by EOS half of the time (the other half
    truncated, as generation can be)."""
    rng = random.Random(seed)
    n = rng.randint(1, trainer.max_completion_length - 1)
    c = [rng.choice(trainer._digit_ids) for _ in range(n)]
    if rng.random() < 0.5:
        c.append(trainer.processing_class.eos_token_id)
    return c


def _trainer(kind: str, out: Path, steps: int, batch: int, bf16: bool):
    from chunkloss.data import count_reward, tiny_dataset, tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(tok, hidden_size=64, num_layers=2)
    common = dict(output_dir=str(out / "trainer"), report_to="none", per_device_train_batch_size=batch,
                  max_steps=steps, logging_steps=1, save_strategy="no", learning_rate=1e-3, seed=0, bf16=bf16,
                  dataloader_num_workers=0, chunk_compile=False)  # fmt: skip
    ds = tiny_dataset(kind, n=256)
    if kind == "sft":
        from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer

        return ChunkedSFTTrainer(model, ChunkedSFTConfig(**common), train_dataset=ds, processing_class=tok)
    if kind == "dpo":
        from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer

        # The reference is given: TRL would load it from the policy's path, and this random model has none.
        return ChunkedDPOTrainer(model, copy.deepcopy(model), args=ChunkedDPOConfig(**common, max_length=48),
                                 train_dataset=ds, processing_class=tok)  # fmt: skip
    if kind == "grpo":
        from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer

        cfg = ChunkedGRPOConfig(**common, num_generations=NUM_GENERATIONS,
                                max_completion_length=MAX_COMPLETION_LENGTH, num_iterations=2)  # fmt: skip
        trainer = fixed_completions(ChunkedGRPOTrainer, _short_completion)
        return trainer(model, count_reward, cfg, train_dataset=ds, processing_class=tok)
    raise ValueError(f"--trainer must be one of {TRAINERS}, got {kind!r}")


def _peak_memory_gib(trainer) -> list[dict] | None:
    """Every process's peak allocated and reserved CUDA memory in GiB (collective: all ranks call it)."""
    if not torch.cuda.is_available():
        return None
    acc = trainer.accelerator
    peaks = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
    mine = torch.tensor(peaks, device=acc.device, dtype=torch.float64)
    rows = acc.gather(mine[None]).reshape(-1, 2).cpu().tolist()
    return [dict(rank=r, allocated=a / 2**30, reserved=b / 2**30) for r, (a, b) in enumerate(rows)]


def run(kind: str, out: Path, batch: int) -> None:
    bf16 = torch.cuda.is_available()
    record_pid(out)
    tr = _trainer(kind, out, STEPS, batch, bf16)
    tap = GradTap(tr)
    clock = StepTimer()
    tr.add_callback(clock.callback())
    tr.train()
    memory = _peak_memory_gib(tr)
    if tr.accelerator.is_main_process:
        curve = [h["loss"] for h in tr.state.log_history if "loss" in h]
        torch.save(tap.grads, out / "grads_step1.pt")
        timed = clock.times[WARMUP_STEPS:] or clock.times
        acc, logs = tr.accelerator, tr.state.log_history
        meta = dict(trainer=kind, num_processes=acc.num_processes, distributed_type=str(acc.distributed_type),
                    per_device_batch=batch, bf16=bf16, loss_curve=curve,
                    grad_norms=[h["grad_norm"] for h in logs if "grad_norm" in h], step_times_s=clock.times,
                    median_step_time_s=statistics.median(timed) if timed else None, peak_memory_gib=memory,
                    device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), torch=torch.__version__)  # fmt: skip
        write_json(out / "run.json", meta)


def compare(multi: Path, single: Path, out: Path) -> dict:
    g_m, g_s = torch.load(multi / "grads_step1.pt"), torch.load(single / "grads_step1.pt")
    r_m, r_s = json.loads((multi / "run.json").read_text()), json.loads((single / "run.json").read_text())
    per_param = {}
    for name, ref in g_s.items():
        got = g_m.get(name)
        if got is None or got.shape != ref.shape:
            per_param[name] = None
            continue
        err = (got - ref).abs().max()
        # Relative to the tensor's largest entry: single entries near zero are sums of cancelling terms.
        per_param[name] = dict(abs=float(err), rel=float(err / ref.abs().max().clamp(min=1e-12)))
    errors = [e for e in per_param.values() if e is not None]
    c_m, c_s = r_m["loss_curve"], r_s["loss_curve"]
    n = min(len(c_m), len(c_s))
    abs_diffs = [abs(a - b) for a, b in zip(c_m[:n], c_s[:n])]
    # Relative to the curve's scale: a GRPO loss crosses zero, so pointwise relative differences mean nothing.
    scale = max((abs(b) for b in c_s[:n]), default=0.0)
    result = dict(
        trainer=r_m["trainer"],
        multi={k: r_m.get(k) for k in RUN_KEYS},
        single={k: r_s.get(k) for k in RUN_KEYS},
        missing_grads=sorted(k for k, e in per_param.items() if e is None),
        extra_grads=sorted(set(g_m) - set(g_s)),
        zero_ref_grads=sorted(k for k, g in g_s.items() if not bool(g.any())),
        max_abs_grad_error=max((e["abs"] for e in errors), default=None),
        max_rel_grad_error=max((e["rel"] for e in errors), default=None),
        per_param_grad_error=per_param,
        curve_multi=c_m,
        curve_single=c_s,
        max_abs_curve_diff=max(abs_diffs, default=None),
        max_rel_curve_diff=max(abs_diffs, default=0.0) / scale if abs_diffs and scale > 0 else None,
        steps_compared=n,
    )
    write_json(out, result)
    return result


def _reason(error_text: str) -> str:
    """Why a run failed, from its error file: a time-out or skip, else its first exception line, else its last
    line."""
    lines = [ln.strip() for ln in error_text.strip().splitlines() if ln.strip()]
    for pattern in (r"timed out|skipped", r"\w+(Error|Exception)\b"):
        hit = next((ln for ln in lines if re.search(pattern, ln) and "Warning" not in ln), None)
        if hit:
            return hit[:300]
    return lines[-1][:300] if lines else "?"


def summary(folder: Path) -> dict:
    """Gather every ``<trainer>_<backend>.json`` comparison in ``folder`` into the result set
    ``folder/multigpu`` (json, md, png); a run that left none is named in ``notes`` with the reason from its
    ``<trainer>_<backend>.error`` or the backend's ``<backend>.error``."""
    comparisons, notes = [], []
    for trainer in TRAINERS:
        for backend in BACKENDS:
            f = folder / f"{trainer}_{backend}.json"
            if not f.exists():
                errors = (folder / f"{trainer}_{backend}.error", folder / f"{backend}.error")
                err = next((e for e in errors if e.exists()), None)
                notes.append(f"{trainer} / {backend}: {_reason(err.read_text()) if err else 'no result'}")
                continue
            r = json.loads(f.read_text())
            comparisons.append(
                {"trainer": trainer, "backend": backend, **{k: v for k, v in r.items() if k != "trainer"}}
            )
            if r["missing_grads"] or r["extra_grads"]:
                notes.append(f"{trainer} / {backend}: missing {r['missing_grads']}, extra {r['extra_grads']}")
    st = stamp(command="bash benchmarks/multigpu_run.sh OUT", gpus=torch.cuda.device_count())
    data = {"stamp": st, "warmup_steps": WARMUP_STEPS, "comparisons": comparisons, "notes": notes}
    write_set(folder, "multigpu", data)
    return data


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", choices=TRAINERS)
    p.add_argument("--out", type=Path, help="run folder, or the json file with --compare")
    p.add_argument("--single", action="store_true", help="the reference: one process on the global batch")
    p.add_argument("--world", type=int, default=2, help="with --single: the multi-process world size")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("MULTI", "SINGLE"))
    p.add_argument("--summary", type=Path, metavar="DIR", help="write DIR/multigpu.{json,md,png} from DIR")
    a = p.parse_args(argv)
    if a.summary:
        summary(a.summary)
        print((a.summary / "multigpu.md").read_text())
        return
    if a.trainer is None or a.out is None:
        p.error("--trainer and --out are required (except with --summary)")
    if a.compare:
        r = compare(*a.compare, a.out)
        keys = ("trainer", "max_abs_grad_error", "max_rel_grad_error", "max_abs_curve_diff",
                "max_rel_curve_diff")  # fmt: skip
        print(json.dumps({k: r[k] for k in keys}))
        return
    batch = PER_DEVICE_BATCH * a.world if a.single else PER_DEVICE_BATCH
    run(a.trainer, a.out, batch)


if __name__ == "__main__":
    main()
