"""Chunked linear + DPO (arXiv:2305.18290) and the loss family of ``trl.DPOTrainer``.

Equals the loss of ``trl.DPOTrainer._compute_loss`` (TRL 1.16, ``trl/trainer/dpo_trainer.py``) on
the policy's sequence log-probs ``ℓ = Σ_t w_t log π(y_t)`` and the reference's ``ℓ_ref``::

    r_c = ℓ_c - ℓ_ref,c,   r_r = ℓ_r - ℓ_ref,r                 (log-ratios)
    s = f'(exp r)           score per f_divergence_type (reverse_kl: s = r)
    L = Σ_k weight_k · mean_pairs loss_k(s_c - s_r, r_c, r_r, ...)   (× WPO weights)

with every ``loss_type`` TRL 1.16 accepts: sigmoid, hinge, ipo, exo_pair, nca_pair, robust,
bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft, sigmoid_norm (each as
written there), ``label_smoothing``, the f-divergences (reverse_kl, forward_kl, js_divergence,
alpha_divergence), ``ld_alpha`` (LD-DPO: tokens past the shorter completion of the pair weigh α) and
``use_weighting`` (WPO, arXiv:2406.11827: each pair's loss × exp(mean_t(log p - log Σ p²)) of both
completions, without grad). TRL 1.16's ``bco_pair`` has no running reward mean (older TRL
versions subtracted one kept in trainer state); it is exactly ``-logσ(β r_c) - logσ(-β r_r)``.

The reference is the reference model's head, projected chunk by chunk without grad in the same pass
(``ref_hidden``/``ref_weight``), precomputed sequence log-probs (``ref_chosen_logps``/...), or none
(reference-free: ℓ_ref = 0). ``aot`` and ``aot_unpaired`` sort the pairs of the whole batch, so they
always take the engine's two passes. Metrics (TRL's names): rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, logits/chosen, logits/rejected,
and with ``return_token_metrics`` entropy and mean_token_accuracy (as DPOTrainer logs them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from chunkloss.losses.common import check_choice, check_range
from chunkloss.losses.preference import FusedLinearPreferenceLoss, PreferenceOptions

__all__ = ["DPOOptions", "FusedLinearDPOLoss", "DPO_LOSS_TYPES"]

DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
    "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# TRL 1.16: the f-DPO reparameterisation is only valid for these (its own check).
_F_DIVERGENCE_LOSS_TYPES = {
    "sigmoid",
    "sigmoid_norm",
    "hinge",
    "ipo",
    "exo_pair",
    "robust",
    "discopop",
    "sft",
}


@dataclass(frozen=True)
class DPOOptions(PreferenceOptions):
    """The options of :class:`FusedLinearDPOLoss`, its constructor's keywords (names and defaults of
    ``trl.DPOConfig`` 1.16).

    Args:
        beta: β of the loss and the rewards.
        loss_type: one loss type of ``DPO_LOSS_TYPES`` or a sequence of them (weighted by
            ``loss_weights`` and summed).
        loss_weights: weight of each loss type; ``None`` weighs each 1.
        label_smoothing: ε of robust, exo_pair and aot (conservative DPO).
        f_divergence_type: 'reverse_kl' (standard DPO), 'forward_kl', 'js_divergence' or
            'alpha_divergence'.
        f_alpha_divergence_coef: α of alpha_divergence.
        ld_alpha: LD-DPO's α in [0, 1] for tokens past the shorter completion of a pair; ``None``: off.
        use_weighting: WPO weights (no grad) on each pair's loss.
        discopop_tau: τ of discopop.
        average_log_prob: the sequence log-prob is the mean over completion tokens instead of the sum
            (not a TRL option; TRL sums).
        ignore_index: label value of prompt and padding tokens (their rows cost no GEMM).
        logit_scale: the logits are multiplied by it (Cohere's ``logit_scale``).
        softcap: final logit softcapping ``c·tanh(z/c)`` after the scale (Gemma-2), ``None`` for off.
        return_token_metrics: also report ``entropy`` (mean over the chosen and rejected completion
            tokens) and ``mean_token_accuracy`` (top-1 over the chosen completion tokens), as
            DPOTrainer logs them; one more reduction over V per row.
    """

    loss_type: str | Sequence[str] = "sigmoid"  # a tuple once validated
    loss_weights: Sequence[float] | None = None  # a tuple once validated
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    ld_alpha: float | None = None
    use_weighting: bool = False
    discopop_tau: float = 0.05
    average_log_prob: bool = False

    def __post_init__(self):
        super().__post_init__()
        types = (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)
        object.__setattr__(self, "loss_type", types)
        if not types:
            raise ValueError("loss_type must name at least one loss type")
        bad = [t for t in types if t not in DPO_LOSS_TYPES]
        if bad:
            raise ValueError(f"unknown loss_type {bad}; supported: {list(DPO_LOSS_TYPES)}")
        weights = (1.0,) * len(types) if self.loss_weights is None else tuple(map(float, self.loss_weights))
        if len(weights) != len(types):
            raise ValueError(
                f"loss_weights must have one weight per loss_type: {len(weights)} weights for {list(types)}"
            )
        object.__setattr__(self, "loss_weights", weights)
        check_choice("f_divergence_type", self.f_divergence_type, F_DIVERGENCES)
        if self.f_divergence_type != "reverse_kl" and not set(types) <= _F_DIVERGENCE_LOSS_TYPES:
            raise ValueError(
                f"f_divergence_type={self.f_divergence_type!r} only supports loss types "
                f"{sorted(_F_DIVERGENCE_LOSS_TYPES)}, got {list(types)} (as TRL 1.16)"
            )
        if self.use_weighting and {"aot", "aot_unpaired"} & set(types):
            raise ValueError(
                "use_weighting (WPO) is not defined for 'aot'/'aot_unpaired', which sort the pairs"
            )
        if "exo_pair" in types and not 0.0 < self.label_smoothing < 1.0:
            raise ValueError(
                f"'exo_pair' needs 0 < label_smoothing < 1 (EXO suggests 1e-3), got {self.label_smoothing}"
            )
        check_range("label_smoothing", self.label_smoothing, 0, 1)
        if "robust" in types and not self.label_smoothing < 0.5:
            raise ValueError(f"'robust' needs label_smoothing in [0, 0.5), got {self.label_smoothing}")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must be in [0, 1] or None, got {self.ld_alpha}")
        if self.discopop_tau <= 0:
            raise ValueError(f"discopop_tau must be positive, got {self.discopop_tau}")

    @property
    def avg_logps(self) -> bool:
        return self.average_log_prob

    @property
    def wpo(self) -> bool:
        return self.use_weighting


def _scores(logratios: Tensor, opts: DPOOptions) -> Tensor:
    """f'(exp(r)) of the f-divergence (TRL's ``chosen_scores``)."""
    kind = opts.f_divergence_type
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence" and abs(opts.f_alpha_divergence_coef - 1.0) >= 1e-6:
        a = opts.f_alpha_divergence_coef
        return (torch.exp(torch.clamp((a - 1.0) * logratios, max=80.0)) - 1.0) / (a - 1.0)
    return logratios


def dpo_pair_loss(pair, scalars, opts: DPOOptions):
    """Per-pair loss of ``trl.DPOTrainer._compute_loss`` (TRL 1.16), its loss-type loop verbatim."""
    beta, eps = opts.beta, opts.label_smoothing
    chosen, rejected = pair.chosen, pair.rejected
    chosen_logratios = chosen - pair.ref_chosen
    rejected_logratios = rejected - pair.ref_rejected
    chosen_scores, rejected_scores = _scores(chosen_logratios, opts), _scores(rejected_logratios, opts)
    delta_score = chosen_scores - rejected_scores
    n_c, n_r = pair.n_chosen.clamp(min=1.0), pair.n_rejected.clamp(min=1.0)
    if opts.use_weighting:
        # WPO (Eq. 2): exp of the mean aligned log-prob of each completion, no grad.
        wpo = torch.exp(pair.wpo_chosen / n_c) * torch.exp(pair.wpo_rejected / n_r)
    loss = torch.zeros_like(chosen)
    for loss_type, loss_weight in zip(opts.loss_type, opts.loss_weights):
        if loss_type == "sigmoid":
            per = -F.logsigmoid(beta * delta_score)
        elif loss_type == "hinge":
            per = torch.relu(1 - beta * delta_score)
        elif loss_type == "ipo":
            per = (chosen_scores / n_c - rejected_scores / n_r - 1 / (2 * beta)) ** 2
        elif loss_type == "exo_pair":
            qw, log_qw = torch.sigmoid(beta * delta_score), F.logsigmoid(beta * delta_score)
            ql, log_ql = torch.sigmoid(-beta * delta_score), F.logsigmoid(-beta * delta_score)
            per = qw * (log_qw - math.log1p(-eps)) + ql * (log_ql - math.log(eps))
        elif loss_type == "nca_pair":
            rc, rr = beta * chosen_logratios, beta * rejected_logratios
            per = -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr)
        elif loss_type == "robust":
            clean = -(1 - eps) * F.logsigmoid(beta * delta_score)
            flipped = -eps * F.logsigmoid(-beta * delta_score)
            per = (clean - flipped) / (1 - 2 * eps)
        elif loss_type == "bco_pair":
            per = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
        elif loss_type == "sppo_hard":
            per = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif loss_type in ("aot", "aot_unpaired"):
            if loss_type == "aot":
                a, b = chosen - rejected, pair.ref_chosen - pair.ref_rejected
            else:
                a, b = chosen_logratios, rejected_logratios
            delta = torch.sort(a, dim=0)[0] - torch.sort(b, dim=0)[0]
            per = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
        elif loss_type == "apo_zero":
            per = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
        elif loss_type == "apo_down":
            per = (
                torch.sigmoid(beta * chosen_logratios)
                + 1
                - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
            )
        elif loss_type == "discopop":
            logits = delta_score * beta
            mod = torch.sigmoid(logits / opts.discopop_tau)
            per = -F.logsigmoid(logits) * (1 - mod) + torch.exp(-logits) * mod
        elif loss_type == "sft":
            # The mean NLL over every chosen completion token of the batch, the same for each pair.
            if opts.use_weighting:  # × per-pair weights: needs the whole batch (two passes)
                per = (-pair.raw_chosen.sum() / scalars.n_chosen_tokens).expand_as(chosen)
            else:  # spread over the pairs, so that a chunk of whole pairs adds up its share
                per = -pair.raw_chosen * (scalars.n_pairs / scalars.n_chosen_tokens)
        else:  # sigmoid_norm
            per = -F.logsigmoid(beta * (chosen_scores / n_c - rejected_scores / n_r))
        if opts.use_weighting:
            per = per * wpo
        loss = loss + loss_weight * per
    return loss, beta * chosen_logratios, beta * rejected_logratios, {}


# Loss types that are functions of the pair's margin alone (``FusedLinearPreferenceLoss.margin_power``):
# of the scores' difference, or of the difference of the scores over the completion lengths.
_MARGIN_TYPES = ({"sigmoid", "hinge", "exo_pair", "robust", "discopop"}, {"ipo", "sigmoid_norm"})


def dpo_margin_power(opts: DPOOptions) -> int | None:
    """``margin_power`` of ``dpo_pair_loss``: with the identity f-divergence scores (reverse KL, or α = 1), a
    loss of margin-only types of one kind; averaged log-probs divide by n once more."""
    kind, a = opts.f_divergence_type, opts.f_alpha_divergence_coef
    if not (kind == "reverse_kl" or (kind == "alpha_divergence" and abs(a - 1.0) < 1e-6)):
        return None
    types = set(opts.loss_type)
    for p, group in enumerate(_MARGIN_TYPES):
        if types <= group:
            return p + int(opts.avg_logps)
    return None


class FusedLinearDPOLoss(FusedLinearPreferenceLoss):
    """DPO family of ``trl.DPOTrainer`` (TRL 1.16) over the chunked LM head.

    Example::

        loss_fn = FusedLinearDPOLoss(beta=0.1, loss_type="sigmoid")
        loss = loss_fn(hidden, lm_head.weight, chosen, rejected,       # hidden (2B, T, H)
                       ref_hidden=ref_hidden, ref_weight=ref_lm_head.weight)
        loss_fn.metrics["rewards/margins"]

    Metrics (TRL's names): ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``; with
    ``return_token_metrics`` also ``entropy`` and ``mean_token_accuracy``.
    """

    options_cls = DPOOptions
    options: DPOOptions
    uses_reference = True
    pair_loss = staticmethod(dpo_pair_loss)
    margin_power = staticmethod(dpo_margin_power)

    @property
    def needs_global_stats(self) -> bool:
        """aot sorts the pairs of the whole batch, and WPO-weighted sft multiplies two batch sums: the loss
        needs every pair's log-probs at once."""
        types = set(self.options.loss_type)
        return bool({"aot", "aot_unpaired"} & types) or ("sft" in types and self.options.use_weighting)

    def token_weights(self, chosen_mask: Tensor, rejected_mask: Tensor) -> Tensor:
        """LD-DPO: completion tokens past the shorter completion of the pair weigh ``ld_alpha``."""
        mask = torch.cat([chosen_mask, rejected_mask])
        alpha = self.options.ld_alpha
        if alpha is None:
            return mask.float()
        pos = mask.cumsum(dim=1)
        shared = torch.minimum(chosen_mask.sum(1), rejected_mask.sum(1)).repeat(2).unsqueeze(1)
        return torch.where(pos > shared, alpha, 1.0) * mask
