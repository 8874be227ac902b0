"""ChunkedGRPOTrainer against TRL's GRPOTrainer: one generated batch, each loss option, equal loss, gradients
and logged metrics."""

from __future__ import annotations

import math

import pytest
import torch
from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer
from trl import GRPOConfig, GRPOTrainer

from chunkloss.data import count_reward, tiny_dataset
from tests.trainers.helpers import assert_close_loss, assert_same_grads, common_args, model_pair, tokenizer

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
        m_ref, m_our = ref._metrics["train"], ours._metrics["train"]
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
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_grpo_options(pair, name, settings, use, args):
    _run(pair, settings, use=use, args=args)


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


def test_grpo_refuses_adaptive_entropy(tmp_path):
    m, _ = model_pair()
    args = ChunkedGRPOConfig(
        **common_args(tmp_path, num_generations=2, max_completion_length=K), use_adaptive_entropy=True
    )
    with pytest.raises(ValueError, match="use_adaptive_entropy"):
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
