"""benchmarks/multigpu_parity.py on CPU in one process (fp32): the gradient tap reads each step's gradients
once the step's micro-batches are all in, so the global batch in two micro-batches gives the reference's
gradients, norms and curve (its error, the noise a real-size run is tested against, is then fp32 rounding),
and the comparison and its result set carry them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from benchmarks import multigpu_parity, report  # noqa: E402
from tests.child_process import in_child_process  # noqa: E402


@in_child_process
def test_two_micro_batches_match_the_global_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    ref, noise = tmp_path / "sft_fsdp2_ref", tmp_path / "sft_fsdp2_noise"
    common = ["--trainer", "sft", "--steps", "3", "--single", "--world", "2"]
    multigpu_parity.main([*common, "--out", str(ref)])
    multigpu_parity.main([*common, "--accumulate", "2", "--out", str(noise)])
    runs = [json.loads((d / "run.json").read_text()) for d in (ref, noise)]
    assert [(r["per_device_batch"], r["accumulate"]) for r in runs] == [(8, 1), (4, 2)]
    assert all(len(r["norms"]) == 3 and set(r["norms"][0]) == {"head", "middle_layer"} for r in runs)

    # The noise run in the place of the 2-process one: what the comparison reads is all there.
    r = multigpu_parity.compare(noise, ref, tmp_path / "sft_fsdp2.json", noise=(noise, ref))
    assert r["missing_grads"] == [] and r["extra_grads"] == [] and r["steps_compared"] == 3
    errors = [r["max_rel_grad_error"], r["max_rel_curve_diff"], *r["max_rel_norm_diff"].values()]
    assert max(errors) < 1e-5, errors  # fp32: summation order only (measured ~3e-7)
    assert r["noise"]["max_rel_norm_diff"] == r["max_rel_norm_diff"]

    data = multigpu_parity.summary(tmp_path)
    [row] = [x for x in report.records("multigpu", data) if x["case"] == "sft fsdp2"]
    assert row["rel_norm_diff_head"] == r["max_rel_norm_diff"]["head"] and "noise_rel_grad_err" in row
