"""Chunked multi-token prediction: K heads, head k a cross-entropy k tokens further ahead, in one chunk loop.

Head k (k = 0 … K-1) reads its own hidden state ``h_k`` (B, T, H) and predicts ``labels[:, t + k]``, where
``labels`` (B, T) is already shifted for head 0 exactly as for :class:`FusedLinearCrossEntropyLoss`::

    L = Σ_k w_k · (1 / n_k) · Σ_{t < T-k, y_{t+k} ≠ ignore} ℓ(h_k[t] @ W_kᵀ + b_k, y_{t+k})

with ``ℓ`` the cross-entropy of ``chunkloss.losses.cross_entropy`` (label smoothing, softcap, z-loss, …),
``w_k = head_weights[k]`` and ``n_k`` head k's count of targets (``num_items_in_batch`` instead, when given;
1 for ``reduction='sum'``). It equals K separate ``F.cross_entropy`` calls on materialised logits, one per
head, weighted and summed: Medusa (Cai et al. 2024, arXiv:2401.10774; base head k = 0 and Medusa head k
predicting token t+k+1) and DeepSeek-V3's multi-token prediction (arXiv:2412.19437: depth k predicts token
t+k+1 through the shared output head).

Heads that share one weight (and bias) are stacked into one row set: one engine call projects all their rows
through that weight and accumulates one weight gradient. Heads with their own weights get one engine call
each. Each head's hidden gradient comes back to its own input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from chunkloss.engine import Batch, FusedLinearBase, StepKind, register_gpu_steps
from chunkloss.losses.common import LabelRows, check_head, check_labels, item_count
from chunkloss.losses.cross_entropy import CrossEntropyOptions, cross_entropy_kernel_rows, cross_entropy_rows

__all__ = ["FusedLinearMultiTokenLoss", "MultiTokenOptions"]

#: Per-head metric sums the chunk step returns, by the name of the per-row value they sum.
_HEAD_SUMS = {
    "loss": "head_loss",
    "z_loss": "head_z_loss",
    "correct": "head_correct",
    "entropy": "head_entropy",
}
#: Public per-head metric names: ``head{k}/<name>``.
_METRIC_NAMES = {
    "head_loss": "loss",
    "head_z_loss": "z_loss",
    "head_correct": "accuracy",
    "head_entropy": "entropy",
}


@dataclass(frozen=True)
class MultiTokenOptions(CrossEntropyOptions):
    """The options of :class:`FusedLinearMultiTokenLoss`, its constructor's keywords (``head_weights`` also
    by position).

    Args:
        head_weights: ``w_k`` of each head (K floats ≥ 0); ``None`` weighs every head 1.
        ignore_index: label value that takes no part.
        reduction: 'mean' (each head's mean over its targets, weighted and summed), 'sum', or 'none'
            ((K, B, T) per-position ``w_k·loss``, 0 where a head has no target).
        label_smoothing: ε in [0, 1], as in ``F.cross_entropy``.
        lse_square_scale: λ of the z-loss ``λ·logsumexp²``; 0 turns it off.
        softcap: final logit softcapping ``c·tanh(z/c)``, ``None`` for none.
        temperature: the logits are divided by it (after the softcap).
        logit_scale: the logits are multiplied by it first.
        return_token_accuracy: report ``head{k}/accuracy`` (top-1); on by default.
        return_entropy: report each head's mean per-token entropy.
    """

    head_weights: Sequence[float] | None = None  # a tuple once validated
    return_token_accuracy: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.head_weights is None:
            return
        if isinstance(self.head_weights, (str, bytes)) or not isinstance(self.head_weights, Sequence):
            raise TypeError(
                f"head_weights must be a sequence of floats, got {type(self.head_weights).__name__}"
            )
        try:
            weights = tuple(float(w) for w in self.head_weights)
        except (TypeError, ValueError):
            raise TypeError(f"head_weights must hold numbers, got {list(self.head_weights)!r}") from None
        if not weights:
            raise ValueError("head_weights must hold one weight per head (K ≥ 1), got none")
        if not all(math.isfinite(w) and w >= 0 for w in weights):
            raise ValueError(f"head_weights must be finite and ≥ 0, got {weights}")
        object.__setattr__(self, "head_weights", weights)  # hashable: the compiled steps are keyed on it


@dataclass
class MultiTokenRows(LabelRows):
    """Per row of the stacked heads: its label, its head k and that head's weight ``w_k / n_k``."""

    head: Tensor  # (N,) int64 in [0, K)
    row_weight: Tensor  # (N,) fp32


@dataclass
class MultiTokenScalars:
    """The stacked heads' tensors of the whole batch."""

    head_zeros: Tensor  # (K,) zeros: each head's sums are added into a copy
    one: Tensor  # 0-d 1: the cross-entropy kernel's normaliser (the rows carry w_k / n_k)


def _head_sums(
    rows: dict[str, Tensor], token: MultiTokenRows, scalars: MultiTokenScalars, opts: MultiTokenOptions
):
    """The chunk's weighted loss and, per head, the sums of its rows' values (``head_loss`` (K,), …)."""
    per_row = rows["loss"]
    loss = (per_row * token.row_weight).sum()
    zeros, head = scalars.head_zeros, token.head
    metrics = {_HEAD_SUMS[k]: zeros.index_add(0, head, v) for k, v in rows.items() if k in _HEAD_SUMS}
    if opts.reduction == "none":
        metrics["loss"] = per_row * token.row_weight
    return loss, metrics


def multi_token_chunk(
    logits, extra_logits, token: MultiTokenRows, scalars: MultiTokenScalars, opts: MultiTokenOptions
):
    """Loss of one chunk of stacked heads' rows: ``Σ_i (w_k/n_k)_i · ℓ_i``, and the per-head sums."""
    return _head_sums(cross_entropy_rows(logits, token.labels, opts), token, scalars, opts)


def _per_head(value, k: int, name: str, dims: int, optional: bool = False) -> list:
    """``value`` as K per-head tensors: one tensor of ``dims`` dims shared by all, a stacked (K, ...) tensor,
    or a sequence of K tensors (``None`` for every head when ``optional``)."""
    if value is None and optional:
        return [None] * k
    if isinstance(value, Tensor):
        if value.dim() == dims:
            return [value] * k
        if value.dim() == dims + 1:
            if value.shape[0] != k:
                raise ValueError(f"{name} holds {value.shape[0]} heads, hiddens {k}")
            return list(value.unbind(0))
        raise ValueError(f"{name} must have {dims} dims (shared) or {dims + 1} (per head), got {value.dim()}")
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != k:
            raise ValueError(f"{name} holds {len(value)} heads, hiddens {k}")
        return list(value)
    raise TypeError(f"{name} must be a tensor or a sequence of K tensors, got {type(value).__name__}")


def _hiddens(hiddens) -> tuple[list[Tensor], Tensor | None]:
    """The K (B, T, H) hidden states and, for a (K, B, T, H) input, that tensor."""
    if isinstance(hiddens, Tensor):
        if hiddens.dim() != 4:
            raise ValueError(
                "hiddens must be (K, B, T, H) or a sequence of K (B, T, H) tensors, "
                f"got {tuple(hiddens.shape)}"
            )
        heads, stacked = list(hiddens.unbind(0)), hiddens
    elif isinstance(hiddens, Sequence) and not isinstance(hiddens, (str, bytes)):
        heads, stacked = list(hiddens), None
        for i, h in enumerate(heads):
            if not isinstance(h, Tensor):
                raise TypeError(f"hiddens[{i}] must be a torch.Tensor, got {type(h).__name__}")
            if h.dim() != 3:
                raise ValueError(f"hiddens[{i}] must be (B, T, H), got {tuple(h.shape)}")
    else:
        raise TypeError(f"hiddens must be a tensor or a sequence of tensors, got {type(hiddens).__name__}")
    if not heads:
        raise ValueError("hiddens must hold at least one head (K ≥ 1), got K = 0")
    for i, h in enumerate(heads[1:], 1):
        if h.shape != heads[0].shape:
            raise ValueError(
                f"hiddens[{i}] shape {tuple(h.shape)} differs from hiddens[0] {tuple(heads[0].shape)}"
            )
    return heads, stacked


def _groups(weights: list[Tensor], biases: list[Tensor | None]) -> list[list[int]]:
    """Heads grouped by the (weight, bias) pair they share (the same tensor objects), in order of use."""
    groups: dict[tuple[int, int], list[int]] = {}
    for k, (w, b) in enumerate(zip(weights, biases)):
        groups.setdefault((id(w), id(b)), []).append(k)
    return list(groups.values())


def _shifted_labels(labels: Tensor, k: int, ignore_index: int) -> Tensor:
    """(K, B, T): head k's target at t is ``labels[:, t + k]``, ``ignore_index`` for t ≥ T - k."""
    t = labels.shape[1]
    out = labels.new_full((k, *labels.shape), ignore_index)
    for i in range(min(k, t)):
        out[i, :, : t - i] = labels[:, i:]
    return out


def _normalisers(counts: Tensor, num_items_in_batch, opts: MultiTokenOptions) -> Tensor:
    """(K,) fp32 divisor of each head's summed loss."""
    k = counts.shape[0]
    if num_items_in_batch is not None and opts.reduction != "none":
        if isinstance(num_items_in_batch, Tensor) and num_items_in_batch.numel() == k and k > 1:
            return num_items_in_batch.detach().to(counts.device, torch.float32).reshape(k).clamp(min=1.0)
        return item_count(num_items_in_batch, counts.device).expand(k)
    if opts.reduction == "mean":
        return counts.float().clamp(min=1.0)
    return torch.ones(k, device=counts.device)


class FusedLinearMultiTokenLoss(FusedLinearBase):
    """Σ_k w_k · cross-entropy of head k at offset k, without materialising any head's logits.

    Example::

        loss_fn = FusedLinearMultiTokenLoss(head_weights=(1.0, 0.8, 0.64))
        loss = loss_fn(hiddens, lm_head.weight, labels)   # hiddens (K, B, T, H) or K × (B, T, H)

    After a call ``loss_fn.metrics`` holds, for every head k, ``head{k}/loss`` (mean cross-entropy over its
    targets, unweighted), ``head{k}/accuracy`` (top-1, with ``return_token_accuracy``),
    ``head{k}/num_tokens``, and ``head{k}/z_loss`` / ``head{k}/entropy`` where asked. A head without targets
    (all ignored, or T ≤ k) adds 0 to the loss, and its metrics are 0 with ``num_tokens`` 0.
    """

    options_cls = MultiTokenOptions
    options: MultiTokenOptions
    head_args = ("hiddens", "weight", "bias")
    chunk_loss = staticmethod(multi_token_chunk)

    positional_options = ("head_weights",)

    @property
    def token_outputs(self) -> tuple[str, ...]:
        """``("loss",)`` with reduction='none': the per-row losses are the output."""
        return ("loss",) if self.options.reduction == "none" else ()

    def forward(
        self,
        hiddens: Tensor | Sequence[Tensor],  # (K, B, T, H) or K × (B, T, H)
        weight: Tensor | Sequence[Tensor],  # (V, H) shared, (K, V, H) or K × (V, H)
        labels: Tensor,  # (B, T), shifted for head 0
        *,
        bias: Tensor | Sequence[Tensor] | None = None,  # (V,), (K, V) or K × (V,)
        num_items_in_batch: int | Tensor | None = None,  # a count for every head, or (K,) counts
    ) -> Tensor:
        """The weighted sum of the heads' losses (0-d), or (K, B, T) per-position ``w_k·ℓ`` for 'none'."""
        opts = self.options
        heads, stacked = _hiddens(hiddens)
        k = len(heads)
        weights = _per_head(weight, k, "weight", 2)
        biases = _per_head(bias, k, "bias", 1, optional=True)
        head_weights = opts.head_weights or (1.0,) * k
        if len(head_weights) != k:
            raise ValueError(f"head_weights holds {len(head_weights)} weights for {k} heads")
        for i in range(k):
            check_head(heads[i], weights[i], biases[i], name=f"hiddens[{i}]")
            if weights[i].shape[0] != weights[0].shape[0]:
                raise ValueError(
                    f"weight of head {i} has V={weights[i].shape[0]}, head 0 V={weights[0].shape[0]}"
                )
        device = heads[0].device
        checks: list = []
        check_labels(
            labels, heads[0].shape[:-1], weights[0].shape[0], opts.ignore_index, defer=checks, device=device
        )
        shifted = _shifted_labels(labels, k, opts.ignore_index)  # (K, B, T)
        keep = shifted.reshape(k, -1) != opts.ignore_index
        counts = keep.sum(1)
        n_bad, *n_head = torch.cat([checks[0][0].reshape(1), counts]).tolist()  # the one host sync
        checks[0][1](n_bad)
        scale = torch.tensor(head_weights, dtype=torch.float32).to(device) / _normalisers(
            counts, num_items_in_batch, opts
        )
        scalars = MultiTokenScalars(
            head_zeros=torch.zeros(k, device=device), one=torch.ones((), device=device)
        )
        n = labels.numel()
        outs, losses, sums = [None] * k, [], {}
        for group in _groups(weights, biases):
            if stacked is not None and group == list(range(k)):
                hidden = stacked.reshape(k * n, -1)
            elif len(group) == 1:
                hidden = heads[group[0]].reshape(n, -1)
            else:
                hidden = torch.cat([heads[i].reshape(n, -1) for i in group])
            index = torch.tensor(group, device=device)
            rows = torch.nonzero_static(keep[index].reshape(-1), size=sum(n_head[i] for i in group)).squeeze(
                1
            )
            head = index[rows // n]
            batch = Batch(
                rows=rows,
                token=MultiTokenRows(
                    labels=shifted[index].reshape(-1)[rows].long(), head=head, row_weight=scale[head]
                ),
                scalars=scalars,
                num_rows=len(group) * n,
                all_rows=rows.numel() == len(group) * n,
            )
            out = self.run(hidden, weights[group[0]], biases[group[0]], batch)
            for name, v in self.metrics.items():
                sums[name] = sums[name] + v if name in sums else v
            losses.append(out)
            if opts.reduction == "none":
                for j, i in enumerate(group):
                    outs[i] = out.view(len(group), *labels.shape)[j]
        self.metrics = _head_metrics(sums, counts, opts)
        if opts.reduction == "none":
            return torch.stack(outs)
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()


def _head_metrics(sums: dict[str, Tensor], counts: Tensor, opts: MultiTokenOptions) -> dict[str, Tensor]:
    """``head{k}/<name>``: each per-head sum over that head's count of targets (0 without targets)."""
    denom = counts.float().clamp(min=1.0)
    asked = {
        "head_loss": True,
        "head_z_loss": opts.lse_square_scale > 0,
        "head_correct": opts.return_token_accuracy,
        "head_entropy": opts.return_entropy,
    }
    zeros = torch.zeros(counts.shape, device=counts.device)
    means = {key: sums.get(key, zeros) / denom for key, on in asked.items() if on}  # no rows: no chunk sums
    metrics = {}
    for k in range(counts.shape[0]):
        for key, value in means.items():
            metrics[f"head{k}/{_METRIC_NAMES[key]}"] = value[k].detach()
        metrics[f"head{k}/num_tokens"] = counts[k].float()
    return metrics


# --------------------------------------------------------------------------------------------------
# The CUDA steps: the cross-entropy kernel, each row weighted by its head's ``w_k/n_k``.
def multi_token_token(opts, logits, extra_logits, token, scalars):
    """``TOKEN``: ``grad_and_value(multi_token_chunk)``."""
    rows = cross_entropy_kernel_rows(opts, logits, token.labels, scalars.one, token.row_weight)
    return (logits, *_head_sums(rows, token, scalars, opts))


def multi_token_token_rows(opts, logits, extra_logits, token, scalars, row_weight):
    """``TOKEN_ROWS`` (reduction='none'): the gradient of ``Σ_i row_weight_i·w_k·ℓ_i``."""
    cross_entropy_kernel_rows(opts, logits, token.labels, scalars.one, row_weight * token.row_weight)
    return logits


register_gpu_steps(
    FusedLinearMultiTokenLoss,
    {StepKind.TOKEN: multi_token_token, StepKind.TOKEN_ROWS: multi_token_token_rows},
    math=("chunk_loss",),
)
