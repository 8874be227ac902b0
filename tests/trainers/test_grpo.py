"""ChunkedGRPOTrainer against TRL's GRPOTrainer: one generated batch, each loss option, equal loss, gradients
and logged metrics."""

from __future__ import annotations

import math

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from chunkloss.data import count_reward, tiny_dataset
from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import (
    assert_close_loss,
    assert_same_grads,
    common_args,
    grads,
    model_pair,
    stored_metrics,
    tokenizer,
)

K = 6  # max_completion_length

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


def _build(tmp_path, models=None, compile_=False, **cfg):
    ref_m, our_m = models or model_pair()
    ds = tiny_dataset("grpo", n=8)
    base = common_args(tmp_path, num_generations=2, max_completion_length=K, **cfg)
    ref = GRPOTrainer(ref_m, count_reward, GRPOConfig(**base), train_dataset=ds, processing_class=tokenizer())
    ours = ChunkedGRPOTrainer(
        our_m,
        count_reward,
        ChunkedGRPOConfig(**base, chunk_size=5, chunk_compile=compile_),
        train_dataset=ds,
        processing_class=tokenizer(),
    )
    for tr in (ref, ours):
        tr.current_gradient_accumulation_steps = 2
        tr.model.train()
    return ref, ours


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _make_pair(tmp_path_factory.mktemp("grpo"))


def _make_pair(tmp_path, models=None, **cfg):
    torch.manual_seed(0)
    ref, ours = _build(tmp_path, models=models, **cfg)
    inputs = ref._prepare_inputs(next(iter(ref.get_train_dataloader())))
    g = torch.Generator().manual_seed(0)
    b = inputs["completion_ids"].size(0)
    # Uneven completion lengths (one empty), non-zero advantages, and off-policy old/ref/sampler log-probs.
    mask = inputs["completion_mask"].clone()
    mask[0, 4:] = 0
    mask[1, 2:] = 0
    mask[2, :] = 0
    inputs["completion_mask"] = mask
    inputs["advantages"] = torch.randn(b, generator=g)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], mask], 1)
    with torch.no_grad():
        logps = ref._get_per_token_logps_and_entropies(ref.model, ids, att, K)[0]
    noise = {k: 0.3 * torch.randn(logps.shape, generator=g) for k in ("old", "ref", "sampling")}
    extra = {
        "old_per_token_logps": logps + noise["old"],
        "ref_per_token_logps": logps + noise["ref"],
        "sampling_per_token_logps": logps + noise["sampling"],
        "importance_sampling_ratio": torch.exp(0.2 * torch.randn(logps.shape, generator=g)),
        "tool_mask": (torch.rand(logps.shape, generator=g) > 0.2).long(),
    }
    inputs["num_items_in_batch"] = mask.sum().float()
    return ref, ours, inputs, extra


def _run(pair, settings=None, use=(), args=None):
    """Apply ``settings`` (trainer attributes) and ``args`` (config fields) to both trainers, add the ``use``
    inputs, run both losses and compare loss, gradients and the metrics just logged."""
    ref, ours, inputs, extra = pair
    batch = dict(inputs, **{k: extra[k] for k in use})
    saved = []
    for tr in (ref, ours):
        for k, v in (settings or {}).items():
            saved.append((tr, k, getattr(tr, k)))
            setattr(tr, k, v)
        for k, v in (args or {}).items():
            saved.append((tr.args, k, getattr(tr.args, k)))
            setattr(tr.args, k, v)
        tr._entropy_bonus_enabled = tr.entropy_coef != 0.0
        tr.model.zero_grad()
        tr._metrics["train"].clear()
    try:
        l_ref = ref._compute_loss(ref.model, dict(batch))
        l_ref.backward()
        l_our = ours._compute_loss(ours.model, dict(batch))
        l_our.backward()
        assert_close_loss(l_our, l_ref)
        assert_same_grads(ref.model, ours.model)
        m_ref, m_our = stored_metrics(ref), stored_metrics(ours)
        assert sorted(m_ref) == sorted(m_our)
        for key in m_ref:
            for a, b in zip(m_our[key], m_ref[key]):
                assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-6), key
        return l_our
    finally:
        for obj, k, v in reversed(saved):
            setattr(obj, k, v)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_types(pair, loss_type, level):
    _run(pair, {"loss_type": loss_type, "importance_sampling_level": level}, use=("old_per_token_logps",))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_grpo_on_policy(pair, loss_type):
    """No old log-probs: TRL uses the current ones, detached."""
    _run(pair, {"loss_type": loss_type})


@pytest.mark.parametrize("bias_correction", [True, False])
def test_grpo_kl(pair, bias_correction):
    _run(
        pair,
        {"beta": 0.04},
        use=("old_per_token_logps", "ref_per_token_logps"),
        args={"use_bias_correction_kl": bias_correction},
    )


@pytest.mark.parametrize(
    "name,settings,use,args",
    [
        ("delta", {}, ("old_per_token_logps",), {"delta": 1.1}),
        ("epsilon_high", {"epsilon_high": 0.28}, ("old_per_token_logps",), {}),
        (
            "off_policy_mask",
            {"off_policy_mask_threshold": 0.05},
            ("old_per_token_logps", "sampling_per_token_logps"),
            {},
        ),
        ("top_entropy", {"top_entropy_quantile": 0.5}, ("old_per_token_logps",), {}),
        ("entropy_bonus", {"entropy_coef": 0.01}, ("old_per_token_logps",), {}),
        ("tool_mask", {}, ("old_per_token_logps", "tool_mask"), {}),
        (
            "vllm_is_ratio",
            {"use_vllm": True, "vllm_importance_sampling_correction": True},
            ("old_per_token_logps", "importance_sampling_ratio"),
            {},
        ),
        ("vespo_is_ratio", {"loss_type": "vespo"}, ("old_per_token_logps", "importance_sampling_ratio"), {}),
        (
            "sapo_temps",
            {"loss_type": "sapo"},
            ("old_per_token_logps",),
            {"sapo_temperature_pos": 0.7, "sapo_temperature_neg": 1.3},
        ),
        (
            "vespo_params",
            {"loss_type": "vespo"},
            ("old_per_token_logps",),
            {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.0, "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.0},
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_grpo_options(pair, name, settings, use, args):
    _run(pair, settings, use=use, args=args)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_vllm_sequence_is_ratio(pair, loss_type):
    """vLLM's importance-sampling ratio of TRL's default ``vllm_importance_sampling_mode="sequence_mask"``
    (and "sequence_truncate"): one ratio per sequence, shape (B, 1), 0 where the mask drops the sequence."""
    ref, ours, inputs, extra = pair
    b = inputs["completion_ids"].size(0)
    ratio = torch.exp(0.3 * torch.randn(b, 1, generator=torch.Generator().manual_seed(3)))
    ratio[1] = 0.0
    _run(
        (ref, ours, inputs, {**extra, "importance_sampling_ratio": ratio}),
        {"loss_type": loss_type, "use_vllm": True, "vllm_importance_sampling_correction": True},
        use=("old_per_token_logps", "importance_sampling_ratio"),
    )


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_grpo_cast_lm_head_to_fp32(tmp_path, tie):
    """``cast_lm_head_to_fp32`` on a bf16 model: TRL casts ``lm_head`` to fp32 at construction (with tied
    embeddings, the shared weight too) and projects fp32 hidden states outside autocast; ours casts the
    chunk's inputs the same way. Measured: the backbone's bf16 gradients agree exactly, the head's to 2e-7.
    Ours without the cast would fail (bf16 hidden states against the fp32 head)."""
    models = tuple(m.to(torch.bfloat16) for m in model_pair(tie_word_embeddings=tie))
    p = _make_pair(tmp_path, models=models, cast_lm_head_to_fp32=True)
    ours = p[1]
    assert ours.model.lm_head.weight.dtype == torch.float32
    assert ours.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    _run(p, {"beta": 0.04}, use=("old_per_token_logps", "ref_per_token_logps"))


def test_grpo_eval_mode(pair):
    ref, ours, _, _ = pair
    ref.model.eval()
    ours.model.eval()
    try:
        _run(pair, {"loss_type": "dapo"}, use=("old_per_token_logps",))
    finally:
        ref.model.train()
        ours.model.train()


def test_grpo_train_step_runs(tmp_path):
    """A real optimisation step through Trainer.train: generation, rewards, logging, the chunked loss."""
    _, ours = _build(tmp_path, max_steps=1, learning_rate=1e-2)
    before = ours.model.lm_head.weight.detach().clone()
    out = ours.train()
    assert math.isfinite(out.training_loss)
    assert not torch.equal(before, ours.model.lm_head.weight)
    logged = ours.state.log_history[0]
    for key in ("entropy", "clip_ratio/region_mean", "reward"):
        assert key in logged


def test_grpo_compiled(tmp_path):
    torch.manual_seed(0)
    ref, ours = _build(tmp_path, compile_=True)
    inputs = ref._prepare_inputs(next(iter(ref.get_train_dataloader())))
    inputs["advantages"] = torch.linspace(-1, 1, inputs["advantages"].numel())
    pair = (ref, ours, inputs, {})
    _run(pair, {"loss_type": "dapo"})


def test_grpo_refuses_adaptive_entropy_with_entropy_mask(tmp_path):
    m, _ = model_pair()
    args = ChunkedGRPOConfig(
        **common_args(tmp_path, num_generations=2, max_completion_length=K),
        use_adaptive_entropy=True,
        top_entropy_quantile=0.5,
    )
    with pytest.raises(ValueError, match="use_adaptive_entropy=True with top_entropy_quantile < 1"):
        ChunkedGRPOTrainer(
            m, count_reward, args, train_dataset=tiny_dataset("grpo", 8), processing_class=tokenizer()
        )


@pytest.mark.parametrize(
    "family,overrides", [("gemma2", {"final_logit_softcapping": 3.0}), ("cohere", {"logit_scale": 0.5})]
)
def test_grpo_head_transforms(tmp_path, family, overrides):
    """Gemma-2's final logit softcapping and Cohere's logit scale, with the KL term (reference log-probs) and
    a sampling temperature (a config field: TRL binds it into its fused head at construction): TRL applies
    them in its fused head, ours in the chunked loss."""
    models = model_pair(family=family, **overrides)
    p = _make_pair(tmp_path, models=models, temperature=0.7)
    assert p[1]._grpo_loss().options.softcap == overrides.get("final_logit_softcapping")
    assert p[1]._grpo_loss().options.logit_scale == overrides.get("logit_scale", 1.0)
    _run(
        p,
        {"beta": 0.04, "importance_sampling_level": "sequence"},
        use=("old_per_token_logps", "ref_per_token_logps"),
    )


# Gradient accumulation. TRL 1.16 (GRPOTrainer, loss_is_scaled_for_ga=True, so Trainer.training_step does
# not rescale): num_items_in_batch is the masked-token count of the whole generation batch
# (steps_per_generation = gradient_accumulation_steps micro-batches by default); "dapo" divides each
# micro-batch's token sum by num_items_in_batch · GA / steps_per_generation, "grpo" divides its mean of
# per-sequence means by GA. Both make two equal-sized micro-batches sum to exactly the loss of the one large
# batch at GA=1 (not so "bnpo": a per-micro-batch token mean; measured 2e-2 off on the gradient).


def _concat(micro):
    """The one large batch made of the micro-batches (split from one padded generation batch: same widths)."""
    out = {}
    for k, v in micro[0].items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            out[k] = torch.cat([m[k] for m in micro])
        else:
            assert all(m[k] is v or torch.equal(torch.as_tensor(m[k]), torch.as_tensor(v)) for m in micro), k
            out[k] = v
    return out


@pytest.fixture(scope="module")
def accum(tmp_path_factory):
    """Both trainers at gradient_accumulation_steps=2 and the two micro-batches TRL's own _prepare_inputs
    buffers from one generation batch, made uneven (one empty completion) with random advantages."""
    torch.manual_seed(0)
    ref, ours = _build(tmp_path_factory.mktemp("grpo_accum"), gradient_accumulation_steps=2)
    assert ref.args.steps_per_generation == ours.args.steps_per_generation == 2
    first = ref._prepare_inputs(next(iter(ref.get_train_dataloader())))
    micro = [dict(first), dict(ref._buffered_inputs[1])]
    # TRL counts num_items_in_batch over the whole generation batch, not the micro-batch.
    assert int(first["num_items_in_batch"]) == sum(int(m["completion_mask"].sum()) for m in micro)
    g = torch.Generator().manual_seed(1)
    for i, m in enumerate(micro):
        mask = m["completion_mask"].clone()
        mask[0, 1 + 2 * i :] = 0
        if i == 1:
            mask[-1] = 0  # an empty completion
        m["completion_mask"] = mask
        m["advantages"] = torch.randn(mask.size(0), generator=g)
    n = sum(m["completion_mask"].sum() for m in micro).float()
    for m in micro:
        m["num_items_in_batch"] = n  # as TRL counts it, for the masks just changed
    # Trainer.training_step gets the batch as given (not TRL's buffer).
    ref._prepare_inputs = ours._prepare_inputs = lambda inputs: inputs
    return ref, ours, micro


def _accumulate(tr, batches, loss_type, ga, old=None):
    """Trainer.training_step on each batch (the real GA scaling path) at GA=``ga``; the summed loss, the
    accumulated gradients and the metrics logged."""
    saved = (tr.loss_type, tr.current_gradient_accumulation_steps, tr.args.steps_per_generation)
    tr.loss_type, tr.current_gradient_accumulation_steps, tr.args.steps_per_generation = loss_type, ga, ga
    tr.model.zero_grad()
    tr._metrics["train"].clear()
    try:
        total = 0.0
        for i, b in enumerate(batches):
            b = dict(b)
            if old is not None:
                b["old_per_token_logps"] = old[i]
            total = total + tr.training_step(tr.model, b, b["num_items_in_batch"])
        metrics = {k: list(v) for k, v in stored_metrics(tr).items() if k != "step_time"}
        return total, grads(tr.model), metrics
    finally:
        tr.loss_type, tr.current_gradient_accumulation_steps, tr.args.steps_per_generation = saved


def _assert_grads(g_our, g_ref):
    assert sorted(g_our) == sorted(g_ref)
    for n in g_ref:
        assert_close_to_ref(g_our[n], g_ref[n], name=f"grad {n}")


@pytest.mark.parametrize("off_policy", [False, True], ids=["on_policy", "off_policy"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_grpo_gradient_accumulation(accum, loss_type, off_policy):
    """Ours under GA=2 equals TRL under GA=2 (loss per micro-batch, gradients, metrics), and both equal the
    one large batch at GA=1 (TRL's normalisation makes the split exact for these loss types)."""
    ref, ours, micro = accum
    old = None
    if off_policy:  # old log-probs off the current ones: ratios ≠ 1, some tokens clipped
        g = torch.Generator().manual_seed(2)
        old = []
        for m in micro:
            ids = torch.cat([m["prompt_ids"], m["completion_ids"]], 1)
            att = torch.cat([m["prompt_mask"], m["completion_mask"]], 1)
            with torch.no_grad():
                lp = ref._get_per_token_logps_and_entropies(ref.model, ids, att, K)[0]
            old.append(lp + 0.3 * torch.randn(lp.shape, generator=g))
    l_ref, g_ref, m_ref = _accumulate(ref, micro, loss_type, 2, old)
    l_our, g_our, m_our = _accumulate(ours, micro, loss_type, 2, old)
    assert_close_loss(l_our, l_ref)
    _assert_grads(g_our, g_ref)
    assert sorted(m_our) == sorted(m_ref)
    for key in m_ref:
        assert len(m_our[key]) == len(m_ref[key]) == 2, key
        for a, b in zip(m_our[key], m_ref[key]):
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-6), key

    big = [_concat(micro)]
    old_big = None if old is None else [torch.cat(old)]
    l_big, g_big, _ = _accumulate(ref, big, loss_type, 1, old_big)
    assert l_big.item() != 0
    assert_close_loss(l_ref, l_big)  # TRL's own guarantee
    _assert_grads(g_ref, g_big)
    l_big_our, g_big_our, _ = _accumulate(ours, big, loss_type, 1, old_big)
    assert_close_loss(l_our, l_big)
    _assert_grads(g_our, g_big)
    _assert_grads(g_big_our, g_big)
    assert_close_loss(l_big_our, l_big)


def test_grpo_lora_on_lm_head_old_logps(tmp_path):
    """With a LoRA adapter on lm_head, the old log-probs TRL computes when a generation serves several steps
    (steps_per_generation > gradient_accumulation_steps) include the adapter. TRL's fused head reads
    ``lm_head.weight`` alone and leaves it out: the base-class call below is checked to differ. Reference: the
    PEFT model's own logits."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False
    )
    _, model = model_pair()
    torch.manual_seed(0)
    ours = ChunkedGRPOTrainer(
        model,
        count_reward,
        ChunkedGRPOConfig(
            **common_args(tmp_path, num_generations=2, max_completion_length=K, steps_per_generation=2),
            chunk_size=5,
            chunk_compile=False,
        ),
        train_dataset=tiny_dataset("grpo", n=8),
        processing_class=tokenizer(),
        peft_config=cfg,
    )
    ours.model.train()
    inputs = ours._prepare_inputs(next(iter(ours.get_train_dataloader())))
    old = inputs["old_per_token_logps"]
    assert old is not None
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logits = ours.model(input_ids=ids, attention_mask=att).logits[:, -K - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
        ref = ref * inputs["completion_mask"]
        trl_head = GRPOTrainer._get_per_token_logps_and_entropies(ours, ours.model, ids, att, K)[0]
    assert_close_to_ref(old, ref)
    assert (trl_head - ref).abs().max() > 1e-2


def _adaptive_steps(tr, micro, loss_type, target, n_steps=2):
    """``n_steps`` optimizer steps of ``micro`` under GA=len(micro) with TRL's adaptive entropy controller on
    (initial coefficient 0.05); per step: the summed loss, gradients, metrics and the controller's state."""
    state = {
        "loss_type": loss_type,
        "current_gradient_accumulation_steps": len(micro),
        "use_adaptive_entropy": True,
        "_entropy_bonus_enabled": True,
        "entropy_coef": 0.05,
        "_last_world_entropy": float("inf"),
        "_entropy_window_stats": None,
    }
    args = {"steps_per_generation": len(micro), "entropy_target": target}
    saved = [(tr, k, getattr(tr, k)) for k in state] + [(tr.args, k, getattr(tr.args, k)) for k in args]
    for k, v in state.items():
        setattr(tr, k, v)
    for k, v in args.items():
        setattr(tr.args, k, v)
    out = []
    try:
        for _ in range(n_steps):
            tr.model.zero_grad()
            tr._metrics["train"].clear()
            total = 0.0
            for i, b in enumerate(micro):
                # Only the window's last micro-batch syncs gradients (the controller updates there).
                tr.accelerator.gradient_state._set_sync_gradients(i == len(micro) - 1)
                total = total + tr.training_step(tr.model, dict(b), b["num_items_in_batch"])
            metrics = {k: list(v) for k, v in stored_metrics(tr).items() if k != "step_time"}
            out.append((total, grads(tr.model), metrics, tr.entropy_coef, tr._last_world_entropy))
        return out
    finally:
        tr.accelerator.gradient_state._set_sync_gradients(True)
        for obj, k, v in saved:
            setattr(obj, k, v)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("target", [100.0, 0.0], ids=["entropy_below_target", "entropy_above_target"])
def test_grpo_adaptive_entropy(accum, loss_type, target):
    """TRL's adaptive entropy controller (``use_adaptive_entropy``) over two optimizer steps of two
    micro-batches each: the first step applies no bonus (nothing measured yet); the window's entropy then
    moves the coefficient up (below the target: the second step applies it) or down (above: none again).
    Loss, gradients, metrics (``policy_loss``, ``entropy_coef``) and the controller's state equal TRL's at
    each step."""
    ref, ours, micro = accum
    steps_ref = _adaptive_steps(ref, micro, loss_type, target)
    steps_our = _adaptive_steps(ours, micro, loss_type, target)
    coefs = [step[3] for step in steps_ref]
    assert coefs == (pytest.approx([0.055, 0.06]) if target else pytest.approx([0.045, 0.04]))
    # The coefficient goes to each call: one loss module (and compiled step) whatever its value.
    assert {dict(k[1:])["entropy_coef"] for k in ours._chunk_losses} <= {0.0, 1.0}, list(ours._chunk_losses)
    for (l_ref, g_ref, m_ref, c_ref, e_ref), (l_our, g_our, m_our, c_our, e_our) in zip(steps_ref, steps_our):
        assert_close_loss(l_our, l_ref)
        _assert_grads(g_our, g_ref)
        assert sorted(m_our) == sorted(m_ref) and "policy_loss" in m_ref and "entropy_coef" in m_ref
        for key in m_ref:
            assert len(m_our[key]) == len(m_ref[key]), key
            for a, b in zip(m_our[key], m_ref[key]):
                assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-6), key
        assert c_our == c_ref and e_our == pytest.approx(e_ref, rel=1e-6)
    # The bonus changes the second step's loss only where it is applied.
    bonus_applied = not torch.allclose(steps_ref[0][0], steps_ref[1][0])
    assert bonus_applied == bool(target)
