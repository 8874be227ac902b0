"""Host syncs in a chunked trainer's ``compute_loss`` on CUDA: the chunked losses' own, and no more.

TRL's trainers fetch each metric with ``.item()`` inside ``compute_loss``; a chunked loss has already run the
LM head's gradient GEMMs by then, so the host would wait for them and the GPU would idle while the host
launches the backward (SFT at Llama-3.2-1B's 16 layers, batch 8: 172.5 ms per step against TRL's 161.3,
``benchmarks/results/dev/s11/``). The chunked trainers keep their metrics on the device until ``log``
(``DeferredMetrics``); the parity tests check the logged values against TRL's.

``torch.cuda.set_sync_debug_mode`` reports the syncs CUDA sees; it may miss some, so this bounds what it sees.
"""

import warnings

import pytest
import torch

from chunkloss.data import tiny_dataset
from tests.trainers.helpers import common_args, model_pair, tokenizer

pytestmark = pytest.mark.gpu


def _syncs(fn) -> list[str]:
    fn()  # compile and warm up outside the count
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(c.message)[:80] for c in caught if "synchroniz" in str(c.message).lower()]


def _args(tmp_path, **kw):
    return {**common_args(tmp_path, **kw), "use_cpu": False}


def _step(trainer):
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    trainer.model.train()

    def step():
        trainer.compute_loss(trainer.model, dict(batch)).backward()

    return step


def test_sft_compute_loss_syncs_once(tmp_path):
    from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer

    model = model_pair()[0].cuda()
    trainer = ChunkedSFTTrainer(
        model,
        ChunkedSFTConfig(**_args(tmp_path, max_length=64)),
        train_dataset=tiny_dataset("sft", n=8),
        processing_class=tokenizer(),
    )
    syncs = _syncs(_step(trainer))
    assert len(syncs) <= 1, syncs
    logged = trainer.log({}) or trainer.state.log_history[-1]
    assert isinstance(logged["entropy"], float) and isinstance(logged["num_tokens"], int)


def test_dpo_compute_loss_syncs_once(tmp_path):
    from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer

    model, ref = (m.cuda() for m in model_pair())
    trainer = ChunkedDPOTrainer(
        model,
        ref,
        ChunkedDPOConfig(**_args(tmp_path, max_length=48)),
        train_dataset=tiny_dataset("dpo", n=8),
        processing_class=tokenizer(),
    )
    syncs = _syncs(_step(trainer))
    assert len(syncs) <= 2, syncs  # the reference model's log-probs (a chunked loss too) and the DPO loss
    logged = trainer.log({}) or trainer.state.log_history[-1]
    assert isinstance(logged["rewards/margins"], float) and isinstance(logged["num_tokens"], int)
