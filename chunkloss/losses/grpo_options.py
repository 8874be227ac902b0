"""GRPO's options (:class:`GRPOOptions`) and the names of its loss types and importance-sampling levels, read
by both :mod:`chunkloss.losses.grpo` (the loss) and :mod:`chunkloss.losses.grpo_batch` (its inputs)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from chunkloss.engine import FusedOptions
from chunkloss.losses.common import check_choice, check_head_transforms, check_positive, check_range

__all__ = [
    "CLIP_LOSS_TYPES",
    "GLOBAL_COUNT_LOSS_TYPES",
    "GRPOOptions",
    "IS_LEVELS",
    "LOG_RATIO_MIN",
    "LOSS_TYPES",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IS_LEVELS = ("token", "sequence", "sequence_token")
#: The PPO-clip loss types; TRL logs ``clip_ratio/*`` for these.
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
#: The loss types normalised by the global masked-token count ``num_items_in_batch``.
GLOBAL_COUNT_LOSS_TYPES = ("dapo", "cispo", "vespo")
#: TRL clamps log importance weights from below at log(1e-8).
LOG_RATIO_MIN = math.log(1e-8)


@dataclass(frozen=True)
class GRPOOptions(FusedOptions):
    """The options of :class:`~chunkloss.losses.grpo.FusedLinearGRPOLoss`, its constructor's keywords
    (GRPOConfig's names, except ``epsilon_low`` for TRL's ``epsilon``).

    Args:
        loss_type: one of ``LOSS_TYPES``: 'grpo', 'bnpo', 'dr_grpo', 'dapo' (TRL's default), 'cispo',
            'sapo', 'luspo', 'vespo'.
        beta: KL coefficient; needs ``ref_logps`` or a reference head when non-zero.
        epsilon_low: lower clip ε (TRL's ``epsilon``).
        epsilon_high: upper clip ε (cispo: the ratio cap ε_max); ``None`` means ``epsilon_low``.
        delta: two-sided clip: the ratio is first clamped at ``delta`` (INTELLECT-2); ``None`` for off.
        importance_sampling_level: 'token', 'sequence' (GSPO) or 'sequence_token' (GSPO-token).
        sapo_temperature_pos, sapo_temperature_neg: SAPO gate temperatures τ_pos, τ_neg.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO Gamma weight parameters.
        use_bias_correction_kl: multiply the KL term by the importance ratio (DeepSeek-V3.2).
        temperature: the logits (policy and reference) are divided by it.
        logit_scale: the logits are first multiplied by it (Cohere's ``logit_scale``).
        softcap: final logit softcapping ``c·tanh(z/c)`` after the scale, before the temperature
            (Gemma-2's ``final_logit_softcapping``); ``None`` for off.
        off_policy_mask_threshold: drop negative-advantage sequences whose mean KL(sampler ‖ policy)
            exceeds it (DeepSeek-V3.2 off-policy sequence masking); ``None`` for off.
        top_entropy_quantile: keep only the top ρ of tokens by entropy in the policy loss (1.0: all).
        entropy_coef: coefficient of the entropy bonus (loss -= coef · mean entropy / GA); ≠ 0 switches
            the bonus on, and a call may pass another value (see ``forward``).
        use_adaptive_entropy: must be False: the adaptive controller is trainer state; pass its current
            coefficient to each call as ``entropy_coef``.
        max_completion_length: the dr_grpo normaliser's constant (required for dr_grpo).
    """

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = True
    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    max_completion_length: int | None = None

    def __post_init__(self):
        super().__post_init__()
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IS_LEVELS)
        if self.loss_type == "dr_grpo" and (
            self.max_completion_length is None or self.max_completion_length <= 0
        ):
            raise ValueError(
                "loss_type='dr_grpo' normalises by B·max_completion_length: pass max_completion_length "
                f"(a positive int), got {self.max_completion_length!r}"
            )
        if self.use_adaptive_entropy:
            raise ValueError(
                "use_adaptive_entropy=True is not supported: the adaptive controller is trainer state that "
                "changes entropy_coef between optimizer steps; pass its current value to each call as "
                "entropy_coef (the constructor's entropy_coef != 0 switches the bonus on)"
            )
        check_positive("temperature", self.temperature)
        check_head_transforms(self)
        check_range("top_entropy_quantile", self.top_entropy_quantile, 0, 1)
        if self.sapo_temperature_pos <= 0 or self.sapo_temperature_neg <= 0:
            raise ValueError("sapo_temperature_pos and sapo_temperature_neg must be positive")

    @property
    def eps_high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_sequence_path(self) -> bool:
        """Whether some per-sequence statistic of the policy log-probs enters the loss."""
        return (
            self.importance_sampling_level != "token"
            or self.loss_type == "vespo"
            or self.off_policy_mask_threshold is not None
            or self.top_entropy_quantile < 1.0
        )
