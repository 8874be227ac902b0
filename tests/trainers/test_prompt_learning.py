"""PEFT's prompt-learning adapters (prompt tuning, p-tuning, prefix tuning) in every chunked trainer: trained
as TRL 1.16's own trainer trains them (same loss, gradients and metrics on one batch), or refused when the
trainer is built where TRL's trainer fails on them mid-training.

Prompt tuning and p-tuning prepend virtual tokens to the hidden states; prefix tuning gives the attention
layers virtual keys and values. Gradient checkpointing is off: under it transformers drops the prefix's keys
and values, and TRL's trainers fail on prefix tuning (refused here, last test).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import TrainingArguments
from trl import SFTConfig, SFTTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from chunkloss.data import tiny_dataset
from chunkloss.trainers import (
    ChunkedDistillationConfig,
    ChunkedDistillationTrainer,
    ChunkedGKDConfig,
    ChunkedGKDTrainer,
    ChunkedORPOConfig,
    ChunkedORPOTrainer,
    ChunkedSFTConfig,
    ChunkedSFTTrainer,
)
from tests.trainers import test_dpo as dpo_parity
from tests.trainers import test_gkd as gkd_parity
from tests.trainers import test_grpo as grpo_parity
from tests.trainers import test_rloo as rloo_parity
from tests.trainers import test_sft as sft_parity
from tests.trainers.helpers import check_orpo_step, common_args, model_pair, teacher_model, tokenizer

peft = pytest.importorskip("peft")

# transformers 5 renames gradient_checkpointing (the old name warns).
_CKPT = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)
NO_CKPT = {_CKPT: False}


def _config(kind: str):
    if kind == "prompt_tuning":
        return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    if kind == "p_tuning":
        return peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16)
    return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)


KINDS = ["prompt_tuning", "p_tuning", "prefix_tuning"]


def _same_adapter(ref, ours):
    """Ours starts from TRL's adapter weights (PEFT draws the virtual tokens at random)."""
    ours.model.load_state_dict(ref.model.state_dict())


@pytest.mark.parametrize("kind", KINDS)
def test_sft(tmp_path, kind):
    """completion_only_loss=False: the first real token has a label, which the last virtual token predicts
    (PEFT pads the labels on the left; TRL's loss counts that term)."""
    ref, ours = sft_parity._pair(tmp_path, peft_config=_config(kind), completion_only_loss=False, **NO_CKPT)
    _same_adapter(ref, ours)
    sft_parity._check(ref, ours)


@pytest.mark.parametrize("kind", KINDS)
def test_dpo(tmp_path, kind):
    """The reference is the model with the adapter off (no ref_model), as TRL scores it."""
    ref, ours = dpo_parity._pair(tmp_path, with_ref=False, peft_config=_config(kind), **NO_CKPT)
    _same_adapter(ref, ours)
    dpo_parity._check(ref, ours)


def _grpo_pair(tmp_path, kind):
    ref_m, our_m = model_pair()
    models = tuple(peft.get_peft_model(m, _config(kind)) for m in (ref_m, our_m))
    models[1].load_state_dict(models[0].state_dict())
    return grpo_parity._make_pair(tmp_path, models=models, **NO_CKPT)


@pytest.mark.parametrize("kind", KINDS)
def test_grpo(tmp_path, kind):
    p = _grpo_pair(tmp_path, kind)
    settings = {"loss_type": "grpo", "importance_sampling_level": "sequence"}
    grpo_parity._run(p, settings, use=("old_per_token_logps",))


@pytest.mark.parametrize("kind", KINDS)
def test_rloo(tmp_path, kind):
    ref_m, our_m = model_pair()
    models = tuple(peft.get_peft_model(m, _config(kind)) for m in (ref_m, our_m))
    models[1].load_state_dict(models[0].state_dict())
    p = rloo_parity._make_pair(tmp_path, models=models, **NO_CKPT)
    # TRL's RLOO copies a PeftModel's adapter to a "ref" adapter, which the loss never reaches (TRL leaves it
    # requiring grad, with no gradient): frozen here for both, so that every trainable parameter is compared.
    for tr in p[:2]:
        for name, param in tr.model.named_parameters():
            if ".ref." in name:
                param.requires_grad_(False)
    rloo_parity._run(p, {"epsilon_high": 0.5})


def _orpo(tmp_path, chunked: bool, kind: str, model=None):
    cls, cfg_cls = (ChunkedORPOTrainer, ChunkedORPOConfig) if chunked else (ORPOTrainer, ORPOConfig)
    extra = {"chunk_size": 11, "chunk_compile": False} if chunked else {}
    return cls(
        model if model is not None else model_pair()[0],
        cfg_cls(**common_args(tmp_path, max_length=48, **NO_CKPT), **extra),
        train_dataset=tiny_dataset("orpo", 8),
        processing_class=tokenizer(),
        peft_config=_config(kind),
    )


def test_orpo_prefix_tuning(tmp_path):
    ref_m, our_m = model_pair()
    ref, ours = _orpo(tmp_path, False, "prefix_tuning", ref_m), _orpo(tmp_path, True, "prefix_tuning", our_m)
    _same_adapter(ref, ours)
    check_orpo_step(ref, ours)


@pytest.mark.parametrize("kind", ["prompt_tuning", "p_tuning"])
def test_orpo_refuses_virtual_tokens(tmp_path, kind):
    """TRL's ORPOTrainer fails on these mid-training (its logits carry the virtual tokens, its labels do
    not): checked, then ours refuses them when built."""
    trl_trainer = _orpo(tmp_path, False, kind)
    batch = trl_trainer._prepare_inputs(
        trl_trainer.data_collator([trl_trainer.train_dataset[i] for i in range(2)])
    )
    with pytest.raises(ValueError):
        trl_trainer.compute_loss(trl_trainer.model, batch)
    with pytest.raises(ValueError, match=f"ChunkedORPOTrainer does not support PEFT {kind}"):
        _orpo(tmp_path, True, kind)


def test_gkd_prefix_tuning(tmp_path):
    ref_m, our_m = model_pair()
    models = tuple(peft.get_peft_model(m, _config("prefix_tuning")) for m in (ref_m, our_m))
    models[1].load_state_dict(models[0].state_dict())
    ref, ours = gkd_parity._pair(tmp_path, models=models, **NO_CKPT)
    gkd_parity._check(ref, ours)


@pytest.mark.parametrize("kind", ["prompt_tuning", "p_tuning"])
def test_gkd_refuses_virtual_tokens(tmp_path, kind):
    """TRL's GKDTrainer stacks the student's lengthened logits with the teacher's and fails mid-training."""
    with pytest.raises(ValueError, match=f"ChunkedGKDTrainer does not support PEFT {kind}"):
        ChunkedGKDTrainer(
            model_pair()[0],
            teacher_model(),
            ChunkedGKDConfig(**common_args(tmp_path, max_length=64, lmbda=0.0, **NO_CKPT)),
            train_dataset=tiny_dataset("gkd", n=8),
            processing_class=tokenizer(),
            peft_config=_config(kind),
        )


@pytest.mark.parametrize("kind", KINDS)
def test_distillation_refuses_prompt_learning(tmp_path, kind):
    """TRL's DistillationTrainer refuses prompt learning in its constructor; so does ours (its message)."""
    with pytest.raises(ValueError, match="Prompt-learning PEFT methods"):
        ChunkedDistillationTrainer(
            model_pair()[0],
            teacher_model(),
            ChunkedDistillationConfig(**common_args(tmp_path, max_completion_length=6, **NO_CKPT)),
            train_dataset=tiny_dataset("distillation", n=8),
            processing_class=tokenizer(),
            peft_config=_config(kind),
        )


def test_prefix_tuning_with_gradient_checkpointing_refused(tmp_path):
    """TRL's trainer fails mid-training (the checkpointed layers drop the prefix's keys and values); ours
    refuses at construction."""
    args = {**common_args(tmp_path, max_length=64, max_steps=1), _CKPT: True}
    trl_trainer = SFTTrainer(
        model_pair()[0],
        SFTConfig(**args),
        train_dataset=tiny_dataset("sft", n=8),
        processing_class=tokenizer(),
        peft_config=_config("prefix_tuning"),
    )
    with pytest.raises(RuntimeError, match="must match the size"):
        trl_trainer.train()
    with pytest.raises(ValueError, match="prefix tuning with gradient_checkpointing=True"):
        ChunkedSFTTrainer(
            model_pair()[0],
            ChunkedSFTConfig(**args, chunk_compile=False),
            train_dataset=tiny_dataset("sft", n=8),
            processing_class=tokenizer(),
            peft_config=copy.deepcopy(_config("prefix_tuning")),
        )


def test_virtual_tokens_lengthen_hidden_states(tmp_path):
    """The case the left padding exists for: prompt tuning's hidden states are longer than the labels."""
    _, ours = sft_parity._pair(tmp_path, peft_config=_config("prompt_tuning"), **NO_CKPT)
    batch = sft_parity._batch(ours)
    seen = []
    ours.model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        chunked_head=lambda hidden, head: seen.append(hidden.shape[1]),
    )
    assert seen == [batch["input_ids"].shape[1] + 4]
    assert torch.isfinite(sft_parity._step(ours, batch))
