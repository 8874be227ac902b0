"""Activation checkpointing under the name transformers reads now.

transformers 5.23 renamed ``gradient_checkpointing`` (the config field and the model's methods) to
``activation_checkpointing`` and warns (``FutureWarning``) on each use of an old name. TRL 1.16 uses the old
names in two places, so a chunked trainer would warn where its user wrote nothing deprecated:

* its config classes default ``gradient_checkpointing`` to True, and the config warns when it is built:
  :class:`CheckpointingDefault` gives TRL's default to the new name instead;
* around generation and its no-grad scoring passes it reads ``model.is_gradient_checkpointing`` and calls
  ``gradient_checkpointing_disable()`` / ``gradient_checkpointing_enable()``
  (``trl/models/utils.py``: ``_unwrap_model_for_generation``, lines 136-154, and
  ``disable_gradient_checkpointing``, lines 407-414; GRPO, DPO, distillation and GKD's on-policy generation),
  each step. No argument avoids those calls: :func:`trl_checkpointing_calls` drops exactly their three
  warnings while the trainer trains or evaluates.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

from transformers import TrainingArguments

__all__ = ["CheckpointingDefault", "trl_checkpointing_calls"]

_RENAMED = "activation_checkpointing" in TrainingArguments.__dataclass_fields__


@dataclass
class CheckpointingDefault:
    """Mixin placed first in a chunked config's bases: TRL's default of activation checkpointing (on), given
    to ``activation_checkpointing`` when neither name is set. ``gradient_checkpointing`` defaults to None, as
    in transformers, so that only a value passed under the old name warns (and is used, as transformers uses
    it). Without the rename (transformers before 5.23) it changes nothing."""

    if _RENAMED:
        gradient_checkpointing: bool | None = field(
            default=None,
            metadata={
                "help": "Deprecated alias of activation_checkpointing (transformers 5.23). Unset, with "
                "activation_checkpointing unset too: on, TRL's default.",
                "nargs": "?",
                "const": True,
            },
        )

    def __post_init__(self):
        if _RENAMED and self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True
        super().__post_init__()


_TRL_CALLS = ("is_gradient_checkpointing", "gradient_checkpointing_disable", "gradient_checkpointing_enable")


@contextlib.contextmanager
def trl_checkpointing_calls():
    """Inside: transformers' FutureWarnings on the three deprecated model attributes TRL 1.16 uses (module
    docstring) are dropped; every other warning is shown as before."""
    with warnings.catch_warnings():
        for name in _TRL_CALLS:
            warnings.filterwarnings(
                "ignore",
                message=f"`{name}` is deprecated",
                category=FutureWarning,
                module="transformers.modeling_utils",
            )
        yield
