"""What a q/k/v, o, gate, up or down projection computes, read off the module, for the fused kernels.

A projection is fused when it is an ``nn.Linear`` (``F.linear(x, weight, bias)``) or a PEFT LoRA ``Linear``
whose forward is ``base(x) + scaling · lora_B(lora_A(dropout(x)))`` with one active, unmerged, plain adapter
(no DoRA or other variant, no ``lora_bias``, not ``fan_in_fan_out``) over an ``nn.Linear`` base; a LoRA layer
whose adapters are disabled, or none of whose adapters is active, computes its base layer alone. Anything
else (a quantised base, DoRA, several active adapters, a merged adapter, another PEFT tuner, a module with a
hook other than FSDP2's and DeepSpeed's) runs its own forward; :func:`why_not_fused` says why, for the one log
line ``patch`` writes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from chunkloss.kernels.lora import LoraAdapter

from .hooks import gathering_hooks_only

__all__ = ["Projection", "projection", "why_not_fused"]


@dataclass(frozen=True)
class Projection:
    """``F.linear(x, weight, bias)``, plus ``adapter``'s update when it is not None."""

    weight: torch.Tensor  # (out, in)
    bias: torch.Tensor | None  # (out,)
    adapter: LoraAdapter | None = None


def _fusable_hooks(module: nn.Module) -> bool:
    """No hooks on ``module`` or under it but FSDP2's and DeepSpeed's, which gather parameters: the fused
    calls run inside the forwards of the modules they read (:mod:`chunkloss.models.hooks`). Another hook
    (accelerate's offload, a user's) expects the module's own forward."""
    return all(gathering_hooks_only(m) for m in module.modules())


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and gathering_hooks_only(module)


def _lora_linear_class():
    """PEFT's LoRA ``Linear``, or None when PEFT was never imported (then no module is one)."""
    return getattr(sys.modules.get("peft.tuners.lora.layer"), "Linear", None)


def _active(module) -> list[str]:
    return [name for name in module.active_adapters if name in module.lora_A]


def _lora_refusal(module) -> str | None:
    """Why a PEFT LoRA Linear cannot run as :class:`Projection`, or None when it can."""
    if not _fusable_hooks(module):
        return "a hook on the LoRA layer"
    if not _plain_linear(module.base_layer):
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
    lora = _lora_linear_class()
    if lora is None or type(module) is not lora or _lora_refusal(module) is not None:
        return None
    base = module.base_layer
    active = [] if module.disable_adapters else _active(module)
    if not active:
        return Projection(base.weight, base.bias)
    name = active[0]
    dropout = module.lora_dropout[name]
    p = dropout.p if type(dropout) is nn.Dropout and dropout.training else 0.0
    a, b = module.lora_A[name].weight, module.lora_B[name].weight
    adapter = LoraAdapter(a, b, float(module.scaling[name]), p)
    return Projection(base.weight, base.bias, adapter)


def why_not_fused(module: nn.Module) -> str | None:
    """Why ``module`` runs its own forward (:func:`projection` is None), in a few words; None when fused."""
    if _plain_linear(module):
        return None
    if type(module) is nn.Linear:
        return "a hook"
    lora = _lora_linear_class()
    if lora is not None and type(module) is lora:
        return _lora_refusal(module)
    return type(module).__name__
