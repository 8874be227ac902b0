"""End to end (``e2e_<task>``): chunkloss's trainers against TRL's, sweeps, summaries and curves."""

from __future__ import annotations

import math

from benchmarks.render.common import (
    E2E_IMPLS,
    _colors,
    _num,
    _plain,
    _ratio,
    stamp_line,
)


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
