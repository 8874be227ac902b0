"""Multi-GPU parity of the chunked trainers: FSDP2 or DeepSpeed ZeRO-3 on 2 GPUs against 1 GPU.

Under ``accelerate launch`` this trains a model for ``--steps`` steps: a tiny random model (``--model tiny``,
20 steps by default) or a real shape of ``benchmarks.multigpu_scale.MODELS`` with random weights, its kernels
and ``--seq-len``-token sequences (30 steps). Rank 0 saves the full gradients of the first step (after the
backward, before clipping and the optimizer step; at a real shape only the middle layer's), each step's
gradient norm of the LM head and of the middle layer, the loss curve, the step times and every GPU's peak
memory. ``--single``: the reference, one process on the global batch, launched with the same accelerate
config so that both runs follow one precision recipe; with ``--accumulate 2`` the same global batch in two
micro-batches, which differs from the reference only in the order of its bf16 sums: the noise the 2-GPU run
is measured against. ``--compare`` writes the errors of a 2-process run (and of the noise run) against the
reference; ``--summary DIR`` gathers them into the set ``DIR/multigpu`` (``DIR/multigpu_<model>`` at a
real shape). ``benchmarks/multigpu_run.sh`` runs it all. GRPO's completions are a fixed function of the
prompt and the completion's index in its group, so both runs train on the same tokens; ``num_iterations=2``
(tiny model) makes every other loss carry an importance ratio that depends on the weights.
"""

from __future__ import annotations

import os

# Before anything can initialise NCCL: NVLink multicast (NVLS) stays off on the shared H200 hosts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import copy  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks import harness, multigpu_scale  # noqa: E402
from benchmarks.report import write_json, write_set  # noqa: E402

STEPS, REAL_STEPS = 20, 30  # the tiny model's, a real shape's
PER_DEVICE_BATCH, REAL_BATCH = 4, 2
BACKENDS = ("fsdp2", "zero3")
# What --compare prints.
SHOWN = ("trainer", "max_abs_grad_error", "max_rel_grad_error", "max_abs_curve_diff", "max_rel_curve_diff",
         "max_rel_norm_diff", "noise")  # fmt: skip
RUN_KEYS = ("distributed_type", "num_processes", "accumulate", "median_step_time_s", "peak_memory_gib")
# The tiny model's training arguments (chunkloss's trainers, eager chunk steps), and per trainer.
TINY_CONFIG = dict(report_to="none", logging_steps=1, save_strategy="no", learning_rate=1e-3, seed=0,
                   dataloader_num_workers=0, chunk_compile=False)  # fmt: skip
ONLINE = dict(num_generations=2, max_completion_length=12, num_iterations=2)
SHORT = dict(max_length=48)
TINY_KIND_CONFIG = {"dpo": SHORT, "kto": SHORT, "grpo": ONLINE, "rloo": {**ONLINE, "beta": 0.0}}
# (RLOO with β > 0 loads its reference from the policy's path, which the tiny model has none of.)
WARMUP_STEPS = 3  # step times before this are compilation and allocator warm-up, left out of the median


def _full_grad(param, deepspeed: bool, cpu: bool = True) -> torch.Tensor | None:
    """The full gradient of a parameter under ZeRO-3 (partitioned), FSDP2 (a DTensor) or one process, as an
    fp32 copy on the CPU (``cpu``) or on the device. Collective under ZeRO-3 and FSDP2: every rank calls it
    for every parameter, in the same order."""
    if deepspeed:
        from deepspeed.utils import safe_get_full_grad

        g = safe_get_full_grad(param)
    else:
        g = param.grad
        if g is not None and type(g).__name__ == "DTensor":
            g = g.full_tensor()
    # A copy: on CPU in fp32 .float().cpu() would alias the gradient, which clipping then scales in place.
    return None if g is None else g.detach().to("cpu" if cpu else g.device, torch.float32, copy=True)


class GradTap:
    """After each optimizer step's backward and before clipping and the step: the gradient norms of the LM
    head and of the middle decoder layer (``norms``, one dict per step), and in the first step the full
    gradients (``grads``) of every parameter, or (``whole=False``) of the middle layer's. Read when
    ``training_step`` returns at the end of an accumulation (the Trainer clips later), and under DeepSpeed,
    whose engine clips and steps inside ``accelerator.backward``, at the entry of the engine's ``step``."""

    def __init__(self, trainer, whole: bool = True):
        self.trainer, self.whole = trainer, whole
        self.deepspeed = str(trainer.accelerator.distributed_type).endswith("DEEPSPEED")
        self.grads: dict[str, torch.Tensor] | None = None
        self.norms: list[dict[str, float]] = []
        self._inner = trainer.training_step
        self._engine = None
        trainer.training_step = self._training_step

    def _read(self) -> None:
        ds, model = self.deepspeed, self.trainer.model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        head = getattr(model, "module", model).get_output_embeddings().weight
        middle = [(n, p) for n, p in named if f"layers.{model.config.num_hidden_layers // 2}." in n]
        if self.grads is None:
            kept = named if self.whole else middle
            self.grads = {n: g for n, p in kept if (g := _full_grad(p, ds)) is not None}
        norms = {}
        groups = {"head": [p for _, p in named if p is head], "middle_layer": [p for _, p in middle]}
        for group, params in groups.items():
            squares = [g.square().sum() for p in params if (g := _full_grad(p, ds, cpu=False)) is not None]
            norms[group] = float(torch.stack(squares).sum().sqrt()) if squares else None
        self.norms.append(norms)

    def _training_step(self, *args, **kwargs):
        if self._engine is None and self.deepspeed:
            self._engine = self.trainer.accelerator.deepspeed_engine_wrapped.engine
            step = self._engine.step

            def tapped_step(*a, **kw):
                self._read()
                return step(*a, **kw)

            self._engine.step = tapped_step
        loss = self._inner(*args, **kwargs)
        if not self.deepspeed and self.trainer.accelerator.sync_gradients:
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


def _trainer(a, batch: int, bf16: bool):
    """``a.trainer``'s chunked trainer, ``a.accumulate`` micro-batches of ``batch`` per step: on the tiny
    model (eager chunk steps), or on ``a.model``'s shape as ``benchmarks.multigpu_scale`` builds it (random
    weights, bf16 on CUDA, the kernels on)."""
    from chunkloss.data import count_reward, tiny_dataset, tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    if a.model != "tiny":
        model = multigpu_scale.build_model(a.model, tok, a.seq_len)
        return multigpu_scale.build_trainer(
            a, "chunked", model, tok, batch, rows=256, accumulate=a.accumulate
        )
    torch.manual_seed(0)
    model = tiny_model(tok, hidden_size=64, num_layers=2)
    Config, Trainer = harness.trainer_classes(a.trainer, "chunkloss")
    run = dict(output_dir=str(a.out / "trainer"), per_device_train_batch_size=batch, max_steps=a.steps)
    run.update(bf16=bf16, gradient_accumulation_steps=a.accumulate, **TINY_KIND_CONFIG.get(a.trainer, {}))
    args = Config(**TINY_CONFIG, **run)
    data = tiny_dataset("grpo" if a.trainer == "rloo" else a.trainer, n=256)  # RLOO takes GRPO's prompts
    kw = dict(train_dataset=data, processing_class=tok)
    if a.trainer in ("dpo", "kto"):  # the reference is given: TRL would load it from the policy's path
        return Trainer(model, copy.deepcopy(model), args=args, **kw)
    if a.trainer in ("grpo", "rloo"):
        return harness.fixed_completions(Trainer, _short_completion)(model, count_reward, args, **kw)
    return Trainer(model, args, **kw)


def run(a, batch: int) -> None:
    """Train ``a.trainer`` at per-process micro-batch ``batch``; rank 0 writes ``a.out``'s run.json (and
    grads_step1.pt)."""
    bf16 = torch.cuda.is_available()
    harness.record_pid(a.out)
    tr = _trainer(a, batch, bf16)
    tap = GradTap(tr, whole=a.model == "tiny")  # at a real shape the whole model's gradients would not fit
    clock = harness.step_timer()
    tr.add_callback(clock)
    tr.train()
    memory = harness.peak_memory_gib(tr)
    if tr.accelerator.is_main_process:
        curve = [h["loss"] for h in tr.state.log_history if "loss" in h]
        torch.save(tap.grads, a.out / "grads_step1.pt")
        timed = clock.times[WARMUP_STEPS:] or clock.times
        acc, logs, real = tr.accelerator, tr.state.log_history, a.model != "tiny"
        meta = dict(trainer=a.trainer, model=a.model, seq_len=a.seq_len if real else None)
        meta.update(gradient_checkpointing=a.gradient_checkpointing if real else None)
        meta.update(num_processes=acc.num_processes, distributed_type=str(acc.distributed_type))
        meta.update(per_device_batch=batch, accumulate=a.accumulate, bf16=bf16, loss_curve=curve)
        meta.update(grad_norms=[h["grad_norm"] for h in logs if "grad_norm" in h], norms=tap.norms)
        median = statistics.median(timed) if timed else None
        meta.update(step_times_s=clock.times, median_step_time_s=median, peak_memory_gib=memory)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        nvls = os.environ.get("NCCL_NVLS_ENABLE")
        meta.update(device=device, nccl_nvls_enable=nvls, torch=torch.__version__)
        write_json(a.out / "run.json", meta)


def _rel_diff(got: list, ref: list) -> float | None:
    """The largest difference of two curves relative to the reference curve's largest magnitude (a GRPO
    loss crosses zero, so pointwise relative differences mean nothing)."""
    n = min(len(got), len(ref))
    pairs = [(x, y) for x, y in zip(got[:n], ref[:n]) if x is not None and y is not None]
    scale = max((abs(y) for _, y in pairs), default=0.0)
    return max(abs(x - y) for x, y in pairs) / scale if pairs and scale > 0 else None


def errors(run: Path, ref: Path) -> dict:
    """``run``'s first-step gradients, loss curve and per-step gradient norms against ``ref``'s."""
    g_m, g_s = torch.load(run / "grads_step1.pt"), torch.load(ref / "grads_step1.pt")
    r_m, r_s = json.loads((run / "run.json").read_text()), json.loads((ref / "run.json").read_text())
    per_param = {}
    for name, want in g_s.items():
        got = g_m.get(name)
        if got is None or got.shape != want.shape:
            per_param[name] = None
            continue
        err = (got - want).abs().max()
        # Relative to the tensor's largest entry: single entries near zero are sums of cancelling terms.
        per_param[name] = dict(abs=float(err), rel=float(err / want.abs().max().clamp(min=1e-12)))
    found = [e for e in per_param.values() if e is not None]
    c_m, c_s = r_m["loss_curve"], r_s["loss_curve"]
    abs_diffs = [abs(x - y) for x, y in zip(c_m, c_s)]
    n_m, n_s = r_m.get("norms") or [], r_s.get("norms") or []
    groups = sorted({g for step in n_s for g in step})
    norm_diffs = {g: _rel_diff([s.get(g) for s in n_m], [s.get(g) for s in n_s]) for g in groups}
    return dict(
        missing_grads=sorted(k for k, e in per_param.items() if e is None),
        extra_grads=sorted(set(g_m) - set(g_s)),
        zero_ref_grads=sorted(k for k, g in g_s.items() if not bool(g.any())),
        max_abs_grad_error=max((e["abs"] for e in found), default=None),
        max_rel_grad_error=max((e["rel"] for e in found), default=None),
        per_param_grad_error=per_param,
        max_abs_curve_diff=max(abs_diffs, default=None),
        max_rel_curve_diff=_rel_diff(c_m, c_s),
        max_rel_norm_diff=norm_diffs,
        steps_compared=min(len(c_m), len(c_s)),
    )


def compare(multi: Path, single: Path, out: Path, noise: tuple[Path, Path] | None = None) -> dict:
    """The 2-process run ``multi`` against the reference ``single`` (:func:`errors`), with both curves and
    norms; and, given ``noise`` (the noise run, the reference's batch in two micro-batches, and the reference
    it is measured against), its errors as ``noise``."""
    r_m, r_s = json.loads((multi / "run.json").read_text()), json.loads((single / "run.json").read_text())
    result = dict(
        trainer=r_m["trainer"],
        model=r_m.get("model", "tiny"),
        seq_len=r_m.get("seq_len"),
        gradient_checkpointing=r_m.get("gradient_checkpointing"),
        multi={k: r_m.get(k) for k in RUN_KEYS},
        single={k: r_s.get(k) for k in RUN_KEYS},
        **errors(multi, single),
        curve_multi=r_m["loss_curve"],
        curve_single=r_s["loss_curve"],
        norms_multi=r_m.get("norms"),
        norms_single=r_s.get("norms"),
    )
    if noise is not None:
        e = errors(*noise)
        result["noise"] = {k: e[k] for k in ("max_rel_grad_error", "max_rel_curve_diff", "max_rel_norm_diff")}
        result["noise"]["run"] = {k: json.loads((noise[0] / "run.json").read_text()).get(k) for k in RUN_KEYS}
    write_json(out, result)
    return result


def set_name(model: str) -> str:
    return "multigpu" if model == "tiny" else f"multigpu_{model}"


def real_setting(c: dict) -> str:
    """A real-shape comparison's setting, in words."""
    gc = "on" if c.get("gradient_checkpointing") else "off"
    return (
        f"{c['model']} shape with random weights, bf16, the kernels on; {c['seq_len']}-token sequences, "
        f"{REAL_BATCH} per GPU ({2 * REAL_BATCH} on one GPU), {c['steps_compared']} steps "
        f"(benchmarks.harness.make_trainer's learning rate), checkpointing {gc}."
    )


def summary(folder: Path, model: str = "tiny") -> dict:
    """Gather every ``<trainer>_<backend>[_<model>].json`` comparison in ``folder`` into the result set
    ``folder/multigpu[_<model>]`` (json, md, png); a run that left none is named in ``notes`` with the reason
    from its ``.error`` file or the backend's ``<backend>.error``."""
    comparisons, notes = [], []
    for trainer in harness.MULTIGPU_TRAINERS:
        for backend in BACKENDS:
            name = f"{trainer}_{backend}" + ("" if model == "tiny" else f"_{model}")
            f = folder / f"{name}.json"
            if not f.exists():
                errs = (folder / f"{name}.error", folder / f"{backend}.error")
                err = next((e for e in errs if e.exists()), None)
                why = harness.failure_reason(err.read_text()) if err else "no result"
                notes.append(f"{trainer} / {backend}: {why}")
                continue
            r = json.loads(f.read_text())  # its trainer is ``trainer``
            comparisons.append({"trainer": trainer, "backend": backend, **r})
            if r["missing_grads"] or r["extra_grads"]:
                notes.append(f"{trainer} / {backend}: missing {r['missing_grads']}, extra {r['extra_grads']}")
    env = "" if model == "tiny" else f"CHUNKLOSS_MODEL={model} "
    st = harness.stamp(command=f"{env}bash benchmarks/multigpu_run.sh OUT", gpus=torch.cuda.device_count())
    data = {"stamp": st, "warmup_steps": WARMUP_STEPS, "comparisons": comparisons, "notes": notes}
    if model != "tiny" and comparisons:
        data["model"] = real_setting(comparisons[0])
    write_set(folder, set_name(model), data)
    return data


def main(argv: list[str] | None = None) -> None:
    p = multigpu_scale.multigpu_parser(
        __doc__, model="tiny", out="run folder, or the json file with --compare"
    )
    p.add_argument("--steps", type=int, help=f"default {STEPS}, a real shape {REAL_STEPS}")
    p.add_argument("--single", action="store_true", help="the reference: one process on the global batch")
    p.add_argument("--world", type=int, default=2, help="with --single: the multi-process world size")
    p.add_argument("--accumulate", type=int, default=1, help="with --single: micro-batches per step")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("MULTI", "SINGLE"))
    p.add_argument("--noise", nargs=2, type=Path, metavar=("RUN", "REF"), help="with --compare: noise")
    p.add_argument("--summary", type=Path, metavar="DIR", help="write DIR/multigpu[_<model>].{json,md,png}")
    a = p.parse_args(argv)
    if a.summary:
        summary(a.summary, a.model)
        print((a.summary / f"{set_name(a.model)}.md").read_text())
        return
    if a.trainer is None or a.out is None:
        p.error("--trainer and --out are required (except with --summary)")
    if a.compare:
        r = compare(*a.compare, a.out, a.noise)
        print(json.dumps({k: r.get(k) for k in SHOWN}))
        return
    if a.accumulate < 1 or (a.accumulate > 1 and not a.single) or a.world % a.accumulate:
        p.error("--accumulate: a divisor of --world, with --single")
    a.steps = a.steps or (STEPS if a.model == "tiny" else REAL_STEPS)
    per_process = PER_DEVICE_BATCH if a.model == "tiny" else REAL_BATCH
    run(a, per_process * a.world // a.accumulate if a.single else per_process)


if __name__ == "__main__":
    main()
