"""Chunked linear + ORPO (Hong et al., arXiv:2403.07691).

Equals ``trl.experimental.orpo.ORPOTrainer.get_batch_loss_metrics`` (TRL 1.16)::

    L = NLL_chosen - mean_pairs β·logσ(log_odds)
    log_odds = (ℓ_c - ℓ_r) - (log(1 - e^ℓ_c) - log(1 - e^ℓ_r))

with ℓ the mean per-token log-prob over the completion labels (``chosen``/``rejected``) and
``NLL_chosen`` the mean cross-entropy of the chosen rows over ``nll_labels`` (TRL takes the prompt
and completion tokens of the chosen rows: pass them as ``nll_labels``; default: ``chosen``).
Metrics (TRL's names): rewards/* (β·ℓ), logps/*, logits/* (mean logit over completion tokens; TRL
averages over every position, padding included: pass ``logit_rows`` all True for that), nll_loss,
log_odds_ratio (mean logσ(log_odds)), log_odds_chosen (mean log_odds). A pair with an empty
completion (TRL: NaN) adds 0 to the odds-ratio term and to the two log-odds metrics, and still
counts in the mean over pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkloss.losses.common import log1mexp
from chunkloss.losses.preference import FusedLinearPreferenceLoss, PreferenceOptions

__all__ = ["FusedLinearORPOLoss", "ORPOOptions"]


@dataclass(frozen=True)
class ORPOOptions(PreferenceOptions):
    """The options of :class:`FusedLinearORPOLoss`, its constructor's keywords. ORPO fixes what the base
    leaves to options: ℓ is the mean completion log-prob and the NLL term weighs 1.

    Args:
        beta: λ, the weight of the odds-ratio term (``ORPOConfig.beta``).
        ignore_index: label value of prompt and padding tokens (their rows cost no GEMM).
        logit_scale: the logits are multiplied by it (Cohere's ``logit_scale``).
        softcap: final logit softcapping ``c·tanh(z/c)`` after the scale (Gemma-2), ``None`` for off.
        return_token_metrics: also report ``entropy`` and ``mean_token_accuracy`` (one more reduction
            over V per row).
    """

    avg_logps = True
    nll_coef = 1.0


def orpo_pair_loss(pair, scalars, opts: ORPOOptions):
    """``-β·logσ(log_odds)`` per pair, as ``ORPOTrainer.odds_ratio_loss`` (TRL 1.16)."""
    valid = pair.valid
    # Empty completions give ℓ = 0 and log(1 - e^0) = -inf: stand in a finite value, masked below.
    c = torch.where(valid, pair.chosen, -1.0)
    r = torch.where(valid, pair.rejected, -1.0)
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    ratio = torch.where(valid, F.logsigmoid(log_odds), 0.0)
    metrics = {"log_odds_ratio": ratio, "log_odds_chosen": torch.where(valid, log_odds, 0.0)}
    return -opts.beta * ratio, opts.beta * pair.chosen, opts.beta * pair.rejected, metrics


class FusedLinearORPOLoss(FusedLinearPreferenceLoss):
    """ORPO over the chunked LM head.

    Example::

        loss_fn = FusedLinearORPOLoss(beta=0.1)
        loss = loss_fn(hidden, lm_head.weight, chosen, rejected, bias=lm_head.bias)  # hidden (2B, T, H)
        loss_fn.metrics["log_odds_ratio"]

    Metrics (TRL's names): ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``,
    ``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen``; with ``return_token_metrics`` also ``entropy``
    and ``mean_token_accuracy``.
    """

    options_cls = ORPOOptions
    options: ORPOOptions
    uses_nll = True
    pair_loss = staticmethod(orpo_pair_loss)
