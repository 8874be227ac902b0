"""Cross-entropy of one chunk of logits and its gradient, written over the logits, in two reads.

The chunk loop (``chunkloss.engine``) projects a chunk of rows, ``logits = hidden_c @ weight.T`` (C, V), and
needs the chunk's loss and ``dL/dlogits`` in the logits' own buffer, which the backward GEMMs then read.
:func:`cross_entropy_step` computes the per-row losses ``ℓ_i`` and writes the gradient of
``L = Σ_i w_i·ℓ_i / normaliser`` over the logits; :func:`cross_entropy_step_ref` is the same in plain PyTorch.
Pass 1 reads each row once with online reductions (max, sum-exp, and what the options need) and pass 2 reads
it again and writes the gradient in the logits' dtype, computed in fp32 and rounded once (a compiled
``grad_and_value`` step reads the logits three times and writes them once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._utils import arguments_of, next_power_of_2
from .logprob import _online, _scaled, _scalings, row_stats_ref

__all__ = ["cross_entropy_step", "cross_entropy_step_ref"]

# Columns per step of a row's two passes and warps per row (docs/design.md, "Triton steps").
BLOCK_V = 8192
NUM_WARPS = 16

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cross_entropy_step_ref(
    logits: Tensor, labels: Tensor, normaliser: Tensor, grad_scale: Tensor | None = None, **options
) -> dict[str, Tensor]:
    """:func:`cross_entropy_step` in plain PyTorch (same arguments): fp32 autograd of ``ℓ_i``, the gradient
    rounded once to the logits' dtype and copied over them."""
    o = arguments_of(cross_entropy_step, logits, labels, normaliser, grad_scale, **options)
    eps, lam, want_accuracy, want_entropy = (
        o["label_smoothing"],
        o["lse_square_scale"],
        o["want_accuracy"],
        o["want_entropy"],
    )
    _check(logits, labels, normaliser, grad_scale, eps, lam, o["softcap"], o["temperature"])
    with torch.enable_grad():
        x = logits.detach().to(torch.float32, copy=True)  # a copy: the logits are overwritten below
        x.requires_grad_(True)
        scales = {k: o[k] for k in ("logit_scale", "softcap", "temperature")}
        want = dict(lse=True, entropy=want_entropy, mean=eps > 0, argmax=want_accuracy)
        r = row_stats_ref(x, labels, **scales, **want)
        loss = -r["logp"] if eps == 0 else (1 - eps) * -r["logp"] + eps * (r["lse"] - r["mean"])
        rows = {}
        if lam > 0:
            rows["z_loss"] = lam * r["lse"].square()
            loss = loss + rows["z_loss"]
        rows["loss"] = loss
        if want_accuracy:
            rows["correct"] = (r["argmax"] == labels).float()
        if want_entropy:
            rows["entropy"] = r["entropy"]
        w = grad_scale if grad_scale is not None else torch.ones_like(rows["loss"])
        (grad,) = torch.autograd.grad((rows["loss"] * w).sum() / normaliser, x)
    logits.copy_(grad)
    return {k: v.detach() for k, v in rows.items()}


# Row i of the raw logits x (one program), ε = label_smoothing, λ = lse_square_scale, y the label,
# z = scale(x) and dz/dx from ``logprob._scaled`` (logit_scale, softcap, temperature). Pass 1 is
# ``logprob._online``: one read of the row for its max m, s = Σ exp(z - m), h = Σ exp(z - m)·z (entropy),
# Σ z (smoothing) and the first argmax (accuracy); then lse = m + log s, entropy = lse - h/s, and
#   ℓ = (1-ε)·(lse - z_y) + ε·(lse - z_sum/V) + λ·lse².
# Pass 2, with p_j = exp(z_j - lse) and c = w_i/normaliser:
#   dℓ/dz_j = p_j·(1 + 2λ·lse) - (1-ε)·[j = y] - ε/V,   dL/dx_j = c·dℓ/dz_j·dz_j/dx_j
@triton.jit
def _cross_entropy_step_kernel(
    X,  # (C, V) logits in, dL/dlogits out (same dtype), contiguous
    Y,  # (C,) int64 labels in [0, V)
    NORM,  # () fp32 normaliser
    W,  # (C,) fp32 per-row weights w_i (read if HAS_GRAD_SCALE)
    LOSS,  # (C,) fp32 ℓ_i
    Z_LOSS,  # (C,) fp32 λ·lse² (written if HAS_Z_LOSS)
    CORRECT,  # (C,) fp32 argmax == label (written if WANT_ACCURACY)
    ENTROPY,  # (C,) fp32 (written if WANT_ENTROPY)
    V,  # vocabulary size, also the row stride
    eps,  # ε
    lam,  # λ
    LOGIT_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,  # 0 for none
    TEMPERATURE: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    WANT_ACCURACY: tl.constexpr,
    WANT_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * V  # int64: C·V passes 2^31 at real vocabularies
    cols = tl.arange(0, BLOCK_V)

    # Pass 1.
    m, s, h, z_sum, arg, _ = _online(
        base, V, LOGIT_SCALE, SOFTCAP, TEMPERATURE, WANT_ENTROPY, HAS_SMOOTHING, WANT_ACCURACY, False, BLOCK_V
    )
    y = tl.load(Y + row)
    z_y, dz_y = _scaled(tl.load(base + y), LOGIT_SCALE, SOFTCAP, TEMPERATURE)
    lse = m + tl.log(s)
    loss = lse - z_y
    if HAS_SMOOTHING:
        loss = (1.0 - eps) * loss + eps * (lse - z_sum / V)
    if HAS_Z_LOSS:
        z_loss = lam * lse * lse
        loss += z_loss
        tl.store(Z_LOSS + row, z_loss)
    tl.store(LOSS + row, loss)
    if WANT_ACCURACY:
        tl.store(CORRECT + row, (arg == y).to(tl.float32))
    if WANT_ENTROPY:
        tl.store(ENTROPY + row, lse - h / s)

    # Pass 2: the gradient over the logits.
    c = 1.0 / tl.load(NORM)
    if HAS_GRAD_SCALE:
        c *= tl.load(W + row)
    p_coef = 1.0
    if HAS_Z_LOSS:
        p_coef += 2.0 * lam * lse
    one_hot = 1.0
    uniform = 0.0
    if HAS_SMOOTHING:
        one_hot -= eps
        uniform = eps / V
    # Last block first: pass 1 has just read the end of the row, which is the likeliest to be still in L2.
    start = (V - 1) // BLOCK_V * BLOCK_V
    while start >= 0:
        idx = start + cols
        mask = idx < V
        z, dz = _scaled(tl.load(base + idx, mask=mask, other=0.0), LOGIT_SCALE, SOFTCAP, TEMPERATURE)
        g = tl.exp(z - lse) * p_coef - uniform
        g = tl.where(idx == y, g - one_hot, g) * c
        tl.store(base + idx, (g * dz).to(X.dtype.element_ty), mask=mask)
        start -= BLOCK_V


@torch.no_grad()
def cross_entropy_step(
    logits: Tensor,  # (C, V)
    labels: Tensor,  # (C,)
    normaliser: Tensor,  # ()
    grad_scale: Tensor | None = None,  # (C,)
    *,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    want_accuracy: bool = False,
    want_entropy: bool = False,
) -> dict[str, Tensor]:
    """Per-row cross-entropy of a chunk of logits, and ``dL/dlogits`` written over the logits.

    ``L = Σ_i w_i·ℓ_i / normaliser`` with ``ℓ_i = (1-ε)·(lse_i - z_iy) + ε·(lse_i - mean_j z_ij) + λ·lse_i²``,
    ``z = scale(logits)`` as in ``logprob.scale_ref``, ``lse`` its logsumexp, all in fp32.

    Args:
        logits: (C, V) contiguous fp32/bf16/fp16; overwritten with ``dL/dlogits`` in its own dtype.
        labels: (C,) int64 in ``[0, V)`` (ignored rows dropped beforehand; not checked, a check would sync).
        normaliser: 0-d fp32 tensor dividing the summed loss (read on the device).
        grad_scale: (C,) fp32 per-row weights ``w_i``, or ``None`` for 1.
        label_smoothing: ε, as in ``F.cross_entropy``.
        lse_square_scale: λ of the z-loss; 0 turns it off.
        softcap: ``softcap·tanh(z/softcap)`` after ``logit_scale``, ``None`` for none.
        temperature: the logits are divided by it last.
        logit_scale: the logits are multiplied by it first.
        want_accuracy: also return ``"correct"``.
        want_entropy: also return ``"entropy"``.

    Returns:
        fp32 (C,) tensors by name: ``"loss"`` (ℓ_i, z-loss included, without ``w_i`` or the normaliser),
        ``"z_loss"`` (λ·lse², only if λ > 0), ``"correct"`` (1.0 where the first argmax of z is the label,
        only if ``want_accuracy``), ``"entropy"`` (``-Σ_j p_ij·log p_ij``, only if ``want_entropy``).
    """
    _check(logits, labels, normaliser, grad_scale, label_smoothing, lse_square_scale, softcap, temperature)
    c, v = logits.shape
    new = lambda: torch.empty(c, dtype=torch.float32, device=logits.device)  # noqa: E731
    out = {"loss": new()}
    if lse_square_scale > 0:
        out["z_loss"] = new()
    if want_accuracy:
        out["correct"] = new()
    if want_entropy:
        out["entropy"] = new()
    if c == 0:
        return out
    loss = out["loss"]  # stands in for the pointers a switch leaves unread
    _cross_entropy_step_kernel[(c,)](
        logits,
        labels,
        normaliser,
        grad_scale if grad_scale is not None else loss,
        loss,
        out.get("z_loss", loss),
        out.get("correct", loss),
        out.get("entropy", loss),
        v,
        float(label_smoothing),
        float(lse_square_scale),
        **_scalings(logit_scale, softcap, temperature),
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=lse_square_scale > 0,
        HAS_GRAD_SCALE=grad_scale is not None,
        WANT_ACCURACY=bool(want_accuracy),
        WANT_ENTROPY=bool(want_entropy),
        BLOCK_V=min(BLOCK_V, next_power_of_2(v)),
        num_warps=NUM_WARPS,
    )
    return out


def _check(logits, labels, normaliser, grad_scale, label_smoothing, lse_square_scale, softcap, temperature):
    """Shapes, dtypes, devices and layouts only: nothing here reads a tensor's values (no host sync)."""
    for name, t in (("logits", logits), ("labels", labels), ("normaliser", normaliser)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logits.dtype not in _DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be (C, V) with V >= 1, got shape {tuple(logits.shape)}")
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous (the gradient is written over them row by row)")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64, got {labels.dtype}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels must be (C,)=({logits.shape[0]},), got {tuple(labels.shape)}")
    if normaliser.dtype != torch.float32 or normaliser.dim() != 0:
        raise TypeError(
            f"normaliser must be a 0-d float32 tensor, got {normaliser.dtype} {tuple(normaliser.shape)}"
        )
    tensors = [("labels", labels), ("normaliser", normaliser)]
    if grad_scale is not None:
        if not isinstance(grad_scale, Tensor) or grad_scale.dtype != torch.float32:
            raise TypeError(
                f"grad_scale must be a float32 tensor or None, got {getattr(grad_scale, 'dtype', grad_scale)}"
            )
        if grad_scale.shape != logits.shape[:1] or grad_scale.stride(0) != 1:
            raise ValueError(
                f"grad_scale must be contiguous (C,)=({logits.shape[0]},), got {tuple(grad_scale.shape)}"
            )
        tensors.append(("grad_scale", grad_scale))
    for name, t in tensors:
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device} but logits are on {logits.device}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if lse_square_scale < 0:
        raise ValueError(f"lse_square_scale must be >= 0, got {lse_square_scale}")
    _scalings(1.0, softcap, temperature)  # temperature and softcap, checked as the row kernels check them
