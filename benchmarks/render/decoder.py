"""The decoder blocks: the gated MLP (``decoder``) and the attention input (``decoder_attn``)."""

from __future__ import annotations

from benchmarks.render.common import (
    ATTN_CALL_PEAK_MEANING,
    ATTN_IN_IMPLS,
    ATTN_SAVED_MEANING,
    CALL_PEAK_LABEL,
    CALL_PEAK_MEANING,
    DECODER_IMPLS,
    SAVED_LABEL,
    SAVED_MEANING,
    _colors,
    _grouped_bars,
    _ok,
    _ratio,
    stamp_line,
)


def _mib(v) -> str:
    return "n/a" if v is None else f"{v / 2**20:.0f}"


def decoder_md(data: dict) -> str:
    lines = [
        "# Gated MLP block, forward + backward",
        "",
        f"{stamp_line(data['stamp'])}. bf16, Llama's MLP `down(silu(gate(x)) * up(x))`: x (N, H), gate "
        "and up weights (I, H), down weight (H, I), all four needing grad. Time: CUDA events, median of "
        f"{data['repeats']} calls after {data['warmup']} warm-up calls. **{SAVED_LABEL}**: {SAVED_MEANING}. "
        f"**{CALL_PEAK_LABEL}**: {CALL_PEAK_MEANING}. Error: max |error| / max |value| against the same math "
        "in fp32, of y, of dx and of the worst weight gradient. GEMM floor: the block's nine matrix "
        f"multiplications (18·N·H·I FLOPs) at {data['peak_tflops']:.0f} TFLOP/s.",
        "",
        f"| shape (N, H, I) | implementation | ms | × GEMM floor | {SAVED_LABEL} | saved / eager "
        f"| {CALL_PEAK_LABEL} | error y | error dx | error dW |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager = {r["case"]: r["saved_bytes"] for r in data["rows"] if r["impl"] == "eager" and _ok(r)}
    for r in _by_case_and_impl(data["rows"], DECODER_IMPLS):
        shape, impl = f"{r['N']}, {r['H']}, {r['I']}", DECODER_IMPLS.get(r["impl"], r["impl"])
        if not _ok(r):
            lines.append(f"| {shape} | {impl} | {r['error']} | | | | | | | |")
            continue
        err, base = r["err"], eager.get(r["case"])
        cells = [shape, impl, f"{r['ms']:.3f}", f"{r['ms'] / r['floor_ms']:.2f}", _mib(r["saved_bytes"]),
                 _ratio(r["saved_bytes"], base), _mib(r["peak_bytes"]), f"{err['y']:.1e}", f"{err['x']:.1e}",
                 f"{max(err['w_gate'], err['w_up'], err['w_down']):.1e}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _by_case_and_impl(rows: list[dict], impls: dict) -> list[dict]:
    """``rows`` in the order of their cases' first rows, and within a case in the order of ``impls`` (others
    last)."""
    cases, rank = list(dict.fromkeys(r["case"] for r in rows)), {impl: i for i, impl in enumerate(impls)}
    return sorted(rows, key=lambda r: (cases.index(r["case"]), rank.get(r["impl"], len(impls))))


def _block_png(data: dict, plt, names: dict, label, title: str):
    """Two panels per case (x) and implementation (colour): time, with the GEMM floor, and saved bytes."""
    rows = data["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = [i for i in names if any(r["impl"] == i for r in rows)]
    colors = _colors(impls)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 5.2))
    _grouped_bars(ax_t, rows, cases, impls, "ms", 1, colors, names)
    _grouped_bars(ax_m, rows, cases, impls, "saved_bytes", 2**20, colors, names)
    for c, case in enumerate(cases):
        floor = next(r["floor_ms"] for r in rows if r["case"] == case)
        legend = "GEMM floor" if c == 0 else None
        ax_t.hlines(floor, c - 0.45, c + 0.45, colors="k", linestyles="--", label=legend)
    labels = [label(next(r for r in rows if r["case"] == c)) for c in cases]
    for ax, panel in ((ax_t, "ms, forward + backward"), (ax_m, SAVED_LABEL)):
        ax.set_xticks(range(len(cases)), labels, fontsize=8)
        ax.set_title(panel, fontsize=10)
    fig.legend(*ax_t.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"{title}, bf16 ({data['stamp'].get('gpu')}; lower is better)", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def decoder_png(data: dict, plt):
    return _block_png(data, plt, DECODER_IMPLS, lambda r: f"N={r['N']}, H={r['H']}, I={r['I']}",
                      "Gated MLP block")  # fmt: skip


def _attn_shape(r: dict) -> str:
    return f"{r['B']}×{r['T']}, {r['H']}, {r['heads']}/{r['kv_heads']} × {r['head_dim']}"


def decoder_attn_md(data: dict) -> str:
    lines = [
        "# Attention input block, forward + backward",
        "",
        f"{stamp_line(data['stamp'])}. bf16, what a Llama attention layer computes before attention: "
        "`h = RMSNorm(x)`, the q, k and v projections of h split into heads, and rotate-half RoPE on q and "
        "k. x (B, T, H), the norm weight (H,), the q weight (heads·head_dim, H), the k and v weights "
        "(KV heads·head_dim, H), all five needing grad; cos and sin (B, T, head_dim) for positions 0..T-1. "
        "chunkloss's kernels run as `patch` runs them (norm and RoPE in place); with the norm output "
        "recomputed, inside the context of `patch(norm_recompute=True)`: the projections' saved input is "
        "not kept and the backward runs the norm kernel again. Time: CUDA events, median of "
        f"{data['repeats']} calls after {data['warmup']} warm-up calls. **{SAVED_LABEL}**: "
        f"{ATTN_SAVED_MEANING}. **{CALL_PEAK_LABEL}**: {ATTN_CALL_PEAK_MEANING}. Error: max |error| / "
        "max |value| against the same math in fp32, of the worst of q, k and v, of dx and of the worst "
        "weight gradient (norm, q, k, v). GEMM floor: the three projections' forward, input-gradient and "
        "weight-gradient products (6·N·H·(heads + 2·KV heads)·head_dim FLOPs, N = B·T) at "
        f"{data['peak_tflops']:.0f} TFLOP/s.",
        "",
        f"| model | B×T, H, heads/KV heads × head_dim | implementation | ms | × GEMM floor | {SAVED_LABEL} "
        f"| saved / eager | {CALL_PEAK_LABEL} | error q, k, v | error dx | error dW |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager = {r["case"]: r["saved_bytes"] for r in data["rows"] if r["impl"] == "eager" and _ok(r)}
    for r in _by_case_and_impl(data["rows"], ATTN_IN_IMPLS):
        head = f"| {r['model']} | {_attn_shape(r)} | {ATTN_IN_IMPLS.get(r['impl'], r['impl'])} |"
        if not _ok(r):
            lines.append(f"{head} {r['error']} | | | | | | | |")
            continue
        err = r["err"]
        cells = [f"{r['ms']:.3f}", f"{r['ms'] / r['floor_ms']:.2f}", _mib(r["saved_bytes"]),
                 _ratio(r["saved_bytes"], eager.get(r["case"])), _mib(r["peak_bytes"]),
                 f"{max(err['q'], err['k'], err['v']):.1e}", f"{err['x']:.1e}",
                 f"{max(err['norm_w'], err['w_q'], err['w_k'], err['w_v']):.1e}"]  # fmt: skip
        lines.append(f"{head} " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def decoder_attn_png(data: dict, plt):
    return _block_png(data, plt, ATTN_IN_IMPLS, lambda r: f"{r['model']}\n{_attn_shape(r)}",
                      "Attention input block (RMSNorm, q/k/v projections, RoPE)")  # fmt: skip
