"""A LoRA adapter on lm_head through ChunkedORPOTrainer (SFT, DPO and GKD have theirs in their own files).

trl.experimental.orpo.ORPOTrainer accepts the adapter and scores the PEFT model's own ``outputs.logits``, so
the adapter is in its loss and TRL on the same PEFT model is the reference; ours feeds the adapter's columns
to the chunked loss (``chunkloss/trainers/_head.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from chunkloss.data import tiny_dataset
from chunkloss.trainers.orpo import ChunkedORPOConfig, ChunkedORPOTrainer
from tests.trainers.helpers import check_orpo_step, common_args, model_pair, tokenizer


def test_orpo_lora_on_lm_head_trains(tmp_path):
    peft = pytest.importorskip("peft")
    # Random A and B (init_lora_weights=False): a zero B would make the adapter's logits, and A's gradient, 0.
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False
    )
    ref_m, our_m = model_pair()
    ds = tiny_dataset("orpo", n=8)
    base = common_args(tmp_path, max_length=48)
    ref = ORPOTrainer(
        ref_m,
        ORPOConfig(**base),
        train_dataset=ds,
        processing_class=tokenizer(),
        peft_config=copy.deepcopy(cfg),
    )
    ours = ChunkedORPOTrainer(
        our_m,
        ChunkedORPOConfig(**base, chunk_size=11, chunk_compile=False),
        train_dataset=ds,
        processing_class=tokenizer(),
        peft_config=copy.deepcopy(cfg),
    )
    ours.model.load_state_dict(ref.model.state_dict())
    lora_b = [n for n, _ in ours.model.named_parameters() if "lm_head.lora_B" in n]
    assert lora_b

    batch, results = check_orpo_step(ref, ours)
    # TRL's gradient reaches lm_head's B only through the adapter's logits: its loss includes the adapter.
    for tr in (ref, ours):
        assert tr.model.get_parameter(lora_b[0]).grad.abs().sum() > 0
    with torch.no_grad(), ours.model.disable_adapter():
        without = ours.compute_loss(ours.model, dict(batch))
    assert abs(without.item() - results[1].item()) > 1e-3
