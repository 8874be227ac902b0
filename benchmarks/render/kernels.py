"""The row kernels (``kernels``): forward + backward per kernel and implementation."""

from __future__ import annotations

from benchmarks.render.common import (
    KERNEL_IMPLS,
    _colors,
    _log_axis,
    stamp_line,
)


def _kcell(row: dict, impl: str, key: str = "ms", fmt: str = "{:.3f}") -> str:
    v = row.get(impl, {}).get(key)
    return "n/a" if v is None else fmt.format(v)


def kernels_md(data: dict) -> str:
    bw = data.get("peak_bw", 3.0e12)
    lines = [
        "# Row kernels, forward + backward",
        "",
        f"{stamp_line(data['stamp'])}. bf16. Median ms of one step (forward, then `torch.autograd.grad`). "
        "**GPU** = the step captured in a CUDA graph and replayed (GPU time alone, as in a model where the "
        "host runs ahead); **eager** = launched back to back from Python (host-bound where launching costs "
        f"more than the GPU work). Bandwidth floor: the time to read and write the bytes the op must move at "
        f"{bw / 1e12:.1f} TB/s. Memory: the highest memory allocated during one eager step minus the memory "
        "allocated before it, outputs and gradients included, in MiB.",
        "",
        "| case | floor | torch GPU / eager | compile GPU / eager | liger GPU / eager "
        "| ours GPU / eager | ours GPU / floor | memory ours | memory liger |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        ours = row.get("ours", {}).get("graph_ms")
        ratio = f"{ours / row['floor_ms']:.2f}x" if ours else "n/a"
        times = " | ".join(f"{_kcell(row, i, 'graph_ms')} / {_kcell(row, i)}" for i in KERNEL_IMPLS)
        peaks = " | ".join(_kcell(row, i, "peak_extra_mib", "{:.0f}") for i in ("ours", "liger"))
        lines.append(f"| {row['case']} | {row['floor_ms']:.3f} | {times} | {ratio} | {peaks} |")
    return "\n".join(lines) + "\n"


def kernels_png(data: dict, plt):
    rows = data["rows"]
    colors = _colors(KERNEL_IMPLS)
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(KERNEL_IMPLS)
    for k, impl in enumerate(KERNEL_IMPLS):
        xs, ys = [], []
        for c, row in enumerate(rows):
            t = row.get(impl, {}).get("graph_ms")
            if t is not None:
                xs.append(c + (k - 1.5) * width)
                ys.append(t / row["floor_ms"])
        ax.bar(xs, ys, width, color=colors[impl], label=impl)
    ax.axhline(1.0, color="k", linestyle="--", label="bandwidth floor")
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=20, ha="right", fontsize=8)
    _log_axis(ax)
    ax.set_ylabel("GPU time / bandwidth floor")
    ax.set_title(
        f"Row kernels, forward + backward, bf16: GPU time over the bandwidth floor "
        f"({data['stamp'].get('gpu')}; lower is better)",
        fontsize=10,
    )
    ax.legend(fontsize=8, ncol=5, loc="upper center")
    fig.tight_layout()
    return fig
