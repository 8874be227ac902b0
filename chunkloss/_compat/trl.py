"""TRL's private names that chunkloss uses, and its version workarounds.

Supported: TRL 1.16 (``pyproject.toml``: ``>=1.16.0,<1.17``). The chunked trainers subclass TRL's, so they
read and write state TRL keeps under private names; each accessor says which trainers keep it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from .transformers import DEPRECATED_CHECKPOINTING_CALLS

__all__ = [
    "PRIVATE_ATTRIBUTES",
    "RESUMED_STATE",
    "SFT_LABEL_SMOOTHING_WARNING",
    "TRAINER_OVERRIDES",
    "EntropyControl",
    "clear_metrics",
    "is_vision_dataset",
    "last_hidden_state",
    "metric_stores",
    "metrics",
    "quiet_checkpointing_calls",
    "redirected_last_hidden_state",
    "restore_state",
    "resumed_state",
    "set_total_train_tokens",
    "total_train_tokens",
    "tp_size",
]

_SFT = "trl.trainer.sft_trainer.SFTTrainer"
_DPO = "trl.trainer.dpo_trainer.DPOTrainer"
_KTO = "trl.trainer.kto_trainer.KTOTrainer"
_GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"
_RLOO = "trl.trainer.rloo_trainer.RLOOTrainer"
_DISTILLATION = "trl.trainer.distillation_trainer.DistillationTrainer"
_ORPO = "trl.experimental.orpo.orpo_trainer.ORPOTrainer"
_GKD = "trl.experimental.gkd.gkd_trainer.GKDTrainer"

#: Private names of TRL 1.16's trainers that the chunked trainers override by name, with the trainers that
#: define them: the loss (``_compute_loss``), KTO's KL log-probs (``_compute_kl_logps``), the no-grad
#: log-probs of GRPO and RLOO (``_get_per_token_logps_and_entropies``), RLOO's generation-and-scoring step
#: (``_generate_and_score_completions``, wrapped), and the model card's tags (``_tag_names``, a class
#: attribute).
TRAINER_OVERRIDES = {
    "_compute_loss": (_DPO, _KTO, _GRPO, _RLOO, _DISTILLATION),
    "_compute_kl_logps": (_KTO,),
    "_get_per_token_logps_and_entropies": (_GRPO, _RLOO),
    "_generate_and_score_completions": (_RLOO,),
    "_tag_names": (_SFT, _DPO, _KTO, _ORPO, _GRPO, _RLOO, _GKD, _DISTILLATION),
}

#: Private attributes and methods of TRL 1.16's trainers that the accessors below read, write or call, with
#: the trainers that set or define them.
PRIVATE_ATTRIBUTES = {
    "_metrics": (_SFT, _DPO, _KTO, _GRPO, _RLOO, _GKD, _DISTILLATION),
    "_stored_metrics": (_ORPO,),
    "_total_train_tokens": (_SFT, _DPO, _KTO, _GRPO, _RLOO, _GKD, _DISTILLATION),
    "_tp_size": (_SFT, _DPO, _KTO, _GKD),
    "_step": (_GRPO, _RLOO, _DISTILLATION),
    "_buffered_inputs": (_GRPO, _RLOO, _DISTILLATION),
    "_entropy_bonus_enabled": (_GRPO,),
    "_last_world_entropy": (_GRPO,),
    "_entropy_window_stats": (_GRPO,),
    "_is_vision_dataset": (_SFT, _DPO, _KTO, _GKD),
    "_get_last_hidden_state": (_DISTILLATION,),
    "_forward_redirection": (_DISTILLATION,),
}


# --- metrics --------------------------------------------------------------------------------------------


def metrics(trainer, mode: str) -> dict[str, list]:
    """The metric lists TRL averages at each log, by name, for ``mode`` (``"train"`` or ``"eval"``):
    ``trainer._metrics[mode]`` (every TRL 1.16 trainer but ORPO's)."""
    return trainer._metrics[mode]


def metric_stores(trainer) -> list[dict[str, list]]:
    """Every store of metric lists ``trainer`` keeps: the values of ``_metrics`` and of ``_stored_metrics``
    (ORPO's TRL 1.16 trainer), by mode; empty where it keeps neither."""
    return [
        store for name in ("_metrics", "_stored_metrics") for store in getattr(trainer, name, {}).values()
    ]


def clear_metrics(trainer) -> None:
    """Empty every metric list of :func:`metric_stores`."""
    for store in metric_stores(trainer):
        store.clear()


def total_train_tokens(trainer) -> int:
    """TRL's running count of training tokens (``num_tokens``): ``trainer._total_train_tokens`` (TRL 1.16)."""
    return trainer._total_train_tokens


def set_total_train_tokens(trainer, count: int) -> None:
    """Set :func:`total_train_tokens`."""
    trainer._total_train_tokens = count


def tp_size(trainer) -> int:
    """The tensor-parallel size TRL divides token counts by: ``trainer._tp_size`` (TRL 1.16's SFT, DPO, KTO
    and reward trainers)."""
    return trainer._tp_size


# --- state a checkpoint leaves out --------------------------------------------------------------------------

#: Attributes of TRL 1.16's trainers that their checkpoints do not hold and that change what a resumed run
#: logs or trains on: the running token count (``num_tokens``), and the generation step counter and buffered
#: generations of GRPO, RLOO and distillation (a run resumed between two generations otherwise generates
#: anew). They are the keys of the saved state, so their names stay as TRL spells them.
RESUMED_STATE = ("_total_train_tokens", "_step", "_buffered_inputs")


def resumed_state(trainer) -> dict:
    """``{name: value}`` of the :data:`RESUMED_STATE` attributes ``trainer`` has."""
    return {name: getattr(trainer, name) for name in RESUMED_STATE if hasattr(trainer, name)}


def restore_state(trainer, state: dict) -> None:
    """Set the attributes of a :func:`resumed_state`."""
    for name, value in state.items():
        setattr(trainer, name, value)


# --- trainer-specific state and helpers ---------------------------------------------------------------------


class EntropyControl:
    """The entropy bonus state of TRL 1.16's ``GRPOTrainer``: ``_entropy_bonus_enabled`` (the bonus is on),
    ``_last_world_entropy`` (the global entropy of the last optimizer step) and ``_entropy_window_stats``
    (entropy sum and token count of the accumulation window so far, or None)."""

    def __init__(self, trainer):
        self.trainer = trainer

    @property
    def enabled(self) -> bool:
        return self.trainer._entropy_bonus_enabled

    @property
    def last_world_entropy(self) -> float:
        return self.trainer._last_world_entropy

    @last_world_entropy.setter
    def last_world_entropy(self, value: float) -> None:
        self.trainer._last_world_entropy = value

    @property
    def window(self):
        return self.trainer._entropy_window_stats

    @window.setter
    def window(self, value) -> None:
        self.trainer._entropy_window_stats = value


def is_vision_dataset(trainer) -> bool:
    """Whether the train dataset has images: ``trainer._is_vision_dataset`` (TRL 1.16's SFT, DPO, KTO and
    GKD)."""
    return trainer._is_vision_dataset


def last_hidden_state(trainer, model, *args, **kwargs):
    """``DistillationTrainer._get_last_hidden_state(model, ...)`` (TRL 1.16): ``model``'s last hidden states
    over the completion positions."""
    return trainer._get_last_hidden_state(model, *args, **kwargs)


def redirected_last_hidden_state(trainer, wrapped, model, *args, **kwargs):
    """:func:`last_hidden_state` of ``model`` run as the forward of ``wrapped``, its wrapper, so that FSDP or
    DeepSpeed gathers its weights: ``DistillationTrainer._forward_redirection`` (TRL 1.16)."""
    fn = trainer._get_last_hidden_state
    return trainer._forward_redirection(wrapped, model, fn, model, *args, **kwargs)


# --- warnings -----------------------------------------------------------------------------------------------

#: The start of TRL 1.16's ``SFTTrainer`` warning that ``label_smoothing_factor`` computes the loss from
#: materialised logits in an extra forward (``trl/trainer/sft_trainer.py``); the chunked loss takes the
#: smoothing itself, so the warning is not true of the chunked trainer.
SFT_LABEL_SMOOTHING_WARNING = "`label_smoothing_factor` is deprecated in `SFTTrainer`"


@contextlib.contextmanager
def quiet_checkpointing_calls() -> Iterator[None]:
    """Inside: transformers' FutureWarnings on the deprecated checkpointing attributes of the model that TRL
    1.16 reads and calls around generation and its no-grad scoring (``trl/models/utils.py``:
    ``_unwrap_model_for_generation`` and ``disable_gradient_checkpointing``) are dropped; every other warning
    is shown as before. Can go once TRL uses ``activation_checkpointing``'s names."""
    with warnings.catch_warnings():
        for name in DEPRECATED_CHECKPOINTING_CALLS:
            warnings.filterwarnings(
                "ignore",
                message=f"`{name}` is deprecated",
                category=FutureWarning,
                module="transformers.modeling_utils",
            )
        yield
