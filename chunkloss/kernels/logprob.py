"""Per-row statistics of a chunk of logits, and the gradient of a loss on them, in few reads of the logits.

Many losses see a chunk's logits ``x`` (C, V) only through a few numbers per row of ``z = scale(x)``
(:func:`scale_ref`: ``· logit_scale``, then ``softcap·tanh(z / softcap)``, then ``/ temperature``):
the label log-prob ``log p_y = z_y - lse``, the entropy ``H = lse - Σ_j p_j·z_j``,
the mean logit, the argmax. GRPO's per-token loss is a function of ``(log p_y, H)``; a preference loss sums
label log-probs per sequence. Such a loss needs, per row, only the derivatives ``a = dL/dlog p_y``,
``a2 = dL/dlog p_y2`` (a second label, e.g. ORPO's NLL targets) and ``b = dL/dH``, and then::

    dL/dz_j = a·[j = y] + a2·[j = y2] - (a + a2)·p_j - b·p_j·(z_j - lse + H)
    dL/dx_j = dL/dz_j · logit_scale/temperature · (1 - tanh²(x_j·logit_scale/softcap))   (softcap only)

:func:`row_stats` reads each row once with online reductions (running max, sum-exp and what is asked)
and writes nothing of size [C, V]; :func:`row_grad_` writes ``dL/dlogits`` over the logits in their dtype
(computed in fp32, rounded once), reading each row once more when ``lse`` and ``H`` are handed over from
:func:`row_stats` on the same logits, twice otherwise (a compiled step reads them three or four times).
Each has a plain-PyTorch reference in fp32 beside it (``*_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._utils import arguments_of, next_power_of_2

__all__ = [
    "row_grad_from_loss_",
    "label_logprob_ref",
    "label_logprob_triton",
    "row_grad_",
    "row_grad_ref",
    "row_stats",
    "row_stats_ref",
    "scale_ref",
]

# Columns per step of a row's online reduction and warps per row (docs/design.md, "Triton steps").
BLOCK_V = 8192
NUM_WARPS = 8
# The gradient pass reads and writes (and reads once more without the statistics): the CE step's launch shape.
GRAD_NUM_WARPS = 16

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scale_ref(
    logits: Tensor, logit_scale: float = 1.0, softcap: float | None = None, temperature: float = 1.0
) -> Tensor:
    """``z = scale(logits)`` in fp32: ``· logit_scale``, then ``softcap·tanh(z / softcap)``, then
    ``/ temperature`` (the order transformers applies them in)."""
    z = logits.float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def row_stats_ref(
    logits: Tensor, labels: Tensor, labels2: Tensor | None = None, **options
) -> dict[str, Tensor]:
    """:func:`row_stats` in plain PyTorch (same arguments), fp32 and differentiable."""
    o = arguments_of(row_stats, logits, labels, labels2, **options)
    z = scale_ref(logits, o["logit_scale"], o["softcap"], o["temperature"])
    lse = torch.logsumexp(z, dim=-1)
    out = {"logp": z.gather(-1, labels.long()[:, None])[:, 0] - lse}
    if labels2 is not None:
        out["logp2"] = z.gather(-1, labels2.long()[:, None])[:, 0] - lse
    if o["lse"]:
        out["lse"] = lse
    if o["entropy"]:
        out["entropy"] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    if o["mean"]:
        out["mean"] = z.mean(-1)
    if o["argmax"]:
        out["argmax"] = z.argmax(-1)
    if o["lse2"]:
        out["lse2"] = torch.logsumexp(2 * z, dim=-1)
    return out


def label_logprob_ref(logits: Tensor, labels: Tensor, *args, **kwargs) -> Tensor:
    """:func:`label_logprob_triton` in plain PyTorch (same arguments): ``log_softmax(scale(logits))[i,
    labels[i]]`` in fp32."""
    o = arguments_of(label_logprob_triton, logits, labels, *args, **kwargs)
    scales = {k: o[k] for k in ("logit_scale", "softcap", "temperature")}
    return row_stats_ref(logits, labels, **scales)["logp"]


@triton.jit
def _scaled(x, LOGIT_SCALE: tl.constexpr, SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr):
    """(z, dz/dx) of raw logits x."""
    u = x.to(tl.float32) * LOGIT_SCALE
    # One return statement: Triton 3.6 checks every return's types alike, even under a constexpr branch.
    if SOFTCAP > 0:
        # tanh(v) = 2·sigmoid(2v) - 1 (the interpreter has no libdevice tanh).
        t = 2.0 * tl.sigmoid(2.0 * u / SOFTCAP) - 1.0
        z = SOFTCAP * t / TEMPERATURE
        dz = (1.0 - t * t) * (LOGIT_SCALE / TEMPERATURE)
    else:
        z = u / TEMPERATURE
        dz = LOGIT_SCALE / TEMPERATURE
    return z, dz


@triton.jit
def _online(
    base,
    V,
    LOGIT_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    TEMPERATURE: tl.constexpr,
    WANT_H: tl.constexpr,
    WANT_SUM: tl.constexpr,
    WANT_ARG: tl.constexpr,
    WANT_SQ: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One read of a row: with m the running max and α = exp(m_old - m) when it moves,
    s = Σ exp(z - m), h = Σ exp(z - m)·z, z_sum = Σ z, the first argmax, s2 = Σ exp(2(z - m)).
    Running values move once per block (per-lane ones would cost a second exp per element)."""
    cols = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    h = 0.0
    z_sum = 0.0
    s2 = 0.0
    arg = 0
    start = 0
    while start < V:  # a while loop: the interpreter cannot take range() over a runtime int
        mask = start + cols < V
        z_fin, _ = _scaled(
            tl.load(base + start + cols, mask=mask, other=0.0), LOGIT_SCALE, SOFTCAP, TEMPERATURE
        )
        if WANT_SUM:
            z_sum += tl.sum(tl.where(mask, z_fin, 0.0), 0)
        z = tl.where(mask, z_fin, -float("inf"))
        m_blk = tl.max(z, 0)
        if WANT_ARG:
            if m_blk > m:  # a branch, not a (value, index) reduction per block: the max moves rarely
                arg = start + tl.min(tl.where(z == m_blk, cols, BLOCK), 0)
        m_new = tl.maximum(m, m_blk)  # finite: every block holds a column < V
        alpha = tl.exp(m - m_new)  # 0 on the first block
        e = tl.exp(z - m_new)  # 0 in masked lanes
        if WANT_H:
            h = h * alpha + tl.sum(tl.where(mask, e * z_fin, 0.0), 0)
        if WANT_SQ:
            s2 = s2 * alpha * alpha + tl.sum(e * e, 0)
        s = s * alpha + tl.sum(e, 0)
        m = m_new
        start += BLOCK
    return m, s, h, z_sum, arg, s2


@triton.jit
def _row_stats_kernel(
    X,  # (C, V) logits, unit column stride
    Y,  # (C,) labels
    Y2,  # (C,) second labels (read if HAS_Y2)
    LOGP,  # (C,) fp32 z_y - lse
    LOGP2,  # (C,) fp32 z_y2 - lse
    LSE,  # (C,) fp32
    ENT,  # (C,) fp32 lse - Σ p·z
    MEAN,  # (C,) fp32 Σ z / V
    ARG,  # (C,) int64 first argmax of z
    LSE2,  # (C,) fp32 logsumexp(2z)
    V,
    stride_row,
    LOGIT_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,  # 0 for none
    TEMPERATURE: tl.constexpr,
    HAS_Y2: tl.constexpr,
    WANT_LSE: tl.constexpr,
    WANT_ENT: tl.constexpr,
    WANT_MEAN: tl.constexpr,
    WANT_ARG: tl.constexpr,
    WANT_LSE2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * stride_row  # int64: C·V passes 2^31 at real vocabularies
    m, s, h, z_sum, arg, s2 = _online(
        base, V, LOGIT_SCALE, SOFTCAP, TEMPERATURE, WANT_ENT, WANT_MEAN, WANT_ARG, WANT_LSE2, BLOCK
    )
    lse = m + tl.log(s)
    y = tl.load(Y + row).to(tl.int64)
    z_y, _ = _scaled(tl.load(base + y), LOGIT_SCALE, SOFTCAP, TEMPERATURE)
    tl.store(LOGP + row, z_y - lse)
    if HAS_Y2:
        y2 = tl.load(Y2 + row).to(tl.int64)
        z_y2, _ = _scaled(tl.load(base + y2), LOGIT_SCALE, SOFTCAP, TEMPERATURE)
        tl.store(LOGP2 + row, z_y2 - lse)
    if WANT_LSE:
        tl.store(LSE + row, lse)
    if WANT_ENT:
        tl.store(ENT + row, lse - h / s)
    if WANT_MEAN:
        tl.store(MEAN + row, z_sum / V)
    if WANT_ARG:
        tl.store(ARG + row, arg.to(tl.int64))
    if WANT_LSE2:
        tl.store(LSE2 + row, 2.0 * m + tl.log(s2))


@triton.jit
def _row_grad_kernel(
    X,  # (C, V) logits in, dL/dlogits out (same dtype), unit column stride
    Y,  # (C,) labels
    Y2,  # (C,) second labels (read if HAS_Y2)
    A,  # (C,) fp32 dL/dlog p_y
    A2,  # (C,) fp32 dL/dlog p_y2 (read if HAS_Y2)
    B,  # (C,) fp32 dL/dH (read if HAS_B)
    LSE,  # (C,) fp32 (read if HAS_STATS)
    ENT,  # (C,) fp32 (read if HAS_STATS and HAS_B)
    V,
    stride_row,
    LOGIT_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    TEMPERATURE: tl.constexpr,
    HAS_Y2: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_STATS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * stride_row
    if HAS_STATS:
        lse = tl.load(LSE + row)
        ent = 0.0
        if HAS_B:
            ent = tl.load(ENT + row)
    else:
        m, s, h, _, _, _ = _online(
            base, V, LOGIT_SCALE, SOFTCAP, TEMPERATURE, HAS_B, False, False, False, BLOCK
        )
        lse = m + tl.log(s)
        ent = lse - h / s
    a = tl.load(A + row)
    y = tl.load(Y + row).to(tl.int64)
    a_sum = a
    a2 = 0.0
    y2 = -1
    if HAS_Y2:
        a2 = tl.load(A2 + row)
        y2 = tl.load(Y2 + row).to(tl.int64)
        a_sum += a2
    b = 0.0
    if HAS_B:
        b = tl.load(B + row)
    cols = tl.arange(0, BLOCK)
    # Last block first: a statistics pass has just read the end of the row, the likeliest to be still in L2.
    start = (V - 1) // BLOCK * BLOCK
    while start >= 0:
        idx = start + cols
        mask = idx < V
        z, dz = _scaled(tl.load(base + idx, mask=mask, other=0.0), LOGIT_SCALE, SOFTCAP, TEMPERATURE)
        p = tl.exp(z - lse)
        g = -a_sum * p
        if HAS_B:
            g -= b * p * (z - lse + ent)
        g = tl.where(idx == y, g + a, g)
        if HAS_Y2:
            g = tl.where(idx == y2, g + a2, g)
        tl.store(base + idx, (g * dz).to(X.dtype.element_ty), mask=mask)
        start -= BLOCK


def _scalings(logit_scale, softcap, temperature) -> dict:
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    return dict(LOGIT_SCALE=float(logit_scale), SOFTCAP=float(softcap or 0.0), TEMPERATURE=float(temperature))


@torch.no_grad()
def row_stats(
    logits: Tensor,  # (C, V)
    labels: Tensor,  # (C,)
    labels2: Tensor | None = None,  # (C,)
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    lse: bool = False,
    entropy: bool = False,
    mean: bool = False,
    argmax: bool = False,
    lse2: bool = False,
) -> dict[str, Tensor]:
    """Per-row statistics of ``z = scale(logits)`` in one read, on CUDA (or CPU under ``TRITON_INTERPRET=1``).

    Returns fp32 (C,) tensors by name: ``"logp"`` (``log_softmax(z)[i, labels[i]]``, always), ``"logp2"``
    (the same at ``labels2``, if given), and if asked ``"lse"``, ``"entropy"`` (``-Σ_j p_ij·log p_ij``),
    ``"mean"`` (``z.mean(-1)``), ``"argmax"`` (int64, the first maximum) and ``"lse2"``
    (``logsumexp(2z)``). Labels must be in ``[0, V)``: the losses have checked them; no check here may sync.
    """
    _check(logits, labels, labels2)
    c, v = logits.shape
    new = lambda dtype=torch.float32: torch.empty(c, dtype=dtype, device=logits.device)  # noqa: E731
    want = dict(lse=lse, entropy=entropy, mean=mean, lse2=lse2)
    out = {"logp": new()}
    if labels2 is not None:
        out["logp2"] = new()
    out.update({k: new() for k, on in want.items() if on})
    if argmax:
        out["argmax"] = new(torch.int64)
    if c == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    dummy = out["logp"]  # stands in for the pointers a switch leaves unread
    _row_stats_kernel[(c,)](
        logits,
        labels,
        labels2 if labels2 is not None else labels,
        out["logp"],
        out.get("logp2", dummy),
        out.get("lse", dummy),
        out.get("entropy", dummy),
        out.get("mean", dummy),
        out.get("argmax", labels),
        out.get("lse2", dummy),
        v,
        logits.stride(0),
        **_scalings(logit_scale, softcap, temperature),
        HAS_Y2=labels2 is not None,
        WANT_LSE=lse,
        WANT_ENT=entropy,
        WANT_MEAN=mean,
        WANT_ARG=argmax,
        WANT_LSE2=lse2,
        BLOCK=min(BLOCK_V, next_power_of_2(v)),
        num_warps=NUM_WARPS,
    )
    return out


@torch.no_grad()
def row_grad_(
    logits: Tensor,  # (C, V)
    labels: Tensor,  # (C,)
    coef: Tensor,  # (C,) dL/dlog p_y
    labels2: Tensor | None = None,  # (C,)
    coef2: Tensor | None = None,  # (C,) dL/dlog p_y2
    coef_entropy: Tensor | None = None,  # (C,) dL/dH
    *,
    lse: Tensor | None = None,  # (C,)
    entropy: Tensor | None = None,  # (C,)
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """``dL/dlogits`` of a loss that sees each row through ``log p_y``, ``log p_y2`` and ``H`` (formula in the
    module docstring), written over ``logits`` in their dtype and returned.

    ``lse`` (and ``entropy`` when ``coef_entropy`` is given): :func:`row_stats`'s ``"lse"`` (``"entropy"``) of
    these same logits; the row's max/sum-exp are then not read again. Without them they are.
    The coefficients are fp32 (C,) tensors, already holding every normaliser.
    """
    _check(logits, labels, labels2)
    if (labels2 is None) != (coef2 is None):
        raise ValueError("labels2 and coef2 go together")
    for name, t in (("coef", coef), ("coef2", coef2), ("coef_entropy", coef_entropy)):
        bad = t is not None and (t.dtype != torch.float32 or t.shape != logits.shape[:1])
        if bad or (t is not None and not t.is_contiguous()):
            raise ValueError(
                f"{name} must be a contiguous float32 (C,) tensor, got {t.dtype} {tuple(t.shape)}"
            )
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit column stride (the gradient is written over them)")
    has_stats = lse is not None
    if (entropy is not None and not has_stats) or (
        has_stats and coef_entropy is not None and entropy is None
    ):
        raise ValueError("the row statistics go together: lse, and entropy with coef_entropy (or neither)")
    c, v = logits.shape
    if c == 0:
        return logits
    _row_grad_kernel[(c,)](
        logits,
        labels,
        labels2 if labels2 is not None else labels,
        coef,
        coef2 if coef2 is not None else coef,
        coef_entropy if coef_entropy is not None else coef,
        lse if has_stats else coef,
        entropy if has_stats and entropy is not None else coef,
        v,
        logits.stride(0),
        **_scalings(logit_scale, softcap, temperature),
        HAS_Y2=labels2 is not None,
        HAS_B=coef_entropy is not None,
        HAS_STATS=has_stats,
        BLOCK=min(BLOCK_V, next_power_of_2(v)),
        num_warps=GRAD_NUM_WARPS,
    )
    return logits


def row_grad_from_loss_(
    logits: Tensor,
    labels: Tensor,
    loss: Tensor,
    logp: Tensor,
    *,
    lse: Tensor,
    entropy: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """:func:`row_grad_` for a loss evaluated with autograd on :func:`row_stats`'s ``logp``, ``lse`` and
    ``entropy`` for these logits: the leaves ``logp`` and, when it requires grad, ``entropy`` give the
    coefficients."""
    ent = entropy
    leaves = [logp] + ([ent] if ent is not None and ent.requires_grad else [])
    coef = torch.autograd.grad(loss, leaves, allow_unused=True)
    # Contiguous: the gradient of a sum reaches each row as a stride-0 expansion.
    coef = [torch.zeros_like(leaves[0]) if c is None else c.contiguous() for c in coef]
    return row_grad_(
        logits,
        labels,
        coef[0],
        coef_entropy=coef[1] if len(coef) > 1 else None,
        lse=lse,
        entropy=entropy,
        logit_scale=logit_scale,
        softcap=softcap,
        temperature=temperature,
    )


def row_grad_ref(
    logits: Tensor,
    labels: Tensor,
    coef: Tensor,
    labels2: Tensor | None = None,
    coef2: Tensor | None = None,
    coef_entropy: Tensor | None = None,
    *,
    lse: Tensor | None = None,
    entropy: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """:func:`row_grad_` by fp32 autograd of ``Σ coef·log p_y + coef2·log p_y2 + coef_entropy·H``, rounded
    once to the logits' dtype and copied over them (``lse`` and ``entropy`` are accepted and not needed)."""
    with torch.enable_grad():
        x = logits.detach().to(torch.float32, copy=True).requires_grad_(True)
        got = row_stats_ref(
            x,
            labels,
            labels2,
            logit_scale=logit_scale,
            softcap=softcap,
            temperature=temperature,
            entropy=coef_entropy is not None,
        )
        total = (got["logp"] * coef).sum()
        if labels2 is not None:
            total = total + (got["logp2"] * coef2).sum()
        if coef_entropy is not None:
            total = total + (got["entropy"] * coef_entropy).sum()
        (grad,) = torch.autograd.grad(total, x)
    return logits.copy_(grad)


def label_logprob_triton(
    logits: Tensor,
    labels: Tensor,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """``log_softmax(scale(logits))[i, labels[i]]`` (C,) in fp32, without grad, for CUDA tensors (or CPU ones
    under ``TRITON_INTERPRET=1``)."""
    return row_stats(logits, labels, logit_scale=logit_scale, softcap=softcap, temperature=temperature)[
        "logp"
    ]


def _check(logits: Tensor, labels: Tensor, labels2: Tensor | None = None) -> None:
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be (C, V) and labels (C,), got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if logits.dtype not in _DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if labels2 is not None and labels2.shape != labels.shape:
        raise ValueError(f"labels2 must be (C,)=({labels.shape[0]},), got {tuple(labels2.shape)}")
