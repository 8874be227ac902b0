"""Gated MLP ``down(act(gate(x)) * up(x))`` as one autograd Function keeping at most ``x``, ``g`` and ``u``.

Equals the forward of ``transformers``' ``LlamaMLP`` / ``GemmaMLP``,
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, for ``act`` in silu (SwiGLU), tanh-approximated gelu and
exact gelu (GeGLU). The gated product ``h`` is never saved: the backward recomputes it in the pass that
computes ``dg`` and ``du``.

``g`` and ``u`` come from cuBLAS, ``h`` from the Triton GLU kernel; in the backward, one Triton pass over
``g``, ``u`` and ``dh`` writes ``dg``, ``du`` and ``h`` (over ``dh``). The down projection ``y = h Wd^T + bd``
is one cuBLAS GEMM.

Backward, with ``dy`` the upstream gradient (``'`` is the activation's derivative)::

    dh = dy Wd                              (cuBLAS)
    dg = dh * u * act'(g),  du = dh * act(g)
    dWd = dy^T h,  dx = dg Wg + du Wu,  dWg = dg^T x,  dWu = du^T x,  dbg, dbu, dbd = column sums

``recompute=True`` (default) saves only ``x``: the backward replays the gate/up GEMMs (not a checkpoint of the
layer). ``recompute=False`` also saves ``g`` and ``u`` (2·I more elements per token) and replays nothing.
With ``recompute`` and no adapter dropout, ``x`` and the parameters are saved by a node ahead of the MLP
(:class:`_HeldInputs`), before it runs: a non-reentrant checkpoint's recompute of a pre-norm layer stops at
that save, its last, and does not run the MLP's forward again (the adapters' ``t`` are then computed again in
the backward, from ``x`` and the replayed ``h``).
Weight gradients are computed only for weights that require grad.

LoRA (``adapters=(gate, up, down)``, each a :class:`~chunkloss.kernels.lora.LoraAdapter` or None): the
low-rank updates ``s·(dropout(x)·Aᵀ)·Bᵀ`` are added to ``g`` and ``u`` before the gating and to ``y``, with
their backward written out in ``chunkloss/kernels/lora.py``: ``dh`` gets the down adapter's ``dt·A`` and
``dx`` the gate and up adapters', in one ``addmm`` each (and, without dropout, one GEMM ``x·[A_g; A_u]ᵀ`` and
one for both ``dA``). The replay of ``g`` and ``u`` adds the saved ``t = x·Aᵀ`` (N, r) back. Saved besides
``x``: each adapter's ``t`` and dropout mask.

QLoRA: a weight given as a :class:`~chunkloss.kernels.frozen.FrozenWeight` (a 4-bit base's dequantisation)
is loaded right before each GEMM that reads it (forward; ``dh`` or ``dx`` in the backward; the replay) and
dropped after it; it is never saved.

FP8 base: a weight given as a :class:`~chunkloss.kernels.fp8.Float8Weight` runs each of those GEMMs in
fp8 (``chunkloss/kernels/fp8.py``), the replay included. gate and up stay two GEMMs each
way, as the modules are: ``dx = dg·Wg + du·Wu`` quantises ``dg`` and ``du`` with scales of their own, as
:func:`gated_mlp_ref` does.
"""

from dataclasses import dataclass

import torch
from torch import nn

from .frozen import (
    FrozenWeight,
    Weight,
    add_grad_input_,
    check_weights,
    grad_input,
    joined,
    linear,
    linear_ref,
    split_frozen,
)
from .glu import ACTIVATIONS, GLUOptions, _glu_bwd, _glu_fwd, glu_ref
from .lora import (
    LoraAdapter,
    LoraPlan,
    lora_da,
    lora_down,
    lora_dt,
    lora_dx_,
    lora_grads,
    lora_ref,
    lora_up_,
    plan_lora,
)


def gated_mlp_ref(
    x: torch.Tensor,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    *,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "silu",
    adapters: tuple[LoraAdapter | None, ...] | None = None,
) -> torch.Tensor:
    """Pure-PyTorch gated MLP, op for op as ``LlamaMLP`` (``"silu"``) / ``GemmaMLP`` compute it.

    Args:
        x: (..., H) input.
        w_gate, w_up: (I, H) ``gate_proj`` / ``up_proj`` weights; ``w_down``: (H, I); each a tensor or a
            ``FrozenWeight``.
        b_gate, b_up: (I,) biases, ``b_down``: (H,) bias, or None.
        activation: "silu", "gelu_tanh" or "gelu" (exact).
        adapters: ``(gate, up, down)`` LoRA adapters (each a ``LoraAdapter`` or None) computed as PEFT's LoRA
            layers compute them, or None.

    Returns:
        (..., H) ``F.linear(act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), w_down, b_down)``.
    """
    gate_ad, up_ad, down_ad = adapters or (None, None, None)
    g = lora_ref(linear_ref(x, w_gate, b_gate), x, gate_ad)
    u = lora_ref(linear_ref(x, w_up, b_up), x, up_ad)
    gated = glu_ref(g, u, activation)
    return lora_ref(linear_ref(gated, w_down, b_down), gated, down_ad)


@dataclass(frozen=True)
class MLPOptions:
    activation: str = "silu"
    recompute: bool = True  # save only x; the backward replays the gate/up GEMMs
    lora_in: LoraPlan | None = None  # the adapters of gate and up (they read x)
    lora_out: LoraPlan | None = None  # the adapter of down (it reads h)


def _n_tensors(plan: LoraPlan | None) -> int:
    return 0 if plan is None else len(plan.ranks)


def _split(items, *sizes):
    """Consecutive runs of ``sizes`` items, then the rest."""
    runs, start = [], 0
    for size in sizes:
        runs.append(items[start : start + size])
        start += size
    return *runs, items[start:]


def _gate_up(x, w_gate, w_up, b_gate, b_up, lora_in, t_in, opts: MLPOptions):
    """g, u (M, I): the base GEMMs plus the gate and up adapters' ``s·t·Bᵀ``."""
    g, u = linear(x, w_gate, b_gate), linear(x, w_up, b_up)
    if opts.lora_in is not None:
        lora_up_([(g, u)[i] for i in opts.lora_in.slots], t_in, lora_in, opts.lora_in)
    return g, u


class GatedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down, opts: MLPOptions, held, *lora):
        lora_in, lora_out = lora[: 2 * _n_tensors(opts.lora_in)], lora[2 * _n_tensors(opts.lora_in) :]
        t_in, masks_in = lora_down(x, lora_in, opts.lora_in) if opts.lora_in is not None else (None, ())
        g, u = _gate_up(x, w_gate, w_up, b_gate, b_up, lora_in, t_in, opts)
        h, g, u = _glu_fwd(g, u, GLUOptions(opts.activation))
        y = linear(h, w_down, b_down)
        t_out, masks_out = None, ()
        if opts.lora_out is not None:
            t_out, masks_out = lora_down(h, lora_out, opts.lora_out)
            lora_up_([y], t_out, lora_out, opts.lora_out)
        saved = () if opts.recompute else (g, u)
        weights, ctx.frozen = split_frozen((w_gate, w_up, w_down))  # a FrozenWeight is loaded again
        ctx.opts, ctx.held = opts, held
        if held is None:
            ctx.save_for_backward(
                x, *weights, b_gate, b_up, t_in, t_out, *masks_in, *masks_out, *lora, *saved
            )
        return y

    @staticmethod
    def saved(ctx) -> list:
        """What :meth:`forward` saved, or, for a tile of :class:`_HeldInputs`, the same read from that node:
        the tile's rows of ``x``, ``t_in`` computed again, ``t_out`` None (the backward computes it from the
        ``h`` it recomputes) and no masks (held inputs have no dropout)."""
        if ctx.held is None:
            return list(ctx.saved_tensors)
        held, start, stop = ctx.held
        x, w_gate, w_up, w_down, b_gate, b_up, *lora = held.take()
        x, opts = x[start:stop], ctx.opts
        n_in, n_out = _n_tensors(opts.lora_in), _n_tensors(opts.lora_out)
        t_in = lora_down(x, lora[: 2 * n_in], opts.lora_in)[0] if n_in else None
        return [x, w_gate, w_up, w_down, b_gate, b_up, t_in, None, *(None,) * (n_in + n_out), *lora]

    @staticmethod
    def backward(ctx, dy):
        x, w_gate, w_up, w_down, b_gate, b_up, t_in, t_out, *rest = GatedMLPFunction.saved(ctx)
        w_gate, w_up, w_down = joined((w_gate, w_up, w_down), ctx.frozen)
        need, opts = ctx.needs_input_grad, ctx.opts
        n_in, n_out = _n_tensors(opts.lora_in), _n_tensors(opts.lora_out)
        masks_in, masks_out, lora_in, lora_out, saved = _split(rest, n_in, n_out, 2 * n_in, 2 * n_out)
        need_in, need_out = need[9 : 9 + 2 * n_in], need[9 + 2 * n_in :]
        dy = dy.contiguous()
        dh = grad_input(dy, w_down)
        dt_out = grads_out = None
        if opts.lora_out is not None:  # dt·A into dh now, dA (and dB without t_out) once h is written below
            need_b = need_out if t_out is not None else (need_out[0], False)
            dt_out, db_out = lora_dt([dy], t_out, lora_out, opts.lora_out, need_b, True)
            lora_dx_(dh, dt_out, masks_out, lora_out, opts.lora_out)
        if saved:
            g, u = saved
        else:
            g, u = _gate_up(x, w_gate, w_up, b_gate, b_up, lora_in, t_in, opts)
        # One pass: dg, du over g, u (when replayed) and h over dh.
        dg, du, h = _glu_bwd(dh, g, u, GLUOptions(opts.activation, in_place=len(saved) == 0), c=dh)
        if opts.lora_out is not None:
            if t_out is None:
                t_out = lora_down(h, lora_out, opts.lora_out)[0]
                db_out = lora_dt([dy], t_out, lora_out, opts.lora_out, need_out, False)[1]
            da_out = lora_da(dt_out, h, masks_out, lora_out, opts.lora_out, need_out)
            grads_out = tuple(g for pair in zip(da_out, db_out, strict=True) for g in pair)
        dw_down = dy.t() @ h if need[3] else None
        del h, dh  # freed before the input and gate/up weight gradients are allocated
        dx = None
        if need[0] and (ctx.held is None or ctx.held[0].x_grad):  # a held x needing none still passes one
            dx = grad_input(dg, w_gate)
            add_grad_input_(dx, du, w_up)
        grads_in = ()
        if opts.lora_in is not None:
            parts = [(dg, du)[i] for i in opts.lora_in.slots]
            grads_in = lora_grads(parts, x, t_in, masks_in, lora_in, opts.lora_in, need_in, dx)
        dw_gate = dg.t() @ x if need[1] else None
        dw_up = du.t() @ x if need[2] else None
        db_gate = dg.sum(0) if need[4] else None
        db_up = du.sum(0) if need[5] else None
        db_down = dy.sum(0) if need[6] else None
        return dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down, None, None, *grads_in, *(grads_out or ())


class _HeldInputs(torch.autograd.Function):
    """``x`` as it is, saving ``x`` and the MLP's parameters *before* the MLP runs; the tiles of
    :class:`GatedMLPFunction` then save nothing and read them from this node in their backward.

    Under non-reentrant checkpointing (early stop, torch's default) the recompute of a layer stops at its last
    save. In a pre-norm layer this one is the last (the residual addition after the MLP saves nothing), so the
    recompute never runs the MLP's forward, whose output nothing in the backward reads: one of the MLP's four
    forward passes of a checkpointed step with ``recompute`` (forward, recompute, replay in the backward) is
    gone. Where something after the MLP saves a tensor, the recompute runs on through the MLP as before."""

    @staticmethod
    def forward(ctx, x, *tensors):
        ctx.save_for_backward(x, *tensors)
        ctx.n = len(tensors)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return dx, *(None,) * ctx.n


class _Held:
    """A :class:`_HeldInputs` node's saved tensors for the ``tiles`` tile backwards that read them: unpacked
    once (checkpointing allows one unpack per saved tensor) and let go after the last of them."""

    __slots__ = ("node", "tiles", "left", "values", "x_grad")

    def __init__(self, node, tiles: int, x_grad: bool):
        self.node, self.tiles, self.left, self.values = node, tiles, tiles, None
        self.x_grad = x_grad  # whether x itself needs a gradient (the node's output does when a weight does)

    def take(self) -> tuple:
        values = self.values if self.values is not None else self.node.saved_tensors
        self.left -= 1
        self.values = values if self.left else None
        self.left = self.left or self.tiles  # a second backward (retain_graph) unpacks again
        return values


def _hold(x2, weights, b_gate, b_up, opts: MLPOptions, lora, tiles: int, x_grad: bool):
    """``(x2, held)``: ``x2`` through :class:`_HeldInputs` and its :class:`_Held` record for ``tiles``
    tiles, where the MLP saves only ``x`` (``recompute``, no adapter dropout: a mask is drawn in the forward)
    and runs eagerly with gradients; else ``(x2, None)``, each tile saving its own tensors."""
    plans = [p for p in (opts.lora_in, opts.lora_out) if p is not None]
    if not opts.recompute or not all(p.shared for p in plans):  # shared: no dropout
        return x2, None
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return x2, None
    out = _HeldInputs.apply(x2, *split_frozen(weights)[0], b_gate, b_up, *lora)
    return (x2, None) if out.grad_fn is None else (out, _Held(out.grad_fn, tiles, x_grad))


def _check(x, w_gate, w_up, w_down, biases, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    hidden, inter = x.shape[-1], w_gate.shape[0]
    if w_gate.shape != (inter, hidden) or w_up.shape != (inter, hidden) or w_down.shape != (hidden, inter):
        raise ValueError(
            f"gated_mlp expects x (..., H), w_gate and w_up (I, H), w_down (H, I); got x {tuple(x.shape)}, "
            f"w_gate {tuple(w_gate.shape)}, w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)}"
        )
    for name, b, size in zip(("b_gate", "b_up", "b_down"), biases, (inter, inter, hidden)):
        if b is not None and b.shape != (size,):
            raise ValueError(f"gated_mlp: {name} must have shape ({size},), got {tuple(b.shape)}")
    dtypes = {t.dtype for t in (x, w_gate, w_up, w_down, *biases) if t is not None}
    if len(dtypes) > 1:
        got = sorted(map(str, dtypes))
        raise TypeError(f"gated_mlp: x, weights and biases must share a dtype, got {got}")


def gated_mlp(
    x: torch.Tensor,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    *,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "silu",
    recompute: bool = True,
    adapters: tuple[LoraAdapter | None, ...] | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Fused ``F.linear(act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), w_down, b_down)``.

    Equals :func:`gated_mlp_ref` (``LlamaMLP`` / ``GemmaMLP``, with PEFT's LoRA layers where ``adapters`` has
    an adapter). Under ``torch.autocast`` the base operands are cast to the autocast dtype, as ``nn.Linear``
    would be, and the adapters' products run in it.

    Args:
        x: (..., H) input.
        w_gate, w_up: (I, H) weights; w_down: (H, I); each a tensor or a
            :class:`~chunkloss.kernels.frozen.FrozenWeight` (loaded for each GEMM, never saved).
        b_gate, b_up: (I,) biases or None; b_down: (H,) bias or None.
        activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (exact; GeGLU).
        recompute: save only ``x`` for the backward, which replays the gate/up GEMMs (H elements saved per
            token); False saves ``x`` and the pre-activations ``g``, ``u`` (H + 2I) and replays nothing.
        adapters: ``(gate, up, down)``, a :class:`~chunkloss.kernels.lora.LoraAdapter` or None for each
            projection (see ``chunkloss/kernels/lora.py``), or None. They may be in another dtype than the
            base.
        tile: rows (tokens) per call of the fused Function, or None for one call over all rows. Each tile is
            its own autograd node, so the (rows, I) intermediates of the forward and of the backward exist for
            one tile at a time; with ``recompute`` the memory the MLP adds beyond its input and output is
            O(tile), not O(tokens). The weights' gradients are the sums of the tiles' (autograd's
            accumulation).

    Returns:
        (..., H) in ``x.dtype`` (the autocast dtype under autocast).

    Raises:
        ValueError: an unknown activation, mismatched shapes, adapters that do not fit their projection.
        TypeError: mixed dtypes of x, weights and biases outside autocast.
    """
    biases = (b_gate, b_up, b_down)
    check_weights("gated_mlp", ("w_gate", "w_up", "w_down"), (w_gate, w_up, w_down))
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w_gate, w_up, w_down = (t.to(dtype) for t in (x, w_gate, w_up, w_down))
        biases = tuple(None if b is None else b.to(dtype) for b in biases)
    _check(x, w_gate, w_up, w_down, biases, activation)
    hidden, inter = x.shape[-1], w_gate.shape[0]
    if adapters is not None and (not isinstance(adapters, (tuple, list)) or len(adapters) != 3):
        raise ValueError(
            "gated_mlp: adapters must be a tuple of 3 (for gate, up, down), each a LoraAdapter or None"
        )
    gate_ad, up_ad, down_ad = adapters or (None, None, None)
    plan_in, lora_in = plan_lora("gated_mlp", ("gate", "up"), (gate_ad, up_ad), hidden, (inter, inter), x)
    plan_out, lora_out = plan_lora("gated_mlp", ("down",), (down_ad,), inter, (hidden,), x)
    b_gate, b_up, b_down = biases
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] == 0:
        return gated_mlp_ref(
            x,
            w_gate,
            w_up,
            w_down,
            b_gate=b_gate,
            b_up=b_up,
            b_down=b_down,
            activation=activation,
            adapters=adapters,
        )
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w_gate, w_up, w_down = (
        w if isinstance(w, FrozenWeight) else w.contiguous() for w in (w_gate, w_up, w_down)
    )
    opts = MLPOptions(activation, recompute, plan_in, plan_out)
    if tile is not None and (type(tile) is not int or tile <= 0):
        raise ValueError(f"gated_mlp: tile must be a positive int or None, got {tile!r}")
    with torch.autocast(x.device.type, enabled=False):
        rows = x2.shape[0]
        bounds = [(a, min(a + tile, rows)) for a in range(0, rows, tile)] if tile else [(0, rows)]
        lora = (*lora_in, *lora_out)
        x2, held = _hold(x2, (w_gate, w_up, w_down), b_gate, b_up, opts, lora, len(bounds), x.requires_grad)
        args = (w_gate, w_up, w_down, b_gate, b_up, b_down, opts)
        ys = [
            GatedMLPFunction.apply(x2[a:b], *args, None if held is None else (held, a, b), *lora)
            for a, b in bounds
        ]
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
    return y.view(*shape[:-1], y.shape[-1])


class FusedGatedMLP(nn.Module):
    """Gated MLP with ``transformers``' parameter names (``gate_proj``, ``up_proj``, ``down_proj``).

    Args:
        hidden_size: H.
        intermediate_size: I.
        activation: "silu", "gelu_tanh" or "gelu".
        bias: biases on all three projections (Llama's ``mlp_bias``).
        recompute: see :func:`gated_mlp`.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        bias: bool = False,
        recompute: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.activation, self.recompute = activation, recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(
            x,
            self.gate_proj.weight,
            self.up_proj.weight,
            self.down_proj.weight,
            b_gate=self.gate_proj.bias,
            b_up=self.up_proj.bias,
            b_down=self.down_proj.bias,
            activation=self.activation,
            recompute=self.recompute,
        )

    def extra_repr(self) -> str:
        return f"activation={self.activation}, recompute={self.recompute}"
