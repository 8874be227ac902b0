"""GRPO's options (:class:`GRPOOptions`), its loss types (:class:`GRPOLossType`, with the table of what each
one does) and importance-sampling levels, read by :mod:`chunkloss.losses.grpo` (the loss),
:mod:`chunkloss.losses.grpo_batch` (its inputs), the reference and the trainer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from chunkloss.engine import FusedOptions
from chunkloss.losses.common import check_choice, check_head_transforms, check_positive, check_range

__all__ = [
    "CLIP_LOSS_TYPES",
    "GLOBAL_COUNT_LOSS_TYPES",
    "ClipMetrics",
    "GRPOLossType",
    "GRPOOptions",
    "IS_LEVELS",
    "LOG_RATIO_MIN",
    "LOSS_TYPES",
    "Normaliser",
    "PolicyTerm",
]


class PolicyTerm(Enum):
    """The per-token policy loss ℓ_t (``w`` the importance weight, ``A`` the advantage)."""

    CLIP = "clip"  # -min(w·A, clip(w, 1-ε_low, 1+ε_high)·A), w first clamped at ``delta`` when set
    CISPO = "cispo"  # -sg(min(w, ε_high))·A·logp
    SAPO = "sapo"  # -σ(τ·(w-1))·4/τ·A, τ = τ_pos if A > 0 else τ_neg
    VESPO = "vespo"  # -φ(W)·A·logp, φ(W) = e^λ·W^k·e^{-λW} (no grad), W = Π_t w_t·ρ_t (ρ: vLLM's ratio)


class Normaliser(Enum):
    """What the masked sum Σ ℓ is divided by (``GA``: gradient-accumulation steps, ``B``: sequences)."""

    SEQUENCE_MEAN = "sequence_mean"  # each sequence by its length: Σ_s (Σ_t ℓ / |s|) / B / GA
    LOCAL_TOKENS = "local_tokens"  # N_local (this batch's masked tokens) · GA
    MAX_LENGTH = "max_length"  # B · max_completion_length · GA
    SEQUENCES = "sequences"  # B · GA
    GLOBAL_TOKENS = "global_tokens"  # num_items_in_batch / num_processes · GA / steps_per_generation


class ClipMetrics(Enum):
    """The ratio metrics a loss type logs (TRL's names; VESPO logs its mean weight where the others log clip
    ratios)."""

    CLIP_RATIO = (
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    )
    CISPO = ("cispo_clip_ratio",)
    VESPO_PHI = ("vespo/phi_seq_mean",)
    NONE = ()


class GRPOLossType(str, Enum):
    """TRL 1.16's GRPO loss types: each member is its ``loss_type`` string (it compares, hashes and prints as
    that string) and carries its row of the table below, which the loss, the batch, the reference and the
    trainer read.

    Attributes:
        term: the per-token policy loss.
        normaliser: how the batch's summed loss is normalised.
        clip_metrics: the ratio metrics it logs.
        global_count, sequence_weight: derived from the row (see each).
    """

    term: PolicyTerm
    normaliser: Normaliser
    clip_metrics: ClipMetrics

    # fmt: off
    #         loss_type   term               normaliser                  clip_metrics
    GRPO    = "grpo",     PolicyTerm.CLIP,   Normaliser.SEQUENCE_MEAN,   ClipMetrics.CLIP_RATIO
    BNPO    = "bnpo",     PolicyTerm.CLIP,   Normaliser.LOCAL_TOKENS,    ClipMetrics.CLIP_RATIO
    DR_GRPO = "dr_grpo",  PolicyTerm.CLIP,   Normaliser.MAX_LENGTH,      ClipMetrics.CLIP_RATIO
    DAPO    = "dapo",     PolicyTerm.CLIP,   Normaliser.GLOBAL_TOKENS,   ClipMetrics.CLIP_RATIO
    CISPO   = "cispo",    PolicyTerm.CISPO,  Normaliser.GLOBAL_TOKENS,   ClipMetrics.CISPO
    SAPO    = "sapo",     PolicyTerm.SAPO,   Normaliser.SEQUENCE_MEAN,   ClipMetrics.NONE
    LUSPO   = "luspo",    PolicyTerm.CLIP,   Normaliser.SEQUENCES,       ClipMetrics.CLIP_RATIO
    VESPO   = "vespo",    PolicyTerm.VESPO,  Normaliser.GLOBAL_TOKENS,   ClipMetrics.VESPO_PHI
    # fmt: on

    def __new__(cls, value: str, term: PolicyTerm, normaliser: Normaliser, clip_metrics: ClipMetrics):
        member = str.__new__(cls, value)
        member._value_ = value
        member.term, member.normaliser, member.clip_metrics = term, normaliser, clip_metrics
        return member

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def global_count(self) -> bool:
        """Normalised by the global masked-token count ``num_items_in_batch`` (the trainer passes it), so the
        logged ``policy_loss`` is not multiplied back by GA."""
        return self.normaliser is Normaliser.GLOBAL_TOKENS

    @property
    def sequence_weight(self) -> bool:
        """The term weighs each token by a statistic of its whole sequence (the loss runs its sequence path),
        and vLLM's importance-sampling ratio (token-level, whenever given) enters that weight instead of
        multiplying the per-token loss."""
        return self.term is PolicyTerm.VESPO


LOSS_TYPES = tuple(t.value for t in GRPOLossType)
IS_LEVELS = ("token", "sequence", "sequence_token")
#: The PPO-clip loss types; TRL logs ``clip_ratio/*`` for these.
CLIP_LOSS_TYPES = tuple(t.value for t in GRPOLossType if t.clip_metrics is ClipMetrics.CLIP_RATIO)
#: The loss types normalised by the global masked-token count ``num_items_in_batch``.
GLOBAL_COUNT_LOSS_TYPES = tuple(t.value for t in GRPOLossType if t.global_count)
#: TRL clamps log importance weights from below at log(1e-8).
LOG_RATIO_MIN = math.log(1e-8)


@dataclass(frozen=True)
class GRPOOptions(FusedOptions):
    """The options of :class:`~chunkloss.losses.grpo.FusedLinearGRPOLoss`, its constructor's keywords
    (GRPOConfig's names, except ``epsilon_low`` for TRL's ``epsilon``).

    Args:
        loss_type: one of ``LOSS_TYPES``: 'grpo', 'bnpo', 'dr_grpo', 'dapo' (TRL's default), 'cispo',
            'sapo', 'luspo', 'vespo'; held as its :class:`GRPOLossType` (a ``str``).
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
        object.__setattr__(self, "loss_type", GRPOLossType(self.loss_type))
        check_choice("importance_sampling_level", self.importance_sampling_level, IS_LEVELS)
        if self.loss_type.normaliser is Normaliser.MAX_LENGTH and (
            self.max_completion_length is None or self.max_completion_length <= 0
        ):
            raise ValueError(
                f"loss_type={self.loss_type.value!r} normalises by B·max_completion_length: pass "
                f"max_completion_length (a positive int), got {self.max_completion_length!r}"
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
            or self.loss_type.sequence_weight
            or self.off_policy_mask_threshold is not None
            or self.top_entropy_quantile < 1.0
        )
