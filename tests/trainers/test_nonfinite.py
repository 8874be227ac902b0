"""A NaN or inf training loss is reported once, in one warning line naming the step and the first non-finite
input (the LM head's weight, the hidden states reaching it, or neither: the loss itself), at the next log.

transformers' ``logging_nan_inf_filter`` (on by default) leaves such steps out of the logged loss, so the
logged numbers alone do not show it. On CUDA the recording adds no host sync to the training step."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

from chunkloss.data import tiny_dataset
from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer
from tests.trainers.helpers import common_args, model_pair, tokenizer

BAD_STEP = 2  # the first step whose loss is not finite; the log before it (step 1) shows a finite loss
# transformers 5.23 renamed gradient_checkpointing (the old name warns).
CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


class _PoisonBefore(TrainerCallback):
    """Sets ``param`` to ``value`` once the step before ``BAD_STEP`` is done."""

    def __init__(self, param: torch.nn.Parameter, value: float):
        self.param, self.value = param, value

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == BAD_STEP - 1:
            with torch.no_grad():
                self.param.fill_(self.value)


def _trainer(tmp_path, case: str, logging_steps: int = 1) -> ChunkedSFTTrainer:
    model, _ = model_pair()
    args = ChunkedSFTConfig(
        **common_args(tmp_path, max_length=48),
        max_steps=4,
        chunk_compile=False,
        **{CHECKPOINTING: False},
    )
    trainer = ChunkedSFTTrainer(
        model, args, train_dataset=tiny_dataset("sft", 16), processing_class=tokenizer()
    )
    trainer.args.logging_steps = logging_steps
    if case == "head weight":
        trainer.add_callback(_PoisonBefore(model.lm_head.weight, math.inf))
    elif case == "hidden states":  # the final norm's scale: every hidden state reaching the head is NaN
        trainer.add_callback(_PoisonBefore(model.model.norm.weight, math.nan))
    elif case == "loss":  # inputs finite, the loss's value NaN from BAD_STEP on
        compute_loss = trainer.compute_loss

        def nan_loss(*a, **kw):
            loss = compute_loss(*a, **kw)
            return loss * math.nan if trainer.state.global_step + 1 >= BAD_STEP else loss

        trainer.compute_loss = nan_loss
    return trainer


def _reports(caplog) -> list[str]:
    messages = [r.getMessage() for r in caplog.records if r.name == "chunkloss.trainers"]
    return [m for m in messages if "training loss is" in m]


FIRST = {
    "head weight": "the LM head's weight was already non-finite",
    "hidden states": "the hidden states reaching the LM head were non-finite (its weight was finite)",
    "loss": "the LM head's weight and input were finite: the loss's own math or inputs were not",
}


@pytest.mark.parametrize("case", list(FIRST))
def test_first_nonfinite_loss_is_reported_once_with_its_step_and_input(tmp_path, caplog, case):
    trainer = _trainer(tmp_path, case)
    with caplog.at_level(logging.WARNING, logger="chunkloss.trainers"):
        trainer.train()
    assert trainer.state.global_step == 4
    reports = _reports(caplog)
    assert len(reports) == 1, reports  # steps 2, 3 and 4 are all non-finite: one line
    assert f"ChunkedSFTTrainer: the training loss is nan at step {BAD_STEP}: {FIRST[case]}" in reports[0]
    assert "\n" not in reports[0]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert math.isfinite(losses[0]), "the step before is finite"


def test_reported_at_the_next_log_between_logs(tmp_path, caplog):
    """The step is the one that went non-finite, not the logging step that found it."""
    trainer = _trainer(tmp_path, "loss", logging_steps=3)
    with caplog.at_level(logging.WARNING, logger="chunkloss.trainers"):
        trainer.train()
    reports = _reports(caplog)
    assert len(reports) == 1 and f"at step {BAD_STEP}:" in reports[0], reports


def test_reported_when_an_error_ends_training_before_the_next_log(tmp_path, caplog):
    """As generation fails on weights a NaN loss has turned NaN: the report comes before the error leaves."""
    trainer = _trainer(tmp_path, "loss", logging_steps=10)
    compute_loss = trainer.compute_loss

    def failing(*a, **kw):
        if trainer.state.global_step + 1 > BAD_STEP:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return compute_loss(*a, **kw)

    trainer.compute_loss = failing
    with caplog.at_level(logging.WARNING, logger="chunkloss.trainers"):
        with pytest.raises(RuntimeError, match="probability tensor"):
            trainer.train()
    reports = _reports(caplog)
    assert len(reports) == 1 and f"at step {BAD_STEP}:" in reports[0], reports


def test_finite_run_reports_nothing(tmp_path, caplog):
    trainer = _trainer(tmp_path, "none")
    with caplog.at_level(logging.WARNING, logger="chunkloss.trainers"):
        trainer.train()
    assert _reports(caplog) == []
    assert trainer._nonfinite_first[0].item() == -1.0


@pytest.mark.gpu
def test_recording_adds_no_host_sync_on_cuda(tmp_path):
    """The per-step recording (the head's two flags, the loss's) runs with CUDA's sync check set to error."""
    from chunkloss.trainers._nonfinite import record_head_inputs

    trainer = _trainer(tmp_path, "none")
    model = trainer.model.cuda()
    hidden = torch.randn(4, 16, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    weight = model.lm_head.weight.detach().bfloat16()
    loss = torch.tensor(math.nan, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            record_head_inputs(model, hidden, weight)
            trainer._record_loss(loss, model.__dict__.pop("_chunkloss_head_inputs_finite"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    step, value, hidden_finite, weight_finite = trainer._nonfinite_first.tolist()
    assert step == 1 and math.isnan(value) and hidden_finite == weight_finite == 1.0
