"""Resuming: every chunked trainer, stopped after step k and resumed from its checkpoint, logs for the steps
after k what the uninterrupted run logs (losses, rewards, every metric, the GRPO and RLOO generations buffered
across k); a save interrupted before it completes leaves the previous checkpoint to resume from.

The runs are the tiny configs through ``chunkloss train`` (CPU, two threads at most) on 64 rows of the tiny
dataset (the resume falls inside the first epoch), four steps logged one by one and saved every two. Two
steps follow the resume, so the second one's loss shows the restored optimizer state. GRPO's config
generates once per four steps, so step 2 falls inside a generation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from chunkloss import cli
from chunkloss.trainers._resume import STATE_FILE

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TRAINERS = ["sft", "dpo", "orpo", "kto", "grpo", "rloo", "gkd", "distillation", "medusa"]
STEPS, SAVE = 4, 2
ROWS = 64  # not the configs' 512 (GRPO: 256): each run tokenizes all of them, for four steps
# Logged once per run (not per step), or wall-clock times.
NOT_COMPARED = {
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "train_loss",
    "total_flos",
    "step_time",
}


def _run(name: str, out: Path, *overrides: str) -> list[dict]:
    args = [
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
        "--logging_steps",
        "1",
        "--save_strategy",
        "steps",
        "--save_steps",
        str(SAVE),
        "--dataset_size",
        str(ROWS),
        *overrides,
    ]
    if name == "grpo":
        args += ["--use_adaptive_entropy", "true", "--entropy_target", "0.5"]  # the controller's state too
    cli.train(str(CONFIGS / f"{name}-tiny.yaml"), args)
    return _steps(out / f"checkpoint-{STEPS}")


def _steps(checkpoint: Path) -> list[dict]:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    per_step = [h for h in history if "train_runtime" not in h]
    return [{k: v for k, v in h.items() if k not in NOT_COMPARED} for h in per_step]


def _assert_same_steps(resumed: list[dict], full: list[dict], after: int) -> None:
    later = [h for h in full if h["step"] > after]
    assert [h["step"] for h in resumed if h["step"] > after] == [h["step"] for h in later] != []
    for ours, theirs in zip([h for h in resumed if h["step"] > after], later):
        assert sorted(ours) == sorted(theirs)
        # The same operations on the same inputs and state on CPU: the same numbers.
        assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-7, nan_ok=True), ours["step"]


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", TRAINERS)
def test_resumed_run_logs_what_the_uninterrupted_run_logs(tmp_path, name):
    full = _run(name, tmp_path / "full")
    assert (tmp_path / "full" / f"checkpoint-{SAVE}" / STATE_FILE).exists()
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE}"
    resumed = _run(name, tmp_path / "resumed", "--resume_from_checkpoint", str(checkpoint))
    _assert_same_steps(resumed, full, after=SAVE)
    if name == "grpo":
        assert {"entropy_coef"} <= set(resumed[-1])


class _Killed(Exception):
    pass


def test_an_interrupted_save_leaves_the_previous_checkpoint_to_resume_from(tmp_path, monkeypatch):
    from transformers import Trainer
    from transformers.trainer_utils import get_last_checkpoint

    full = _run("sft", tmp_path / "full")
    out = tmp_path / "killed"
    save_rng = Trainer._save_rng_state

    def dies_at_the_last_save(self, output_dir):  # the model and optimizer are written, the state is not
        if self.state.global_step == STEPS:
            raise _Killed
        save_rng(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", dies_at_the_last_save)
    with pytest.raises(_Killed):
        _run("sft", out, "--save_total_limit", "1")
    monkeypatch.undo()
    # transformers alone would pick the broken folder; save_total_limit=1 has not deleted the complete one.
    assert get_last_checkpoint(str(out)) == str(out / f"checkpoint-{STEPS}")
    assert (out / f"checkpoint-{SAVE}" / STATE_FILE).exists()
    assert not (out / f"checkpoint-{STEPS}" / STATE_FILE).exists()

    with pytest.raises(ValueError, match=f"not a complete checkpoint.*checkpoint-{SAVE}"):
        _run("sft", out, "--resume_from_checkpoint", str(out / f"checkpoint-{STEPS}"))
    assert (
        cli.main(
            [
                "train",
                str(CONFIGS / "sft-tiny.yaml"),
                "--output_dir",
                str(out),
                "--resume_from_checkpoint",
                str(out / f"checkpoint-{STEPS}"),
            ]
        )
        == 2
    )
    resumed = _run("sft", out, "--resume_from_checkpoint", "true", "--save_total_limit", "1")
    _assert_same_steps(resumed, full, after=SAVE)
    assert not (out / f"checkpoint-{SAVE}").exists(), "the older checkpoint goes once the new one is complete"
