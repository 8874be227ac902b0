"""transformers' private names that chunkloss uses, and its version workarounds.

Supported: transformers 5.x (``pyproject.toml``: ``>=5.0,<6``); each accessor names the versions it was
written for.
"""

from __future__ import annotations

import sys

from transformers import TrainingArguments
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = [
    "ACTIVATION_CLASSES",
    "CHECKPOINTING_RENAMED",
    "CHECKPOINTING_RENAMES",
    "DEPRECATED_CHECKPOINTING_CALLS",
    "OUTPUT_CACHE_FIELD",
    "TRAINER_OVERRIDES",
    "attn_implementation",
    "cache_update",
    "enable_activation_checkpointing",
    "eager_attention_forward",
    "layer_checkpointed",
    "output_dir",
]

#: ``transformers.Trainer``'s private methods that the chunked trainers override by name (a subclass can do
#: no other), each calling transformers' own first (transformers 4.x and 5.x):
#:
#: * ``_save_checkpoint``: the checkpoint is marked complete after transformers' save;
#: * ``_load_optimizer_and_scheduler``: the state transformers' checkpoints leave out is loaded with it;
#: * ``_prepare_inputs``: the batch's shapes, for an out-of-memory error;
#: * ``_inner_training_loop``: a fresh start per attempt, and the out-of-memory error.
TRAINER_OVERRIDES = (
    "_save_checkpoint",
    "_load_optimizer_and_scheduler",
    "_prepare_inputs",
    "_inner_training_loop",
)


def output_dir(trainer, trial) -> str:
    """The folder ``trainer`` writes this run's checkpoints to: ``Trainer._get_output_dir(trial=trial)``
    (transformers 4.x and 5.x)."""
    return trainer._get_output_dir(trial=trial)


def attn_implementation(config) -> str | None:
    """The attention implementation a model was loaded with (``"eager"``, ``"sdpa"``, ...):
    ``config._attn_implementation`` (transformers 4.36 and later), which the families' own forwards read."""
    return config._attn_implementation


def eager_attention_forward(module):
    """The ``eager_attention_forward`` of the modeling module that defines ``module``'s class
    (``transformers.models.llama.modeling_llama``, ...), found in ``sys.modules``: each family defines its own
    (transformers 4.48 and later)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def cache_update(cache, k, v, layer_idx: int, kwargs: dict):
    """``cache.update(k, v, layer_idx, kwargs=kwargs)``, as the families' attention forwards call it in
    transformers 5.25 (the cache reads what it needs from the attention's keyword arguments)."""
    return cache.update(k, v, layer_idx, kwargs=kwargs)


#: The field of ``CausalLMOutputWithPast`` that holds the cache: transformers 5.24 renamed
#: ``past_key_values`` to ``cache``. ``past_key_values`` can go once the minimum transformers is 5.24.
OUTPUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

#: transformers 5.23 renamed ``gradient_checkpointing`` (the config fields and the model's methods) to
#: ``activation_checkpointing`` and warns (``FutureWarning``) on each use of an old name. True from 5.23 on.
CHECKPOINTING_RENAMED = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
#: The config fields of that rename, old name: new name.
CHECKPOINTING_RENAMES = {
    "gradient_checkpointing": "activation_checkpointing",
    "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs",
}
#: The model attributes of that rename whose old names warn (transformers 5.23 and later).
DEPRECATED_CHECKPOINTING_CALLS = (
    "is_gradient_checkpointing",
    "gradient_checkpointing_disable",
    "gradient_checkpointing_enable",
)

#: Class names of the gated MLPs' activations (``transformers.activations``, and torch's ``nn.SiLU``), by the
#: kernels' activation name. ``PytorchGELUTanh`` is an older name of ``GELUTanh`` (both exist in 5.25).
ACTIVATION_CLASSES = {
    "silu": ("SiLUActivation", "SiLU"),
    "gelu_tanh": ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"),
    "gelu": ("GELUActivation",),
}


def enable_activation_checkpointing(args) -> None:
    """Turn on activation checkpointing in a ``TrainingArguments`` under every name the installed version has:
    ``activation_checkpointing`` and ``gradient_checkpointing`` (which mirrors it) from transformers 5.23,
    ``gradient_checkpointing`` alone before."""
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if hasattr(args, name):
            setattr(args, name, True)


def layer_checkpointed(layer) -> bool:
    """Whether a decoder layer runs under activation checkpointing now: ``GradientCheckpointingLayer``'s
    ``gradient_checkpointing`` flag (transformers 5.x; not renamed by 5.23) while training."""
    return bool(layer.training and getattr(layer, "gradient_checkpointing", False))
