"""A pre-norm attention layer's input, ``RMSNorm -> q/k/v projections -> RoPE``, as one autograd Function.

Equals ``LlamaDecoderLayer.input_layernorm`` followed by what ``LlamaAttention.forward`` computes before
attention: ``h = RMSNorm(x)``, ``q, k, v = q_proj(h), k_proj(h), v_proj(h)`` split into heads as
``(B, heads, T, head_dim)`` views, then ``apply_rotary_pos_emb`` on q and k (rotate-half, partial rotary
dims too).

Forward: the RMSNorm kernel (its per-row ``rstd`` kept); one cuBLAS GEMM of ``h`` with the concatenated
``[Wq; Wk; Wv]`` writes ``q | k | v`` as one (N, (Hq + 2·Hkv)·D) tensor; the RoPE kernel rotates its q and k
columns in place. q, k and v are returned as views of it.

Backward: the RoPE kernel un-rotates ``dq`` and ``dk`` straight into one (N, (Hq + 2·Hkv)·D) buffer beside
``dv``; one GEMM gives ``dh = [dq dk dv]·[Wq; Wk; Wv]`` (where three projections would give three products
and two additions), one GEMM gives ``[dWq; dWk; dWv] = [dq dk dv]ᵀ·h``; the RMSNorm kernel's backward gives
``dx`` and the norm weight's gradient. Saved for the backward: ``x``, ``h`` and ``rstd``, as the separate
modules keep; with ``norm_recompute=True`` only ``x`` and ``rstd``, and the backward runs the norm kernel
again for ``h`` (the same kernel on the same input: the same bits).

LoRA (``adapters=(q, k, v)``, each a :class:`~chunkloss.kernels.lora.LoraAdapter` or None): the low-rank
updates ``s·(dropout(h)·Aᵀ)·Bᵀ`` are added to their columns of the projection output before RoPE, and their
backward is written out in ``chunkloss/kernels/lora.py``: without dropout one GEMM ``h·[A_q; A_k; A_v]ᵀ``
feeds every adapter, and ``dh`` is the base's ``[dq dk dv]·[Wq; Wk; Wv]`` plus one ``addmm`` of the adapters'
``[dt_q dt_k dt_v]·[A_q; A_k; A_v]``. Frozen projection weights get no gradient GEMM. Saved besides: the
adapters' ``t = h·Aᵀ`` (N, Σr) and their dropout masks.

QLoRA: a projection weight given as a :class:`~chunkloss.kernels.frozen.FrozenWeight` (a 4-bit base's
dequantisation) is loaded into ``[Wq; Wk; Wv]`` for the forward GEMM and again for the backward's ``dh``, and
is not saved.

FP8 base: q, k and v as :class:`~chunkloss.kernels.fp8.Float8Weight` join into one (their e4m3 data and row
scales concatenated), so the forward and ``dh`` are one fp8 GEMM each; ``dh``'s gradient
``[dq dk dv]`` is quantised with one scale per row over the three, and :func:`attention_input_ref` joins them
the same way. fp8 weights beside others (a projection without LoRA left in bf16) run one GEMM each.
"""

from dataclasses import dataclass

import torch

from .frozen import (
    Weight,
    check_weights,
    joined,
    joined_grad_input,
    joined_linear,
    joined_linear_ref,
    split_frozen,
)
from .lora import LoraAdapter, LoraPlan, lora_down, lora_grads, lora_ref, lora_up_, plan_lora
from .rms_norm import (
    RMSNormOptions,
    _rms_norm_bwd,
    _rms_norm_fwd,
    rms_norm_bwd_torch,
    rms_norm_fwd_torch,
    rms_norm_ref,
)
from .rope import RoPEOptions, _rope_launch, _tables, apply_rotary_pos_emb_ref, rope_op

_ROPE = RoPEOptions(head_axis=1)


def attention_input_ref(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    w_q: Weight,
    w_k: Weight,
    w_v: Weight,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    b_q: torch.Tensor | None = None,
    b_k: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    head_dim: int | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
    adapters: tuple[LoraAdapter | None, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure PyTorch, op for op as transformers' Llama modules (PEFT's LoRA layers for the projections with an
    adapter); arguments as :func:`attention_input`."""
    head_dim = head_dim or cos.shape[-1]
    h = rms_norm_ref(x, norm_weight, eps, offset, casting)
    q_ad, k_ad, v_ad = adapters or (None, None, None)

    # One projection each, as the modules; fp8 weights joined, as attention_input quantises their gradient.
    y_q, y_k, y_v = joined_linear_ref(h, (w_q, w_k, w_v), (b_q, b_k, b_v))

    def heads(y, adapter):
        y = lora_ref(y, h, adapter)
        return y.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)

    q, k = apply_rotary_pos_emb_ref(heads(y_q, q_ad), heads(y_k, k_ad), cos, sin)
    return q, k, heads(y_v, v_ad)


@dataclass(frozen=True)
class AttentionInputOptions:
    norm: RMSNormOptions
    head_dim: int
    widths: tuple[int, int, int]  # output columns of the q, k and v projections
    norm_recompute: bool = False  # keep x and rstd, not h: the backward runs the norm again
    lora: LoraPlan | None = None  # the adapters of q, k, v


def _cat(tensors):
    return None if tensors[0] is None else torch.cat(tensors)


def _head_views(qkv: torch.Tensor, batch: int, opts: AttentionInputOptions):
    """q, k, v as (B, heads, T, head_dim) views of the (B·T, width) ``qkv``."""
    return tuple(
        part.view(batch, -1, part.shape[1] // opts.head_dim, opts.head_dim).transpose(1, 2)
        for part in qkv.split(opts.widths, dim=1)
    )


def _norm_fwd(x, weight, opts: RMSNormOptions):
    """(h, rstd) of the (N, H) rows ``x`` (contiguous); the kernel's math in PyTorch ops while compiling."""
    if torch.compiler.is_compiling():
        return rms_norm_fwd_torch(x, weight, opts.eps, opts.offset, opts.casting)
    h, _, rstd = _rms_norm_fwd(x, weight, opts)
    return h, rstd


def _norm_bwd(dh, x, weight, rstd, opts: RMSNormOptions, needs_dx, needs_dw):
    if torch.compiler.is_compiling():
        return rms_norm_bwd_torch(dh, x, weight, rstd, opts.offset, opts.casting, needs_dx, needs_dw)
    return _rms_norm_bwd(dh, x, weight, rstd, opts, needs_dx, needs_dw)


def _adapted(parts, plan: LoraPlan):
    """The parts (q, k, v columns) of the projections that have an adapter."""
    return [parts[i] for i in plan.slots]


class AttentionInputFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, norm_weight, w_q, w_k, w_v, b_q, b_k, b_v, cos, sin, opts: AttentionInputOptions, *lora
    ):
        batch = x.shape[0]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        h, rstd = _norm_fwd(x2, norm_weight, opts.norm)
        qkv = joined_linear(h, (w_q, w_k, w_v), _cat((b_q, b_k, b_v)))
        t, masks = None, ()
        if opts.lora is not None:  # before RoPE: the adapters add to the projections' outputs
            t, masks = lora_down(h, lora, opts.lora)
            lora_up_(_adapted(qkv.split(opts.widths, dim=1), opts.lora), t, lora, opts.lora)
        q, k, v = _head_views(qkv, batch, opts)
        if torch.compiler.is_compiling():  # new q and k
            q, k = rope_op(q.detach(), k.detach(), cos, sin, _ROPE.head_axis, False)
        else:
            _rope_launch(q, k, cos, sin, _ROPE, backward=False, out=(q, k))
        kept = None if opts.norm_recompute else h
        weights, ctx.frozen = split_frozen((w_q, w_k, w_v))  # a FrozenWeight is loaded again, not saved
        ctx.save_for_backward(x2, norm_weight, rstd, kept, *weights, cos, sin, t, *masks, *lora)
        ctx.opts, ctx.batch, ctx.x_shape, ctx.has_bias = opts, batch, x.shape, b_q is not None
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, norm_weight, rstd, h, w_q, w_k, w_v, cos, sin, t, *rest = ctx.saved_tensors
        opts, need = ctx.opts, ctx.needs_input_grad
        plan, n_lora = opts.lora, 0 if opts.lora is None else len(opts.lora.ranks)
        masks, lora = rest[:n_lora], rest[n_lora:]
        if h is None:
            h = _norm_fwd(x, norm_weight, opts.norm)[0]
        if torch.compiler.is_compiling():
            dq, dk = rope_op(dq.detach(), dk.detach(), cos, sin, _ROPE.head_axis, True)
            dqkv = torch.cat([d.transpose(1, 2).reshape(h.shape[0], -1) for d in (dq, dk, dv)], dim=1)
        else:
            dqkv = h.new_empty(h.shape[0], sum(opts.widths))
            dq_out, dk_out, dv_out = _head_views(dqkv, ctx.batch, opts)
            _rope_launch(dq, dk, cos, sin, _ROPE, backward=True, out=(dq_out, dk_out))
            dv_out.copy_(dv)
        dh = joined_grad_input(dqkv, joined((w_q, w_k, w_v), ctx.frozen)) if need[0] or need[1] else None
        lora_g = ()
        if plan is not None:  # adds the adapters' share of dh into it
            parts = _adapted(dqkv.split(opts.widths, dim=1), plan)
            lora_g = lora_grads(parts, h, t, masks, lora, plan, need[11:], dh)
        dx = dnorm_w = None
        if dh is not None:
            dx, dnorm_w = _norm_bwd(dh, x, norm_weight, rstd, opts.norm, need[0], need[1])
            dx = None if dx is None else dx.view(ctx.x_shape)
        dws = (None, None, None)
        if any(need[2:5]):
            dws = (dqkv.t() @ h).split(opts.widths)
        dbs = dqkv.sum(0).split(opts.widths) if ctx.has_bias and any(need[5:8]) else (None, None, None)
        grads = [g if n else None for g, n in zip((*dws, *dbs), need[2:8], strict=True)]
        return dx, dnorm_w, *grads, None, None, None, *lora_g


def autocast_changes_dtype(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether autocast is on and would cast x or a weight, which :func:`attention_input` does not take."""
    if not torch.is_autocast_enabled(x.device.type):
        return False
    dtype = torch.get_autocast_dtype(x.device.type)
    return any(t.dtype != dtype for t in (x, *weights))


def _check(x, norm_weight, weights, biases, cos, head_dim):
    hidden = x.shape[-1]
    if x.ndim != 3 or norm_weight.shape != (hidden,):
        raise ValueError(
            f"attention_input expects x (B, T, H) and norm_weight (H,); got x {tuple(x.shape)}, "
            f"norm_weight {tuple(norm_weight.shape)}"
        )
    for name, w, b in zip(("w_q", "w_k", "w_v"), weights, biases, strict=True):
        if w.ndim != 2 or w.shape[1] != hidden or w.shape[0] % head_dim:
            raise ValueError(
                f"attention_input: {name} must be (heads * {head_dim}, {hidden}), got {tuple(w.shape)}"
            )
        if b is not None and b.shape != (w.shape[0],):
            raise ValueError(
                f"attention_input: the bias of {name} must be ({w.shape[0]},), got {tuple(b.shape)}"
            )
    if cos.shape[-1] > head_dim or cos.shape[-1] % 2 or cos.shape[-2] != x.shape[1]:
        raise ValueError(
            f"attention_input: cos and sin must be (B or 1, T, R) with R even and <= head_dim "
            f"{head_dim}, T = {x.shape[1]}; got {tuple(cos.shape)}"
        )
    dtypes = {t.dtype for t in (x, *weights, *biases) if t is not None}
    if len(dtypes) > 1:
        got = sorted(map(str, dtypes))
        raise TypeError(f"attention_input: x, weights and biases must share a dtype, got {got}")


def attention_input(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    w_q: Weight,
    w_k: Weight,
    w_v: Weight,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    b_q: torch.Tensor | None = None,
    b_k: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    head_dim: int | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
    norm_recompute: bool = False,
    adapters: tuple[LoraAdapter | None, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm, the q/k/v projections and RoPE in one autograd Function; equals :func:`attention_input_ref`.

    Args:
        x: (B, T, H) the layer's input (the residual stream).
        norm_weight: (H,) the input RMSNorm's weight; ``eps``, ``offset`` and ``casting`` as
            :func:`~chunkloss.kernels.rms_norm` takes them (Gemma: ``offset=1.0, casting="gemma"``).
        w_q, w_k, w_v: (Hq·D, H), (Hkv·D, H), (Hkv·D, H) projection weights, each a tensor or a
            :class:`~chunkloss.kernels.frozen.FrozenWeight` (loaded for each GEMM, never saved); ``b_q``,
            ``b_k``, ``b_v`` their biases (Qwen2) or None.
        cos, sin: (B or 1, T, R) rotary tables as transformers' rotary embedding returns them, R <= D even.
        head_dim: D; default R.
        norm_recompute: do not keep the normalised ``h`` for the backward (H elements per token); the
            backward runs the norm kernel again.
        adapters: ``(q, k, v)``, a :class:`~chunkloss.kernels.lora.LoraAdapter` or None for each projection
            (PEFT's LoRA layers; see ``chunkloss/kernels/lora.py``), or None. The adapters read the normalised
            input; they may be in another dtype than the base (fp32 adapters on a bf16 model).

    Under ``torch.autocast``, x, the projection weights and biases must already be in the autocast dtype (a
    bf16 model under bf16 autocast): the separate modules would normalise x in its own dtype and cast only the
    projections' operands, a rounding this function does not reproduce.

    Returns:
        q (B, Hq, T, D) rotated, k (B, Hkv, T, D) rotated, v (B, Hkv, T, D): views of one projection output,
        the layout ``LlamaAttention`` gives them (not to be modified in place).

    Raises:
        ValueError: mismatched shapes, adapters that do not fit their projection (shape, rank, device,
        dropout). TypeError: mixed dtypes of x, weights and biases, or dtypes autocast would change.
    """
    head_dim = head_dim or cos.shape[-1]
    weights, biases = (w_q, w_k, w_v), (b_q, b_k, b_v)
    check_weights("attention_input", ("w_q", "w_k", "w_v"), weights)
    _check(x, norm_weight, weights, biases, cos, head_dim)
    if autocast_changes_dtype(x, *weights):
        dtype = torch.get_autocast_dtype(x.device.type)
        raise TypeError(
            f"attention_input: under autocast to {dtype}, x and the weights must be in that "
            f"dtype already; got {x.dtype}"
        )
    if any(b is not None for b in biases):  # one concatenated bias, zeros where a projection has none
        biases = tuple(
            torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b
            for w, b in zip(weights, biases, strict=True)
        )
    widths = tuple(w.shape[0] for w in weights)
    plan, lora = plan_lora("attention_input", ("q", "k", "v"), adapters, x.shape[-1], widths, x)
    cos, sin = _tables(cos, sin, None, x.shape[0])
    norm = RMSNormOptions(eps, offset, casting, in_place=True)
    opts = AttentionInputOptions(norm, head_dim, widths, norm_recompute, plan)
    with torch.autocast(x.device.type, enabled=False):
        return AttentionInputFunction.apply(x, norm_weight, *weights, *biases, cos, sin, opts, *lora)
