"""Multi-GPU scale at a real model size: chunkloss's trainers and TRL's per-GPU batch sweep
(``multigpu_scale``)."""

from __future__ import annotations

from benchmarks.render.common import (
    _colors,
    _num,
    _plain,
    _ratio,
    _span,
    stamp_line,
)

SCALE_IMPLS = {"chunked": "chunkloss (Chunked*Trainer)", "trl": "TRL 1.16 (*Trainer)"}
SETTING_KEYS = ("model", "seq_len", "world", "gradient_checkpointing")


def _settings(data: dict) -> list[tuple]:
    """The (model, seq_len, world, gradient_checkpointing) settings of a set's runs, in order."""
    return list(dict.fromkeys(tuple(r.get(k) for k in SETTING_KEYS) for r in data["runs"]))


def _setting_title(setting: tuple) -> str:
    model, seq, world, gc = setting
    gpus = f"{world} GPU{'' if world == 1 else 's'}"
    return f"{model}, {seq}-token sequences, {gpus}, gradient checkpointing {'on' if gc else 'off'}"


def _peak(r: dict) -> float | None:
    """The highest peak allocated memory over a run's ranks (GiB), None where none was recorded."""
    mem = r.get("peak_memory_gib")
    return max(m["allocated"] for m in mem) if mem else None


def _pairs(runs: list[dict]) -> list[tuple[str, str]]:
    return list(dict.fromkeys((r["trainer"], r["backend"]) for r in runs))


def scale_summary(data: dict) -> list[dict]:
    """Per setting, trainer and backend: per implementation the largest per-GPU batch that ran (``largest``;
    None if none did), why the sweep went no further (``stop``: ``"OOM at b"``, ``"time budget at b"``,
    ``"failed at b"`` or ``"last batch tried"``) and its tokens/s there (``tokens``); chunkloss over TRL at
    each batch both ran (``time_ratios``: median step time, ``memory_ratios``: peak memory of the fullest
    GPU; {batch: ratio})."""
    out = []
    for setting in _settings(data):
        runs = [r for r in data["runs"] if tuple(r.get(k) for k in SETTING_KEYS) == setting]
        for trainer, backend in _pairs(runs):
            mine = [r for r in runs if (r["trainer"], r["backend"]) == (trainer, backend)]
            s = {"setting": setting, "trainer": trainer, "backend": backend, "largest": {}, "stop": {},
                 "tokens": {}}  # fmt: skip
            ok = {
                i: {r["batch"]: r for r in mine if r["impl"] == i and r["status"] == "ok"}
                for i in SCALE_IMPLS
            }
            for impl in SCALE_IMPLS:
                largest = max(ok[impl], default=None)
                s["largest"][impl] = largest
                s["tokens"][impl] = None if largest is None else ok[impl][largest].get("tokens_per_s")
                ended = sorted(
                    (r["batch"], r["status"]) for r in mine if r["impl"] == impl and r["status"] != "ok"
                )
                if ended:
                    b, status = ended[0]
                    word = {"oom": "OOM", "skipped": "time budget", "failed": "failed"}[status]
                    s["stop"][impl] = f"{word} at {b}"
                else:
                    s["stop"][impl] = "last batch tried" if largest is not None else "not run"
            common = sorted(set(ok["chunked"]) & set(ok["trl"]))
            ours, trl = ok["chunked"], ok["trl"]
            s["time_ratios"] = {
                b: ours[b]["median_step_time_s"] / trl[b]["median_step_time_s"] for b in common
            }
            s["memory_ratios"] = {
                b: _peak(ours[b]) / _peak(trl[b]) for b in common if _peak(ours[b]) and _peak(trl[b])
            }
            out.append(s)
    return out


def _largest(s: dict, impl: str) -> str:
    b = s["largest"][impl]
    return f"{'none' if b is None else b} ({s['stop'][impl]})"


def scale_summary_table(data: dict) -> list[str]:
    many = len(_settings(data)) > 1
    lines = [
        ("| setting " if many else "")
        + "| trainer | backend | largest batch: chunkloss | largest batch: TRL "
        "| tokens/s there (chunkloss / TRL) | chunkloss / TRL step time | chunkloss / TRL peak memory |",
        "|---" * (7 + many) + "|",
    ]
    for s in scale_summary(data):
        tokens = " / ".join(_num(s["tokens"][i], ".0f") for i in SCALE_IMPLS)
        cells = [s["trainer"], s["backend"], _largest(s, "chunked"), _largest(s, "trl"), tokens,
                 _span(s["time_ratios"]), _span(s["memory_ratios"])]  # fmt: skip
        if many:
            cells.insert(0, f"{s['setting'][0]} {s['setting'][1]} x{s['setting'][2]}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def head_memory_table(data: dict) -> list[str]:
    lines = [
        "| model | V × H | gathered weight (GiB) | fp32 accumulator (GiB) | weight-dtype gradient (GiB) "
        "| rows in one chunk, no accumulator |",
        "|---|---|---|---|---|---|",
    ]
    for model, h in data.get("head_memory", {}).items():
        lines.append(
            f"| {model} | {h['vocab']} × {h['hidden']}{' (tied)' if h['tied'] else ''} "
            f"| {h['gathered_weight_gib']:.3f} | {h['fp32_accumulator_gib']:.3f} "
            f"| {h['weight_grad_gib']:.3f} | up to {h['one_chunk_max_rows']} |"
        )
    return lines


def _mem_cell(r: dict) -> str:
    mem = r.get("peak_memory_gib")
    if not mem:
        return "n/a"
    ranks = " / ".join(f"{m['allocated']:.2f}" for m in mem)
    return f"{_peak(r):.2f} ({ranks})"


def scale_rows_table(data: dict, setting: tuple) -> list[str]:
    lines = [
        "| trainer | backend | implementation | per-GPU batch | step time (s) | tokens/s | peak GiB per GPU: "
        "max (per rank) | time / TRL | memory / TRL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    runs = [r for r in data["runs"] if tuple(r.get(k) for k in SETTING_KEYS) == setting]
    trl = {
        (r["trainer"], r["backend"], r["batch"]): r
        for r in runs
        if r["impl"] == "trl" and r["status"] == "ok"
    }
    impls = list(SCALE_IMPLS)
    order = _pairs(runs)

    def key(r):
        impl = impls.index(r["impl"]) if r["impl"] in impls else len(impls)
        return order.index((r["trainer"], r["backend"])), r["batch"], impl

    for r in sorted(runs, key=key):
        head = [r["trainer"], r["backend"], SCALE_IMPLS.get(r["impl"], r["impl"]), r["batch"]]
        if r["status"] != "ok":
            what = {"oom": "OOM", "skipped": "skipped (time budget)", "failed": "failed"}[r["status"]]
            lines.append("| " + " | ".join(map(str, [*head, what, "", "", "", ""])) + " |")
            continue
        base = trl.get((r["trainer"], r["backend"], r["batch"])) if r["impl"] != "trl" else None
        time_ratio = _ratio(r["median_step_time_s"], base and base["median_step_time_s"])
        peak, base_peak = _peak(r), base and _peak(base)
        mem_ratio = _ratio(peak, base_peak) if peak and base_peak else "–"
        cells = [*head, f"{r['median_step_time_s']:.3f}", _num(r.get("tokens_per_s"), ".0f"), _mem_cell(r),
                 time_ratio, mem_ratio]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def multigpu_scale_md(data: dict) -> str:
    runs = data["runs"]
    steps = sorted({r["steps"] for r in runs if "steps" in r})
    warmup = sorted({r["warmup"] for r in runs if "warmup" in r})
    dtypes = "/".join(sorted({r["dtype"] for r in runs if r.get("dtype")})) or "dtype not recorded"
    steps = "/".join(map(str, steps)) or "?"
    warmup = "/".join(map(str, warmup)) or "?"
    lines = [
        "# Multi-GPU scale: chunkloss's trainers and TRL's, per-GPU batch until out of memory",
        "",
        f"{stamp_line(data['stamp'])}. Randomly initialised models of real shape ({dtypes}; in bf16, FSDP2 "
        "keeps fp32 master weights and computes in bf16, ZeRO-3 runs a bf16 module over fp32 optimizer "
        "partitions), one accelerate config per backend (configs/accelerate/fsdp2.yaml, zero3.yaml), the "
        f"same data, options and batch for both trainers of a row. Each batch trains {steps} steps; step "
        f"time: median after {warmup} warm-up steps; tokens/s: non-padding tokens of the policy's training "
        "forwards on all GPUs per median step (DPO: chosen and rejected); peak memory: "
        "`torch.cuda.max_memory_allocated` per GPU, reset when training begins (sharded weights, gradients, "
        "optimizer states and activations). GRPO's completions are fixed tokens "
        f"({data.get('num_generations', '?')} per prompt, filling the sequence), not sampled: its step is "
        "scoring, loss, backward and optimizer. Ratios: chunkloss over TRL at the same per-GPU batch (below "
        "1: faster / less). A sweep stops at its first OOM, or before a batch its share of the time budget "
        "cannot fit.",
        "",
        *scale_summary_table(data),
        "",
        "## The LM head's memory per GPU",
        "",
        "Under FSDP2 and ZeRO-3 every rank holds the whole (V, H) head weight while the head runs "
        "(gathered in the compute dtype, bf16), and the chunked head computes the full weight gradient of "
        "its rank's rows in its forward: in an fp32 accumulator while the chunks run, then cast to bf16 and "
        "kept for the backward, where the backend reduce-scatters it. None of the three is sharded; they do "
        "not shrink with more GPUs. A call whose rows all fit one chunk allocates no accumulator. "
        "docs/multigpu.md has the details.",
        "",
        *head_memory_table(data),
    ]
    for setting in _settings(data):
        lines += ["", f"## {_setting_title(setting)}", "", *scale_rows_table(data, setting)]
    if data.get("notes"):
        lines += ["", "Notes on the runs:", "", *[f"- {n}" for n in data["notes"]]]
    return "\n".join(lines) + "\n"


def multigpu_scale_png(data: dict, plt):
    runs = [r for r in data["runs"] if r["status"] == "ok"]
    settings = _settings(data)
    trainers = list(dict.fromkeys(r["trainer"] for r in data["runs"])) or ["none"]
    fig, axes = plt.subplots(2, len(trainers), figsize=(4.6 * len(trainers), 7.5), squeeze=False)
    lines = list(dict.fromkeys((r["backend"], r["impl"]) for r in data["runs"]))
    colors = _colors([b for b in dict.fromkeys(b for b, _ in lines)])
    for col, trainer in enumerate(trainers):
        ax_m, ax_t = axes[0][col], axes[1][col]
        for setting in settings:
            suffix = f", {setting[0]}" if len(settings) > 1 else ""
            for backend, impl in lines:
                mine = sorted(
                    (
                        (r["batch"], r)
                        for r in runs
                        if (r["trainer"], r["backend"], r["impl"]) == (trainer, backend, impl)
                        and tuple(r.get(k) for k in SETTING_KEYS) == setting
                    ),
                    key=lambda br: br[0],
                )
                if not mine:
                    continue
                oom = [r["batch"] for r in data["runs"] if r["status"] == "oom" and r["trainer"] == trainer
                       and (r["backend"], r["impl"]) == (backend, impl)]  # fmt: skip
                label = f"{backend}, {impl}{suffix}" + (f" (OOM at {min(oom)})" if oom else "")
                style = dict(color=colors[backend], linestyle="-" if impl == "chunked" else "--", marker="o")
                mem = [(b, _peak(r)) for b, r in mine if _peak(r) is not None]
                if mem:
                    ax_m.plot(*zip(*mem), label=label, **style)
                tok = [(b, r["tokens_per_s"]) for b, r in mine if r.get("tokens_per_s") is not None]
                if tok:
                    ax_t.plot(*zip(*tok), label=label, **style)
        ax_m.set_title(f"{trainer}: peak memory of the fullest GPU (GiB)", fontsize=10)
        ax_t.set_title(f"{trainer}: tokens/s, all GPUs", fontsize=10)
        for ax in (ax_m, ax_t):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(_plain())
            ax.set_xlabel("per-GPU batch")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    title = "; ".join(_setting_title(s) for s in settings)
    fig.suptitle(f"{title} ({data['stamp'].get('gpu', '')}); solid: chunkloss, dashed: TRL", fontsize=9)
    fig.tight_layout()
    return fig
