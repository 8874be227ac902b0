"""Rotary position embedding (rotate-half convention) for q and k in one Triton launch.

Equals ``transformers``' ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin`` with
``rotate_half(x) = cat(-x[..., R/2:R], x[..., :R/2])``, where ``cos``/``sin`` are what the model's rotary
embedding returns, ``(B, T, R)`` or ``(T, R)``. With ``R < head_dim`` (partial rotary) only the first ``R``
dims rotate and the rest pass through. One program handles one token: all q heads and all k heads
(grouped-query attention has fewer k heads), reading that token's ``cos``/``sin`` row once.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from ._utils import next_power_of_2


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the halves of the last dimension, as in transformers."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1):
    """Pure-PyTorch ``apply_rotary_pos_emb`` (transformers), extended to partial rotary dims like Phi.

    Args:
        q: (B, Hq, T, D) for ``unsqueeze_dim=1`` or (B, T, Hq, D) for ``unsqueeze_dim=2``.
        k: same layout with Hkv heads.
        cos, sin: (B, T, R) or (T, R) (shared by the batch), R <= D and even; with ``position_ids`` and
            2-D tables, (T_max, R) rows gathered by ``position_ids`` (B, T) (pre-4.38 transformers).
        position_ids: see ``cos``; ignored for 3-D tables, as transformers does.
        unsqueeze_dim: the head axis of q and k.

    Returns:
        (q_embed, k_embed), shapes and dtypes of q and k.
    """
    if position_ids is not None and cos.ndim == 2:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.ndim == 2:  # (T, R) shared by the batch (transformers itself would broadcast it wrongly)
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]

    def rotate(x):
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        out = (x_rot * cos) + (rotate_half(x_rot) * sin)
        return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)

    return rotate(q), rotate(k)


@dataclass(frozen=True)
class RoPEOptions:
    head_axis: int = 1  # axis of the heads in q/k: 1 for (B, H, T, D), 2 for (B, T, H, D)
    in_place: bool = False  # rotate q, k in place and their gradients in place


# Forward, per head row x (first R dims; dims >= R pass through), with p(j) = j +- R/2 the partner of dim j
# and sign(j) = -1 for j < R/2 else +1 (that is rotate_half(x)_j = sign(j) * x_p(j)):
#   out_j = x_j * cos_j + sign(j) * x_p(j) * sin_j
# Backward: dim j receives dout_j * cos_j from itself and dout_p(j) * sign(p(j)) * sin_p(j) from its
# partner, and sign(p(j)) = -sign(j):
#   dx_j = dout_j * cos_j - sign(j) * dout_p(j) * sin_p(j)
@triton.jit
def _rope_heads(
    X, OUT, sxb, sxh, sxt, sob, soh, sot, b, t, n_heads, cos, sin_j, sin_p, cols, partner, sign, n_cols, rot,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    mask = (heads < n_heads)[:, None] & (cols < n_cols)[None, :]
    row = X + b * sxb + t * sxt + heads[:, None] * sxh
    x = tl.load(row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner[None, :], mask=mask & (cols < rot)[None, :], other=0.0).to(tl.float32)
    if BACKWARD:
        y = x * cos[None, :] - sign[None, :] * xp * sin_p[None, :]
    else:
        y = x * cos[None, :] + sign[None, :] * xp * sin_j[None, :]
    y = tl.where((cols < rot)[None, :], y, x)
    # In place, every head's row must be fully read before it is overwritten: the two loads above are done.
    out = OUT + b * sob + t * sot + heads[:, None] * soh + cols[None, :]
    tl.store(out, y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K,  # inputs (forward) or output gradients (backward); unit stride in the last dim
    QO, KO,  # outputs; may alias Q, K
    COS, SIN,  # (B or 1, T, R) tables (batch stride 0 when shared)
    sqb, sqh, sqt, skb, skh, skt,  # batch / head / token strides of Q and K
    sqob, sqoh, sqot, skob, skoh, skot,  # same for QO and KO
    scb, sct,  # batch / token strides of COS and SIN
    seq_len,
    n_q_heads,
    n_k_heads,
    head_dim,
    rot,  # rotary dims R (even, <= head_dim)
    BACKWARD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    t = pid % seq_len
    cols = tl.arange(0, BLOCK_D)
    half = rot // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    sign = tl.where(cols < half, -1.0, 1.0)
    rot_mask = cols < rot
    table = b * scb + t * sct
    cos = tl.load(COS + table + cols, mask=rot_mask, other=0.0).to(tl.float32)
    sin_j = tl.load(SIN + table + cols, mask=rot_mask, other=0.0).to(tl.float32)
    sin_p = tl.load(SIN + table + partner, mask=rot_mask, other=0.0).to(tl.float32)
    _rope_heads(Q, QO, sqb, sqh, sqt, sqob, sqoh, sqot, b, t, n_q_heads, cos, sin_j, sin_p, cols, partner,
                sign, head_dim, rot, BACKWARD, BLOCK_HQ)
    _rope_heads(K, KO, skb, skh, skt, skob, skoh, skot, b, t, n_k_heads, cos, sin_j, sin_p, cols, partner,
                sign, head_dim, rot, BACKWARD, BLOCK_HK)


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense (a permutation of a contiguous tensor): safe to overwrite in place."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda s: s[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _bht_strides(x: torch.Tensor, head_axis: int):
    token_axis = 3 - head_axis
    return x.stride(0), x.stride(head_axis), x.stride(token_axis)


def _rope_launch(q, k, cos, sin, opts: RoPEOptions, backward: bool):
    """Rotate (or un-rotate, for the backward) q and k; returns the outputs (q, k when in place)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    in_place = opts.in_place and _dense(q) and _dense(k)
    qo, ko = (q, k) if in_place else (torch.empty_like(q), torch.empty_like(k))
    batch, head_dim = q.shape[0], q.shape[-1]
    seq_len = q.shape[3 - opts.head_axis]
    n_q, n_k = q.shape[opts.head_axis], k.shape[opts.head_axis]
    rot = cos.shape[-1]
    scb = 0 if cos.shape[0] == 1 else cos.stride(0)
    block_hq, block_hk = next_power_of_2(n_q), next_power_of_2(n_k)  # host ints, not triton's (~4 us each)
    block_d = next_power_of_2(head_dim)
    _rope_kernel[(batch * seq_len,)](
        q, k, qo, ko, cos, sin,
        *_bht_strides(q, opts.head_axis), *_bht_strides(k, opts.head_axis),
        *_bht_strides(qo, opts.head_axis), *_bht_strides(ko, opts.head_axis),
        scb, cos.stride(1), seq_len, n_q, n_k, head_dim, rot,
        BACKWARD=backward, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
        num_warps=4 if (block_hq + block_hk) * block_d <= 4096 else 8,
    )
    return qo, ko, in_place


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, opts: RoPEOptions):
        qo, ko, in_place = _rope_launch(q, k, cos, sin, opts, backward=False)
        if in_place:
            # Not mark_dirty: autograd refuses it for views (the usual q, a transposed projection) when a
            # Function returns two tensors. Bumping the version still makes any node that saved the
            # pre-rotation q or k fail loudly instead of reading rotated values.
            torch.autograd.graph.increment_version((q, k))
        ctx.save_for_backward(cos, sin)
        ctx.opts = opts
        ctx.q_meta, ctx.k_meta = (q.shape, q.dtype), (k.shape, k.dtype)
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        if not any(ctx.needs_input_grad[:2]):
            return None, None, None, None, None
        # Either output may get no gradient (e.g. k unused); rotating zeros keeps one launch for both.
        dq = torch.zeros(ctx.q_meta[0], dtype=ctx.q_meta[1], device=cos.device) if dq is None else dq
        dk = torch.zeros(ctx.k_meta[0], dtype=ctx.k_meta[1], device=cos.device) if dk is None else dk
        dq, dk, _ = _rope_launch(dq, dk, cos, sin, ctx.opts, backward=True)
        # cos/sin get no gradient: transformers builds them from a buffer (inv_freq), never a parameter.
        dq, dk = (dq if ctx.needs_input_grad[0] else None), (dk if ctx.needs_input_grad[1] else None)
        return dq, dk, None, None, None


def _tables(cos, sin, position_ids, batch):
    if position_ids is not None and cos.ndim == 2:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    assert cos.ndim == 3 and cos.shape == sin.shape and cos.shape[0] in (1, batch), (cos.shape, sin.shape)
    return cos.contiguous(), sin.contiguous()


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1,
                         in_place: bool = False):
    """Triton ``apply_rotary_pos_emb``; equals :func:`apply_rotary_pos_emb_ref`.

    Args:
        q: (B, Hq, T, D) for ``unsqueeze_dim=1`` (any strides with a unit last one, e.g. the transposed view
            of a projection) or (B, T, Hq, D) for ``unsqueeze_dim=2``.
        k: same layout, Hkv heads (Hq a multiple of Hkv is not required).
        cos, sin: (B, T, R), (1, T, R) or (T, R) with R <= D even; see :func:`apply_rotary_pos_emb_ref` for
            ``position_ids``.
        position_ids: (B, T) rows of 2-D tables; ignored with 3-D tables.
        unsqueeze_dim: 1 or 2, the head axis of q and k (as in transformers).
        in_place: overwrite q and k (when they are dense, e.g. views of a projection output) and, in the
            backward, their gradients. Saves two q/k-sized buffers; q and k must not be leaves that require
            grad, and their gradients must not be shared with another node.

    Returns:
        (q_embed, k_embed), shapes, strides and dtypes of q and k.
    """
    assert q.ndim == 4 and k.ndim == 4 and unsqueeze_dim in (1, 2), (q.shape, k.shape, unsqueeze_dim)
    cos, sin = _tables(cos, sin, position_ids, q.shape[0])
    seq_axis = 3 - unsqueeze_dim
    assert k.shape[0] == q.shape[0] and k.shape[seq_axis] == q.shape[seq_axis] == cos.shape[1], (
        q.shape, k.shape, cos.shape)
    assert cos.shape[-1] <= q.shape[-1] == k.shape[-1] and cos.shape[-1] % 2 == 0, (cos.shape, q.shape)
    opts = RoPEOptions(head_axis=unsqueeze_dim, in_place=in_place)
    return RoPEFunction.apply(q, k, cos, sin, opts)


class ApplyRotaryPosEmb(nn.Module):
    """:func:`apply_rotary_pos_emb` as a module (no parameters): ``(q, k, cos, sin) -> (q_embed, k_embed)``.

    Args:
        unsqueeze_dim: head axis of q and k (1 for (B, H, T, D), 2 for (B, T, H, D)).
        in_place: see :func:`apply_rotary_pos_emb`.
    """

    def __init__(self, unsqueeze_dim: int = 1, in_place: bool = False):
        super().__init__()
        self.unsqueeze_dim, self.in_place = unsqueeze_dim, in_place

    def forward(self, q, k, cos, sin, position_ids=None):
        return apply_rotary_pos_emb(q, k, cos, sin, position_ids, self.unsqueeze_dim, self.in_place)

    def extra_repr(self) -> str:
        return f"unsqueeze_dim={self.unsqueeze_dim}, in_place={self.in_place}"
