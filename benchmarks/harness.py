"""Timing and memory harness shared by every GPU benchmark of chunkloss.

A benchmark case builds its inputs once and offers one callable per implementation (ours and each
installed peer). Each callable runs forward + backward of the LM-head step on those inputs. The
harness times it with CUDA events after warm-up (median of ``repeats``) and measures its peak extra
memory (``report.MEMORY_DEFINITION``). Every result file carries a :func:`stamp`: date, GPU and library
versions.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import importlib.metadata
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PEAK_TFLOPS = 800.0  # bf16 dense GEMM rate measured on the H100 (8192³: 798 TFLOP/s)
PACKAGES = ("torch", "triton", "transformers", "trl", "accelerate", "chunkloss", "liger-kernel",
            "cut-cross-entropy", "peft", "bitsandbytes", "datasets", "deepspeed")  # fmt: skip


def stamp(command: str = "", gpus: int | None = None) -> dict:
    """Date, GPU (the CUDA device's name, ``<gpus> x <name>`` if ``gpus`` is given; "cpu" without CUDA), the
    installed versions of the packages that shape a result (``None`` if absent) and the ``command``."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if gpus is not None and gpu != "cpu":
        gpu = f"{gpus} x {gpu}"
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["torch"] = torch.__version__
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return {"date": date, "gpu": gpu, "versions": versions, "command": command}


LLAMA3 = dict(vocab=128256, kv=8, tied=True)
QWEN3 = dict(family="qwen3", vocab=151936, kv=8, head_dim=128, tied=True)
# Real models' shapes, for random weights; tied: the LM head shares the input embedding's weight.
SHAPES = {
    "llama-3.2-1b": dict(LLAMA3, hidden=2048, inter=8192, layers=16, heads=32, head_dim=64),
    "llama-3.2-3b": dict(LLAMA3, hidden=3072, inter=8192, layers=28, heads=24, head_dim=128),
    "llama-3.1-8b": dict(LLAMA3, hidden=4096, inter=14336, layers=32, heads=32, head_dim=128, tied=False),
    "qwen3-0.6b": dict(QWEN3, hidden=1024, inter=3072, layers=28, heads=16),
    "qwen3-4b": dict(QWEN3, hidden=2560, inter=9728, layers=36, heads=32),
    "qwen3-8b": dict(QWEN3, hidden=4096, inter=12288, layers=36, heads=32, tied=False),
    "tiny": dict(vocab=4096, hidden=64, inter=128, layers=2, heads=4, kv=2, head_dim=16, tied=True),
}  # fmt: skip


def command(module: str, argv: list[str] | None) -> str:
    """The command line ``python -m benchmarks.<module>`` with ``argv`` (``sys.argv[1:]`` if None)."""
    return " ".join([f"python -m benchmarks.{module}", *(sys.argv[1:] if argv is None else argv)])


def split_choices(parser, flag: str, text: str, allowed) -> list[str]:
    """``flag``'s comma-separated ``text`` as a list, or ``parser``'s error when it names none or another than
    ``allowed``."""
    items = [i for i in text.split(",") if i]
    if not items or set(items) - set(allowed):
        parser.error(f"{flag}: choose from {', '.join(allowed)}, got {text!r}")
    return items


def run_worker(module: str, argv: list[str], timeout_s: float, env: dict | None = None):
    """``python -m benchmarks.<module> <argv> --worker --out PART`` in a process of its own: the rows it wrote
    to PART (none if it wrote nothing) and why it failed (None when it exited with status 0)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        part = pathlib.Path(f.name)
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *argv, "--worker", "--out", str(part)]
    try:
        rc = subprocess.run(cmd, timeout=timeout_s, env=env).returncode
        error = None if rc == 0 else f"process exited with status {rc}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout_s:.0f} s"
    rows = json.loads(part.read_text()) if part.stat().st_size else []
    part.unlink()
    return rows, error


@dataclass
class Case:
    """One loss case: its inputs, built once, and one callable per implementation on them."""

    name: str  # the row, e.g. "ce N=8192"
    group: str  # the loss family
    tokens: int  # in the batch
    floor_flops: float  # the GEMMs the step cannot avoid: 6·N_valid·H·V, + 2·N_valid·H·V per no-grad head
    make_inputs: Callable[[torch.device], dict]  # device -> tensors, the leaves needing grad marked
    impls: dict[str, Callable[[dict], torch.Tensor]]  # name -> (inputs -> scalar loss)
    meta: dict = field(default_factory=dict)  # recorded alongside

    @property
    def floor_ms(self) -> float:
        return self.floor_flops / (PEAK_TFLOPS * 1e12) * 1e3


def optional(module: str, name: str):
    """``module.name``, or None when it does not import: a peer is offered only where it is installed."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def head_inputs(device, *rows: int, hidden: int, vocab: int):
    """A generator seeded 0, then from it an LM head's bf16 leaves on ``device``: ``hidden`` (*rows, H) drawn
    from N(0, 0.5²) and ``weight`` (V, H) from N(0, 0.02²)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(*rows, hidden, generator=g) * 0.5).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, torch.bfloat16).requires_grad_()
    return g, x, weight


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is the GPU running out of memory: PyTorch's error, or cuBLAS failing to allocate its
    workspace (reported as a RuntimeError of its own)."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text)


def error_text(e: BaseException) -> str:
    """A failed run's result: ``OOM`` (:func:`is_oom`), else the exception's type and first line."""
    return "OOM" if is_oom(e) else f"{type(e).__name__}: {str(e).partition(chr(10))[0][:300]}"


def free_memory() -> None:
    """Collect unreachable objects and hand cached CUDA blocks back, between runs that must not share them."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def record_pid(run_dir) -> None:
    """This process's id in ``run_dir/pids/rank<RANK>.pid``: the shell driver kills leftover workers by id."""
    pids = pathlib.Path(run_dir) / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))


# A shape's keys as transformers' config fields.
CONFIG_FIELDS = dict(vocab="vocab_size", hidden="hidden_size", inter="intermediate_size",
                     layers="num_hidden_layers", heads="num_attention_heads", kv="num_key_value_heads",
                     head_dim="head_dim", tied="tie_word_embeddings")  # fmt: skip


def random_model(shape: dict, seed: int, tokenizer=None, **config):
    """A causal LM of ``shape`` (a ``SHAPES`` entry) with random weights from ``seed``, built directly on this
    process's GPU in bf16 (no host copy: a 4B model initialises in seconds), without CUDA on the CPU in fp32;
    the pad, EOS and BOS ids from ``tokenizer`` when given; ``config`` adds or overrides config fields."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {field: shape[key] for key, field in CONFIG_FIELDS.items()}
    if tokenizer is not None:
        fields.update({f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("pad", "eos", "bos")})
    cfg = AutoConfig.for_model(shape.get("family", "llama"), **{**fields, **config})
    cuda = torch.cuda.is_available()
    torch.manual_seed(seed)
    with torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32)


def timed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of ``fn``: CUDA events on CUDA (queued work first), else the wall clock."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def peak_extra(fn: Callable[[], object]) -> tuple[object, int | None]:
    """``fn()`` and the highest CUDA memory allocated during it minus what was allocated before (bytes; None
    off CUDA)."""
    if not torch.cuda.is_available():
        return fn(), None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def measure(fn: Callable[[dict], torch.Tensor], inputs: dict, warmup: int = 2, repeats: int = 7) -> dict:
    """``ms`` (the median of ``repeats`` forward + backward after ``warmup``), ``ms_all``,
    ``peak_extra_bytes`` (``report.MEMORY_DEFINITION``: gradients set to ``None`` before the step, the bytes
    of those it returns subtracted), ``grad_bytes`` and ``loss`` of one implementation."""
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        for t in leaves:
            t.grad = None
        loss = fn(inputs)
        loss.backward()
        return loss

    for _ in range(warmup):
        step()
    times = [timed_ms(step, torch.device("cuda")) for _ in range(repeats)]
    for t in leaves:
        t.grad = None
    gc.collect()
    loss, peak = peak_extra(step)
    grad_bytes = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    out = dict(
        ms=statistics.median(times), ms_all=times, peak_extra_bytes=peak - grad_bytes, grad_bytes=grad_bytes
    )
    out["loss"] = float(loss.detach().float())
    for t in leaves:
        t.grad = None
    return out


# The implementations a user picks with one flag or one class: TRL's trainer, with Liger's kernels, compiled,
# chunkloss's chunked trainer (with its kernels unless told otherwise), and TRL's as Unsloth patches it.
TRAINER_IMPLS = ("trl", "liger", "compile", "chunkloss", "unsloth")
# The fields whose defaults Unsloth's configs change (to 8-bit AdamW, accumulation, ...): the others' given.
UNSLOTH_DEFAULTS = ("optim", "gradient_accumulation_steps", "weight_decay", "warmup_steps")
# The trainers the multi-GPU benchmarks run (multigpu_parity, multigpu_scale).
MULTIGPU_TRAINERS = ("sft", "dpo", "grpo", "kto", "rloo")
LOSSES = ("sft", "dpo", "grpo", "orpo", "gkd", "medusa", "kto", "rloo")
NUM_GENERATIONS = 2
# The training arguments every implementation shares (besides batch, steps, precision and checkpointing).
TRAINING = dict(report_to="none", learning_rate=1e-5, logging_steps=1, save_strategy="no", seed=0,
                dataloader_num_workers=0)  # fmt: skip


def kernels_available() -> bool:
    """Whether chunkloss's Triton kernels can run here: on CUDA, or through the interpreter
    (``TRITON_INTERPRET=1``) on a CPU."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def counting_dataset(loss: str, n: int, length: int):
    """Counting prompts with completions of ``length`` words (each at least one token, so every sequence is
    truncated to the trainer's max length): prompt-completion rows (SFT, Medusa), chosen/rejected pairs
    with two wrong numbers (DPO, ORPO), the same unpaired, alternately right (labelled desirable) and wrong
    (KTO), prompts (GRPO, RLOO) or conversations (GKD)."""
    from datasets import Dataset

    prompts, good, bad = [], [], []
    for i in range(n):
        start = i % 20
        prompts.append(f"count {start} to {start + length - 1} :")
        seq = [str((start + j) % 30) for j in range(length)]
        good.append(" " + " ".join(seq))
        slips = {(i * 7 + 3) % length, (i * 13 + length // 2) % length}
        bad.append(" " + " ".join(str((int(w) + 1) % 30) if j in slips else w for j, w in enumerate(seq)))
    if loss in ("grpo", "rloo"):
        return Dataset.from_dict({"prompt": prompts})
    if loss == "kto":
        label = [i % 2 == 0 for i in range(n)]
        completion = [g if d else b for g, b, d in zip(good, bad, label, strict=True)]
        return Dataset.from_dict({"prompt": prompts, "completion": completion, "label": label})
    if loss in ("sft", "medusa"):
        return Dataset.from_dict({"prompt": prompts, "completion": good})
    if loss == "gkd":  # conversational: GKD's collator splits the prompt from the last message
        chats = [
            [{"role": "user", "content": p}, {"role": "assistant", "content": g.strip()}]
            for p, g in zip(prompts, good, strict=True)
        ]
        return Dataset.from_dict({"messages": chats})
    return Dataset.from_dict({"prompt": prompts, "chosen": good, "rejected": bad})


def even_id_reward(completion_ids, **kwargs) -> list[float]:
    """Fraction of a completion's token ids that are even: differs between the completions of a group, so
    GRPO's advantages are not zero."""
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def random_digits(trainer, seed: int) -> list[int]:
    """``max_completion_length`` random digit tokens of ``trainer``'s tokenizer, seeded by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(trainer._digit_ids), (trainer.max_completion_length,), generator=g)
    return torch.tensor(trainer._digit_ids)[pick].tolist()


def fixed_completions(base, complete=random_digits):
    """``base`` (TRL's ``GRPOTrainer`` or ``RLOOTrainer``, or a subclass) whose completions are
    ``complete(trainer, seed)`` (with the tokenizer's digit tokens in ``trainer._digit_ids``), seeded by the
    prompt's ids and the completion's index in its group: the step is scoring, loss, backward and optimizer,
    with nothing sampled. TRL lays a generation batch out group after group, each process holding a contiguous
    slice; a completion's index in its group is its global position modulo ``num_generations``."""

    class FixedCompletions(base):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations=None, **kw):
            if not hasattr(self, "_digit_ids"):
                vocab = self.processing_class.get_vocab()
                self._digit_ids = sorted(i for t, i in vocab.items() if t.isdigit())
            first = self.accelerator.process_index * len(prompt_ids)
            group = num_generations or self.num_generations
            completions = []
            for i, ids in enumerate(prompt_ids):
                key = json.dumps([list(ids), (first + i) % group]).encode()
                completions.append(complete(self, zlib.crc32(key)))
            # RLOO's: the ids alone; GRPO's: no sampling log-probs, as TRL's transformers generation
            return completions if num_generations is None else (completions, None)

    FixedCompletions.__name__ = f"FixedCompletions{base.__name__}"
    return FixedCompletions


def materialised_medusa(base):
    """``base`` (``ChunkedMedusaTrainer``) whose heads' loss is Medusa's own: each head's logits
    ``lm_head_k(block_k(hidden))`` materialised and upcast to fp32 for ``F.cross_entropy`` against the token
    k + 1 places ahead, weighted ``decay^k``; stage 2 adds ``base_weight`` times the base head's loss."""
    import torch.nn.functional as F

    class MaterialisedMedusa(base):
        def __init__(self, *args, **kwargs):  # defined: a subclass without one gets TRL's, not the parent's
            super().__init__(*args, **kwargs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            a, heads, m = self.args, self.medusa_heads, self.accelerator.unwrap_model(model)
            with contextlib.nullcontext() if a.medusa_stage == 2 else torch.no_grad():
                ids, mask = inputs["input_ids"], inputs.get("attention_mask")
                out = m.model(input_ids=ids, attention_mask=mask, use_cache=False)
            hidden = out.last_hidden_state[:, :-1]
            target, t = inputs["labels"][:, 1:], hidden.shape[1]
            loss = 0.0
            if a.medusa_stage == 2:
                logits = m.lm_head(hidden).float()
                loss = a.medusa_base_weight * F.cross_entropy(logits.flatten(0, 1), target.flatten())
            for k in range(1, a.medusa_num_heads + 1):
                logits = heads.lm_heads[k - 1](heads.blocks[k - 1](hidden[:, : t - k])).float()
                ce = F.cross_entropy(logits.flatten(0, 1), target[:, k:].flatten())
                loss = loss + a.medusa_decay**k * ce
            return loss

    return MaterialisedMedusa


def trainer_classes(loss: str, impl: str) -> tuple[type, type]:
    """The config and trainer classes of ``loss``: chunkloss's for chunkloss, else TRL's. Medusa has no TRL
    trainer: its peer is Medusa's own loss on materialised logits (:func:`materialised_medusa`)."""
    if loss not in LOSSES or impl not in TRAINER_IMPLS:
        raise ValueError(f"loss must be one of {LOSSES} and impl of {TRAINER_IMPLS}, got {loss!r}, {impl!r}")
    if loss == "medusa":
        from chunkloss.trainers.medusa import ChunkedMedusaConfig, ChunkedMedusaTrainer

        if impl == "chunkloss":
            return ChunkedMedusaConfig, ChunkedMedusaTrainer
        return ChunkedMedusaConfig, materialised_medusa(ChunkedMedusaTrainer)
    name = loss.upper()
    if impl != "chunkloss":
        module = importlib.import_module(f"trl.experimental.{loss}" if loss in ("orpo", "gkd") else "trl")
        return getattr(module, f"{name}Config"), getattr(module, f"{name}Trainer")
    module = importlib.import_module(f"chunkloss.trainers.{loss}")
    return getattr(module, f"Chunked{name}Config"), getattr(module, f"Chunked{name}Trainer")


def make_trainer(
    loss: str,
    impl: str,
    model,
    tokenizer,
    ds,
    *,
    out_dir: str,
    batch: int,
    steps: int,
    seq: int,
    gc: bool,
    ref=None,
    peft_config=None,
    kernels: bool = True,
    chunk_compile: bool = True,
    medusa: dict | None = None,
    accumulate: int = 1,
    config: dict | None = None,
):
    """``loss``'s trainer of ``impl`` (``TRAINER_IMPLS``) on ``model``, the same options for every ``impl``:
    chunkloss's with ``chunk_kernels=kernels`` (False where they cannot run), the peers as they are picked
    (Unsloth's with ``UNSLOTH_DEFAULTS`` as the others have them). ``ref``: DPO's or KTO's reference or
    GKD's teacher (None under ``peft_config``: the adapter-free model is it). GRPO's and RLOO's fixed
    completions fill what the prompt leaves of ``seq``; RLOO's β is 0 (TRL builds its reference from the
    policy's hub name, which a random model lacks). ``medusa``: ``ChunkedMedusaConfig``'s ``medusa_*``
    fields; ``config``: config fields set last."""
    from transformers import TrainingArguments

    cuda = torch.cuda.is_available()
    # transformers 5 renamed gradient_checkpointing (the old name still works, with a warning).
    renamed = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    cfg = dict(TRAINING, output_dir=out_dir, per_device_train_batch_size=batch, max_steps=steps, bf16=cuda)
    cfg.update(use_cpu=not cuda, gradient_accumulation_steps=accumulate)
    cfg["activation_checkpointing" if renamed else "gradient_checkpointing"] = gc
    chunk = dict(chunk_kernels=kernels and kernels_available(), chunk_compile=chunk_compile and cuda)
    if loss == "medusa":  # both on the chunked trainer's config; the peer swaps in Medusa's own loss
        cfg.update({f"medusa_{k}": v for k, v in (medusa or {}).items()})
        cfg.update(chunk if impl == "chunkloss" else {})
    else:
        unsloth = {k: getattr(TrainingArguments, k) for k in UNSLOTH_DEFAULTS}
        peers = {"trl": {}, "liger": dict(use_liger_kernel=True), "compile": dict(torch_compile=True)}
        cfg.update({**peers, "unsloth": unsloth, "chunkloss": chunk}[impl])
    if loss in ("grpo", "rloo"):
        prompt = max(len(tokenizer(p)["input_ids"]) for p in ds["prompt"])
        completion = max(seq - prompt, 1)
        cfg.update(num_generations=NUM_GENERATIONS, max_completion_length=completion, temperature=1.0)
        cfg.update({"beta": 0.0} if loss == "rloo" else {})
    else:
        cfg["max_length"] = seq
    if loss in ("dpo", "kto"):
        cfg["precompute_ref_log_probs"] = False
    if loss == "gkd":  # off-policy: no step generates; the Trainer counts non-padding tokens
        cfg.update(lmbda=0.0, include_num_input_tokens_seen="non_padding")
    cfg.update(config or {})
    Config, Trainer = trainer_classes(loss, impl)
    kw = dict(train_dataset=ds, processing_class=tokenizer, peft_config=peft_config)
    if loss in ("grpo", "rloo"):
        return fixed_completions(Trainer)(model, [even_id_reward], Config(**cfg), **kw)
    if loss in ("dpo", "gkd", "kto"):
        return Trainer(model, ref, Config(**cfg), **kw)
    return Trainer(model, Config(**cfg), **kw)


def step_timer(after_step=None):
    """A ``TrainerCallback`` that times each training step with CUDA events (wall clock off CUDA) and keeps
    the memory allocated when training begins, after which the CUDA peak is reset; ``after_step()``, if
    given, runs at each step's end. ``times``: seconds per step (synchronises once); ``peak_extra_gib()``:
    the highest memory allocated since training began minus what was allocated then (GiB; None off CUDA)."""
    from transformers import TrainerCallback

    def mark():
        if not torch.cuda.is_available():
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.events, self.allocated_before, self._start = [], 0, None

        @property
        def times(self) -> list[float]:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                return [a.elapsed_time(b) / 1e3 for a, b in self.events]
            return [b - a for a, b in self.events]

        def peak_extra_gib(self) -> float | None:
            if not torch.cuda.is_available():
                return None
            return (torch.cuda.max_memory_allocated() - self.allocated_before) / 2**30

        def on_train_begin(self, *a, **kw):
            free_memory()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                self.allocated_before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, *a, **kw):
            self._start = mark()

        def on_step_end(self, *a, **kw):
            self.events.append((self._start, mark()))
            if after_step is not None:
                after_step()

    return StepTimer()


# Kernel kinds by name (the first that matches): NCCL's collectives, then the compute kinds.
KERNEL_KINDS = (
    ("comm", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "splitk")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copies", ("copy", "memcpy", "memset", "cast", "fill", "cat_")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other" if "at::" in name or "cub::" in name else "triton"


def _union_us(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, t in sorted(spans):
        busy += max(t - max(s, end), 0)
        end = max(end, t)
    return busy


def kernel_time(prof, wall_s: float, steps: int) -> dict:
    """Per step, ms of CUDA kernel time by :func:`kernel_kind`; idle: the steps' time minus the union of the
    kernel intervals; comm_exposed: the time only collectives ran (the union of all kernel intervals minus
    that of the others)."""
    parts = dict.fromkeys([k for k, _ in KERNEL_KINDS] + ["triton", "other"], 0.0)
    spans, compute = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            kind, span = kernel_kind(e.name), (e.time_range.start, e.time_range.end)
            parts[kind] += (span[1] - span[0]) / 1e3
            spans.append(span)
            if kind != "comm":
                compute.append(span)
    busy = _union_us(spans)
    out = {k: v / steps for k, v in parts.items()}
    out["comm_exposed"] = (busy - _union_us(compute)) / 1e3 / steps
    out["idle"] = max(wall_s * 1e3 - busy / 1e3, 0.0) / steps
    return out


def profile_steps(trainer, warmup: int):
    """A ``torch.profiler`` of CUDA kernels (CPU ops off CUDA) over ``trainer``'s steps after ``warmup``."""
    from transformers import TrainerCallback

    activity = torch.profiler.ProfilerActivity
    prof = torch.profiler.profile(activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU])

    class Window(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup:
                prof.start()

        def on_train_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.stop()

    trainer.add_callback(Window())
    return prof


def peak_memory_gib(trainer) -> list[dict] | None:
    """Every process's peak allocated and reserved CUDA memory in GiB (collective: all ranks call it)."""
    if not torch.cuda.is_available():
        return None
    acc = trainer.accelerator
    peaks = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
    mine = torch.tensor(peaks, device=acc.device, dtype=torch.float64)
    rows = acc.gather(mine[None]).reshape(-1, 2).cpu().tolist()
    return [dict(rank=r, allocated=a / 2**30, reserved=b / 2**30) for r, (a, b) in enumerate(rows)]


def failure_reason(error_text: str) -> str:
    """Why a run failed, from its error file: a time-out or skip, else its first exception line, else its last
    line."""
    lines = [ln.strip() for ln in error_text.strip().splitlines() if ln.strip()]
    for pattern in (r"timed out|skipped", r"\w+(Error|Exception)\b"):
        hit = next((ln for ln in lines if re.search(pattern, ln) and "Warning" not in ln), None)
        if hit:
            return hit[:300]
    return lines[-1][:300] if lines else "?"
