"""One call that makes a ``transformers`` causal LM run on chunkloss's kernels.

``patch(model)`` gives the modules of a Llama, Mistral, Qwen2, Qwen3, Gemma or Gemma-2 model the forwards
written out in :mod:`chunkloss.models.layers` (each module's class becomes a subclass of its own, of the same
name):

* every RMSNorm runs :func:`~chunkloss.kernels.rms_norm` (Gemma: ``1 + w`` in fp32);
* every attention module runs its q/k/v projections, :func:`~chunkloss.kernels.apply_rotary_pos_emb` (q and k
  rotated in place), the cache, transformers' attention interface and ``o_proj``;
* with ``attention=True`` (the default; not Qwen3, which normalises q and k per head before RoPE), each
  decoder layer runs its input RMSNorm, q/k/v projections and RoPE as one
  :func:`~chunkloss.kernels.attention_input` call;
* with ``norm_recompute=True``, every decoder layer keeps no output of its pre-norms (the input /
  post-attention / pre-feedforward RMSNorm) for the backward; the projections that read them get them back by
  running the norm kernel again (:mod:`chunkloss.models.saved_norms`);
* every gated MLP runs :func:`~chunkloss.kernels.gated_mlp`: one autograd Function that keeps the MLP's input
  and its gate and up pre-activations but not the gated product (recomputed in the backward), or with
  ``mlp_recompute=True`` the input only (the backward replays the gate and up GEMMs);
* a q/k/v, o, gate, up or down projection that is a PEFT LoRA layer with one active plain adapter runs inside
  those fused calls with its adapter (:mod:`chunkloss.models.lora`) where the LoRA kernels are installed; over
  a bitsandbytes 4-bit base (QLoRA) too, its weight dequantised for each GEMM and never saved; over an fp8
  base (:func:`~chunkloss.models.fp8.quantize_base_fp8`) with the base's GEMMs in fp8;
* the causal-LM forward, when called with ``labels``, feeds the final hidden states straight into
  ``chunkloss.FusedLinearCrossEntropyLoss``: the (tokens x vocab) logits are never materialised and the
  output's ``logits`` is ``None``. Without labels the model's own forward runs and returns logits as usual.

What runs fused is decided at each call: a projection that is neither an ``nn.Linear`` nor a plain LoRA layer
(DoRA, several active adapters, a merged adapter, an 8-bit base), a module with a hook other than FSDP2's and
DeepSpeed ZeRO-3's (accelerate's offload, a user's), fp32 weights under bf16 autocast, or a 4-bit base whose
compute dtype is not the one the call computes in (or that is hooked or sharded) run the separate modules (the
norm, RoPE and gating kernels still), which compute the same values. Under FSDP2's and ZeRO-3's hooks a fused
call runs inside the forwards of the modules whose weights it reads (:mod:`chunkloss.models.hooks`), so that
their hooks gather those weights for it and for its backward. ``patch`` logs one line saying what runs fused
and what does not, and why.

Only this model's modules change; other models of the same family in the process keep transformers' code.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter

import torch
from torch import nn

from chunkloss._compat import transformers as transformers_compat

from .layers import (
    Gemma2Attention,
    MistralAttention,
    PatchedAttention,
    PatchedGatedMLP,
    PatchedLayerOptions,
    PatchedMLPOptions,
    PatchedNormOptions,
    PatchedRMSNorm,
    PreNormLayer,
    Qwen3Attention,
    SandwichLayer,
    SlidingWindowAttention,
)
from .lora import on_4bit_base, on_fp8_base, why_not_fused

logger = logging.getLogger("chunkloss.models")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
          "gemma2": "Gemma2"}  # fmt: skip
# model type -> (attention forward, decoder-layer forward)
_FAMILIES = {
    "llama": (PatchedAttention, PreNormLayer),
    "mistral": (MistralAttention, PreNormLayer),
    "qwen2": (SlidingWindowAttention, PreNormLayer),
    "qwen3": (Qwen3Attention, PreNormLayer),
    "gemma": (PatchedAttention, PreNormLayer),
    "gemma2": (Gemma2Attention, SandwichLayer),
}
_GEMMA_TYPES = ("gemma", "gemma2")
_PRE_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _norm_in_place_safe(name: str, model_type: str) -> bool:
    """Norms whose output only feeds linear layers, so their incoming gradient is a fresh tensor.

    Gemma-2's post-attention / post-feedforward norms feed the residual add, whose backward hands the same
    gradient tensor to both branches: overwriting it would corrupt the residual's gradient.
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("input_layernorm", "pre_feedforward_layernorm"):
        return True
    return leaf == "post_attention_layernorm" and model_type != "gemma2"


def _mlp_activation(mlp: nn.Module) -> str | None:
    """The kernels' name of the MLP's activation, by its class name; None when no kernel has it."""
    name = type(mlp.act_fn).__name__
    classes = transformers_compat.ACTIVATION_CLASSES
    return next((kind for kind, names in classes.items() if name in names), None)


def _base_class(module: nn.Module) -> type:
    """The module's class before :func:`_install` (its own, if never patched)."""
    return vars(type(module)).get("_chunkloss_base", type(module))


_CLASSES: dict[tuple[type, type], type] = {}


def _install(module: nn.Module, forward: type | None, attr: str | None = None, options=None) -> None:
    """Make ``module`` an instance of ``forward`` + its own class (same name and module), or of its own class
    again when ``forward`` is None; ``options`` becomes the attribute ``attr`` the forward reads."""
    base = _base_class(module)
    if forward is None:
        module.__class__ = base
    else:
        key = (base, forward)
        if key not in _CLASSES:
            _CLASSES[key] = type(
                base.__name__,
                (forward, base),
                {
                    "_chunkloss_base": base,
                    "__module__": base.__module__,
                    "__qualname__": base.__qualname__,
                },
            )
        module.__class__ = _CLASSES[key]
    if attr is not None:
        if forward is None:
            module.__dict__.pop(attr, None)
        else:
            setattr(module, attr, options)


def devices_off_kernels(model: nn.Module, *, interpreter: bool = True) -> set[str]:
    """Device types of ``model``'s parameters that the Triton kernels cannot take: all but CUDA, or none
    where ``interpreter`` and ``TRITON_INTERPRET=1`` (the interpreter runs them on the CPU, for tests).
    ``meta`` parameters are materialised elsewhere (offload)."""
    if interpreter and os.environ.get("TRITON_INTERPRET") == "1":
        return set()
    return {p.device.type for p in model.parameters()} - {"cuda", "meta"}


def _check_device(model: nn.Module) -> None:
    off = sorted(devices_off_kernels(model))
    if off:
        raise ValueError(
            f"chunkloss.models.patch: the model's parameters are on {off}; the Triton kernels run on CUDA "
            "tensors only (or on CPU with TRITON_INTERPRET=1 set before importing chunkloss). Move the model "
            "to CUDA first."
        )


class ChunkedLossForCausalLM:
    """``XForCausalLM.forward`` whose loss, with ``labels``, skips the logits; see :func:`patch`."""

    chunkloss_loss_options: dict

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        if labels is None:
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return_dict = kwargs.pop("return_dict", None)
        shift_labels = kwargs.pop("shift_labels", None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden = hidden[:, keep, :]
        if shift_labels is None:
            # As transformers' ForCausalLMLoss: position t predicts token t + 1, the last one nothing.
            shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        ce = self.chunkloss_cross_entropy()
        loss = ce(
            hidden,
            self.lm_head.weight,
            shift_labels.to(hidden.device),
            bias=self.lm_head.bias,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
        )
        cache = transformers_compat.OUTPUT_CACHE_FIELD  # past_key_values before transformers 5.24
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{cache: getattr(outputs, cache, None)},
        )
        if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
            return out.to_tuple()
        return out

    def chunkloss_cross_entropy(self):
        """The loss, kept across calls (it holds its compiled per-chunk step); Gemma-2's
        ``final_logit_softcapping`` read at each call, as transformers does."""
        from chunkloss import FusedLinearCrossEntropyLoss

        softcap = getattr(self.config, "final_logit_softcapping", None)
        cached = self.__dict__.get("_chunkloss_ce")
        if cached is None or cached[0] != softcap:
            options = self.chunkloss_loss_options
            ce = FusedLinearCrossEntropyLoss(ignore_index=-100, softcap=softcap, **options)
            self._chunkloss_ce = cached = (softcap, ce)
        return cached[1]


def _peft_tuner(module: nn.Module) -> str | None:
    """``"lora"``, ``"ia3"``, ... for a PEFT tuner layer, else None."""
    parts = type(module).__module__.split(".")
    return parts[2] if parts[:2] == ["peft", "tuners"] and len(parts) > 2 else None


def _summary(model: nn.Module, fused: Counter) -> tuple[str, bool]:
    """The log line: what runs fused, what does not and why; and whether anything falls back."""
    reasons: Counter = Counter()
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else None  # the hidden states' dtype
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _PROJECTIONS:
            why, tuner = why_not_fused(module, dtype), _peft_tuner(module)
            if why is None and tuner == "lora":
                kind = "QLoRA projections (4-bit base)" if on_4bit_base(module) else "LoRA projections"
                fused["LoRA projections (fp8 base)" if on_fp8_base(module) else kind] += 1
            elif why is not None:
                reasons[f"{leaf} ({f'{tuner} ' if tuner and tuner != 'lora' else ''}{why})"] += 1
        elif leaf in ("embed_tokens", "lm_head") and _peft_tuner(module):
            reasons[f"{leaf} ({_peft_tuner(module)} adapter: PEFT's forward)"] += 1
    runs = [f"{n} {what}" for what, n in fused.items() if n]
    line = f"chunkloss.models.patch({type(model).__name__}): fused: {', '.join(runs) or 'nothing'}"
    if reasons:
        line += "; separate: " + ", ".join(f"{what} x{n}" for what, n in sorted(reasons.items()))
    return line, bool(reasons)


def patch(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    mlp: bool = True,
    loss: bool = True,
    loss_options: dict | None = None,
    mlp_recompute: bool = False,
    norm_recompute: bool = False,
    attention: bool = True,
    mlp_tile: int | None = None,
) -> nn.Module:
    """Make a transformers Llama / Mistral / Qwen2 / Qwen3 / Gemma / Gemma-2 model use chunkloss's kernels.

    Patching again replaces the earlier options (``attention=False`` after ``attention=True`` puts the
    separate norm and projections back); a copy (``copy.deepcopy``) of a patched model is patched the same way
    and reads its own weights.

    Args:
        model: an ``XForCausalLM``, the bare ``XModel`` (then ``loss`` does nothing), or a PEFT model
            wrapping either (its base model is patched; see the module docstring for LoRA layers).
        rms_norm: every RMSNorm on the kernel (including Qwen3's per-head q/k norms).
        rope: the attention modules' rotary embedding on the kernel; False keeps the family's
            ``apply_rotary_pos_emb``.
        mlp: every gated MLP fused. An MLP whose activation has no kernel keeps transformers' code, with a
            warning naming it.
        loss: with ``labels``, compute the causal-LM loss through ``chunkloss.FusedLinearCrossEntropyLoss``
            without logits; the output's ``logits`` is then ``None``. Gemma-2's ``final_logit_softcapping``
            is passed to the loss as ``softcap``.
        loss_options: extra keyword options for ``FusedLinearCrossEntropyLoss`` (e.g. ``{"compile": False}``).
        mlp_recompute: the fused MLP saves only its input and replays the gate/up GEMM in the backward
            (least memory, one more GEMM); False (the default) saves the gate and up pre-activations too
            (2·I more elements per token, no replayed GEMM, faster). docs/design.md has the measurement.
        norm_recompute: the decoder layers do not keep their pre-norms' outputs for the backward (H elements
            per token for each of the two norms before the attention and the MLP); the backward runs those
            norms again, once each. Needs ``rms_norm``; a layer run under gradient checkpointing is left as
            it is. Not for a model compiled with ``torch.compile`` (saved-tensor hooks).
        attention: with ``rms_norm`` and ``rope``, run each layer's input norm, q/k/v projections and RoPE as
            one :func:`~chunkloss.kernels.attention_input` call (one GEMM over the concatenated weights).
        mlp_tile: tokens per tile of the fused MLP (``gated_mlp(..., tile=)``): its (tokens, I) intermediates
            exist for one tile at a time, in the forward, a checkpoint's recompute and the backward. None (the
            default): one call over all tokens. With ``mlp_recompute``, what an MLP adds to a layer's memory
            no longer grows with the sequence; for long sequences.

    Returns:
        ``model`` (the object passed in), patched in place.

    Raises:
        ValueError: the model's ``config.model_type`` is not one of ``SUPPORTED_MODEL_TYPES``, or its
            parameters are on a device other than CUDA while ``TRITON_INTERPRET=1`` is not set.
    """
    wrapper, model = model, model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"chunkloss.models.patch supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"got {model_type!r} ({type(model).__name__})."
        )
    if norm_recompute and not rms_norm:
        raise ValueError("chunkloss.models.patch: norm_recompute=True needs rms_norm=True")
    if mlp_tile is not None and (type(mlp_tile) is not int or mlp_tile <= 0):
        raise ValueError(f"chunkloss.models.patch: mlp_tile must be a positive int or None, got {mlp_tile!r}")
    _check_device(model)
    family = _NAMES[model_type]
    gemma = model_type in _GEMMA_TYPES
    attention_forward, layer_forward = _FAMILIES[model_type]
    fuse = attention and rms_norm and rope and attention_forward.takes_attention_input
    fused: Counter = Counter()
    for name, module in model.named_modules():
        cls = _base_class(module).__name__
        if cls == f"{family}RMSNorm":
            options = PatchedNormOptions(
                eps=getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)),
                offset=1.0 if gemma else 0.0,
                casting="gemma" if gemma else "llama",
                in_place=_norm_in_place_safe(name, model_type),
                offer=norm_recompute and name.rsplit(".", 1)[-1] in _PRE_NORMS,
            )
            _install(module, PatchedRMSNorm if rms_norm else None, "chunkloss_norm", options)
            fused["norms"] += rms_norm
        elif cls == f"{family}MLP":
            activation = _mlp_activation(module) if mlp else None
            if mlp and activation is None:
                warnings.warn(
                    f"chunkloss: {name} uses {type(module.act_fn).__name__}, left unpatched", stacklevel=2
                )
            _install(
                module,
                PatchedGatedMLP if activation else None,
                "chunkloss_mlp",
                PatchedMLPOptions(activation, mlp_recompute, mlp_tile),
            )
            fused["MLPs"] += activation is not None
        elif cls == f"{family}Attention":
            _install(module, attention_forward if rope else None)
            fused["RoPE"] += rope
        elif cls == f"{family}DecoderLayer":
            _install(
                module,
                layer_forward if fuse or norm_recompute else None,
                "chunkloss_layer",
                PatchedLayerOptions(fuse, norm_recompute),
            )
            fused["attention inputs"] += fuse
    if loss and hasattr(model, "lm_head") and hasattr(model, "model"):
        _install(model, ChunkedLossForCausalLM, "chunkloss_loss_options", dict(loss_options or {}))
        model.__dict__.pop("_chunkloss_ce", None)
        fused["chunked CE"] = 1
    elif isinstance(model, ChunkedLossForCausalLM):
        _install(model, None, "chunkloss_loss_options")
    line, falls_back = _summary(model, fused)
    logger.log(logging.WARNING if falls_back else logging.INFO, line)
    return wrapper


__all__ = ["SUPPORTED_MODEL_TYPES", "patch"]
