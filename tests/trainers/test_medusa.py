"""ChunkedMedusaTrainer: one batch against Medusa's loss on materialised logits (stages 1 and 2), what trains
in each stage, a short run whose loss falls, the saved heads, and refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunkloss.data import tiny_dataset, tiny_model
from chunkloss.heads import load_medusa_heads
from chunkloss.trainers.medusa import ChunkedMedusaConfig, ChunkedMedusaTrainer
from tests.trainers.helpers import common_args, tokenizer

K = 3


def _trainer(tmp_path, stage=1, share=False, n=8, **cfg):
    torch.manual_seed(0)
    model = tiny_model(tokenizer(), "qwen3", hidden_size=32, num_layers=1)
    args = ChunkedMedusaConfig(
        **common_args(tmp_path, max_length=64, **cfg),
        medusa_num_heads=K,
        medusa_stage=stage,
        medusa_share_lm_head=share,
        medusa_base_weight=0.5,
        chunk_size=7,
        chunk_compile=False,
    )
    trainer = ChunkedMedusaTrainer(
        model, args, train_dataset=tiny_dataset("sft", n=n), processing_class=tokenizer()
    )
    # Zero-initialised blocks make every head start as the base head's features; random ones test more.
    with torch.no_grad():
        for p in trainer.medusa_heads.blocks.parameters():
            p.normal_(0, 0.1)
    return trainer


def _batch(trainer):
    examples = [trainer.train_dataset[i] for i in range(4)]
    return trainer._prepare_inputs(trainer.data_collator(examples))


def _reference_loss(trainer, batch):
    """Medusa's loss on materialised logits (in the model's dtype): head k (1-based) at position t predicts
    the label k places after the base head's; stage 2 adds λ₀ times the base head's cross-entropy."""
    model, heads, args = trainer.model, trainer.medusa_heads, trainer.args
    hidden = model.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    hidden, target = hidden[:, :-1], batch["labels"][:, 1:]
    base_w = model.lm_head.weight
    loss = 0.0
    if args.medusa_stage == 2:
        loss = args.medusa_base_weight * F.cross_entropy(
            (hidden @ base_w.t()).flatten(0, 1), target.flatten()
        )
    t = hidden.shape[1]
    for k in range(1, K + 1):
        feats = heads.blocks[k - 1](hidden[:, : t - k])
        w = base_w if heads.share_lm_head else heads.lm_heads[k - 1].weight
        z = feats @ w.t()
        loss = loss + args.medusa_decay**k * F.cross_entropy(z.flatten(0, 1), target[:, k:].flatten())
    return loss


@pytest.mark.parametrize("share", [False, True], ids=["own_heads", "shared_head"])
@pytest.mark.parametrize("stage", [1, 2])
def test_loss_and_gradients_match_materialised_medusa(tmp_path, stage, share):
    trainer = _trainer(tmp_path, stage, share)
    batch = _batch(trainer)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad()
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    if stage == 1:
        assert trainable and all(n.startswith("medusa_heads.") for n in trainable)
    else:
        assert "model.embed_tokens.weight" in trainable and "lm_head.weight" in trainable
    assert set(grads) == trainable
    ref_model = trainer.model.double()  # the reference in fp64
    ref = _reference_loss(trainer, batch)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    ref_params = dict(ref_model.named_parameters())
    for name, g in grads.items():
        torch.testing.assert_close(g.double(), ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_stage_1_backbone_runs_without_autograd(tmp_path):
    trainer = _trainer(tmp_path, stage=1)
    seen = []
    trainer.model.model.layers[0].register_forward_hook(lambda m, i, o: seen.append(torch.is_grad_enabled()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, dict(_batch(trainer)))
    assert seen == [False] and loss.requires_grad


@pytest.mark.parametrize("stage", [1, 2])
def test_short_run_trains_heads_logs_and_saves_them(tmp_path, stage):
    trainer = _trainer(tmp_path, stage, n=64, max_steps=12, learning_rate=1e-2, per_device_eval_batch_size=4)
    backbone = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "medusa" not in n}
    heads = {n: p.detach().clone() for n, p in trainer.medusa_heads.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[-1]["loss"] < logs[0]["loss"]
    for k in range(1, K + 1):
        assert f"medusa{k}/loss" in logs[0] and f"medusa{k}/mean_token_accuracy" in logs[0]
    assert ("mean_token_accuracy" in logs[0]) == (stage == 2)
    moved = any(not torch.equal(p, backbone[n]) for n, p in trainer.model.named_parameters() if n in backbone)
    assert moved == (stage == 2)
    assert all(not torch.equal(p, heads[n]) for n, p in trainer.medusa_heads.named_parameters())
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.medusa_num_heads == K
    reloaded = load_medusa_heads(loaded, str(out))
    for n, p in trainer.medusa_heads.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[n], p)


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="packing or padding_free"):
        _trainer(tmp_path, padding_free=True)
    with pytest.raises(ValueError, match="medusa_stage must be 1 or 2"):
        ChunkedMedusaConfig(**common_args(tmp_path), medusa_stage=3)
    with pytest.raises(ValueError, match="medusa_num_heads"):
        ChunkedMedusaConfig(**common_args(tmp_path), medusa_num_heads=0)


def test_stage_2_starts_from_the_saved_stage_1_heads(tmp_path):
    first = _trainer(tmp_path, stage=1)
    out = tmp_path / "stage1"
    first.save_model(str(out))
    args = ChunkedMedusaConfig(
        **common_args(tmp_path / "stage2", max_length=64), medusa_num_heads=K, medusa_stage=2
    )
    second = ChunkedMedusaTrainer(
        str(out), args, train_dataset=tiny_dataset("sft", n=8), processing_class=tokenizer()
    )
    for (n, p), q in zip(first.medusa_heads.state_dict().items(), second.medusa_heads.state_dict().values()):
        torch.testing.assert_close(q, p, msg=n)
    assert all(p.requires_grad for p in second.model.parameters())
