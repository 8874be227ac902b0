"""Rotary position embedding (rotate-half convention) for q and k in one Triton launch.

Equals ``transformers``' ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin`` with
``rotate_half(x) = cat(-x[..., R/2:R], x[..., :R/2])``, where ``cos``/``sin`` are what the model's rotary
embedding returns, ``(B, T, R)`` or ``(T, R)``. With ``R < head_dim`` (partial rotary) only the first ``R``
dims rotate and the rest pass through. One program handles ``RoPELaunchOptions.tokens`` consecutive tokens,
each with all its q heads and all its k heads (grouped-query attention has fewer k heads), reading that
token's ``cos``/``sin`` row once; every head row is read once, as its two rotary halves.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from ._utils import LaunchTable, cdiv, custom_op, next_power_of_2


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the halves of the last dimension, as in transformers."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
):
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


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, a cheap lru_cache key
class RoPELaunchOptions:
    """Launch parameters of the RoPE kernel (the sweep behind the defaults: docs/design.md, "Kernel launch
    parameters"). More tokens per program do not help: the static loop cannot issue a token's loads before
    the previous token's stores (the compiler must assume they alias).
    """

    tokens: int = 1  # consecutive (b, t) rows per program, a static loop (the last program is masked)
    num_warps: int = 4
    block_h: int = 0  # heads per tile (a power of two); 0: all q heads in one tile and all k heads in one
    evict_first: bool = False  # load q, k (or their gradients) with evict_first: each byte is read once


# sm90 (H100, H200): the sweep behind RoPELaunchOptions' defaults; other architectures take the defaults.
ROPE_LAUNCH: LaunchTable[RoPELaunchOptions] = LaunchTable(
    "rope", RoPELaunchOptions(), {(9, 0): RoPELaunchOptions()}
)


def rope_launch_options(device: torch.device | None = None, **changes):
    """``ROPE_LAUNCH.use(device, **changes)`` (tests force ``tokens=3, block_h=2`` at small shapes)."""
    return ROPE_LAUNCH.use(device, **changes)


# Per head row, the rotary dims split into halves x1 = x[:R/2], x2 = x[R/2:R], and likewise the table rows
# c1, c2 = cos[:R/2], cos[R/2:] and s1, s2 = sin[:R/2], sin[R/2:] (transformers duplicates the halves, so
# c1 == c2 there, but nothing here relies on it). With rotate_half(x) = cat(-x2, x1), the forward
# out = x * cos + rotate_half(x) * sin is
#   out1 = x1 * c1 - x2 * s1
#   out2 = x2 * c2 + x1 * s2
# and dims [R, D) pass through. Backward, from the upstream gradient halves d1, d2 (out1 depends on x1
# through c1 and on x2 through -s1; out2 on x2 through c2 and on x1 through s2):
#   dx1 = d1 * c1 + d2 * s2
#   dx2 = d2 * c2 - d1 * s1
# and the pass-through dims' gradient is d itself.
@triton.jit
def _rope_heads(
    X,
    OUT,  # one tensor's input rows and output rows (OUT may be X)
    x_row,
    o_row,  # offsets of this token's first head in X and OUT (int64)
    sxh,
    soh,  # head strides of X and OUT
    c1,
    c2,
    s1,
    s2,  # (BLOCK_R,) fp32 halves of this token's cos and sin rows
    row,
    n_rows,  # this token's index and the token count (the last program's static loop runs past the end)
    N_HEADS: tl.constexpr,  # 0 skips the tensor (a gradient that is not needed)
    HALF: tl.constexpr,  # R / 2
    N_PASS: tl.constexpr,  # pass-through dims D - R to copy: 0 for full rotary and in place
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,  # power of two >= HALF
    BLOCK_P: tl.constexpr,  # power of two >= N_PASS
    EVICT: tl.constexpr,  # eviction policy of the row loads ("" or "evict_first")
):
    cols = tl.arange(0, BLOCK_R)
    for h0 in tl.static_range(0, N_HEADS, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
        # Both sides are vectors: Triton 3.9's interpreter refuses a mask built from a scalar comparison.
        head_mask = (heads < N_HEADS) & (heads * 0 + row < n_rows)
        mask = head_mask[:, None] & (cols < HALF)[None, :]
        x_ptr = X + x_row + heads[:, None] * sxh + cols[None, :]
        x1 = tl.load(x_ptr, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1[None, :] + x2 * s2[None, :]
            y2 = x2 * c2[None, :] - x1 * s1[None, :]
        else:
            y1 = x1 * c1[None, :] - x2 * s1[None, :]
            y2 = x2 * c2[None, :] + x1 * s2[None, :]
        # In place, each thread stores only the elements it loaded itself, after loading them (y needs x).
        o_ptr = OUT + o_row + heads[:, None] * soh + cols[None, :]
        tl.store(o_ptr, y1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(o_ptr + HALF, y2.to(OUT.dtype.element_ty), mask=mask)
        if N_PASS > 0:
            pass_cols = 2 * HALF + tl.arange(0, BLOCK_P)
            pass_mask = head_mask[:, None] & (pass_cols < 2 * HALF + N_PASS)[None, :]
            x = tl.load(
                X + x_row + heads[:, None] * sxh + pass_cols[None, :], mask=pass_mask, eviction_policy=EVICT
            )
            tl.store(OUT + o_row + heads[:, None] * soh + pass_cols[None, :], x, mask=pass_mask)


@triton.jit
def _rope_kernel(
    Q,
    K,  # inputs (forward) or output gradients (backward); unit stride in the last dim
    QO,
    KO,  # outputs; may alias Q, K
    COS,
    SIN,  # (B or 1, T, R) tables (batch stride 0 when shared)
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,  # batch / head / token strides of Q and K
    sqob,
    sqoh,
    sqot,
    skob,
    skoh,
    skot,  # same for QO and KO
    scb,
    sct,  # batch / token strides of COS and SIN
    n_rows,  # B * T tokens
    seq_len,
    N_Q: tl.constexpr,  # q heads (0: skip q)
    N_K: tl.constexpr,  # k heads (0: skip k)
    HALF: tl.constexpr,  # R / 2
    N_PASS: tl.constexpr,  # pass-through dims to copy (out of place only)
    BACKWARD: tl.constexpr,
    TOKENS: tl.constexpr,  # consecutive tokens per program
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    EVICT: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * TOKENS
    cols = tl.arange(0, BLOCK_R)
    for i in tl.static_range(TOKENS):
        row = first + i
        b = row // seq_len
        t = row - b * seq_len
        table = b * scb + t * sct + cols
        table_mask = (cols < HALF) & (cols * 0 + row < n_rows)  # vectors (see _rope_heads)
        c1 = tl.load(COS + table, mask=table_mask, other=0.0).to(tl.float32)
        c2 = tl.load(COS + table + HALF, mask=table_mask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + table, mask=table_mask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + table + HALF, mask=table_mask, other=0.0).to(tl.float32)
        _rope_heads(
            Q,
            QO,
            b * sqb + t * sqt,
            b * sqob + t * sqot,
            sqh,
            sqoh,
            c1,
            c2,
            s1,
            s2,
            row,
            n_rows,
            N_Q,
            HALF,
            N_PASS,
            BACKWARD,
            BLOCK_HQ,
            BLOCK_R,
            BLOCK_P,
            EVICT,
        )
        _rope_heads(
            K,
            KO,
            b * skb + t * skt,
            b * skob + t * skot,
            skh,
            skoh,
            c1,
            c2,
            s1,
            s2,
            row,
            n_rows,
            N_K,
            HALF,
            N_PASS,
            BACKWARD,
            BLOCK_HK,
            BLOCK_R,
            BLOCK_P,
            EVICT,
        )


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense (a permutation of a contiguous tensor): safe to overwrite in place."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda s: s[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _bht_strides(x: torch.Tensor | None, head_axis: int):
    if x is None:  # a skipped tensor (zero heads): never indexed
        return 0, 0, 0
    return x.stride(0), x.stride(head_axis), x.stride(3 - head_axis)


@functools.lru_cache(maxsize=256)
def _rope_plan(
    n_rows: int, n_q: int, n_k: int, head_dim: int, rot: int, copy_pass: bool, launch: RoPELaunchOptions
):
    """(grid, constexprs and num_warps) of one launch; cached, so a call costs a dict lookup."""
    assert launch.tokens >= 1 and launch.block_h >= 0 and launch.block_h & (launch.block_h - 1) == 0, launch
    cap = launch.block_h or 1 << 30
    n_pass = head_dim - rot if copy_pass else 0
    meta = dict(
        N_Q=n_q,
        N_K=n_k,
        HALF=rot // 2,
        N_PASS=n_pass,
        TOKENS=launch.tokens,
        BLOCK_HQ=min(cap, next_power_of_2(n_q)),
        BLOCK_HK=min(cap, next_power_of_2(n_k)),
        BLOCK_R=next_power_of_2(rot // 2),
        BLOCK_P=next_power_of_2(n_pass),
        EVICT="evict_first" if launch.evict_first else "",
        num_warps=launch.num_warps,
    )
    return (cdiv(n_rows, launch.tokens),), meta


def _rope_launch(q, k, cos, sin, opts: RoPEOptions, backward: bool, out=None):
    """Rotate (or un-rotate, for the backward) q and k; returns the outputs (q, k when in place).

    Either of q and k may be None (a gradient that is not needed): it is skipped and its output is None.
    ``out``: the (qo, ko) to write, with q's and k's shapes and unit last strides, in place of the choice
    ``opts.in_place`` makes (``out=(q, k)`` rotates views of one projection output in place).
    """
    q = q if q is None or q.stride(-1) == 1 else q.contiguous()
    k = k if k is None or k.stride(-1) == 1 else k.contiguous()
    present = [x for x in (q, k) if x is not None]
    if out is not None:
        qo, ko = out
        in_place = qo is q and ko is k
    else:
        in_place = opts.in_place and all(_dense(x) for x in present)
        qo, ko = (q, k) if in_place else [None if x is None else torch.empty_like(x) for x in (q, k)]
    first = present[0]
    batch, seq_len, head_dim = first.shape[0], first.shape[3 - opts.head_axis], first.shape[-1]
    n_q = 0 if q is None else q.shape[opts.head_axis]
    n_k = 0 if k is None else k.shape[opts.head_axis]
    rot = cos.shape[-1]
    n_rows = batch * seq_len
    if n_rows == 0:
        return qo, ko, in_place
    grid, meta = _rope_plan(
        n_rows, n_q, n_k, head_dim, rot, not in_place and rot < head_dim, ROPE_LAUNCH.get(first.device)
    )
    _rope_kernel[grid](
        first if q is None else q,
        first if k is None else k,  # a skipped tensor's pointer is never read
        first if qo is None else qo,
        first if ko is None else ko,
        cos,
        sin,
        *_bht_strides(q, opts.head_axis),
        *_bht_strides(k, opts.head_axis),
        *_bht_strides(qo, opts.head_axis),
        *_bht_strides(ko, opts.head_axis),
        0 if cos.shape[0] == 1 else cos.stride(0),
        cos.stride(1),
        n_rows,
        seq_len,
        BACKWARD=backward,
        **meta,
    )
    return qo, ko, in_place


# The launch as a custom op with new outputs, which torch.compile calls without tracing into Triton (the
# interpreter included): the Functions use it while compiling and the in-place launches otherwise. Its inputs
# are passed detached: the Functions' backwards are written out, and autograd's fallback for custom ops stays
# out of the trace.
@custom_op("rope")
def rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_axis: int, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    _rope_launch(q, k, cos, sin, RoPEOptions(head_axis), backward, out=(qo, ko))
    return qo, ko


@rope_op.register_fake
def _(q, k, cos, sin, head_axis, backward):
    return torch.empty_like(q), torch.empty_like(k)


def rope_new(q, k, cos, sin, opts: RoPEOptions, backward: bool):
    """``(qo, ko, in_place)`` as :func:`_rope_launch` without ``out``; through :func:`rope_op` (new outputs)
    under ``torch.compile``."""
    if torch.compiler.is_compiling() and q is not None and k is not None:
        return *rope_op(q.detach(), k.detach(), cos, sin, opts.head_axis, backward), False
    return _rope_launch(q, k, cos, sin, opts, backward)


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, opts: RoPEOptions):
        qo, ko, in_place = rope_new(q, k, cos, sin, opts, backward=False)
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
        # Only the gradients that are needed and that arrived (an unused output gets none) are un-rotated.
        dq = dq if ctx.needs_input_grad[0] else None
        dk = dk if ctx.needs_input_grad[1] else None
        if dq is not None or dk is not None:
            dq, dk, _ = rope_new(dq, dk, cos, sin, ctx.opts, backward=True)
        # A needed gradient whose output got none (e.g. k unused) is zero.
        if ctx.needs_input_grad[0] and dq is None:
            dq = torch.zeros(ctx.q_meta[0], dtype=ctx.q_meta[1], device=cos.device)
        if ctx.needs_input_grad[1] and dk is None:
            dk = torch.zeros(ctx.k_meta[0], dtype=ctx.k_meta[1], device=cos.device)
        # cos/sin get no gradient: transformers builds them from a buffer (inv_freq), never a parameter.
        return dq, dk, None, None, None


def _tables(cos, sin, position_ids, batch):
    if position_ids is not None and cos.ndim == 2:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    assert cos.ndim == 3 and cos.shape == sin.shape and cos.shape[0] in (1, batch), (cos.shape, sin.shape)
    return cos.contiguous(), sin.contiguous()


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
    in_place: bool = False,
):
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
        q.shape,
        k.shape,
        cos.shape,
    )
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
