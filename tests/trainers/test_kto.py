"""ChunkedKTOTrainer against TRL's KTOTrainer: one batch from one state, each loss type and option, equal
loss, gradients and logged metrics; a few optimizer steps from one state, equal parameters."""

from __future__ import annotations

import inspect

import pytest
import torch
from trl import KTOConfig, KTOTrainer

from chunkloss.data import tiny_dataset
from chunkloss.testing.reference import kto_ref
from chunkloss.trainers.kto import ChunkedKTOConfig, ChunkedKTOTrainer
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import (
    assert_close_loss,
    check_step,
    common_args,
    logged_metrics,
    model_pair,
    reference_pair,
    tokenizer,
)


def _pair(tmp_path, **kw):
    return reference_pair(
        "kto", (KTOConfig, KTOTrainer), (ChunkedKTOConfig, ChunkedKTOTrainer), tmp_path, **kw
    )


def _batch(trainer, rows=range(4)):
    return trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in rows]))


def _check(ref, ours, rows=range(4)):
    return check_step(ref, ours, _batch(ref, rows))[2]


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_types(tmp_path, loss_type):
    # β=0.5 and unequal weights make the loss bite on both sides.
    m = _check(*_pair(tmp_path, loss_type=loss_type, beta=0.5, desirable_weight=1.3, undesirable_weight=0.7))
    assert "rewards/margins" in m and ("kl" in m)


@pytest.mark.parametrize("rows", [[0, 2, 4, 6], [1, 3, 5, 7]], ids=["all_desirable", "all_undesirable"])
def test_kto_one_sided_batch(tmp_path, rows):
    """A batch of one side: TRL logs neither that step's margin nor the missing side's metrics."""
    m = _check(*_pair(tmp_path, beta=0.5), rows=rows)
    missing = "rejected" if rows[0] == 0 else "chosen"
    assert "rewards/margins" not in m and not any(k.endswith(missing) for k in m)


def test_kto_kl_term_is_positive_here(tmp_path):
    """The batch's KL term is above its clamp at 0, so the parity above covers its value (the reference is
    another random model: the mismatched completions' log-ratio is far from 0)."""
    ref, ours = _pair(tmp_path)
    m = _check(ref, ours)
    assert m["kl"][0] > 0


def test_kto_precomputed_reference(tmp_path):
    ref, ours = _pair(tmp_path, precompute_ref_log_probs=True)
    assert {"ref_logps", "ref_KL_logps"} <= set(ref.train_dataset.column_names)
    _check(ref, ours)


def test_kto_peft_reference_is_base_model(tmp_path):
    """PEFT without a reference model: the reference is the model with its adapter disabled."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    _check(*_pair(tmp_path, with_ref=False, peft_config=cfg))


def test_kto_compiled(tmp_path):
    _check(*_pair(tmp_path, compile_=True))


@pytest.mark.parametrize(
    "family,overrides", [("gemma2", {"final_logit_softcapping": 3.0}), ("cohere", {"logit_scale": 0.5})]
)
def test_kto_head_transforms(tmp_path, family, overrides):
    """Gemma-2's final logit softcapping and Cohere's logit scale: TRL applies them in its fused head, ours in
    the chunked loss (the no-grad log-probs come from TRL)."""
    ref, ours = _pair(
        tmp_path,
        models=model_pair(family=family, **overrides),
        ref_models=model_pair(family=family, seed=1, **overrides),
    )
    assert ours._kto_loss.options.softcap == overrides.get("final_logit_softcapping")
    assert ours._kto_loss.options.logit_scale == overrides.get("logit_scale", 1.0)
    _check(ref, ours)


def test_kto_training_steps_match(tmp_path):
    """Three SGD steps of Trainer.train from one state: the logged losses and metrics and every parameter at
    the end equal TRL's (fp32 row of tests/tolerances.py)."""
    cfg = dict(max_steps=3, optim="sgd", learning_rate=0.5, beta=0.5)
    ref, ours = _pair(tmp_path, **cfg)
    for tr in (ref, ours):
        tr.train()
    hist_ref = [h for h in ref.state.log_history if "loss" in h]
    hist_our = [h for h in ours.state.log_history if "loss" in h]
    assert len(hist_ref) == len(hist_our) == 3
    for a, b in zip(hist_our, hist_ref):
        assert sorted(a) == sorted(b)
        for key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for (name, p_ref), (_, p_our) in zip(ref.model.named_parameters(), ours.model.named_parameters()):
        assert_close_to_ref(p_our.detach(), p_ref.detach(), name=name)
    moved = sum(not torch.equal(p, q) for p, q in zip(ref.model.parameters(), model_pair()[0].parameters()))
    assert moved > 0


def test_kto_lora_on_lm_head(tmp_path):
    """LoRA on lm_head (TRL refuses it) trains: the policy's and the KL batch's log-probs go through the
    adapter, the reference's through the model with it disabled; checked against the PEFT model's materialised
    logits and ``kto_ref``'s formula."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["lm_head"], init_lora_weights=False, lora_dropout=0.0
    )
    ours = ChunkedKTOTrainer(
        model_pair()[1],
        None,
        ChunkedKTOConfig(**common_args(tmp_path, max_length=48), chunk_compile=False),
        train_dataset=tiny_dataset("kto", n=8),
        processing_class=tokenizer(),
        peft_config=cfg,
    )
    batch = _batch(ours)
    model = ours.model
    model.train()
    loss = ours.compute_loss(model, dict(batch))
    loss.backward()
    ours_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    assert any("lm_head.lora_B" in k for k in ours_grads)
    model.zero_grad()

    def hidden_and_labels(prefix):
        ids, att = batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"]
        labels = ids.masked_fill(batch[f"{prefix}completion_mask"] == 0, -100)[:, 1:]
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        return logits, labels

    def seq_logps(prefix):
        logits, labels = hidden_and_labels(prefix)
        lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return (lp * (labels != -100)).sum(1)

    with torch.no_grad():
        kl_logps = seq_logps("KL_")
        with model.disable_adapter():
            ref_logps, ref_kl_logps = seq_logps(""), seq_logps("KL_")
        # The KL batch's log-probs through the adapter (the KL term is clamped at 0 on this batch, so the loss
        # alone would not show them): TRL's fused head leaves the adapter's lm_head out.
        assert_close_to_ref(ours._compute_kl_logps(model, batch), kl_logps)
        assert (KTOTrainer._compute_kl_logps(ours, model, batch) - kl_logps).abs().max() > 1e-2
    logits, labels = hidden_and_labels("")
    eye = torch.eye(logits.shape[-1])
    expected, _ = kto_ref(
        logits, eye, labels, batch["label"], ref_logps=ref_logps, kl_logps=kl_logps, ref_kl_logps=ref_kl_logps
    )
    expected.backward()
    assert_close_loss(loss, expected)
    assert sorted(ours_grads) == sorted(k for k, p in model.named_parameters() if p.grad is not None)
    for k, p in model.named_parameters():
        if p.grad is not None:
            assert_close_to_ref(ours_grads[k], p.grad, name=k)


def test_kto_logs_trls_metrics(tmp_path):
    """What ``log`` writes (the stored metrics fetched and averaged): TRL's names and values."""
    ref, ours = _pair(tmp_path)
    _check(ref, ours)
    logged_ref, logged_our = logged_metrics(ref), logged_metrics(ours)
    assert sorted(logged_our) == sorted(logged_ref)
    for key in logged_ref:
        assert logged_our[key] == pytest.approx(logged_ref[key], rel=1e-5, abs=1e-6), key


def test_kto_signature_is_trls():
    mine, theirs = inspect.signature(ChunkedKTOTrainer), inspect.signature(KTOTrainer)
    assert list(mine.parameters) == list(theirs.parameters)
    for name, p in theirs.parameters.items():
        q = mine.parameters[name]
        assert (q.kind, q.default) == (p.kind, p.default), name


def test_kto_refuses_unknown_loss_type(tmp_path):
    with pytest.raises(ValueError, match=r"ChunkedKTOTrainer does not support loss_type='sigmoid'"):
        _pair(tmp_path, loss_type="sigmoid")


def test_kto_peft_model_with_lm_head_lora_precompute_refused(tmp_path):
    """With precompute_ref_log_probs, TRL scores the reference inside its constructor, before the chunked head
    exists: the "ref" adapter's lm_head LoRA would be left out. Refused before anything is computed."""
    peft = pytest.importorskip("peft")
    import chunkloss.trainers.kto as kto_mod

    calls = []
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kto_mod.KTOTrainer, "compute_ref_log_probs", lambda self, m, i: calls.append(1))
        with pytest.raises(ValueError, match="precompute_ref_log_probs"):
            ChunkedKTOTrainer(
                peft.get_peft_model(model_pair()[0], cfg),
                None,
                ChunkedKTOConfig(
                    **common_args(tmp_path, max_length=48), precompute_ref_log_probs=True, chunk_compile=False
                ),
                train_dataset=tiny_dataset("kto", 8),
                processing_class=tokenizer(),
            )
    assert not calls


def test_kto_peft_model_with_lm_head_lora_without_ref_model(tmp_path):
    """Given a PeftModel and no ref_model, TRL scores the reference through a "ref" copy of the adapter with
    its fused head, which reads lm_head.weight alone. Ours scores it with the adapter's lm_head: the "ref"
    adapter's materialised log-probs of the completions and of the KL batch, with the trained "default"
    adapter moved away from it first."""
    peft = pytest.importorskip("peft")
    from trl.trainer.utils import use_adapter

    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    ours = ChunkedKTOTrainer(
        peft.get_peft_model(model_pair()[0], cfg),
        None,
        ChunkedKTOConfig(**common_args(tmp_path, max_length=48), chunk_compile=False),
        train_dataset=tiny_dataset("kto", 8),
        processing_class=tokenizer(),
    )
    model = ours.model
    assert "ref" in model.peft_config
    with torch.no_grad():  # the policy's adapter moves on in training; the reference must not follow it
        for name, p in model.named_parameters():
            if "lora_B.default" in name:
                p.add_(0.5 * torch.randn_like(p))
    batch = _batch(ours)
    got = ours.compute_ref_log_probs(model, batch)

    def seq_logps(prefix):
        ids = batch[f"{prefix}input_ids"]
        logits = model(input_ids=ids, attention_mask=batch[f"{prefix}attention_mask"]).logits.float()
        tok = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        return (tok * batch[f"{prefix}completion_mask"][:, 1:]).sum(1)

    with torch.no_grad(), use_adapter(model, "ref"):
        want = (seq_logps(""), seq_logps("KL_"))
    assert_close_to_ref(got, want)
    trl_own = KTOTrainer.compute_ref_log_probs(ours, model, batch)
    assert (trl_own[0] - want[0]).abs().max() > 1e-2  # TRL's head leaves the adapter's lm_head out
