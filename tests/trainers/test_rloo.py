"""ChunkedRLOOTrainer against TRL's RLOOTrainer: one generated batch with equal loss, gradients and logged
metrics for each loss option; the whole generation-and-scoring step (KL penalty in the reward,
leave-one-out advantages, their normalisation, reward clipping, truncated completions) equal; and the
parameters after a few optimizer steps of ``train`` equal. Generation is replaced by fixed completions
(:func:`fixed_completions`), the same for both trainers at each step."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from trl import RLOOConfig, RLOOTrainer

from chunkloss.data import count_reward, tiny_dataset
from chunkloss.testing.reference import rloo_loss_from_logps_ref
from chunkloss.trainers import ChunkedRLOOConfig, ChunkedRLOOTrainer
from chunkloss.trainers._online import ChunkedScoring
from tests.tolerances import assert_close_to_ref
from tests.trainers.helpers import (
    MOE,
    assert_close_loss,
    assert_same_grads,
    common_args,
    grads,
    model_pair,
    stored_metrics,
    tokenizer,
)
from tests.trainers.test_moe_aux import COEF, _check, _model_aux

K = 6  # max_completion_length
# Sequence ratios the batch's old log-probs are set to, and its advantages' signs (as in
# tests/losses/test_rloo.py): completion 0 clipped above, 1 below, 3 above the range with A < 0 (unclipped:
# the minimum); 2 is emptied.
RATIOS = (1.45, 0.6, 1.1, 1.4)
SIGNS = (1.0, -1.0, 1.0, -1.0)


def fixed_completions(trainer) -> None:
    """Generation replaced by completions drawn from the prompt's tokens, its place in the batch and the
    trainer's step counter: both trainers get the same ones at each step. Lengths 1 to K; some end in EOS."""
    tok = tokenizer()
    vocab, eos = len(tok), tok.eos_token_id

    def generate(prompt_ids, images, multimodal_fields):
        out = []
        for i, ids in enumerate(prompt_ids):
            g = torch.Generator().manual_seed(hash((tuple(ids), i, trainer._step)) % 2**31)
            n = int(torch.randint(1, K + 1, (1,), generator=g))
            completion = torch.randint(5, vocab, (n,), generator=g).tolist()
            if i % 3 == 0 and n < K:
                completion.append(eos)
            out.append(completion)
        return out

    trainer._generate_single_turn = generate


def _build(tmp_path, models=None, compile_=False, **cfg):
    ref_m, our_m = models or model_pair()
    ds = tiny_dataset("grpo", n=8)
    base = common_args(tmp_path, num_generations=2, max_completion_length=K, **{"beta": 0.0, **cfg})
    ref = RLOOTrainer(ref_m, count_reward, RLOOConfig(**base), train_dataset=ds, processing_class=tokenizer())
    ours = ChunkedRLOOTrainer(
        our_m,
        count_reward,
        ChunkedRLOOConfig(**base, chunk_size=5, chunk_compile=compile_),
        train_dataset=ds,
        processing_class=tokenizer(),
    )
    for tr in (ref, ours):
        fixed_completions(tr)
        tr.model.train()
    return ref, ours


def _make_pair(tmp_path, models=None, **cfg):
    """Both trainers and one batch of TRL's, off-policy: the old log-probs set to give ``RATIOS``, the
    advantages ``SIGNS`` times random magnitudes, completion 2 emptied (as ``mask_truncated_completions``
    does; TRL's summed old log-prob of it is then 0)."""
    ref, ours = _build(tmp_path, models=models, **cfg)
    torch.manual_seed(0)
    inputs = ref._prepare_inputs(next(iter(ref.get_train_dataloader())))
    mask = inputs["completion_mask"].clone()
    mask[2] = 0
    inputs["completion_mask"] = mask
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], mask], 1)
    k = inputs["completion_ids"].size(1)
    with torch.no_grad():
        logps = ref._get_per_token_logps_and_entropies(ref.model, ids, att, k)[0]
    inputs["old_logps"] = (logps * mask).sum(1) - torch.log(torch.tensor(RATIOS)) * (mask.sum(1) > 0)
    g = torch.Generator().manual_seed(0)
    inputs["advantages"] = (torch.rand(mask.size(0), generator=g) + 0.5) * torch.tensor(SIGNS)
    return ref, ours, inputs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _make_pair(tmp_path_factory.mktemp("rloo"))


def _run(pair, settings=None):
    """Apply ``settings`` (trainer attributes) to both trainers, run both losses on the batch and compare
    loss, gradients and the metrics just stored (TRL's ``_metrics["train"]``, or ``["eval"]``)."""
    ref, ours, inputs = pair
    mode = "train" if ref.model.training else "eval"
    saved = []
    for tr in (ref, ours):
        for k, v in (settings or {}).items():
            saved.append((tr, k, getattr(tr, k)))
            setattr(tr, k, v)
        tr.model.zero_grad()
        tr._metrics[mode].clear()
    try:
        l_ref = ref._compute_loss(ref.model, dict(inputs))
        l_ref.backward()
        l_our = ours._compute_loss(ours.model, dict(inputs))
        l_our.backward()
        assert_close_loss(l_our, l_ref)
        assert_same_grads(ref.model, ours.model)
        ours.fetch_deferred_metrics()
        m_ref, m_our = ref._metrics[mode], ours._metrics[mode]
        assert list(m_ref) == list(m_our)  # TRL's names in TRL's order
        for key in m_ref:
            for a, b in zip(m_our[key], m_ref[key], strict=True):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-6), key
        return m_ref
    finally:
        for obj, k, v in reversed(saved):
            setattr(obj, k, v)


@pytest.mark.parametrize(
    "settings",
    [{}, {"epsilon_high": 0.5}, {"epsilon_low": 0.5, "epsilon_high": 0.5}],
    ids=["epsilon", "epsilon_high", "wide"],
)
def test_rloo_loss(pair, settings):
    """ε = 0.2 clips completions 0 and 1; ε_high = 0.5 only 1 (r = 0.6); ε = 0.5 neither."""
    metrics = _run(pair, settings)
    expected = {0: 0.5, 1: 0.25, 2: 0.0}[len(settings)]
    assert metrics["clip_ratio/region_mean"][0] == pytest.approx(expected)


def test_rloo_on_policy(pair):
    """The old log-probs TRL computed (ratios 1 up to the two heads' rounding), completion 2 kept."""
    ref, ours, _ = pair
    torch.manual_seed(0)
    inputs = ref._prepare_inputs(next(iter(ref.get_train_dataloader())))
    inputs["advantages"] = torch.linspace(-1, 1, inputs["advantages"].numel())
    _run((ref, ours, inputs))


def test_rloo_eval_mode(pair):
    ref, ours, _ = pair
    for tr in (ref, ours):
        tr.model.eval()
    try:
        m = _run(pair)
    finally:
        for tr in (ref, ours):
            tr.model.train()
    assert "entropy" in m


def test_rloo_compiled(tmp_path):
    _run(_make_pair(tmp_path, compile_=True))


@pytest.mark.parametrize(
    "family,overrides", [("gemma2", {"final_logit_softcapping": 3.0}), ("cohere", {"logit_scale": 0.5})]
)
def test_rloo_head_transforms(tmp_path, family, overrides):
    """Gemma-2's softcapping and Cohere's logit scale, and a sampling temperature (bound into TRL's fused head
    at construction): TRL applies them in its fused head, ours in the chunked loss."""
    p = _make_pair(tmp_path, models=model_pair(family=family, **overrides), temperature=0.7)
    opts = p[1]._rloo_loss().options
    assert opts.softcap == overrides.get("final_logit_softcapping") and opts.temperature == 0.7
    assert opts.logit_scale == overrides.get("logit_scale", 1.0)
    _run(p, {"epsilon_high": 0.28})


def test_rloo_gradient_accumulation(pair):
    """Trainer.training_step at GA=2 (transformers divides RLOO's loss by it, for both): two micro-batches'
    summed losses and accumulated gradients equal TRL's."""
    ref, ours, inputs = pair
    halves = [{k: v[i::2] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()} for i in (0, 1)]
    out = []
    for tr in (ref, ours):
        # Set by the training loop, which this test skips; the batch goes in as given (not TRL's buffer).
        tr.current_gradient_accumulation_steps = 2
        tr._prepare_inputs = lambda x: x
        tr.model.zero_grad()
        try:
            total = sum(tr.training_step(tr.model, dict(h), None) for h in halves)
        finally:
            del tr._prepare_inputs
        out.append((total, grads(tr.model)))
    assert_close_loss(out[1][0], out[0][0])
    for n, g in out[0][1].items():
        assert_close_to_ref(out[1][1][n], g, name=f"grad {n}")


def _scored(tr):
    """``_prepare_inputs`` of a fresh generation batch (generation, rewards, advantages) and its metrics."""
    torch.manual_seed(0)
    tr._metrics["train"].clear()
    tr._buffered_inputs = None
    out = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    return out, {k: list(v) for k, v in stored_metrics(tr).items()}


def test_rloo_scoring_with_kl_in_the_reward(tmp_path):
    """TRL's whole scoring step in ours: the KL penalty (β·Σ_t(old - ref), the reference model TRL loads
    from the policy's path) subtracted from the clipped rewards, leave-one-out baselines, normalised
    advantages, truncated completions masked; then the loss on that batch."""
    path = tmp_path / "policy"
    model_pair()[0].save_pretrained(path)
    cfg = dict(
        beta=0.05, normalize_advantages=True, reward_clip_range=(-0.25, 0.25), mask_truncated_completions=True
    )
    ref, ours = _build(tmp_path, models=(str(path), str(path)), **cfg)
    assert ref.ref_model is not None and ours.ref_model is not None
    for tr in (ref, ours):  # the policy moved off the reference (as after some training): a nonzero KL
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in tr.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    (b_ref, m_ref), (b_our, m_our) = _scored(ref), _scored(ours)
    assert sorted(b_ref) == sorted(b_our)
    for k, v in b_ref.items():
        assert torch.equal(b_our[k], v), k
    assert sorted(m_ref) == sorted(m_our) and abs(m_ref["kl"][0]) > 1e-3
    for k in m_ref:
        assert m_our[k] == pytest.approx(m_ref[k], rel=1e-6), k
    assert b_ref["completion_mask"].sum(1).eq(0).any(), "a truncated completion is masked"
    _run((ref, ours, b_ref), {"epsilon_high": 0.28})


def test_rloo_scores_through_the_chunked_head(tmp_path, monkeypatch):
    """Off-policy (each generation used twice), the old log-probs come from the chunked head, not TRL's
    scoring forward (its logits), and equal TRL's."""
    ref, ours = _build(tmp_path, num_iterations=2)
    b_ref, _ = _scored(ref)

    def trl_scoring(*args, **kwargs):
        raise AssertionError("TRL's scoring forward ran")

    monkeypatch.setattr(RLOOTrainer, "_get_per_token_logps_and_entropies", trl_scoring)
    b_our, _ = _scored(ours)
    assert_close_to_ref(b_our["old_logps"], b_ref["old_logps"], name="old_logps")


def test_rloo_lora_on_lm_head(tmp_path):
    """A LoRA adapter on lm_head (TRL refuses it: its fused head reads lm_head.weight alone): the old
    log-probs include the adapter, and the loss and every adapter gradient equal the reference on the PEFT
    model's own logits. TRL's head is checked to leave the adapter out."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False
    )
    args = ChunkedRLOOConfig(
        **common_args(tmp_path, num_generations=2, max_completion_length=K, beta=0.0, num_iterations=2),
        chunk_size=5,
        chunk_compile=False,
    )
    ours = ChunkedRLOOTrainer(
        model_pair()[1],
        count_reward,
        args,
        train_dataset=tiny_dataset("grpo", n=8),
        processing_class=tokenizer(),
        peft_config=lora,
    )
    fixed_completions(ours)
    ours.model.train()
    inputs = ours._prepare_inputs(next(iter(ours.get_train_dataloader())))
    mask, k = inputs["completion_mask"], inputs["completion_ids"].size(1)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], mask], 1)
    logits = ours.model(input_ids=ids, attention_mask=att).logits[:, -k - 1 : -1].float()
    lp_all = torch.log_softmax(logits, -1)
    logp = lp_all.gather(-1, inputs["completion_ids"][..., None])[..., 0]
    with torch.no_grad():
        trl_head = RLOOTrainer._get_per_token_logps_and_entropies(ours, ours.model, ids, att, k)[0]
    assert_close_to_ref(inputs["old_logps"], (logp.detach() * mask).sum(1))
    assert ((trl_head - logp.detach()) * mask).abs().max() > 1e-2
    inputs["advantages"] = torch.linspace(-1, 1, mask.size(0))
    ent = -(lp_all.exp() * lp_all).sum(-1)
    l_ref, _ = rloo_loss_from_logps_ref(logp, ent, mask, inputs["advantages"], old_logps=inputs["old_logps"])
    ours.model.zero_grad()
    l_ref.backward()
    g_ref = grads(ours.model)
    ours.model.zero_grad()
    ours._compute_loss(ours.model, dict(inputs)).backward()
    g_our = grads(ours.model)
    assert any("lm_head.lora_B" in n for n in g_ref) and sorted(g_our) == sorted(g_ref)
    for n, g in g_ref.items():
        assert_close_to_ref(g_our[n], g, name=f"grad {n}")


def test_rloo_moe_aux_loss(tmp_path):
    """The router load-balancing loss, added unscaled as TRL adds it (transformers divides the whole loss by
    the accumulation steps)."""
    ref, ours, inputs = _make_pair(tmp_path, models=model_pair(**MOE), router_aux_loss_coef=COEF)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)

    def loss_fn(tr):
        tr._metrics["train"].clear()
        return tr._compute_loss(tr.model, dict(inputs))

    _check(ref, ours, loss_fn, "router_aux_loss_coef", _model_aux(ref.model, ids, att))
    assert stored_metrics(ours)["aux_loss"] == pytest.approx(stored_metrics(ref)["aux_loss"], rel=1e-5)


def test_rloo_on_policy_skips_the_old_logps_forward(tmp_path, monkeypatch):
    """On-policy (each generation used within one optimizer step, β = 0) the batch carries no old log-probs
    and their no-grad forward does not run: the loss takes the current ones, detached. Off-policy, or with a
    KL penalty, they are scored."""
    ref, ours = _build(tmp_path)
    calls = []
    real = ChunkedScoring._get_per_token_logps_and_entropies

    def counted(self, *args, **kwargs):
        calls.append(args[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChunkedScoring, "_get_per_token_logps_and_entropies", counted)
    batch, _ = _scored(ours)
    assert batch["old_logps"] is None and not calls
    assert _scored(ref)[0]["old_logps"] is not None  # TRL scores them
    assert not ours._old_logps_needed()
    assert _build(tmp_path, num_iterations=2)[1]._old_logps_needed()
    ours.beta = 0.05  # read when scoring, as TRL reads it
    assert ours._old_logps_needed()


@pytest.mark.parametrize("iterations", [2, 1], ids=["off_policy", "on_policy"])
def test_rloo_train_drift(tmp_path, iterations):
    """Three optimizer steps of ``train`` (SGD): every parameter's update and every logged value equal
    TRL's. Off-policy each generation is used twice, the second use partly clipped; on-policy ours skips the
    old log-probs' forward (TRL's give ratios of 1 up to rounding)."""
    # lr 0.05: the second use of the first generation is partly clipped (at 0.2 and above, all of it is).
    cfg = dict(max_steps=3, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant")
    ref, ours = _build(tmp_path, num_iterations=iterations, **cfg)
    before = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    for tr in (ref, ours):
        transformers.set_seed(0)
        tr.train()
    p_ref, p_our = dict(ref.model.named_parameters()), dict(ours.model.named_parameters())
    moved = 0.0
    for n, p0 in before.items():
        step_ref, step_our = p_ref[n].detach() - p0, p_our[n].detach() - p0
        assert_close_to_ref(step_our, step_ref, name=f"update of {n}")
        moved = max(moved, float(step_ref.abs().max()))
    assert moved > 1e-3
    h_ref, h_our = ref.state.log_history, ours.state.log_history
    assert len(h_ref) == len(h_our) == 4  # three logged steps and the run's summary
    clipped = h_ref[1]["clip_ratio/region_mean"]
    assert (0 < clipped < 1 if iterations == 2 else clipped == 0) and h_ref[1]["grad_norm"] > 0
    for a, b in zip(h_our, h_ref):
        assert sorted(a) == sorted(b)
        for key, v in b.items():
            if key in ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"):
                continue
            assert (isinstance(v, float) and math.isnan(v) and math.isnan(a[key])) or a[key] == pytest.approx(
                v, rel=1e-5, abs=1e-6
            ), key


def test_rloo_refuses_multimodal_inputs(pair):
    _, ours, inputs = pair
    with pytest.raises(ValueError, match="does not support multimodal input 'pixel_values'"):
        ours._compute_loss(ours.model, {**inputs, "pixel_values": torch.zeros(1)})


@pytest.mark.parametrize("column", ["image", "images"])
def test_rloo_refuses_image_datasets_when_built(tmp_path, column):
    ds = tiny_dataset("grpo", n=8)
    ds = ds.add_column(column, [None] * len(ds))
    args = ChunkedRLOOConfig(**common_args(tmp_path, num_generations=2, max_completion_length=K, beta=0.0))
    with pytest.raises(ValueError, match=f"does not support a dataset with an '{column}' column"):
        ChunkedRLOOTrainer(
            model_pair()[0], count_reward, args, train_dataset=ds, processing_class=tokenizer()
        )
