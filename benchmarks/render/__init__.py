"""Markdown tables and PNG plots of the benchmark result files, one renderer per benchmark.

A result set is ``<name>.json`` (the measurements and a ``stamp``: date, GPU, library versions), ``<name>.md``
and ``<name>.png``, all three written by :func:`write_set`. The benchmark of a set follows from its name:
``losses``, ``kernels``, ``decoder``, ``decoder_attn``, ``medusa``, ``medusa_e2e``, ``multigpu``,
``multigpu_scale`` or ``e2e_<task>``. Runs on a CPU (Agg backend).
"""

from __future__ import annotations

import json
import pathlib

from benchmarks.render.common import (
    ATTN_CALL_PEAK_MEANING,
    ATTN_IN_IMPLS,
    ATTN_SAVED_MEANING,
    CALL_PEAK_LABEL,
    CALL_PEAK_MEANING,
    DECODER_IMPLS,
    E2E_IMPLS,
    FAMILIES,
    GEMM_FLOOR,
    KERNEL_IMPLS,
    LOSS_IMPLS,
    MEDUSA_IMPLS,
    MEMORY_DEFINITION,
    MEMORY_LABEL,
    MEMORY_MEANING,
    SAVED_LABEL,
    SAVED_MEANING,
    GiB,
    _pyplot,
    first_table,
    stamp_line,
)
from benchmarks.render.decoder import (
    decoder_attn_md,
    decoder_attn_png,
    decoder_md,
    decoder_png,
)
from benchmarks.render.e2e import (
    _e2e_panels,
    checkpointing,
    e2e_md,
    e2e_png,
    e2e_summary,
    e2e_summary_table,
    records_sequences,
)
from benchmarks.render.kernels import (
    kernels_md,
    kernels_png,
)
from benchmarks.render.losses import (
    loss_cell,
    losses_md,
    losses_png,
)
from benchmarks.render.medusa import (
    MEDUSA_OURS,
    medusa_chunk_note,
    medusa_e2e_md,
    medusa_e2e_png,
    medusa_e2e_summary,
    medusa_md,
    medusa_png,
    medusa_rows_table,
    medusa_summary,
    medusa_summary_table,
)
from benchmarks.render.multigpu import (
    multigpu_md,
    multigpu_png,
)
from benchmarks.render.multigpu_scale import (
    SCALE_IMPLS,
    multigpu_scale_md,
    multigpu_scale_png,
    scale_summary,
)

__all__ = [
    "MEDUSA_OURS",
    "ATTN_CALL_PEAK_MEANING",
    "ATTN_IN_IMPLS",
    "ATTN_SAVED_MEANING",
    "CALL_PEAK_LABEL",
    "CALL_PEAK_MEANING",
    "checkpointing",
    "decoder_attn_md",
    "decoder_attn_png",
    "DECODER_IMPLS",
    "decoder_md",
    "decoder_png",
    "E2E_IMPLS",
    "e2e_md",
    "e2e_png",
    "e2e_summary",
    "e2e_summary_table",
    "FAMILIES",
    "first_table",
    "GEMM_FLOOR",
    "GiB",
    "KERNEL_IMPLS",
    "kernels_md",
    "kernels_png",
    "kind",
    "loss_cell",
    "LOSS_IMPLS",
    "losses_md",
    "losses_png",
    "medusa_chunk_note",
    "medusa_e2e_md",
    "medusa_e2e_png",
    "medusa_e2e_summary",
    "MEDUSA_IMPLS",
    "medusa_md",
    "medusa_png",
    "medusa_rows_table",
    "medusa_summary",
    "medusa_summary_table",
    "MEMORY_DEFINITION",
    "MEMORY_LABEL",
    "MEMORY_MEANING",
    "multigpu_md",
    "multigpu_png",
    "multigpu_scale_md",
    "multigpu_scale_png",
    "records_sequences",
    "render",
    "RENDERERS",
    "SAVED_LABEL",
    "SAVED_MEANING",
    "SCALE_IMPLS",
    "scale_summary",
    "stamp_line",
    "write_set",
    "_e2e_panels",
    "_pyplot",
]

RENDERERS = {
    "losses": (losses_md, losses_png),
    "kernels": (kernels_md, kernels_png),
    "decoder": (decoder_md, decoder_png),
    "decoder_attn": (decoder_attn_md, decoder_attn_png),
    "medusa": (medusa_md, medusa_png),
    "medusa_e2e": (medusa_e2e_md, medusa_e2e_png),
    "e2e": (e2e_md, e2e_png),
    "multigpu": (multigpu_md, multigpu_png),
    "multigpu_scale": (multigpu_scale_md, multigpu_scale_png),
}


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
