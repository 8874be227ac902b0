"""What every chunked trainer shares: the chunkloss fields of the config subclasses, and reading them."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch

__all__ = [
    "ChunkedArguments",
    "DeferredMetrics",
    "apply_chunk_kernels",
    "chunk_options",
    "fetch_metrics",
    "mean_or_zero",
    "refuse",
]

_ACCUM = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "weight": None,
    "none": None,
}


@dataclass
class ChunkedArguments:
    """chunkloss fields added to TRL's config classes (the defaults need no tuning).

    Args:
        chunk_size: rows of logits per chunk; ``None`` sizes chunks to a 448 MiB logits budget.
        chunk_accum_dtype: dtype of the LM-head gradient accumulator across chunks: ``"float32"`` (default),
            ``"bfloat16"``, ``"float16"`` or ``"weight"`` (the weight's own dtype).
        chunk_compile: run the per-chunk math under ``torch.compile``.
        chunk_kernels: run the model's RMSNorms, rotary embedding and gated MLPs on chunkloss's Triton
            kernels, and each layer's input norm, q/k/v projections and rotary embedding as one fused call
            (``chunkloss.models.patch(model, loss=False)``), and a reference or teacher model's too; see
            :func:`apply_chunk_kernels`.
        chunk_kernels_mlp_recompute: with ``chunk_kernels``, the fused MLP saves only its input and replays
            the gate/up GEMM in the backward (``patch(..., mlp_recompute=True)``): less activation memory, one
            more GEMM per MLP. Off by default (the gate and up pre-activations are saved).
        chunk_kernels_norm_recompute: with ``chunk_kernels``, the decoder layers keep no output of the norms
            before attention and MLP for the backward, which runs those norms again
            (``patch(..., norm_recompute=True)``): 2·H fewer elements per token and layer. Off by default.
    """

    chunk_size: int | None = field(
        default=None, metadata={"help": "Rows of logits per chunk (None: automatic)."}
    )
    chunk_accum_dtype: str = field(
        default="float32",
        metadata={"help": "LM-head gradient accumulator dtype: float32, bfloat16 or weight."},
    )
    chunk_compile: bool = field(
        default=True, metadata={"help": "Compile the per-chunk loss with torch.compile."}
    )
    chunk_kernels: bool = field(
        default=False,
        metadata={
            "help": "Run the model's RMSNorm, rotary embedding and gated MLP on chunkloss's Triton kernels, "
            "and each layer's input norm, q/k/v projections and rotary embedding as one fused call "
            "(chunkloss.models.patch(model, loss=False); a reference/teacher model of a supported type "
            "too): less activation memory, faster steps. Model types: llama, mistral, qwen2, qwen3, gemma, "
            "gemma2 (chunkloss.models.patch.SUPPORTED_MODEL_TYPES); CUDA only. Off by default: results "
            "then equal TRL's up to rounding. The rotary patch replaces the family's apply_rotary_pos_emb "
            "for the whole process (chunkloss.models.unpatch_rotary undoes it)."
        },
    )
    chunk_kernels_mlp_recompute: bool = field(
        default=False,
        metadata={
            "help": "With chunk_kernels: the fused MLP saves only its input and replays the gate/up GEMM in "
            "the backward (chunkloss.models.patch(model, mlp_recompute=True)): less activation memory, one "
            "more GEMM per MLP."
        },
    )
    chunk_kernels_norm_recompute: bool = field(
        default=False,
        metadata={
            "help": "With chunk_kernels: the decoder layers keep no output of the norms before attention and "
            "MLP for the backward, which runs those norms again (chunkloss.models.patch(model, "
            "norm_recompute=True)): 2*H fewer activation elements per token and layer."
        },
    )


def chunk_options(args) -> dict:
    """The engine options (``chunk_size``, ``accum_dtype``, ``compile``) from a config, TRL's own or ours."""
    accum = getattr(args, "chunk_accum_dtype", "float32")
    if accum not in _ACCUM:
        raise ValueError(f"chunk_accum_dtype must be one of {sorted(_ACCUM)}, got {accum!r}")
    chunk_size = getattr(args, "chunk_size", None)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    return {
        "chunk_size": chunk_size,
        "accum_dtype": _ACCUM[accum],
        "compile": bool(getattr(args, "chunk_compile", True)),
    }


def mean_or_zero(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count``, or 0 where ``count`` is 0, on the device: TRL's ``(total / count).item() if
    count > 0 else 0.0`` without its two host syncs (the value is the same once fetched)."""
    return torch.where(
        count > 0, total / count.clamp(min=1), torch.zeros((), dtype=total.dtype, device=total.device)
    )


def fetch_metrics(*stores: dict[str, list]) -> None:
    """Replace the 0-d tensors in the lists of each ``store`` (TRL's ``self._metrics[mode]``) by Python
    floats, with one host sync for all of them. ``tolist()`` of a tensor gives the floats its ``.item()``
    gives."""
    where = [
        (vals, i)
        for store in stores
        for vals in store.values()
        for i, v in enumerate(vals)
        if isinstance(v, torch.Tensor)
    ]
    if not where:
        return
    values = torch.stack([vals[i].detach().reshape(()).double() for vals, i in where]).tolist()
    for (vals, i), value in zip(where, values):
        vals[i] = value


class DeferredMetrics:
    """Mixin of the chunked trainers: the metrics ``compute_loss`` stores stay on the device until the trainer
    logs.

    TRL's trainers call ``.item()`` on each metric inside ``compute_loss``, so the host waits there for the
    step so far. With a chunked loss that includes the LM head's gradient GEMMs, which run in the forward
    (TRL's head runs them in the backward, while the host is still launching it): the GPU then idles while
    the host launches the backward. Here ``compute_loss`` stores 0-d tensors (``mean_or_zero`` for TRL's
    guarded means) and the step's token count (``record_tokens``), and ``log`` fetches them all in one sync
    before TRL's ``log`` averages them, so the logged values are TRL's.
    """

    mean_or_zero = staticmethod(mean_or_zero)

    def record_tokens(self, mode: str, count: torch.Tensor | None) -> None:
        """TRL's ``num_tokens`` bookkeeping: in training ``self._total_train_tokens += count.item() //
        self._tp_size``, with ``count`` fetched at the next log; in evaluation (``count`` None) the running
        total now. Either way ``self._metrics[mode]["num_tokens"]`` holds the total (in training, replaced
        by the fetched one when the trainer logs)."""
        if mode == "train":
            self.__dict__.setdefault("_pending_tokens", []).append(count)
        else:
            self.fetch_deferred_metrics()
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    def fetch_deferred_metrics(self) -> None:
        """Fetch the stored metrics and token counts (what ``log`` does first; an evaluation step calls it
        too, since TRL's evaluation metrics read the running token count)."""
        pending = self.__dict__.get("_pending_tokens")
        if pending:
            counts = torch.stack(pending).tolist()
            pending.clear()
            self._total_train_tokens += sum(c // self._tp_size for c in counts)
        stores = []
        for name in ("_metrics", "_stored_metrics"):  # ORPO's TRL trainer keeps ``_stored_metrics``
            stores += list(getattr(self, name, {}).values())
        # Trainers that defer their token count (SFT, DPO) log the running total, as TRL's set it each step.
        if pending is not None and "num_tokens" in self._metrics["train"]:
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        fetch_metrics(*stores)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self.fetch_deferred_metrics()
        super().log(logs, start_time)


def refuse(trainer: str, option: str, why: str) -> None:
    """Raise the error for an option the chunked trainer does not cover (no silent fallback)."""
    raise ValueError(f"{trainer} does not support {option}: {why}")


def _off_device(model) -> set[str]:
    """Device types of ``model``'s parameters that the Triton kernels cannot take (all but CUDA, unless
    ``TRITON_INTERPRET=1`` runs them on the CPU). ``meta`` parameters are materialised elsewhere (offload)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return set()
    return {p.device.type for p in model.parameters()} - {"cuda", "meta"}


def apply_chunk_kernels(trainer) -> None:
    """``chunk_kernels=True``: patch the trainer's models with ``chunkloss.models.patch(model, loss=False,
    mlp_recompute=chunk_kernels_mlp_recompute, norm_recompute=chunk_kernels_norm_recompute)``.

    Called by every chunked trainer once TRL's constructor has built and placed its models. The trained model
    is patched (a PEFT model's base model; LoRA layers stay as they are), or the trainer is refused with a
    ``ValueError`` naming ``chunk_kernels`` when its type is not in ``SUPPORTED_MODEL_TYPES``, its
    parameters are not on CUDA (without ``TRITON_INTERPRET=1``) or ``use_liger_kernel`` is on too (Liger
    patches the same modules). The causal-LM loss is left alone: the trainer
    already computes it chunked. A reference model (DPO, GRPO) or teacher (GKD, distillation) is patched too
    when its type is supported, since its no-grad forwards get faster as well; one of another type keeps
    transformers' modules (warned). The kernels' in-place choices (rotary on fresh q/k projections, MLP and
    norm backwards over buffers read by nothing else) hold under gradient checkpointing: a recomputed
    forward builds the same fresh tensors.

    The rotary patch is process-wide (``chunkloss.models.patch``): other models of the same family in the
    process run the Triton rotary embedding from here on; ``chunkloss.models.unpatch_rotary()`` restores
    transformers' function.
    """
    name = type(trainer).__name__
    options = {
        "mlp_recompute": bool(getattr(trainer.args, "chunk_kernels_mlp_recompute", False)),
        "norm_recompute": bool(getattr(trainer.args, "chunk_kernels_norm_recompute", False)),
    }
    if not getattr(trainer.args, "chunk_kernels", False):
        for key, on in options.items():
            if on:
                refuse(name, f"chunk_kernels_{key}=True without chunk_kernels=True",
                       "it selects what the kernels keep for the backward")  # fmt: skip
        return
    from chunkloss.models.patch import SUPPORTED_MODEL_TYPES, patch

    if getattr(trainer.args, "use_liger_kernel", False):
        refuse(name, "chunk_kernels=True with use_liger_kernel=True",
               "both replace the model's norms, rotary embedding and MLPs; choose one")  # fmt: skip
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    unwrap = trainer.accelerator.unwrap_model
    model = peft_base(unwrap(trainer.model))
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        refuse(name, f"chunk_kernels=True on model type {model_type!r}", f"the kernels cover {supported}")
    off = _off_device(model)
    if off:
        refuse(name, f"chunk_kernels=True with parameters on {sorted(off)}",
               "the Triton kernels run on CUDA tensors only (or under TRITON_INTERPRET=1)")  # fmt: skip
    others = []
    for attr in ("ref_model", "teacher_model"):
        other = getattr(trainer, attr, None)
        if isinstance(other, torch.nn.Module):
            other = peft_base(unwrap(other))
            if other is not model:
                others.append((attr, other, sorted(_off_device(other))))
    for attr, other, other_off in others:
        # The rotary patch reaches this model whenever it shares the trained model's modeling module.
        if type(other).__module__ == type(model).__module__ and other_off:
            refuse(name, f"chunk_kernels=True with {attr} on {other_off}",
                   "it shares the trained model's rotary embedding, which runs on CUDA only")  # fmt: skip
    try:
        patch(model, loss=False, **options)
    except ValueError as e:  # e.g. a model class outside its family's modeling module
        refuse(name, "chunk_kernels=True on this model", str(e))
    for attr, other, other_off in others:
        other_type = getattr(getattr(other, "config", None), "model_type", None)
        if other_type not in SUPPORTED_MODEL_TYPES or other_off:
            where = f"type {other_type!r}" if other_type not in SUPPORTED_MODEL_TYPES else f"on {other_off}"
            warnings.warn(f"chunk_kernels: {attr} ({where}) keeps transformers' modules", stacklevel=2)
            continue
        try:
            patch(other, loss=False, **options)
        except ValueError as e:  # e.g. a wrapper class outside the family's modeling module (FSDP2)
            warnings.warn(f"chunk_kernels: {attr} left partly unpatched: {e}", stacklevel=2)


def peft_base(model):
    """The model under a PEFT wrapper, or the model itself."""
    from accelerate.utils import is_peft_model

    return model.get_base_model() if is_peft_model(model) else model


def jsd_loss_for(cache: dict, student_head, teacher_head, **options):
    """One ``FusedLinearJSDLoss`` per pair of head transforms (logit scale, softcap), built once."""
    from chunkloss.losses.jsd import FusedLinearJSDLoss

    key = (student_head.softcap, student_head.logit_scale, teacher_head.softcap, teacher_head.logit_scale)
    if key not in cache:
        cache[key] = FusedLinearJSDLoss(
            student_logit_scale=student_head.logit_scale,
            teacher_logit_scale=teacher_head.logit_scale,
            student_softcap=student_head.softcap,
            teacher_softcap=teacher_head.softcap,
            **options,
        )
    return cache[key]
