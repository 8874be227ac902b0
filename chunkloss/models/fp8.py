"""An FP8 base for LoRA: a PEFT LoRA model's frozen projection weights stored in float8 e4m3 once, at load.

:func:`quantize_base_fp8` replaces the ``nn.Linear`` base layer of every PEFT ``lora.Linear`` at a q/k/v, o,
gate, up or down projection with a :class:`~chunkloss.kernels.fp8.Float8Linear`: the weight quantised with one
fp32 scale per output row (:class:`~chunkloss.kernels.fp8.Float8Weight`), the bias kept as it was. The fused
calls (:func:`chunkloss.models.patch`) read it as a ``Float8Weight`` and run the base's forward and
input-gradient GEMMs in fp8; the adapters, norms, embeddings and the LM head stay in the model's dtype.
"""

from __future__ import annotations

from torch import nn

from chunkloss.kernels.fp8 import Float8Linear

from .lora import _lora_kind

__all__ = ["quantize_base_fp8"]

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_base_fp8(model: nn.Module) -> int:
    """Store the frozen base weights of ``model``'s PEFT LoRA projections in float8, once.

    Every PEFT ``lora.Linear`` at a q/k/v, o, gate, up or down projection whose base layer is a plain
    ``nn.Linear`` with a frozen weight gets a :class:`~chunkloss.kernels.fp8.Float8Linear` base instead (each
    weight quantised with one fp32 scale per output row, the bias kept); the 16-bit weights are released.
    Call it after ``get_peft_model`` and before training; a layer already in fp8 is left as it is.
    Projections without a LoRA adapter keep their weights.

    Returns:
        The number of base layers now in fp8 (those quantised by this call and before).

    Raises:
        ValueError: ``model`` has no PEFT LoRA projection over a plain ``nn.Linear`` (a 4-bit or 8-bit base,
            or no PEFT LoRA model), or such a base weight requires grad (it would be trained).
        RuntimeError: the weights' device or this torch has no fp8 GEMM (CUDA below compute capability 8.9).
    """
    targets = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in _PROJECTIONS or _lora_kind(module) != "linear":
            continue
        base = module.base_layer
        if type(base) is Float8Linear:
            targets.append((module, None))
        elif type(base) is nn.Linear:
            if base.weight.requires_grad:
                raise ValueError(
                    f"quantize_base_fp8: {name}'s base weight requires grad; an fp8 base is for LoRA on a "
                    "frozen model"
                )
            targets.append((module, base))
    if not targets:
        raise ValueError(
            f"quantize_base_fp8: {type(model).__name__} has no PEFT LoRA projection (q/k/v, o, gate, up, "
            "down) over an nn.Linear base; an fp8 base is for a PEFT LoRA model"
        )
    for module, base in targets:
        if base is not None:
            module.base_layer = Float8Linear.from_linear(base)
    return len(targets)
