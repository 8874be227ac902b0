"""Host syncs in a chunked trainer's ``compute_loss`` on CUDA: none after the chunked loss has run.

TRL's trainers fetch each metric with ``.item()`` inside ``compute_loss``; a chunked loss has already run the
LM head's gradient GEMMs by then, so the host would wait for them and the GPU would idle while the host
launches the backward (SFT at Llama-3.2-1B's 16 layers, batch 8: 7% slower per step than TRL's). The chunked
trainers keep their metrics on the device until ``log`` (``DeferredMetrics``); the parity tests check the
logged values against TRL's.

``torch.cuda.set_sync_debug_mode`` reports the syncs CUDA sees; it may miss some, so this bounds what it sees.
With TRL's ``.item()`` calls back in ``compute_loss`` both tests fail.
"""

import warnings

import pytest
import torch

from chunkloss.data import tiny_dataset
from chunkloss.engine import FusedLinearBase
from tests.trainers.helpers import common_args, model_pair, tokenizer

pytestmark = pytest.mark.gpu


def _events(trainer) -> list[str]:
    """One ``compute_loss`` (after a warm-up one), as the ordered list of the syncs CUDA reports ("sync") and
    of the chunked losses' returns ("loss"). The model's forward and the losses sync for their own reasons
    (attention masks, row counts); after the last loss returns nothing may wait for the GPU."""
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    trainer.model.train()
    trainer.compute_loss(trainer.model, dict(batch)).backward()
    torch.cuda.synchronize()
    events, real_run = [], FusedLinearBase.run

    def run(self, *args, **kwargs):
        out = real_run(self, *args, **kwargs)
        events.append("loss")
        return out

    def show(message, *args, **kwargs):
        if "synchroniz" in str(message).lower():
            events.append("sync")

    FusedLinearBase.run = run
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            loss = trainer.compute_loss(trainer.model, dict(batch))
    finally:
        torch.cuda.set_sync_debug_mode(0)
        FusedLinearBase.run = real_run
    loss.backward()
    return events


def _assert_no_sync_after_loss(events):
    assert "loss" in events, events
    last = len(events) - 1 - events[::-1].index("loss")
    assert "sync" not in events[last:], events


def _trainer(kind: str, tmp_path):
    """A chunked trainer of ``kind`` on CUDA (a tiny fp32 model; DPO with a reference model), and a metric its
    log must hold as a number."""
    args = {**common_args(tmp_path, max_length=64 if kind == "sft" else 48), "use_cpu": False}
    models = [m.cuda() for m in model_pair()]
    if kind == "sft":
        from chunkloss.trainers.sft import ChunkedSFTConfig as Config
        from chunkloss.trainers.sft import ChunkedSFTTrainer as Trainer

        models, metric = models[:1], "entropy"
    else:
        from chunkloss.trainers.dpo import ChunkedDPOConfig as Config
        from chunkloss.trainers.dpo import ChunkedDPOTrainer as Trainer

        metric = "rewards/margins"
    data = tiny_dataset(kind, n=8)
    return Trainer(*models, Config(**args), train_dataset=data, processing_class=tokenizer()), metric


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_no_sync_in_compute_loss_after_the_loss(tmp_path, kind):
    trainer, metric = _trainer(kind, tmp_path)
    _assert_no_sync_after_loss(_events(trainer))
    logged = trainer.log({}) or trainer.state.log_history[-1]
    assert isinstance(logged[metric], float) and logged["num_tokens"] > 0
