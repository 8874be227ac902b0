"""The chunked LM head the trainers call: the model's backbone runs inside the model's own forward, and the
chunked loss gets the last hidden states with the head's weight, bias and logit transforms.

``add_chunked_head(model)`` patches ``model.forward`` the way TRL 1.16's ``add_fused_lm_head`` does, so
that ``model(**inputs, chunked_head=fn)`` returns ``ChunkedHeadOutput(fn(hidden, head), aux_loss)``.
The backbone runs inside the model's forward and the loss runs as the forward of the LM head module
(:func:`in_head_forward`), so FSDP2 and DeepSpeed ZeRO-3 gather and release the head's weight, and reduce its
gradient, with their own hooks on that module, as for an ``nn.Linear`` head; the chunked losses compute their
gradients in that forward.

A LoRA adapter on ``lm_head`` trains through the chunked loss: its logits
``x·Wᵀ + b + Σ_a s_a·(drop_a(x)·A_aᵀ)·B_aᵀ`` equal ``[x, drop_a(x)·A_aᵀ, …] · [W, s_a·B_a, …]ᵀ + b``, so the
loss gets the concatenated hidden states and weight, and autograd carries the gradient to ``A`` and ``B``.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ._common import refuse
from ._nonfinite import record_head_inputs

__all__ = [
    "ChunkedHeadOutput",
    "Head",
    "add_chunked_head",
    "allow_lm_head_adapter",
    "fused_head_call",
    "head_transforms",
    "left_pad",
    "refuse_precomputed_head_lora_reference",
]


@dataclass
class Head:
    """The LM head as the chunked losses take it: ``logits = scale(hidden @ weight.T + bias)``."""

    weight: Tensor  # (V, H')
    bias: Tensor | None  # (V,)
    softcap: float | None
    logit_scale: float

    def features(self, hidden: Tensor) -> Tensor:
        """Hidden states ``(..., H)`` as the head's input ``(..., H')`` (LoRA columns appended)."""
        return self._features(hidden) if self._features is not None else hidden

    _features: Callable[[Tensor], Tensor] | None = None


def label_logps_head(logp_loss, targets: Tensor, cast_fp32: bool = False) -> Callable:
    """A ``chunked_head`` function: the per-token log-probs of ``targets`` (B, k), the next tokens of the
    sequence's last k positions (0 where -100), from the hidden states just before them, through the head with
    its active adapters. ``logp_loss`` is a ``FusedLinearCrossEntropyLoss(reduction="none")`` with the head's
    transforms; ``cast_fp32`` runs the head in fp32 (TRL's ``cast_lm_head_to_fp32``)."""
    k = targets.shape[1]

    def head_fn(hidden: Tensor, head: Head) -> Tensor:
        x, w, b = head.features(hidden[:, -k - 1 : -1]), head.weight, head.bias
        ctx = contextlib.nullcontext()
        if cast_fp32:
            x, w, b = x.float(), w.float(), None if b is None else b.float()
            ctx = torch.autocast(x.device.type, enabled=False)
        with ctx:
            return -logp_loss(x, w, targets, bias=b)

    return head_fn


def fused_head_call(model: Callable, logp_loss) -> Callable:
    """``model`` as TRL 1.16's trainers call their fused LM head, ``model(..., labels=labels,
    fused_lm_head=True).log_probs`` (the log-probs of the next tokens, (B, T - 1), 0 where the label is -100),
    with the log-probs from the chunked head (:func:`label_logps_head`), through the head's active adapters:
    TRL's fused head reads ``lm_head.weight`` alone and would leave a LoRA adapter on ``lm_head`` out.
    ``model`` has the chunked head (:func:`add_chunked_head`); ``logp_loss`` as for
    :func:`label_logps_head`."""

    def call(*, labels: Tensor, fused_lm_head: bool = True, **kwargs):
        head_fn = label_logps_head(logp_loss, labels[:, 1:])
        return types.SimpleNamespace(log_probs=model(**kwargs, chunked_head=head_fn).result)

    return call


def refuse_precomputed_head_lora_reference(trainer: str, call: dict) -> None:
    """Refuse ``precompute_ref_log_probs=True`` for a ``PeftModel`` with LoRA on ``lm_head`` given without
    ``ref_model`` (``call``: the trainer's constructor arguments by name). TRL scores the reference through a
    "ref" copy of the adapter in its constructor, before the chunked head exists and while ``lm_head`` shows
    TRL its base layer (:func:`allow_lm_head_adapter`): that copy's ``lm_head`` would be left out."""
    args = call.get("args")
    if args is None or not args.precompute_ref_log_probs or call.get("ref_model") is not None:
        return
    if has_lm_head_lora(call.get("model")):
        refuse(
            trainer,
            "precompute_ref_log_probs=True with LoRA on lm_head of a PeftModel and no ref_model",
            "TRL scores the reference in its constructor with a head that leaves the adapter's "
            "lm_head out; set precompute_ref_log_probs=False (the chunked head then scores it)",
        )


def left_pad(t: Tensor, length: int, value: int) -> Tensor:
    """``t`` (B, T) padded on the left to (B, ``length``) with ``value``. Prompt tuning and p-tuning prepend
    their virtual tokens to the hidden states; PEFT pads the labels the same way (with -100)."""
    extra = length - t.shape[1]
    return t if extra <= 0 else torch.nn.functional.pad(t, (extra, 0), value=value)


class ChunkedHeadOutput(NamedTuple):
    """What ``model(..., chunked_head=fn)`` returns: ``fn``'s result and the MoE load-balancing loss. A named
    tuple, so that FSDP2's and DeepSpeed ZeRO-3's hooks on the model's output find the tensors in it (ZeRO-3
    warns of an output type it cannot look into)."""

    result: Any
    aux_loss: Tensor | None = None


def head_transforms(config) -> tuple[float | None, float]:
    """``(final_logit_softcapping, logit_scale)`` of a config, read as TRL 1.16's fused head reads them."""
    text_config = config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    logit_scale = getattr(text_config, "logit_scale", None)
    if logit_scale is None:
        logit_scale = getattr(text_config, "output_multiplier", None)
    if logit_scale is None:
        logit_scale = getattr(text_config, "lm_head_multiplier", None)
    if logit_scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        logit_scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return softcap, 1.0 if logit_scale is None else float(logit_scale)


def _lora_layer_type():
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # PEFT is optional
        return None
    return LoraLayer


def _base_linear(lm_head: nn.Module) -> nn.Module:
    """The plain ``nn.Linear`` under a PEFT tuner layer (or the head itself)."""
    return lm_head.get_base_layer() if hasattr(lm_head, "get_base_layer") else lm_head


def has_lm_head_lora(model) -> bool:
    """Whether ``model`` (a module or a name) is a PEFT model with a LoRA adapter on its ``lm_head``."""
    from accelerate.utils import is_peft_model

    lora = _lora_layer_type()
    if lora is None or not isinstance(model, nn.Module) or not is_peft_model(model):
        return False
    return isinstance(model.get_output_embeddings(), lora)


def check_head_supported(model: nn.Module) -> None:
    """Raise a clear error for LM heads the chunked losses cannot take exactly."""
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head) to fuse into the loss")
    lora = _lora_layer_type()
    base = _base_linear(lm_head)
    if lm_head is not base:
        if lora is None or not isinstance(lm_head, lora):
            raise ValueError(
                f"The adapter on lm_head ({type(lm_head).__name__}) is not supported by the chunked loss: "
                "only LoRA adapters are. Remove 'lm_head' from the adapter's target modules."
            )
        if getattr(lm_head, "lora_variant", None):
            raise ValueError(
                f"LoRA variants on lm_head ({sorted(lm_head.lora_variant)}: DoRA and the like) are not "
                "supported by the chunked loss: use plain LoRA or drop 'lm_head' from the target modules."
            )
        if any(b.bias is not None for b in lm_head.lora_B.values()):
            raise ValueError("lora_bias=True on lm_head is not supported by the chunked loss")
    if not isinstance(base, nn.Linear):
        raise ValueError(f"lm_head must be an nn.Linear for the chunked loss, got {type(base).__name__}")


def _adapters(lm_head: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module, float]]:
    """``(lora_A, lora_B, lora_dropout, scaling)`` of each active, unmerged LoRA adapter on ``lm_head``."""
    if lm_head is _base_linear(lm_head) or lm_head.disable_adapters or lm_head.merged:
        return []
    return [
        (lm_head.lora_A[name], lm_head.lora_B[name], lm_head.lora_dropout[name], lm_head.scaling[name])
        for name in lm_head.active_adapters
        if name in lm_head.lora_A
    ]


def has_active_head_adapter(model: nn.Module) -> bool:
    """Whether ``model``'s ``lm_head`` has an active LoRA adapter (read without touching its parameters)."""
    return bool(_adapters(model.get_output_embeddings()))


def _unsharded(t: Tensor | None, name: str) -> Tensor | None:
    # Inside the head's forward FSDP2 has unsharded every unit the forward runs; a DTensor here belongs to a
    # unit it does not run (its gradient would never be reduce-scattered).
    if t is not None and type(t).__name__ == "DTensor":
        raise RuntimeError(
            f"chunkloss: {name} is still sharded inside the LM head's forward: it belongs to an FSDP2 unit "
            "that is neither the lm_head module, a module under it, nor a module whose forward is running. "
            "Shard lm_head in a unit of its own or with the final norm (as accelerate does)."
        )
    return t


def _head_of(model: nn.Module) -> Head:
    """The :class:`Head` of ``model`` from its parameters as they are now (looked up on each call: FSDP and
    PEFT replace modules and parameters). Inside :func:`in_head_forward` they are the gathered ones."""
    lm_head = model.get_output_embeddings()
    base = _base_linear(lm_head)
    softcap, logit_scale = head_transforms(model.config)
    weight, bias = _unsharded(base.weight, "lm_head.weight"), _unsharded(base.bias, "lm_head.bias")
    adapters = _adapters(lm_head)
    if not adapters:
        return Head(weight, bias, softcap, logit_scale)

    def features(x: Tensor) -> Tensor:
        cols = [x]
        for a, _, drop, _ in adapters:
            cols.append(drop(x.to(a.weight.dtype)) @ _unsharded(a.weight, "lora_A.weight").t())
        return torch.cat([c.to(x.dtype) for c in cols], dim=-1)

    weight = torch.cat(
        [weight, *[s * _unsharded(b.weight, "lora_B.weight").to(weight.dtype) for _, b, _, s in adapters]], 1
    )
    return Head(weight, bias, softcap, logit_scale, features)


@torch.compiler.disable
def in_head_forward(model: nn.Module, fn: Callable[[Tensor, Head], Any], hidden: Tensor) -> Any:
    """``fn(hidden, head)`` run as the forward of ``model``'s LM head; returns ``fn``'s result.

    Never traced: under ``torch_compile=True`` (the model compiled whole) Dynamo stops before it, and the
    chunked loss runs its own loop, with its step compiled by ``chunk_compile``.

    The head module and those under it that have forward hooks and hold parameters (a LoRA adapter's base
    layer, ``lora_A``, ``lora_B``) each run ``fn`` inside their forward
    (:func:`chunkloss.models.hooks.run_inside`): FSDP2 unshards their unit before the call and again before
    the backward, and reduce-scatters the gradients after it; ZeRO-3 gathers each module's parameters at the
    same two points and reduce-scatters a gradient as it is accumulated, as for any ``nn.Linear``. The
    :class:`Head` is read inside those forwards. Other forward hooks on these modules run too, with ``fn``'s
    result as the head's output. Without hooks ``fn`` is called directly.

    With gradients off the hooks see no output (``fn``'s result leaves by another way): the head takes no part
    in a backward then, and a result with a graph of its own, such as GKD's loss computed with gradients on
    inside the teacher's head, is not cut from it by a hook that detaches outputs under ``no_grad``.

    In a training forward (gradients on, ``model.training``) it also keeps on ``model`` whether ``hidden`` and
    the head's weight are finite, on the device (:func:`chunkloss.trainers._nonfinite.record_head_inputs`).
    """
    from chunkloss.models.hooks import hooked_owners, run_inside

    lm_head = model.get_output_embeddings()
    hidden = hidden.to(_base_linear(lm_head).weight.device)
    owners = hooked_owners([lm_head])
    if torch.is_grad_enabled():

        def call(x: Tensor) -> Any:
            head = _head_of(model)
            if model.training:  # a training step's head: what the trainer reports of a non-finite loss
                record_head_inputs(model, x, head.weight)
            return fn(x, head)

        return run_inside(owners, call, hidden)
    out = []
    run_inside(owners, lambda x: out.append(fn(x, _head_of(model))), hidden)
    return out[0]


def add_chunked_head(model: nn.Module) -> None:
    """Patch ``model.forward`` so that ``model(..., chunked_head=fn)`` runs the backbone and returns
    ``ChunkedHeadOutput(fn(last_hidden_state, head), aux_loss)``; without ``chunked_head`` the forward is the
    one the model had (generation and TRL's own fused head are unchanged). Patch the base model, before or
    after PEFT wraps it (the head and backbone are looked up on each call)."""
    if getattr(model, "_chunkloss_head", False):
        return
    check_head_supported(model)
    # Kept on the instance rather than in a closure, so that a deep copy of the model calls its own forward.
    model._chunkloss_previous_forward = model.forward
    text_config = model.config.get_text_config()

    @functools.wraps(type(model).forward)
    def _forward(self, *args, chunked_head=None, **kwargs):
        if chunked_head is None:
            return self._chunkloss_previous_forward(*args, **kwargs)
        for key in ("labels", "shift_labels", "num_items_in_batch", "fused_lm_head", "logits_to_keep"):
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone_out = self.base_model(*args, **kwargs)
        result = in_head_forward(self, chunked_head, backbone_out.last_hidden_state)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            aux_loss = load_balancing_loss_func(
                backbone_out.router_logits,
                text_config.num_experts
                if hasattr(text_config, "num_experts")
                else text_config.num_local_experts,
                text_config.num_experts_per_tok,
                kwargs.get("attention_mask"),
            )
        return ChunkedHeadOutput(result, aux_loss)

    model.forward = types.MethodType(_forward, model)
    model._chunkloss_head = True


@contextlib.contextmanager
def allow_lm_head_adapter(model: nn.Module | str):
    """While TRL's constructor runs, show it the plain ``nn.Linear`` under a LoRA adapter on ``lm_head``.

    TRL refuses such an adapter because its fused head reads ``lm_head.weight`` and would never train it; the
    chunked head here trains it, so the refusal does not apply. Only ``get_output_embeddings`` is shadowed on
    the instance, and only for the duration of the block. A model given by name (TRL loads it) has no
    adapter yet: nothing to do.
    """
    if not isinstance(model, nn.Module):
        yield
        return
    target = model
    while hasattr(target, "get_base_model") and target is not target.get_base_model():
        target = target.get_base_model()
    cls_get = type(target).get_output_embeddings
    target.get_output_embeddings = lambda: _base_linear(cls_get(target))
    try:
        yield
    finally:
        del target.get_output_embeddings
