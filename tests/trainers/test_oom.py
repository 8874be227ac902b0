"""Running out of memory in a chunked trainer.

With ``auto_find_batch_size=True`` the trainer retries at a smaller batch and trains as a fresh run at that
batch would (nothing from the failed attempt is logged or kept), also when torch.compile wraps the error; on
CPU the error is raised by a hook at the first batch size. Without it, the error names the batch and what to
do, and the last checkpoint resumes. The GPU test runs out of memory for real under a memory cap.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from chunkloss.data import tiny_dataset, tiny_model
from chunkloss.trainers._resume import STATE_FILE
from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer
from tests.trainers.helpers import common_args, tokenizer

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"  # the first line of torch's message


def _trainer(tmp_path, batch: int, model=None, dataset=None, **cfg):
    torch.manual_seed(0)
    args = {
        **common_args(tmp_path),
        "max_length": 64,
        "chunk_size": 7,
        "chunk_compile": False,
        "per_device_train_batch_size": batch,
        "max_steps": 3,
        **cfg,
    }
    return ChunkedSFTTrainer(
        model or tiny_model(tokenizer(), hidden_size=32, num_layers=1),
        ChunkedSFTConfig(**args),
        train_dataset=dataset or tiny_dataset("sft", n=64),
        processing_class=tokenizer(),
    )


def _fail_at(trainer, when, make_error):
    """Raise ``make_error()`` after the loss of a batch is computed (its metrics and token count stored, as
    when the backward runs out of memory) whenever ``when(batch_rows, global_step)``."""
    calls, compute_loss = [], trainer.compute_loss

    def failing(model, inputs, *args, **kwargs):
        out = compute_loss(model, inputs, *args, **kwargs)
        rows = inputs["input_ids"].shape[0]
        if when(rows, trainer.state.global_step):
            calls.append(rows)
            raise make_error()
        return out

    trainer.compute_loss = failing
    return calls


def _history(trainer) -> list[dict]:
    drop = {"train_runtime", "train_samples_per_second", "train_steps_per_second"}
    return [{k: v for k, v in h.items() if k not in drop} for h in trainer.state.log_history]


@pytest.mark.parametrize("wrapped", [False, True], ids=["oom", "oom-inside-compile"])
def test_auto_find_batch_size_retries_and_trains_as_a_fresh_run(tmp_path, wrapped):
    def error():
        if not wrapped:
            return torch.OutOfMemoryError(OOM)
        wrapper = RuntimeError("backend compiler failed with OutOfMemoryError")  # as torch.compile wraps it
        wrapper.__cause__ = torch.OutOfMemoryError(OOM)
        return wrapper

    ours = _trainer(tmp_path / "auto", 8, auto_find_batch_size=True)
    failed = _fail_at(ours, lambda rows, step: rows == 8, error)
    ours.train()
    assert failed == [8] and ours.state.train_batch_size == 7  # accelerate's retry: 0.9 x the batch
    fresh = _trainer(tmp_path / "fresh", 7)
    fresh.train()
    assert _history(ours) == _history(fresh)  # no metric, token count or step of the failed attempt


def test_without_auto_find_batch_size_the_error_names_the_batch_and_the_checkpoint(tmp_path):
    ours = _trainer(tmp_path, 8, save_strategy="steps", save_steps=2, max_steps=4)
    _fail_at(ours, lambda rows, step: step == 2, lambda: torch.OutOfMemoryError(OOM))
    with pytest.raises(torch.OutOfMemoryError) as info:
        ours.train()
    message = str(info.value)
    assert "per_device_train_batch_size=8" in message and "(8, " in message, message  # input_ids (8, T)
    assert "auto_find_batch_size=True" in message and "gradient_accumulation_steps" in message
    assert f"resume from {tmp_path / 'checkpoint-2'}" in message and OOM in message
    assert (tmp_path / "checkpoint-2" / STATE_FILE).exists()
    resumed = _trainer(tmp_path, 8, save_strategy="steps", save_steps=2, max_steps=4)
    (tmp_path / "checkpoint-3").mkdir()  # what a save killed at its start leaves
    with pytest.raises(ValueError, match="checkpoint-3 is incomplete.*checkpoint-2"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    resumed.train(resume_from_checkpoint=True)  # the last complete checkpoint
    assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2, 3, 4]


class _AllocatedAfterFirstStep(TrainerCallback):
    def __init__(self):
        self.allocated = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.allocated is None:
            torch.cuda.synchronize()
            self.allocated = torch.cuda.memory_allocated()


def _long_texts(n: int = 64, words: int = 1200) -> Dataset:
    tok = tokenizer()
    vocab = [t for t in tok.get_vocab() if t.isdigit()]
    texts = [" ".join(vocab[(i + j) % len(vocab)] for j in range(words)) for i in range(n)]
    return Dataset.from_dict({"text": texts})


@pytest.mark.gpu
def test_out_of_memory_on_gpu_retries_with_kernels_and_compile_and_frees_the_failed_attempt(tmp_path):
    """A Qwen3-shaped model (H = 1024, 16 layers, V = 65536) on 1024-token sequences, without gradient
    checkpointing (TRL's default turns it on, and then a sequence adds only about 13 MiB, measured on an H100)
    and with SGD, so that the activations set the peak: each sequence adds hundreds of MiB, so under a cap
    between the peaks of batches 6 and 7 batches 8 and 7 run out of memory, and 6 trains;
    its allocated memory after the first step is a fresh batch-6 run's."""
    data = _long_texts()
    cfg = dict(
        max_length=1024,
        bf16=True,
        use_cpu=False,
        chunk_kernels=True,
        chunk_compile=True,
        chunk_size=None,
        max_steps=2,
        logging_steps=1,
        optim="sgd",
        gradient_checkpointing=False,
    )

    def model():
        torch.manual_seed(0)
        return tiny_model(
            tokenizer(), hidden_size=1024, num_layers=16, vocab_size=65536, max_position_embeddings=2048
        ).cuda()

    def run(batch, **extra):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        out = tmp_path / f"b{batch}-{len(extra)}"
        trainer = _trainer(out, batch, model=model(), dataset=data, **cfg, **extra)
        probe = _AllocatedAfterFirstStep()
        trainer.add_callback(probe)
        trainer.train()
        peak, batch = torch.cuda.max_memory_allocated(), trainer.state.train_batch_size
        del trainer
        return probe.allocated, peak, batch

    _, peak2, _ = run(2)
    _, peak4, _ = run(4)
    per_seq = (peak4 - peak2) / 2
    assert per_seq > 100 * 2**20, f"a sequence adds {per_seq / 2**20:.0f} MiB: too little to cap between"
    fresh_alloc, peak6, _ = run(6)
    cap = peak6 + per_seq / 2
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        retry_alloc, _, batch = run(8, auto_find_batch_size=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert batch == 6
    # Equal up to the allocator's rounding of a few blocks (2 MiB each).
    assert abs(retry_alloc - fresh_alloc) <= 16 * 2**20 + 0.01 * fresh_alloc, (retry_alloc, fresh_alloc)
