"""benchmarks/multigpu_scale.py on CPU with the tiny model: a sweep in one process that ends in an
out-of-memory batch, one that ends at its time budget, two gloo processes under torchrun, the driver's
``--remaining`` rule, and the ``--summary`` result set gathered from those runs."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

from benchmarks import multigpu_scale, report  # noqa: E402
from tests.child_process import in_child_process

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--seq-len", "16", "--steps", "2", "--warmup", "1"]
RUN_KEYS = {
    "trainer",
    "backend",
    "impl",
    "model",
    "seq_len",
    "world",
    "gradient_checkpointing",
    "batch",
    "oom",
    "step_times_s",
    "median_step_time_s",
    "tokens_per_step",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "peak_memory_gib",
    "stamp",
    "head_memory",
}


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)


def _oom_from(batch: int, monkeypatch) -> None:
    """``make_trainer`` raises the CUDA out-of-memory error from per-GPU ``batch`` on."""
    real = multigpu_scale.make_trainer

    def make_trainer(*args, **kw):
        if kw["batch"] >= batch:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kw)

    monkeypatch.setattr(multigpu_scale, "make_trainer", make_trainer)


@in_child_process
def test_sweeps_and_summary(tmp_path, monkeypatch):
    ours, trl = tmp_path / "sft_none_chunked", tmp_path / "sft_none_trl"
    _oom_from(4, monkeypatch)
    assert (
        multigpu_scale.main(
            ["--trainer", "sft", "--impl", "chunked", "--batch-sizes", "1,2,4,8", *TINY, "--out", str(ours)]
        )
        == 0
    )
    # A budget already spent (it counts from the process start): the batch after the first is skipped.
    assert (
        multigpu_scale.main(
            [
                "--trainer",
                "sft",
                "--impl",
                "trl",
                "--batch-sizes",
                "1,2",
                *TINY,
                "--time-budget-s",
                "0.001",
                "--out",
                str(trl),
            ]
        )
        == 0
    )
    # A profiled run: its own set, not a row of the scale.
    profiled = tmp_path / "sft_none_chunked_profile"
    assert (
        multigpu_scale.main(
            [
                "--trainer",
                "sft",
                "--impl",
                "chunked",
                "--batch-sizes",
                "1",
                *TINY,
                "--profile",
                "--out",
                str(profiled),
            ]
        )
        == 0
    )

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
    assert statuses == [
        ("chunked", 1, "ok"),
        ("chunked", 2, "ok"),
        ("chunked", 4, "oom"),
        ("trl", 1, "ok"),
        ("trl", 2, "skipped"),
    ]
    rows = report.records("multigpu_scale", data)
    assert [(r["impl"], r["error"]) for r in rows] == [
        ("chunked", None),
        ("chunked", None),
        ("chunked", "oom"),
        ("trl", None),
        ("trl", "skipped"),
    ]
    assert rows[0]["time"] == data["runs"][0]["median_step_time_s"]
    assert (tmp_path / "multigpu_scale.png").stat().st_size > 5_000
    assert json.loads((tmp_path / "multigpu_scale.json").read_text())["runs"] == data["runs"]
    profile = json.loads((tmp_path / f"{multigpu_scale.PROFILE}.json").read_text())
    [row] = report.records(multigpu_scale.PROFILE, profile)
    assert row["case"] == "tiny sft none x1 16 tok gc on b=1" and row["impl"] == "chunked"
    assert {"gemm", "comm", "comm_exposed", "idle"} <= set(row) and row["time"] > 0


@pytest.mark.parametrize("impl", ["chunked", "trl"])  # liger: Triton kernels, GPU only
@in_child_process
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
    assert (
        multigpu_scale.main(
            ["--trainer", "sft", "--impl", impl, "--batch-sizes", "1", *TINY, "--out", str(tmp_path / impl)]
        )
        == 0
    )
    assert alive == [False]


def test_remaining_relaunches_after_progress_and_notes_a_failed_batch(tmp_path):
    run = tmp_path / "dpo_fsdp2_chunked"
    run.mkdir()
    setting = {
        "trainer": "dpo",
        "backend": "fsdp2",
        "impl": "chunked",
        "model": "tiny",
        "seq_len": 16,
        "world": 2,
        "gradient_checkpointing": True,
        "batch_sizes": [1, 2, 4],
    }
    (run / "setting.json").write_text(json.dumps(setting))
    ok = {k: v for k, v in setting.items() if k != "batch_sizes"} | {
        "batch": 1,
        "oom": False,
        "steps": 2,
        "warmup": 1,
        "median_step_time_s": 0.5,
        "tokens_per_s": 64.0,
        "peak_memory_gib": None,
    }
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
    assert notes == [
        "dpo_fsdp2_chunked, batch 2: RuntimeError: NCCL error",
        "zero3: ImportError: no deepspeed",
    ]


@pytest.mark.slow  # two processes importing torch, transformers and TRL: about 14 s on two CPU cores
@in_child_process
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
