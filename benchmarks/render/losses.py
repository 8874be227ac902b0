"""The loss benchmark (``losses``): time and memory per case and implementation."""

from __future__ import annotations

from benchmarks.render.common import (
    FAMILIES,
    GEMM_FLOOR,
    LOSS_IMPLS,
    MEMORY_DEFINITION,
    MEMORY_LABEL,
    GiB,
    _colors,
    _log_axis,
    _ok,
    stamp_line,
)


def loss_cell(r: dict | None) -> str:
    """``ms / GiB`` of one loss result, ``OOM``, ``error`` or ``–`` (not run)."""
    if r is None:
        return "–"
    if "error" in r:
        return "OOM" if r["error"] == "OOM" else "error"
    return f"{r['ms']:.1f} / {r['peak_extra_bytes'] / GiB:.2f}"


def losses_md(data: dict) -> str:
    rows, stamp = data["rows"], data["stamp"]
    lines = [
        "# Loss benchmarks: forward + backward of the LM head and its loss",
        "",
        f"{stamp_line(stamp)}. bf16, Llama-3-8B head (H=4096, V=128256). Time: CUDA events, median after "
        "warm-up. " + MEMORY_DEFINITION + " " + GEMM_FLOOR.format(tflops=data.get("peak_tflops", 800)),
        "",
        f"| case | implementation | ms | × GEMM floor | {MEMORY_LABEL} | loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['impl']} | {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['impl']} | {r['ms']:.2f} | {r['ms'] / r['floor_ms']:.2f} | "
            f"{r['peak_extra_bytes'] / GiB:.2f} | {r['loss']:.5f} |"
        )
    return "\n".join(lines) + "\n"


def losses_png(data: dict, plt):
    rows = data["rows"]
    families = [f for f in FAMILIES if any(r["group"] == f for r in rows)]
    impls = [i for i in LOSS_IMPLS if any(r["impl"] == i for r in rows)]
    colors = _colors(impls)
    fig, axes = plt.subplots(2, len(families), figsize=(3.6 * len(families), 7.5), squeeze=False)
    for j, family in enumerate(families):
        g = [r for r in rows if r["group"] == family]
        cases = list(dict.fromkeys(r["case"] for r in g))
        here = [i for i in impls if any(r["impl"] == i for r in g)]
        width = 0.8 / len(here)
        for k, impl in enumerate(here):
            by = {r["case"]: r for r in g if r["impl"] == impl}
            xs = [c + (k - (len(here) - 1) / 2) * width for c in range(len(cases))]
            ms = [by[c]["ms"] if _ok(by.get(c)) else 0 for c in cases]
            mem = [by[c]["peak_extra_bytes"] / GiB if _ok(by.get(c)) else 0 for c in cases]
            axes[0][j].bar(xs, ms, width, color=colors[impl], label=impl)
            axes[1][j].bar(xs, [max(m, 1e-3) if m else 0 for m in mem], width, color=colors[impl])
            for x, c in zip(xs, cases, strict=True):
                if by.get(c) is not None and not _ok(by[c]):
                    for ax in axes[:, j]:
                        ax.text(
                            x,
                            0.02,
                            "OOM" if by[c]["error"] == "OOM" else "error",
                            rotation=90,
                            fontsize=7,
                            ha="center",
                            va="bottom",
                            transform=ax.get_xaxis_transform(),
                        )
        for c, case in enumerate(cases):
            floor = next(r["floor_ms"] for r in g if r["case"] == case)
            axes[0][j].hlines(
                floor, c - 0.45, c + 0.45, colors="k", linestyles="--", label="GEMM floor" if c == 0 else None
            )
        labels = [c.removeprefix("grpo dapo ").removeprefix("dpo+ref ") for c in cases]
        for ax in axes[:, j]:
            ax.set_xticks(range(len(cases)), labels, rotation=20, ha="right", fontsize=7)
            _log_axis(ax)
        axes[0][j].set_title(f"{family}: time", fontsize=9)
        axes[1][j].set_title(f"{family}: memory", fontsize=9)
    axes[0][0].set_ylabel("ms, forward + backward")
    axes[1][0].set_ylabel(MEMORY_LABEL)
    handles = {}
    for ax in axes[0]:
        handles.update(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(f"Losses, bf16, H=4096, V=128256 ({data['stamp'].get('gpu')})", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    return fig
