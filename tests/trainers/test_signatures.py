"""The chunked trainers take TRL 1.16's constructor arguments: the same parameters with the same defaults, so
every call TRL accepts reaches the chunked trainer unchanged (no extra parameters: the chunkloss options are
config fields)."""

from __future__ import annotations

import inspect

import pytest
import torch
from trl import DistillationTrainer, DPOTrainer, GRPOConfig, GRPOTrainer, RLOOTrainer, SFTTrainer
from trl.experimental.gkd import GKDTrainer
from trl.experimental.orpo import ORPOTrainer

from chunkloss.data import count_reward, tiny_dataset
from chunkloss.trainers import (
    ChunkedDistillationTrainer,
    ChunkedDPOTrainer,
    ChunkedGKDTrainer,
    ChunkedGRPOConfig,
    ChunkedGRPOTrainer,
    ChunkedORPOConfig,
    ChunkedORPOTrainer,
    ChunkedRLOOTrainer,
    ChunkedSFTTrainer,
)
from tests.trainers.helpers import common_args, model_pair, tokenizer

PAIRS = [
    (ChunkedSFTTrainer, SFTTrainer),
    (ChunkedDPOTrainer, DPOTrainer),
    (ChunkedORPOTrainer, ORPOTrainer),
    (ChunkedGRPOTrainer, GRPOTrainer),
    (ChunkedRLOOTrainer, RLOOTrainer),
    (ChunkedGKDTrainer, GKDTrainer),
    (ChunkedDistillationTrainer, DistillationTrainer),
]


@pytest.mark.parametrize("ours,trl_cls", PAIRS, ids=[p[1].__name__ for p in PAIRS])
def test_signature_is_trls(ours, trl_cls):
    mine, theirs = inspect.signature(ours), inspect.signature(trl_cls)
    assert list(mine.parameters) == list(theirs.parameters)
    for name, p in theirs.parameters.items():
        q = mine.parameters[name]
        assert (q.kind, q.default) == (p.kind, p.default), name
    assert issubclass(ours, trl_cls)


def test_wrong_argument_is_trls_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_argument'"):
        ChunkedSFTTrainer(model="x", no_such_argument=1)


def test_grpo_without_reward_funcs(tmp_path):
    """TRL 1.16 declares reward_funcs=None (the rewards may be owned by an environment): the call without it
    reaches TRL's constructor, which asks for a reward source the same way for both trainers (an environment
    needs a tool-calling chat template, which the tiny tokenizer lacks); given by keyword, it builds both."""
    args = dict(**common_args(tmp_path, num_generations=2, max_completion_length=4))
    for cls, cfg in ((GRPOTrainer, GRPOConfig), (ChunkedGRPOTrainer, ChunkedGRPOConfig)):
        with pytest.raises(ValueError, match="No reward source provided"):
            cls(
                model=model_pair()[0],
                args=cfg(**args),
                train_dataset=tiny_dataset("grpo", 8),
                processing_class=tokenizer(),
            )
        trainer = cls(
            model=model_pair()[0],
            args=cfg(**args),
            train_dataset=tiny_dataset("grpo", 8),
            processing_class=tokenizer(),
            reward_funcs=count_reward,
        )
        assert trainer.reward_funcs == [count_reward]


def test_orpo_encoder_decoder_refused_before_trls_constructor(tmp_path, monkeypatch):
    """The refusal comes before TRL's constructor loads the model or tokenises the dataset."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    tok = tokenizer()
    config = AutoConfig.for_model(
        "t5",
        vocab_size=len(tok),
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config)
    path = tmp_path / "t5"
    model.save_pretrained(path)

    def trls_constructor(*args, **kwargs):
        raise AssertionError("TRL's constructor ran")

    monkeypatch.setattr(ORPOTrainer, "__init__", trls_constructor)
    args = ChunkedORPOConfig(**common_args(tmp_path, max_length=48))
    for given in (model, str(path)):
        with pytest.raises(ValueError, match="ChunkedORPOTrainer does not support encoder-decoder models"):
            ChunkedORPOTrainer(given, args, train_dataset=tiny_dataset("orpo", 8), processing_class=tok)


def test_subclass_keeps_the_constructor_it_inherits():
    """A user's subclass without a constructor runs the chunked trainer's: the generated one taking TRL's
    arguments, or a hand-written one (Medusa's adds the heads) that replacing would silently skip."""
    from chunkloss.trainers import ChunkedMedusaTrainer

    class MySFT(ChunkedSFTTrainer):
        pass

    class MyMedusa(ChunkedMedusaTrainer):
        pass

    assert inspect.signature(MySFT) == inspect.signature(SFTTrainer)
    assert MyMedusa.__init__ is ChunkedMedusaTrainer.__init__
