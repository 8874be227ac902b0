"""Whether the chunked trainers run their models on chunkloss's kernels (``chunk_kernels``), and with what
options: :func:`apply_chunk_kernels`."""

from __future__ import annotations

import logging

import torch

from ._arguments import ChunkedArguments
from ._common import peft_base, refuse
from ._long_context import layer_options

__all__ = ["apply_chunk_kernels"]

FP8_SETTINGS = (None, "base", "train")


def _model_type(model) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _why_not(model, args, *, auto: bool) -> tuple[str, str] | None:
    """``(option, why)`` when the kernels cannot run ``model``; None when they can. In auto mode the CPU
    is a reason even under ``TRITON_INTERPRET=1`` (the interpreter is for tests, which ask for the
    kernels)."""
    from chunkloss.models import SUPPORTED_MODEL_TYPES
    from chunkloss.models.patch import devices_off_kernels

    if args.use_liger_kernel:
        why = "both replace the model's norms, rotary embedding and MLPs; choose one"
        return "with use_liger_kernel=True", why
    model_type = _model_type(model)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"on model type {model_type!r}", f"the kernels cover {', '.join(SUPPORTED_MODEL_TYPES)}"
    off = devices_off_kernels(model, interpreter=not auto)
    if off:
        return (
            f"with parameters on {sorted(off)}",
            "the Triton kernels run on CUDA tensors only (or under TRITON_INTERPRET=1)",
        )
    return None


def _check_fp8_base(name: str, model, why_no_kernels) -> None:
    """Refuse ``chunk_fp8='base'`` where it cannot run: the kernels off, no PEFT LoRA projection over an
    ``nn.Linear`` base, or parameters on a device without fp8 GEMMs."""
    from accelerate.utils import is_peft_model

    from chunkloss.models.lora import _lora_kind

    if why_no_kernels is not None:
        refuse(
            name,
            f"chunk_fp8='base' {why_no_kernels[0]}",
            f"its fp8 GEMMs run in the kernels ({why_no_kernels[1]})",
        )
    lora = is_peft_model(model) and any(_lora_kind(m) == "linear" for m in model.modules())
    if not lora:
        refuse(
            name, "chunk_fp8='base' without a PEFT LoRA model", "it stores a LoRA model's frozen base in fp8"
        )
    _check_fp8_devices(name, "base", model)


def _check_fp8_devices(name: str, setting: str, model) -> None:
    from chunkloss.kernels.fp8 import fp8_refusal

    for device in sorted({str(p.device) for p in model.parameters()} - {"meta"}):
        fp8_why = fp8_refusal(device)
        if fp8_why is not None:
            refuse(name, f"chunk_fp8={setting!r} with parameters on {device}", fp8_why)


def _float8_training(name: str, model, fsdp2: bool) -> None:
    """``chunk_fp8='train'``: the trained model's linear layers to torchao's float8 training
    (:func:`chunkloss.models.float8_training`; under FSDP2 its weights all-gathered in float8), refused for
    a PEFT model, without torchao and on a device without fp8 GEMMs."""
    from accelerate.utils import is_peft_model

    from chunkloss.models import float8_training

    if is_peft_model(model):
        why = "it trains every projection's weight in float8; chunk_fp8='base' is the fp8 option for LoRA"
        refuse(name, "chunk_fp8='train' with a PEFT model", why)
    _check_fp8_devices(name, "train", model)
    try:
        float8_training(model, fsdp_float8_all_gather=fsdp2)
    except ModuleNotFoundError:
        refuse(name, "chunk_fp8='train' without torchao", "pip install 'chunkloss[fp8]'")
    except ValueError as e:
        refuse(name, "chunk_fp8='train' on this model", str(e))


def apply_chunk_kernels(trainer) -> None:
    """Patch the trainer's models with ``chunkloss.models.patch(model, loss=False,
    mlp_recompute=..., mlp_tile=..., norm_recompute=...)`` as ``chunk_kernels`` says, the layer options from
    :func:`~chunkloss.trainers._long_context.layer_options`.

    Called by every chunked trainer once TRL's constructor has built and placed its models. The trained model
    is patched (a PEFT model's base model, its plain LoRA layers inside the fused calls) when:

    * ``chunk_kernels=None`` (the default) and the model is on CUDA, of a type in ``SUPPORTED_MODEL_TYPES``,
      and ``use_liger_kernel`` is off; otherwise the model keeps transformers' modules and one log line
      (``chunkloss.trainers``, WARNING) says why;
    * ``chunk_kernels=True``, or the trainer is refused with a ``ValueError`` naming ``chunk_kernels`` when
      the type is not supported, the parameters are not on CUDA (without ``TRITON_INTERPRET=1``),
      ``use_liger_kernel`` is on too (Liger patches the same modules).

    Under ``torch_compile=True`` the patched model is what gets compiled (:mod:`chunkloss.trainers._compile`):
    the kernels' custom ops are traced with the decoder layers; the chunked head runs its own loop, untraced.

    With ``chunk_fp8='base'`` the model's PEFT LoRA bases are first stored in fp8
    (:func:`chunkloss.models.quantize_base_fp8`); refused (``ValueError`` naming ``chunk_fp8``) without the
    kernels, without a PEFT LoRA model and on a device without fp8 GEMMs. With ``chunk_fp8='train'`` the
    trained model's linear layers but the LM head go to torchao's float8 training first
    (:func:`chunkloss.models.float8_training`; with or without the kernels, which then keep the row work);
    refused for a PEFT model, without torchao and on a device without fp8 GEMMs.

    The causal-LM loss is left alone: the trainer already computes it chunked. A reference model (DPO, GRPO)
    or teacher (GKD, distillation) is patched too when the kernels can take it, since its no-grad forwards get
    faster as well; one they cannot take keeps transformers' modules (named in the log line). What ``patch``
    leaves to the separate modules (a DoRA adapter, an 8-bit layer, a hook) its own log line names. The
    kernels' in-place choices (rotary on fresh q/k projections, MLP and norm backwards over buffers read by
    nothing else) hold under gradient checkpointing: a recomputed forward builds the same fresh tensors.
    """
    from chunkloss.models import patch

    name, args = type(trainer).__name__, trainer.args
    chunked = ChunkedArguments.of(args)
    setting, fp8 = chunked.chunk_kernels, chunked.chunk_fp8
    kernels = _check_settings(name, chunked, args)
    unwrap = trainer.accelerator.unwrap_model
    if fp8 == "train":  # before patching, which then leaves torchao's layers to it
        _float8_training(name, unwrap(trainer.model), fsdp2=trainer.accelerator.is_fsdp2)
    if not kernels:
        return
    options = layer_options(args)
    log = logging.getLogger("chunkloss.trainers")
    model = peft_base(unwrap(trainer.model))
    why = _why_not(model, args, auto=setting is None)
    if fp8 == "base":
        _check_fp8_base(name, unwrap(trainer.model), why)
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
    if fp8 == "base":  # before patching: its log line then counts the fp8 bases
        from chunkloss.models import quantize_base_fp8

        quantize_base_fp8(model)
    try:
        patch(model, loss=False, **options)
    except ValueError as e:  # e.g. a model class outside its family's modeling module
        refuse(name, "chunk_kernels on this model", str(e))
    kept = _patch_others(trainer, model, options, auto=setting is None)
    line = f"{name}: chunk_kernels on for the model (type {_model_type(model)!r})"
    log.log(logging.WARNING if kept else logging.INFO, "; ".join([line, *kept]))


def _check_settings(name: str, chunked: ChunkedArguments, args) -> bool:
    """Refuse bad or contradictory kernel settings (``ValueError``); False when ``chunk_kernels=False``
    leaves nothing to do."""
    setting, fp8 = chunked.chunk_kernels, chunked.chunk_fp8
    if setting not in (None, True, False):
        raise ValueError(f"chunk_kernels must be None, True or False, got {setting!r}")
    if fp8 not in FP8_SETTINGS:
        raise ValueError(f"chunk_fp8 must be None, 'base' or 'train', got {fp8!r}")
    hooks = {"chunk_kernels_norm_recompute": "its", "chunk_long_context": "activation offloading's"}
    for option, whose in hooks.items():
        if getattr(chunked, option) and args.torch_compile:
            why = f"{whose} saved-tensor hooks are not traced by torch.compile"
            refuse(name, f"{option}=True with torch_compile=True", why)
    if setting is False:
        kernel_options = {
            "chunk_kernels_mlp_recompute": chunked.chunk_kernels_mlp_recompute,
            "chunk_kernels_norm_recompute": chunked.chunk_kernels_norm_recompute,
            "chunk_kernels_mlp_tile": chunked.chunk_kernels_mlp_tile,
            "chunk_fp8": fp8 if fp8 == "base" else None,  # 'train' is torchao's GEMMs: no kernels needed
        }
        for key, value in kernel_options.items():
            if value:
                refuse(
                    name,
                    f"{key}={value!r} with chunk_kernels=False",
                    "it selects how the kernels compute and what they keep for the backward",
                )
        return False
    return True


def _patch_others(trainer, model, options: dict, auto: bool) -> list[str]:
    """Patch the trainer's reference model or teacher where the kernels take it; what each one they do not
    take keeps, for the log line."""
    from chunkloss.models import patch

    kept = []
    for attr in ("ref_model", "teacher_model"):
        other = getattr(trainer, attr, None)
        if not isinstance(other, torch.nn.Module):
            continue
        other = peft_base(trainer.accelerator.unwrap_model(other))
        if other is model:
            continue
        other_why = _why_not(other, trainer.args, auto=auto)
        if other_why is None:
            patch(other, loss=False, **options)
        else:
            kept.append(f"{attr} (type {_model_type(other)!r}) {other_why[0]} keeps transformers' modules")
    return kept
