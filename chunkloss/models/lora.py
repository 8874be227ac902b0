"""What a q/k/v, o, gate, up or down projection computes, read off the module, for the fused kernels.

A projection is fused when it is an ``nn.Linear`` (``F.linear(x, weight, bias)``) or a PEFT LoRA ``Linear``
whose forward is ``base(x) + scaling · lora_B(lora_A(dropout(x)))`` with one active, unmerged, plain adapter
(no DoRA or other variant, no ``lora_bias``, not ``fan_in_fan_out``) over an ``nn.Linear`` base; a LoRA layer
whose adapters are disabled, or none of whose adapters is active, computes its base layer alone.

QLoRA: PEFT's ``Linear4bit`` (``peft/tuners/lora/bnb.py``) over a bitsandbytes ``Linear4bit`` base (nf4 or
fp4, with or without double quantisation, with or without a bias) is fused the same way: its weight becomes a
:class:`~chunkloss.kernels.frozen.FrozenWeight` that loads
``bitsandbytes.functional.dequantize_4bit(weight.data, weight.quant_state)`` in the layer's compute dtype
for each GEMM, and its adapter adds as that class does (``cast_before_add``). bitsandbytes computes the base
in its compute dtype whatever the input's dtype or autocast: the fused calls take a 4-bit base where that is
the dtype they compute in (``computes_as_is``). A 4-bit base is fused only unhooked and unsharded: under
FSDP2 or ZeRO-3 (whose gathering does not keep its ``quant_state``) it runs its own forward.

FP8 base: a PEFT ``lora.Linear`` whose base is a :class:`~chunkloss.kernels.fp8.Float8Linear`
(:func:`~chunkloss.models.fp8.quantize_base_fp8`) is fused the same way, its weight a
:class:`~chunkloss.kernels.fp8.Float8Weight` in the dtype it was quantised from (``computes_as_is`` as for a
4-bit base); elsewhere it runs its own forward, which computes the same fp8 products.

Anything else (an 8-bit or other quantised base, DoRA, several active adapters, a merged adapter, another
PEFT tuner, a module with a hook other than FSDP2's and DeepSpeed's) runs its own forward;
:func:`why_not_fused` says why, for the one log line ``patch`` writes. bitsandbytes is never imported here: a
module is one of its layers only when it was.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from chunkloss._compat import accelerate as accelerate_compat
from chunkloss._compat import torch as torch_compat
from chunkloss.kernels.fp8 import Float8Linear
from chunkloss.kernels.frozen import FrozenWeight
from chunkloss.kernels.lora import LoraAdapter

from .hooks import gathering_hooks_only

__all__ = ["Projection", "projection", "why_not_fused", "computes_as_is"]

QUANT_TYPES_4BIT = ("nf4", "fp4")  # bitsandbytes' 4-bit data types, both dequantised by dequantize_4bit


@dataclass(frozen=True)
class Projection:
    """``F.linear(x, weight, bias)``, plus ``adapter``'s update when it is not None."""

    weight: (
        torch.Tensor | FrozenWeight
    )  # (out, in); a 4-bit base's dequantisation, loaded per GEMM; an fp8 base
    bias: torch.Tensor | None  # (out,)
    adapter: LoraAdapter | None = None


def _fusable_hooks(module: nn.Module) -> bool:
    """No hooks on ``module`` or under it but FSDP2's and DeepSpeed's, which gather parameters: the fused
    calls run inside the forwards of the modules they read (:mod:`chunkloss.models.hooks`). Another hook
    (accelerate's offload, a user's) expects the module's own forward."""
    return all(gathering_hooks_only(m) for m in module.modules())


def _unhooked(module: nn.Module) -> bool:
    """No hook at all, FSDP2's and DeepSpeed's included: a 4-bit base is dequantised only as it is."""
    return not torch_compat.forward_hooks(module) and not accelerate_compat.has_hf_hook(module)


def _sharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is an FSDP2 shard (a DTensor) or a ZeRO-3 partition (``ds_id``)."""
    dtensor = _class("torch.distributed.tensor", "DTensor")
    return (dtensor is not None and isinstance(weight, dtensor)) or hasattr(weight, "ds_id")


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and gathering_hooks_only(module)


def _fp8_linear(module: nn.Module) -> bool:
    return type(module) is Float8Linear and gathering_hooks_only(module)


def _class(module: str, name: str):
    """``module.name`` when that module was imported (else no object is an instance of it), or None."""
    return getattr(sys.modules.get(module), name, None)


def _lora_linear_class():
    """PEFT's LoRA ``Linear``, or None when PEFT was never imported (then no module is one)."""
    return _class("peft.tuners.lora.layer", "Linear")


def _lora_kind(module: nn.Module) -> str | None:
    """``"linear"`` for PEFT's LoRA ``Linear``, ``"4bit"`` / ``"8bit"`` for its bitsandbytes layers, else
    None."""
    kinds = {
        "linear": _lora_linear_class(),
        "4bit": _class("peft.tuners.lora.bnb", "Linear4bit"),
        "8bit": _class("peft.tuners.lora.bnb", "Linear8bitLt"),
    }
    return next((kind for kind, cls in kinds.items() if cls is not None and type(module) is cls), None)


def _is_4bit_linear(module: nn.Module) -> bool:
    """A bitsandbytes ``Linear4bit`` (``LinearNF4`` and ``LinearFP4`` only preset its quant type)."""
    names = ("Linear4bit", "LinearNF4", "LinearFP4")
    return any(type(module) is _class("bitsandbytes.nn.modules", name) for name in names)


def _4bit_refusal(base: nn.Module) -> str | None:
    """Why a 4-bit base cannot be dequantised for the kernels, or None when it can."""
    if not _is_4bit_linear(base):
        return f"its base layer is {type(base).__name__}"
    if not _unhooked(base):
        return "a hook on its 4-bit base layer"
    if _sharded(base.weight):
        return "its 4-bit weight sharded by FSDP2 or ZeRO-3"
    state = getattr(base.weight, "quant_state", None)
    if state is None:
        return "its 4-bit weight has no quant_state (not quantised yet)"
    if state.quant_type not in QUANT_TYPES_4BIT:
        return f"4-bit quant type {state.quant_type!r} (not {' or '.join(QUANT_TYPES_4BIT)})"
    if getattr(state, "packing_format_for_cpu", False):
        return "its 4-bit weight in bitsandbytes' CPU inference packing"
    if base.compute_dtype is None:
        return "a 4-bit base without a compute dtype"
    return None


def _dequantized(base: nn.Module) -> FrozenWeight:
    """A 4-bit base's weight as its forward and backward dequantise it, in the layer's compute dtype."""
    from bitsandbytes.functional import dequantize_4bit  # imported already: base is one of its layers

    weight, dtype = base.weight, base.compute_dtype

    def load() -> torch.Tensor:
        return dequantize_4bit(weight.data, weight.quant_state).to(dtype)

    return FrozenWeight(load, tuple(weight.quant_state.shape), dtype, weight.device)


def _base(module: nn.Module, kind: str) -> tuple[torch.Tensor | FrozenWeight, torch.Tensor | None]:
    """The LoRA layer's base weight and bias as its base layer computes with them."""
    base = module.base_layer
    if type(base) is Float8Linear:
        return base.frozen_weight(), base.bias
    if kind != "4bit":
        return base.weight, base.bias
    weight, bias = _dequantized(base), base.bias
    if bias is not None and bias.dtype != weight.dtype:  # Linear4bit casts its bias to the compute dtype
        bias = bias.to(weight.dtype)
    return weight, bias


def computes_as_is(part: Projection, x: torch.Tensor) -> bool:
    """Whether a fused call on ``x`` computes ``part`` as its module does: always, but for a 4-bit base, which
    computes in its compute dtype whatever ``x``'s dtype or autocast (bitsandbytes casts ``x`` to it and the
    output back); the kernels take it where ``x`` is in that dtype and autocast, if on, would not cast."""
    if not isinstance(part.weight, FrozenWeight):
        return True
    dtype, device = part.weight.dtype, x.device.type
    autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != dtype
    return x.dtype == dtype and not autocast


def _active(module) -> list[str]:
    return [name for name in module.active_adapters if name in module.lora_A]


def _lora_refusal(module, kind: str) -> str | None:
    """Why a PEFT LoRA Linear (or Linear4bit) cannot run as :class:`Projection`, or None when it can."""
    if not _fusable_hooks(module):
        return "a hook on the LoRA layer"
    if kind == "8bit":
        return "an 8-bit base: bitsandbytes Linear8bitLt"
    if kind == "4bit":
        why = _4bit_refusal(module.base_layer)
        if why is not None:
            return why
    elif not _plain_linear(module.base_layer) and not _fp8_linear(module.base_layer):
        return f"its base layer is {type(module.base_layer).__name__}"
    if module.disable_adapters and not module.merged:
        return None  # the base layer alone
    if module.merged:
        return "a merged adapter"
    active = _active(module)
    if len(active) > 1:
        return f"{len(active)} active adapters"
    if not active:
        return None
    name = active[0]
    if name in getattr(module, "lora_variant", {}):
        variant = type(module.lora_variant[name]).__name__.removesuffix("LinearVariant")
        return f"a {variant or 'variant'} adapter"
    if module.fan_in_fan_out:
        return "fan_in_fan_out"
    a, b = module.lora_A[name], module.lora_B[name]
    if type(a) is not nn.Linear or type(b) is not nn.Linear or b.bias is not None or a.bias is not None:
        return "lora_bias or non-linear adapter weights"
    dropout = module.lora_dropout[name]
    if type(dropout) not in (nn.Identity, nn.Dropout):
        return f"its dropout is {type(dropout).__name__}"
    return None


def projection(module: nn.Module) -> Projection | None:
    """What ``module(x)`` computes as a :class:`Projection`, or None when it must run its own forward.

    Read at each call: adapters are switched (``disable_adapter()``, ``set_adapter``), merged and unmerged
    between calls.
    """
    if _plain_linear(module):
        return Projection(module.weight, module.bias)
    kind = _lora_kind(module)
    if kind is None or _lora_refusal(module, kind) is not None:
        return None
    weight, bias = _base(module, kind)
    active = [] if module.disable_adapters else _active(module)
    if not active:
        return Projection(weight, bias)
    name = active[0]
    dropout = module.lora_dropout[name]
    p = dropout.p if type(dropout) is nn.Dropout and dropout.training else 0.0
    a, b = module.lora_A[name].weight, module.lora_B[name].weight
    adapter = LoraAdapter(a, b, float(module.scaling[name]), p, cast_before_add=kind == "4bit")
    return Projection(weight, bias, adapter)


def on_4bit_base(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA layer over a bitsandbytes 4-bit base."""
    return _lora_kind(module) == "4bit"


def on_fp8_base(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA layer over a :class:`~chunkloss.kernels.fp8.Float8Linear` base."""
    return _lora_kind(module) == "linear" and type(module.base_layer) is Float8Linear


def why_not_fused(module: nn.Module, dtype: torch.dtype | None = None) -> str | None:
    """Why ``module`` runs its own forward (:func:`projection` is None), in a few words; None when fused.

    With ``dtype``, the model's (its hidden states'), a 4-bit base whose compute dtype differs is named too:
    the fused calls leave it to its own forward at every call (:func:`computes_as_is`)."""
    if _plain_linear(module):
        return None
    if type(module) is nn.Linear:
        return "a hook"
    kind = _lora_kind(module)
    if kind is None:
        return type(module).__name__
    why = _lora_refusal(module, kind)
    if why is None and kind == "4bit" and dtype is not None and module.base_layer.compute_dtype != dtype:
        why = f"4-bit compute dtype {module.base_layer.compute_dtype} on a {dtype} model"
    if why is None and on_fp8_base(module) and dtype is not None and module.base_layer.dtype != dtype:
        why = f"fp8 base quantised from {module.base_layer.dtype} on a {dtype} model"
    return why
