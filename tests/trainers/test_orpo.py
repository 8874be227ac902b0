"""ChunkedORPOTrainer against trl.experimental.orpo.ORPOTrainer (which materialises the logits): one batch
from one state, equal loss, gradients and logged metrics."""

from __future__ import annotations

import pytest
from chunkloss.trainers.orpo import ChunkedORPOConfig, ChunkedORPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from chunkloss.data import tiny_dataset
from tests.trainers.helpers import assert_close_loss, assert_same_grads, common_args, model_pair, tokenizer


def _pair(tmp_path, compile_=False, model_kw=None, **cfg):
    ref_m, our_m = model_pair(**(model_kw or {}))
    ds = tiny_dataset("orpo", n=8)
    base = common_args(tmp_path, max_length=48, **cfg)
    ref = ORPOTrainer(ref_m, ORPOConfig(**base), train_dataset=ds, processing_class=tokenizer())
    ours = ChunkedORPOTrainer(
        our_m,
        ChunkedORPOConfig(**base, chunk_size=11, chunk_compile=compile_),
        train_dataset=ds,
        processing_class=tokenizer(),
    )
    return ref, ours


def _check(ref, ours):
    batch = ref._prepare_inputs(ref.data_collator([ref.train_dataset[i] for i in range(4)]))
    results = []
    for tr in (ref, ours):
        tr.model.train()
        tr._stored_metrics.clear()
        loss = tr.compute_loss(tr.model, dict(batch))
        loss.backward()
        results.append(loss)
    assert_close_loss(results[1], results[0])
    assert_same_grads(ref.model, ours.model)
    m_ref, m_our = ref._stored_metrics["train"], ours._stored_metrics["train"]
    assert sorted(m_ref) == sorted(m_our)
    for key in m_ref:
        assert m_our[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_parity(tmp_path, beta):
    _check(*_pair(tmp_path, beta=beta))


def test_orpo_tied_embeddings(tmp_path):
    _check(*_pair(tmp_path, model_kw={"tie_word_embeddings": True}))


@pytest.mark.parametrize(
    "family,overrides", [("gemma2", {"final_logit_softcapping": 3.0}), ("cohere", {"logit_scale": 0.5})]
)
def test_orpo_head_transforms(tmp_path, family, overrides):
    """Gemma-2's final logit softcapping and Cohere's logit scale: TRL's ORPO applies them in the model's
    forward logits, ours in the chunked loss (also in the logits/* metrics)."""
    ref, ours = _pair(tmp_path, model_kw=dict(family=family, **overrides))
    assert ours._orpo_loss.options.softcap == overrides.get("final_logit_softcapping")
    assert ours._orpo_loss.options.logit_scale == overrides.get("logit_scale", 1.0)
    _check(ref, ours)


def test_orpo_compiled(tmp_path):
    _check(*_pair(tmp_path, compile_=True))
