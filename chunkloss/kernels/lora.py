"""LoRA (arXiv:2106.09685) inside the fused projections: ``y = x·Wᵀ + b + s·(dropout(x)·Aᵀ)·Bᵀ``.

Equals PEFT's ``lora.Linear.forward`` (``peft/tuners/lora/layer.py``) for one active, unmerged, plain
LoRA adapter without ``lora_bias``::

    result = base_layer(x)
    x = x.to(lora_A.weight.dtype)
    result = result + lora_B(lora_A(dropout(x))) * scaling
    result = result.to(base result dtype)

with ``A = lora_A.weight`` (r, in), ``B = lora_B.weight`` (out, r) and ``s = scaling`` (``lora_alpha / r``,
or ``lora_alpha / sqrt(r)`` with ``use_rslora``). The adapter's products run in the adapter's dtype (fp32
adapters on a bf16 base included), or in the autocast dtype under ``torch.autocast``, where PEFT's ``lora_A``
and ``lora_B`` linears run. The base weight is frozen or not: its gradient is computed only when it requires
one.

QLoRA: PEFT's ``Linear4bit`` (``peft/tuners/lora/bnb.py``) adds the adapter to a bitsandbytes 4-bit base in
another order, which an adapter built with ``cast_before_add=True`` follows::

    result = base_layer(x).clone()
    if not torch.is_autocast_enabled():                   # CUDA's autocast
        x = x.to(lora_A.weight.dtype)
        result = result + (lora_B(lora_A(dropout(x))) * scaling).to(result.dtype)
    else:                                                 # nothing cast: dropout draws on x as it is
        result = result + lora_B(lora_A(dropout(x))) * scaling

The base weight is then a :class:`~chunkloss.kernels.frozen.FrozenWeight` (its dequantisation), materialised
for each GEMM and never saved (``chunkloss/kernels/frozen.py``).

FP8 base: a :class:`~chunkloss.kernels.fp8.Float8Weight` (e4m3 with one scale per output row) runs the base's
forward GEMM and its input gradient in fp8 (``chunkloss/kernels/fp8.py``); the adapter's
products stay in the adapter's dtype, and the references compute the base as ``fp8_linear_ref``.

Public API (the fused blocks take one adapter per projection, ``None`` for a projection without one; each
base weight a tensor or a ``FrozenWeight``)::

    LoraAdapter(a, b, scaling, dropout_p=0.0, cast_before_add=False)
    lora_linear(x, weight, bias=None, adapter=None)           # o_proj; equals lora_linear_ref
    attention_input(x, norm_weight, w_q, w_k, w_v, cos, sin, ..., adapters=(q, k, v))
    gated_mlp(x, w_gate, w_up, w_down, ..., adapters=(gate, up, down))
    attention_input_ref / gated_mlp_ref / lora_linear_ref: the same arguments, PEFT's ops one by one

Dropout: ``dropout_p`` is the probability applied, so 0 for a module in eval mode. Every function draws
one keep-mask per adapter with ``dropout_p > 0`` as PEFT does: ``torch.native_dropout`` (the kernel
``F.dropout`` runs on CUDA) on the input cast to the adapter's dtype, from the default generator, in the
order of the projections (q, k, v; gate, up, down). A reference run (or PEFT's forward on CUDA) from the same
``torch.manual_seed`` draws the same masks. The mask is saved for the backward as bool, and
``native_dropout_backward`` applies it again where the dropped input or its gradient is needed.

Backward of one projection, with upstream gradient ``g`` (N, out), ``xd = mask/(1 - p) ⊙ x`` and the saved
``t = xd·Aᵀ`` (N, r)::

    dt = s·(g·B)                         (N, r)
    dB = gᵀ·(s·t)                        (out, r)
    dA = dtᵀ·xd                          (r, in)
    dx = g·W + mask/(1 - p) ⊙ (dt·A)     without dropout: one addmm into the base's input gradient
    dW = gᵀ·x, db = Σ g                  only when the base weight and bias require grad

Projections that read one input (q, k and v; gate and up) and have no dropout share one GEMM
``x·[A_q; A_k; A_v]ᵀ`` in the forward, one ``[dt_q dt_k dt_v]ᵀ·x`` for their ``dA`` and one ``addmm`` into
``dx``.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .frozen import FrozenWeight, Weight, check_weights, grad_input, linear, linear_ref, split_frozen


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One LoRA adapter of one projection, adding ``scaling·(dropout(x)·aᵀ)·bᵀ`` to it.

    Args:
        a: (r, in) PEFT's ``lora_A[name].weight``, any rank r >= 1 (above ``min(in, out)`` too, as in PEFT).
        b: (out, r) ``lora_B[name].weight``, in ``a``'s dtype and on its device.
        scaling: ``scaling[name]`` (``lora_alpha / r``; ``lora_alpha / sqrt(r)`` with ``use_rslora``).
        dropout_p: the dropout probability applied to the adapter's input: ``lora_dropout[name].p`` in
            training mode, 0 in eval mode (or for ``nn.Identity``).
        cast_before_add: add as PEFT's 4-bit ``Linear4bit`` does (see the module docstring): outside CUDA's
            autocast the update is cast to the base output's dtype and then added (``lora.Linear`` adds in the
            promoted dtype and casts the sum); under it the input is not cast to the adapter's dtype, so
            dropout draws its mask on the input's dtype.
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    dropout_p: float = 0.0
    cast_before_add: bool = False


@dataclass(frozen=True)
class LoraPlan:
    """What an autograd Function knows of the adapters of the projections that read one input."""

    slots: tuple[int, ...]  # the projections (by position among those reading the input) that have an adapter
    ranks: tuple[int, ...]
    scalings: tuple[float, ...]
    dropout_ps: tuple[float, ...]
    dtype: torch.dtype  # the adapters' compute dtype: theirs, or the autocast dtype
    cast_outs: tuple[bool, ...]  # the update is cast to the output's dtype before the addition
    keep_inputs: tuple[bool, ...]  # dropout draws on the input in its own dtype, not the adapter's

    @property
    def shared(self) -> bool:
        """No dropout: one GEMM with the concatenated A matrices serves every adapter."""
        return not any(self.dropout_ps)


def _dropout(x: torch.Tensor, mask: torch.Tensor | None, p: float) -> torch.Tensor:
    """``mask/(1 - p) ⊙ x`` in one kernel, as the dropout drawn with ``mask`` computed it."""
    return x if mask is None else torch.ops.aten.native_dropout_backward(x, mask, 1.0 / (1.0 - p))


def lora_ref(result: torch.Tensor, x: torch.Tensor, adapter: LoraAdapter | None) -> torch.Tensor:
    """PEFT's adapter step, ``(result + lora_B(lora_A(dropout(x.to(A.dtype)))) * scaling)`` cast back to
    ``result.dtype``; with ``cast_before_add``, ``Linear4bit``'s (see the module docstring)."""
    if adapter is None:
        return result
    dtype = result.dtype
    convert = not (adapter.cast_before_add and torch.is_autocast_enabled("cuda"))
    if convert:
        x = x.to(adapter.a.dtype)
    if adapter.dropout_p:  # nn.Dropout in training mode, as F.dropout runs it on CUDA
        x = torch.native_dropout(x, adapter.dropout_p, True)[0]
    update = F.linear(F.linear(x, adapter.a), adapter.b) * adapter.scaling
    if not adapter.cast_before_add:
        return (result + update).to(dtype)
    return result + (update.to(dtype) if convert else update)


def lora_linear_ref(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None = None,
    adapter: LoraAdapter | None = None,
) -> torch.Tensor:
    """Pure PyTorch, op for op as PEFT's ``lora.Linear.forward``; arguments as :func:`lora_linear`."""
    return lora_ref(linear_ref(x, weight, bias), x, adapter)


def _check_adapter(where: str, adapter, in_features: int, out_features: int, x: torch.Tensor) -> None:
    if not isinstance(adapter, LoraAdapter):
        raise TypeError(f"{where} must be a LoraAdapter or None, got {type(adapter).__name__}")
    a, b = adapter.a, adapter.b
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_features or b.shape != (out_features, a.shape[0]):
        raise ValueError(
            f"{where}: a must be (r, {in_features}) and b ({out_features}, r); got a "
            f"{tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if a.shape[0] < 1:  # no upper bound: the products hold for r > min(in, out) too, which PEFT accepts
        raise ValueError(f"{where}: rank must be at least 1, got {a.shape[0]}")
    if not a.is_floating_point() or b.dtype != a.dtype:
        raise TypeError(f"{where}: a and b must share a floating-point dtype; got {a.dtype} and {b.dtype}")
    if a.device != x.device or b.device != x.device:
        raise ValueError(
            f"{where}: a and b must be on the input's device {x.device}; got {a.device} and {b.device}"
        )
    if not math.isfinite(adapter.scaling):
        raise ValueError(f"{where}: scaling must be finite, got {adapter.scaling}")
    if not 0.0 <= adapter.dropout_p < 1.0:
        raise ValueError(f"{where}: dropout_p must be in [0, 1), got {adapter.dropout_p}")


def plan_lora(
    where: str, names: tuple[str, ...], adapters, in_features: int, widths: tuple[int, ...], x: torch.Tensor
) -> tuple[LoraPlan | None, tuple[torch.Tensor, ...]]:
    """Checks the adapters given per projection (``names``, output ``widths``) and returns their plan and
    tensors ``(a, b)`` of each adapter in turn; ``(None, ())`` without adapters. Call it where autocast is as
    the caller set it: under autocast the adapters compute in its dtype."""
    if adapters is None:
        return None, ()
    if not isinstance(adapters, (tuple, list)) or len(adapters) != len(names):
        raise ValueError(
            f"{where}: adapters must be a tuple of {len(names)} (for {', '.join(names)}), "
            f"each a LoraAdapter or None"
        )
    present = [(i, ad) for i, ad in enumerate(adapters) if ad is not None]
    if not present:
        return None, ()
    for i, ad in present:
        _check_adapter(f"{where}: the {names[i]} adapter", ad, in_features, widths[i], x)
    dtypes = {ad.a.dtype for _, ad in present}
    if len(dtypes) > 1:
        raise TypeError(
            f"{where}: the adapters of {', '.join(names)} must share a dtype, got {sorted(map(str, dtypes))}"
        )
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else dtypes.pop()
    cuda_autocast = torch.is_autocast_enabled("cuda")  # what PEFT's Linear4bit asks
    plan = LoraPlan(
        slots=tuple(i for i, _ in present),
        ranks=tuple(ad.a.shape[0] for _, ad in present),
        scalings=tuple(float(ad.scaling) for _, ad in present),
        dropout_ps=tuple(float(ad.dropout_p) for _, ad in present),
        dtype=dtype,
        cast_outs=tuple(bool(ad.cast_before_add) and not cuda_autocast for _, ad in present),
        keep_inputs=tuple(bool(ad.cast_before_add) and cuda_autocast for _, ad in present),
    )
    return plan, tuple(t for _, ad in present for t in (ad.a, ad.b))


def _dropped(x: torch.Tensor, weights, mask, p: float, keep_input: bool, plan: LoraPlan) -> torch.Tensor:
    """``dropout(x)`` in ``plan.dtype`` with a saved mask, as PEFT's forward computed it: in the adapters'
    dtype (``x``'s own with ``keep_input``), or straight in ``plan.dtype`` when ``x`` is in it
    (``x·mask/(1 - p)`` rounds once either way)."""
    keep = keep_input or x.dtype == plan.dtype
    return _dropout(x if keep else x.to(weights[0].dtype), mask, p).to(plan.dtype)


def lora_down(x: torch.Tensor, weights, plan: LoraPlan):
    """``t = [dropout_j(x)·A_jᵀ]_j`` (N, Σr) in ``plan.dtype`` and the masks drawn (None where p = 0)."""
    a_list = [a.to(plan.dtype) for a in weights[0::2]]
    if plan.shared:
        xc = x.to(plan.dtype)
        return xc @ (a_list[0] if len(a_list) == 1 else torch.cat(a_list)).t(), (None,) * len(a_list)
    xa = x.to(weights[0].dtype)
    ts, masks = [], []
    for a, p, keep in zip(a_list, plan.dropout_ps, plan.keep_inputs, strict=True):
        xin = x if keep else xa  # PEFT's Linear4bit under CUDA's autocast drops x as it comes
        xd, mask = torch.native_dropout(xin, p, True) if p else (xin, None)
        ts.append(xd.to(plan.dtype) @ a.t())
        masks.append(mask)
    return (ts[0] if len(ts) == 1 else torch.cat(ts, dim=1)), tuple(masks)


def lora_up_(outs, t: torch.Tensor, weights, plan: LoraPlan) -> None:
    """``outs[j] += s_j·t_j·B_jᵀ`` in place, rounded once; ``outs`` are the (N, out_j) outputs (views) of
    the projections with an adapter."""
    parts = zip(outs, t.split(plan.ranks, dim=1), weights[1::2], plan.scalings, plan.cast_outs, strict=True)
    for out, tj, b, s, cast_out in parts:
        b = b.to(plan.dtype)
        if out.dtype == plan.dtype:
            out.addmm_(tj, b.t(), alpha=s)
        elif cast_out:  # PEFT's Linear4bit: the update rounded to the base's dtype, then added
            out.add_((tj @ b.t()).mul_(s).to(out.dtype))
        else:  # PEFT adds in the promoted dtype, then casts to the base's
            out.add_(tj @ b.t(), alpha=s)


def lora_dt(gs, t: torch.Tensor, weights, plan: LoraPlan, need, need_dt: bool):
    """``dt = [s_j·g_j·B_j]_j`` (N, Σr) in ``plan.dtype`` (None unless ``need_dt``) and the list of ``dB_j``
    (None where ``need``, the flags of (a, b, a, b, ...), says no), from the (N, out_j) upstream gradients."""
    dts, dbs = [], []
    ts = t.split(plan.ranks, dim=1) if t is not None else (None,) * len(plan.ranks)  # None: no dB wanted
    for j, (g, tj, b, s) in enumerate(zip(gs, ts, weights[1::2], plan.scalings, strict=True)):
        gc = g.to(plan.dtype)
        dbs.append((gc.t() @ (tj * s)).to(b.dtype) if need[2 * j + 1] else None)
        if need_dt:
            dts.append(gc @ b.to(plan.dtype) * s)
    dt = None if not need_dt else dts[0] if len(dts) == 1 else torch.cat(dts, dim=1)
    return dt, dbs


def lora_dx_(dx: torch.Tensor, dt: torch.Tensor, masks, weights, plan: LoraPlan) -> None:
    """``dx += Σ_j mask_j/(1 - p_j) ⊙ (dt_j·A_j)`` in place (one addmm without dropout)."""
    a_list = [a.to(plan.dtype) for a in weights[0::2]]
    if plan.shared:
        a = a_list[0] if len(a_list) == 1 else torch.cat(a_list)
        if dx.dtype == plan.dtype:
            dx.addmm_(dt, a)
        else:
            dx.add_(dt @ a)
        return
    for dtj, a, m, p in zip(dt.split(plan.ranks, dim=1), a_list, masks, plan.dropout_ps, strict=True):
        if m is None:
            dx.add_(dtj @ a)
        else:
            dx.addcmul_(dtj @ a, m, value=1.0 / (1.0 - p))


def lora_da(dt: torch.Tensor, x: torch.Tensor, masks, weights, plan: LoraPlan, need):
    """The list of ``dA_j = dt_jᵀ·dropout_j(x)`` (None where ``need`` says no)."""
    a_list = weights[0::2]
    wanted = [bool(need[2 * j]) for j in range(len(a_list))]
    if not any(wanted):
        return [None] * len(a_list)
    if plan.shared:
        das = (dt.t() @ x.to(plan.dtype)).split(plan.ranks)
    else:
        parts = zip(
            dt.split(plan.ranks, dim=1), masks, plan.dropout_ps, plan.keep_inputs, wanted, strict=True
        )
        das = [dtj.t() @ _dropped(x, weights, m, p, k, plan) if w else None for dtj, m, p, k, w in parts]
    return [da.to(a.dtype) if w else None for da, a, w in zip(das, a_list, wanted, strict=True)]


def lora_grads(gs, x: torch.Tensor, t, masks, weights, plan: LoraPlan, need, dx: torch.Tensor | None):
    """The adapters' gradients ``(dA_1, dB_1, dA_2, ...)`` (None where ``need`` says no); their input gradient
    is added into ``dx`` (skipped when None)."""
    need_dt = dx is not None or any(need[0::2])
    dt, dbs = lora_dt(gs, t, weights, plan, need, need_dt)
    if dx is not None:
        lora_dx_(dx, dt, masks, weights, plan)
    das = lora_da(dt, x, masks, weights, plan, need) if need_dt else [None] * len(dbs)
    return tuple(g for pair in zip(das, dbs, strict=True) for g in pair)


class LoraLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: LoraPlan | None, *lora):
        y = linear(x, weight, bias)
        t, masks = None, ()
        if plan is not None:
            t, masks = lora_down(x, lora, plan)
            lora_up_([y], t, lora, plan)
        (kept,), (ctx.frozen,) = split_frozen((weight,))
        x_kept = x if plan is not None or ctx.needs_input_grad[1] else None  # for dA, dW
        ctx.save_for_backward(x_kept, kept, t, *masks, *lora)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, t, *rest = ctx.saved_tensors
        plan, need = ctx.plan, ctx.needs_input_grad
        n = 0 if plan is None else len(plan.ranks)
        masks, lora = rest[:n], rest[n:]
        dx = grad_input(dy, weight if ctx.frozen is None else ctx.frozen) if need[0] else None
        dw = dy.t() @ x if need[1] else None
        db = dy.sum(0) if need[2] else None
        grads = () if plan is None else lora_grads([dy], x, t, masks, lora, plan, need[4:], dx)
        return dx, dw, db, None, *grads


def lora_linear(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None = None,
    adapter: LoraAdapter | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` plus a LoRA adapter: one autograd Function, its backward written out.

    Equals :func:`lora_linear_ref` (PEFT's ``lora.Linear.forward``). Under ``torch.autocast`` the base
    operands are cast to the autocast dtype, as ``F.linear`` casts them, and the adapter's products run in it.

    Args:
        x: (..., in) input.
        weight: (out, in) the base weight (frozen or not), or a
            :class:`~chunkloss.kernels.frozen.FrozenWeight` loaded for the forward's GEMM and again for the
            backward's, never saved; bias: (out,) or None.
        adapter: the projection's :class:`LoraAdapter`, or None (then this is ``F.linear``).

    Returns:
        (..., out) in the base's dtype (the autocast dtype under autocast).

    Raises:
        ValueError: mismatched shapes or devices, a rank of 0, dropout outside [0, 1).
        TypeError: mixed base dtypes, or an adapter whose a and b differ in dtype.
    """
    check_weights("lora_linear", ("weight",), (weight,))
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    out_features, in_features = weight.shape if weight.ndim == 2 else (-1, -1)
    if weight.ndim != 2 or x.shape[-1] != in_features or (bias is not None and bias.shape != (out_features,)):
        raise ValueError(
            f"lora_linear expects x (..., in), weight (out, in) and bias (out,); got x "
            f"{tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"bias {None if bias is None else tuple(bias.shape)}"
        )
    dtypes = {t.dtype for t in (x, weight, bias) if t is not None}
    if len(dtypes) > 1:
        raise TypeError(f"lora_linear: x, weight and bias must share a dtype, got {sorted(map(str, dtypes))}")
    plan, lora = plan_lora("lora_linear", ("weight",), (adapter,), in_features, (out_features,), x)
    if plan is None and not isinstance(weight, FrozenWeight):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, in_features)
    with torch.autocast(x.device.type, enabled=False):
        y = LoraLinearFunction.apply(x2, weight, bias, plan, *lora)
    return y.view(*x.shape[:-1], out_features)
