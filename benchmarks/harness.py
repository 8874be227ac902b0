"""Timing and memory harness shared by every GPU benchmark of chunkloss.

A benchmark case builds its inputs once and offers one callable per implementation (ours and each
installed peer). Each callable runs forward + backward of the LM-head step on those inputs. The
harness times it with CUDA events after warm-up (median of ``repeats``) and measures its peak extra
memory (``render.MEMORY_DEFINITION``). Every result file carries a :func:`stamp`: date, GPU and library
versions.
"""

from __future__ import annotations

import datetime
import gc
import importlib.metadata
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PEAK_TFLOPS = 800.0  # bf16 dense GEMM rate measured on the H100 (8192³: 798 TFLOP/s)
PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "trl",
    "accelerate",
    "chunkloss",
    "liger-kernel",
    "cut-cross-entropy",
)


def stamp(gpu: str | None = None, command: str = "") -> dict:
    """Date, GPU name and installed versions of the packages that shape a result (``None`` if absent).

    Args:
        gpu: device name; by default the current CUDA device's, or "cpu".
        command: the command line that produced the result.
    """
    if gpu is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["torch"] = torch.__version__
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return {"date": date, "gpu": gpu, "versions": versions, "command": command}


@dataclass
class Case:
    """One benchmark case.

    Attributes:
        name: row label, e.g. "ce N=8192".
        group: the loss or kernel family ("cross_entropy", "dpo", ...), one table/plot each.
        tokens: x-axis value for plots (tokens in the batch).
        floor_flops: FLOPs of the GEMMs the step cannot avoid (e.g. 6·N_valid·H·V for CE;
            + 2·N_valid·H·V per no-grad head).
        make_inputs: ``device -> dict`` of tensors (leaf tensors that need grad have requires_grad).
        impls: implementation name -> ``inputs -> loss`` (a scalar tensor to call .backward() on).
        meta: anything to record alongside (shapes, options).
    """

    name: str
    group: str
    tokens: int
    floor_flops: float
    make_inputs: Callable[[torch.device], dict]
    impls: dict[str, Callable[[dict], torch.Tensor]]
    meta: dict = field(default_factory=dict)

    @property
    def floor_ms(self) -> float:
        return self.floor_flops / (PEAK_TFLOPS * 1e12) * 1e3


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is the GPU running out of memory: PyTorch's error, or cuBLAS failing to allocate its
    workspace (reported as a RuntimeError of its own)."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    """Collect unreachable objects and hand cached CUDA blocks back, between runs that must not see each
    other's memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def training_input(args: tuple, kwargs: dict):
    """``(input_ids, attention_mask or None)`` as a forward pre-hook (``with_kwargs=True``) sees them, for a
    forward with gradients on (a training forward: generation and reference forwards run without), else
    None. A mask that is not (B, T) padding is returned as None."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not torch.is_grad_enabled() or ids is None:
        return None
    mask = kwargs.get("attention_mask")
    return ids, (mask if mask is not None and mask.dim() == 2 else None)


def random_model(shape: dict, device, dtype, seed: int, tokenizer=None, **config):
    """A causal LM of ``shape`` (``family`` (default llama), ``vocab``, ``hidden``, ``inter``, ``layers``,
    ``heads``, ``kv``, ``head_dim``) with random weights from ``seed``, built directly on ``device`` in
    ``dtype``; the pad, EOS and BOS ids from ``tokenizer`` when given; ``config`` adds or overrides config
    fields."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                  num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                  num_key_value_heads=shape["kv"], head_dim=shape["head_dim"])  # fmt: skip
    if tokenizer is not None:
        fields.update({f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("pad", "eos", "bos")})
    cfg = AutoConfig.for_model(shape.get("family", "llama"), **{**fields, **config})
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def grad_leaves(inputs: dict) -> list[torch.Tensor]:
    """The tensors of ``inputs`` that require grad."""
    return [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def measure(fn: Callable[[dict], torch.Tensor], inputs: dict, warmup: int = 2, repeats: int = 7) -> dict:
    """Median time (ms) of forward + backward and peak extra memory (bytes) of one implementation.

    Returns:
        ``ms`` (median), ``ms_all``, ``peak_extra_bytes`` (``render.MEMORY_DEFINITION``: every gradient
        is set to ``None`` before the step, and the bytes of the gradients it returns are subtracted),
        ``grad_bytes`` and ``loss``.
    """
    leaves = grad_leaves(inputs)

    def step():
        for t in leaves:
            t.grad = None
        loss = fn(inputs)
        loss.backward()
        return loss

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        for t in leaves:
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = fn(inputs)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    for t in leaves:
        t.grad = None
    del loss
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grad_bytes = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    out = {
        "ms": statistics.median(times),
        "ms_all": times,
        "peak_extra_bytes": peak - grad_bytes,
        "grad_bytes": grad_bytes,
        "loss": float(loss.detach().float()),
    }
    for t in leaves:
        t.grad = None
    return out


def measure_or_error(timer: Callable[..., dict], fn, inputs: dict, repeats: int = 7) -> dict:
    """``timer(fn, inputs, repeats=repeats)``, or ``{"error": ...}`` when the implementation runs out of
    memory or fails: a peer failing is a result, not the end of the benchmark."""
    try:
        return timer(fn, inputs, repeats=repeats)
    except Exception as e:
        if is_oom(e):
            return {"error": "OOM"}
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
