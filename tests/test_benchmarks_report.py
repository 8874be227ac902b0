"""The committed benchmark results: one stamped set per benchmark, regenerated on a CPU by
``python -m benchmarks.report`` into the committed tables, plots, README table and docs/benchmarks.md."""

from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks import render, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SETS = sorted(p.stem for p in RESULTS.glob("*.json"))


def test_results_hold_one_json_md_png_set_per_benchmark_and_nothing_else():
    names = {p.name for p in RESULTS.iterdir()}
    expected = {f"{s}.{ext}" for s in SETS for ext in ("json", "md", "png")}
    assert names == expected
    assert {render.kind(s) for s in SETS} == {"losses", "kernels", "e2e", "multigpu"}


@pytest.mark.parametrize("name", SETS, ids=[f"{s}.json" for s in SETS])
def test_every_result_set_is_stamped_with_date_gpu_and_versions(name):
    stamp = json.loads((RESULTS / f"{name}.json").read_text())["stamp"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", stamp["date"])
    assert stamp["gpu"]
    for package in ("torch", "triton", "transformers", "trl", "chunkloss"):
        assert package in stamp["versions"], package


def test_report_regenerates_the_committed_tables_plots_readme_and_docs(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    for png in results.glob("*.png"):
        png.unlink()
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    docs = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(results), "--docs", str(docs), "--readme", str(readme)]) == 0
    assert docs.read_text() == (ROOT / "docs" / "benchmarks.md").read_text()
    assert readme.read_text() == (ROOT / "README.md").read_text()
    for name in SETS:
        assert (results / f"{name}.md").read_text() == (RESULTS / f"{name}.md").read_text(), name
        assert (results / f"{name}.png").stat().st_size > 10_000, name


def test_peak_extra_memory_has_one_name_and_definition_everywhere():
    readme = (ROOT / "README.md").read_text()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    losses = (RESULTS / "losses.md").read_text()
    for text in (readme, docs, losses):
        assert render.MEMORY_LABEL in text
        assert render.MEMORY_MEANING in text
    assert "beyond grads" not in readme + docs + losses


def _set(curves: list[dict], gen: bool = False) -> dict:
    row = {"task": "dpo", "impl": "trl", "batch": 2, "steps": 4, "step_time_s": 0.1, "peak_mem_gib": 1.0}
    if gen:
        row |= {"gen_time_s": 0.05, "train_time_s": 0.05}
    return {"stamp": {"gpu": "cpu", "date": "2026-01-01", "versions": {}}, "task": "dpo",
            "sweep": [{**row, "oom": False}], "curves": curves}  # fmt: skip


@pytest.mark.parametrize(
    ("curves", "gen", "panels"),
    [
        ([], False, ["step_time_s", "peak_mem_gib"]),
        ([{"impl": "trl", "batch": 2, "steps": 3, "losses": [0.7, 0.6, 0.5]}], False,
         ["step_time_s", "peak_mem_gib", "losses"]),
        ([{"impl": "trl", "batch": 2, "steps": 3, "losses": [0.0] * 3, "rewards": [1.0, 2.0, 3.0]}], True,
         ["step_time_s", "train_time_s", "peak_mem_gib", "rewards"]),
    ],
)  # fmt: skip
def test_end_to_end_plot_draws_only_panels_with_data(curves, gen, panels, tmp_path):
    data = _set(curves, gen)
    assert [key for key, _ in render._e2e_panels(data)] == panels
    render.write_set(tmp_path, "e2e_dpo", data)
    assert (tmp_path / "e2e_dpo.png").stat().st_size > 0


def test_committed_end_to_end_sets_without_curves_have_no_curve_panel():
    for name in (s for s in SETS if render.kind(s) == "e2e"):
        data = json.loads((RESULTS / f"{name}.json").read_text())
        keys = [key for key, _ in render._e2e_panels(data)]
        assert ("losses" in keys or "rewards" in keys) == bool(data["curves"]), name


def test_benchmarks_import_no_private_chunkloss_names():
    private = re.compile(r"(chunkloss[\w.]*\._\w+|from chunkloss[\w.]* import [^\n]*\b_\w+)")
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        assert not private.search(path.read_text()), path.name


@pytest.mark.parametrize("module", sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_module_imports_against_the_public_api(module):
    importlib.import_module(f"benchmarks.{module}")


@pytest.mark.parametrize("module", ["cases_ce", "cases_grpo", "cases_jsd", "cases_preference"])
def test_every_loss_case_offers_chunkloss_and_plain_torch(module):
    cases = importlib.import_module(f"benchmarks.{module}").cases()
    assert cases
    for case in cases:
        assert {"chunkloss", "torch"} <= set(case.impls), case.name
        assert case.floor_ms > 0
