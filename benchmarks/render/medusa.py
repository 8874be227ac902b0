"""Multi-token (Medusa) heads: the loss (``medusa``) and end-to-end training (``medusa_e2e``)."""

from __future__ import annotations

from benchmarks.render.common import (
    MEDUSA_IMPLS,
    MEMORY_DEFINITION,
    MEMORY_LABEL,
    GiB,
    _colors,
    _grouped_bars,
    _log_axis,
    _num,
    _ok,
    _plain,
    _ratio,
    _span,
    stamp_line,
)

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


MEDUSA_E2E_IMPLS = {
    "hf": "hf (materialised logits)",
    "chunkloss": "chunkloss (ChunkedMedusaTrainer)",
}


def _pairs(data: dict) -> list[tuple[int, int]]:
    """The (stage, K) pairs of a ``medusa_e2e`` set, in the order they ran."""
    return list(dict.fromkeys((r["stage"], r["heads"]) for r in data["runs"]))


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
