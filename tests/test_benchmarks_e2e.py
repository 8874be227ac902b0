"""The end-to-end benchmark's summary against TRL (memory growth per batch unit, largest batch, time ratios,
loss-curve distance), its gradient-checkpointing result sets and the length of its sequences."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from benchmarks import bench_e2e, render, report  # noqa: E402
from chunkloss.data import tiny_tokenizer  # noqa: E402


def _run(impl, batch, mem=None, time=None, oom=False):
    r = {"task": "sft", "impl": impl, "batch": batch, "steps": 4, "oom": oom}
    if not oom:
        r |= {
            "step_time_s": time,
            "peak_mem_gib": mem,
            "seq_tokens": 1024,
            "rows": batch,
            "mean_tokens": 1024.0,
        }
    return r


def _set(gradient_checkpointing: bool | None = False) -> dict:
    sweep = [
        _run("trl", 2, 10.0, 1.0), _run("chunkloss", 2, 10.0, 0.7),
        _run("trl", 4, 14.0, 2.0), _run("chunkloss", 4, 11.0, 1.2),
        _run("trl", 8, oom=True), _run("chunkloss", 8, 12.0, 2.2),
    ]  # fmt: skip
    curves = [
        {"task": "sft", "impl": impl, "batch": 2, "steps": 3, "losses": losses}
        for impl, losses in (("trl", [2.0, 1.5, 1.0]), ("chunkloss", [2.0, 1.52, 0.99]))
    ]
    args = {} if gradient_checkpointing is None else {"gradient_checkpointing": gradient_checkpointing}
    return {"stamp": {"gpu": "cpu", "date": "2026-01-01", "versions": {}}, "task": "sft", "model": "tiny.",
            "args": args, "sweep": sweep, "curves": curves, "skipped": []}  # fmt: skip


def test_summary_slopes_largest_batches_and_ratios_against_trl():
    trl, ours = render.e2e_summary(_set())
    # Least squares over the batches that ran: (2, 10), (4, 14) -> 2 GiB per sequence; (2, 10), (4, 11),
    # (8, 12) -> 6 / (56 / 3) = 9 / 28 (the mean batch is 14 / 3).
    assert trl["growth"] == pytest.approx(2.0) and ours["growth"] == pytest.approx(9 / 28)
    assert ours["growth_ratio"] == pytest.approx(9 / 56) and trl["growth_ratio"] is None
    assert (trl["largest"], trl["oom_at"], ours["largest"], ours["oom_at"]) == (4, 8, 8, None)
    # Ours never ran out of memory: its largest batch, and so the ratio, is a lower bound.
    assert ours["largest_ratio"] == pytest.approx(2.0) and ours["largest_bound"] == ">="
    assert ours["time_ratios"] == pytest.approx({2: 0.7, 4: 0.6}) and ours[
        "worst_time_ratio"
    ] == pytest.approx(0.7)
    assert ours["curve_diff"] == pytest.approx(0.02)


def test_summary_table_and_checkpointing_in_the_title():
    md = render.e2e_md(_set(gradient_checkpointing=True))
    assert md.startswith("# End to end: SFT, chunkloss trainer vs TRL's (gradient checkpointing on)\n")
    assert "Sequences of 1024 tokens (1024 not padding on average)" in md
    assert "| chunkloss | 0.321 | 0.16 | 8 (no OOM) | ≥ 2.00 | 2: 0.70, 4: 0.60 | 0.70 | 0.0200 |" in md
    assert "| trl | 2.000 | – | 4 (OOM at 8) | – | – | – | – |" in md
    assert "(gradient checkpointing off)" in render.e2e_md(_set(gradient_checkpointing=False))


def test_sets_without_the_new_records_render_as_before():
    data = _set(gradient_checkpointing=None)
    for r in data["sweep"]:
        for key in ("seq_tokens", "rows", "mean_tokens"):
            r.pop(key, None)
    md = render.e2e_md(data)
    assert "gradient checkpointing" not in md and "Sequences of" not in md
    assert md.startswith("# End to end: SFT, chunkloss trainer vs TRL's\n")


def test_checkpointing_sets_are_written_and_documented_beside_the_others(tmp_path):
    data = _set(gradient_checkpointing=True)
    results = {
        "models": {"sft": "tiny."},
        **{k: data[k] for k in ("stamp", "args", "sweep", "curves", "skipped")},
    }
    bench_e2e.write_outputs(results, str(tmp_path), plot=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e2e_sft_gc.json", "e2e_sft_gc.md"]
    section = "\n".join(report.e2e_section({"e2e_sft": _set(False), "e2e_sft_gc": _set(True)}))
    assert section.index("### SFT (gradient checkpointing off)") < section.index(
        "### SFT (gradient checkpointing on)"
    )
    assert "![e2e sft gc](../benchmarks/results/e2e_sft_gc.png)" in section
    assert section.count("| impl | memory growth (GiB / batch unit) |") == 2


@pytest.mark.parametrize("seq_len", [48, 1024])
def test_default_words_fill_every_sequence_past_seq_len(seq_len):
    """Each word is at least one token, so completions of seq_len words are truncated to seq_len tokens."""
    tok = tiny_tokenizer()
    for task, completion in (("sft", "completion"), ("dpo", "chosen"), ("dpo", "rejected")):
        ds = bench_e2e.counting_dataset(task, 20, seq_len)
        assert all(len(tok(r["prompt"] + r[completion])["input_ids"]) > seq_len for r in ds)
