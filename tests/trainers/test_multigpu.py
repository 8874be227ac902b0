"""Issue 9 on two GPUs: the chunked trainers under ``accelerate launch`` with FSDP2 and DeepSpeed ZeRO-3
give the one-process gradients of the same global batch after one step, and the same 20-step loss curve
(``benchmarks/multigpu_parity.py`` does the runs; skipped without two CUDA devices)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# bf16 training, fp32 comparison: the sharded run reduces bf16 gradients in another order than one process.
# Not yet measured on 2xH200: 2e-2 relative to each tensor's largest entry is a bf16 rounding budget of a few
# ulps (bf16 eps 7.8e-3); to be replaced by the measured error once the recorded run exists.
GRAD_RTOL = 2e-2
CURVE_RTOL = 5e-2


def _run(cmd, env):
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=1800)


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["fsdp2", "zero3"])
@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo"])
def test_parity_with_single_process(backend, trainer, tmp_path):
    if backend == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (ZeRO-3 needs it)")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    mod = ["-m", "benchmarks.multigpu_parity", "--trainer", trainer]
    config = ROOT / "configs" / "accelerate" / f"{backend}.yaml"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    _run([*launch, "--num_processes", "2", *mod, "--out", str(tmp_path / "multi")], env)
    single = {**env, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    _run([sys.executable, *mod, "--single", "--world", "2", "--out", str(tmp_path / "single")], single)
    out = tmp_path / "cmp.json"
    _run(
        [
            sys.executable,
            *mod,
            "--compare",
            str(tmp_path / "multi"),
            str(tmp_path / "single"),
            "--out",
            str(out),
        ],
        env,
    )
    r = json.loads(out.read_text())
    assert r["missing_grads"] == []
    assert r["max_rel_grad_error"] <= GRAD_RTOL, r["per_param_rel_grad_error"]
    assert r["steps_compared"] == 20
    assert r["max_rel_curve_diff"] <= CURVE_RTOL, (r["curve_multi"], r["curve_single"])
