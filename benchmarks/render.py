"""Markdown tables and PNG plots of the benchmark result files, one renderer per benchmark.

A result set is ``<name>.json`` (the measurements and a ``stamp``: date, GPU, library versions), ``<name>.md``
and ``<name>.png``, all three written by :func:`write_set`. The benchmark of a set follows from its name:
``losses``, ``kernels``, ``decoder``, ``decoder_attn``, ``medusa``, ``medusa_e2e``, ``multigpu`` or
``e2e_<task>``. Runs on a CPU (Agg backend).
"""

from __future__ import annotations

import json
import math
import pathlib

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
    "ours_saved": "chunkloss fused, recompute=False",
    "ours": "chunkloss fused, recompute=True",
}
# The attention input block's implementations (bench_decoder's names) and what each one is.
ATTN_IN_IMPLS = {
    "eager": "eager PyTorch",
    "compile": "torch.compile",
    "liger": "Liger RMSNorm + cuBLAS + Liger RoPE",
    "unfused": "chunkloss RMSNorm + cuBLAS + chunkloss RoPE",
    "norm_recompute": "chunkloss RMSNorm + cuBLAS + chunkloss RoPE, norm recomputed",
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


def kind(name: str) -> str:
    """The benchmark of a result set named ``name``: the name itself where it has its own renderer
    (``medusa_e2e``), else the part before the first ``_`` (``e2e_dpo`` -> ``e2e``, ``losses_ce`` ->
    ``losses``)."""
    return name if name in RENDERERS else name.split("_", 1)[0]


def write_set(out_dir: pathlib.Path | str, name: str, data: dict, plot: bool = True) -> None:
    """Write ``<name>.json``, ``<name>.md`` and (if ``plot``) ``<name>.png`` under ``out_dir``."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    render(out_dir, name, data, plot)


def render(out_dir: pathlib.Path, name: str, data: dict, plot: bool = True) -> None:
    """Write ``<name>.md`` and (if ``plot``) ``<name>.png`` from a set's data."""
    md, png = RENDERERS[kind(name)]
    (out_dir / f"{name}.md").write_text(md(data))
    if plot:
        plt = _pyplot()
        fig = png(data, plt)
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)


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


# --- losses -----------------------------------------------------------------------------------------------


def _ok(r: dict | None) -> bool:
    return r is not None and "error" not in r


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


# --- kernels ----------------------------------------------------------------------------------------------


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


# --- end to end -------------------------------------------------------------------------------------------


def _num(v, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def _ratio(a, b) -> str:
    return "–" if a is None or b is None else f"{a / b:.2f}"


def checkpointing(data: dict, form: str = " ({})") -> str:
    """``gradient checkpointing on`` / ``off`` put in ``form``, or ``""`` for a set that does not say."""
    if "gradient_checkpointing" not in data.get("args", {}):
        return ""
    return form.format(f"gradient checkpointing {'on' if data['args']['gradient_checkpointing'] else 'off'}")


def records_sequences(data: dict) -> bool:
    """Whether an end-to-end set's runs record the sequences they trained on (what its summary states)."""
    return any("seq_tokens" in r for r in data["sweep"])


def _slope(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of y on x over ``points`` (None for fewer than two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def _dash(v, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def e2e_summary(data: dict) -> list[dict]:
    """Per implementation of a sweep, in the sweep's order, against TRL's.

    Keys: ``growth`` (GiB of peak memory per added unit of the per-device batch: the least-squares slope
    over the batches that ran) and ``growth_ratio``; ``largest`` (the largest batch that ran), ``oom_at``
    (the batch that ran out of memory; None if none did, so ``largest`` is a lower bound) and
    ``largest_ratio``, with ``largest_bound`` ``"="``, ``">="`` or ``"<="`` where one side never ran out of
    memory (no ratio where neither did); ``time_ratios`` ({batch: step time over TRL's} at each batch both
    ran) and ``worst_time_ratio``; ``curve_diff`` (the largest |loss - TRL's loss| over the steps both
    logged). Ratios are None for TRL itself and where a side has no value.
    """
    sweep, curves = data["sweep"], data.get("curves") or []
    out = []
    for impl in dict.fromkeys(r["impl"] for r in sweep):
        ok = [r for r in sweep if r["impl"] == impl and not r["oom"]]
        mem = [(r["batch"], r["peak_mem_gib"]) for r in ok if r.get("peak_mem_gib") is not None]
        out.append({
            "impl": impl,
            "growth": _slope(mem),
            "largest": max((r["batch"] for r in ok), default=None),
            "oom_at": min((r["batch"] for r in sweep if r["impl"] == impl and r["oom"]), default=None),
            "step_times": {r["batch"]: r["step_time_s"] for r in ok},
            "losses": next((r.get("losses") for r in curves if r["impl"] == impl), None),
        })  # fmt: skip
    trl = next((s for s in out if s["impl"] == "trl"), None)
    for s in out:
        s |= dict.fromkeys(("growth_ratio", "largest_ratio", "largest_bound", "worst_time_ratio"))
        s["time_ratios"], s["curve_diff"] = {}, None
        if trl is None or s is trl:
            continue
        if s["growth"] is not None and trl["growth"]:
            s["growth_ratio"] = s["growth"] / trl["growth"]
        if s["largest"] and trl["largest"] and (s["oom_at"] or trl["oom_at"]):
            s["largest_ratio"] = s["largest"] / trl["largest"]
            s["largest_bound"] = "=" if s["oom_at"] and trl["oom_at"] else ("<=" if s["oom_at"] else ">=")
        s["time_ratios"] = {b: t / trl["step_times"][b] for b, t in s["step_times"].items()
                            if b in trl["step_times"]}  # fmt: skip
        s["worst_time_ratio"] = max(s["time_ratios"].values(), default=None)
        if s["losses"] and trl["losses"]:
            s["curve_diff"] = max(abs(a - b) for a, b in zip(s["losses"], trl["losses"]))
    return out


def e2e_summary_table(data: dict) -> list[str]:
    """:func:`e2e_summary` in markdown: a sentence on the sequences and the columns, then the table."""
    seen = [r for r in data["sweep"] if "seq_tokens" in r]
    lengths = "/".join(str(t) for t in sorted({r["seq_tokens"] for r in seen}))
    mean = sum(r["mean_tokens"] for r in seen) / len(seen)
    lines = [
        f"Against TRL's, over the sweep. Sequences of {lengths} tokens ({mean:.0f} not padding on average), "
        "as the policy's first training forward of each run saw them. **Memory growth**: the least-squares "
        "slope of peak memory over the batches that ran, in GiB per added unit of the per-device batch (for "
        "DPO and ORPO a chosen/rejected pair). **Largest batch**: the largest that ran; no OOM means the "
        "sweep ended first, so it is a lower bound (≥ / ≤ on the ratio). **Time / trl**: at each batch both "
        "ran. **Loss curve**: the largest |loss - TRL's loss| over the steps both logged.",
        "",
        "| impl | memory growth (GiB / batch unit) | growth / trl | largest batch | largest / trl "
        "| time / trl at each batch | worst time / trl | loss curve, max diff from trl |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in e2e_summary(data):
        largest = "none" if s["largest"] is None else str(s["largest"])
        if s["largest"] is not None:
            largest += f" (OOM at {s['oom_at']})" if s["oom_at"] else " (no OOM)"
        bound = {">=": "≥ ", "<=": "≤ "}.get(s["largest_bound"], "")
        ratio = "–" if s["largest_ratio"] is None else f"{bound}{s['largest_ratio']:.2f}"
        times = ", ".join(f"{b}: {t:.2f}" for b, t in s["time_ratios"].items()) or "–"
        cells = [s["impl"], _dash(s["growth"], ".3f"), _dash(s["growth_ratio"]), largest, ratio, times,
                 _dash(s["worst_time_ratio"]), _dash(s["curve_diff"], ".4f")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def e2e_md(data: dict) -> str:
    task, sweep = data["task"], data["sweep"]
    has_gen = any(r.get("gen_time_s") is not None for r in sweep)
    lines = [
        f"# End to end: {task.upper()}, chunkloss trainer vs TRL's{checkpointing(data)}",
        "",
        f"{stamp_line(data['stamp'])}. {data.get('model', '')} Step time: median over the timed steps; peak "
        "memory: the highest CUDA memory allocated during training. Ratios: the implementation's over TRL's "
        "at the same batch (below 1: faster / less).",
        "",
    ]
    cols = ["impl", "batch", "steps", "step time (s)"]
    if has_gen:
        cols += ["generation (s)", "step outside generation (s)", "outside generation / trl"]
    cols += ["peak memory (GiB)", "time / trl", "memory / trl"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    trl = {r["batch"]: r for r in sweep if r["impl"] == "trl" and not r["oom"]}
    for r in sweep:
        cells = [r["impl"], r["batch"], r["steps"]]
        if r["oom"]:
            cells += ["OOM"] + [""] * (len(cols) - 4)
        else:
            t = trl.get(r["batch"]) if r["impl"] != "trl" else None
            cells.append(_num(r["step_time_s"]))
            if has_gen:
                tt = None if t is None else t.get("train_time_s")
                cells += [_num(r["gen_time_s"]), _num(r["train_time_s"]), _ratio(r["train_time_s"], tt)]
            cells += [
                _num(r["peak_mem_gib"], ".2f"),
                _ratio(r["step_time_s"], None if t is None else t["step_time_s"]),
                _ratio(r["peak_mem_gib"], None if t is None else t["peak_mem_gib"]),
            ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    for s in data.get("skipped", []):
        lines.append(f"\nSweep stopped before batch {s['batch']} ({s['reason']}).")
    curves = data.get("curves") or []
    if curves:
        rewards = any(r.get("rewards") for r in curves)
        cols = ["impl", "batch", "steps", "first loss", "last loss"] + [
            "first reward",
            "last reward",
        ] * rewards
        lines += ["", "Training curves (first and last logged value):", ""]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in curves:
            ls, rw = r.get("losses") or [math.nan], r.get("rewards") or [math.nan]
            vals = [ls[0], ls[-1]] + ([rw[0], rw[-1]] if rewards else [])
            cells = [r["impl"], r["batch"], r["steps"], *(f"{v:.4f}" for v in vals)]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    if records_sequences(data):
        lines += ["", *e2e_summary_table(data)]
    return "\n".join(lines) + "\n"


def _e2e_panels(data: dict) -> list[tuple[str, str]]:
    """(kind, title) of each panel that has data: sweeps always; generation split and curves if recorded."""
    task, panels = data["task"], []
    panels.append(("step_time_s", f"{task}: step time (s) vs batch"))
    if any(r.get("train_time_s") is not None for r in data["sweep"]):
        panels.append(("train_time_s", f"{task}: step time outside generation (s) vs batch"))
    panels.append(("peak_mem_gib", f"{task}: peak memory (GiB) vs batch"))
    curves = data.get("curves") or []
    if any(r.get("rewards") for r in curves):
        panels.append(("rewards", f"{task}: reward per step"))
    elif any(r.get("losses") for r in curves):
        panels.append(("losses", f"{task}: loss per step"))
    return panels


def e2e_png(data: dict, plt):
    panels = _e2e_panels(data)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    # Equal curves overlap: the line styles tell them apart. Each impl keeps its colour whichever ran.
    style = dict(zip(E2E_IMPLS, ("-", "--", ":", "-."), strict=True))
    colors = _colors(E2E_IMPLS)
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        for impl in E2E_IMPLS:
            if key in ("rewards", "losses"):
                for r in data["curves"]:
                    if r["impl"] == impl and r.get(key):
                        ax.plot(range(1, len(r[key]) + 1), r[key], label=impl, linestyle=style[impl],
                                color=colors[impl])  # fmt: skip
                ax.set_xlabel(f"step (batch {data['curves'][0]['batch']})")
                continue
            pts = [
                (r["batch"], r[key])
                for r in data["sweep"]
                if r["impl"] == impl and not r["oom"] and r.get(key) is not None
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl, linestyle=style[impl], color=colors[impl])
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(_plain())
            ax.set_xlabel("per-device batch")
        ax.set_title(title, fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    gpu = data["stamp"].get("gpu")
    fig.suptitle(f"{data.get('model', '')} ({gpu}{checkpointing(data, '; {}')})", fontsize=9)
    fig.tight_layout()
    return fig


# --- multi-GPU --------------------------------------------------------------------------------------------


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


# --- gated MLP block (decoder) ----------------------------------------------------------------------------


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


def _grouped_bars(ax, rows, cases, impls, key, scale, colors, names) -> None:
    """Bars of ``row[key] / scale`` per case (x) and implementation (colour); 0 where a row is missing."""
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        by = {r["case"]: r for r in rows if r["impl"] == impl and _ok(r)}
        xs = [c + (k - (len(impls) - 1) / 2) * width for c in range(len(cases))]
        ys = [by[c][key] / scale if c in by and by[c].get(key) is not None else 0 for c in cases]
        ax.bar(xs, ys, width, color=colors[impl], label=names[impl])


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


# --- attention input block (decoder_attn) -----------------------------------------------------------------


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


# --- multi-token (Medusa) heads ---------------------------------------------------------------------------


MEDUSA_OURS = ("chunkloss", "chunkloss_bf16_accum", "chunkloss_bf16_accum_liger_chunks")


def medusa_summary(rows: list[dict]) -> list[dict]:
    """Per K-head case and chunkloss row (``MEDUSA_OURS``, those measured): its time over K × one head's, and
    its time and memory against each peer."""
    single = next((r for r in rows if r["impl"] == "chunkloss_single_head" and _ok(r)), None)
    out = []
    for case in dict.fromkeys(r["case"] for r in rows if r["heads"] > 1):
        by = {r["impl"]: r for r in rows if r["case"] == case and _ok(r)}
        for impl in (i for i in MEDUSA_OURS if i in by):
            ours = by[impl]
            s = {
                "case": case,
                "impl": impl,
                "k_single": single and ours["ms"] / (ours["heads"] * single["ms"]),
            }
            for peer in ("torch", "liger"):
                p = by.get(peer, {})
                s[f"speedup_{peer}"] = p["ms"] / ours["ms"] if "ms" in p else None
                mem = p.get("peak_extra_bytes"), ours.get("peak_extra_bytes")
                s[f"memory_{peer}"] = mem[1] / mem[0] if all(mem) else None
            out.append(s)
    return out


def medusa_rows_table(data: dict) -> list[str]:
    lines = [f"| case | implementation | ms | × GEMM floor | {MEMORY_LABEL} | loss |", "|---" * 6 + "|"]
    for r in data["rows"]:
        impl = MEDUSA_IMPLS.get(r["impl"], r["impl"])
        if not _ok(r):
            lines.append(f"| {r['case']} | {impl} | {r['error']} | | | |")
            continue
        mem = "n/a" if r.get("peak_extra_bytes") is None else f"{r['peak_extra_bytes'] / GiB:.2f}"
        lines.append(f"| {r['case']} | {impl} | {r['ms']:.2f} | {r['ms'] / r['floor_ms']:.2f} | {mem} "
                     f"| {r['loss']:.4f} |")  # fmt: skip
    return lines


def medusa_summary_table(data: dict) -> list[str]:
    lines = [
        "| case | chunkloss | time / (K × one head) | speed-up vs torch | speed-up vs Liger "
        "| memory / torch's | memory / Liger's |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = ("k_single", "speedup_torch", "speedup_liger", "memory_torch", "memory_liger")
    for s in medusa_summary(data["rows"]):
        cells = [s["case"], MEDUSA_IMPLS[s["impl"]], *(_num(s[k], ".2f") for k in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def medusa_chunk_note(data: dict) -> str:
    """The sentence naming the chunk size of the ``chunkloss_bf16_accum_liger_chunks`` rows (empty without
    them)."""
    sizes = sorted({r["chunk_size"] for r in data["rows"] if r.get("chunk_size")})
    if not sizes:
        return ""
    return (
        " bf16 accum: the weight gradient accumulated in bf16 (the weight's dtype, as Liger accumulates it) "
        "instead of fp32, chunks sized by chunkloss; with Liger's chunk size: chunk_size = "
        f"{', '.join(map(str, sizes))} rows, what Liger's fused cross-entropy takes on one head's N rows "
        "(next_pow2(ceil(N / ceil(V / H))))."
    )


def medusa_md(data: dict) -> str:
    size = data["size"]
    lines = [
        "# Multi-token (Medusa) heads, forward + backward of the K heads' loss",
        "",
        f"{stamp_line(data['stamp'])}. {str(size['dtype']).removeprefix('torch.')}, H={size['hidden']}, "
        f"V={size['vocab']}, N={size['batch']}x{size['seq']} positions. Head k reads its own hidden state "
        "and predicts the token k places ahead, loss weight 0.8^k; the heads share one (V, H) weight "
        "(shared) or have one each (per_head). Time: CUDA events, median after warm-up. "
        + MEMORY_DEFINITION
        + " GEMM floor: the logits and their two gradients of every head's labelled rows at "
        f"{data['peak_tflops']:.0f} TFLOP/s. One head: chunkloss's cross-entropy on N rows, the unit of "
        "the second table's time column." + medusa_chunk_note(data),
        "",
        *medusa_rows_table(data),
        "",
        *medusa_summary_table(data),
    ]
    return "\n".join(lines) + "\n"


def medusa_png(data: dict, plt):
    rows = [r for r in data["rows"] if r["heads"] > 1]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = [i for i in MEDUSA_IMPLS if any(r["impl"] == i for r in rows)]
    colors = _colors(impls)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6))
    _grouped_bars(ax_t, rows, cases, impls, "ms", 1, colors, MEDUSA_IMPLS)
    _grouped_bars(ax_m, rows, cases, impls, "peak_extra_bytes", GiB, colors, MEDUSA_IMPLS)
    single = next((r for r in data["rows"] if r["impl"] == "chunkloss_single_head" and _ok(r)), None)
    for c, case in enumerate(cases if single else ()):
        k = next(r["heads"] for r in rows if r["case"] == case)
        label = "chunkloss CE, one head × K" if c == 0 else None
        ax_t.hlines(k * single["ms"], c - 0.45, c + 0.45, colors="k", linestyles="--", label=label)
    labels = [c.rsplit(" N=", 1)[0] for c in cases]
    for ax, title in ((ax_t, "ms, forward + backward"), (ax_m, MEMORY_LABEL)):
        ax.set_xticks(range(len(cases)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
    if any(r.get("peak_extra_bytes") for r in rows):  # a CPU run records no memory: nothing to log-scale
        _log_axis(ax_m)
    ax_t.legend(fontsize=7, loc="upper left")
    size = data["size"]
    fig.suptitle(f"Medusa heads, H={size['hidden']}, V={size['vocab']}, N={size['batch']}x{size['seq']} "
                 f"({data['stamp'].get('gpu')}; lower is better)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    return fig


# --- end-to-end Medusa training ---------------------------------------------------------------------------

MEDUSA_E2E_IMPLS = {
    "hf": "hf (materialised logits)",
    "chunkloss": "chunkloss (ChunkedMedusaTrainer)",
}


def _pairs(data: dict) -> list[tuple[int, int]]:
    """The (stage, K) pairs of a ``medusa_e2e`` set, in the order they ran."""
    return list(dict.fromkeys((r["stage"], r["heads"]) for r in data["runs"]))


def _span(values: dict) -> str:
    """``lo–hi (batches b0–b1)`` of {batch: value}, one value as ``v (batch b)``, ``–`` for none."""
    if not values:
        return "–"
    lo, hi, b = min(values.values()), max(values.values()), sorted(values)
    if len(b) == 1:
        return f"{lo:.2f} (batch {b[0]})"
    return f"{lo:.2f}–{hi:.2f} (batches {b[0]}–{b[-1]})"


def medusa_e2e_summary(data: dict) -> list[dict]:
    """Per (stage, K): per implementation the largest batch that ran (``largest``; None if none did) and why
    the sweep went no further (``stop``: ``"OOM at b"``, ``"time budget"`` or ``"last batch tried"``), its
    tokens/s there (``tokens``); chunkloss over hf at each batch both ran (``time_ratios``,
    ``memory_ratios``: {batch: ratio}); the largest relative difference of their first-step losses
    (``loss_diff``; None without a common batch)."""
    out = []
    for stage, k in _pairs(data):
        runs = [r for r in data["runs"] if (r["stage"], r["heads"]) == (stage, k)]
        budget = any((s["stage"], s["heads"]) == (stage, k) for s in data.get("skipped", []))
        s = {"stage": stage, "heads": k, "largest": {}, "stop": {}, "tokens": {}}
        ok = {
            impl: {r["batch"]: r for r in runs if r["impl"] == impl and not r["oom"]}
            for impl in MEDUSA_E2E_IMPLS
        }
        for impl in MEDUSA_E2E_IMPLS:
            oom = [r["batch"] for r in runs if r["impl"] == impl and r["oom"]]
            largest = max(ok[impl], default=None)
            s["largest"][impl] = largest
            s["tokens"][impl] = None if largest is None else ok[impl][largest].get("tokens_per_s")
            s["stop"][impl] = f"OOM at {oom[0]}" if oom else "time budget" if budget else "last batch tried"
        common = sorted(set(ok["hf"]) & set(ok["chunkloss"]))
        hf, ours = ok["hf"], ok["chunkloss"]
        s["time_ratios"] = {b: ours[b]["step_time_s"] / hf[b]["step_time_s"] for b in common}
        s["memory_ratios"] = {
            b: ours[b]["peak_mem_gib"] / hf[b]["peak_mem_gib"]
            for b in common
            if ours[b].get("peak_mem_gib") and hf[b].get("peak_mem_gib")
        }
        diffs = [abs(ours[b]["first_loss"] - hf[b]["first_loss"]) / abs(hf[b]["first_loss"]) for b in common]
        s["loss_diff"] = max(diffs, default=None)
        out.append(s)
    return out


def medusa_e2e_summary_table(data: dict) -> list[str]:
    lines = [
        "| stage | K | largest batch: hf | largest batch: chunkloss | tokens/s there (hf / chunkloss) "
        "| chunkloss / hf step time | chunkloss / hf peak memory | first-step loss, relative difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in medusa_e2e_summary(data):
        largest = [
            "none" if s["largest"][i] is None else f"{s['largest'][i]} ({s['stop'][i]})"
            for i in MEDUSA_E2E_IMPLS
        ]
        tokens = " / ".join(_num(s["tokens"][i], ".0f") for i in MEDUSA_E2E_IMPLS)
        cells = [s["stage"], s["heads"], *largest, tokens, _span(s["time_ratios"]), _span(s["memory_ratios"]),
                 _num(s["loss_diff"], ".1e")]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def medusa_e2e_pair_table(data: dict, stage: int, k: int) -> list[str]:
    lines = [
        "| batch | implementation | step time (s) | tokens/s | peak memory (GiB) | time / hf | memory / hf "
        "| first-step loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    runs = [r for r in data["runs"] if (r["stage"], r["heads"]) == (stage, k)]
    hf = {r["batch"]: r for r in runs if r["impl"] == "hf" and not r["oom"]}
    for r in sorted(runs, key=lambda r: (r["batch"], list(MEDUSA_E2E_IMPLS).index(r["impl"]))):
        impl = MEDUSA_E2E_IMPLS[r["impl"]]
        if r["oom"]:
            lines.append(f"| {r['batch']} | {impl} | OOM | | | | | |")
            continue
        base = hf.get(r["batch"]) if r["impl"] != "hf" else None
        mem = r.get("peak_mem_gib")
        mem_ratio = _ratio(mem, base and base.get("peak_mem_gib")) if mem else "–"
        time_ratio = _ratio(r["step_time_s"], base and base["step_time_s"])
        cells = [r["batch"], impl, f"{r['step_time_s']:.3f}", f"{r['tokens_per_s']:.0f}", _num(mem, ".2f"),
                 time_ratio, mem_ratio, f"{r['first_loss']:.4f}"]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def medusa_e2e_md(data: dict) -> str:
    lines = [
        "# End to end: Medusa heads trained with materialised logits (hf) and with chunkloss",
        "",
        f"{stamp_line(data['stamp'])}. {data['model']}, {data['dtype']}, K Medusa heads (one residual "
        f"block and an own LM head each), sequences of {data['seq']} random tokens. Stage 1: backbone frozen "
        f"and run without autograd, the heads train on Σ_k {data['decay']}^k · L_k; stage 2: heads and model "
        f"train jointly, plus {data['base_weight']:g} × the base head's loss. hf: each head's logits "
        "materialised and upcast to fp32 for `F.cross_entropy`, as Medusa's training code does; chunkloss: "
        "`ChunkedMedusaTrainer.compute_loss` (`FusedLinearMultiTokenLoss`). Same model, batches, initial "
        f"weights and AdamW; one training step = forward, backward and optimizer step. Step time: median of "
        f"{data['steps']} steps after {data['warmup']} warm-up steps; tokens/s: batch × {data['seq']} / step "
        "time; peak memory: the highest CUDA memory allocated during the run (weights, gradients, optimizer "
        "state, activations). Ratios: chunkloss over hf at the same batch (below 1: faster / less). A sweep "
        "stops at an implementation's first OOM, or before a batch its share of the time budget "
        f"({data['time_budget_s']:.0f} s for all) cannot fit.",
        "",
        *medusa_e2e_summary_table(data),
    ]
    for stage, k in _pairs(data):
        lines += ["", f"## Stage {stage}, K = {k}", "", *medusa_e2e_pair_table(data, stage, k)]
    return "\n".join(lines) + "\n"


def medusa_e2e_png(data: dict, plt):
    pairs = _pairs(data)
    fig, axes = plt.subplots(2, max(1, len(pairs)), figsize=(4.2 * max(1, len(pairs)), 7), squeeze=False)
    colors = _colors(MEDUSA_E2E_IMPLS)
    limit = data.get("device_memory_gib")
    for col, (stage, k) in enumerate(pairs):
        ax_m, ax_t = axes[0][col], axes[1][col]
        runs = [r for r in data["runs"] if (r["stage"], r["heads"]) == (stage, k)]
        for impl, name in MEDUSA_E2E_IMPLS.items():
            ok = sorted((r["batch"], r) for r in runs if r["impl"] == impl and not r["oom"])
            oom = [r["batch"] for r in runs if r["impl"] == impl and r["oom"]]
            label = name + (f", OOM at {oom[0]}" if oom else "")
            mem = [(b, r["peak_mem_gib"]) for b, r in ok if r.get("peak_mem_gib") is not None]
            if mem:
                ax_m.plot(*zip(*mem), marker="o", color=colors[impl], label=label)
            if oom and limit:
                ax_m.plot([oom[0]], [limit], marker="x", markersize=10, color=colors[impl], linestyle="none")
            if ok:
                tokens = [r["tokens_per_s"] for _, r in ok]
                ax_t.plot([b for b, _ in ok], tokens, marker="o", color=colors[impl], label=label)
        if limit:
            ax_m.axhline(limit, color="k", linestyle="--", linewidth=0.8, label="GPU memory (x: OOM)")
        ax_m.set_title(f"stage {stage}, K={k}: peak memory (GiB)", fontsize=10)
        ax_t.set_title(f"stage {stage}, K={k}: tokens/s", fontsize=10)
        for ax in (ax_m, ax_t):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(_plain())
            ax.set_xlabel(f"batch (sequences of {data['seq']} tokens)")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle(f"Medusa training step, {data['model']} ({data['stamp'].get('gpu')})", fontsize=9)
    fig.tight_layout()
    return fig


RENDERERS = {
    "losses": (losses_md, losses_png),
    "kernels": (kernels_md, kernels_png),
    "decoder": (decoder_md, decoder_png),
    "decoder_attn": (decoder_attn_md, decoder_attn_png),
    "medusa": (medusa_md, medusa_png),
    "medusa_e2e": (medusa_e2e_md, medusa_e2e_png),
    "e2e": (e2e_md, e2e_png),
    "multigpu": (multigpu_md, multigpu_png),
}
