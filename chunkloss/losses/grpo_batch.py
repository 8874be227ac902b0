"""GRPO's inputs, checked and turned into the tensors of the engine's ``Batch``.

The loss and its per-chunk math are in :mod:`chunkloss.losses.grpo`; the normalisers follow its module
docstring.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from chunkloss.engine import ExtraHead, Rows, Sequences
from chunkloss.losses.common import check_head, check_labels, item_count, to_scalar
from chunkloss.losses.grpo_options import LOG_RATIO_MIN, GRPOOptions, Normaliser


@dataclass
class GRPORows(Rows):
    """Per completion token that takes part."""

    ids: Tensor  # (N,) int64 the sampled token
    adv: Tensor  # (N,) its sequence's (or its own) advantage
    weight: Tensor  # (N,) 1 / the loss type's normaliser
    seq: Tensor  # (N,) int64 its sequence
    inv_len: Tensor  # (N,) 1 / its sequence's length
    old_logps: Tensor | None = None  # (N,) the sampling policy's log-prob (None: on-policy)
    ref_logps: Tensor | None = None  # (N,) the reference's log-prob (without a reference head)
    sampling_logps: Tensor | None = None  # (N,) the sampler's log-prob (off-policy mask)
    is_ratio: Tensor | None = None  # (N,) vLLM's importance-sampling ratio


@dataclass
class GRPOSequences(Sequences):
    """Per completion."""

    length: Tensor  # (S,) its tokens that take part
    index: Tensor  # (S,) int64 its index in the batch
    adv: Tensor | None = None  # (S,) its advantage, where advantages are per sequence
    vespo_log_is: Tensor | None = None  # (S,) Σ_t log of vLLM's ratio (vespo)


@dataclass
class GRPOScalars:
    """The batch's tensors."""

    n_valid: Tensor  # 0-d tokens that take part (at least 1)
    n_bonus: Tensor  # 0-d the entropy bonus's normaliser
    n_seqs: Tensor  # 0-d sequences (at least 1)
    grad_accum: Tensor  # 0-d TRL's gradient-accumulation steps
    policy_scale: Tensor  # 0-d scale of the logged ``policy_loss``
    seq_zeros: Tensor  # (B + 1,) zeros the per-sequence clip flags are added into
    entropy_coef: Tensor | None = None  # 0-d this call's entropy-bonus coefficient (bonus on)
    entropy_threshold: Tensor | None = None  # 0-d the entropy mask's threshold, where the engine estimates it


def check_trainer_state(num_processes, gradient_accumulation_steps, steps_per_generation) -> None:
    """Trainer state divides the normaliser: 0 (or less) would make the loss inf, NaN or silently 0."""
    for arg, v in (
        ("num_processes", num_processes),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
        ("steps_per_generation", steps_per_generation),
    ):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v > 0:
            raise ValueError(f"{arg} must be a positive number, got {v!r}")


def check_completions(hidden, weight, completion_ids, completion_mask, tool_mask) -> tuple[Tensor, list]:
    """The mask of the rows that take part (B, T) bool, and the deferred checks of the inputs: each mask
    value is 0 or 1, and each id is in [0, V) where the mask is 1 (ids outside the mask are never read). The
    checks sync in ``sequence_batch``'s one host sync, raising there before any id is used."""
    b, t, _ = hidden.shape
    dev = hidden.device
    label_checks = []
    check_bt(completion_ids, (b, t), "completion_ids", dev)
    check_bt(completion_mask, (b, t), "completion_mask", dev)
    _check_zero_one(completion_mask, "completion_mask", label_checks)
    mask = completion_mask.bool()
    if tool_mask is not None:
        check_bt(tool_mask, (b, t), "tool_mask", dev)
        _check_zero_one(tool_mask, "tool_mask", label_checks)
        mask = mask & tool_mask.bool()
    ids = completion_ids.masked_fill(~mask, 0)
    check_labels(ids, (b, t), weight.shape[0], None, name="completion_ids", defer=label_checks)
    return mask, label_checks


def check_advantages_and_ratio(opts: GRPOOptions, hidden, advantages, importance_sampling_ratio) -> None:
    """``advantages`` (B,) or (B, T); vLLM's ratio (B, T), (B, 1) or (B,), token-level for vespo."""
    b, t, _ = hidden.shape
    dev = hidden.device
    if not isinstance(advantages, Tensor) or advantages.shape not in ((b,), (b, t)):
        raise ValueError(
            f"advantages must be (B,)=({b},) or (B, T)=({b}, {t}), got "
            f"{tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__}"
        )
    if advantages.device != dev:
        raise ValueError(f"advantages is on {advantages.device} but hidden is on {dev}")
    isr = importance_sampling_ratio
    if isr is None:
        return
    if not isinstance(isr, Tensor):
        raise TypeError(f"importance_sampling_ratio must be a torch.Tensor, got {type(isr).__name__}")
    if isr.shape not in ((b, t), (b, 1), (b,)):
        raise ValueError(
            f"importance_sampling_ratio must be (B, T)=({b}, {t}), (B, 1) or (B,), got {tuple(isr.shape)}"
        )
    if isr.device != dev:
        raise ValueError(f"importance_sampling_ratio is on {isr.device} but hidden is on {dev}")
    if opts.loss_type.sequence_weight and isr.shape != (b, t):
        raise ValueError(
            f"{opts.loss_type} needs a token-level importance_sampling_ratio (B, T) (TRL's token_* modes)"
        )


def reference_head(opts: GRPOOptions, hidden, weight, ref_logps, ref_hidden, ref_weight, ref_bias) -> list:
    """The reference model's head as the batch's extra head (no grad), or ``[]`` where the reference is
    ``ref_logps`` or ``beta`` is 0."""
    if opts.beta == 0.0:
        return []
    if ref_logps is not None and ref_hidden is not None:
        raise ValueError("pass either ref_logps or a reference head (ref_hidden, ref_weight), not both")
    if ref_hidden is None:
        if ref_logps is None:
            raise ValueError(f"beta={opts.beta} needs ref_logps or a reference head (ref_hidden, ref_weight)")
        return []
    if ref_weight is None:
        raise ValueError("ref_hidden needs ref_weight")
    check_head(ref_hidden, ref_weight, ref_bias, name="ref_hidden")
    b, t, _ = hidden.shape
    if ref_hidden.shape[:-1] != (b, t) or ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"reference head must give (B, T, V)=({b}, {t}, {weight.shape[0]}) logits, "
            f"got ref_hidden {tuple(ref_hidden.shape)} and ref_weight {tuple(ref_weight.shape)}"
        )
    if ref_hidden.device != hidden.device:
        raise ValueError(f"ref_hidden is on {ref_hidden.device} but hidden is on {hidden.device}")
    ref_b = None if ref_bias is None else ref_bias.detach()
    return [ExtraHead(ref_hidden.detach().reshape(b * t, -1), ref_weight.detach(), ref_b)]


def normaliser(opts: GRPOOptions, mask, num_items_in_batch, num_processes, ga: float, spg) -> Tensor:
    """What the summed per-token loss is divided by (the loss type's ``Normaliser``): per row (B, T) for
    ``SEQUENCE_MEAN`` (each sequence's length times B times GA), else one 0-d count."""
    b, t = mask.shape
    dev = mask.device
    f32 = torch.float32
    kind = opts.loss_type.normaliser
    if kind is Normaliser.SEQUENCE_MEAN:
        return (mask.sum(-1).to(f32).clamp(min=1.0) * b * ga).unsqueeze(1).expand(b, t)
    if kind is Normaliser.LOCAL_TOKENS:
        return mask.sum().clamp(min=1).to(f32) * ga
    if kind is Normaliser.MAX_LENGTH:
        return to_scalar(float(b * opts.max_completion_length) * ga, dev)
    if kind is Normaliser.SEQUENCES:
        return to_scalar(float(b) * ga, dev)
    # Normaliser.GLOBAL_TOKENS
    items = mask.sum() if num_items_in_batch is None else item_count(num_items_in_batch, dev)
    return items.to(f32).clamp(min=1.0) / num_processes * ga / spg


def batch_tensors(opts: GRPOOptions, completion_ids, mask, advantages, per_token, isr, norm, ga: float):
    """The batch's per-row (B, T), per-sequence (B,) and whole-batch tensors."""
    b, t = mask.shape
    dev = mask.device
    f32 = torch.float32
    n_valid = mask.sum().clamp(min=1).to(f32)
    len_s = mask.sum(-1).to(f32)
    adv = advantages.to(f32)
    optional = {
        name: None if v is None else check_bt(v, (b, t), name, dev).to(f32) for name, v in per_token.items()
    }
    token = GRPORows(
        ids=completion_ids.long(),
        adv=adv.unsqueeze(1).expand(b, t) if adv.dim() == 1 else adv,
        weight=(1.0 / norm).expand(b, t),
        seq=torch.arange(b, device=dev).unsqueeze(1).expand(b, t),
        inv_len=(1.0 / len_s.clamp(min=1.0)).unsqueeze(1).expand(b, t),
        is_ratio=None if isr is None else isr.to(f32).reshape(b, -1).expand(b, t),
        **optional,
    )
    vespo_log_is = None
    if opts.loss_type.sequence_weight:
        vespo_log_is = (
            torch.zeros(b, device=dev)
            if isr is None
            else torch.clamp(torch.log(isr.to(f32)), LOG_RATIO_MIN, 20.0).sum(-1)
        )
    sequence = GRPOSequences(
        length=len_s,
        index=torch.arange(b, device=dev),
        adv=adv if adv.dim() == 1 else None,
        vespo_log_is=vespo_log_is,
    )
    scalars = GRPOScalars(
        n_valid=n_valid,
        n_bonus=n_valid,
        n_seqs=to_scalar(max(b, 1), dev),
        grad_accum=to_scalar(ga, dev),
        policy_scale=to_scalar(1.0 if opts.loss_type.global_count else ga, dev),
        # One slot more than there are sequences (dropped in _finish_metrics): inductor's CPU codegen
        # (torch 2.13) fails on an index_add into a 1-element buffer, i.e. a batch of one sequence.
        seq_zeros=torch.zeros(b + 1, device=dev),
    )
    return token, sequence, scalars


def _check_zero_one(mask: Tensor, name: str, defer: list) -> None:
    """Append to ``defer`` (``sequence_batch``'s ``host_checks``) the check that every value of ``mask`` is 0
    or 1: the loss reads it as a bool, so another value (a weight, NaN) would count as 1 where TRL's masked
    sums weigh by it."""
    if mask.dtype == torch.bool:
        return
    bad = (mask != 0) & (mask != 1)

    def check(n_bad: int) -> None:
        if n_bad:
            raise ValueError(
                f"{name} holds {mask[bad][0].item()}, outside {{0, 1}} (1 marks a token that takes part)"
            )

    defer.append((bad.sum(), check))


def check_bt(x, shape, name: str, device: torch.device) -> Tensor:
    """``x`` itself, checked to be a (B, T) tensor on ``device``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must be (B, T)={tuple(shape)}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but hidden is on {device}")
    return x
