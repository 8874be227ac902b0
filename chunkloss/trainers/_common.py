"""What every chunked trainer shares: the chunkloss fields of the config subclasses, and reading them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from chunkloss._compat import trl as trl_compat

from ._long_context import mlp_options

__all__ = [
    "ChunkedArguments",
    "DeferredMetrics",
    "apply_chunk_kernels",
    "check_max_steps",
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
        chunk_kernels: run the model on chunkloss's Triton kernels (``chunkloss.models.patch(model,
            loss=False)``: RMSNorms, rotary embedding, each layer's input norm, q/k/v projections and rotary
            embedding as one fused call, the gated MLPs, and LoRA adapters inside those calls), and a
            reference or teacher model too. ``None`` (the default): on when the model is on CUDA, of a
            supported type and ``use_liger_kernel`` is off, else off with one log line saying why; ``True``:
            required (the trainer is refused when it cannot be); ``False``: off. See
            :func:`apply_chunk_kernels`.
        chunk_kernels_mlp_recompute: with ``chunk_kernels``, the fused MLP saves only its input and replays
            the gate/up GEMM in the backward (``patch(..., mlp_recompute=True)``): less activation memory, one
            more GEMM per MLP. Off by default (the gate and up pre-activations are saved).
        chunk_kernels_norm_recompute: with ``chunk_kernels``, the decoder layers keep no output of the norms
            before attention and MLP for the backward, which runs those norms again
            (``patch(..., norm_recompute=True)``): 2·H fewer elements per token and layer. Off by default.
        chunk_kernels_mlp_tile: with ``chunk_kernels``, tokens per tile of the fused MLP
            (``patch(..., mlp_tile=...)``): its (tokens, intermediate) tensors exist for one tile at a time.
            None: one call over all tokens, or 8192-token tiles under ``chunk_long_context``.
        chunk_long_context: train long sequences: checkpointing on, what it keeps (each layer's input)
            offloaded to pinned host memory on a side stream by TRL's activation offloading, and with the
            kernels the MLP recomputed and tiled (:mod:`chunkloss.trainers._long_context`). Off by default.
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
    chunk_kernels: bool | None = field(
        default=None,
        metadata={
            "help": "Run the model's RMSNorm, rotary embedding, attention input (norm + q/k/v + rotary as "
            "one call) and gated MLP on chunkloss's Triton kernels, LoRA adapters inside them "
            "(chunkloss.models.patch(model, loss=False); a reference/teacher model of a supported type too): "
            "less activation memory, faster steps. None (default): on when the model is on CUDA, of a "
            "supported type (llama, mistral, qwen2, qwen3, gemma, gemma2: "
            "chunkloss.models.SUPPORTED_MODEL_TYPES) and use_liger_kernel is off; otherwise off, with one "
            "log line saying why. True: required (refused when impossible). False: off; results then equal "
            "TRL's up to rounding."
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
    chunk_kernels_mlp_tile: int | None = field(
        default=None,
        metadata={
            "help": "With chunk_kernels: tokens per tile of the fused MLP (chunkloss.models.patch(model, "
            "mlp_tile=N)); its (tokens, intermediate) tensors exist for one tile at a time. None: no tiles, "
            "or 8192 under chunk_long_context."
        },
    )
    chunk_long_context: bool = field(
        default=False,
        metadata={
            "help": "Train long sequences: gradient checkpointing on, each checkpointed layer input "
            "offloaded to pinned CPU memory on a side stream (TRL's activation offloading), and with "
            "chunk_kernels the MLP recomputed and tiled."
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
    """Replace the 0-d tensors in the lists of each ``store`` (TRL's metrics of one mode) by Python
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
        """TRL's ``num_tokens`` bookkeeping: in training the running total grows by ``count.item() //``
        the tensor-parallel size, with ``count`` fetched at the next log; in evaluation (``count`` None) the
        running total now. Either way the ``num_tokens`` metric holds the total (in training, replaced by the
        fetched one when the trainer logs)."""
        if mode == "train":
            self.__dict__.setdefault("_pending_tokens", []).append(count)
        else:
            self.fetch_deferred_metrics()
        trl_compat.metrics(self, mode)["num_tokens"] = [trl_compat.total_train_tokens(self)]

    def record_aux_loss(self, mode: str, aux_loss: torch.Tensor) -> None:
        """TRL's ``aux_loss`` metric of a mixture-of-experts router: its mean over the gathered processes."""
        trl_compat.metrics(self, mode)["aux_loss"].append(
            self.accelerator.gather_for_metrics(aux_loss).mean()
        )

    def fetch_deferred_metrics(self) -> None:
        """Fetch the stored metrics and token counts (what ``log`` does first; an evaluation step calls it
        too, since TRL's evaluation metrics read the running token count)."""
        pending = self.__dict__.get("_pending_tokens")
        if pending:
            counts = torch.stack(pending).tolist()
            pending.clear()
            tp = trl_compat.tp_size(self)
            total = trl_compat.total_train_tokens(self) + sum(c // tp for c in counts)
            trl_compat.set_total_train_tokens(self, total)
        # Trainers that defer their token count (SFT, DPO) log the running total, as TRL's set it each step.
        if pending is not None and "num_tokens" in trl_compat.metrics(self, "train"):
            trl_compat.metrics(self, "train")["num_tokens"] = [trl_compat.total_train_tokens(self)]
        fetch_metrics(*trl_compat.metric_stores(self))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self.fetch_deferred_metrics()
        super().log(logs, start_time)


def refuse(trainer: str, option: str, why: str) -> None:
    """Raise the error for an option the chunked trainer does not cover (no silent fallback)."""
    raise ValueError(f"{trainer} does not support {option}: {why}")


def check_max_steps(args) -> None:
    """``max_steps`` is a step count (at least 1) or negative (transformers' "train ``num_train_epochs``");
    0, which transformers runs as one step, is refused."""
    if getattr(args, "max_steps", -1) == 0:
        raise ValueError(
            "max_steps=0 would train one step (transformers runs at least one): set max_steps to the number "
            "of steps, or -1 (the default) to train num_train_epochs epochs"
        )


def _off_device(model) -> set[str]:
    """Device types of ``model``'s parameters that the Triton kernels cannot take (all but CUDA, unless
    ``TRITON_INTERPRET=1`` runs them on the CPU). ``meta`` parameters are materialised elsewhere (offload)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return set()
    return {p.device.type for p in model.parameters()} - {"cuda", "meta"}


def _model_type(model) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _why_not(model, args, *, auto: bool) -> tuple[str, str] | None:
    """``(option, why)`` when the kernels cannot run ``model``; None when they can. In auto mode the CPU
    is a reason even under ``TRITON_INTERPRET=1`` (the interpreter is for tests, which ask for the
    kernels)."""
    from chunkloss.models import SUPPORTED_MODEL_TYPES

    if getattr(args, "use_liger_kernel", False):
        why = "both replace the model's norms, rotary embedding and MLPs; choose one"
        return "with use_liger_kernel=True", why
    if getattr(args, "torch_compile", False):
        why = (
            "compiling a patched model on CUDA fails in the kernels' custom ops (their fake-tensor calls "
            "raise 'vector::reserve' under torch 2.11); TRL compiles transformers' modules"
        )
        return "with torch_compile=True", why
    model_type = _model_type(model)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"on model type {model_type!r}", f"the kernels cover {', '.join(SUPPORTED_MODEL_TYPES)}"
    off = {p.device.type for p in model.parameters()} - {"cuda", "meta"}
    if not auto:
        off = _off_device(model)
    if off:
        return (
            f"with parameters on {sorted(off)}",
            "the Triton kernels run on CUDA tensors only (or under TRITON_INTERPRET=1)",
        )
    return None


def apply_chunk_kernels(trainer) -> None:
    """Patch the trainer's models with ``chunkloss.models.patch(model, loss=False,
    mlp_recompute=chunk_kernels_mlp_recompute, norm_recompute=chunk_kernels_norm_recompute)`` as
    ``chunk_kernels`` says.

    Called by every chunked trainer once TRL's constructor has built and placed its models. The trained model
    is patched (a PEFT model's base model, its plain LoRA layers inside the fused calls) when:

    * ``chunk_kernels=None`` (the default) and the model is on CUDA, of a type in ``SUPPORTED_MODEL_TYPES``,
      and neither ``use_liger_kernel`` nor ``torch_compile`` is on; otherwise the model keeps transformers'
      modules and one log line (``chunkloss.trainers``, WARNING) says why;
    * ``chunk_kernels=True``, or the trainer is refused with a ``ValueError`` naming ``chunk_kernels`` when
      the type is not supported, the parameters are not on CUDA (without ``TRITON_INTERPRET=1``),
      ``use_liger_kernel`` is on too (Liger patches the same modules) or ``torch_compile`` is on.

    The causal-LM loss is left alone: the trainer already computes it chunked. A reference model (DPO, GRPO)
    or teacher (GKD, distillation) is patched too when the kernels can take it, since its no-grad forwards get
    faster as well; one they cannot take keeps transformers' modules (named in the log line). What ``patch``
    leaves to the separate modules (a DoRA adapter, an 8-bit layer, a hook) its own log line names. The
    kernels' in-place choices (rotary on fresh q/k projections, MLP and norm backwards over buffers read by
    nothing else) hold under gradient checkpointing: a recomputed forward builds the same fresh tensors.
    """
    import logging

    from chunkloss.models import patch

    name, args = type(trainer).__name__, trainer.args
    setting = getattr(args, "chunk_kernels", None)
    if setting not in (None, True, False):
        raise ValueError(f"chunk_kernels must be None, True or False, got {setting!r}")
    norm_recompute = bool(getattr(args, "chunk_kernels_norm_recompute", False))
    options = {**mlp_options(args), "norm_recompute": norm_recompute}
    if setting is False:
        for key in ("mlp_recompute", "norm_recompute", "mlp_tile"):
            value = getattr(args, f"chunk_kernels_{key}", None)
            if value:
                refuse(
                    name,
                    f"chunk_kernels_{key}={value!r} with chunk_kernels=False",
                    "it selects how the kernels compute and what they keep for the backward",
                )
        return
    if options["norm_recompute"] and getattr(args, "torch_compile", False):
        refuse(
            name,
            "chunk_kernels_norm_recompute=True with torch_compile=True",
            "its saved-tensor hooks are not traced by torch.compile",
        )
    log = logging.getLogger("chunkloss.trainers")
    unwrap = trainer.accelerator.unwrap_model
    model = peft_base(unwrap(trainer.model))
    why = _why_not(model, args, auto=setting is None)
    if why is not None:
        if setting:
            refuse(name, f"chunk_kernels=True {why[0]}", why[1])
        log.warning(
            "%s: chunk_kernels off: the model (type %r) %s keeps transformers' modules (%s); "
            "chunk_kernels=False silences this",
            name,
            _model_type(model),
            why[0],
            why[1],
        )
        return
    try:
        patch(model, loss=False, **options)
    except ValueError as e:  # e.g. a model class outside its family's modeling module
        refuse(name, "chunk_kernels on this model", str(e))
    kept = []
    for attr in ("ref_model", "teacher_model"):
        other = getattr(trainer, attr, None)
        if not isinstance(other, torch.nn.Module):
            continue
        other = peft_base(unwrap(other))
        if other is model:
            continue
        other_why = _why_not(other, args, auto=setting is None)
        if other_why is None:
            patch(other, loss=False, **options)
        else:
            kept.append(f"{attr} (type {_model_type(other)!r}) {other_why[0]} keeps transformers' modules")
    line = f"{name}: chunk_kernels on for the model (type {_model_type(model)!r})"
    log.log(logging.WARNING if kept else logging.INFO, "; ".join([line, *kept]))


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
