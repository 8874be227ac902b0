"""The committed benchmark results and the report built from them: every set stamped and rendered, the
committed pages in step with the json files, and the ratios against the best peer computed from the json."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks import report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SETS = sorted(p.stem for p in RESULTS.glob("*.json"))
STAMP = {"gpu": "GPU", "date": "2026-01-01", "versions": {}, "command": "cmd"}


def test_results_hold_one_json_md_png_set_per_benchmark_and_nothing_else():
    names = {p.name for p in RESULTS.iterdir()}
    assert names == {f"{s}.{ext}" for s in SETS for ext in ("json", "md", "png")}
    assert {report.kind(s) for s in SETS} <= set(report.KINDS)


@pytest.mark.parametrize("name", SETS, ids=[f"{s}.json" for s in SETS])
def test_every_result_set_is_stamped_and_gives_rows(name):
    data = json.loads((RESULTS / f"{name}.json").read_text())
    stamp = data["stamp"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", stamp["date"]) and stamp["gpu"]
    for package in ("torch", "transformers", "trl", "chunkloss"):
        assert package in stamp["versions"], package
    rows = report.records(name, data)
    assert rows and all(r["error"] or r["time"] > 0 for r in rows)


def test_report_regenerates_the_committed_tables_readme_and_docs(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    for png in results.glob("*.png"):
        png.unlink()
    readme, docs = tmp_path / "README.md", tmp_path / "benchmarks.md"
    shutil.copy(ROOT / "README.md", readme)
    assert report.main(["--results", str(results), "--docs", str(docs), "--readme", str(readme)]) == 0
    assert docs.read_text() == (ROOT / "docs" / "benchmarks.md").read_text()
    assert readme.read_text() == (ROOT / "README.md").read_text()
    for name in SETS:
        assert (results / f"{name}.md").read_text() == (RESULTS / f"{name}.md").read_text(), name
        assert (results / f"{name}.png").stat().st_size > 5_000, name


def _loss(case, impl, ms=None, gib=None, error=None):
    r = {"case": case, "group": "g", "impl": impl, "floor_ms": 1.0}
    return r | ({"error": error} if error else {"ms": ms, "peak_extra_bytes": gib * report.GiB, "loss": 1.0})


def test_ratios_are_against_the_fastest_and_the_smallest_peer_that_ran():
    rows = report.records(
        "losses",
        {
            "stamp": STAMP,
            "rows": [
                _loss("a", "chunkloss", 10.0, 1.0),
                _loss("a", "chunkloss (bf16 accum)", 9.0, 0.5),
                _loss("a", "torch", 8.0, 4.0),
                _loss("a", "liger", 12.0, 2.0),
                _loss("a", "cce", error="OOM"),
                _loss("b", "chunkloss", 5.0, 1.0),
                _loss("b", "torch", error="OOM"),
            ],
        },
    )
    by = {(s["case"], s["impl"]): s for s in report.against_best_peer(rows)}
    a = by[("a", "chunkloss")]
    assert (a["best_time_peer"], a["best_memory_peer"]) == ("torch", "liger")
    assert a["time_ratio"] == pytest.approx(10 / 8) and a["memory_ratio"] == pytest.approx(1 / 2)
    assert by[("a", "chunkloss (bf16 accum)")]["time_ratio"] == pytest.approx(9 / 8)
    assert by[("b", "chunkloss")]["time_ratio"] is None  # no peer ran
    md = report.set_md(
        "losses",
        {"stamp": STAMP, "rows": [_loss("a", "chunkloss", 10.0, 1.0), _loss("a", "torch", 8.0, 4.0)]},
    )
    assert "| a | chunkloss | 1.25 (torch) | 0.25 (torch) |" in md


def _run(impl, batch, time=None, mem=None, oom=False, **setting):
    r = {
        "shape": "tiny",
        "task": "full",
        "loss": "sft",
        "seq": 64,
        "gc": False,
        "impl": impl,
        "batch": batch,
        "oom": oom,
    } | setting
    return r | ({"error": "OOM"} if oom else {"step_time_s": time, "peak_mem_gib": mem})


def test_e2e_rows_compare_each_batch_and_setting_with_the_best_peer():
    sweep = [
        _run("trl", 8, 1.0, 30.0),
        _run("liger", 8, 0.8, 25.0),
        _run("compile", 8, 0.9, 20.0),
        _run("chunkloss", 8, 0.6, 15.0),
        _run("trl", 16, oom=True),
        _run("chunkloss", 16, 1.1, 28.0),
        _run("liger", 8, 2.0, 30.0, gc=True),
        _run("chunkloss", 8, 1.0, 10.0, gc=True),
    ]
    s = {
        (x["case"], x["impl"]): x
        for x in report.against_best_peer(report.records("e2e_full_sft", {"sweep": sweep}))
    }
    off = s[("tiny full sft 64 tok gc off b=8", "chunkloss")]
    on = s[("tiny full sft 64 tok gc on b=8", "chunkloss")]
    assert (off["best_time_peer"], off["best_memory_peer"]) == ("liger", "compile")
    assert off["time_ratio"] == pytest.approx(0.75) and off["memory_ratio"] == pytest.approx(0.75)
    assert on["time_ratio"] == pytest.approx(0.5) and on["memory_ratio"] == pytest.approx(1 / 3)
    assert s[("tiny full sft 64 tok gc off b=16", "chunkloss")]["time_ratio"] is None


def test_multigpu_scale_rows_take_the_fullest_gpu_and_name_kernels_off():
    runs = [
        {
            "model": "m",
            "trainer": "dpo",
            "backend": "zero3",
            "gradient_checkpointing": True,
            "batch": 1,
            "impl": impl,
            "status": "ok",
            "median_step_time_s": t,
            "tokens_per_s": 10 / t,
            "kernels": k,
            "peak_memory_gib": [{"rank": 0, "allocated": m0}, {"rank": 1, "allocated": m1}],
        }
        for impl, t, k, m0, m1 in (
            ("chunked", 0.8, True, 30.0, 31.0),
            ("trl", 1.0, False, 40.0, 39.0),
            ("chunked", 0.9, False, 35.0, 34.0),
        )
    ]
    runs.append({**runs[1], "impl": "liger", "batch": 2, "status": "oom", "peak_memory_gib": None})
    rows = report.records("multigpu_scale", {"runs": runs})
    assert [r["impl"] for r in rows] == ["chunked", "trl", "chunked (no kernels)", "liger"]
    assert [r["memory"] for r in rows[:3]] == [31.0, 40.0, 35.0] and rows[3]["error"] == "oom"
    (with_k, without) = [s for s in report.against_best_peer(rows)]
    assert with_k["time_ratio"] == pytest.approx(0.8) and with_k["memory_ratio"] == pytest.approx(31 / 40)
    assert without["time_ratio"] == pytest.approx(0.9)


def test_merge_groups_runs_by_task_and_loss_and_newer_rows_replace_older(tmp_path):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    a.mkdir(), b.mkdir(), out.mkdir()
    first = {
        "stamp": STAMP,
        "mode": "e2e",
        "sweep": [_run("trl", 8, 1.0, 30.0), _run("chunkloss", 8, 0.7, 20.0)],
    }
    (a / "x.json").write_text(json.dumps(first))
    second = {
        "stamp": STAMP,
        "mode": "e2e",
        "sweep": [_run("chunkloss", 8, 0.6, 19.0), _run("trl", 8, 2.0, 9.0, task="lora")],
    }
    (b / "y.json").write_text(json.dumps(second))
    floor = {"stamp": STAMP, "mode": "floor", "rows": [{"case": "c", "impl": "floor", "ms": 5.0}]}
    (b / "z.json").write_text(json.dumps(floor))
    os.utime(a / "x.json", (1, 1))  # older than b's files
    assert report.merge(out, [a, b]) == ["e2e_full_sft", "e2e_lora_sft", "floor"]
    full = json.loads((out / "e2e_full_sft.json").read_text())["sweep"]
    assert [(r["impl"], r["step_time_s"]) for r in full] == [("trl", 1.0), ("chunkloss", 0.6)]
    assert (out / "e2e_lora_sft.md").exists() and (out / "floor.png").exists()


def test_compiled_chunkloss_is_a_row_of_its_own(tmp_path):
    """chunkloss under ``torch_compile`` (``bench_e2e --compile-ours``) and eager: two rows, both kept by a
    merge, the compiled one's first step (its compilation) shown."""
    compiled = {**_run("chunkloss", 8, 0.7, 20.0), "compiled": True, "first_step_s": 28.0}
    data = {"stamp": STAMP, "mode": "e2e", "sweep": [_run("chunkloss", 8, 0.7, 20.0), compiled]}
    (tmp_path / "x.json").write_text(json.dumps(data))
    report.merge(tmp_path / "out", [tmp_path])
    table = (tmp_path / "out" / "e2e_full_sft.md").read_text()
    assert "| chunkloss | 0.700 |" in table and "| chunkloss + torch_compile | 0.700 |" in table, table
    assert "28.000" in table, table


def test_benchmarks_import_no_private_chunkloss_names():
    private = re.compile(r"(chunkloss[\w.]*\._\w+|from chunkloss[\w.]* import [^\n]*\b_\w+)")
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        assert not private.search(path.read_text()), path.name


MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", MODULES)
def test_every_benchmark_module_imports_against_the_public_api(module):
    importlib.import_module(f"benchmarks.{module}")


@pytest.mark.parametrize(
    "module", ["cases_ce", "cases_grpo", "cases_jsd", "cases_kto", "cases_preference", "cases_rloo"]
)
def test_every_loss_case_offers_chunkloss_and_plain_torch(module):
    cases = importlib.import_module(f"benchmarks.{module}").cases()
    assert cases
    for case in cases:
        assert {"chunkloss", "torch"} <= set(case.impls), case.name
        assert case.floor_ms > 0
