"""Activation checkpointing under the name transformers reads now.

transformers 5.23 renamed ``gradient_checkpointing`` to ``activation_checkpointing``
(:data:`chunkloss._compat.transformers.CHECKPOINTING_RENAMED`) and warns on each use of an old name. TRL
1.16's config classes default ``gradient_checkpointing`` to True, and the config warns when it is built:
:class:`CheckpointingDefault` gives TRL's default to the new name instead. TRL's calls of the model's old
names around generation are quieted by :func:`chunkloss._compat.trl.quiet_checkpointing_calls`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkloss._compat.transformers import CHECKPOINTING_RENAMED

from ._arguments import ChunkedArguments

__all__ = ["CheckpointingDefault"]


@dataclass
class CheckpointingDefault:
    """Mixin placed first in a chunked config's bases: TRL's default of activation checkpointing (on), given
    to ``activation_checkpointing`` when neither name is set. ``gradient_checkpointing`` defaults to None, as
    in transformers, so that only a value passed under the old name warns (and is used, as transformers uses
    it). Without the rename (transformers before 5.23) it changes nothing. Being first, it also runs
    :class:`~chunkloss.trainers._arguments.ChunkedArguments`' checks when the config is built."""

    if CHECKPOINTING_RENAMED:
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
        # TrainingArguments.__post_init__ calls no base's: the chunkloss fields are checked from here.
        if isinstance(self, ChunkedArguments):
            ChunkedArguments.__post_init__(self)
        if (
            CHECKPOINTING_RENAMED
            and self.activation_checkpointing is None
            and self.gradient_checkpointing is None
        ):
            self.activation_checkpointing = True
        super().__post_init__()
