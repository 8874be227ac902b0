"""bench_e2e on CPU with the tiny shape: each implementation's sweep in its own process, the floor's list of
matrix products, and the profile's split of kernel time."""

from __future__ import annotations

import json
import os
import types

import pytest

pytest.importorskip("trl")

from benchmarks import bench_e2e, harness  # noqa: E402
from tests.child_process import in_child_process

SMOKE = ["--shape", "tiny", "--seq", "32", "--steps", "3", "--warmup", "1", "--batches", "2"]


def _args(**kw):
    base = dict(shape="tiny", task="full", loss="sft", seq=32, gc="off", layers=0)
    return types.SimpleNamespace(**(base | kw))


def test_floor_gemms_drop_frozen_weight_gradients_and_add_the_recompute():
    s = bench_e2e.SHAPES["tiny"]
    rows, layers, linears = 2 * 32, s["layers"], 7
    full = bench_e2e.step_gemms(_args(), 2)
    assert sum(c for *_, c in full) == 3 * linears * layers + 3  # forward, dx, dW per linear and the head
    lora = bench_e2e.step_gemms(_args(task="lora"), 2)
    assert all(not (m == s["vocab"] and k == rows) for m, k, n, c in lora)  # no head weight gradient
    assert sum(c for m, k, n, c in lora if bench_e2e.LORA_RANK not in (m, k, n)) == 2 * linears * layers + 2
    gc = bench_e2e.step_gemms(_args(gc="on"), 2)
    assert sum(c for *_, c in gc) - sum(c for *_, c in full) == linears * layers  # the layers' forward again
    dpo = bench_e2e.step_gemms(_args(loss="dpo"), 2)
    assert dpo[0][0] == 2 * rows  # chosen and rejected rows
    # KTO: the reference on the completions, the policy and the reference on the KL batch, all without grad
    kto = bench_e2e.step_gemms(_args(loss="kto"), 2)
    assert sum(c for *_, c in kto) - sum(c for *_, c in full) == 3 * (linears * layers + 1)


def test_kernel_kinds_and_idle_time_from_the_union_of_intervals():
    names = {
        "sm90_xmma_gemm_bf16": "gemm",
        "nvjet_tst_128x256": "gemm",
        "flash_fwd_kernel": "attention",
        "void at::native::multi_tensor_apply_kernel<Adam>": "optimizer",
        "_rms_norm_fwd_kernel": "triton",
        "void at::native::elementwise_kernel<copy>": "copies",
        "void at::native::reduce_kernel": "other",
        "ncclDevKernel_AllGather_RING_LL": "comm",
    }
    assert {n: harness.kernel_kind(n) for n in names} == names
    cuda = harness.torch.autograd.DeviceType.CUDA

    def event(name, start, end):
        span = types.SimpleNamespace(start=start, end=end)
        return types.SimpleNamespace(name=name, device_type=cuda, time_range=span)

    spans = [
        event("x_gemm", 0, 4000),
        event("_k_kernel", 2000, 5000),
        event("flash_bwd", 7000, 8000),
        event("ncclDevKernel_ReduceScatter", 4500, 7500),
    ]
    prof = types.SimpleNamespace(events=lambda: spans)
    # 10 ms over two steps, 8 ms busy; from 5 to 7 ms only the collective runs
    parts = harness.kernel_time(prof, wall_s=0.010, steps=2)
    assert parts["gemm"] == 2.0 and parts["triton"] == 1.5 and parts["attention"] == 0.5
    assert parts["comm"] == 1.5 and parts["comm_exposed"] == pytest.approx(1.0)
    assert parts["idle"] == pytest.approx(1.0)


@pytest.mark.slow  # a process per implementation importing torch, transformers and TRL
@in_child_process
def test_each_implementation_runs_in_its_own_process_and_the_floor_runs(tmp_path):
    out = tmp_path / "sft.json"
    assert bench_e2e.main([*SMOKE, "--impl", "trl,chunkloss", "--no-kernels", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["mode"] == "e2e" and [r["impl"] for r in data["sweep"]] == ["trl", "chunkloss"]
    for r in data["sweep"]:
        assert "error" not in r, r
        assert len(r["step_times_s"]) == 2 and r["step_time_s"] > 0 and r["tokens_per_s"] > 0
    # Medusa's own loss on materialised fp32 logits and the chunked one: the same sums in another order.
    medusa = tmp_path / "medusa.json"
    assert (
        bench_e2e.main(
            [
                *SMOKE,
                "--loss",
                "medusa",
                "--medusa-stage",
                "2",
                "--impl",
                "trl,chunkloss",
                "--no-kernels",
                "--out",
                str(medusa),
            ]
        )
        == 0
    )
    hf, ours = json.loads(medusa.read_text())["sweep"]
    assert hf["losses"] == pytest.approx(ours["losses"], rel=1e-4) and len(hf["losses"]) == 3
    floor = tmp_path / "floor.json"
    assert bench_e2e.main([*SMOKE, "--floor", "--out", str(floor)]) == 0
    (row,) = json.loads(floor.read_text())["rows"]
    assert row["ms"] == pytest.approx(row["parts"]["gemm"] + row["parts"]["attention"])


@pytest.mark.slow  # a process per implementation importing torch, transformers and TRL
@in_child_process
def test_kto_and_rloo_run_and_give_trl_losses(tmp_path):
    """The chunked trainers with the kernels (the Triton interpreter) and TRL's: the same loss curve (KTO's
    data unpaired, half desirable, the KL batch TRL builds; RLOO's completions fixed)."""
    for loss in ("kto", "rloo"):
        out = tmp_path / f"{loss}.json"
        assert bench_e2e.main([*SMOKE, "--loss", loss, "--impl", "trl,chunkloss", "--out", str(out)]) == 0
        trl, ours = json.loads(out.read_text())["sweep"]
        assert "error" not in trl and "error" not in ours, (trl, ours)
        assert ours["kernels"] and ours["patch"].startswith("chunkloss.models.patch")
        assert len(ours["losses"]) == 3
        assert ours["losses"] == pytest.approx(trl["losses"], rel=1e-4, abs=1e-5), loss


def test_bad_arguments_get_one_line():
    with pytest.raises(SystemExit):
        bench_e2e.main([*SMOKE, "--impl", "deepspeed", "--out", "x.json"])
    with pytest.raises(SystemExit):
        bench_e2e.main([*SMOKE, "--profile", "--impl", "trl,liger", "--out", "x.json"])


def test_unsloth_process_finds_its_site_first_and_a_failing_import_is_its_row(monkeypatch, tmp_path):
    """``$CHUNKLOSS_UNSLOTH_SITE`` leads the unsloth process's ``PYTHONPATH`` (no other's); an Unsloth that
    cannot import (as without a GPU; here a package that raises on import) gives a row with its error."""
    site = tmp_path / "site"
    (site / "unsloth").mkdir(parents=True)
    (site / "unsloth" / "__init__.py").write_text('raise ImportError("this unsloth raises on import")\n')
    monkeypatch.setenv("CHUNKLOSS_UNSLOTH_SITE", str(site))
    monkeypatch.setenv("PYTHONPATH", "/rest")
    assert bench_e2e.child_env("unsloth")["PYTHONPATH"] == os.pathsep.join([str(site), "/rest"])
    assert bench_e2e.child_env("trl") is None
    monkeypatch.delenv("PYTHONPATH")
    assert bench_e2e.child_env("unsloth")["PYTHONPATH"] == str(site)
    out = tmp_path / "unsloth.json"
    assert bench_e2e.main([*SMOKE, "--task", "lora", "--impl", "unsloth", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["sweep"]
    assert row["impl"] == "unsloth" and row["error"] == "ImportError: this unsloth raises on import"
    monkeypatch.delenv("CHUNKLOSS_UNSLOTH_SITE")
    assert bench_e2e.child_env("unsloth") is None


def test_qlora_floor_adds_the_dequantisation_of_each_4bit_weight(monkeypatch):
    """Each 4-bit weight dequantised once per forward pass and once for the input gradient (the full task has
    no such part)."""
    pytest.importorskip("bitsandbytes")
    shapes = []

    def timed(fn, repeats=10):
        out = fn()
        shapes.append(tuple(out.shape) if hasattr(out, "shape") else None)
        return 1.0

    monkeypatch.setattr(bench_e2e, "_time_ms", timed)
    layers, linears = bench_e2e.SHAPES["tiny"]["layers"], 7
    assert bench_e2e.dequant_ms(_args(task="qlora"), "cpu") == linears * layers * 2
    assert bench_e2e.dequant_ms(_args(task="qlora", gc="on"), "cpu") == linears * layers * 3
    s = bench_e2e.SHAPES["tiny"]
    assert shapes[:2] == [(s["heads"] * s["head_dim"], s["hidden"]), (s["kv"] * s["head_dim"], s["hidden"])]
    assert "dequant" not in bench_e2e.floor(_args(), 2)["parts"]
    row = bench_e2e.floor(_args(task="qlora"), 2)
    assert row["parts"]["dequant"] == linears * layers * 2 and row["ms"] == sum(row["parts"].values())


def test_qlora_without_bitsandbytes_gets_one_line(monkeypatch, capsys):
    real = bench_e2e.importlib.util.find_spec
    monkeypatch.setattr(
        bench_e2e.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else real(name, *a),
    )
    with pytest.raises(SystemExit):
        bench_e2e.main([*SMOKE, "--task", "qlora", "--out", "x.json"])
    assert "--task qlora needs bitsandbytes" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["fp8", "fp8-train"])
@pytest.mark.parametrize("extra", [["--impl", "trl,chunkloss"], ["--impl", "chunkloss", "--floor"]])
def test_fp8_tasks_are_chunkloss_with_its_kernels_only(capsys, task, extra):
    """``--task fp8`` runs chunkloss's fp8 base (``chunk_fp8="base"``), ``--task fp8-train`` its float8 full
    fine-tuning (``chunk_fp8="train"``): no peer has either, and the floor would time bf16 GEMMs."""
    with pytest.raises(SystemExit):
        bench_e2e.main([*SMOKE, "--task", task, *extra, "--out", "x.json"])
    assert f"--task {task} is chunkloss's chunk_fp8" in capsys.readouterr().err
