"""End to end: one training step of TRL's trainers, the peers a user picks with one flag, and chunkloss's.

Implementations (``--impl``), each in its own process (Liger patches transformers' classes process-wide):
``trl``, ``liger``, ``compile``, ``chunkloss`` (``--no-kernels``: no ``chunk_kernels``) and ``unsloth``
(Unsloth's loader, 4-bit under ``qlora``, its LoRA on the same weights, TRL's trainer as Unsloth patches it;
``CHUNKLOSS_UNSLOTH_SITE=DIR``, a ``--target`` install of the TRL and datasets it pins, leads its path).
Losses (``--loss``): ``harness.LOSSES`` as ``harness.make_trainer`` sets them up (Medusa: ``--medusa-heads``,
``--medusa-stage``; its peer, ``--impl trl``, is Medusa's loss on fp32 logits). Tasks (``--task``): ``full``,
``lora`` (PEFT LoRA r=16 on q/k/v/o/gate/up/down, bf16 base), ``qlora`` (on a bitsandbytes nf4 base);
chunkloss only: ``fp8`` (that LoRA on e4m3 bases, ``chunk_fp8="base"``; its peer: ``lora``), ``fp8-train``
(``full`` in float8 via torchao, ``chunk_fp8="train"``). Shapes: ``harness.SHAPES``.

Per implementation, the batches of ``--batches`` run in turn until the first OOM, ``--steps`` steps each;
step time is the median after ``--warmup``; peak memory is the highest CUDA memory allocated during training
minus what was allocated when it began. A chunkloss row with its kernels keeps the line
``chunkloss.models.patch`` logged. ``--out FILE.json`` is rewritten after every implementation;
``python -m benchmarks.report --merge DIR`` merges such files into the committed sets.

    TRITON_INTERPRET=1 python -m benchmarks.bench_e2e --shape tiny --impl trl,chunkloss --batches 2 \\
        --steps 6 --warmup 1 --out /tmp/e2e/smoke.json                                   # CPU smoke run

``--profile`` (one implementation, one batch): CUDA kernel time per step by kind (``harness.kernel_time``).
``--floor``: the step's GEMMs and attention timed alone, with ``--task qlora`` the 4-bit dequantisation too.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import importlib.util
import json
import logging
import os
import statistics
import sys
import tempfile

import torch

from benchmarks import harness
from benchmarks.harness import SHAPES
from benchmarks.report import e2e_case, write_json

CHUNK_FP8 = {"fp8": "base", "fp8-train": "train"}  # the chunkloss-only tasks' chunk_fp8
TASKS = ("full", "lora", "qlora", *CHUNK_FP8)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK = 16
LORA = dict(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=LORA_TARGETS)
# Sequences per example: DPO and ORPO train a chosen and a rejected sequence.
ROWS_PER_EXAMPLE = {"dpo": 2, "orpo": 2}
# No-grad forwards a step: DPO's reference, GKD's teacher, KTO's reference and, on its KL batch, the policy
NO_GRAD_FORWARDS = {"dpo": 1, "gkd": 1, "kto": 3}  # and the reference; RLOO none (on-policy, β = 0)


def build_model(a, seed: int = 0):
    """``a.shape``'s model with random weights from ``seed`` (4-bit nf4 for ``qlora``), bf16 on CUDA."""
    from chunkloss.data import tiny_tokenizer

    s = SHAPES[a.shape]
    config = dict(num_hidden_layers=a.layers or s["layers"], max_position_embeddings=max(4096, a.seq))
    model = harness.random_model(s, seed, tiny_tokenizer(), **config)
    if a.task != "qlora":
        return model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype, device_map = model.dtype, {"": 0 if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:  # bitsandbytes quantises while loading
        model.save_pretrained(tmp)
        del model
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        return AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=q, dtype=dtype, device_map=device_map
        )


def unsloth_model(a, tokenizer):
    """``a.shape``'s random weights saved and loaded by Unsloth's loader; its LoRA unless ``full``."""
    from unsloth import FastLanguageModel

    gc = "unsloth" if a.gc == "on" else False
    with tempfile.TemporaryDirectory() as tmp:
        build_model(argparse.Namespace(**{**vars(a), "task": "full"})).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        harness.free_memory()
        options = dict(max_seq_length=a.seq, dtype=torch.bfloat16, use_gradient_checkpointing=gc)
        options.update(
            offload_embedding=False, load_in_4bit=a.task == "qlora", full_finetuning=a.task == "full"
        )
        model, _ = FastLanguageModel.from_pretrained(tmp, **options)
    if a.task == "full":
        return model
    return FastLanguageModel.get_peft_model(model, **LORA, use_gradient_checkpointing=gc)


def setting(a, impl: str) -> dict:
    """What a run is, the keys of its case (``report.e2e_case``) first."""
    medusa = {"medusa": f"stage {a.medusa_stage} K={a.medusa_heads}"} if a.loss == "medusa" else {}
    kernels = impl == "chunkloss" and a.kernels and harness.kernels_available()
    case = dict(shape=a.shape, task=a.task, loss=a.loss, **medusa, seq=a.seq, gc=a.gc == "on", impl=impl)
    compiled = impl == "compile" or (impl == "chunkloss" and getattr(a, "compile_ours", False))
    return {**case, "layers": a.layers or SHAPES[a.shape]["layers"], "kernels": kernels, "compiled": compiled}


def train(a, batch: int, profile: bool = False) -> dict:
    """Train ``a.steps`` steps of ``a.impl`` at ``batch`` in this process; the run's measurements."""
    res = {**setting(a, a.impl), "batch": batch, "steps": a.steps, "oom": False}
    model = ref = trainer = None
    try:
        if a.impl == "unsloth":  # imported first: it patches transformers, TRL and PEFT as they load
            for k in ("HF_HUB_OFFLINE", "UNSLOTH_DISABLE_STATISTICS"):  # nothing downloaded
                os.environ.setdefault(k, "1")
            import unsloth  # noqa: F401

            res["versions"] = {p: importlib.metadata.version(p) for p in ("unsloth", "trl", "datasets")}
        from chunkloss.data import tiny_tokenizer

        tokenizer = tiny_tokenizer()
        model = unsloth_model(a, tokenizer) if a.impl == "unsloth" else build_model(a)
        if a.loss == "gkd" or (a.loss in ("dpo", "kto") and a.task == "full"):  # GKD's teacher: another seed
            ref = (copy.deepcopy(model) if a.loss != "gkd" else build_model(a, seed=1)).requires_grad_(False)
        # GKD's collator keeps the prompt whole, so its completions leave room for it (up to --seq tokens).
        rows = getattr(a, "rows", 0) or max(64, batch * a.steps)  # bench_longctx: only what the steps read
        ds = harness.counting_dataset(a.loss, rows, a.seq // 2 if a.loss == "gkd" else a.seq)
        medusa = dict(num_heads=a.medusa_heads, stage=a.medusa_stage)
        peft = None  # full fine-tuning; Unsloth's model has its LoRA
        if a.task not in ("full", "fp8-train") and a.impl != "unsloth":
            from peft import LoraConfig

            peft = LoraConfig(**LORA, task_type="CAUSAL_LM")
        run = dict(out_dir=tempfile.mkdtemp(), batch=batch, steps=a.steps, seq=a.seq, gc=a.gc == "on")
        fp8 = {"chunk_fp8": CHUNK_FP8[a.task]} if a.task in CHUNK_FP8 else {}
        config = {**(getattr(a, "extra", None) or {}), **fp8}
        if a.impl == "chunkloss" and res["compiled"]:  # --compile-ours
            config["torch_compile"] = True
        options = dict(kernels=a.kernels, peft_config=peft, medusa=medusa, config=config or None)
        with patch_lines() as lines:
            trainer = harness.make_trainer(a.loss, a.impl, model, tokenizer, ds, ref=ref, **run, **options)
        if lines:
            res["patch"] = lines[0]
        timer = harness.step_timer()
        trainer.add_callback(timer)
        prof = harness.profile_steps(trainer, a.warmup) if profile else None
        trainer.train()
        times, losses = timer.times[a.warmup :], [h["loss"] for h in trainer.state.log_history if "loss" in h]
        step = statistics.median(times)
        res.update(step_time_s=step, step_times_s=times, peak_mem_gib=timer.peak_extra_gib(), losses=losses)
        res["first_step_s"] = timer.times[0]  # with the compilation, where the run compiles
        res["tokens_per_s"] = batch * ROWS_PER_EXAMPLE.get(a.loss, 1) * a.seq / step
        if prof is not None:
            res["parts"] = harness.kernel_time(prof, sum(times), len(times))
    except Exception as e:  # noqa: BLE001 - an OOM ends the sweep; another error is the run's result
        res.update(oom=harness.is_oom(e), error=harness.error_text(e))
    finally:
        del model, ref, trainer
        harness.free_memory()
    return res


@contextlib.contextmanager
def patch_lines():
    """The lines ``chunkloss.models.patch`` logs meanwhile (INFO and above)."""
    log, lines = logging.getLogger("chunkloss.models"), []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _time_ms(fn, repeats: int = 10) -> float:
    """Median ms of ``fn()`` after warm-up (CUDA events; wall clock off CUDA)."""
    for _ in range(3):
        fn()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return statistics.median(harness.timed_ms(fn, device) for _ in range(repeats))


def _linears(a) -> list[tuple[int, int]]:
    """(in, out) of a layer's q, k, v, o, gate, up and down projections."""
    s = SHAPES[a.shape]
    q, kv = s["heads"] * s["head_dim"], s["kv"] * s["head_dim"]
    h, i = s["hidden"], s["inter"]
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def _forward_passes(a) -> int:
    """The layers' forward passes per step: once, again under checkpointing, and ``NO_GRAD_FORWARDS``."""
    return 1 + (a.gc == "on") + NO_GRAD_FORWARDS.get(a.loss, 0)


def step_gemms(a, batch: int) -> list[tuple[int, int, int, int]]:
    """``(M, K, N, count)`` of the step's matrix products: per linear, the forward ``x W^T``, the input
    gradient and (trainable weights) the weight gradient; LoRA's adapters their own; the layers' forward
    once more under checkpointing; the ``NO_GRAD_FORWARDS`` (DPO's reference, ...) on the same rows."""
    s = SHAPES[a.shape]
    layers = a.layers or s["layers"]
    rows = batch * ROWS_PER_EXAMPLE.get(a.loss, 1) * a.seq
    h = s["hidden"]
    full, fwd_passes = a.task == "full", _forward_passes(a)
    out = []
    for fin, fout in _linears(a):
        out += [(rows, fin, fout, layers * fwd_passes), (rows, fout, fin, layers)]
        if full:
            out.append((fout, rows, fin, layers))
        else:  # x A^T, (x A^T) B^T; backward: dB, d(x A^T), dA, dx
            r = LORA_RANK
            out += [(rows, fin, r, layers * fwd_passes), (rows, r, fout, layers * fwd_passes)]
            out += [(fout, rows, r, layers), (rows, fout, r, layers)]
            out += [(r, rows, fin, layers), (rows, r, fin, layers)]
    out += [(rows, h, s["vocab"], 1 + NO_GRAD_FORWARDS.get(a.loss, 0)), (rows, s["vocab"], h, 1)]
    if full:
        out.append((s["vocab"], rows, h, 1))
    return out


def dequant_ms(a, dev) -> float:
    """``--task qlora``: ms per step of dequantising each 4-bit nf4 weight before each GEMM that reads it
    (once per forward pass, once for the input gradient), as the QLoRA base's forward and backward do."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    total, count = 0.0, (a.layers or SHAPES[a.shape]["layers"]) * (_forward_passes(a) + 1)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    for fin, fout in _linears(a):
        packed, state = quantize_4bit(torch.randn(fout, fin, device=dev, dtype=dtype), quant_type="nf4")
        total += count * _time_ms(lambda packed=packed, state=state: dequantize_4bit(packed, state))
        del packed, state
    return total


def floor(a, batch: int) -> dict:
    """The step's GEMMs and attention timed alone (ms per step); a QLoRA step's dequantisation too."""
    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gemm_ms = 0.0
    for m, k, n, count in step_gemms(a, batch):
        x, w = torch.randn(m, k, device=dev, dtype=dt), torch.randn(k, n, device=dev, dtype=dt)
        gemm_ms += count * _time_ms(lambda x=x, w=w: x @ w)
        del x, w
    s = SHAPES[a.shape]
    b = batch * ROWS_PER_EXAMPLE.get(a.loss, 1)
    q = torch.randn(b, s["heads"], a.seq, s["head_dim"], device=dev, dtype=dt, requires_grad=True)
    shape = (b, s["kv"], a.seq, s["head_dim"])
    k, v = (torch.randn(shape, device=dev, dtype=dt).requires_grad_() for _ in "kv")
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fwd_bwd():
        sdpa(q, k, v, is_causal=True, enable_gqa=True).backward(torch.ones_like(q))

    with torch.no_grad():
        fwd_ms = _time_ms(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))
    attn_ms = (a.layers or s["layers"]) * (_time_ms(fwd_bwd) + (_forward_passes(a) - 1) * fwd_ms)
    parts = {"gemm": gemm_ms, "attention": attn_ms}
    if a.task == "qlora":
        parts["dequant"] = dequant_ms(a, dev)
    return {**setting(a, "floor"), "batch": batch, "ms": sum(parts.values()), "parts": parts}


def worker(a) -> None:
    """This process's runs: the sweep of one implementation (or its profile, or the floor) to ``a.out``."""
    rows = []
    for batch in a.batches:
        r = floor(a, batch) if a.floor else train(a, batch, profile=a.profile)
        if a.profile:
            r["ms"] = r.get("step_time_s", 0) * 1e3
        rows.append({"case": e2e_case(r), **r} if a.profile or a.floor else r)
        shown = {k: r.get(k) for k in ("step_time_s", "peak_mem_gib", "ms", "parts", "error")}
        print(f"[bench_e2e] {a.impl} b={batch}: {json.dumps(shown)}", flush=True)
        if r.get("oom"):
            break
    write_json(a.out, rows)


def child_env(impl: str) -> dict | None:
    """The environment of ``impl``'s process: unsloth's has ``$CHUNKLOSS_UNSLOTH_SITE`` first on its path."""
    site = os.environ.get("CHUNKLOSS_UNSLOTH_SITE")
    if impl != "unsloth" or not site:
        return None
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}


def sweep_parser(
    doc: str, *, task: str, steps: int, warmup: int, timeout_s: float
) -> argparse.ArgumentParser:
    """The arguments of bench_e2e and bench_longctx, with their defaults."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama-3.2-1b")
    p.add_argument("--task", choices=TASKS, default=task)
    p.add_argument("--steps", type=int, default=steps, help="training steps per run")
    p.add_argument("--warmup", type=int, default=warmup, help="steps left out of the timing")
    p.add_argument("--layers", type=int, default=0, help="decoder layers; 0: the shape's own")
    p.add_argument("--timeout-s", type=float, default=timeout_s, help="per implementation's process")
    p.add_argument("--out", required=True, help="result json file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = sweep_parser(__doc__, task="full", steps=10, warmup=3, timeout_s=300)
    p.add_argument("--loss", choices=harness.LOSSES, default="sft")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--gc", choices=("off", "on"), default="off", help="gradient checkpointing")
    p.add_argument("--impl", default="trl,liger,compile,chunkloss", help=f"of {harness.TRAINER_IMPLS}")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128", help="per-device, in turn until an OOM")
    p.add_argument("--medusa-heads", type=int, default=3, help="medusa: K heads")
    p.add_argument("--medusa-stage", type=int, choices=(1, 2), default=1, help="medusa: 1 heads, 2 joint")
    p.add_argument("--no-kernels", dest="kernels", action="store_false", help="chunkloss: no chunk_kernels")
    p.add_argument("--compile-ours", action="store_true", help="chunkloss: torch_compile=True")
    p.add_argument("--profile", action="store_true", help="torch.profiler's kernel time by kind, one impl")
    p.add_argument("--floor", action="store_true", help="the step's GEMMs and attention timed alone")
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",") if b]
    impls = harness.split_choices(p, "--impl", a.impl, harness.TRAINER_IMPLS)
    if a.steps - a.warmup < 5 and not (a.shape == "tiny"):
        p.error("--steps must leave at least 5 timed steps after --warmup")
    if a.profile and (len(impls) != 1 or len(a.batches) != 1):
        p.error("--profile takes one --impl and one batch")
    if a.task == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        p.error("--task qlora needs bitsandbytes: pip install 'chunkloss[qlora]'")
    if a.task in CHUNK_FP8 and (impls != ["chunkloss"] or a.floor or not a.kernels):
        p.error(f"--task {a.task} is chunkloss's chunk_fp8: --impl chunkloss with its kernels, no --floor")
    if a.worker:
        worker(a)
        return 0
    mode = "floor" if a.floor else "profile" if a.profile else "e2e"
    key = "sweep" if mode == "e2e" else "rows"
    data = {"stamp": harness.stamp(command=harness.command("bench_e2e", argv)), "mode": mode, key: []}
    for impl in ["floor"] if a.floor else impls:
        one = [] if a.floor else ["--impl", impl]
        rows, error = harness.run_worker("bench_e2e", [*argv, *one], a.timeout_s, child_env(impl))
        if error is not None:
            rows = [{**setting(a, impl), "batch": a.batches[0], "oom": False, "error": error}]
            rows[0] = {"case": e2e_case(rows[0]), **rows[0]} if mode != "e2e" else rows[0]
        data[key] += rows
        write_json(a.out, data)
    print(f"[bench_e2e] wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
