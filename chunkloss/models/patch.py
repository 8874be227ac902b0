"""One call that makes a ``transformers`` causal LM run on chunkloss's kernels.

``patch(model)`` swaps, on a Llama, Mistral, Qwen2, Qwen3, Gemma or Gemma-2 model:

* every RMSNorm module's forward for :func:`~chunkloss.kernels.rms_norm` (Gemma: ``1 + w`` in fp32);
* the family's ``apply_rotary_pos_emb`` for the Triton one (q and k rotated in place);
* with ``attention=True`` (the default; not Qwen3, which normalises q and k per head before RoPE), each
  decoder layer's input RMSNorm, q/k/v projections and RoPE for one
  :func:`~chunkloss.kernels.attention_input` call run by the attention module: the layer's
  ``input_layernorm`` then passes its input through, and transformers' attention forward (cache,
  attention, ``o_proj``) receives the rotated q, k and v as its projections' outputs. Per call, a layer
  whose q/k/v projections are not plain ``nn.Linear`` modules, whose norm or projections have hooks, or
  whose dtypes autocast would change runs the norm kernel and transformers' attention instead;
* with ``norm_recompute=True``, every decoder layer's forward for one that does not keep its pre-norms'
  outputs (the input / post-attention / pre-feedforward RMSNorm) for the backward; the projections that read
  them get them back by running the norm kernel again (:mod:`chunkloss.models.saved_norms`);
* every gated MLP for :func:`~chunkloss.kernels.mlp.gated_mlp`: one autograd Function that keeps the
  MLP's input and its gate and up pre-activations but not the gated product (recomputed in the backward), or
  with ``mlp_recompute=True`` the input only (the backward replays the gate and up GEMMs).
  An MLP whose projections are not plain ``nn.Linear`` modules (PEFT/LoRA layers, quantised linears, or
  linears with forward hooks) keeps its projections, checked at every call, and only its
  ``act(gate) * up`` runs on :func:`~chunkloss.kernels.swiglu` / :func:`~chunkloss.kernels.geglu`;
* the causal-LM forward, when called with ``labels``, for one that feeds the final hidden states straight
  into ``chunkloss.FusedLinearCrossEntropyLoss``: the (tokens x vocab) logits are never materialised and the
  output's ``logits`` is ``None``. Without labels the original forward runs and returns logits as usual.

Norms, MLPs and the loss are patched on this model's modules only. Rotary embedding is a module-level
function in transformers, so it is replaced in the family's modeling module and applies to every model of
that family in the process (the result is the same up to rounding); ``unpatch_rotary`` puts transformers'
function back.
"""

import functools
import os
import sys
import types
import warnings

import torch
from torch import nn

from chunkloss.kernels import glu as _glu
from chunkloss.kernels import mlp as _mlp
from chunkloss.kernels import rms_norm as _rms
from chunkloss.kernels import rope as _rope
from chunkloss.kernels.attention_input import attention_input, autocast_changes_dtype

from . import saved_norms as _saved

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
_GEMMA_TYPES = ("gemma", "gemma2")
_RMSNORM_CLASSES = {f"{name}RMSNorm" for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2")}
_MLP_CLASSES = {f"{name}MLP" for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2")}
_PRE_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")
_LAYER_CLASSES = {f"{name}DecoderLayer" for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2")}
# Attention modules whose input norm, projections and RoPE attention_input computes (Qwen3's q/k norms sit
# between the projections and RoPE).
_ATTENTION_CLASSES = {f"{name}Attention" for name in ("Llama", "Mistral", "Qwen2", "Gemma", "Gemma2")}
# (q, k) data pointers attention_input rotated already, while transformers' attention forward runs on them.
_PRE_ROTATED: list[tuple[int, int]] = []
# Modeling module name -> the apply_rotary_pos_emb it had before patch() replaced it, for unpatch_rotary.
_ORIGINAL_ROPE: dict[str, object] = {}


def _rotary_fn(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    if _PRE_ROTATED and _PRE_ROTATED[-1] == (q.data_ptr(), k.data_ptr()):
        return q, k  # handed over by _attention_forward, rotated
    # q and k are fresh projections (transposed views) that attention reads only through the result.
    return _rope.apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim, in_place=True)


def _norm_in_place_safe(name: str, model_type: str) -> bool:
    """Norms whose output only feeds linear layers, so their incoming gradient is a fresh tensor.

    Gemma-2's post-attention / post-feedforward norms feed the residual add, whose backward hands the same
    gradient tensor to both branches: overwriting it would corrupt the residual's gradient.
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("input_layernorm", "pre_feedforward_layernorm"):
        return True
    return leaf == "post_attention_layernorm" and model_type != "gemma2"


def _pre_norm(name: str) -> bool:
    """Norms whose output the next projections save for their backward (what ``norm_recompute`` drops)."""
    return name.rsplit(".", 1)[-1] in _PRE_NORMS


def _norm_forward(module, x, *, eps, offset, casting, in_place, offer=False):
    out = _rms.rms_norm(x, module.weight, eps, offset, casting, in_place)
    if offer:
        _saved.offer(out, lambda: _rms.rms_norm(x, module.weight, eps, offset, casting, in_place))
    return out


def _layer_forward(module, *args, _forward, **kwargs):
    """A decoder layer's forward that keeps no pre-norm output for the backward (``norm_recompute``)."""
    if not torch.is_grad_enabled() or (module.training and getattr(module, "gradient_checkpointing", False)):
        return _forward(*args, **kwargs)
    with _saved.SavedNorms():
        return _forward(*args, **kwargs)


def _unhooked(module: nn.Module) -> bool:
    """No hook (accelerate's offload, DeepSpeed ZeRO-3's gathering, a user's) that a fused call would skip."""
    return not module._forward_hooks and not module._forward_pre_hooks and not hasattr(module, "_hf_hook")


def _input_norm_forward(norm, x, *, norm_options, norm_recompute):
    """A layer's input RMSNorm: passes ``x`` through when its attention module can run the norm itself
    (:func:`_attention_forward`), which it tells that module; runs the norm kernel otherwise."""
    attn = norm._chunkloss_attention
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    rope_patched = sys.modules[type(attn).__module__].apply_rotary_pos_emb is _rotary_fn
    fuse = (rope_patched and _unhooked(norm) and all(map(_plain_linear, projs))
            and not autocast_changes_dtype(x, *(p.weight for p in projs)))  # fmt: skip
    attn._chunkloss_takes_norm = fuse
    if fuse:
        return x
    return _norm_forward(norm, x, **norm_options, in_place=True, offer=norm_recompute)


def _handed(t, x):
    return t


def _attention_forward(module, hidden_states, *args, norm_options, norm_recompute, **kwargs):
    """Attention that, when its layer's input norm passed ``hidden_states`` through, computes the norm, q/k/v
    and RoPE in one attention_input call and hands them to transformers' forward (cache, attention,
    ``o_proj``) as its projections' outputs, which its RoPE call passes through."""
    if not module.__dict__.pop("_chunkloss_takes_norm", False):
        return module._chunkloss_forward(hidden_states, *args, **kwargs)
    projs = (module.q_proj, module.k_proj, module.v_proj)
    cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[0]
    biases = {"b_q": projs[0].bias, "b_k": projs[1].bias, "b_v": projs[2].bias}
    q, k, v = attention_input(hidden_states, module._chunkloss_norm.weight, *(p.weight for p in projs), cos,
                              sin, **biases, head_dim=module.head_dim, **norm_options,
                              norm_recompute=norm_recompute)  # fmt: skip
    for proj, t in zip(projs, (q, k, v), strict=True):  # (B, heads, T, D) -> the projection's (B, T, heads·D)
        proj.forward = functools.partial(_handed, t.transpose(1, 2).flatten(2))
    _PRE_ROTATED.append((q.data_ptr(), k.data_ptr()))
    try:
        return module._chunkloss_forward(hidden_states, *args, **kwargs)
    finally:
        _PRE_ROTATED.pop()
        for proj in projs:
            del proj.forward


def _fuse_attention_input(layer: nn.Module, *, fuse: bool, gemma: bool, norm_recompute: bool) -> None:
    """Let ``layer``'s attention run its input norm (:func:`_input_norm_forward`), or undo that. The two
    modules know each other through plain attributes (not submodules), which ``copy.deepcopy`` maps to the
    copies."""
    norm, attn = layer.input_layernorm, layer.self_attn
    if hasattr(attn, "_chunkloss_forward"):  # patched before: start from transformers' forward
        attn.forward = attn._chunkloss_forward
        if getattr(getattr(norm.forward, "__func__", None), "func", None) is _input_norm_forward:
            del norm.forward  # rms_norm=False this time: transformers' norm
    if not fuse or type(attn).__name__ not in _ATTENTION_CLASSES:
        return
    attn._chunkloss_forward = attn.forward
    options = {"eps": getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)),
               "offset": 1.0 if gemma else 0.0, "casting": "gemma" if gemma else "llama"}  # fmt: skip
    object.__setattr__(attn, "_chunkloss_norm", norm)  # not registered as a submodule
    object.__setattr__(norm, "_chunkloss_attention", attn)
    kw = {"norm_options": options, "norm_recompute": norm_recompute}
    attn.forward = types.MethodType(functools.partial(_attention_forward, **kw), attn)
    norm.forward = types.MethodType(functools.partial(_input_norm_forward, **kw), norm)


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose forward is ``F.linear(x, weight, bias)``: not a subclass (LoRA, quantised),
    and no hook (accelerate's offload, a user's) that a fused call would skip."""
    return type(module) is nn.Linear and _unhooked(module)


def _mlp_forward(module, x, *, activation, recompute):
    gate, up, down = module.gate_proj, module.up_proj, module.down_proj
    if _plain_linear(gate) and _plain_linear(up) and _plain_linear(down):
        return _mlp.gated_mlp(x, gate.weight, up.weight, down.weight, b_gate=gate.bias, b_up=up.bias,
                              b_down=down.bias, activation=activation, recompute=recompute)
    # gate_proj / up_proj outputs are read only here, so the backward may overwrite them with their grads.
    return down(_glu._glu(gate(x), up(x), activation, True))


def _mlp_activation(mlp: nn.Module) -> str | None:
    name = type(mlp.act_fn).__name__
    if name in ("SiLUActivation", "SiLU"):
        return "silu"
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"):
        return "gelu_tanh"
    if name == "GELUActivation":
        return "gelu"
    return None


def _check_device(model: nn.Module) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    off = sorted({p.device.type for p in model.parameters()} - {"cuda", "meta"})
    if off:
        raise ValueError(
            f"chunkloss.models.patch: the model's parameters are on {off}; the Triton kernels run on CUDA "
            "tensors only (or on CPU with TRITON_INTERPRET=1 set before importing chunkloss). Move the model "
            "to CUDA first."
        )


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """``XForCausalLM.forward`` whose loss skips the logits; see :func:`patch`."""
    if labels is None:
        return self._chunkloss_forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            logits_to_keep=logits_to_keep, **kwargs,
        )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from chunkloss import FusedLinearCrossEntropyLoss

    return_dict = kwargs.pop("return_dict", None)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = self.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
    )
    hidden = outputs.last_hidden_state
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    hidden = hidden[:, keep, :]
    softcap = getattr(self.config, "final_logit_softcapping", None)
    if self._chunkloss_ce is None or self._chunkloss_ce[0] != softcap:
        # Kept across calls: the loss instance holds its compiled per-chunk step.
        ce = FusedLinearCrossEntropyLoss(ignore_index=-100, softcap=softcap, **self._chunkloss_loss_options)
        self._chunkloss_ce = (softcap, ce)
    if shift_labels is None:
        # As transformers' ForCausalLMLoss: position t predicts token t + 1, the last one predicts nothing.
        shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = self._chunkloss_ce[1](hidden, self.lm_head.weight, shift_labels.to(hidden.device),
                                 bias=self.lm_head.bias, num_items_in_batch=kwargs.get("num_items_in_batch"))
    out = CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                 hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
        return out.to_tuple()
    return out


def patch(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, mlp: bool = True, loss: bool = True,
          loss_options: dict | None = None, mlp_recompute: bool = False, norm_recompute: bool = False,
          attention: bool = True) -> nn.Module:
    """Make a transformers Llama / Mistral / Qwen2 / Qwen3 / Gemma / Gemma-2 model use chunkloss's kernels.

    Args:
        model: an ``XForCausalLM``, the bare ``XModel`` (then ``loss`` does nothing), or a PEFT model
            wrapping either (its base model is patched; LoRA layers stay as they are).
        rms_norm: patch every RMSNorm module (including Qwen3's per-head q/k norms).
        rope: replace the family's ``apply_rotary_pos_emb`` (process-wide, see the module docstring).
        mlp: patch every gated MLP (fused gate/up GEMM; see the module docstring for LoRA and other
            projections, which keep their own forward). An MLP whose activation has no kernel keeps
            transformers' code, with a warning naming it.
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
            one :func:`~chunkloss.kernels.attention_input` call (one GEMM over the concatenated weights; see
            the module docstring); the layer's ``input_layernorm`` module then returns its input unchanged.

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
    _check_device(model)
    gemma = model_type in _GEMMA_TYPES
    for name, module in model.named_modules():
        cls = type(module).__name__
        if rms_norm and cls in _RMSNORM_CLASSES:
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
            module.forward = types.MethodType(functools.partial(
                _norm_forward, eps=eps, offset=1.0 if gemma else 0.0, casting="gemma" if gemma else "llama",
                in_place=_norm_in_place_safe(name, model_type), offer=norm_recompute and _pre_norm(name),
            ), module)
        elif norm_recompute and cls in _LAYER_CLASSES:
            forward = getattr(module, "_chunkloss_forward", module.forward)  # patching twice: the original
            module._chunkloss_forward = forward
            module.forward = types.MethodType(functools.partial(_layer_forward, _forward=forward), module)
        elif mlp and cls in _MLP_CLASSES:
            activation = _mlp_activation(module)
            if activation is None:
                act = type(module.act_fn).__name__
                warnings.warn(f"chunkloss: {name} uses {act}, left unpatched", stacklevel=2)
                continue
            module.forward = types.MethodType(
                functools.partial(_mlp_forward, activation=activation, recompute=mlp_recompute), module
            )
    for module in model.modules():
        if type(module).__name__ in _LAYER_CLASSES:
            _fuse_attention_input(module, fuse=attention and rms_norm and rope, gemma=gemma,
                                  norm_recompute=norm_recompute)
    if rope:
        modeling = sys.modules[type(model).__module__]
        if not hasattr(modeling, "apply_rotary_pos_emb"):
            raise ValueError(f"{modeling.__name__} has no apply_rotary_pos_emb to replace")
        if modeling.apply_rotary_pos_emb is not _rotary_fn:  # patching twice must not lose the original
            _ORIGINAL_ROPE[modeling.__name__] = modeling.apply_rotary_pos_emb
        modeling.apply_rotary_pos_emb = _rotary_fn
    if loss and hasattr(model, "lm_head") and hasattr(model, "model"):
        if not hasattr(model, "_chunkloss_forward"):
            model._chunkloss_forward = model.forward
        model._chunkloss_ce = None
        model._chunkloss_loss_options = dict(loss_options or {})
        model.forward = types.MethodType(_causal_lm_forward, model)
    return wrapper


def unpatch_rotary(model: nn.Module | None = None) -> list[str]:
    """Put back the ``apply_rotary_pos_emb`` that :func:`patch` replaced, process-wide.

    Norms and MLPs patched on a model's modules stay patched; only the family's module-level function, which
    every model of the family in the process calls, returns to what it was before ``patch`` replaced it.

    Args:
        model: a model of the family to restore (PEFT-wrapped or not); ``None`` restores every family that
            ``patch`` replaced in this process.

    Returns:
        The names of the modeling modules whose function was put back (empty when none was patched).
    """
    if model is None:
        names = list(_ORIGINAL_ROPE)
    else:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
        names = [type(base).__module__]
    restored = []
    for name in names:
        modeling = sys.modules.get(name)
        patched = modeling is not None and getattr(modeling, "apply_rotary_pos_emb", None) is _rotary_fn
        if patched and name in _ORIGINAL_ROPE:
            modeling.apply_rotary_pos_emb = _ORIGINAL_ROPE.pop(name)
            restored.append(name)
    return restored


__all__ = ["SUPPORTED_MODEL_TYPES", "patch", "unpatch_rotary"]
