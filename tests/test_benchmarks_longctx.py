"""bench_longctx on CPU with the tiny shape: each implementation's lengths in its own process, the slope of
the GPU peaks, and the report's rendering of the set."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")

from benchmarks import bench_longctx, report  # noqa: E402


def test_summary_is_the_least_squares_growth_per_1k_tokens():
    rows = [
        {"impl": "a", "tokens": 32768, "peak_mem_gib": 5.0, "step_time_s": 1.0},
        {"impl": "a", "tokens": 65536, "peak_mem_gib": 8.0, "step_time_s": 2.0},
        {"impl": "a", "tokens": 131072, "peak_mem_gib": 14.0, "step_time_s": 5.0},
        {"impl": "a", "tokens": 262144, "oom": True},
        {"impl": "b", "tokens": 32768, "peak_mem_gib": 1.0, "step_time_s": 1.0},
    ]
    summary = report.longctx_summary(rows)
    assert summary["a"]["gib_per_1k_tokens"] == pytest.approx(9.0 / 98.304)
    assert summary["a"]["longest_tokens"] == 131072
    assert summary["b"] == {"gib_per_1k_tokens": None, "longest_tokens": 32768}


@pytest.mark.slow
def test_cpu_run_and_report(tmp_path):
    out = tmp_path / "longctx_tiny.json"
    argv = [
        "--shape",
        "tiny",
        "--task",
        "lora",
        "--seqs",
        "32,64",
        "--impl",
        "chunkloss,trl",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    assert bench_longctx.main(argv) == 0
    data = json.loads(out.read_text())
    assert [(r["impl"], r["tokens"]) for r in data["rows"]] == [
        ("chunkloss", 32),
        ("chunkloss", 64),
        ("trl", 32),
        ("trl", 64),
    ]
    assert all(r["step_time_s"] > 0 and r["host_peak_gib"] > 0 and not r["oom"] for r in data["rows"])
    assert data["summary"]["chunkloss"]["longest_tokens"] == 64
    md = report.set_md("longctx_tiny", data)
    assert "tiny lora sft 64 tok" in md
    assert "GPU GiB per 1k tokens" in md
