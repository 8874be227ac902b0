"""What every renderer shares: the memory and floor wording, the implementation names, the stamp line,
and the plotting helpers."""

from __future__ import annotations

GiB = 2**30
MEMORY_LABEL = "peak extra memory (GiB)"
MEMORY_MEANING = (
    "the highest memory allocated during the step minus the memory allocated before it, not counting the "
    "gradients the step returns"
)
MEMORY_DEFINITION = f"Peak extra memory: {MEMORY_MEANING}."
GEMM_FLOOR = (
    "GEMM floor: the time the step's unavoidable matrix multiplications (the logits and their two gradients) "
    "would take at {tflops:.0f} TFLOP/s, the bf16 rate cuBLAS reaches on a large square matrix product on "
    "this GPU; no implementation that computes the logits can be faster."
)
FAMILIES = ("cross_entropy", "grpo", "grpo_modes", "jsd", "dpo", "orpo")
LOSS_IMPLS = (
    "chunkloss",
    "chunkloss (bf16 accum)",
    "torch",
    "torch.compile",
    "trl 1.16 head",
    "trl 1.16 chunked divergence",
    "liger",
    "cce",
)
E2E_IMPLS = ("trl", "chunkloss", "chunkloss+kernels", "chunkloss+kernels+recompute")
KERNEL_IMPLS = ("torch", "compile", "liger", "ours")
# The gated MLP block's implementations (bench_decoder's names) and what each one is.
DECODER_IMPLS = {
    "eager": "eager PyTorch",
    "compile": "torch.compile",
    "cublas_swiglu": "cuBLAS + chunkloss SwiGLU",
    "liger": "cuBLAS + Liger SwiGLU",
    "ours_saved": "chunkloss, cuBLAS + gating kernels, recompute=False",
    "ours": "chunkloss, cuBLAS + gating kernels, recompute=True",
    "triton_saved": "chunkloss, gating in a Triton GEMM, recompute=False",
    "triton": "chunkloss, gating in a Triton GEMM, recompute=True",
}
# The attention input block's implementations (bench_decoder's names) and what each one is.
ATTN_IN_IMPLS = {
    "eager": "eager PyTorch",
    "compile": "torch.compile",
    "liger": "Liger RMSNorm + cuBLAS + Liger RoPE",
    "unfused": "chunkloss RMSNorm + cuBLAS + chunkloss RoPE",
    "norm_recompute": "chunkloss RMSNorm + cuBLAS + chunkloss RoPE, norm recomputed",
    "fused": "chunkloss, norm + one q/k/v GEMM + RoPE in one autograd Function",
    "fused_norm_recompute": "chunkloss, norm + one q/k/v GEMM + RoPE in one autograd Function, norm "
    "recomputed",
}
SAVED_LABEL = "saved for backward (MiB)"
SAVED_MEANING = (
    "the bytes of the tensors autograd keeps from the forward for the backward (distinct storages; the "
    "input x counted, the weights not)"
)
ATTN_SAVED_MEANING = (
    "the bytes of the tensors autograd keeps from the forward for the backward (distinct storages; the "
    "input x counted, the weights and the cos/sin tables, which every layer shares, not)"
)
CALL_PEAK_LABEL = "peak of one call, gradients included (MiB)"
CALL_PEAK_MEANING = (
    "the highest memory allocated during one forward + backward minus the memory allocated before it, the "
    "output and the four gradients included"
)
ATTN_CALL_PEAK_MEANING = (
    "the highest memory allocated during one forward + backward minus the memory allocated before it, q, k, "
    "v and the five gradients included"
)
MEDUSA_IMPLS = {
    "chunkloss": "chunkloss",
    "chunkloss_bf16_accum": "chunkloss, bf16 accum",
    "chunkloss_bf16_accum_liger_chunks": "chunkloss, bf16 accum, Liger's chunk size",
    "torch": "torch (materialised logits)",
    "liger": "Liger (once per head)",
    "chunkloss_single_head": "chunkloss CE, one head",
}


def stamp_line(stamp: dict) -> str:
    """One line naming a result's date, GPU and library versions."""
    recorded = stamp.get("versions", {})
    versions = ", ".join(f"{k} {v}" for k, v in recorded.items() if v and v != "unknown")
    if "unknown" in recorded.values():  # a version the run did not record (None: package not installed)
        versions += " (other versions not recorded)"
    return f"{stamp.get('gpu', 'unknown GPU')}, {stamp.get('date', 'unknown date')}; {versions}"


def first_table(md: str) -> list[str]:
    """The lines of the first markdown table in ``md``."""
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain():
    from matplotlib.ticker import FormatStrFormatter

    return FormatStrFormatter("%g")


def _log_axis(ax) -> None:
    """Log scale with plain numbers (0.5, 2, 100) as tick labels."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _colors(names) -> dict:
    cmap = _pyplot().get_cmap("tab10")
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def _ok(r: dict | None) -> bool:
    return r is not None and "error" not in r


def _num(v, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def _ratio(a, b) -> str:
    return "–" if a is None or b is None else f"{a / b:.2f}"


def _span(values: dict) -> str:
    """``lo–hi (batches b0–b1)`` of {batch: value}, one value as ``v (batch b)``, ``–`` for none."""
    if not values:
        return "–"
    lo, hi, b = min(values.values()), max(values.values()), sorted(values)
    if len(b) == 1:
        return f"{lo:.2f} (batch {b[0]})"
    return f"{lo:.2f}–{hi:.2f} (batches {b[0]}–{b[-1]})"


def _grouped_bars(ax, rows, cases, impls, key, scale, colors, names) -> None:
    """Bars of ``row[key] / scale`` per case (x) and implementation (colour); 0 where a row is missing."""
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        by = {r["case"]: r for r in rows if r["impl"] == impl and _ok(r)}
        xs = [c + (k - (len(impls) - 1) / 2) * width for c in range(len(cases))]
        ys = [by[c][key] / scale if c in by and by[c].get(key) is not None else 0 for c in cases]
        ax.bar(xs, ys, width, color=colors[impl], label=names[impl])
