"""ChunkedORPOTrainer against trl.experimental.orpo.ORPOTrainer (which materialises the logits): one batch
from one state, equal loss, gradients and logged metrics."""

from __future__ import annotations

import pytest
import torch
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from chunkloss.data import tiny_dataset
from chunkloss.trainers.orpo import ChunkedORPOConfig, ChunkedORPOTrainer
from tests.trainers.helpers import (
    assert_close_loss,
    assert_same_grads,
    check_orpo_step,
    common_args,
    grads,
    model_pair,
    stored_metrics,
    tokenizer,
)


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


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_parity(tmp_path, beta):
    check_orpo_step(*_pair(tmp_path, beta=beta))


def test_orpo_tied_embeddings(tmp_path):
    check_orpo_step(*_pair(tmp_path, model_kw={"tie_word_embeddings": True}))


@pytest.mark.parametrize(
    "family,overrides", [("gemma2", {"final_logit_softcapping": 3.0}), ("cohere", {"logit_scale": 0.5})]
)
def test_orpo_head_transforms(tmp_path, family, overrides):
    """Gemma-2's final logit softcapping and Cohere's logit scale: TRL's ORPO applies them in the model's
    forward logits, ours in the chunked loss (also in the logits/* metrics)."""
    ref, ours = _pair(tmp_path, model_kw=dict(family=family, **overrides))
    assert ours._orpo_loss.options.softcap == overrides.get("final_logit_softcapping")
    assert ours._orpo_loss.options.logit_scale == overrides.get("logit_scale", 1.0)
    check_orpo_step(ref, ours)


def test_orpo_compiled(tmp_path):
    check_orpo_step(*_pair(tmp_path, compile_=True))


# Gradient accumulation. TRL's ORPOTrainer sets loss_is_scaled_for_ga=False and never sees a
# num_items_in_batch (its batches carry no "labels"), so Trainer.training_step divides each micro-batch's
# loss by GA. The odds-ratio term is a mean over pairs, the NLL a token mean over the micro-batch's chosen
# rows: two micro-batches of as many pairs and as many chosen tokens sum to exactly the loss of the one large
# batch; with unequal token counts they do not, in TRL as in ours.


def _slice(batch, rows):
    return {k: v[rows] if isinstance(v, torch.Tensor) else [v[i] for i in rows] for k, v in batch.items()}


def _accumulate(tr, batches, ga):
    """Trainer.training_step on each batch at GA=``ga`` from zero gradients; the summed loss."""
    tr.current_gradient_accumulation_steps = ga  # set by the training loop, which this test skips
    tr.model.zero_grad()
    tr._stored_metrics.clear()
    return sum(tr.training_step(tr.model, dict(b), None) for b in batches)


def test_orpo_gradient_accumulation(tmp_path):
    """Two micro-batches at GA=2 through Trainer.training_step: ours equals TRL's accumulation (loss,
    gradients, metrics per micro-batch) and, with equal chosen-token counts, TRL's one large batch."""
    ref, ours = _pair(tmp_path, beta=0.5, gradient_accumulation_steps=2)
    big = ref._prepare_inputs(ref.data_collator([ref.train_dataset[i] for i in range(4)]))
    # Micro-batches cut from the one padded batch: every row sees the same padding as in the large batch.
    nll_tokens = (big["chosen_attention_mask"][:, 1:] == 1).sum(1).tolist()
    even, uneven = [[0, 2], [1, 3]], [[0, 1], [2, 3]]
    assert [sum(nll_tokens[i] for i in rows) for rows in even] == [23, 23]
    assert [sum(nll_tokens[i] for i in rows) for rows in uneven] == [24, 22]
    assert ref._get_num_items_in_batch([_slice(big, rows) for rows in even], torch.device("cpu")) is None

    for split, exact in ((uneven, False), (even, True)):
        micro = [_slice(big, rows) for rows in split]
        l_ref = _accumulate(ref, micro, 2)
        l_our = _accumulate(ours, micro, 2)
        assert_close_loss(l_our, l_ref)
        assert_same_grads(ref.model, ours.model)
        m_ref, m_our = stored_metrics(ref, "_stored_metrics"), stored_metrics(ours, "_stored_metrics")
        assert sorted(m_ref) == sorted(m_our) and len(m_ref["nll_loss"]) == 2
        for key in m_ref:
            assert m_our[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-6), key
        l_big = _accumulate(ref, [big], 1)
        if exact:
            assert_close_loss(l_our, l_big)
            assert_same_grads(ref.model, ours.model)
        else:  # a token mean per micro-batch: the comparison with TRL above tells the normalisations apart
            g_our, g_big = grads(ours.model), grads(ref.model)
            assert max(float((g_our[k] - g_big[k]).abs().max() / g_big[k].abs().max()) for k in g_big) > 1e-3
