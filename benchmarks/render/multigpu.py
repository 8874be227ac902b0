"""Multi-GPU parity and memory (``multigpu``)."""

from __future__ import annotations

from benchmarks.render.common import (
    _log_axis,
    _num,
    stamp_line,
)


def _mem(mem) -> str:
    return "n/a" if not mem else " / ".join(f"{m['allocated']:.3f}" for m in mem)


def multigpu_md(data: dict) -> str:
    lines = [
        "# Multi-GPU parity: chunked trainers on 2 GPUs vs 1 GPU, same accelerate config and global batch",
        "",
        f"{stamp_line(data['stamp'])}. Gradients of the first step (before clipping and the optimizer step), "
        "fp32 copies of bf16 training; relative error = max |difference| / max |1-GPU entry| per tensor, max "
        "over tensors. Curve: 20 logged losses, largest |difference| (and the same over the largest |1-GPU "
        "loss|). Step time: median after the warm-up steps. Memory: peak allocated GiB per GPU.",
        "",
        "| trainer | backend | max abs grad err | max rel grad err | max abs curve diff | max rel curve diff "
        "| step s (2 GPU / 1 GPU) | peak GiB per GPU (2 GPU; 1 GPU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["comparisons"]:
        m, s = r["multi"], r["single"]
        lines.append(
            f"| {r['trainer']} | {r['backend']} "
            f"| {_num(r['max_abs_grad_error'], '.2e')} | {_num(r['max_rel_grad_error'], '.2e')} "
            f"| {_num(r['max_abs_curve_diff'], '.2e')} | {_num(r['max_rel_curve_diff'], '.2e')} "
            f"| {_num(m['median_step_time_s'])} / {_num(s['median_step_time_s'])} "
            f"| {_mem(m['peak_memory_gib'])}; {_mem(s['peak_memory_gib'])} |"
        )
    if data.get("notes"):
        lines += ["", "Runs without a comparison:", "", *[f"- {n}" for n in data["notes"]]]
    return "\n".join(lines) + "\n"


def multigpu_png(data: dict, plt):
    comps = data["comparisons"]
    labels = [f"{r['trainer']}\n{r['backend']}" for r in comps]
    fig, (ax_e, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(comps))
    grads = [r["max_rel_grad_error"] or 0 for r in comps]
    curves = [r["max_rel_curve_diff"] or 0 for r in comps]
    ax_e.bar([x - 0.2 for x in xs], grads, 0.4, label="first-step gradients")
    ax_e.bar([x + 0.2 for x in xs], curves, 0.4, label="20-step loss curve")
    ax_e.axhline(2**-7, color="k", linestyle="--", label="one bf16 rounding step (2^-7)")
    ax_e.set_title("2 GPUs vs 1 GPU: largest relative difference", fontsize=10)
    _log_axis(ax_e)
    for shift, run, label in ((-0.2, "multi", "2 GPUs"), (0.2, "single", "1 GPU")):
        times = [r[run]["median_step_time_s"] or 0 for r in comps]
        ax_t.bar([x + shift for x in xs], times, 0.4, label=label)
    ax_t.set_title("median step time (s), tiny model", fontsize=10)
    for ax in (ax_e, ax_t):
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(data["stamp"].get("gpu", ""), fontsize=9)
    fig.tight_layout()
    return fig
