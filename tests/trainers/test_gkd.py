"""ChunkedGKDTrainer against TRL's experimental GKDTrainer: one training step from one state, equal loss and
gradients; off-policy (lmbda=0), on-policy generation (lmbda=1) and seq_kd under a fixed seed."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from trl.experimental.gkd import GKDConfig, GKDTrainer

from chunkloss.data import tiny_dataset
from chunkloss.trainers.gkd import ChunkedGKDConfig, ChunkedGKDTrainer
from tests.trainers.helpers import (
    MOE,
    assert_close_loss,
    assert_same_grads,
    common_args,
    grads,
    model_pair,
    teacher_model,
    tokenizer,
)


def _pair(tmp_path, models=None, teacher=None, compile=False, chunk_size=7, **cfg):
    ref_model, our_model = models or model_pair()
    teacher = teacher if teacher is not None else teacher_model()
    ds = tiny_dataset("gkd", n=8)
    base = common_args(tmp_path, **{"max_length": 64, "lmbda": 0.0, "max_new_tokens": 6, **cfg})
    ref = GKDTrainer(
        ref_model, copy.deepcopy(teacher), GKDConfig(**base), train_dataset=ds, processing_class=tokenizer()
    )
    ours = ChunkedGKDTrainer(
        our_model,
        copy.deepcopy(teacher),
        ChunkedGKDConfig(**base, chunk_size=chunk_size, chunk_compile=compile),
        train_dataset=ds,
        processing_class=tokenizer(),
    )
    return ref, ours


def _batch(trainer, lo=0, hi=4):
    examples = [trainer.train_dataset[i] for i in range(lo, hi)]
    return trainer._prepare_inputs(trainer.data_collator(examples))


def _train_step(trainer, batch, num_items_in_batch=None, seed=0):
    # Same Python and torch RNG state for both trainers: the lmbda draw and the sampled completions agree.
    random.seed(seed)
    torch.manual_seed(seed)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which these tests skip
    return trainer.training_step(trainer.model, {k: v.clone() for k, v in batch.items()}, num_items_in_batch)


def _check(ref, ours, num_items_in_batch=None):
    batch = _batch(ref)
    l_ref = _train_step(ref, batch, num_items_in_batch)
    l_our = _train_step(ours, batch, num_items_in_batch)
    assert_close_loss(l_our, l_ref)
    assert_same_grads(ref.model, ours.model)
    # GKDTrainer.compute_loss logs no metrics of its own; neither do we.
    assert {k: dict(v) for k, v in ours._metrics.items()} == {k: dict(v) for k, v in ref._metrics.items()}
    return l_our


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])  # forward KL, JSD, reverse KL: three branches
def test_gkd_parity_off_policy(tmp_path, beta):
    ref, ours = _pair(tmp_path, beta=beta)
    assert _check(ref, ours).item() > 0


def test_gkd_parity_on_policy_generation(tmp_path):
    """lmbda=1: the student samples completions (fixed seed); the loss is taken on them."""
    ref, ours = _pair(tmp_path, lmbda=1.0, temperature=0.9)
    _check(ref, ours)


def test_gkd_parity_seq_kd(tmp_path):
    """seq_kd: the teacher samples the completions (fixed seed)."""
    ref, ours = _pair(tmp_path, seq_kd=True)
    _check(ref, ours)


def test_gkd_on_policy_loss_on_generated_batch(tmp_path):
    """The loss call alone on a batch the student generated (labels masked after EOS and over the prompt)."""
    ref, ours = _pair(tmp_path, lmbda=1.0)
    batch = _batch(ref)
    torch.manual_seed(0)
    ids, mask, labels = GKDTrainer.generate_on_policy_outputs(ref.model, batch, ref.generation_config)
    gen = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    assert (labels != -100).any()
    losses = []
    for t in (ref, ours):
        t.model.train()
        losses.append(t.compute_loss(t.model, dict(gen)))
        losses[-1].backward()
    assert_close_loss(losses[1], losses[0])
    assert_same_grads(ref.model, ours.model)


def test_gkd_num_items_in_batch(tmp_path):
    ref, ours = _pair(tmp_path)
    _check(ref, ours, num_items_in_batch=torch.tensor(37))


def test_gkd_temperature_does_not_reach_loss(tmp_path):
    """GKD's args.temperature only samples: TRL's loss call passes none, so at 0.5 the losses still agree."""
    ref, ours = _pair(tmp_path, temperature=0.5)
    _check(ref, ours)


@pytest.mark.parametrize(
    "cfg,model_kw",
    [
        ({"loss_type": "dft"}, {}),
        ({"label_smoothing_factor": 0.1}, {}),
        ({"router_aux_loss_coef": 0.5}, MOE),
    ],
    ids=["dft", "label_smoothing", "moe_router_aux_loss"],
)
def test_gkd_sft_loss_fields(tmp_path, cfg, model_kw):
    """GKDConfig inherits SFTConfig's loss fields, and GKDTrainer.compute_loss reads none of them: the loss
    is the generalized JSD, without DFT, label smoothing or the MoE router loss (the student's config asks for
    its router logits, the loss leaves them out). Ours reads none either."""
    ref, ours = _pair(tmp_path, models=model_pair(**model_kw) if model_kw else None, **cfg)
    if model_kw:
        assert ours.aux_loss_enabled and ours.model.config.output_router_logits
    _check(ref, ours)


@pytest.mark.parametrize(
    "family,overrides",
    [("gemma2", {"final_logit_softcapping": 3.0}), ("cohere", {"logit_scale": 0.5})],
)
def test_gkd_head_transforms(tmp_path, family, overrides):
    """Softcapping and logit scale on both heads, as each model's forward applies them."""
    models = model_pair(family=family, **overrides)
    teacher = teacher_model(family, **{k: 2 * v for k, v in overrides.items()})
    ref, ours = _pair(tmp_path, models=models, teacher=teacher)
    _check(ref, ours)


def test_gkd_lm_head_bias(tmp_path):
    ref_model, our_model = model_pair()
    teacher = teacher_model()
    torch.manual_seed(2)
    head = torch.nn.Linear(32, ref_model.config.vocab_size, bias=True)
    ref_model.lm_head, our_model.lm_head = head, copy.deepcopy(head)
    teacher.lm_head = torch.nn.Linear(48, teacher.config.vocab_size, bias=True)
    ref, ours = _pair(tmp_path, models=(ref_model, our_model), teacher=teacher)
    _check(ref, ours)
    assert ours.model.lm_head.bias.grad is not None


def test_gkd_compiled(tmp_path):
    ref, ours = _pair(tmp_path, compile=True, chunk_size=None)
    _check(ref, ours)


def test_gkd_refuses_compute_metrics(tmp_path):
    model, _ = model_pair()
    with pytest.raises(ValueError, match="compute_metrics"):
        ChunkedGKDTrainer(
            model,
            teacher_model(),
            ChunkedGKDConfig(**common_args(tmp_path)),
            train_dataset=tiny_dataset("gkd", 8),
            processing_class=tokenizer(),
            compute_metrics=lambda p: {},
        )


def test_gkd_bad_chunk_options(tmp_path):
    model, _ = model_pair()
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedGKDTrainer(
            model,
            teacher_model(),
            ChunkedGKDConfig(**common_args(tmp_path), chunk_size=0),
            train_dataset=tiny_dataset("gkd", 8),
            processing_class=tokenizer(),
        )


def test_gkd_lora_on_lm_head_trains(tmp_path):
    """TRL refuses a LoRA adapter on lm_head; ours trains it. Reference: TRL's generalized_jsd_loss on the
    PEFT model's and the teacher's logits."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False
    )
    ref_model, our_model = model_pair()
    teacher = teacher_model()
    args = common_args(tmp_path, max_length=64, lmbda=0.0)
    with pytest.raises(ValueError, match="lm_head"):
        GKDTrainer(
            copy.deepcopy(ref_model),
            copy.deepcopy(teacher),
            GKDConfig(**args),
            train_dataset=tiny_dataset("gkd", n=8),
            processing_class=tokenizer(),
            peft_config=copy.deepcopy(cfg),
        )
    ref_peft = peft.get_peft_model(ref_model, copy.deepcopy(cfg))
    ours = ChunkedGKDTrainer(
        our_model,
        copy.deepcopy(teacher),
        ChunkedGKDConfig(**args, chunk_size=5, chunk_compile=False),
        train_dataset=tiny_dataset("gkd", n=8),
        processing_class=tokenizer(),
        peft_config=cfg,
    )
    ref_peft.load_state_dict(ours.model.state_dict())
    batch = _batch(ours)
    l_our = _train_step(ours, batch)
    ref_peft.train()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=mask).logits
    l_ref = GKDTrainer.generalized_jsd_loss(
        ref_peft(input_ids=ids, attention_mask=mask).logits[:, :-1],
        t_logits[:, :-1],
        labels=batch["labels"][:, 1:],
        beta=0.5,
    )
    l_ref.backward()
    assert_close_loss(l_our, l_ref)
    assert_same_grads(ref_peft, ours.model)
    lora_b = [n for n in dict(ours.model.named_parameters()) if "lm_head.lora_B" in n]
    assert lora_b and ours.model.get_parameter(lora_b[0]).grad.abs().sum() > 0


def test_gkd_evaluate(tmp_path):
    """Evaluation goes through compute_loss(return_outputs=True): same eval_loss, no logits needed."""
    ref, ours = _pair(tmp_path)
    out = []
    for t in (ref, ours):
        t.eval_dataset = tiny_dataset("gkd", n=4)
        out.append(t.evaluate()["eval_loss"])
    assert out[1] == pytest.approx(out[0], rel=1e-5)


def _accumulate(trainer, batches, ga, num_items_in_batch):
    """The training step on each batch at GA=``ga`` from zero gradients (lmbda=0: no generation); the summed
    loss."""
    trainer.current_gradient_accumulation_steps = ga  # set by the training loop, which these tests skip
    trainer.model.zero_grad()
    return sum(
        trainer.training_step(trainer.model, {k: v.clone() for k, v in b.items()}, num_items_in_batch)
        for b in batches
    )


def test_gkd_gradient_accumulation_equals_one_batch(tmp_path):
    """Two micro-batches at GA=2 through the training step, with the num_items_in_batch the Trainer counts
    over both: the loss and gradients of TRL's one large batch at GA=1, and TRL's own accumulation. The
    micro-batches hold unequal label counts, so a mean per micro-batch (num_items_in_batch=None: the Trainer
    then divides each batchmean by GA) gives other gradients."""
    ref, ours = _pair(tmp_path, gradient_accumulation_steps=2)
    big = _batch(ref, 0, 4)
    # Cut from the one (left-)padded batch: every row sees the same padding and positions as in it.
    micro = [{k: v[:2] for k, v in big.items()}, {k: v[2:] for k, v in big.items()}]
    counts = [int((m["labels"][:, 1:] != -100).sum()) for m in micro]
    assert counts[0] != counts[1]
    n = ours._get_num_items_in_batch(micro, torch.device("cpu"))
    assert int(n) == sum(counts) and ours.model_accepts_loss_kwargs  # so training_step does not divide by GA

    l_big = _accumulate(ref, [big], 1, ref._get_num_items_in_batch([big], torch.device("cpu")))
    l_our = _accumulate(ours, micro, 2, n)
    assert_close_loss(l_our, l_big)
    assert_same_grads(ref.model, ours.model)
    l_ref = _accumulate(ref, micro, 2, n)
    assert_close_loss(l_our, l_ref)
    assert_same_grads(ref.model, ours.model)

    g_our = grads(ours.model)
    _accumulate(ours, micro, 2, None)
    g_mean = grads(ours.model)
    assert max(float((g_mean[k] - g_our[k]).abs().max() / g_our[k].abs().max()) for k in g_our) > 1e-3
