"""ChunkedDPOTrainer against TRL's DPOTrainer: one batch from one state, each loss option, equal loss,
gradients and logged metrics."""

from __future__ import annotations

import pytest
import torch
from trl import DPOConfig, DPOTrainer

from chunkloss.data import tiny_dataset
from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import (
    assert_close_loss,
    check_step,
    common_args,
    grads,
    model_pair,
    reference_pair,
    stored_metrics,
    tokenizer,
)

LOSS_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]  # fmt: skip


def _pair(tmp_path, **kw):
    return reference_pair(
        "dpo", (DPOConfig, DPOTrainer), (ChunkedDPOConfig, ChunkedDPOTrainer), tmp_path, **kw
    )


def _check(ref, ours):
    batch = ref._prepare_inputs(ref.data_collator([ref.train_dataset[i] for i in range(4)]))
    return check_step(ref, ours, batch)[1]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_dpo_loss_types(tmp_path, loss_type):
    cfg = {"label_smoothing": 0.1} if loss_type in ("exo_pair", "robust", "aot", "aot_unpaired") else {}
    # β=0.5 makes the losses bite; discopop's gate σ(β·δ/τ) multiplies the fp32 summation-order difference of
    # δ by β/τ (measured 2e-5 relative on the embedding gradient at β=0.5, τ=0.05), so it keeps TRL's β=0.1.
    beta = 0.1 if loss_type == "discopop" else 0.5
    _check(*_pair(tmp_path, loss_type=[loss_type], beta=beta, **cfg))


@pytest.mark.parametrize(
    "cfg",
    [
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},  # RPO-style mixture
        {"f_divergence_type": "forward_kl"},
        {"f_divergence_type": "js_divergence"},
        {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
        {"ld_alpha": 0.5},
        {"use_weighting": True},
        {"loss_type": ["discopop"], "discopop_tau": 0.2},
        {"label_smoothing": 0.1},  # TRL 1.16's "sigmoid" takes no ε (no cDPO): only robust/exo_pair/aot do
        {"padding_free": True},  # TRL 1.16 turns it off with a warning: padded batches, as without it
    ],
    ids=[
        "mixture",
        "forward_kl",
        "js",
        "alpha",
        "ld_alpha",
        "wpo",
        "discopop_tau",
        "sigmoid_label_smoothing",
        "padding_free",
    ],
)
def test_dpo_options(tmp_path, cfg):
    _check(*_pair(tmp_path, **cfg))


def test_dpo_precomputed_reference(tmp_path):
    ref, ours = _pair(tmp_path, precompute_ref_log_probs=True)
    assert "ref_chosen_logps" in ref.train_dataset.column_names
    _check(ref, ours)


def test_dpo_peft_reference_is_base_model(tmp_path):
    """PEFT without a reference model: the reference is the model with its adapter disabled."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ref, ours = _pair(tmp_path, with_ref=False, peft_config=cfg)
    _check(ref, ours)


def test_dpo_lora_on_lm_head(tmp_path):
    """LoRA on lm_head (TRL refuses it) trains; checked against the PEFT model's materialised logits."""
    peft = pytest.importorskip("peft")
    import torch.nn.functional as F

    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["lm_head"], init_lora_weights=False, lora_dropout=0.0
    )
    _, our_m = model_pair()
    ours = ChunkedDPOTrainer(
        our_m,
        None,
        ChunkedDPOConfig(**common_args(tmp_path, max_length=48), chunk_size=9, chunk_compile=False),
        train_dataset=tiny_dataset("dpo", n=8),
        processing_class=tokenizer(),
        peft_config=cfg,
    )
    batch = ours._prepare_inputs(ours.data_collator([ours.train_dataset[i] for i in range(4)]))
    ours.model.train()
    loss = ours.compute_loss(ours.model, dict(batch))
    loss.backward()
    # Reference: sigmoid DPO from the same PEFT model's materialised logits, the reference with the adapter
    # disabled.
    model = ours.model
    ours_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)[:, 1:]

    def seq_logps():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (lp * (labels != -100)).sum(1)

    with torch.no_grad(), model.disable_adapter():
        ref_lp = seq_logps()
    lp = seq_logps()
    n = lp.shape[0] // 2
    delta = (lp[:n] - ref_lp[:n]) - (lp[n:] - ref_lp[n:])
    expected = -F.logsigmoid(0.1 * delta).mean()
    expected.backward()
    assert_close_loss(loss, expected)
    assert sorted(ours_grads) == sorted(k for k, p in model.named_parameters() if p.grad is not None)
    assert any("lm_head.lora_B" in k for k in ours_grads)
    for k, p in model.named_parameters():
        if p.grad is not None:
            assert_close_to_ref(ours_grads[k], p.grad, name=k)


def test_dpo_compiled(tmp_path):
    _check(*_pair(tmp_path, compile_=True))


@pytest.mark.parametrize(
    "family,overrides", [("gemma2", {"final_logit_softcapping": 3.0}), ("cohere", {"logit_scale": 0.5})]
)
def test_dpo_head_transforms(tmp_path, family, overrides):
    """Gemma-2's final logit softcapping and Cohere's logit scale: TRL applies them in its fused head (policy
    and reference), ours in the chunked loss (the reference's log-probs come from TRL)."""
    ref, ours = _pair(
        tmp_path,
        models=model_pair(family=family, **overrides),
        ref_models=model_pair(family=family, seed=1, **overrides),
    )
    assert ours._dpo_loss.options.softcap == overrides.get("final_logit_softcapping")
    assert ours._dpo_loss.options.logit_scale == overrides.get("logit_scale", 1.0)
    _check(ref, ours)


# Gradient accumulation. TRL 1.16's DPOTrainer ignores num_items_in_batch and sets
# loss_is_scaled_for_ga=False, so Trainer.training_step divides each micro-batch's loss (a mean over its
# pairs) by GA: equal-sized micro-batches sum to exactly the loss of the one large batch for per-pair losses
# such as "sigmoid" (not so for the "sft" term, a token mean per micro-batch, so the mixture is compared
# against TRL only).


def _accumulate(tr, batches, ga, num_items_in_batch=None):
    """Trainer.training_step on each batch at GA=``ga``: summed loss, accumulated gradients, metrics."""
    tr.current_gradient_accumulation_steps = ga  # set by the training loop, which this test skips
    tr.model.zero_grad()
    tr._metrics["train"].clear()
    total = sum(tr.training_step(tr.model, dict(b), num_items_in_batch) for b in batches)
    return total, grads(tr.model), {k: list(v) for k, v in stored_metrics(tr).items()}


def _assert_grads(g_our, g_ref):
    assert sorted(g_our) == sorted(g_ref)
    for n in g_ref:
        assert_close_to_ref(g_our[n], g_ref[n], name=f"grad {n}")


@pytest.mark.parametrize(
    "cfg,exact",
    [
        ({"loss_type": ["sigmoid"]}, True),
        ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}, False),
    ],
    ids=["sigmoid", "mixture"],
)
def test_dpo_gradient_accumulation(tmp_path, cfg, exact):
    """Two micro-batches at GA=2 through Trainer.training_step: ours equals TRL (loss, gradients, metrics per
    micro-batch) and, where TRL's normalisation makes it exact, the one large batch at GA=1."""
    ref, ours = _pair(tmp_path, beta=0.5, gradient_accumulation_steps=2, **cfg)

    def batch(lo, hi):
        return ref._prepare_inputs(ref.data_collator([ref.train_dataset[i] for i in range(lo, hi)]))

    micro, big = [batch(0, 2), batch(2, 4)], batch(0, 4)
    n = sum(int(b["completion_mask"].sum()) for b in micro)
    assert n == int(big["completion_mask"].sum())
    l_ref, g_ref, m_ref = _accumulate(ref, micro, 2, torch.tensor(n))
    l_our, g_our, m_our = _accumulate(ours, micro, 2, torch.tensor(n))
    assert_close_loss(l_our, l_ref)
    _assert_grads(g_our, g_ref)
    assert sorted(m_our) == sorted(m_ref)
    for key in m_ref:
        assert m_our[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-6), key
    assert len(m_ref["rewards/margins"]) == 2

    l_big, g_big, _ = _accumulate(ref, [big], 1)
    l_big_our, g_big_our, _ = _accumulate(ours, [big], 1)
    assert_close_loss(l_big_our, l_big)
    _assert_grads(g_big_our, g_big)
    if exact:
        assert_close_loss(l_ref, l_big)  # TRL's own guarantee
        _assert_grads(g_ref, g_big)
        assert_close_loss(l_our, l_big)
        _assert_grads(g_our, g_big)


@pytest.mark.parametrize("ld_alpha", [None, 0.5])
def test_dpo_peft_model_with_lm_head_lora_without_ref_model(tmp_path, ld_alpha):
    """Given a PeftModel and no ref_model, TRL scores the reference through a "ref" copy of the adapter with
    its fused head, which reads lm_head.weight alone (measured: sequence log-probs 0.2 to 3.2 nats off the
    PEFT model's own under the "ref" adapter). Ours scores it with the adapter's lm_head: equal to the "ref"
    adapter's materialised log-probs summed over the completion (or ld_alpha-weighted, TRL's own code), with
    the trained "default" adapter moved away from it first."""
    peft = pytest.importorskip("peft")
    from trl.trainer.utils import use_adapter

    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    ours = ChunkedDPOTrainer(
        peft.get_peft_model(model_pair()[0], cfg),
        None,
        ChunkedDPOConfig(**common_args(tmp_path, max_length=48), ld_alpha=ld_alpha, chunk_compile=False),
        train_dataset=tiny_dataset("dpo", 8),
        processing_class=tokenizer(),
    )
    model = ours.model
    assert "ref" in model.peft_config
    with torch.no_grad():  # the policy's adapter moves on in training; the reference must not follow it
        for name, p in model.named_parameters():
            if "lora_B.default" in name:
                p.add_(0.5 * torch.randn_like(p))
    batch = ours._prepare_inputs(ours.data_collator([ours.train_dataset[i] for i in range(4)]))
    got = torch.cat(ours.compute_ref_log_probs(model, batch))

    with torch.no_grad(), use_adapter(model, "ref"):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    tok = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    tok = tok * batch["completion_mask"][:, 1:]
    if ld_alpha is None:  # TRL's combination of the per-token log-probs
        want = tok.sum(1)
    else:
        mask = batch["completion_mask"][:, 1:]
        pos, lens = mask.cumsum(1), mask.sum(1)
        shared = torch.minimum(*lens.chunk(2)).repeat(2)[:, None]
        want = (tok * ((pos > 0) & (pos <= shared))).sum(1) + ld_alpha * (tok * (pos > shared)).sum(1)
    assert_close_to_ref(got, want)
    trl_own = torch.cat(DPOTrainer.compute_ref_log_probs(ours, model, batch))
    assert (trl_own - want).abs().max() > 1e-2  # TRL's head leaves the adapter's lm_head out


def test_dpo_peft_model_with_lm_head_lora_precompute_refused(tmp_path):
    """With precompute_ref_log_probs, TRL scores the reference inside its constructor, before the chunked head
    exists (and while lm_head shows TRL its base layer): the "ref" adapter's lm_head LoRA would be left out of
    the stored log-probs without a word. Refused before anything is computed."""
    peft = pytest.importorskip("peft")
    import chunkloss.trainers.dpo as dpo_mod

    calls = []
    spy = lambda self, model, inputs: calls.append(1)  # noqa: E731
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dpo_mod.DPOTrainer, "compute_ref_log_probs", spy)
        with pytest.raises(ValueError, match="precompute_ref_log_probs"):
            ChunkedDPOTrainer(
                peft.get_peft_model(model_pair()[0], cfg),
                None,
                ChunkedDPOConfig(
                    **common_args(tmp_path, max_length=48), precompute_ref_log_probs=True, chunk_compile=False
                ),
                train_dataset=tiny_dataset("dpo", 8),
                processing_class=tokenizer(),
            )
    assert not calls  # refused before TRL's constructor computed anything
