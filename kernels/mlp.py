"""Gated MLP ``down(act(gate(x)) * up(x))`` as one autograd Function keeping at most ``x``, ``g`` and ``u``.

Equals the forward of ``transformers``' ``LlamaMLP`` / ``GemmaMLP``,
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, for ``act`` in silu (SwiGLU), tanh-approximated gelu and
exact gelu (GeGLU). The gated product ``h`` is never saved: the backward recomputes it in the pass that
computes ``dg`` and ``du``.

The gate/up projections run one of two ways (``gate_up_gemm``):

* ``"cublas"`` (default): ``g``, ``u`` by cuBLAS, ``h`` by the Triton GLU kernel; in the backward, one Triton
  pass over ``g``, ``u`` and ``dh`` writes ``dg``, ``du`` and ``h`` (over ``dh``).
* ``"triton"``: one Triton GEMM computes a tile of ``g = x Wg^T + bg`` and the same tile of
  ``u = x Wu^T + bu`` (two fp32 accumulators that share each loaded tile of ``x``) and writes only
  ``h = act(g) * u``; the pre-activations never reach memory, and the backward's gating is in a Triton
  GEMM's epilogue too.

The down projection ``y = h Wd^T + bd`` is one cuBLAS GEMM.

Backward, with ``dy`` the upstream gradient (``'`` is the activation's derivative)::

    dh = dy Wd                              (cuBLAS)
    dg = dh * u * act'(g),  du = dh * act(g)
    dWd = dy^T h,  dx = dg Wg + du Wu,  [dWg; dWu] = [dg du]^T x,  dbg, dbu, dbd = column sums

``recompute=True`` (default) saves only ``x``: the backward replays the gate/up GEMM (one extra GEMM, not a
checkpoint of the layer; with ``"triton"`` its epilogue reads ``dh`` and writes ``dg | du`` and ``h`` over
``dh``). ``recompute=False`` also saves ``g`` and ``u`` (2·I more elements per token) and replays nothing
(with ``"triton"`` the backward computes ``dh`` in Triton with ``dg``, ``du`` and ``h`` in that GEMM's
epilogue, so ``dh`` never reaches memory). Saved per token: H elements against ``H + 2I``.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from ._utils import cdiv, next_power_of_2
from .glu import _ACT_ID, _SQRT_2_OVER_PI, ACTIVATIONS, GLUOptions, _act_and_grad, _glu_bwd, _glu_fwd, glu_ref

# Set at import, as Triton reads it: kernels then run in the interpreter (tests on CPU).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Kernel modes (constexpr MODE).
_FWD, _FWD_SAVE, _BWD_REPLAY, _BWD_SAVED = 0, 1, 2, 3
GATE_UP_GEMMS = ("cublas", "triton")


def gated_mlp_ref(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
    b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """Pure-PyTorch gated MLP, op for op as ``LlamaMLP`` (``"silu"``) / ``GemmaMLP`` compute it.

    Args:
        x: (..., H) input.
        w_gate, w_up: (I, H) ``gate_proj`` / ``up_proj`` weights; ``w_down``: (H, I).
        b_gate, b_up: (I,) biases, ``b_down``: (H,) bias, or None.
        activation: "silu", "gelu_tanh" or "gelu" (exact).

    Returns:
        (..., H) ``F.linear(act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), w_down, b_down)``.
    """
    gated = glu_ref(F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up), activation)
    return F.linear(gated, w_down, b_down)


@dataclass(frozen=True)
class MLPOptions:
    activation: str = "silu"
    recompute: bool = True  # save only x; the backward replays the gate/up GEMM
    gate_up_gemm: str = "cublas"  # "cublas": cuBLAS GEMMs + GLU kernels; "triton": gating in a Triton GEMM


def _configs(one_acc: bool):
    if _INTERPRET:
        # Small tiles so that tests at small odd shapes cover partial tiles and several K steps; larger
        # problems take 64-wide tiles (the interpreter's time grows with the number of tile steps).
        return [triton.Config({"BLOCK_M": b, "BLOCK_N": b, "BLOCK_K": b, "GROUP_M": 2}, num_warps=1)
                for b in (16, 64)]
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Two 128 x 128 fp32 accumulators fill 128 registers per
    # thread at 8 warps, so 128 x 256 tiles only for the one-accumulator (dh) GEMM.
    shapes = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4)]
    if one_acc:
        shapes += [(128, 256, 64, 8, 3)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in shapes
    ]


# The interpreter multiplies bf16 operands as their integer bit patterns, and truncates fp32 -> bf16 casts
# where a GPU rounds to nearest even: under it, bf16 operands are upcast before tl.dot and stored values are
# rounded here first (the cast after this is then exact).
@triton.jit
def _interpreter_bf16(x, INTERPRET_BF16: tl.constexpr):
    if INTERPRET_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x


# Grid: one program per (BLOCK_M, BLOCK_N) tile of the (M, N) output, in groups of GROUP_M row tiles that
# sweep the columns together, so the weight tiles a group reads stay in L2.
#   modes 0-2: A = x (M, K=H), B1 = Wg^T, B2 = Wu^T (K, N=I): acc1 = g, acc2 = u (before the biases);
#   mode 3:    A = dy (M, K=H), B1 = Wd (K, N=I): acc1 = dh, and g | u are read from GU_IN.
@triton.jit
def _gated_gemm_kernel(
    A,  # (M, K) row stride stride_am, unit column stride
    B1,  # (K, N) strides (stride_bk, stride_bn): Wg^T, or Wd in mode 3
    B2,  # (K, N) same strides: Wu^T (unused in mode 3)
    BIAS1,  # (N,) gate bias (HAS_BIAS)
    BIAS2,  # (N,) up bias (HAS_BIAS)
    H,  # (M, N) h = act(g) * u out; mode 2 reads dh from it first, tile by tile
    GU_IN,  # (M, 2N) saved g | u (mode 3)
    GU_OUT,  # (M, 2N) g | u out (mode 1) or dg | du out (modes 2, 3)
    M, N, K,
    M_KEY,  # power-of-two bucket of M, for the autotuner's cache only
    stride_am, stride_bk, stride_bn, stride_h, stride_gu,
    MODE: tl.constexpr,  # 0 forward, 1 forward saving g | u, 2 backward replaying g, u, 3 backward from g | u
    ACT: tl.constexpr,  # 0 silu, 1 gelu_tanh, 2 gelu
    K0: tl.constexpr,  # sqrt(2 / pi)
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on K
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" or "tf32" for fp32 operands (Triton's default
    # "tf32" for 16-bit ones, where it changes nothing)
    INTERPRET_BF16: tl.constexpr,  # bf16 in the interpreter: see _interpreter_bf16
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    group_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % group_m
    pid_n = (pid % (GROUP_M * grid_n)) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    rows = offs_m.to(tl.int64)[:, None]
    a_ptrs = A + rows * stride_am + offs_k[None, :]
    b_off = offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    b1_ptrs, b2_ptrs = B1 + b_off, B2 + b_off
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a_mask, b_mask = mask_m[:, None], mask_n[None, :]
        else:
            k_in = offs_k < K - k * BLOCK_K
            a_mask, b_mask = mask_m[:, None] & k_in[None, :], k_in[:, None] & mask_n[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b1 = tl.load(b1_ptrs, mask=b_mask, other=0.0)
        if INTERPRET_BF16:
            a, b1 = a.to(tl.float32), b1.to(tl.float32)
        acc1 = tl.dot(a, b1, acc1, input_precision=PRECISION)
        if MODE != 3:
            b2 = tl.load(b2_ptrs, mask=b_mask, other=0.0)
            if INTERPRET_BF16:
                b2 = b2.to(tl.float32)
            acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b1_ptrs += BLOCK_K * stride_bk
        b2_ptrs += BLOCK_K * stride_bk

    mask = mask_m[:, None] & mask_n[None, :]
    h_ptrs = H + rows * stride_h + offs_n[None, :]
    gu_off = rows * stride_gu + offs_n[None, :]
    if MODE == 3:
        dh = acc1
        g = tl.load(GU_IN + gu_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU_IN + gu_off + N, mask=mask, other=0.0).to(tl.float32)
    else:
        g, u = acc1, acc2
        if HAS_BIAS:
            g += tl.load(BIAS1 + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            u += tl.load(BIAS2 + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if MODE == 2:  # read before the store below overwrites this tile with h
            dh = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(g, ACT, K0)
    tl.store(h_ptrs, _interpreter_bf16(act * u, INTERPRET_BF16).to(H.dtype.element_ty), mask=mask)
    if MODE == 1:
        g_out, u_out = _interpreter_bf16(g, INTERPRET_BF16), _interpreter_bf16(u, INTERPRET_BF16)
        tl.store(GU_OUT + gu_off, g_out.to(GU_OUT.dtype.element_ty), mask=mask)
        tl.store(GU_OUT + gu_off + N, u_out.to(GU_OUT.dtype.element_ty), mask=mask)
    if MODE >= 2:
        dg, du = _interpreter_bf16(dh * u * dact, INTERPRET_BF16), _interpreter_bf16(dh * act, INTERPRET_BF16)
        tl.store(GU_OUT + gu_off, dg.to(GU_OUT.dtype.element_ty), mask=mask)
        tl.store(GU_OUT + gu_off + N, du.to(GU_OUT.dtype.element_ty), mask=mask)


def _prune(configs, named_args, **kwargs):
    size = named_args["M"] * named_args["N"] * named_args["K"]
    if _INTERPRET:
        return configs[:1] if size < 2**22 else configs[1:]
    # Problems under 2^30 multiply-adds (tiny models, tests) take the first configuration without timing.
    return configs[:1] if size < 2**30 else configs


_heuristic = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_gated_gemm_kernel)
_KEY = ["M_KEY", "N", "K"]
_PRUNE = {"early_config_prune": _prune}
_fwd_kernel = triton.autotune(_configs(False), key=_KEY, prune_configs_by=_PRUNE)(_heuristic)
# Mode 2 overwrites dh with h: each timed trial must start from the same dh.
_replay_kernel = triton.autotune(_configs(False), key=_KEY, prune_configs_by=_PRUNE, restore_value=["H"])(
    _heuristic
)
_saved_kernel = triton.autotune(_configs(True), key=_KEY, prune_configs_by=_PRUNE)(_heuristic)


def _launch(kernel, mode, a, b1, b2, bias1, bias2, h, gu_in, gu_out, opts: MLPOptions):
    m, k = a.shape
    n = h.shape[1]
    fp32_prec = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"

    def grid(meta):
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)

    kernel[grid](
        a, b1, b2, bias1, bias2, h, gu_in, gu_out, m, n, k, next_power_of_2(m),
        a.stride(0), b1.stride(0) if mode == _BWD_SAVED else b1.stride(1),
        b1.stride(1) if mode == _BWD_SAVED else b1.stride(0), h.stride(0), gu_out.stride(0),
        MODE=mode, ACT=_ACT_ID[opts.activation], K0=_SQRT_2_OVER_PI, HAS_BIAS=bias1 is not None,
        PRECISION=fp32_prec if a.dtype == torch.float32 else "tf32",
        INTERPRET_BF16=_INTERPRET and a.dtype == torch.bfloat16,
    )


def _forward(x, w_gate, w_up, b_gate, b_up, opts: MLPOptions):
    """h (M, I), and what the backward keeps of the pre-activations: () with ``opts.recompute``, else
    (g, u), each (M, I), from cuBLAS or (g | u,) (M, 2I) from the Triton GEMM."""
    if opts.gate_up_gemm == "cublas":
        g, u = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
        h, g, u = _glu_fwd(g, u, GLUOptions(opts.activation))
        return h, () if opts.recompute else (g, u)
    m, n = x.shape[0], w_gate.shape[0]
    h = x.new_empty(m, n)
    gu = None if opts.recompute else x.new_empty(m, 2 * n)
    mode = _FWD if opts.recompute else _FWD_SAVE
    _launch(_fwd_kernel, mode, x, w_gate, w_up, b_gate, b_up, h, None, gu if gu is not None else h, opts)
    return h, () if gu is None else (gu,)


def _backward_cublas(dy, x, w_gate, w_up, w_down, b_gate, b_up, saved, opts: MLPOptions):
    """(h, dg, du), each (M, I), from the upstream gradient dy (M, H): cuBLAS for ``dh`` (and, without
    ``saved``, the replayed ``g``, ``u``, whose buffers then take ``dg``, ``du``), and one GLU pass that
    writes ``dg``, ``du`` and ``h`` over ``dh``."""
    dh = dy @ w_down
    if saved:
        g, u = saved
    else:
        g, u = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
    dg, du = _glu_bwd(dh, g, u, GLUOptions(opts.activation, in_place=not saved), c=dh)
    return dh, dg, du


def _backward_gated(dy, x, w_gate, w_up, w_down, b_gate, b_up, saved, opts: MLPOptions):
    """(h (M, I), dg | du (M, 2I)) from the upstream gradient dy (M, H), with the Triton GEMMs."""
    m, n = x.shape[0], w_gate.shape[0]
    dgu = x.new_empty(m, 2 * n)
    gu = saved[0] if saved else None
    if gu is None:
        h = dy @ w_down  # dh, overwritten with h tile by tile
        _launch(_replay_kernel, _BWD_REPLAY, x, w_gate, w_up, b_gate, b_up, h, None, dgu, opts)
    else:
        h = x.new_empty(m, n)
        _launch(_saved_kernel, _BWD_SAVED, dy, w_down, w_down, None, None, h, gu, dgu, opts)
    return h, dgu


class GatedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down, opts: MLPOptions):
        h, saved = _forward(x, w_gate, w_up, b_gate, b_up, opts)
        y = F.linear(h, w_down, b_down)
        ctx.save_for_backward(x, w_gate, w_up, w_down, b_gate, b_up, *saved)
        ctx.opts = opts
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w_gate, w_up, w_down, b_gate, b_up, *saved = ctx.saved_tensors
        need, opts, n = ctx.needs_input_grad, ctx.opts, w_gate.shape[0]
        dy = dy.contiguous()
        dgu = None
        if opts.gate_up_gemm == "cublas":
            h, dg, du = _backward_cublas(dy, x, w_gate, w_up, w_down, b_gate, b_up, saved, opts)
        else:
            h, dgu = _backward_gated(dy, x, w_gate, w_up, w_down, b_gate, b_up, saved, opts)
            dg, du = dgu[:, :n], dgu[:, n:]
        dw_down = dy.t() @ h if need[3] else None
        del h  # freed before the input and gate/up weight gradients are allocated
        dx = None
        if need[0]:
            dx = dg @ w_gate
            dx.addmm_(du, w_up)
        if need[1] and need[2] and dgu is not None:
            dw_gate, dw_up = (dgu.t() @ x).split(n)  # one GEMM for both: [dWg; dWu] = [dg du]^T x
        else:
            dw_gate = dg.t() @ x if need[1] else None
            dw_up = du.t() @ x if need[2] else None
        db_gate = dg.sum(0) if need[4] else None
        db_up = du.sum(0) if need[5] else None
        db_down = dy.sum(0) if need[6] else None
        return dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down, None


def _check(x, w_gate, w_up, w_down, biases, activation, gate_up_gemm):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate_up_gemm not in GATE_UP_GEMMS:
        raise ValueError(f"gate_up_gemm must be one of {GATE_UP_GEMMS}, got {gate_up_gemm!r}")
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
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
    b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
    activation: str = "silu", recompute: bool = True, gate_up_gemm: str = "cublas",
) -> torch.Tensor:
    """Fused ``F.linear(act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), w_down, b_down)``.

    Equals :func:`gated_mlp_ref` (``LlamaMLP`` / ``GemmaMLP``). With ``gate_up_gemm="triton"`` the activation
    is applied to the fp32 GEMM accumulator, so ``g`` and ``u`` are not rounded to ``x.dtype`` before gating.
    Under ``torch.autocast`` the operands are cast to the autocast dtype, as ``nn.Linear`` would be.

    Args:
        x: (..., H) input.
        w_gate, w_up: (I, H) weights; w_down: (H, I).
        b_gate, b_up: (I,) biases or None; b_down: (H,) bias or None.
        activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (exact; GeGLU).
        recompute: save only ``x`` for the backward, which replays the gate/up GEMM (H elements saved per
            token); False saves ``x`` and the pre-activations ``g``, ``u`` (H + 2I) and replays nothing.
        gate_up_gemm: "cublas" (cuBLAS GEMMs and Triton gating kernels) or "triton" (the gate and up
            projections as one Triton GEMM with the gating applied to its result before it is written).

    Returns:
        (..., H) in ``x.dtype`` (the autocast dtype under autocast).

    Raises:
        ValueError: an unknown activation or ``gate_up_gemm``, or mismatched shapes.
        TypeError: mixed dtypes outside autocast.
    """
    biases = (b_gate, b_up, b_down)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w_gate, w_up, w_down = (t.to(dtype) for t in (x, w_gate, w_up, w_down))
        biases = tuple(None if b is None else b.to(dtype) for b in biases)
    _check(x, w_gate, w_up, w_down, biases, activation, gate_up_gemm)
    b_gate, b_up, b_down = biases
    if (b_gate is None) != (b_up is None):  # the kernel takes both or neither
        b_gate = torch.zeros_like(b_up) if b_gate is None else b_gate
        b_up = torch.zeros_like(b_gate) if b_up is None else b_up
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] == 0:
        return gated_mlp_ref(x, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down,
                             activation=activation)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w_gate, w_up, w_down = w_gate.contiguous(), w_up.contiguous(), w_down.contiguous()
    with torch.autocast(x.device.type, enabled=False):
        y = GatedMLPFunction.apply(x2, w_gate, w_up, w_down, b_gate, b_up, b_down,
                                   MLPOptions(activation, recompute, gate_up_gemm))
    return y.view(*shape[:-1], y.shape[-1])


class FusedGatedMLP(nn.Module):
    """Gated MLP with ``transformers``' parameter names (``gate_proj``, ``up_proj``, ``down_proj``).

    Args:
        hidden_size: H.
        intermediate_size: I.
        activation: "silu", "gelu_tanh" or "gelu".
        bias: biases on all three projections (Llama's ``mlp_bias``).
        recompute, gate_up_gemm: see :func:`gated_mlp`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 recompute: bool = True, gate_up_gemm: str = "cublas", device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if gate_up_gemm not in GATE_UP_GEMMS:
            raise ValueError(f"gate_up_gemm must be one of {GATE_UP_GEMMS}, got {gate_up_gemm!r}")
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.activation, self.recompute, self.gate_up_gemm = activation, recompute, gate_up_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                         b_gate=self.gate_proj.bias, b_up=self.up_proj.bias, b_down=self.down_proj.bias,
                         activation=self.activation, recompute=self.recompute, gate_up_gemm=self.gate_up_gemm)

    def extra_repr(self) -> str:
        return f"activation={self.activation}, recompute={self.recompute}, gate_up_gemm={self.gate_up_gemm}"
