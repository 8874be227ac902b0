"""Regenerate every table, plot and page of benchmark results from the committed result files.

    python -m benchmarks.report

For each ``benchmarks/results/<name>.json`` this rewrites ``<name>.md`` and ``<name>.png``; then it writes
``docs/benchmarks.md`` and the measured table of ``README.md`` (between the ``<!-- PERF -->`` markers). Needs
no GPU: it only reads the result files, which the benchmarks write on a GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from benchmarks import render
from benchmarks.render import (
    GEMM_FLOOR,
    MEMORY_DEFINITION,
    MEMORY_LABEL,
    MEMORY_MEANING,
    GiB,
    loss_cell,
    stamp_line,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARK = "<!-- PERF -->"
# The README's table: one representative case per loss, and the peers (TRL's two chunked paths as one column).
README_CASES = (
    "ce N=32768",
    "grpo dapo B=16 T=1024",
    "jsd N=8192",
    "orpo 8x1024",
    "dpo+ref 8x1024",
    "dpo+ref 1x32768",
)
PEERS = {
    "chunkloss": ("chunkloss",),
    "torch": ("torch",),
    "torch.compile": ("torch.compile",),
    "TRL 1.16": ("trl 1.16 head", "trl 1.16 chunked divergence"),
    "Liger": ("liger",),
    "Cut Cross-Entropy": ("cce",),
}
E2E_TASKS = ("sft", "dpo", "orpo", "grpo", "gkd")
# Each case's chunkloss step on the H100 split by kind of GPU work (torch profiler, kernel time per step).
# Measured once with chunkloss 0.1.0, torch 2.11.0+cu130, 2026-11-25; the profiling script is not kept.
STEP_BREAKDOWN = (
    ("ce N=8192", 27.7, 32.7, 28.8, 1.77, 0.21),
    ("ce N=32768", 110.7, 132.7, 121.3, 7.15, 1.81),
    ("grpo dapo B=16 T=1024", 56.5, 75.9, 64.6, 4.36, 2.27),
    ("grpo dapo B=2 T=16384", 113.0, 145.2, 125.3, 8.69, 3.00),
    ("orpo 8x1024", 48.4, 61.7, 53.0, 3.50, 1.91),
    ("dpo+ref 8x1024", 64.6, 79.4, 69.9, 4.63, 1.91),
    ("jsd N=8192", 43.0, 58.5, 48.8, 8.09, 1.14),
    ("jsd N=16384", 86.1, 115.4, 97.3, 16.14, 1.22),
)


def load_sets(results: pathlib.Path = RESULTS) -> dict[str, dict]:
    """Every result set under ``results`` by name (the json file's stem)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}


def peer_table(losses: dict, cases=README_CASES) -> list[str]:
    """Markdown rows: per case, ``ms / GiB`` of chunkloss and each peer."""
    rows = losses["rows"]
    out = ["| loss, case | " + " | ".join(PEERS) + " |", "|---|" + "---|" * len(PEERS)]
    for case in cases:
        by = {r["impl"]: r for r in rows if r["case"] == case}
        if not by:
            continue
        cells = [loss_cell(next((by[i] for i in impls if i in by), None)) for impls in PEERS.values()]
        out.append(f"| {case} | " + " | ".join(cells) + " |")
    return out


def readme_block(losses: dict) -> list[str]:
    return [
        f"Forward + backward of the LM head and loss, bf16, Llama-3-8B head (4096 × 128256), one "
        f"{losses['stamp']['gpu']} ({losses['stamp']['date']}). Each cell: milliseconds / {MEMORY_LABEL}, "
        "lower is better; OOM: out of memory. " + MEMORY_DEFINITION + " Cases: N tokens; B sequences of T "
        "tokens; pairs x tokens per sequence, with a reference model (+ref).",
        "",
        *peer_table(losses),
        "",
        "![losses](benchmarks/results/losses.png)",
    ]


def losses_section(losses: dict) -> list[str]:
    cases = list(dict.fromkeys(r["case"] for r in losses["rows"]))
    floor = {r["case"]: r["floor_ms"] for r in losses["rows"]}
    return [
        "## Losses",
        "",
        f"`python -m benchmarks.bench_losses` ({stamp_line(losses['stamp'])}). Forward + backward, bf16, "
        "Llama-3-8B head (H=4096, V=128256), every implementation on the same inputs in one process. "
        f"Each cell: milliseconds / {MEMORY_LABEL}. The GEMM floor column is in milliseconds.",
        "",
        *_with_floor(peer_table(losses, cases), floor),
        "",
        "Every implementation, with the loss it computed: [`losses.md`](../benchmarks/results/losses.md).",
        "",
        "![losses](../benchmarks/results/losses.png)",
    ]


def _with_floor(table: list[str], floor: dict) -> list[str]:
    out = [table[0].replace("| loss, case |", "| loss, case | GEMM floor |"), table[1] + "---|"]
    for line in table[2:]:
        case = line.split("|")[1].strip()
        out.append(line.replace(f"| {case} |", f"| {case} | {floor[case]:.1f} |", 1))
    return out


def breakdown_section() -> list[str]:
    lines = [
        "## Where a loss step's time goes",
        "",
        "Each case's chunkloss step (forward + backward) on an NVIDIA H100 80GB HBM3 with torch "
        "2.11.0+cu130, 2026-11-25, split by the torch profiler into matrix multiplications (cuBLAS and "
        "chunkloss's Triton weight-gradient kernel), chunkloss's row kernels (softmax, loss and gradient of "
        "a chunk's logits), other kernels, and time the GPU sat idle between kernels, in milliseconds per "
        "step. The matrix multiplications alone take 1.04-1.14x the GEMM floor: cuBLAS does not reach its "
        "square-matrix rate on these shapes. The row kernels take 5-14% of the step, other kernels under 4% "
        "and idle time 1-6%. So most of the distance between the step and the floor is in cuBLAS itself.",
        "",
        "| case | GEMM floor | step | matrix multiplications | row kernels | other kernels | idle |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, floor, step, gemm, row, other in STEP_BREAKDOWN:
        idle = step - gemm - row - other
        lines.append(
            f"| {case} | {floor:.1f} | {step:.1f} ({step / floor:.2f}x) | {gemm:.1f} ({gemm / floor:.2f}x) "
            f"| {row:.2f} | {other:.2f} | {idle:.2f} |"
        )
    return lines


def kernels_section(kernels: dict) -> list[str]:
    table = render.first_table(render.kernels_md(kernels))
    return [
        "## Row kernels",
        "",
        f"`python -m benchmarks.bench_kernels` ({stamp_line(kernels['stamp'])}). Forward + backward, bf16, "
        "milliseconds. GPU: the step replayed from a CUDA graph (the kernels alone); eager: launched from "
        "Python back to back (host-bound for the small cases). Bandwidth floor: the time to read and write "
        "the bytes the op must move at the GPU's memory bandwidth (3.0 TB/s). Memory: MiB allocated during "
        "one eager step, outputs and gradients included.",
        "",
        *table,
        "",
        "![kernels](../benchmarks/results/kernels.png)",
    ]


def decoder_section(data: dict) -> list[str]:
    table = render.first_table(render.decoder_md(data))
    return [
        "## Gated MLP block",
        "",
        f"`python -m benchmarks.bench_decoder` ({stamp_line(data['stamp'])}). Forward + backward of Llama's "
        "MLP `down(silu(gate(x)) * up(x))` in bf16, x and the three weights needing grad: chunkloss's fused "
        "gate/up GEMM in its two backward modes against eager PyTorch, torch.compile and cuBLAS GEMMs with "
        "chunkloss's or Liger's SwiGLU kernel. Milliseconds (median); "
        f"**{render.SAVED_LABEL}**: {render.SAVED_MEANING}; "
        f"**{render.CALL_PEAK_LABEL}**: {render.CALL_PEAK_MEANING}, so it is not the {MEMORY_LABEL} of "
        "the loss tables. Errors: max |error| / max |value| against the same math in fp32. GEMM floor: the "
        f"block's nine matrix multiplications at {data['peak_tflops']:.0f} TFLOP/s.",
        "",
        *table,
        "",
        "![decoder](../benchmarks/results/decoder.png)",
    ]


def decoder_attn_section(data: dict) -> list[str]:
    table = render.first_table(render.decoder_attn_md(data))
    return [
        "## Attention input block",
        "",
        f"`python -m benchmarks.bench_decoder` ({stamp_line(data['stamp'])}). Forward + backward of what a "
        "Llama attention layer computes before attention, in bf16: RMSNorm, the q, k and v projections "
        "split into heads, and RoPE on q and k, x, the norm weight and the three projection weights needing "
        "grad. chunkloss's RMSNorm and RoPE kernels with cuBLAS projections, as `patch` runs them, with and "
        "without the norm output kept for the backward (`patch(norm_recompute=True)` recomputes it), "
        "against eager PyTorch (transformers' math), torch.compile and Liger's RMSNorm and RoPE. "
        f"Milliseconds (median); **{render.SAVED_LABEL}**: {render.ATTN_SAVED_MEANING}; "
        f"**{render.CALL_PEAK_LABEL}**: {render.ATTN_CALL_PEAK_MEANING}. Errors: max |error| / max |value| "
        "against the same math in fp32. GEMM floor: the three projections' six matrix multiplications at "
        f"{data['peak_tflops']:.0f} TFLOP/s.",
        "",
        *table,
        "",
        "![decoder attn](../benchmarks/results/decoder_attn.png)",
    ]


def medusa_section(data: dict) -> list[str]:
    size = data["size"]
    return [
        "## Multi-token (Medusa) heads",
        "",
        f"`python -m benchmarks.bench_medusa` ({stamp_line(data['stamp'])}). Forward + backward of K heads' "
        f"loss on the Llama-3-8B head (H={size['hidden']}, V={size['vocab']}, bf16), N={size['batch']}x"
        f"{size['seq']} positions: head k predicts the token k places ahead with loss weight 0.8^k, the "
        "heads sharing one weight or each with its own. chunkloss's multi-token loss against materialised "
        "logits with `F.cross_entropy` per head and Liger's fused cross-entropy once per head. Milliseconds "
        f"(median) and {MEMORY_LABEL}; the GEMM floor counts every head's labelled rows."
        + render.medusa_chunk_note(data),
        "",
        *render.medusa_rows_table(data),
        "",
        "Each chunkloss row against chunkloss's cross-entropy on one head (first row above) times K, and "
        "against the peers (time: theirs over ours; memory: ours over theirs):",
        "",
        *render.medusa_summary_table(data),
        "",
        "![medusa](../benchmarks/results/medusa.png)",
    ]


def medusa_e2e_section(data: dict) -> list[str]:
    return [
        "## End to end: Medusa heads",
        "",
        f"`python -m benchmarks.bench_medusa_e2e` ({stamp_line(data['stamp'])}). {data['model']}, "
        f"{data['dtype']}, with K Medusa heads, sequences of {data['seq']} tokens, the per-step batch "
        "growing until out of memory or out of the time budget. Stage 1 trains the heads on a frozen "
        "backbone, stage 2 heads and model jointly. hf: each head's logits materialised and upcast to fp32 "
        "for `F.cross_entropy`, as Medusa's training code does; chunkloss: `ChunkedMedusaTrainer`'s loss. "
        "One training step: forward, backward and AdamW step; peak memory: the highest CUDA memory allocated "
        "(weights, gradients, optimizer state, activations). Ratios: chunkloss over hf at the batches both "
        "ran. "
        "Every batch: [`medusa_e2e.md`](../benchmarks/results/medusa_e2e.md).",
        "",
        *render.first_table(render.medusa_e2e_md(data)),
        "",
        "![medusa e2e](../benchmarks/results/medusa_e2e.png)",
    ]


def e2e_section(sets: dict) -> list[str]:
    lines = [
        "## End to end: chunkloss's trainers against TRL's",
        "",
        "`python -m benchmarks.bench_e2e --tasks TASK`: the same model, data and initial weights in TRL "
        "1.16's trainer and in chunkloss's drop-in subclass. Each cell: median step time in seconds / peak "
        "CUDA memory in GiB; ratios are chunkloss over TRL (below 1: faster / less). GRPO's steps are "
        "mostly generation, the same code in both trainers; its table also gives the step time outside "
        "generation.",
    ]
    for task in E2E_TASKS:
        for name in (f"e2e_{task}", f"e2e_{task}_gc"):  # without, then with gradient checkpointing
            data = sets.get(name)
            if data is None:
                continue
            lines += ["", f"### {task.upper()}{render.checkpointing(data)}", "",
                      f"{data.get('model', '')} {stamp_line(data['stamp'])}.", ""]  # fmt: skip
            lines += render.first_table(render.e2e_md(data))
            if render.records_sequences(data):
                lines += ["", *render.e2e_summary_table(data)]
            lines += ["", f"![{name.replace('_', ' ')}](../benchmarks/results/{name}.png)"]
    return lines


def multigpu_section(data: dict) -> list[str]:
    table = render.first_table(render.multigpu_md(data))
    return [
        "## Multi-GPU parity",
        "",
        f"`bash benchmarks/multigpu_run.sh OUT` ({stamp_line(data['stamp'])}). The chunked SFT, DPO and GRPO "
        "trainers under FSDP2 and DeepSpeed ZeRO-3 on 2 GPUs against the same accelerate config on 1 GPU "
        "with the same global batch (tiny model, bf16): the largest difference of the first step's "
        "gradients relative to each tensor's largest entry, and of a 20-step loss curve; step time and peak "
        "memory per GPU.",
        "",
        *table,
        "",
        "![multigpu](../benchmarks/results/multigpu.png)",
    ]


def multigpu_scale_section(data: dict) -> list[str]:
    table = render.first_table(render.multigpu_scale_md(data))
    return [
        "## Multi-GPU scale",
        "",
        f"`bash benchmarks/multigpu_scale.sh OUT` ({stamp_line(data['stamp'])}). chunkloss's SFT, DPO "
        "and GRPO trainers and TRL 1.16's under FSDP2 and DeepSpeed ZeRO-3 at a real model shape (random "
        "weights, bf16), the per-GPU batch growing until out of memory or out of the time budget: the "
        "largest batch of each, tokens/s there, and chunkloss over TRL in median step time and in peak "
        "memory of the fullest GPU at the batches both ran. GRPO's completions are fixed tokens, not "
        "sampled. Every batch and the LM head's memory per GPU: "
        "[`multigpu_scale.md`](../benchmarks/results/multigpu_scale.md).",
        "",
        *table,
        "",
        "![multigpu scale](../benchmarks/results/multigpu_scale.png)",
    ]


def docs_page(sets: dict) -> str:
    losses = sets["losses"]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks.report` from the result files in `benchmarks/results/` (each "
        "holds its date, GPU and library versions); do not edit by hand. Each benchmark writes its own "
        "`<name>.json`, `.md` and `.png` there when run on a GPU (`python -m benchmarks.bench_losses`, "
        "`bench_kernels`, `bench_decoder`, `bench_medusa`, `bench_medusa_e2e`, `bench_e2e`, "
        "`bash benchmarks/multigpu_run.sh`).",
        "",
        "Two terms used below:",
        "",
        f"- **{MEMORY_LABEL}**: {MEMORY_MEANING}. It is the working memory a loss needs on top of its "
        f"outputs; the gradients ({losses['rows'][0].get('grad_bytes', 0) / GiB:.2f} GiB for the first case "
        "below) are the same for every implementation.",
        "- **" + GEMM_FLOOR.format(tflops=losses.get("peak_tflops", 800)).replace(": ", "**: ", 1),
        "",
        *losses_section(losses),
        "",
        *breakdown_section(),
    ]
    if "kernels" in sets:
        lines += ["", *kernels_section(sets["kernels"])]
    if "decoder" in sets:
        lines += ["", *decoder_section(sets["decoder"])]
    if "decoder_attn" in sets:
        lines += ["", *decoder_attn_section(sets["decoder_attn"])]
    if "medusa" in sets:
        lines += ["", *medusa_section(sets["medusa"])]
    if "medusa_e2e" in sets:
        lines += ["", *medusa_e2e_section(sets["medusa_e2e"])]
    lines += ["", *e2e_section(sets)]
    if "multigpu" in sets:
        lines += ["", *multigpu_section(sets["multigpu"])]
    if "multigpu_scale" in sets:
        lines += ["", *multigpu_scale_section(sets["multigpu_scale"])]
    return "\n".join(lines) + "\n"


def update_readme(readme: pathlib.Path, losses: dict) -> None:
    """Replace the text between the two ``<!-- PERF -->`` markers of ``readme`` (if it has them)."""
    text = readme.read_text()
    if text.count(MARK) != 2:
        return
    head, _, rest = text.partition(MARK)
    _, _, tail = rest.partition(MARK)
    readme.write_text(f"{head}{MARK}\n" + "\n".join(readme_block(losses)) + f"\n{MARK}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=pathlib.Path, default=RESULTS, help="folder of the result json files")
    p.add_argument("--docs", type=pathlib.Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--readme", type=pathlib.Path, default=ROOT / "README.md")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    a = p.parse_args(argv)
    sets = load_sets(a.results)
    if "losses" not in sets:
        p.error(f"no losses.json in {a.results}")
    for name, data in sets.items():
        render.render(a.results, name, data, plot=not a.no_plots)
    a.docs.parent.mkdir(parents=True, exist_ok=True)
    a.docs.write_text(docs_page(sets))
    if a.readme.exists():
        update_readme(a.readme, sets["losses"])
    print(f"wrote {len(sets)} result sets' tables{'' if a.no_plots else ' and plots'}, {a.docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
