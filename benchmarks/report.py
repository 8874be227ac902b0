"""Write the README's performance section from the committed results in benchmarks/results/.

    python -m benchmarks.report          # rewrites the block between <!-- PERF --> markers in README.md

Loss rows come from ``losses.json`` (CE, GRPO, JSD) and ``losses_preference.json`` (DPO, ORPO); kernel rows
from ``kernels.json``; end-to-end rows (GRPO's also without generation, where a run timed it apart) from
``e2e/``; GPU-scale config runs from ``gpu_configs/``.
"""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GiB = 2**30
MARK = "<!-- PERF -->"


def _load(name):
    return json.loads((RESULTS / name).read_text())


def loss_table() -> list[str]:
    main, pref = _load("losses.json"), _load("losses_preference.json")
    rows = [r for r in main["rows"] if r["group"] not in ("dpo", "orpo")] + pref["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = ["chunkloss", "chunkloss (bf16 accum)", "torch", "torch.compile", "trl 1.16 head"]
    impls += ["trl 1.16 chunked divergence", "liger", "cce"]
    out = [
        f"Losses, forward + backward, bf16, H=4096, V=128256, on one {main['meta']['device']} "
        f"(torch {main['meta']['torch']}). Each cell: ms / peak extra GiB beyond the returned gradients; "
        "the floor is the GEMMs at 800 TFLOP/s. From `benchmarks/results/losses*.json`.",
        "",
        "| case | floor ms | " + " | ".join(impls) + " |",
        "|---|---|" + "---|" * len(impls),
    ]
    for case in cases:
        by = {r["impl"]: r for r in rows if r["case"] == case}
        floor = next(iter(by.values()))["floor_ms"]
        cells = []
        for impl in impls:
            r = by.get(impl)
            if r is None:
                cells.append("–")
            elif "error" in r:
                cells.append("OOM" if r["error"] == "OOM" else "error")
            else:
                x = f" ({r['x_floor']:.2f}×)" if impl == "chunkloss" else ""
                cells.append(f"{r['ms']:.1f}{x} / {r['extra_beyond_grads_bytes'] / GiB:.2f}")
        out.append(f"| {case} | {floor:.1f} | " + " | ".join(cells) + " |")
    return out


def kernel_table() -> list[str]:
    k = _load("kernels.json")
    lines = (RESULTS / "kernels.md").read_text().splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    return [
        f"Row kernels, forward + backward, bf16, on one {k['meta'].get('device', 'GPU')}. From "
        "`benchmarks/results/kernels.md`: GPU = the step replayed from a CUDA graph (the kernels alone), "
        "eager = launched from Python back to back (host-bound for the small cases).",
        "",
        *table,
    ]


E2E_IMPLS = ("trl", "chunkloss", "chunkloss+kernels")
E2E_TASKS = ("grpo", "sft", "dpo", "orpo", "gkd")  # table order
# bench_e2e runs with chunkloss+kernels (`--impls` default), copied here from the GPU runs' e2e.json, oldest
# first; each run's tasks replace the earlier runs' rows, so each row's ratios come from one run.
E2E_KERNELS_RUNS = (
    "e2e/e2e_kernels_run3.json",
    "e2e/e2e_onepass_run4.json",
    "e2e/e2e_sft_gkd_run5.json",
)
# Runs at the real models' depth (28 layers for Qwen3-0.6B, 16 for Llama-3.2-1B): fewer batch sizes fit the
# device time than the trimmed runs above, which stay for the larger batches.
E2E_FULL_DEPTH_RUNS = (
    "e2e/e2e_grpo_28l_run7.json",
    "e2e/e2e_dpo_orpo_16l_run8.json",
    "e2e/run9_grpo_28l/e2e.json",
    "e2e/run9_dpo_orpo_16l_small/e2e.json",
    "e2e/run11_dpo_orpo_16l/e2e.json",
    "e2e/run11_sft_16l/e2e.json",
)


def e2e_table() -> list[str]:
    """GRPO from run 1; DPO and ORPO from run 2; any task in a later run with all three implementations
    (``E2E_KERNELS_RUNS``) from the latest such run instead. Where the GRPO rows time generation apart
    (``gen_time_s``, runs since bench_e2e recorded it), a second table gives the step time without it."""
    run1, run2 = _load("e2e/e2e_all_run1.json"), _load("e2e/e2e_dpo_orpo_run2.json")
    rows = [r for r in run1["sweep"] if r["task"] == "grpo"] + run2["sweep"]
    device = run2["device"]
    layers = {r["task"]: run["args"]["layers"] for run in (run1, run2) for r in run["sweep"]}
    for name in E2E_KERNELS_RUNS:
        run = _load(name)
        tasks = {r["task"] for r in run["sweep"]}
        rows = [r for r in rows if r["task"] not in tasks] + run["sweep"]
        layers.update({t: _run_layers(run["args"], t) for t in tasks})
        device = run["device"]
    return _e2e_rows_table(rows, device, layers, "")


def e2e_full_depth_table() -> list[str]:
    """The runs at the real models' depth (``E2E_FULL_DEPTH_RUNS``), each task and batch from its latest run
    (every implementation of a row's task and batch ran in the same call, so its ratios come from one run)."""
    rows, layers, device = [], {}, ""
    for name in E2E_FULL_DEPTH_RUNS:
        run = _load(name)
        keys = {(r["task"], r["batch"]) for r in run["sweep"]}
        rows = [r for r in rows if (r["task"], r["batch"]) not in keys] + run["sweep"]
        layers.update({r["task"]: r["layers"] for r in run["sweep"]})
        device = run["device"]
    return _e2e_rows_table(rows, device, layers, " at the real models' depth")


def _e2e_rows_table(rows: list[dict], device: str, layers: dict, where: str) -> list[str]:
    impls = [i for i in E2E_IMPLS if any(r["impl"] == i for r in rows)]
    others = [i for i in impls if i != "trl"]
    what = "chunkloss trainer" + (" (+kernels: `chunk_kernels=True`)" if "chunkloss+kernels" in impls else "")
    ratio_cols, train_cols = [], []
    for impl in others:
        tag = f" ({impl})" if len(others) > 1 else ""
        ratio_cols += [f"time ratio{tag}", f"memory ratio{tag}"]
        train_cols.append(f"train-time ratio{tag}")
    names = ["TRL" if i == "trl" else i for i in impls]
    tasks = [t for t in E2E_TASKS if any(r["task"] == t for r in rows)]
    llama = ", ".join(t.upper() for t in tasks if t != "grpo")
    teacher = " (GKD's teacher: same shape, other weights; off-policy, `lmbda=0`)" if "gkd" in tasks else ""
    depth = ", ".join(f"{t.upper()} {layers[t]}" for t in tasks)
    out = [
        f"End to end{where} (`benchmarks/bench_e2e.py`, one {device}, decoder layers {depth}, "
        "full-size heads): "
        f"step time in s / peak GiB, {what} vs TRL 1.16's. GRPO: Qwen3-0.6B shape; {llama}: "
        f"Llama-3.2-1B shape{teacher}, 512 tokens. From `benchmarks/results/e2e/`.",
        "",
        "| task | batch | " + " | ".join(names + ratio_cols) + " |",
        "|---|---|" + "---|" * (len(names) + len(ratio_cols)),
    ]
    for task in tasks:
        for batch in sorted({r["batch"] for r in rows if r["task"] == task}):
            by = {r["impl"]: r for r in rows if r["task"] == task and r["batch"] == batch}
            cells = _e2e_cells(by, impls, others, "step_time_s")
            out.append(f"| {task} | {batch} | " + " | ".join(cells) + " |")
    gen_rows = [r for r in rows if r.get("gen_time_s") is not None]
    if gen_rows:
        out += [
            "",
            "GRPO without generation: each cell is the median step time less the time in "
            "`_generate_and_score_completions` (generation, rewards, TRL's no-grad log-probs: the same code "
            "in both trainers) / the median time in it, in s; the ratios compare the first number, the loss "
            "path's step.",
            "",
            "| task | batch | " + " | ".join(names + train_cols) + " |",
            "|---|---|" + "---|" * (len(names) + len(others)),
        ]
        for task in [t for t in E2E_TASKS if any(r["task"] == t for r in gen_rows)]:
            for batch in sorted({r["batch"] for r in gen_rows if r["task"] == task}):
                by = {r["impl"]: r for r in rows if r["task"] == task and r["batch"] == batch}
                cells = _e2e_cells(by, impls, others, "train_time_s")
                out.append(f"| {task} | {batch} | " + " | ".join(cells) + " |")
    return out


def _run_layers(args: dict, task: str) -> int:
    """Decoder layers of ``task`` in a run's args (a merged run keeps each call's args under its tasks)."""
    if "layers" in args:
        return args["layers"]
    return next(a["layers"] for tasks, a in args.items() if task in tasks.split(","))


def _e2e_cells(by: dict, impls: list[str], others: list[str], key: str) -> list[str]:
    """One row's cells from its runs ``by`` impl: per impl ``<key> / <second>`` (second: the peak GiB for
    ``step_time_s``, the generation time for ``train_time_s``), then per other impl the ratio of ``key`` over
    TRL's (and of the peak memory, for ``step_time_s``)."""
    second, fmt = ("peak_mem_gib", ".2f") if key == "step_time_s" else ("gen_time_s", ".3f")
    ratios = [key, "peak_mem_gib"] if key == "step_time_s" else [key]

    def ok(r) -> bool:
        return r is not None and not r.get("oom") and r.get(key) is not None

    cells = []
    for impl in impls:
        r = by.get(impl)
        if r is not None and r.get("oom"):
            cells.append("OOM")
        else:
            cells.append(f"{r[key]:.3f} / {r[second]:{fmt}}" if ok(r) else "–")
    t = by.get("trl")
    for impl in others:
        c = by.get(impl)
        cells += [f"{c[k] / t[k]:.2f}" if ok(t) and ok(c) else "–" for k in ratios]
    return cells


def configs_table() -> list[str]:
    lines = (RESULTS / "gpu_configs" / "gpu_configs.md").read_text().splitlines()
    return [
        "GPU-scale configs (`python -m benchmarks.gpu_configs`), from `benchmarks/results/gpu_configs/`:",
        "",
        *[ln for ln in lines if ln.startswith("|")],
    ]


def main():
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, _, rest = text.partition(MARK)
    _, _, tail = rest.partition(MARK)
    body = "\n".join(
        [
            *loss_table(),
            "",
            *kernel_table(),
            "",
            *e2e_table(),
            "",
            *e2e_full_depth_table(),
            "",
            *configs_table(),
        ]
    )
    readme.write_text(f"{head}{MARK}\n{body}\n{MARK}{tail}")


if __name__ == "__main__":
    main()
