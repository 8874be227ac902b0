"""Generalized JSD of a chunk of student and teacher logits, and its gradient written over the student's.

The chunk loop (``chunkloss.engine``) projects a chunk of rows through both heads and needs the chunk's loss
and ``dL/dlogits`` of the student in the logits' own buffer. :func:`jsd_step` computes the per-row terms and
writes that gradient over the student's logits; :func:`jsd_step_ref` is the same in plain PyTorch. Each row
pair is read three times and nothing of size [C, V] is allocated (a compiled step holds fp32 copies of both
chunks and reads them several times). Per row, with ``z = scale(x)`` each head's logit transform,
``a = log_softmax(z_s/τ)``, ``b = log_softmax(z_t/τ)``, ``s = e^a``, ``t = e^b``,
``log m = logaddexp(a + log(1-β), b + log β)``::

    jsd   = Σ_j β·t_j·(b_j - log m_j) + (1-β)·s_j·(a_j - log m_j)     0 < β < 1
          = Σ_j s_j·(a_j - b_j)        β = 1 (reverse KL)         = Σ_j t_j·(b_j - a_j)   β = 0 (forward KL)
    u_j   = dL/da_j at fixed a_k (k ≠ j) = (1-β)·s_j·(a_j - log m_j)   (β·t·log m and (1-β)·s·log m's own
            derivatives cancel, as m_j = (1-β)·s_j + β·t_j);  s_j·(a_j - b_j) at β = 1;  -t_j at β = 0
    djsd/dz_s,j = (u_j - s_j·Σ_k u_k) / τ                                            (through log_softmax)
    hard  = lse(z_s) - z_s,y,  dhard/dz_s,j = softmax(z_s)_j - [j = y]              (no temperature)
    dL/dx_j = (w_soft·djsd/dz_s,j + w_hard·dhard/dz_s,j) / normaliser · dz_s,j/dx_j

Pass 1 reads each row for the running max and sum-exp of ``z_s/τ`` and ``z_t/τ`` (``logprob._online``, and
the student's once more for ``z_s`` with the hard loss); pass 2 reads them again for jsd, ``Σ u`` and the
entropy ``-Σ s·a``; pass 3 reads them once more and writes the gradient (computed in fp32, rounded once to the
logits' dtype).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._utils import arguments_of, next_power_of_2
from .logprob import _online, _scaled, scale_ref

__all__ = ["jsd_step", "jsd_step_ref"]

# Columns per step and warps per row (docs/design.md, "Triton steps").
BLOCK_V = 2048
NUM_WARPS = 8

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def jsd_step_ref(
    logits: Tensor, teacher_logits: Tensor, labels: Tensor, normaliser: Tensor, **options
) -> dict[str, Tensor]:
    """:func:`jsd_step` in plain PyTorch (same arguments): fp32 autograd of the per-row terms, the gradient
    rounded once to the logits' dtype and copied over them."""
    o = arguments_of(jsd_step, logits, teacher_logits, labels, normaliser, **options)
    _check(logits, teacher_logits, labels, normaliser)
    _check_options(o["beta"], o["temperature"], o["student_softcap"], o["teacher_softcap"])
    beta, tau = o["beta"], o["temperature"]
    with torch.enable_grad():
        x = logits.detach().to(torch.float32, copy=True).requires_grad_(True)
        z_s = scale_ref(x, o["student_logit_scale"], o["student_softcap"])
        z_t = scale_ref(teacher_logits, o["teacher_logit_scale"], o["teacher_softcap"])
        a, b = torch.log_softmax(z_s / tau, dim=-1), torch.log_softmax(z_t / tau, dim=-1)
        if beta == 0.0:
            soft = (b.exp() * (b - a)).sum(-1)
        elif beta == 1.0:
            soft = (a.exp() * (a - b)).sum(-1)
        else:
            log_m = torch.logaddexp(a + math.log1p(-beta), b + math.log(beta))
            soft = (beta * b.exp() * (b - log_m) + (1 - beta) * a.exp() * (a - log_m)).sum(-1)
        rows = {"soft": soft, "entropy": -(a.exp() * a).sum(-1)}
        total = o["weight_soft_loss"] * soft.sum()
        if o["weight_hard_loss"] != 0.0:
            rows["hard"] = torch.logsumexp(z_s, dim=-1) - z_s.gather(-1, labels.long()[:, None])[:, 0]
            total = total + o["weight_hard_loss"] * rows["hard"].sum()
        (grad,) = torch.autograd.grad(total / normaliser, x)
    logits.copy_(grad)
    return {k: v.detach() for k, v in rows.items()}


def _check_options(beta: float, temperature: float, student_softcap, teacher_softcap) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    for name, cap in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap)):
        if cap is not None and cap <= 0:
            raise ValueError(f"{name} must be positive or None, got {cap}")


@triton.jit
def _divergence(a, b, beta, log_beta, log_1m_beta, inv_1m_beta, MODE: tl.constexpr):
    """Per element of a row block, from a = log S and b = log T: (jsd term, u = dL/da at fixed others, s)."""
    if MODE == 0:
        p_s = tl.exp(a)
        p_t = tl.exp(b)
        term = p_t * (b - a)
        u = -p_t
    elif MODE == 1:
        p_s = tl.exp(a)
        term = p_s * (a - b)
        u = term
    else:
        # x1 = log((1-β)·s), x2 = log(β·t), m = e^x1 + e^x2: three exp/log per element instead of five, from
        # e^hi and r = e^-|x1 - x2| (the smaller of the two mixture parts is e^hi·r).
        x1 = a + log_1m_beta
        x2 = b + log_beta
        hi = tl.maximum(x1, x2)
        e_hi = tl.exp(hi)
        r = tl.exp(-tl.abs(x1 - x2))
        log_m = hi + tl.log(1.0 + r)
        first = x1 >= x2
        p1 = tl.where(first, e_hi, e_hi * r)  # (1-β)·s
        p2 = tl.where(first, e_hi * r, e_hi)  # β·t
        u = p1 * (a - log_m)
        term = p2 * (b - log_m) + u
        p_s = p1 * inv_1m_beta
    return term, u, p_s


@triton.jit
def _jsd_step_kernel(
    XS,  # (C, V) student logits in, dL/dlogits out (same dtype), unit column stride
    XT,  # (C, V) teacher logits, unit column stride
    Y,  # (C,) labels (read if HAS_HARD)
    NORM,  # () fp32 normaliser
    SOFT,  # (C,) fp32 jsd per row
    HARD,  # (C,) fp32 hard-label CE per row (written if HAS_HARD)
    ENT,  # (C,) fp32 entropy of S per row
    V,
    stride_s,
    stride_t,
    beta,
    log_beta,  # log β (mixture only)
    log_1m_beta,  # log(1 - β) (mixture only)
    inv_1m_beta,  # 1 / (1 - β) (mixture only)
    w_soft,
    w_hard,
    S_SCALE: tl.constexpr,
    S_CAP: tl.constexpr,  # 0 for none
    T_SCALE: tl.constexpr,
    T_CAP: tl.constexpr,
    TEMPERATURE: tl.constexpr,  # τ, in the divergence only
    MODE: tl.constexpr,  # 0: β = 0 (forward KL), 1: β = 1 (reverse KL), 2: the mixture
    HAS_HARD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_base = XS + row * stride_s  # int64: C·V passes 2^31 at real vocabularies
    t_base = XT + row * stride_t
    cols = tl.arange(0, BLOCK)

    # Pass 1: lse of z_s/τ and z_t/τ (and of z_s for the hard loss: one more read of the student's row).
    m_s, l_s, _, _, _, _ = _online(s_base, V, S_SCALE, S_CAP, TEMPERATURE, False, False, False, False, BLOCK)
    m_t, l_t, _, _, _, _ = _online(t_base, V, T_SCALE, T_CAP, TEMPERATURE, False, False, False, False, BLOCK)
    lse_s = m_s + tl.log(l_s)
    lse_t = m_t + tl.log(l_t)
    y = 0
    lse_h = 0.0
    if HAS_HARD:
        m_h, l_h, _, _, _, _ = _online(s_base, V, S_SCALE, S_CAP, 1.0, False, False, False, False, BLOCK)
        lse_h = m_h + tl.log(l_h)
        y = tl.load(Y + row).to(tl.int64)
        z_y, dz_y = _scaled(tl.load(s_base + y), S_SCALE, S_CAP, 1.0)  # (dz_y unused)
        tl.store(HARD + row, lse_h - z_y)

    # Pass 2: jsd, Σ u and the entropy, summed per lane and reduced once after the loop.
    soft_v = tl.zeros([BLOCK], dtype=tl.float32)
    u_v = tl.zeros([BLOCK], dtype=tl.float32)
    ent_v = tl.zeros([BLOCK], dtype=tl.float32)
    start = 0
    while start < V:  # a while loop: the interpreter cannot take range() over a runtime int
        mask = start + cols < V
        zs, dzs = _scaled(tl.load(s_base + start + cols, mask=mask, other=0.0), S_SCALE, S_CAP, TEMPERATURE)
        zt, dzt = _scaled(tl.load(t_base + start + cols, mask=mask, other=0.0), T_SCALE, T_CAP, TEMPERATURE)
        a = zs - lse_s
        term, u, p_s = _divergence(a, zt - lse_t, beta, log_beta, log_1m_beta, inv_1m_beta, MODE)
        soft_v += tl.where(mask, term, 0.0)
        u_v += tl.where(mask, u, 0.0)
        ent_v -= tl.where(mask, p_s * a, 0.0)
        start += BLOCK
    u_sum = tl.sum(u_v, 0)
    tl.store(SOFT + row, tl.sum(soft_v, 0))
    tl.store(ENT + row, tl.sum(ent_v, 0))

    # Pass 3: the gradient over the student's logits, last block first (the likeliest to be still in L2).
    # dz/dx from _scaled holds 1/τ; the hard loss's logits are the untempered ones.
    norm = tl.load(NORM)
    c_soft = w_soft / norm
    c_hard = w_hard / norm
    start = (V - 1) // BLOCK * BLOCK
    while start >= 0:
        idx = start + cols
        mask = idx < V
        xs = tl.load(s_base + idx, mask=mask, other=0.0)
        zs, dzs = _scaled(xs, S_SCALE, S_CAP, TEMPERATURE)
        zt, dzt = _scaled(tl.load(t_base + idx, mask=mask, other=0.0), T_SCALE, T_CAP, TEMPERATURE)
        # (term, not `_`: Triton 3.6 keeps the type a name had before a loop, and `_` is a scalar here)
        term, u, p_s = _divergence(zs - lse_s, zt - lse_t, beta, log_beta, log_1m_beta, inv_1m_beta, MODE)
        g = c_soft * (u - p_s * u_sum) * dzs
        if HAS_HARD:
            zh, dzh = _scaled(xs, S_SCALE, S_CAP, 1.0)
            p_h = tl.exp(zh - lse_h)
            g += c_hard * tl.where(idx == y, p_h - 1.0, p_h) * dzh
        tl.store(s_base + idx, g.to(XS.dtype.element_ty), mask=mask)
        start -= BLOCK


@torch.no_grad()
def jsd_step(
    logits: Tensor,  # (C, V) student
    teacher_logits: Tensor,  # (C, V)
    labels: Tensor,  # (C,)
    normaliser: Tensor,  # ()
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    weight_soft_loss: float = 1.0,
    weight_hard_loss: float = 0.0,
    student_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
) -> dict[str, Tensor]:
    """Per-row generalized JSD of a chunk (and the hard-label CE and student entropy), and ``dL/dlogits`` of
    ``L = (w_soft·Σ jsd + w_hard·Σ hard) / normaliser`` written over the student's logits.

    Args:
        logits: (C, V) student logits, fp32/bf16/fp16, unit column stride; overwritten with the gradient.
        teacher_logits: (C, V) teacher logits (no gradient), same V.
        labels: (C,) int64 in ``[0, V)`` (read for the hard loss only; not checked, a check would sync).
        normaliser: 0-d fp32 tensor (read on the device).
        beta: β in [0, 1]; 0 is forward KL(T‖S), 1 reverse KL(S‖T).
        temperature: τ dividing both heads' logits in the divergence (not in the hard loss).
        weight_soft_loss: w_soft, the divergence's weight.
        weight_hard_loss: w_hard, the weight of the student's cross-entropy on the labels; 0 turns it off.
        student_logit_scale, teacher_logit_scale: multipliers of each head's logits.
        student_softcap, teacher_softcap: each head's ``softcap·tanh(z/softcap)``, ``None`` for none.

    Returns:
        fp32 (C,) tensors by name: ``"soft"`` (jsd per row), ``"entropy"`` (of the student at τ) and, when
        ``weight_hard_loss`` ≠ 0, ``"hard"``.
    """
    _check(logits, teacher_logits, labels, normaliser)
    _check_options(beta, temperature, student_softcap, teacher_softcap)
    c, v = logits.shape
    new = lambda: torch.empty(c, dtype=torch.float32, device=logits.device)  # noqa: E731
    out = {"soft": new(), "entropy": new()}
    has_hard = weight_hard_loss != 0.0
    if has_hard:
        out["hard"] = new()
    if c == 0:
        return out
    beta = float(beta)
    mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    _jsd_step_kernel[(c,)](
        logits,
        teacher_logits,
        labels,
        normaliser,
        out["soft"],
        out.get("hard", out["soft"]),
        out["entropy"],
        v,
        logits.stride(0),
        teacher_logits.stride(0),
        beta,
        math.log(beta) if mode == 2 else 0.0,
        math.log1p(-beta) if mode == 2 else 0.0,
        1.0 / (1.0 - beta) if mode == 2 else 0.0,
        float(weight_soft_loss),
        float(weight_hard_loss),
        S_SCALE=float(student_logit_scale),
        S_CAP=float(student_softcap or 0.0),
        T_SCALE=float(teacher_logit_scale),
        T_CAP=float(teacher_softcap or 0.0),
        TEMPERATURE=float(temperature),
        MODE=mode,
        HAS_HARD=has_hard,
        BLOCK=min(BLOCK_V, next_power_of_2(v)),
        num_warps=NUM_WARPS,
    )
    return out


def _check(logits: Tensor, teacher_logits: Tensor, labels: Tensor, normaliser: Tensor) -> None:
    """Shapes, dtypes, devices and layouts only: nothing here reads a tensor's values (no host sync)."""
    for name, t in (("logits", logits), ("teacher_logits", teacher_logits)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name} must be (C, V) with unit column stride, got shape {tuple(t.shape)}")
    if teacher_logits.shape != logits.shape:
        raise ValueError(
            f"teacher_logits {tuple(teacher_logits.shape)} must match logits {tuple(logits.shape)}"
        )
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels must be (C,)=({logits.shape[0]},), got {tuple(labels.shape)}")
    if normaliser.dtype != torch.float32 or normaliser.dim() != 0:
        raise TypeError(
            f"normaliser must be a 0-d float32 tensor, got {normaliser.dtype} {tuple(normaliser.shape)}"
        )
    for name, t in (("teacher_logits", teacher_logits), ("labels", labels), ("normaliser", normaliser)):
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device} but logits are on {logits.device}")
