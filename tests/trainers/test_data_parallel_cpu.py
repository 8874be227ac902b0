"""Two processes on the CPU: the trainers whose loss reads other processes' values train as one process does.

``torchrun`` starts two gloo processes under accelerate's data parallelism on the CPU (``MULTI_CPU``: each
process its half of the batch, the gradients all-reduced). GRPO and RLOO gather the rewards of a group across
processes for its advantages, KTO gathers the KL term's per-process means. ``benchmarks/multigpu_parity.py``
trains the tiny model 20 steps that way and as one process on the global batch (``--single``), and compares
the first step's full gradients and the loss curves. The same script runs the two-GPU FSDP2 and ZeRO-3
comparisons (``tests/trainers/test_multigpu.py``).

Tolerances, fp32 (measured on a 2-core x86 CPU, torch 2.13): the largest gradient error relative to each
tensor's largest entry was 3.5e-7 (KTO), 5.3e-7 (RLOO) and 4.0e-7 (GRPO), the order of the all-reduce's sums;
the largest curve difference relative to the curve's largest loss 6.9e-6, 1.0e-5 and 3.4e-7, over 20 AdamW
steps that carry the first step's rounding forward. The bounds are about 20 and 10 times those.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainers.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
GRAD_RTOL = 1e-5
CURVE_RTOL = 1e-4
STEPS = 20  # benchmarks.multigpu_parity.STEPS


def _run(args: list[str], env: dict) -> None:
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "kto"])
def test_two_cpu_processes_train_as_one(trainer, tmp_path):
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": ""}
    script = ["-m", "benchmarks.multigpu_parity", "--trainer", trainer]
    multi, single, out = tmp_path / "multi", tmp_path / "single", tmp_path / "cmp.json"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    _run([*launch, "--master_port", str(free_port()), *script, "--out", str(multi)], env)
    _run([sys.executable, *script, "--single", "--world", "2", "--out", str(single)], env)
    _run([sys.executable, *script, "--compare", str(multi), str(single), "--out", str(out)], env)
    r = json.loads(out.read_text())
    # Two processes that all-reduce, not two independent ones each comparing itself with the reference.
    assert r["multi"]["num_processes"] == 2 and "MULTI_CPU" in r["multi"]["distributed_type"]
    assert r["single"]["num_processes"] == 1
    assert r["missing_grads"] == [] and r["extra_grads"] == [] and r["zero_ref_grads"] == []
    assert r["max_rel_grad_error"] <= GRAD_RTOL, r["per_param_grad_error"]
    assert r["steps_compared"] == STEPS
    assert r["max_rel_curve_diff"] <= CURVE_RTOL, (r["curve_multi"], r["curve_single"])
