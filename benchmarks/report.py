"""Tables, plots and the benchmarks page from the committed result files.

    python -m benchmarks.report

Every result set is ``benchmarks/results/<name>.json``: the measurements and a ``stamp`` (date, GPU, library
versions, the command that wrote it). The benchmark of a set follows from its name (``losses``, ``kernels``,
``decoder``, ``decoder_attn``, ``medusa``, ``medusa_e2e``, ``e2e_*``, ``profile*``, ``floor*``, ``multigpu``,
``multigpu_scale``). For each, :func:`records` reads one row per (case, implementation): time, memory and
a few extra columns. From them this writes ``<name>.md`` (every row, and per case chunkloss against the best
peer) and ``<name>.png`` (time and memory per case), then ``docs/benchmarks.md`` and the table of
``README.md`` between the ``<!-- PERF -->`` markers. Needs no GPU.

``python -m benchmarks.report --merge DIR...`` first merges the e2e, long-context, profile and floor json
files that GPU runs wrote into ``DIR...`` into the sets under ``--results`` (rows of the same case and
implementation: the newest wins).
"""

from __future__ import annotations

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# The docs page's hand-written head: what the page is, and the command that produces each set.
PAGE_HEAD = ROOT / "benchmarks" / "page_head.md"
MARK = "<!-- PERF -->"
GiB = 2**30
MEMORY_LABEL = "peak extra memory (GiB)"
MEMORY_DEFINITION = (
    "Peak extra memory: the highest memory allocated during the step minus the memory allocated before it, "
    "not counting the gradients the step returns."
)
# Implementations that are chunkloss's (any other is a peer), by the prefix of their name.
OURS = ("chunkloss", "chunked", "ours", "fused", "triton", "unfused", "norm_recompute", "cublas_swiglu")
# The README's table: one representative case per loss, and the peers (TRL's two chunked paths as one column).
README_CASES = ("ce N=32768", "grpo dapo B=16 T=1024", "jsd N=8192", "orpo 8x1024", "dpo+ref 8x1024",
                "dpo+ref 1x32768")  # fmt: skip
PEERS = {"chunkloss": ("chunkloss",), "torch": ("torch",), "torch.compile": ("torch.compile",),
         "TRL 1.16": ("trl 1.16 head", "trl 1.16 chunked divergence"), "Liger": ("liger",),
         "Cut Cross-Entropy": ("cce",)}  # fmt: skip
PEAK = "peak memory (GiB)"
CALL_PEAK = "peak of one call, gradients included (GiB)"
# Per benchmark: title, time unit, memory column, and what is measured.
KINDS = {
    "losses": ("Losses: forward + backward of the LM head and its loss", "ms", MEMORY_LABEL,
               "bf16, Llama-3-8B head (H=4096, V=128256), every implementation on the same inputs in one "
               "process. Time: CUDA events, median after warm-up. " + MEMORY_DEFINITION + " floor: the "
               "logits' three GEMMs at the harness's peak rate (ms)."),
    "kernels": ("Row kernels, forward + backward", "ms", "peak of one eager step (GiB)",
                "bf16. Time: the step replayed from a CUDA graph (eager: launched from Python). floor: "
                "the op's bytes at the GPU's bandwidth (ms)."),
    "decoder": ("Gated MLP block, forward + backward", "ms", CALL_PEAK,
                "bf16, Llama's MLP `down(silu(gate(x)) * up(x))`, x and the weights needing grad. saved: "
                "bytes autograd keeps for the backward (MiB). floor: the nine GEMMs (ms)."),
    "decoder_attn": ("Attention input block (RMSNorm, q/k/v, RoPE), forward + backward", "ms", CALL_PEAK,
                     "bf16, x, the norm weight and the q/k/v weights needing grad. saved: bytes autograd "
                     "keeps for the backward (MiB). floor: the six GEMMs (ms)."),
    "medusa": ("Multi-token (Medusa) heads' loss, forward + backward", "ms", MEMORY_LABEL,
               "bf16, Llama-3-8B head, K heads weighted 0.8^k, one shared weight or one per head. "
               + MEMORY_DEFINITION),
    "medusa_e2e": ("End to end: Medusa heads", "s", PEAK,
                   "A training step with K Medusa heads; stage 1 trains the heads on a frozen backbone, "
                   "stage 2 heads and model. hf: logits materialised as Medusa's code does."),
    "e2e": ("End to end: a training step of TRL's trainers, its peers and chunkloss's", "s", PEAK,
            "Random weights of the named shape, the same data and batch for every implementation, each "
            "in its own process. Step time: median after warm-up; peak memory: the highest CUDA memory "
            "allocated during training minus what was allocated when it began."),
    "longctx": ("Long context: one sequence per step at growing lengths", "s", "GPU peak (GiB)",
                "Random weights of the named shape, checkpointing on, batch 1 (GRPO: one group of 8 "
                "completions), each implementation in its own process. Step time: median after warm-up; GPU "
                "peak: the highest CUDA memory allocated during training minus what was allocated when it "
                "began; host: the process's peak resident memory (GiB). Growth: the least-squares slope of "
                "the GPU peaks, GiB per 1k tokens."),
    "profile": ("Where the training step's GPU time goes", "ms", PEAK,
                "torch.profiler over the timed steps: CUDA kernel time per step by kind; idle: step time "
                "minus the union of kernel intervals (launch and CPU gaps)."),
    "floor": ("The training step's floor: its GEMMs and attention alone", "ms", PEAK,
              "The step's matrix products (same M, K, N; forward and backward; no weight gradient for "
              "frozen weights) and attention (SDPA forward + backward), each timed alone on the same card; "
              "QLoRA: the 4-bit weights' dequantisation too."),
    "multigpu": ("Multi-GPU parity: chunked trainers on 2 GPUs vs 1 GPU, same global batch", "s",
                 "peak GiB per GPU", "The first step's gradients, the loss curve and (a real shape) each "
                 "step's gradient norms of the head and the middle layer against 1 GPU: the largest "
                 "difference relative to the tensor's or the curve's largest magnitude. noise_*: the same "
                 "for the 1-GPU global batch in two micro-batches against 1 GPU (a real shape)."),
    "multigpu_scale": ("Multi-GPU scale: per-GPU batch until out of memory", "s", "peak GiB (fullest GPU)",
                       "Random weights of real shape, bf16, one accelerate config per backend; step time: "
                       "median after warm-up; tokens/s over all GPUs; GRPO's completions are fixed."),
}  # fmt: skip


def kind(name: str) -> str:
    """The benchmark of a result set: its name where that is a kind, else the part before the first ``_``."""
    return name if name in KINDS else name.split("_", 1)[0]


def is_ours(impl: str) -> bool:
    return impl.startswith(OURS)


def _row(case, impl, time=None, memory=None, error=None, **extra) -> dict:
    return {"case": case, "impl": impl, "time": time, "memory": memory, "error": error, **extra}


def _gib(nbytes) -> float | None:
    return None if nbytes is None else nbytes / GiB


def fullest(peaks: list[dict] | None) -> float | None:
    """The largest per-rank allocated peak (GiB) of ``[{"rank", "allocated", ...}]``."""
    return max((p["allocated"] for p in peaks or []), default=None)


def e2e_case(r: dict) -> str:
    """A run's case: the keys that vary between e2e runs, then the batch."""
    parts = [r.get(k) for k in ("shape", "task", "loss", "medusa")]
    if "seq" in r:
        parts.append(f"{r['seq']} tok")
    if "gc" in r:
        parts.append(f"gc {'on' if r['gc'] else 'off'}")
    return " ".join(str(p) for p in parts if p) + f" b={r['batch']}"


def longctx_summary(rows: list[dict]) -> dict:
    """Per implementation of a ``longctx`` set: its GPU-memory growth (the least-squares slope of its peaks
    against tokens, GiB per 1k tokens; None under two points) and the longest run that completed."""
    out = {}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        pts = [
            (r["tokens"] / 1e3, r["peak_mem_gib"])
            for r in rows
            if r["impl"] == impl and r.get("peak_mem_gib") is not None
        ]
        slope = None
        if len(pts) >= 2:
            mx, my = (sum(p[i] for p in pts) / len(pts) for i in (0, 1))
            slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        longest = max((r["tokens"] for r in rows if r["impl"] == impl and "step_time_s" in r), default=None)
        out[impl] = {"gib_per_1k_tokens": slope, "longest_tokens": longest}
    return out


# A run's table rows, per benchmark kind (generators: a kernels run holds one row per implementation).
def _losses_rows(r: dict):
    extra = dict(floor=r.get("floor_ms"), loss=r.get("loss"))
    yield _row(r["case"], r["impl"], r.get("ms"), _gib(r.get("peak_extra_bytes")), r.get("error"), **extra)


def _kernels_rows(r: dict):
    for impl, v in r.items():
        if isinstance(v, dict):
            memory = (v.get("peak_extra_mib") or 0) / 1024
            yield _row(r["case"], impl, v.get("graph_ms"), memory, eager_ms=v.get("ms"), floor=r["floor_ms"])


def _decoder_rows(r: dict):
    max_err = max(r.get("err", {}).values(), default=None)
    extra = dict(floor=r.get("floor_ms"), saved_mib=(r.get("saved_bytes") or 0) / 2**20, max_err=max_err)
    yield _row(r["case"], r["impl"], r.get("ms"), _gib(r.get("peak_bytes")), r.get("error"), **extra)


def impl_label(r: dict) -> str:
    """A run's implementation as the tables name it: chunkloss under ``torch_compile`` is a row of its own."""
    return r["impl"] + (" + torch_compile" if r["impl"] == "chunkloss" and r.get("compiled") else "")


def _training_row(case: str, r: dict, **extra) -> dict:
    """A training run's row: its median step time (s), its peak memory (GiB), and OOM or its error."""
    error = "OOM" if r.get("oom") else r.get("error")
    return _row(case, impl_label(r), r.get("step_time_s"), r.get("peak_mem_gib"), error, **extra)


def _medusa_e2e_rows(r: dict):
    case = f"stage {r['stage']} K={r['heads']} b={r['batch']}"
    yield _training_row(case, r, tokens_per_s=r.get("tokens_per_s"))


def _e2e_rows(r: dict):
    first = {"first_step_s": r["first_step_s"]} if "first_step_s" in r else {}  # runs since it is recorded
    yield _training_row(e2e_case(r), r, tokens_per_s=r.get("tokens_per_s"), **first)


def _longctx_rows(r: dict):
    case = f"{r['shape']} {r['task']} {r['loss']} {r['tokens']} tok"
    yield _training_row(case, r, host=r.get("host_peak_gib"))


def _parts_rows(r: dict):
    yield _row(r["case"], r["impl"], r.get("ms"), r.get("peak_mem_gib"), r.get("error"), **r.get("parts", {}))


def _multigpu_rows(c: dict):
    time, memory = c["multi"]["median_step_time_s"], fullest(c["multi"]["peak_memory_gib"])
    extra = dict(one_gpu_s=c["single"]["median_step_time_s"], **_parity_cells(c))
    yield _row(f"{c['trainer']} {c['backend']}", "chunked", time, memory, **extra)


def _multigpu_scale_rows(r: dict):
    gc = "on" if r["gradient_checkpointing"] else "off"
    case = f"{r['model']} {r['trainer']} {r['backend']} gc {gc} b={r['batch']}"
    off = r["impl"] == "chunked" and not r.get("kernels")  # runs before the switch had no kernels
    impl = r["impl"] + (" (no kernels)" if off else "")
    time, memory = r.get("median_step_time_s"), fullest(r.get("peak_memory_gib"))
    error = None if r["status"] == "ok" else r["status"]
    yield _row(case, impl, time, memory, error, tokens_per_s=r.get("tokens_per_s"))


# Per benchmark kind: the key of its runs in a set, and a run's rows.
RECORDS = {
    "losses": ("rows", _losses_rows), "medusa": ("rows", _losses_rows), "kernels": ("rows", _kernels_rows),
    "decoder": ("rows", _decoder_rows), "decoder_attn": ("rows", _decoder_rows),
    "medusa_e2e": ("runs", _medusa_e2e_rows), "e2e": ("sweep", _e2e_rows), "longctx": ("rows", _longctx_rows),
    "profile": ("rows", _parts_rows), "floor": ("rows", _parts_rows),
    "multigpu": ("comparisons", _multigpu_rows), "multigpu_scale": ("runs", _multigpu_scale_rows),
}  # fmt: skip


def records(name: str, data: dict) -> list[dict]:
    """One row per (case, implementation) of a result set: ``time`` (the kind's unit), ``memory`` (GiB),
    ``error`` (None, ``OOM`` or a message) and extra columns."""
    if kind(name) not in RECORDS:
        raise ValueError(f"no renderer for result set {name!r}")
    key, rows = RECORDS[kind(name)]
    return [row for r in data[key] for row in rows(r)]


def _parity_cells(c: dict) -> dict:
    """A parity comparison's errors, then its noise run's (when it has one)."""
    cells = {}
    for prefix, e in (("", c), ("noise_", c.get("noise") or {})):
        if e:
            cells[f"{prefix}rel_grad_err"] = e["max_rel_grad_error"]
            cells[f"{prefix}rel_curve_diff"] = e["max_rel_curve_diff"]
            for g, v in (e.get("max_rel_norm_diff") or {}).items():
                cells[f"{prefix}rel_norm_diff_{g}"] = v
    return cells


def against_best_peer(rows: list[dict]) -> list[dict]:
    """Per case and chunkloss implementation: its time over the fastest peer's and its memory over the
    smallest peer memory, among the peers that ran (no OOM or error) in that case."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        ran = [r for r in rows if r["case"] == case and r["error"] is None and r["time"] is not None]
        peers = [r for r in ran if not is_ours(r["impl"])]
        fast = min(peers, key=lambda r: r["time"], default=None)
        small = min((r for r in peers if r["memory"] is not None), key=lambda r: r["memory"], default=None)
        for r in (r for r in ran if is_ours(r["impl"])):
            mem = small and r["memory"] is not None and small["memory"] and r["memory"] / small["memory"]
            time = dict(best_time_peer=fast and fast["impl"], time_ratio=fast and r["time"] / fast["time"])
            memory = dict(memory_ratio=mem or None, best_memory_peer=small and small["impl"])
            out.append(dict(case=case, impl=r["impl"], **time, **memory))
    return out


def about(data: dict, meaning: str) -> str:
    """A set's first line: the command that wrote it, the GPU, date and library versions, what it measures."""
    st = data["stamp"]
    versions = ", ".join(f"{k} {v}" for k, v in st.get("versions", {}).items() if v and v != "unknown")
    where = f"{st.get('gpu', 'unknown GPU')}, {st.get('date', 'unknown date')}; {versions}"
    return f"`{st.get('command', '')}` ({where}). {meaning}"


def _num(v) -> str:
    if v is None or v is False:
        return "–"
    if isinstance(v, str):
        return v
    return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}"


def rows_table(name: str, rows: list[dict]) -> list[str]:
    unit, mem = KINDS[kind(name)][1], KINDS[kind(name)][2]
    fixed = ("case", "impl", "time", "memory", "error")
    extra = list(dict.fromkeys(k for r in rows for k in r if k not in fixed))
    head = ["case", "implementation", f"time ({unit})", mem, *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["case"], r["impl"]]
        cells += [r["error"], ""] if r["error"] else [_num(r["time"]), _num(r["memory"])]
        lines.append("| " + " | ".join(cells + [_num(r.get(k)) for k in extra]) + " |")
    return lines


def summary_table(rows: list[dict]) -> list[str]:
    lines = ["| case | chunkloss | time / fastest peer | memory / smallest peer |", "|---|---|---|---|"]
    for s in against_best_peer(rows):
        t = f"{s['time_ratio']:.2f} ({s['best_time_peer']})" if s["time_ratio"] else "–"
        m = f"{s['memory_ratio']:.2f} ({s['best_memory_peer']})" if s["memory_ratio"] else "–"
        lines.append(f"| {s['case']} | {s['impl']} | {t} | {m} |")
    return lines if len(lines) > 2 else []


def set_md(name: str, data: dict) -> str:
    title, _, _, meaning = KINDS[kind(name)]
    rows = records(name, data)
    summary = summary_table(rows)
    lines = [f"# {title}", "", about(data, meaning), *(["", data["model"]] if data.get("model") else []), ""]
    if summary:
        lines += ["Chunkloss against the best peer in each case (below 1: faster / less):", "", *summary, ""]
    lines += rows_table(name, rows)
    growth = [
        f"| {impl} | {_num(v['gib_per_1k_tokens'])} | {v['longest_tokens']} |"
        for impl, v in (data.get("summary") or {}).items()
    ]
    if growth:
        lines += ["", "| implementation | GPU GiB per 1k tokens | longest run (tokens) |", "|---|---|---|"]
        lines += growth
    notes = data.get("notes") or []
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else [])) + "\n"


def set_png(name: str, data: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records(name, data) if r["error"] is None and r["time"] is not None]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    title, unit, mem, _ = KINDS[kind(name)]
    width = min(40, max(8, 0.35 * len(cases) * max(len(impls), 2)))
    fig, axes = plt.subplots(2, 1, figsize=(width, 8), squeeze=False)
    width = 0.8 / max(len(impls), 1)
    for k, impl in enumerate(impls):
        by = {r["case"]: r for r in rows if r["impl"] == impl}
        xs = [c + (k - (len(impls) - 1) / 2) * width for c in range(len(cases))]
        for ax, key in zip(axes[:, 0], ("time", "memory"), strict=True):
            ax.bar(xs, [(by[c][key] or 0) if c in by else 0 for c in cases], width, label=impl)
    for ax, label in zip(axes[:, 0], (f"time ({unit})", mem), strict=True):
        ax.set_xticks(range(len(cases)), cases, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(label)
    axes[0, 0].legend(fontsize=7, ncol=4)
    axes[0, 0].set_title(f"{title} ({data['stamp'].get('gpu')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_json(path: pathlib.Path | str, data) -> None:
    """``data`` as indented json at ``path``, its folder made if missing."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def write_set(out_dir: pathlib.Path | str, name: str, data: dict) -> None:
    """Write ``<name>.json``, ``<name>.md`` and ``<name>.png`` under ``out_dir``."""
    write_json(pathlib.Path(out_dir) / f"{name}.json", data)
    render(pathlib.Path(out_dir), name, data)


def render(out_dir: pathlib.Path, name: str, data: dict) -> None:
    (out_dir / f"{name}.md").write_text(set_md(name, data))
    set_png(name, data, out_dir / f"{name}.png")


# The set a merged run goes into, by the mode of its file (any other mode: the set of that name).
MERGED_SETS = {"e2e": "e2e_{task}_{loss}", "longctx": "longctx_{shape}_{task}_{loss}"}


def merge(out: pathlib.Path, dirs: list[pathlib.Path]) -> list[str]:
    """Merge the files ``bench_e2e --out`` wrote under ``dirs`` into sets in ``out``: end-to-end runs into
    ``e2e_<task>_<loss>``, profiles into ``profile``, floors into ``floor``, added to the rows already there;
    a row of the same case and implementation as an earlier one replaces it."""
    merged: dict[str, dict] = {}
    for path in sorted((p for d in dirs for p in d.rglob("*.json")), key=lambda p: p.stat().st_mtime):
        data = json.loads(path.read_text())
        mode = data.get("mode") if isinstance(data, dict) else None
        key = "sweep" if mode == "e2e" else "rows"
        for r in data.get(key, []) if mode else []:
            name = MERGED_SETS[mode].format(**r) if mode in MERGED_SETS else mode
            if name not in merged:
                old = out / f"{name}.json"
                merged[name] = json.loads(old.read_text()) if old.exists() else {"mode": mode, key: []}
            into = merged[name]
            into["stamp"] = data["stamp"]
            same = (r.get("case") or e2e_case(r), impl_label(r))
            into[key] = [o for o in into[key] if (o.get("case") or e2e_case(o), impl_label(o)) != same]
            into[key].append(r)
    for name, data in merged.items():
        if data.get("mode") == "longctx":
            data["summary"] = longctx_summary(data["rows"])
        write_set(out, name, data)
    return sorted(merged)


def peer_table(losses: dict, cases=README_CASES) -> list[str]:
    """Markdown rows: per case, ``ms / GiB`` of chunkloss and each peer."""
    out = ["| loss, case | " + " | ".join(PEERS) + " |", "|---|" + "---|" * len(PEERS)]
    for case in cases:
        by = {r["impl"]: r for r in losses["rows"] if r["case"] == case}
        if by:
            cells = [_loss_cell(next((by[i] for i in impls if i in by), None)) for impls in PEERS.values()]
            out.append(f"| {case} | " + " | ".join(cells) + " |")
    return out


def _loss_cell(r: dict | None) -> str:
    if r is None:
        return "–"
    if "error" in r:
        return "OOM" if r["error"] == "OOM" else "error"
    return f"{r['ms']:.1f} / {r['peak_extra_bytes'] / GiB:.2f}"


def docs_page(sets: dict) -> str:
    lines = [PAGE_HEAD.read_text().rstrip("\n")]
    for name in sorted(sets, key=lambda n: (list(KINDS).index(kind(n)), n)):
        data, (title, _, _, meaning) = sets[name], KINDS[kind(name)]
        summary = summary_table(records(name, data))
        lines += ["", f"## {title} (`{name}`)", "", about(data, meaning), ""]
        if name == "losses":
            lines += [*peer_table(data, list(dict.fromkeys(r["case"] for r in data["rows"]))), ""]
        elif summary:
            lines += [*summary, ""]
        link = f"../benchmarks/results/{name}"
        lines += [f"Every row: [`{name}.md`]({link}.md).", "", f"![{name}]({link}.png)"]
    return "\n".join(lines) + "\n"


def update_readme(readme: pathlib.Path, losses: dict) -> None:
    """Replace the text between the two ``<!-- PERF -->`` markers of ``readme`` (if it has them) by the
    losses' table: chunkloss and its peers on one representative case per loss."""
    text = readme.read_text()
    if text.count(MARK) != 2:
        return
    head, _, rest = text.partition(MARK)
    _, _, tail = rest.partition(MARK)
    intro = (
        f"Forward + backward of the LM head and loss, bf16, Llama-3-8B head (4096 × 128256), one "
        f"{losses['stamp']['gpu']} ({losses['stamp']['date']}). Each cell: milliseconds / {MEMORY_LABEL}, "
        "lower is better; OOM: out of memory. " + MEMORY_DEFINITION + " Cases: N tokens; B sequences of T "
        "tokens; pairs x tokens per sequence, with a reference model (+ref)."
    )
    block = [intro, "", *peer_table(losses), "", "![losses](benchmarks/results/losses.png)"]
    readme.write_text(f"{head}{MARK}\n" + "\n".join(block) + f"\n{MARK}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=pathlib.Path, default=RESULTS, help="folder of the result json files")
    p.add_argument("--docs", type=pathlib.Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--readme", type=pathlib.Path, default=ROOT / "README.md")
    merge_help = "first merge the bench_e2e files under these folders into --results"
    p.add_argument("--merge", type=pathlib.Path, nargs="+", metavar="DIR", help=merge_help)
    a = p.parse_args(argv)
    if a.merge:
        print("merged", ", ".join(merge(a.results, a.merge)))
    sets = {path.stem: json.loads(path.read_text()) for path in sorted(a.results.glob("*.json"))}
    if "losses" not in sets:
        p.error(f"no losses.json in {a.results}")
    for name, data in sets.items():
        render(a.results, name, data)
    a.docs.parent.mkdir(parents=True, exist_ok=True)
    a.docs.write_text(docs_page(sets))
    if a.readme.exists():
        update_readme(a.readme, sets["losses"])
    print(f"wrote {len(sets)} result sets' tables and plots, {a.docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
