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
    kinds = {render.kind(s) for s in SETS}
    assert {"losses", "kernels", "decoder", "medusa", "e2e", "multigpu"} <= kinds <= set(render.RENDERERS)


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
    medusa = (RESULTS / "medusa.md").read_text()
    assert render.MEMORY_LABEL in medusa and render.MEMORY_MEANING in medusa


def test_decoder_memory_is_named_apart_from_peak_extra_memory():
    decoder = (RESULTS / "decoder.md").read_text()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    section = docs[docs.index("## Gated MLP block") : docs.index("## Multi-token (Medusa) heads")]
    for text in (decoder, section):
        for name in (render.SAVED_LABEL, render.SAVED_MEANING, render.CALL_PEAK_LABEL):
            assert name in text
        assert render.CALL_PEAK_MEANING in text
    assert render.MEMORY_LABEL not in decoder
    data = json.loads((RESULTS / "decoder.json").read_text())
    assert all("peak_extra_bytes" not in r for r in data["rows"])


def test_committed_decoder_and_medusa_sets_cover_every_case_and_implementation():
    decoder = json.loads((RESULTS / "decoder.json").read_text())
    assert {(r["N"], r["H"], r["I"]) for r in decoder["rows"]} == {(8192, 4096, 14336), (16384, 2048, 8192)}
    for case in {r["case"] for r in decoder["rows"]}:
        assert {r["impl"] for r in decoder["rows"] if r["case"] == case} == set(render.DECODER_IMPLS), case
    medusa = json.loads((RESULTS / "medusa.json").read_text())
    cases = [(k, f) for k in (3, 5) for f in ("shared", "per_head")]
    assert list(dict.fromkeys((r["heads"], r["form"]) for r in medusa["rows"] if r["heads"] > 1)) == cases
    assert [r["impl"] for r in medusa["rows"]].count("chunkloss_single_head") == 1
    summary = render.medusa_summary(medusa["rows"])
    assert [s["case"] for s in summary if s["impl"] == "chunkloss"] == [f"K={k} {f} N=8192" for k, f in cases]
    for s in summary:
        assert all(v is not None for v in s.values()), s


def _medusa_rows() -> list[dict]:
    def row(case, heads, impl, ms, peak):
        return {"case": case, "heads": heads, "form": "shared", "impl": impl, "floor_ms": 1.0, "ms": ms,
                "peak_extra_bytes": peak, "loss": 1.0}  # fmt: skip

    return [
        row("one", 1, "chunkloss_single_head", 10.0, 2 * 2**30),
        row("K=3", 3, "chunkloss", 33.0, 2 * 2**30),
        row("K=3", 3, "torch", 66.0, 8 * 2**30),
        {"case": "K=3", "heads": 3, "form": "shared", "impl": "liger", "floor_ms": 1.0, "error": "OOM"},
    ]


def test_medusa_summary_divides_by_k_single_heads_and_skips_failed_peers():
    (s,) = render.medusa_summary(_medusa_rows())
    assert s["k_single"] == pytest.approx(33.0 / 30.0)
    assert s["speedup_torch"] == pytest.approx(2.0) and s["memory_torch"] == pytest.approx(0.25)
    assert s["speedup_liger"] is None and s["memory_liger"] is None


def test_medusa_summary_has_a_row_per_chunkloss_variant_measured():
    rows = _medusa_rows()
    rows.insert(2, {**rows[1], "impl": "chunkloss_bf16_accum", "ms": 36.0, "peak_extra_bytes": 2**29})
    rows.insert(3, {**rows[1], "impl": "chunkloss_bf16_accum_liger_chunks", "ms": 44.0, "chunk_size": 256,
                    "peak_extra_bytes": 2**26})  # fmt: skip
    summary = render.medusa_summary(rows)
    assert [s["impl"] for s in summary] == list(render.MEDUSA_OURS)
    assert summary[1]["memory_torch"] == pytest.approx(1 / 16) and summary[2]["speedup_torch"] == 1.5
    data = {"rows": rows}
    assert "chunk_size = 256 rows" in render.medusa_chunk_note(data)
    assert any(line.startswith("| K=3 | chunkloss, bf16 accum, Liger's chunk size | 1.47 | 1.50 |")
               for line in render.medusa_summary_table(data))  # fmt: skip


def test_decoder_and_medusa_render_failed_and_unmeasured_rows(tmp_path):
    stamp = {"gpu": "cpu", "date": "2026-01-01", "versions": {}}
    medusa = {"stamp": stamp, "size": {"batch": 2, "seq": 3, "hidden": 4, "vocab": 5, "dtype": "float32"},
              "peak_tflops": 800.0, "rows": _medusa_rows()}  # fmt: skip
    medusa["rows"][2]["peak_extra_bytes"] = None  # a CPU run records no memory
    ok = {"N": 8, "H": 4, "I": 16, "case": "N=8", "floor_ms": 1.0, "ms": 2.0, "saved_bytes": 2**20,
          "peak_bytes": None, "err": dict.fromkeys(("y", "x", "w_gate", "w_up", "w_down"), 1e-3)}  # fmt: skip
    failed = {"N": 8, "H": 4, "I": 16, "case": "N=8", "floor_ms": 1.0, "impl": "liger", "error": "OOM"}
    decoder = {"stamp": stamp, "warmup": 1, "repeats": 2, "peak_tflops": 800.0,
               "rows": [{**ok, "impl": "eager"}, {**ok, "impl": "ours"}, failed]}  # fmt: skip
    render.write_set(tmp_path, "medusa", medusa)
    render.write_set(tmp_path, "decoder", decoder)
    md = (tmp_path / "medusa.md").read_text()
    assert "| K=3 | Liger (once per head) | OOM |" in md
    assert "| K=3 | torch (materialised logits) | 66.00 | 66.00 | n/a |" in md
    md = (tmp_path / "decoder.md").read_text()
    assert "| 8, 4, 16 | cuBLAS + Liger SwiGLU | OOM |" in md
    ours = render.DECODER_IMPLS["ours"]
    assert f"| 8, 4, 16 | {ours} | 2.000 | 2.00 | 1 | 1.00 | n/a |" in md
    assert (tmp_path / "decoder.png").stat().st_size > 0 and (tmp_path / "medusa.png").stat().st_size > 0


def _attn_in_set() -> dict:
    ok = {"case": "tiny B=2 T=4", "model": "tiny", "B": 2, "T": 4, "N": 8, "H": 16, "heads": 4, "kv_heads": 2,
          "head_dim": 4, "floor_ms": 1.0, "ms": 2.0, "saved_bytes": 2**21, "peak_bytes": None,
          "err": dict.fromkeys(("q", "k", "v", "x", "norm_w", "w_q", "w_k", "w_v"), 1e-3)}  # fmt: skip
    failed = {k: v for k, v in ok.items() if k not in ("ms", "saved_bytes", "peak_bytes", "err")}
    rows = [{**ok, "impl": "norm_recompute", "saved_bytes": 2**20}, {**ok, "impl": "eager"},
            {**failed, "impl": "liger", "error": "OOM"}]  # fmt: skip
    return {"stamp": {"gpu": "cpu", "date": "2026-01-01", "versions": {}}, "warmup": 1, "repeats": 2,
            "peak_tflops": 800.0, "rows": rows}  # fmt: skip


def test_decoder_attn_set_renders_its_own_table_plot_and_docs_section(tmp_path):
    assert render.kind("decoder_attn") == "decoder_attn"
    data = _attn_in_set()
    render.write_set(tmp_path, "decoder_attn", data)
    md = (tmp_path / "decoder_attn.md").read_text()
    eager = "| tiny | 2×4, 16, 4/2 × 4 | eager PyTorch | 2.000 | 2.00 | 2 | 1.00 | n/a |"
    recomputed = ("| tiny | 2×4, 16, 4/2 × 4 | chunkloss RMSNorm + cuBLAS + chunkloss RoPE, norm recomputed "
                  "| 2.000 | 2.00 | 1 | 0.50 | n/a | 1.0e-03 | 1.0e-03 | 1.0e-03 |")  # fmt: skip
    assert md.index(eager) < md.index(recomputed)  # implementations in render's order, eager first
    assert "| tiny | 2×4, 16, 4/2 × 4 | Liger RMSNorm + cuBLAS + Liger RoPE | OOM |" in md
    assert render.ATTN_SAVED_MEANING in md and render.ATTN_CALL_PEAK_MEANING in md
    assert (tmp_path / "decoder_attn.png").stat().st_size > 10_000
    sets = {name: d for name, d in report.load_sets().items() if name != "decoder_attn"}
    assert "## Attention input block" not in report.docs_page(sets)
    sets["decoder_attn"] = data
    docs = report.docs_page(sets)
    section = docs[docs.index("## Attention input block") : docs.index("## Multi-token (Medusa) heads")]
    assert recomputed in section and render.ATTN_SAVED_MEANING in section
    assert docs.index("## Gated MLP block") < docs.index("## Attention input block")


def test_committed_decoder_attn_set_covers_both_shapes_and_the_peers():
    """Both widths, each with the same implementations: the peers, our unfused path and its norm recompute
    at least, and none the renderer cannot name."""
    data = json.loads((RESULTS / "decoder_attn.json").read_text())
    assert {r["model"] for r in data["rows"]} == {"Llama-3-8B", "Llama-3.2-1B"}
    cases = {r["case"] for r in data["rows"]}
    impls = [{r["impl"] for r in data["rows"] if r["case"] == case} for case in cases]
    assert all(i == impls[0] for i in impls)
    assert {"eager", "compile", "liger", "unfused", "norm_recompute"} <= impls[0] <= set(render.ATTN_IN_IMPLS)


def _medusa_e2e_set() -> dict:
    def run(stage, batch, impl, step=None, mem=None, loss=10.0):
        r = {"stage": stage, "heads": 3, "batch": batch, "impl": impl, "steps": 5, "oom": step is None}
        if step is not None:
            r |= {"step_time_s": step, "tokens_per_s": batch * 1024 / step, "peak_mem_gib": mem,
                  "first_loss": loss}  # fmt: skip
        return r

    runs = [
        run(1, 1, "hf", 0.10, 20.0), run(1, 1, "chunkloss", 0.08, 10.0, 10.001),
        run(1, 2, "hf", 0.20, 40.0), run(1, 2, "chunkloss", 0.14, 12.0, 10.002),
        run(1, 4, "hf"), run(1, 4, "chunkloss", 0.28, 16.0),
        run(2, 1, "hf", 0.30, 30.0), run(2, 1, "chunkloss", 0.25, 25.0),
    ]  # fmt: skip
    return {"stamp": {"gpu": "cpu", "date": "2026-01-01", "versions": {}}, "model": "tiny",
            "dtype": "bfloat16", "seq": 1024, "warmup": 2, "steps": 5, "decay": 0.8, "base_weight": 1.0,
            "time_budget_s": 400.0, "device_memory_gib": 80.0, "runs": runs,
            "skipped": [{"stage": 2, "heads": 3, "batch": 2, "reason": "time budget"}]}  # fmt: skip


def test_medusa_e2e_summary_gives_the_largest_batches_and_ratios_at_common_batches():
    one, two = render.medusa_e2e_summary(_medusa_e2e_set())
    assert (one["stage"], two["stage"]) == (1, 2)
    assert one["largest"] == {"hf": 2, "chunkloss": 4}
    assert one["stop"] == {"hf": "OOM at 4", "chunkloss": "last batch tried"}
    assert two["stop"] == {"hf": "time budget", "chunkloss": "time budget"}
    assert one["time_ratios"] == pytest.approx({1: 0.8, 2: 0.7})
    assert one["memory_ratios"] == pytest.approx({1: 0.5, 2: 0.3})
    assert one["loss_diff"] == pytest.approx(2e-4)
    assert one["tokens"]["chunkloss"] == pytest.approx(4 * 1024 / 0.28)


def test_medusa_e2e_set_renders_through_its_own_name(tmp_path):
    assert render.kind("medusa_e2e") == "medusa_e2e"
    assert [render.kind(n) for n in ("medusa", "losses_ce", "e2e_dpo")] == ["medusa", "losses", "e2e"]
    render.write_set(tmp_path, "medusa_e2e", _medusa_e2e_set())
    md = (tmp_path / "medusa_e2e.md").read_text()
    assert "| 1 | 3 | 2 (OOM at 4) | 4 (last batch tried) | 10240 / 14629 | 0.70–0.80 (batches 1–2) " in md
    assert "| 4 | hf (materialised logits) | OOM |" in md
    assert "| 2 | chunkloss (ChunkedMedusaTrainer) | 0.140 | 14629 | 12.00 | 0.70 | 0.30 | 10.0020 |" in md
    assert md.count("## Stage") == 2
    assert (tmp_path / "medusa_e2e.png").stat().st_size > 10_000


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
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        assert not private.search(path.read_text()), path.name


def _modules() -> list[str]:
    """Every module under benchmarks/, dotted (``render.common``); a package by its own name."""
    out = []
    for path in (ROOT / "benchmarks").rglob("*.py"):
        parts = path.relative_to(ROOT / "benchmarks").with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out.append(".".join(parts))
    return sorted(out)


@pytest.mark.parametrize("module", _modules())
def test_every_benchmark_module_imports_against_the_public_api(module):
    importlib.import_module(f"benchmarks.{module}")


@pytest.mark.parametrize("module", ["cases_ce", "cases_grpo", "cases_jsd", "cases_preference"])
def test_every_loss_case_offers_chunkloss_and_plain_torch(module):
    cases = importlib.import_module(f"benchmarks.{module}").cases()
    assert cases
    for case in cases:
        assert {"chunkloss", "torch"} <= set(case.impls), case.name
        assert case.floor_ms > 0
