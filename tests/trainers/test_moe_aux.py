"""The MoE router load-balancing loss through ChunkedGRPOTrainer, ChunkedDPOTrainer and ChunkedORPOTrainer
against TRL's trainers: one batch from one state, equal loss and gradients (the router's included), with the
coefficient set and at zero. The aux term is checked to be there, so that the parity cannot pass with both
sides dropping it: the loss at coefficient c minus the loss at 0 is c times the model's own aux loss (its
``output_router_logits`` forward), and the router's gradient moves.

How TRL 1.16 turns it on: GRPO and DPO take ``args.router_aux_loss_coef`` (enabled for a config with
``output_router_logits``; the trainer's ``router_aux_loss_coef``); the experimental ORPO takes the model
config's ``output_router_logits=True`` and ``router_aux_loss_coef`` (the trainer's ``aux_loss_coef``).
"""

from __future__ import annotations

import pytest
import torch
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from chunkloss.data import count_reward, tiny_dataset
from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer
from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer
from chunkloss.trainers.orpo import ChunkedORPOConfig, ChunkedORPOTrainer
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import (
    MOE,
    assert_close_loss,
    assert_same_grads,
    common_args,
    model_pair,
    stored_metrics,
    tokenizer,
)

# Large enough that the aux term's share of the router's gradient stands far above the parity tolerances.
COEF = 0.5
GATE = "model.layers.0.mlp.gate.weight"


def _loss_and_grads(tr, loss_fn):
    tr.model.train()
    tr.model.zero_grad()
    loss = loss_fn(tr)
    loss.backward()
    return loss.detach(), tr.model.get_parameter(GATE).grad.clone()


def _check(ref, ours, loss_fn, coef_attr, model_aux, ga=1):
    """TRL against ours at ``COEF`` and at 0 (the trainer's coefficient ``coef_attr`` set to 0: what the loss
    reads); the difference is ``COEF · model_aux / ga``."""
    assert ref.aux_loss_enabled and ours.aux_loss_enabled
    assert getattr(ref, coef_attr) == getattr(ours, coef_attr) == COEF
    runs = {}
    for coef in (COEF, 0.0):
        for tr in (ref, ours):
            setattr(tr, coef_attr, coef)
        l_ref, _ = _loss_and_grads(ref, loss_fn)
        l_our, gate_our = _loss_and_grads(ours, loss_fn)
        assert_close_loss(l_our, l_ref)
        assert_same_grads(ref.model, ours.model)
        runs[coef] = l_our, gate_our
    (l_c, gate_c), (l_0, gate_0) = runs[COEF], runs[0.0]
    assert model_aux > 0
    assert_close_to_ref(l_c - l_0, torch.tensor(COEF * model_aux / ga))
    # The aux term's share of the router's gradient (measured: about as large as the whole gradient; the
    # parity tolerance is 1e-5 of it).
    assert (gate_c - gate_0).abs().max() > 0.1 * gate_c.abs().max()


def _model_aux(model, input_ids, attention_mask) -> float:
    """The model's own load-balancing loss (transformers' forward with ``output_router_logits``)."""
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
    return out.aux_loss.item()


def test_grpo_moe_aux_loss(tmp_path):
    """Gradient accumulation 2: TRL divides the aux term by it (its policy loss is already scaled)."""
    ref_m, our_m = model_pair(**MOE)
    ds = tiny_dataset("grpo", n=8)
    base = common_args(tmp_path, num_generations=2, max_completion_length=6, router_aux_loss_coef=COEF)
    ref = GRPOTrainer(ref_m, count_reward, GRPOConfig(**base), train_dataset=ds, processing_class=tokenizer())
    ours = ChunkedGRPOTrainer(
        our_m,
        count_reward,
        ChunkedGRPOConfig(**base, chunk_size=5, chunk_compile=False),
        train_dataset=ds,
        processing_class=tokenizer(),
    )
    for tr in (ref, ours):
        tr.current_gradient_accumulation_steps = 2
        tr.model.train()
    torch.manual_seed(0)
    inputs = ref._prepare_inputs(next(iter(ref.get_train_dataloader())))
    mask = inputs["completion_mask"].clone()
    mask[0, 3:] = 0  # uneven lengths: the aux loss averages over attended tokens only
    inputs["completion_mask"] = mask
    inputs["advantages"] = torch.randn(mask.size(0), generator=torch.Generator().manual_seed(0))
    inputs["num_items_in_batch"] = mask.sum().float()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], mask], 1)

    def loss_fn(tr):
        tr._metrics["train"].clear()
        return tr._compute_loss(tr.model, dict(inputs))

    _check(ref, ours, loss_fn, "router_aux_loss_coef", _model_aux(ref.model, ids, att), ga=2)
    assert stored_metrics(ours)["aux_loss"] == pytest.approx(stored_metrics(ref)["aux_loss"], rel=1e-5)


def test_dpo_moe_aux_loss(tmp_path):
    ref_m, our_m = model_pair(**MOE)
    refs = model_pair(seed=1, **MOE)
    ds = tiny_dataset("dpo", n=8)
    base = common_args(tmp_path, max_length=48, router_aux_loss_coef=COEF)
    ref = DPOTrainer(ref_m, refs[0], DPOConfig(**base), train_dataset=ds, processing_class=tokenizer())
    ours = ChunkedDPOTrainer(
        our_m,
        refs[1],
        ChunkedDPOConfig(**base, chunk_size=9, chunk_compile=False),
        train_dataset=ds,
        processing_class=tokenizer(),
    )
    batch = ref._prepare_inputs(ref.data_collator([ref.train_dataset[i] for i in range(4)]))

    def loss_fn(tr):
        tr._metrics["train"].clear()
        return tr.compute_loss(tr.model, dict(batch))

    aux = _model_aux(ref.model, batch["input_ids"], batch["attention_mask"])
    _check(ref, ours, loss_fn, "router_aux_loss_coef", aux)
    m_ref, m_our = stored_metrics(ref), stored_metrics(ours)
    assert sorted(m_ref) == sorted(m_our)
    for key in m_ref:
        assert m_our[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-6), key


def test_orpo_moe_aux_loss(tmp_path):
    ref_m, our_m = model_pair(**MOE, output_router_logits=True, router_aux_loss_coef=COEF)
    ds = tiny_dataset("orpo", n=8)
    base = common_args(tmp_path, max_length=48)
    ref = ORPOTrainer(ref_m, ORPOConfig(**base), train_dataset=ds, processing_class=tokenizer())
    ours = ChunkedORPOTrainer(
        our_m,
        ChunkedORPOConfig(**base, chunk_size=11, chunk_compile=False),
        train_dataset=ds,
        processing_class=tokenizer(),
    )
    batch = ref._prepare_inputs(ref.data_collator([ref.train_dataset[i] for i in range(4)]))
    cat = ref.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=ref.padding_value)

    def loss_fn(tr):
        tr._stored_metrics.clear()
        return tr.compute_loss(tr.model, dict(batch))

    aux = _model_aux(ref.model, cat["concatenated_input_ids"], cat["concatenated_attention_mask"])
    _check(ref, ours, loss_fn, "aux_loss_coef", aux)
    m_ref, m_our = stored_metrics(ref, "_stored_metrics"), stored_metrics(ours, "_stored_metrics")
    assert sorted(m_ref) == sorted(m_our)
    for key in m_ref:
        assert m_our[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-6), key
