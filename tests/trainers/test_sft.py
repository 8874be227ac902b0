"""ChunkedSFTTrainer against TRL's SFTTrainer: one batch from one state: equal loss, metrics, grads."""

from __future__ import annotations

import copy

import pytest
import torch
from trl import SFTConfig, SFTTrainer

from chunkloss.data import tiny_dataset
from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer
from tests.trainers.helpers import (
    MOE,
    assert_close_loss,
    assert_same_grads,
    common_args,
    logged_metrics,
    model_pair,
    tokenizer,
)


def _pair(tmp_path, kind="sft", model_kw=None, models=None, peft_config=None, **cfg):
    ref_model, our_model = models or model_pair(**(model_kw or {}))
    ds = tiny_dataset(kind, n=8)
    base = common_args(tmp_path, **{"max_length": 64, **cfg})
    ref = SFTTrainer(
        ref_model,
        SFTConfig(**base),
        train_dataset=ds,
        processing_class=tokenizer(),
        peft_config=copy.deepcopy(peft_config),
    )
    ours = ChunkedSFTTrainer(
        our_model,
        ChunkedSFTConfig(**base, chunk_size=7, chunk_compile=False),
        train_dataset=ds,
        processing_class=tokenizer(),
        peft_config=copy.deepcopy(peft_config),
    )
    return ref, ours


def _batch(trainer, lo=0, hi=4):
    examples = [trainer.train_dataset[i] for i in range(lo, hi)]
    return trainer._prepare_inputs(trainer.data_collator(examples))


def _step(trainer, batch, num_items_in_batch=None):
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=num_items_in_batch)
    loss.backward()
    return loss


def _check(ref, ours, num_items_in_batch=None):
    batch = _batch(ref)
    l_ref = _step(ref, batch, num_items_in_batch)
    l_our = _step(ours, batch, num_items_in_batch)
    assert_close_loss(l_our, l_ref)
    assert_same_grads(ref.model, ours.model)
    # As logged (ours fetches its metrics from the device at log time): the same keys and values.
    m_ref, m_our = logged_metrics(ref), logged_metrics(ours)
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(m_ref) and set(m_our) == set(m_ref)
    for key, value in m_ref.items():
        assert isinstance(m_our[key], type(value)), key
        assert m_our[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    return l_our, m_our


@pytest.mark.parametrize(
    "kind,cfg",
    [
        ("sft", {}),  # prompt-completion: completion-only loss (TRL's default there)
        ("sft", {"completion_only_loss": False}),
        ("gkd", {"assistant_only_loss": True}),  # conversational, {% generation %} markers
        ("gkd", {}),
        ("sft", {"label_smoothing_factor": 0.1}),  # TRL materialises the logits here; we do not
        ("sft", {"loss_type": "dft"}),
        ("sft", {"loss_type": "dft", "label_smoothing_factor": 0.1}),  # TRL smooths only "nll"
        ("sft", {"padding_free": True, "max_length": None}),
        # Packed rows of 16 tokens: "bfd" turns padding-free on (position_ids restart per sequence), "wrapped"
        # cuts sequences across rows under a full attention mask.
        ("sft", {"packing": True, "max_length": 16}),
        ("sft", {"packing": True, "packing_strategy": "wrapped", "max_length": 16}),
    ],
    ids=[
        "completion_only",
        "full_sequence",
        "assistant_only",
        "conversational",
        "label_smoothing",
        "dft",
        "dft_label_smoothing",
        "padding_free",
        "packing_bfd",
        "packing_wrapped",
    ],
)
def test_sft_parity(tmp_path, kind, cfg):
    ref, ours = _pair(tmp_path, kind, **cfg)
    loss, _ = _check(ref, ours)
    assert loss.item() > 0


@pytest.mark.parametrize("cfg", [{}, {"label_smoothing_factor": 0.1}], ids=["nll", "label_smoothing"])
def test_sft_num_items_in_batch(tmp_path, cfg):
    """The loss divided by the window's token count; with label smoothing TRL's LabelSmoother takes the count
    too (transformers >= 5.15), for both of its terms."""
    ref, ours = _pair(tmp_path, **cfg)
    _check(ref, ours, num_items_in_batch=torch.tensor(37))


def test_sft_gradient_accumulation_equals_one_batch(tmp_path):
    """Two micro-batches with the window's token count give the gradient of the one large batch."""
    ref, ours = _pair(tmp_path)
    big = _batch(ours, 0, 4)
    micro = [_batch(ours, 0, 2), _batch(ours, 2, 4)]
    n = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)
    assert n == int((big["labels"][:, 1:] != -100).sum())
    _step(ref, big, torch.tensor(n))
    for m in micro:
        _step(ours, m, torch.tensor(n))
    assert_same_grads(ref.model, ours.model)


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen3", {"tie_word_embeddings": True}),
        ("gemma2", {"final_logit_softcapping": 3.0}),
        ("cohere", {"logit_scale": 0.5}),
    ],
)
def test_sft_head_variants(tmp_path, family, overrides):
    kw = dict(overrides)
    if family == "qwen3":
        ref, ours = _pair(tmp_path, model_kw=dict(family=family, **kw))
        assert ours.model.lm_head.weight is ours.model.model.embed_tokens.weight
    else:
        if family == "gemma2":
            kw["final_logit_softcapping"] = overrides["final_logit_softcapping"]
        ref, ours = _pair(tmp_path, model_kw=dict(family=family, **kw))
    _check(ref, ours)


def test_sft_lm_head_bias(tmp_path):
    ref_model, our_model = model_pair()
    torch.manual_seed(1)
    head = torch.nn.Linear(32, ref_model.config.vocab_size, bias=True)
    ref_model.lm_head, our_model.lm_head = head, copy.deepcopy(head)
    ref, ours = _pair(tmp_path, models=(ref_model, our_model))
    _check(ref, ours)
    assert ours.model.lm_head.bias.grad is not None


def test_sft_moe_router_aux_loss(tmp_path):
    ref, ours = _pair(
        tmp_path,
        model_kw=MOE,
        router_aux_loss_coef=0.01,
    )
    assert ours.aux_loss_enabled
    _, logged = _check(ref, ours)
    assert "aux_loss" in logged


def _compiled_pair(tmp_path, **cfg):
    """TRL's trainer and ours with the chunk steps compiled (automatic chunks), on prompt-completion data."""
    ref_model, our_model = model_pair()
    ds = tiny_dataset("sft", n=8)
    base = common_args(tmp_path, max_length=64, **cfg)
    ref = SFTTrainer(ref_model, SFTConfig(**base), train_dataset=ds, processing_class=tokenizer())
    ours = ChunkedSFTTrainer(
        our_model,
        ChunkedSFTConfig(**base, chunk_compile=True),
        train_dataset=ds,
        processing_class=tokenizer(),
    )
    return ref, ours


def test_sft_compiled(tmp_path):
    _check(*_compiled_pair(tmp_path))


def test_sft_lora_on_lm_head_trains(tmp_path):
    """TRL refuses a LoRA adapter on lm_head; ours trains it. Reference: the PEFT model's own loss."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False
    )
    ref_model, our_model = model_pair()
    with pytest.raises(ValueError, match="lm_head"):
        SFTTrainer(
            copy.deepcopy(ref_model),
            SFTConfig(**common_args(tmp_path, max_length=64)),
            train_dataset=tiny_dataset("sft", n=8),
            processing_class=tokenizer(),
            peft_config=cfg,
        )
    ref_peft = peft.get_peft_model(ref_model, copy.deepcopy(cfg))
    ours = ChunkedSFTTrainer(
        our_model,
        ChunkedSFTConfig(**common_args(tmp_path, max_length=64), chunk_size=5, chunk_compile=False),
        train_dataset=tiny_dataset("sft", n=8),
        processing_class=tokenizer(),
        peft_config=cfg,
    )
    ref_peft.load_state_dict(ours.model.state_dict())
    batch = _batch(ours)
    l_our = _step(ours, batch)
    ref_peft.train()
    l_ref = ref_peft(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    ).loss
    l_ref.backward()
    assert_close_loss(l_our, l_ref)
    assert_same_grads(ref_peft, ours.model)
    lora_b = [n for n in dict(ours.model.named_parameters()) if "lm_head.lora_B" in n]
    assert lora_b and ours.model.get_parameter(lora_b[0]).grad.abs().sum() > 0


def test_sft_refuses_compute_loss_func(tmp_path):
    ref_model, _ = model_pair()
    with pytest.raises(ValueError, match="compute_loss_func"):
        ChunkedSFTTrainer(
            ref_model,
            ChunkedSFTConfig(**common_args(tmp_path)),
            train_dataset=tiny_dataset("sft", 8),
            processing_class=tokenizer(),
            compute_loss_func=lambda *a, **k: 0,
        )


def test_sft_refuses_dora_on_lm_head(tmp_path):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, target_modules=["lm_head"], use_dora=True)
    model, _ = model_pair()
    with pytest.raises(ValueError, match="DoRA"):
        ChunkedSFTTrainer(
            model,
            ChunkedSFTConfig(**common_args(tmp_path)),
            train_dataset=tiny_dataset("sft", 8),
            processing_class=tokenizer(),
            peft_config=cfg,
        )


def test_sft_bad_chunk_options(tmp_path):
    model, _ = model_pair()
    with pytest.raises(ValueError, match="chunk_accum_dtype"):
        ChunkedSFTTrainer(
            model,
            ChunkedSFTConfig(**common_args(tmp_path), chunk_accum_dtype="int8"),
            train_dataset=tiny_dataset("sft", 8),
            processing_class=tokenizer(),
        )
