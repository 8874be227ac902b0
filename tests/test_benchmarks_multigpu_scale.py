"""benchmarks/multigpu_scale.py on CPU with the tiny model: a sweep in one process that ends in an
out-of-memory batch, one that ends at its time budget, two gloo processes under torchrun, the driver's
``--remaining`` rule, and the ``--summary`` result set gathered from those runs."""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

from benchmarks import multigpu_scale, render  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--seq-len", "16", "--steps", "2", "--warmup", "1"]
RUN_KEYS = {
    "trainer", "backend", "impl", "model", "seq_len", "world", "gradient_checkpointing", "batch", "oom",
    "step_times_s", "median_step_time_s", "tokens_per_step", "tokens_per_s", "tokens_per_s_per_gpu",
    "peak_memory_gib", "stamp", "head_memory",
}  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)


def _oom_from(batch: int, monkeypatch) -> None:
    """``make_trainer`` raises the CUDA out-of-memory error from per-GPU ``batch`` on."""
    real = multigpu_scale.make_trainer

    def make_trainer(kind, impl, model, tokenizer, ds, out, b, a):
        if b >= batch:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(kind, impl, model, tokenizer, ds, out, b, a)

    monkeypatch.setattr(multigpu_scale, "make_trainer", make_trainer)


def test_sweeps_and_summary(tmp_path, monkeypatch):
    ours, trl = tmp_path / "sft_none_chunked", tmp_path / "sft_none_trl"
    _oom_from(4, monkeypatch)
    assert multigpu_scale.main(["--trainer", "sft", "--impl", "chunked", "--batch-sizes", "1,2,4,8", *TINY,
                                "--out", str(ours)]) == 0  # fmt: skip
    # A budget already spent (it counts from the process start): the batch after the first is skipped.
    assert multigpu_scale.main(["--trainer", "sft", "--impl", "trl", "--batch-sizes", "1,2", *TINY,
                                "--time-budget-s", "0.001", "--out", str(trl)]) == 0  # fmt: skip

    r = json.loads((ours / "batch_2.json").read_text())
    assert RUN_KEYS <= set(r) and r["oom"] is False
    assert (r["impl"], r["backend"], r["world"], r["batch"]) == ("chunked", "none", 1, 2)
    assert len(r["step_times_s"]) == 2 and r["median_step_time_s"] > 0
    assert r["tokens_per_step"] == 2 * 16  # two rows truncated to --seq-len
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["median_step_time_s"])
    assert r["peak_memory_gib"] is None  # no CUDA
    head = r["head_memory"]
    assert head["fp32_accumulator_bytes"] == 4096 * 64 * 4 and head["gathered_weight_bytes"] == 4096 * 64 * 2
    oom = json.loads((ours / "batch_4.oom.rank0.json").read_text())
    assert oom["oom"] is True and "out of memory" in oom["error"]
    assert not (ours / "batch_8.started").exists()  # the sweep stopped at the OOM
    assert multigpu_scale.remaining(ours, [1, 2, 4, 8]) == []
    assert "time budget" in json.loads((trl / "batch_2.skipped.json").read_text())["skipped"]

    data = multigpu_scale.summary(tmp_path)
    assert {"stamp", "head_memory", "runs", "notes"} <= set(data) and data["notes"] == []
    assert set(data["head_memory"]) == {"tiny"}
    statuses = [(r["impl"], r["batch"], r["status"]) for r in data["runs"]]
    assert statuses == [("chunked", 1, "ok"), ("chunked", 2, "ok"), ("chunked", 4, "oom"), ("trl", 1, "ok"),
                        ("trl", 2, "skipped")]  # fmt: skip
    (s,) = render.scale_summary(data)
    assert s["largest"] == {"chunked": 2, "trl": 1} and s["stop"] == {"chunked": "OOM at 4",
                                                                       "trl": "time budget at 2"}  # fmt: skip
    assert set(s["time_ratios"]) == {1} and s["memory_ratios"] == {}
    md = (tmp_path / "multigpu_scale.md").read_text()
    assert "| sft | none | 2 (OOM at 4) | 1 (time budget at 2) |" in md
    assert "| tiny | 4096 × 64 (tied) |" in md
    assert "## tiny, 16-token sequences, 1 GPU, gradient checkpointing on" in md
    step = r"\d+\.\d{3}"  # a step time
    cells = ((1, "chunked", step), (2, "chunked", step), (4, "chunked", "OOM"), (1, "trl", step),
             (2, "trl", re.escape("skipped (time budget)")))  # fmt: skip
    for batch, impl, cell in cells:
        row = rf"\| sft \| none \| {re.escape(render.SCALE_IMPLS[impl])} \| {batch} \| {cell} \|"
        assert re.search(row, md), row
    assert (tmp_path / "multigpu_scale.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "multigpu_scale.json").read_text())["runs"] == data["runs"]


@pytest.mark.parametrize("impl", multigpu_scale.IMPLS)
def test_a_batch_frees_its_model_before_it_returns(tmp_path, impl, monkeypatch):
    """The model a batch built is gone once ``run_batch`` returns, with the interpreter's automatic collection
    off (``run_batch`` frees it itself): the next batch of the process does not start with it allocated."""
    built, alive = [], []
    real_build, real_run = multigpu_scale.build_model, multigpu_scale.run_batch

    def build_model(*args, **kwargs):
        model = real_build(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    def run_batch(*args, **kwargs):
        gc.disable()
        try:
            r = real_run(*args, **kwargs)
            alive.append(built[-1]() is not None)
        finally:
            gc.enable()
        return r

    monkeypatch.setattr(multigpu_scale, "build_model", build_model)
    monkeypatch.setattr(multigpu_scale, "run_batch", run_batch)
    assert multigpu_scale.main(["--trainer", "sft", "--impl", impl, "--batch-sizes", "1", *TINY,
                                "--out", str(tmp_path / impl)]) == 0  # fmt: skip
    assert alive == [False]


def test_remaining_relaunches_after_progress_and_notes_a_failed_batch(tmp_path):
    run = tmp_path / "dpo_fsdp2_chunked"
    run.mkdir()
    setting = {"trainer": "dpo", "backend": "fsdp2", "impl": "chunked", "model": "tiny", "seq_len": 16,
               "world": 2, "gradient_checkpointing": True, "batch_sizes": [1, 2, 4]}  # fmt: skip
    (run / "setting.json").write_text(json.dumps(setting))
    ok = {k: v for k, v in setting.items() if k != "batch_sizes"} | {"batch": 1, "oom": False, "steps": 2,
          "warmup": 1, "median_step_time_s": 0.5, "tokens_per_s": 64.0, "peak_memory_gib": None}  # fmt: skip
    (run / "batch_1.json").write_text(json.dumps(ok))
    (run / "batch_1.started").write_text("0\n")
    (run / "batch_2.started").write_text("0\n")
    (tmp_path / "dpo_fsdp2_chunked.error").write_text("exit 1; exceptions:\nRuntimeError: NCCL error\n")
    (tmp_path / "zero3.error").write_text(
        "DeepSpeed does not import on this host:\nImportError: no deepspeed\n"
    )
    assert multigpu_scale.remaining(run, [1, 2, 4]) == [2, 4]  # progress: launch again from batch 2
    assert multigpu_scale.remaining(run, [2, 4]) == []  # no progress: its first batch failed
    runs, notes = multigpu_scale.collect(tmp_path)
    assert [(r["batch"], r["status"]) for r in runs] == [(1, "ok"), (2, "failed")]
    assert runs[1]["reason"] == "RuntimeError: NCCL error"
    assert notes == ["dpo_fsdp2_chunked, batch 2: RuntimeError: NCCL error",
                     "zero3: ImportError: no deepspeed"]  # fmt: skip


@pytest.mark.slow  # two processes importing torch, transformers and TRL: about 14 s on two CPU cores
def test_two_gloo_processes_gather_tokens_over_ranks(tmp_path):
    """GRPO with its fixed completions under torchrun: two CPU processes (gloo), per-GPU batch 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "grpo"
    env = {
        **os.environ,
        "TQDM_DISABLE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
    }
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
    ]
    script = ["-m", "benchmarks.multigpu_scale", "--trainer", "grpo", "--impl", "trl", "--batch-sizes", "1"]
    cmd = [*launch, *script, *TINY, "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=120, capture_output=True)
    r = json.loads((out / "batch_1.json").read_text())
    assert r["world"] == 2 and "MULTI_CPU" in r["distributed_type"]
    # Each rank trains one prompt and its 16-token sequence (the prompt, then a completion filling the rest).
    assert 2 * 12 <= r["tokens_per_step"] <= 2 * 16
    assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)


def _set() -> dict:
    setting = {"trainer": "dpo", "backend": "zero3", "model": "qwen3-4b", "seq_len": 2048, "world": 2,
               "gradient_checkpointing": True, "steps": 6, "warmup": 2}  # fmt: skip

    def run(impl, batch, status="ok", time=None, peaks=()):
        r = {**setting, "impl": impl, "batch": batch, "status": status}
        if status == "ok":
            mem = [{"rank": k, "allocated": m, "reserved": m} for k, m in enumerate(peaks)]
            r |= {
                "median_step_time_s": time,
                "tokens_per_s": 2 * batch * 2 * 2048 / time,
                "peak_memory_gib": mem,
            }
        return r

    runs = [run("chunked", 1, time=0.8, peaks=(30.0, 31.0)), run("trl", 1, time=1.0, peaks=(40.0, 39.0)),
            run("chunked", 2, time=1.5, peaks=(35.0, 35.5)), run("trl", 2, status="oom")]  # fmt: skip
    stamp = {"gpu": "2 x GPU", "date": "2026-01-01", "versions": {}}
    head = {"qwen3-4b": multigpu_scale.head_memory("qwen3-4b")}
    return {"stamp": stamp, "num_generations": 2, "head_memory": head, "runs": runs, "notes": []}


def test_report_gives_the_scale_set_its_section_only_when_there(tmp_path):
    from benchmarks import report

    assert render.kind("multigpu_scale") == "multigpu_scale"
    data = _set()
    (s,) = render.scale_summary(data)
    assert s["largest"] == {"chunked": 2, "trl": 1} and s["stop"]["trl"] == "OOM at 2"
    assert s["time_ratios"] == pytest.approx({1: 0.8}) and s["memory_ratios"] == pytest.approx({1: 31 / 40})
    render.write_set(tmp_path, "multigpu_scale", data)
    md = (tmp_path / "multigpu_scale.md").read_text()
    ours = render.SCALE_IMPLS["chunked"]
    assert f"| dpo | zero3 | {ours} | 1 | 0.800 | 10240 | 31.00 (30.00 / 31.00) | 0.80 | 0.78 |" in md
    assert "| qwen3-4b | 151936 × 2560 (tied) | 0.724 | 1.449 | 0.724 | up to 4992 |" in md
    sets = {name: d for name, d in report.load_sets().items() if name != "multigpu_scale"}
    assert "## Multi-GPU scale" not in report.docs_page(sets)
    sets["multigpu_scale"] = data
    docs = report.docs_page(sets)
    assert "| dpo | zero3 | 2 (last batch tried) | 1 (OOM at 2) |" in docs[docs.index("## Multi-GPU scale") :]
