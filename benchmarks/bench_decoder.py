"""Decoder blocks, forward + backward on bf16 leaves, ours vs peers: the gated MLP and the attention input.

**mlp**, Llama's ``down(silu(gate(x)) * up(x))``: ``eager`` (``gated_mlp_ref``), ``compile``,
``cublas_swiglu`` (cuBLAS + chunkloss's SwiGLU), ``liger`` (cuBLAS + Liger's SwiGLU), ``ours``
(:func:`chunkloss.kernels.gated_mlp`, saving only ``x``) and ``ours_saved`` (``recompute=False``).
**attn_in**, RMSNorm, the q/k/v projections split into heads and RoPE on q and k: ``eager`` (transformers'
math), ``compile``, ``unfused`` (chunkloss's norm and RoPE kernels + cuBLAS), ``norm_recompute`` (the norm
output offered to ``saved_norms.SavedNorms``), ``fused`` (:func:`chunkloss.kernels.attention_input`),
``fused_norm_recompute`` and ``liger``. Per shape and implementation: the median ms of forward + backward
(CUDA events), the bytes autograd saves for the backward (distinct storages, weights and cos/sin excluded),
the peak memory of one call (outputs and gradients included) and every output's and gradient's error
against the eager math in fp32. Sets ``decoder`` (mlp) and ``decoder_attn`` (attn_in).

    python -m benchmarks.bench_decoder [--out benchmarks/results] [--blocks mlp,attn_in] [--smoke]
"""

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

if "--smoke" in sys.argv and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read by Triton when chunkloss.kernels is imported

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary_pos_emb

from benchmarks.harness import PEAK_TFLOPS, command, error_text, peak_extra, split_choices, stamp, timed_ms
from benchmarks.report import write_set
from chunkloss import kernels as ck
from chunkloss.models import saved_norms

BLOCKS = ("mlp", "attn_in")
SET_NAMES = {"mlp": "decoder", "attn_in": "decoder_attn"}  # block -> result set
SHAPES = {
    "mlp": [(8192, 4096, 14336), (16384, 2048, 8192)],  # (tokens N, hidden H, intermediate I)
    # (model, batch B, sequence T, hidden H, heads, KV heads, head_dim): N = B·T = 8192 tokens
    "attn_in": [("Llama-3-8B", 4, 2048, 4096, 32, 8, 128), ("Llama-3.2-1B", 4, 2048, 2048, 32, 8, 64)],
}
SMOKE_SHAPES = {"mlp": [(40, 48, 80)], "attn_in": [("tiny", 2, 5, 48, 4, 2, 12)]}
EPS = 1e-5  # Llama-3's rms_norm_eps
ROPE_THETA = 500000.0  # Llama-3's rope_theta


@dataclass
class Case:
    """One shape of one block with its inputs built: what every implementation of the block is called on."""

    row: dict  # the shape's fields, the first of every row
    leaves: dict[str, torch.Tensor]  # bf16 leaves needing grad, in the implementations' argument order
    consts: tuple[torch.Tensor, ...]  # further arguments, needing no grad (RoPE's cos and sin)
    dys: tuple[torch.Tensor, ...]  # gradients of the outputs
    outputs: tuple[str, ...]  # names of the outputs, for the errors
    floor_ms: float
    reference: Callable  # the eager math, run on fp32 copies for the errors


def attn_in_block(norm, rope):
    """``(x, norm_w, w_q, w_k, w_v, cos, sin) -> (q, k, v)`` with the given norm and RoPE, split into heads
    as ``LlamaAttention.forward`` does before attention; q, k, v are (B, heads, T, head_dim)."""

    def block(x, norm_w, w_q, w_k, w_v, cos, sin):
        h = norm(x, norm_w)
        head_dim = cos.shape[-1]

        def heads(w):
            return F.linear(h, w).view(*x.shape[:-1], -1, head_dim).transpose(1, 2)

        q, k, v = heads(w_q), heads(w_k), heads(w_v)
        q, k = rope(q, k, cos, sin)
        return q, k, v

    return block


def _kernel_norm(x, w):  # patch's _norm_forward on an input_layernorm: in_place, its dy feeds nothing else
    return ck.rms_norm(x, w, EPS, 0.0, "llama", True)


def _offered_norm(x, w):  # the same with offer=True, as patch(norm_recompute=True) runs the pre-norms
    out = _kernel_norm(x, w)
    saved_norms.offer(out, lambda: _kernel_norm(x, w))
    return out


def _kernel_rope(q, k, cos, sin):  # as patch runs it: q and k are fresh projections, rotated in place
    return ck.apply_rotary_pos_emb(q, k, cos, sin, None, 1, in_place=True)


attn_in_ref = attn_in_block(lambda x, w: ck.rms_norm_ref(x, w, EPS), hf_apply_rotary_pos_emb)
attn_in_unfused = attn_in_block(_kernel_norm, _kernel_rope)
_attn_in_offered = attn_in_block(_offered_norm, _kernel_rope)


def attn_in_norm_recompute(*args):
    """:func:`attn_in_unfused` in a ``SavedNorms`` context, as a patched decoder layer runs it."""
    with saved_norms.SavedNorms():
        return _attn_in_offered(*args)


def _leaves(device, dtype):
    """A generator seeded 0, and ``rand(*shape, scale, shift)``: leaves drawn from it, needing grad."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(device, dtype).requires_grad_(True)

    return gen, rand


def attn_in_case(model, batch, seq, hidden, n_heads, n_kv, head_dim, device, dtype=torch.bfloat16) -> Case:
    gen, rand = _leaves(device, dtype)

    leaves = {
        "x": rand(batch, seq, hidden),
        "norm_w": rand(hidden, scale=0.1, shift=1.0),
        "w_q": rand(n_heads * head_dim, hidden, scale=hidden**-0.5),
        "w_k": rand(n_kv * head_dim, hidden, scale=hidden**-0.5),
        "w_v": rand(n_kv * head_dim, hidden, scale=hidden**-0.5),
    }
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).expand(batch, seq, head_dim)
    cos, sin = (t.to(device, dtype).contiguous() for t in (emb.cos(), emb.sin()))

    def grad_of(n):  # laid out as the projection's head view: (B, T, n, D) memory, (B, n, T, D) shape
        return torch.randn(batch, seq, n, head_dim, generator=gen).to(device, dtype).transpose(1, 2)

    n = batch * seq
    width = (n_heads + 2 * n_kv) * head_dim  # the three projections' output columns together
    row = dict(case=f"{model} B={batch} T={seq}", model=model, B=batch, T=seq, N=n, H=hidden)
    row.update(heads=n_heads, kv_heads=n_kv, head_dim=head_dim)
    return Case(
        row=row,
        leaves=leaves,
        consts=(cos, sin),
        dys=(grad_of(n_heads), grad_of(n_kv), grad_of(n_kv)),
        outputs=("q", "k", "v"),
        floor_ms=6 * n * hidden * width / (PEAK_TFLOPS * 1e12) * 1e3,  # 3 GEMMs of 2·N·H·width FLOPs
        reference=attn_in_ref,
    )


def mlp_case(n, hidden, inter, device, dtype=torch.bfloat16) -> Case:
    gen, rand = _leaves(device, dtype)

    leaves = {
        "x": rand(n, hidden),
        "w_gate": rand(inter, hidden, scale=hidden**-0.5),
        "w_up": rand(inter, hidden, scale=hidden**-0.5),
        "w_down": rand(hidden, inter, scale=inter**-0.5),
    }
    return Case(
        row={"case": f"N={n} H={hidden} I={inter}", "N": n, "H": hidden, "I": inter},
        leaves=leaves,
        consts=(),
        dys=(torch.randn(n, hidden, generator=gen).to(device, dtype),),
        outputs=("y",),
        floor_ms=18 * n * hidden * inter / (PEAK_TFLOPS * 1e12) * 1e3,  # 9 GEMMs of 2·N·H·I FLOPs
        reference=ck.gated_mlp_ref,
    )


def _liger(block: str):
    """Liger's version of ``block`` on our leaves, or None when liger_kernel (or the part used) is missing."""
    try:
        if block == "mlp":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            def liger(x, wg, wu, wd):  # LigerSwiGLUMLP.forward on our leaves
                return F.linear(LigerSiLUMulFunction.apply(F.linear(x, wg), F.linear(x, wu)), wd)

            return liger
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        print(f"liger_kernel unavailable for {block}: {exc!r}", file=sys.stderr)
        return None
    # Liger's autograd Functions on our leaves (LigerRMSNorm's defaults: llama casting, in place).
    return attn_in_block(
        lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", True),
        lambda q, k, cos, sin: liger_rotary_pos_emb(q, k, cos, sin),
    )


def implementations(block: str, smoke: bool) -> dict:
    if block == "mlp":
        impls = {
            "eager": ck.gated_mlp_ref,
            "cublas_swiglu": lambda x, wg, wu, wd: F.linear(ck.swiglu(x @ wg.t(), x @ wu.t(), True), wd),
            "ours": ck.gated_mlp,
            "ours_saved": lambda x, wg, wu, wd: ck.gated_mlp(x, wg, wu, wd, recompute=False),
        }
    else:
        impls = {
            "eager": attn_in_ref,
            "unfused": attn_in_unfused,
            "norm_recompute": attn_in_norm_recompute,
            "fused": functools.partial(ck.attention_input, eps=EPS),
            "fused_norm_recompute": functools.partial(ck.attention_input, eps=EPS, norm_recompute=True),
        }
    if not smoke:  # inductor on CPU needs a C++ toolchain and minutes; the smoke run checks the script only
        impls["compile"] = torch.compile(impls["eager"], dynamic=False)
    liger = _liger(block)
    if liger is not None:
        impls["liger"] = liger
    return impls


def saved_bytes(fn, case: Case) -> int:
    """Distinct storages autograd saves in one forward of ``fn``, the weights (the leaves after ``x``) and the
    constants excluded; the hooks open outside ``fn``, so a ``SavedNorms`` inside packs all but the norm
    output it recomputes through them."""
    skip = {t.untyped_storage().data_ptr() for t in (*list(case.leaves.values())[1:], *case.consts)}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*case.leaves.values(), *case.consts)
    del out
    return sum(storages.values())


def measure(fn, case: Case, warmup, repeats):
    """Median ms of forward + backward, saved bytes, peak bytes of one call, and the last call's outputs and
    gradients."""
    args = list(case.leaves.values())

    def fresh():  # the output gradients, a new copy per call: in-place RoPE backwards write over them
        return [d.clone() for d in case.dys]

    def step(dys):
        ys = fn(*args, *case.consts)
        ys = ys if isinstance(ys, tuple) else (ys,)
        return ys, torch.autograd.grad(ys, args, dys)

    device = case.dys[0].device
    for _ in range(warmup):
        step(fresh())
    times = [timed_ms(functools.partial(step, dys), device) for dys in (fresh() for _ in range(repeats))]
    saved = saved_bytes(fn, case)
    out, peak = peak_extra(functools.partial(step, fresh()))
    return {"ms": statistics.median(times), "ms_all": times, "saved_bytes": saved, "peak_bytes": peak}, out


def max_rel_err(x, ref) -> float:
    return float((x.detach().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def reference(case: Case):
    """The outputs and the gradients of the block's eager math in fp32."""
    args = [t.detach().float().requires_grad_(True) for t in case.leaves.values()]
    ys = case.reference(*args, *(t.float() for t in case.consts))
    ys = ys if isinstance(ys, tuple) else (ys,)
    grads = torch.autograd.grad(ys, args, [d.float() for d in case.dys])
    return [*(y.detach() for y in ys), *grads]


def run_case(case: Case, impls, device, warmup, repeats) -> list[dict]:
    """One row per implementation: the shape, ``floor_ms`` and :func:`measure`'s fields, or ``error``."""
    ref = reference(case)
    names = (*case.outputs, *case.leaves)
    rows = []
    for name, fn in impls.items():
        row = {**case.row, "impl": name, "floor_ms": case.floor_ms}
        rows.append(row)
        try:
            result, (ys, grads) = measure(fn, case, warmup, repeats)
        except Exception as exc:  # noqa: BLE001 - one failing peer is recorded, not fatal
            row["error"] = error_text(exc)
            print(f"{case.row['case']} / {name}: {exc!r}", file=sys.stderr)
            continue
        result["err"] = {k: max_rel_err(t, r) for k, t, r in zip(names, (*ys, *grads), ref, strict=True)}
        del ys, grads
        row.update(result)
        ms, saved, error = result["ms"], result["saved_bytes"], max(result["err"].values())
        line = f"{case.row['case']:<28} {name:<14} {ms:8.3f} ms  saved {saved} B  max error {error:.1e}"
        print(line, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder of the result sets")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (CPU works)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--blocks", default=",".join(BLOCKS), help=f"comma-separated, of {', '.join(BLOCKS)}")
    args = parser.parse_args(argv)
    blocks = split_choices(parser, "--blocks", args.blocks, BLOCKS)
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_decoder: no CUDA device; use --smoke to check the script on CPU.", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warmup, repeats = (1, 2) if args.smoke else (3, max(args.repeats, 5))
    st = stamp(command=command("bench_decoder", argv))
    for block in blocks:
        start = time.time()
        impls = implementations(block, args.smoke)
        rows = []
        for shape in (SMOKE_SHAPES if args.smoke else SHAPES)[block]:
            case = (mlp_case if block == "mlp" else attn_in_case)(*shape, device)
            rows += run_case(case, impls, device, warmup, repeats)
            del case
        data = dict(
            stamp=st, dtype="bfloat16", warmup=warmup, repeats=repeats, peak_tflops=PEAK_TFLOPS, rows=rows
        )
        name = SET_NAMES[block]
        write_set(args.out, name, data)
        print(f"wrote {name}.json, .md and .png under {args.out} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
