"""Checks, small math and the per-row / per-batch tensors shared by the losses (no chunk loop here: that lives
in chunkloss.engine)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from chunkloss.engine import Rows


@dataclass
class LabelRows(Rows):
    """Per row: the label of a loss over one target per row (cross-entropy, DFT, JSD's hard loss)."""

    labels: Tensor  # (N,) int64, each in [0, V)


@dataclass
class Normalisers:
    """A token loss's tensors of the whole batch."""

    normaliser: Tensor  # 0-d: divides the summed loss
    n_valid: Tensor  # 0-d: the rows that take part, at least 1 (the metrics' means)


def scale_logits(z: Tensor, logit_scale: float = 1.0, softcap: float | None = None, temperature: float = 1.0):
    """The model-side transforms of the logits, in the order transformers applies them:
    ``logit_scale`` (Cohere), final softcapping ``c·tanh(z/c)`` (Gemma-2), then ``/ temperature``."""
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if temperature != 1.0:
        z = z / temperature
    return z


def pick(z: Tensor, labels: Tensor) -> Tensor:
    """``z[i, labels[i]]`` per row of ``z`` (N, V).

    Under ``torch.compile`` this is a masked sum over the vocabulary: it fuses into the row's other
    reductions and its gradient is pointwise, where the gradient of ``gather`` is a dense [N, V]
    scatter that inductor materialises in fp32. Eagerly it is a plain gather (no [N, V] mask).
    """
    if torch.compiler.is_compiling():
        vocab = torch.arange(z.shape[-1], device=z.device)
        return torch.where(vocab == labels.unsqueeze(-1), z, 0.0).sum(-1)
    return z.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@dataclass
class RowStats:
    """Per-row statistics of a chunk's scaled logits ``z`` (C, V), each (C,) fp32 (``argmax`` int64); the
    ones not asked for are ``None``. :func:`row_statistics` computes them with autograd,
    :func:`kernel_row_statistics` in one read of the logits."""

    logp: Tensor  # log_softmax(z)[i, labels[i]]
    logp2: Tensor | None = None  # the same at labels2
    lse: Tensor | None = None  # logsumexp(z)
    entropy: Tensor | None = None  # -Σ_j p_ij·log p_ij
    mean: Tensor | None = None  # z.mean(-1)
    argmax: Tensor | None = None  # the first maximum
    lse2: Tensor | None = None  # logsumexp(2z)


def row_statistics(
    logits: Tensor,
    labels: Tensor,
    labels2: Tensor | None = None,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    lse: bool = False,
    entropy: bool = False,
    mean: bool = False,
    argmax: bool = False,
    lse2: bool = False,
) -> RowStats:
    """The :class:`RowStats` of ``z = scale_logits(logits.float())`` (C, V), differentiable: ``logp``,
    ``logp2`` if ``labels2`` is given, and the others the flags ask for. The losses' formula off CUDA and the
    reference of ``chunkloss.kernels.logprob.row_stats``, which computes the same in one read of the
    logits (:func:`kernel_row_statistics`)."""
    z = scale_logits(logits.float(), logit_scale, softcap, temperature)
    lse_ = nan_if_inf(torch.logsumexp(z, dim=-1))
    return RowStats(
        logp=pick(z, labels.long()) - lse_,
        logp2=pick(z, labels2.long()) - lse_ if labels2 is not None else None,
        lse=lse_ if lse else None,
        entropy=entropy_from_logits(z, lse_) if entropy else None,
        mean=z.mean(-1) if mean else None,
        argmax=z.argmax(-1) if argmax else None,
        lse2=torch.logsumexp(2 * z, dim=-1) if lse2 else None,
    )


def kernel_row_statistics(
    logits: Tensor, labels: Tensor, labels2: Tensor | None = None, **request
) -> RowStats:
    """:func:`row_statistics` (same arguments) by the Triton kernel ``chunkloss.kernels.logprob.row_stats``:
    one read of the logits, no autograd graph; CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``."""
    from chunkloss.kernels.logprob import row_stats  # Triton is imported only here

    return RowStats(**row_stats(logits, labels, labels2, **request))


def saved_statistics(rows: RowStats | None) -> dict:
    """The keywords ``lse`` and ``entropy`` of ``chunkloss.kernels.logprob.row_grad_`` from the statistics a
    ``STATS`` step computed on the same logits (``{}`` for none: the kernel reads the rows again)."""
    return {} if rows is None else dict(lse=rows.lse, entropy=rows.entropy)


#: fp32 elements of the row blocks ``nograd_label_logprob`` reduces at a time off CUDA (64 MiB).
NOGRAD_BLOCK_ELEMS = 2**24


def nograd_label_logprob(
    logits: Tensor,
    labels: Tensor,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """``log_softmax(scale_logits(logits))[i, labels[i]]`` (C,) in fp32 for a head without grad (a reference
    model), from its ``[C, V]`` logits in their own dtype and with no ``[C, V]`` fp32 copy: the Triton kernel
    ``chunkloss.kernels.logprob`` on CUDA (one read of the logits, no compiled graph), blocks of rows
    elsewhere."""
    if logits.is_cuda:
        from chunkloss.kernels.logprob import label_logprob_triton  # Triton is imported only here

        return label_logprob_triton(logits, labels, logit_scale, softcap, temperature)
    rows = max(1, NOGRAD_BLOCK_ELEMS // max(logits.shape[-1], 1))
    scales = dict(logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    parts = [
        row_statistics(logits[a : a + rows], labels[a : a + rows], **scales).logp
        for a in range(0, logits.shape[0], rows)
    ]
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def nan_if_inf(lse: Tensor) -> Tensor:
    """``lse`` (a row's logsumexp) with ±inf turned to NaN, its gradient kept. ``torch.logsumexp`` returns
    +inf for a row that holds +inf (and -inf for a row of -inf), where ``log_softmax``, and so
    ``F.cross_entropy``, gives NaN: ``inf - inf`` makes such a row NaN and leaves a finite ``lse`` as it is
    (``lse - lse`` is 0, with gradient 0)."""
    return lse + (lse - lse)


def entropy_from_logits(z: Tensor, lse: Tensor | None = None) -> Tensor:
    """Entropy ``-Σ p log p`` per row of fp32 logits (N, V)."""
    if lse is None:
        lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse.unsqueeze(-1))
    return lse - (p * z).sum(-1)


def quantile(values: Tensor, q: float) -> Tensor:
    """``torch.quantile(values, q)`` (linear interpolation) bit for bit, for a 1-D ``values`` without NaN,
    written so that torch.compile traces it with a symbolic length: torch 2.11's ``quantile`` calls
    ``numel()`` on the symbolic sizes and dynamo cannot build the graph (GRPO's entropy mask on an H100)."""
    ordered = torch.sort(values).values
    rank = torch.full((1,), q, dtype=values.dtype, device=values.device) * (values.shape[0] - 1)
    below = rank.floor().long()
    above = rank.ceil().long()
    return torch.lerp(ordered.gather(0, below), ordered.gather(0, above), rank - below.to(rank.dtype))[0]


def check_head(hidden: Tensor, weight: Tensor, bias: Tensor | None, name: str = "hidden") -> None:
    """Shapes, dtypes and devices of one linear head: hidden (..., H), weight (V, H), bias (V,), V ≥ 1 and
    H ≥ 1. ``name`` is the hidden argument's name; its prefix names the others (``ref_hidden``:
    ``ref_weight``, ``ref_bias``)."""
    prefix = name[: -len("hidden")] if name.endswith("hidden") else ""
    w_name, b_name = f"{prefix}weight", f"{prefix}bias"
    for arg, t in ((name, hidden), (w_name, weight), (b_name, bias)):
        if t is None and arg == b_name:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{arg} must be a floating-point tensor, got {t.dtype}")
    if weight.dim() != 2 or 0 in weight.shape:
        # An empty vocabulary or hidden size has no logits to normalise (and no chunk size to plan).
        raise ValueError(f"{w_name} must be (V, H) with V ≥ 1 and H ≥ 1, got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        if hidden.dim() >= 1 and hidden.shape[-1] == weight.shape[0]:
            raise ValueError(
                f"{w_name} of shape {tuple(weight.shape)} looks transposed: {name}'s hidden size is "
                f"{hidden.shape[-1]}, and {w_name} must be (V, H)=({weight.shape[1]}, {weight.shape[0]}) as "
                f"nn.Linear stores it (pass lm_head.weight, not its .T)"
            )
        last = hidden.shape[-1] if hidden.dim() else None
        raise ValueError(
            f"{name}'s last dim {last} (shape {tuple(hidden.shape)}) must equal {w_name}'s hidden size "
            f"H={weight.shape[1]} ({w_name} is (V, H)={tuple(weight.shape)})"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"{name} dtype {hidden.dtype} differs from {w_name} dtype {weight.dtype}")
    if hidden.device != weight.device:
        raise ValueError(f"{name} is on {hidden.device} but {w_name} is on {weight.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{b_name} must be (V,)=({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"{b_name} dtype {bias.dtype} differs from {w_name} dtype {weight.dtype}")
        if bias.device != weight.device:
            raise ValueError(f"{b_name} is on {bias.device} but {w_name} is on {weight.device}")


def check_labels(
    labels: Tensor,
    rows_shape: torch.Size,
    vocab: int,
    ignore_index: int | None,
    name: str = "labels",
    rows: bool = False,
    defer: list | None = None,
    device: torch.device | None = None,
) -> Tensor | None:
    """Integer labels of the hidden's leading shape on the hidden's ``device`` (if given), each in [0, V) or
    ``ignore_index`` (``None``: every label must be in [0, V)).

    With ``rows``, returns the flat indices of the labels that are not ignored, found with the range check's
    one host sync (``nonzero`` alone would need a second). With ``defer`` (a list), the range check does not
    sync: it appends ``(count, check)`` for ``chunkloss.engine.sequence_batch``'s ``host_checks``, which
    fetches the count of bad labels in its own sync and calls ``check(count)`` (raising) before the batch is
    built.
    Nothing may index with the labels in between.
    """
    if not isinstance(labels, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got {labels.dtype}")
    if labels.shape != rows_shape:
        raise ValueError(
            f"{name} shape {tuple(labels.shape)} must equal hidden's leading shape {tuple(rows_shape)}"
        )
    if device is not None and labels.device != device:
        raise ValueError(f"{name} is on {labels.device} but hidden is on {device}")
    flat = labels.reshape(-1)
    keep = torch.ones_like(flat, dtype=torch.bool) if ignore_index is None else flat != ignore_index
    bad = keep & ((flat < 0) | (flat >= vocab))
    allowed = "" if ignore_index is None else f" and not ignore_index={ignore_index}"

    def check(n_bad: int) -> None:
        if n_bad:
            raise ValueError(f"{name} holds {flat[bad][0].item()}, outside [0, {vocab}){allowed}")

    if defer is not None:
        if rows:
            raise ValueError("check_labels: rows=True needs its own sync; it cannot be deferred")
        defer.append((bad.sum(), check))
        return None
    # The kept rows' indices, padded to every row, are queued before the sync: after it the GPU would idle
    # while the host launched nonzero's kernels. The first ``n_keep`` are the kept rows in order.
    padded = torch.nonzero_static(keep, size=flat.numel()).squeeze(1) if rows else None
    n_keep, n_bad = torch.stack([keep.sum(), bad.sum()]).tolist()  # the one host sync
    check(n_bad)
    return padded[:n_keep] if rows else None


def check_choice(name: str, value, choices: tuple) -> None:
    """An option's value is one of ``choices``: a ``ValueError`` naming the option otherwise."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_positive(name: str, value: float) -> None:
    """An option's value is above 0 (NaN is not): a ``ValueError`` naming the option otherwise."""
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")


def check_head_transforms(opts) -> None:
    """The options every loss reads its logits through: ``logit_scale`` above 0, ``softcap`` above 0 or
    None."""
    check_positive("logit_scale", opts.logit_scale)
    if opts.softcap is not None and not opts.softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {opts.softcap}")


def check_range(name: str, value: float, low: float, high: float) -> None:
    """An option's value lies in ``[low, high]`` (NaN does not): a ``ValueError`` naming the option
    otherwise."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def to_scalar(x, device, dtype=torch.float32) -> Tensor:
    """A Python number or tensor as a 0-d tensor on ``device`` (no host sync: ``torch.full`` fills on the
    device, where ``torch.tensor(x, device=cuda)`` copies from pageable memory and waits for the stream)."""
    if isinstance(x, Tensor):
        return x.detach().to(device=device, dtype=dtype).reshape(())
    return torch.full((), float(x), device=device, dtype=dtype)


def item_count(num_items_in_batch, device, name: str = "num_items_in_batch") -> Tensor:
    """A token count given as the loss's normaliser (transformers' ``num_items_in_batch``), checked, as a 0-d
    fp32 tensor on ``device``, at least 1: a global count of 0 means no token of the whole batch has a label,
    so the summed loss is 0 and stays 0 (dividing by 0 gave inf or NaN). No host sync for a tensor."""
    if isinstance(num_items_in_batch, Tensor):
        if num_items_in_batch.numel() != 1:
            shape = tuple(num_items_in_batch.shape)
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {shape}")
        if num_items_in_batch.dtype == torch.bool or num_items_in_batch.is_complex():
            raise TypeError(f"{name} must be a real count, got a {num_items_in_batch.dtype} tensor")
    elif isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, numbers.Real):
        raise TypeError(
            f"{name} must be a number or a one-element tensor, got {type(num_items_in_batch).__name__}"
        )
    elif not num_items_in_batch >= 0:
        raise ValueError(f"{name} must be a count ≥ 0, got {num_items_in_batch}")
    return to_scalar(num_items_in_batch, device).clamp(min=1.0)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for x ≤ 0, accurate at both ends (Mächler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
