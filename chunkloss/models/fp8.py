"""FP8 GEMMs for training: a frozen FP8 base for LoRA, and torchao's float8 training for full fine-tuning.

An FP8 base for LoRA: a PEFT LoRA model's frozen projection weights stored in float8 e4m3 once, at load.

:func:`quantize_base_fp8` replaces the ``nn.Linear`` base layer of every PEFT ``lora.Linear`` at a q/k/v, o,
gate, up or down projection with a :class:`~chunkloss.kernels.fp8.Float8Linear`: the weight quantised with one
fp32 scale per output row (:class:`~chunkloss.kernels.fp8.Float8Weight`), the bias kept as it was. The fused
calls (:func:`chunkloss.models.patch`) read it as a ``Float8Weight`` and run the base's forward and
input-gradient GEMMs in fp8; the adapters, norms, embeddings and the LM head stay in the model's dtype.

Full fine-tuning: :func:`float8_training` hands the decoder's linear layers to torchao's float8 training
(``torchao.float8.convert_to_float8_training``), whose ``Float8Linear`` casts each GEMM's operands to float8
with dynamic scales, all three GEMMs of a layer (forward, input and weight gradients). ``patch`` then keeps
those layers as modules of their own and runs the rest on the kernels (norms, RoPE, the gating); the LM head
stays in the model's dtype for the chunked loss.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from chunkloss.kernels.fp8 import Float8Linear

from .lora import _lora_kind

__all__ = ["FLOAT8_RECIPES", "float8_training", "quantize_base_fp8"]

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


#: torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``): one scale per tensor, one per
#: row, or one per row with the weight gradient's GEMM kept in high precision.
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def float8_training(
    model: nn.Module, recipe: str = "tensorwise", fsdp_float8_all_gather: bool = False
) -> int:
    """Train ``model``'s linear layers in float8 through torchao (``convert_to_float8_training``).

    Every ``nn.Linear`` whose sides are multiples of 16 (what the fp8 GEMM takes) becomes torchao's
    ``Float8Linear``, except the output embedding, which the chunked loss reads as a weight. Call it before
    :func:`~chunkloss.models.patch` (which then leaves those layers to torchao) and before sharding. With
    ``fsdp_float8_all_gather`` (the ``tensorwise`` recipe only) FSDP2 all-gathers those weights already cast
    to float8, one byte per weight (torchao's ``enable_fsdp_float8_all_gather``).

    Returns:
        The number of layers converted.

    Raises:
        ModuleNotFoundError: torchao is not installed.
        ValueError: ``recipe`` is not one of :data:`FLOAT8_RECIPES` (or not ``tensorwise`` with
            ``fsdp_float8_all_gather``), or no layer can be converted.
    """
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8_training: recipe must be one of {FLOAT8_RECIPES}, got {recipe!r}")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"float8_training: float8 all-gathers need the tensorwise recipe, got {recipe!r}")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ModuleNotFoundError("float8_training needs torchao (pip install 'chunkloss[fp8]')") from e
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    chosen = []

    def take(module: nn.Module, fqn: str) -> bool:
        ok = (
            type(module) is nn.Linear
            and module is not head
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )
        if ok:
            chosen.append(fqn)
        return ok

    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=take)
    if not chosen:
        raise ValueError(
            f"float8_training: {type(model).__name__} has no nn.Linear with sides that are multiples of 16 "
            "besides its output embedding"
        )
    return len(chosen)
