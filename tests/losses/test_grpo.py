"""FusedLinearGRPOLoss against the fp32 reference (chunkloss.testing.reference.grpo_ref) and TRL 1.16's own
``GRPOTrainer._compute_loss`` (called unbound on a stub trainer whose model returns given log-probs)."""

from __future__ import annotations

import math
import types
import warnings
from collections import defaultdict

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from chunkloss.losses.common import scale_logits
from chunkloss.losses.grpo import LOSS_TYPES, FusedLinearGRPOLoss
from chunkloss.testing.reference import grpo_loss_from_logps_ref, grpo_ref
from tests.tolerances import assert_close_to_ref

B, T, H, V = 3, 11, 16, 37  # odd shapes; sequence 2 is an empty completion


def make_inputs(dtype=torch.float32, adv_2d=False, bias=True, ref_head=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_(True) if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 7:] = 0
    mask[2] = 0  # empty completion
    mask[1, 3] = 0
    adv = torch.randn(B, T, generator=g) if adv_2d else torch.randn(B, generator=g)
    with torch.no_grad():
        z = h.float() @ w.float().t() + (b.float() if bias else 0)
        cur = torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0]
    # Old log-probs close enough to the policy that some ratios fall inside the clip range, some outside.
    old = cur + 0.3 * torch.randn(B, T, generator=g)
    ref = cur + 0.3 * torch.randn(B, T, generator=g)
    inp = dict(hidden=h, weight=w, completion_ids=ids, completion_mask=mask, advantages=adv, bias=b)
    kw = dict(old_logps=old, ref_logps=ref)
    if ref_head:
        kw = dict(
            old_logps=old,
            ref_hidden=(h.detach().float() + 0.1 * torch.randn(B, T, H, generator=g)).to(dtype),
            ref_weight=w.detach().clone(),
            ref_bias=None if b is None else b.detach().clone(),
        )
    return inp, kw


def leaves(inp):
    return [inp[k] for k in ("hidden", "weight", "bias") if inp[k] is not None]


def run_loss(loss_cls, inp, kw, **opts):
    """``loss_cls(**opts)`` on ``inp``: its loss, the leaves' gradients and its metrics."""
    for x in leaves(inp):
        x.grad = None
    mod = loss_cls(**opts)
    loss = mod(**inp, **kw)
    loss.backward()
    return loss.detach().float(), [x.grad.float() for x in leaves(inp)], mod.metrics


def run_ours(inp, kw, **opts):
    return run_loss(FusedLinearGRPOLoss, inp, kw, **opts)


def run_ref(inp, kw, opts, dtype=torch.float32):
    """fp32 reference (dtype=float32), or the materialised torch loss with logits in ``dtype``."""
    f = {k: v for k, v in opts.items() if k not in ("chunk_size", "compile")}
    leaf = leaves(inp)
    xs = [x.detach().to(dtype).requires_grad_(True) for x in leaf]
    h, w, b = xs[0], xs[1], xs[2] if len(xs) > 2 else None
    kw2 = dict(kw)
    for k in ("ref_hidden", "ref_weight", "ref_bias"):
        if kw2.get(k) is not None:
            kw2[k] = kw2[k].to(dtype)
    if dtype == torch.float32:
        loss, m = grpo_ref(
            h, w, inp["completion_ids"], inp["completion_mask"], inp["advantages"], b, **kw2, **f
        )
    else:
        tf = {k: f.pop(k) for k in ("temperature", "logit_scale", "softcap") if k in f}
        tf = dict(
            logit_scale=tf.get("logit_scale", 1.0),
            softcap=tf.get("softcap"),
            temperature=tf.get("temperature", 1.0),
        )
        z = scale_logits((h @ w.t() + (b if b is not None else 0)).float(), **tf)
        lp_all = torch.log_softmax(z, -1)
        logp = lp_all.gather(-1, inp["completion_ids"][..., None])[..., 0]
        ent = -(lp_all.exp() * lp_all).sum(-1)
        if kw2.get("ref_hidden") is not None:
            with torch.no_grad():
                zr = scale_logits((kw2["ref_hidden"] @ kw2["ref_weight"].t()).float(), **tf)
                kw2["ref_logps"] = torch.log_softmax(zr, -1).gather(-1, inp["completion_ids"][..., None])[
                    ..., 0
                ]
        kw2 = {k: v for k, v in kw2.items() if not k.startswith("ref_") or k == "ref_logps"}
        loss, m = grpo_loss_from_logps_ref(logp, ent, inp["completion_mask"], inp["advantages"], **kw2, **f)
    loss.backward()
    return loss.detach().float(), [x.grad.float() for x in xs], m


def assert_close_fp32(ours, ref):
    """Loss, gradients and metrics against the fp32 reference (tests/tolerances.py's fp32 row; a NaN
    metric must be NaN in both)."""
    (lo, go, mo), (lr, gr, mr) = ours, ref
    assert_close_to_ref(lo, lr, name="loss")
    for i, (a, b) in enumerate(zip(go, gr)):
        assert_close_to_ref(a, b, name=f"grad {i}")
    assert set(mo) == set(mr), (set(mo), set(mr))
    for k in mr:
        assert_close_to_ref(float(mo[k]), float(mr[k]), name=k)


def grid_opts(loss_type, level, **extra):
    opts = dict(loss_type=loss_type, importance_sampling_level=level, compile=False, max_completion_length=T)
    if loss_type == "cispo":
        opts["epsilon_high"] = 1.2  # ε_max: some ratios above it
    else:
        opts["epsilon_high"] = 0.28
    opts.update(extra)
    return opts


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("kl", ["none", "precomputed", "head"])
def test_grid_fp32(loss_type, level, kl):
    """Every loss type × IS level × KL source; old logps and on-policy; (B,) and (B,T) advantages. One
    chunk size per grid point, alternating between 1 and larger than B·T so that every loss type and
    level sees both (the sequence path: two passes at 1 < completion length, one pass above); odd sizes
    in test_options_fp32, agreement across chunk sizes in test_chunk_sizes_agree."""
    beta = 0.0 if kl == "none" else 0.04
    cs = (1, 1000)[(LOSS_TYPES.index(loss_type) + ["none", "precomputed", "head"].index(kl)) % 2]
    for adv_2d, on_policy in ((False, False), (True, True)):
        inp, kw = make_inputs(adv_2d=adv_2d, ref_head=kl == "head")
        if kl == "none":
            kw.pop("ref_logps", None)
            kw = {k: v for k, v in kw.items() if not k.startswith("ref_")}
        if on_policy:
            kw.pop("old_logps")
        opts = grid_opts(loss_type, level, beta=beta)
        assert_close_fp32(run_ours(inp, kw, chunk_size=cs, **opts), run_ref(inp, kw, opts))


@pytest.mark.parametrize(
    "loss_type,level,kl",
    [
        ("dapo", "token", "head"),
        ("grpo", "sequence", "head"),
        ("cispo", "sequence_token", "precomputed"),
        ("vespo", "token", "none"),
    ],
)
def test_chunk_sizes_agree(loss_type, level, kl):
    """Loss, gradients and metrics agree across chunk sizes 1, odd, and larger than B·T (token path,
    one-pass and two-pass sequence path)."""
    inp, kw = make_inputs(ref_head=kl == "head")
    if kl == "none":
        kw = {k: v for k, v in kw.items() if not k.startswith("ref_")}
    opts = grid_opts(loss_type, level, beta=0.0 if kl == "none" else 0.04)
    results = [run_ours(inp, kw, chunk_size=cs, **opts) for cs in (1, 5, 1000)]
    for other in results[1:]:
        assert abs(other[0] - results[0][0]) <= 1e-5
        for a, b in zip(other[1], results[0][1]):
            assert_close_to_ref(a, b)
        for k, v in results[0][2].items():
            assert (math.isnan(float(v)) and math.isnan(float(other[2][k]))) or abs(
                float(v) - float(other[2][k])
            ) <= 1e-5, k


@pytest.mark.parametrize(
    "loss_type,level,chunk",
    [
        ("dapo", "token", 4),
        ("grpo", "sequence", 1),
        ("cispo", "sequence", 1000),
        ("sapo", "sequence_token", 3),
    ],
)
def test_logit_transforms(loss_type, level, chunk):
    """logit_scale, softcap and temperature (in that order) on the policy and reference heads: token path,
    two-pass (reference column read back from pass 1) and one-pass sequence path."""
    inp, kw = make_inputs(ref_head=True)
    opts = grid_opts(loss_type, level, beta=0.04, logit_scale=1.7, softcap=2.5, temperature=0.8)
    ref = run_ref(inp, kw, opts)
    assert_close_fp32(run_ours(inp, kw, chunk_size=chunk, **opts), ref)
    # The transforms change the result (softcap 2.5 is well inside the logits' range at scale 1.7).
    plain = run_ref(inp, kw, grid_opts(loss_type, level, beta=0.04))
    assert abs(plain[0] - ref[0]) > 1e-3


# Entropy mask (two passes), mask with bonus on the sequence path, bonus alone (also in test_row_steps.py).
ENTROPY_OPTIONS = [
    dict(loss_type="dapo", top_entropy_quantile=0.3, beta=0.04),
    dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.1, importance_sampling_level="sequence"),
    dict(loss_type="dapo", entropy_coef=0.05),
]
# Masks, clipping and transform options, by id (also run on the CUDA steps: tests/losses/test_row_steps.py).
MORE_OPTIONS = {
    "bonus-quantile0": dict(loss_type="bnpo", entropy_coef=0.05, top_entropy_quantile=0.0),
    "offpolicy-token": dict(loss_type="grpo", off_policy_mask_threshold=0.05, beta=0.04),
    "offpolicy-seq": dict(
        loss_type="dapo", off_policy_mask_threshold=0.05, importance_sampling_level="sequence"
    ),
    "delta": dict(loss_type="dapo", delta=1.1, temperature=0.7, beta=0.04, use_bias_correction_kl=False),
    "sapo-temps": dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0, temperature=1.3),
}


@pytest.mark.parametrize(
    "opts",
    [
        *ENTROPY_OPTIONS,
        *MORE_OPTIONS.values(),
        dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=1.0),
        dict(loss_type="dapo", softcap=2.0, logit_scale=0.6, beta=0.04, importance_sampling_level="sequence"),
    ],
)
@pytest.mark.parametrize("adv_2d", [False, True])
def test_options_fp32(opts, adv_2d):
    """Entropy mask (two passes) and bonus, off-policy mask, delta, temperature, SAPO/VESPO parameters."""
    inp, kw = make_inputs(adv_2d=adv_2d)
    if opts.get("beta", 0) == 0:
        kw.pop("ref_logps")
    opts = {"compile": False, "epsilon_high": 0.28, **opts}
    ref = run_ref(inp, kw, opts)
    for cs in (3, 1000):
        assert_close_fp32(run_ours(inp, kw, chunk_size=cs, **opts), ref)


@pytest.mark.parametrize(
    "loss_type,isr_shape", [("dapo", "token"), ("dapo", "sequence"), ("grpo", "sequence"), ("vespo", "token")]
)
def test_trainer_inputs(loss_type, isr_shape):
    """vLLM IS ratio ((B,T) or (B,)), tool mask, sampling logps, num_items_in_batch across processes
    and gradient accumulation."""
    inp, kw = make_inputs()
    g = torch.Generator().manual_seed(3)
    shape = (B, T) if isr_shape == "token" else (B,)
    kw.update(
        importance_sampling_ratio=torch.rand(shape, generator=g) + 0.5,
        tool_mask=(torch.rand(B, T, generator=g) > 0.2).long(),
        sampling_logps=kw["old_logps"] + 0.1 * torch.randn(B, T, generator=g),
        num_items_in_batch=torch.tensor(37.0),
        num_processes=2,
        gradient_accumulation_steps=4,
        steps_per_generation=2,
    )
    opts = grid_opts(loss_type, "token", beta=0.04, off_policy_mask_threshold=0.05, entropy_coef=0.02)
    ref = run_ref(inp, kw, opts)
    for cs in (2, 1000):
        assert_close_fp32(run_ours(inp, kw, chunk_size=cs, **opts), ref)


# --------------------------------------------------------------------------------------------------
# Parity with TRL's own code: GRPOTrainer._compute_loss, unbound, on a stub trainer.
class _Accel:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_compute_loss(logps, entropies, mask, advantages, *, ga=1, spg=1, inputs_extra=None, **cfg):
    """TRL 1.16's loss on given per-token log-probs and entropies: (loss, metrics)."""
    stub = types.SimpleNamespace(
        top_entropy_quantile=cfg.get("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=cfg.get("off_policy_mask_threshold"),
        importance_sampling_level=cfg.get("importance_sampling_level", "token"),
        beta=cfg.get("beta", 0.0),
        loss_type=cfg.get("loss_type", "dapo"),
        epsilon_low=cfg.get("epsilon_low", 0.2),
        epsilon_high=cfg.get("epsilon_high", 0.2),
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        max_completion_length=cfg.get("max_completion_length"),
        current_gradient_accumulation_steps=ga,
        aux_loss_enabled=False,
        entropy_coef=cfg.get("entropy_coef", 0.0),
        _entropy_bonus_enabled=cfg.get("entropy_coef", 0.0) != 0.0,
        use_adaptive_entropy=False,
        accelerator=_Accel(),
        model=types.SimpleNamespace(training=True),
        args=types.SimpleNamespace(
            use_bias_correction_kl=cfg.get("use_bias_correction_kl", True),
            delta=cfg.get("delta"),
            sapo_temperature_pos=cfg.get("sapo_temperature_pos", 1.0),
            sapo_temperature_neg=cfg.get("sapo_temperature_neg", 1.05),
            vespo_k_pos=2.0,
            vespo_lambda_pos=3.0,
            vespo_k_neg=3.0,
            vespo_lambda_neg=2.0,
            steps_per_generation=spg,
        ),
        _metrics=defaultdict(lambda: defaultdict(list)),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
    )
    stub.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, stub)
    stub._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    b = mask.shape[0]
    inputs = {
        "prompt_ids": torch.zeros(b, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(b, 0, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask),
        "completion_mask": mask,
        "advantages": advantages,
        **(inputs_extra or {}),
    }
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    # entropy_coef is the (static here) coefficient TRL logs, not a function of the batch.
    return loss, {k: v[0] for k, v in stub._metrics["train"].items() if k != "entropy_coef"}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("extras", [False, True])
def test_reference_matches_trl(loss_type, level, extras):
    """The fp32 reference equals TRL's _compute_loss (value, d/dlogps, d/dentropy, metrics)."""
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(4, 9, generator=g) > 0.2).long()
    mask[3] = 0
    logps = (-torch.rand(4, 9, generator=g) * 3).requires_grad_(True)
    ent = (torch.rand(4, 9, generator=g) * 2).requires_grad_(True)
    adv = torch.randn(4, 9, generator=g) if extras else torch.randn(4, generator=g)
    old = logps.detach() + 0.3 * torch.randn(4, 9, generator=g)
    ref = logps.detach() + 0.3 * torch.randn(4, 9, generator=g)
    cfg = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.04,
        epsilon_low=0.2,
        epsilon_high=0.28,
        max_completion_length=9,
    )
    extra_in = {"old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    ours_kw = dict(old_logps=old, ref_logps=ref)
    ga = spg = 1
    if extras:
        cfg.update(top_entropy_quantile=0.4, entropy_coef=0.1, off_policy_mask_threshold=0.05, delta=1.3)
        isr = torch.rand(4, 9, generator=g) + 0.5
        tool = (torch.rand(4, 9, generator=g) > 0.1).long()
        samp = old + 0.1 * torch.randn(4, 9, generator=g)
        extra_in.update(
            importance_sampling_ratio=isr,
            tool_mask=tool,
            sampling_per_token_logps=samp,
            num_items_in_batch=torch.tensor(50.0),
        )
        ours_kw.update(
            importance_sampling_ratio=isr,
            tool_mask=tool,
            sampling_logps=samp,
            num_items_in_batch=torch.tensor(50.0),
        )
        ga, spg = 3, 2
    else:
        ours_kw.update(importance_sampling_ratio=torch.ones(4, 9))  # TRL applies the ratio when use_vllm
        extra_in["importance_sampling_ratio"] = torch.ones(4, 9)
    lt, mt = trl_compute_loss(logps, ent, mask, adv, ga=ga, spg=spg, inputs_extra=extra_in, **cfg)
    gt = torch.autograd.grad(lt, (logps, ent), allow_unused=True)
    lr, mr = grpo_loss_from_logps_ref(
        logps, ent, mask, adv, gradient_accumulation_steps=ga, steps_per_generation=spg, **ours_kw, **cfg
    )
    gr = torch.autograd.grad(lr, (logps, ent), allow_unused=True)
    assert_close_to_ref(lr, lt)
    for a, b in zip(gr, gt):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            assert_close_to_ref(a, b)
    assert set(mr) == set(mt), (set(mr), set(mt))
    for k in mt:
        if math.isnan(mt[k]):
            assert math.isnan(float(mr[k])), k
        else:
            assert abs(float(mr[k]) - mt[k]) <= 1e-6, (k, float(mr[k]), mt[k])


@pytest.mark.parametrize(
    "loss_type,level,seed,extra",
    [
        ("dapo", "token", 0, {}),
        ("grpo", "token", 0, {}),
        ("cispo", "token", 0, {}),
        ("vespo", "token", 0, {}),
        # Sequence ratios (1.15, 1.03, 1.0) with advantages (+, +, -): ε_max=1.1 clips sequence 0 alone,
        # so TRL's cispo_clip_ratio (a mean over the B sequences) is 1/3, unlike the token mean.
        ("cispo", "sequence", 3, {"epsilon_high": 1.1}),
    ],
)
def test_module_matches_trl(loss_type, level, seed, extra):
    """End to end: chunked module vs TRL's _compute_loss on the fp32 log-probs of the same head."""
    inp, kw = make_inputs(seed=seed)
    opts = grid_opts(loss_type, level, beta=0.04, **extra)
    h, w, b = (x.detach().requires_grad_(True) for x in leaves(inp))
    z = h @ w.t() + b
    lp_all = torch.log_softmax(z, -1)
    logp = lp_all.gather(-1, inp["completion_ids"][..., None])[..., 0]
    ent = -(lp_all.exp() * lp_all).sum(-1)
    extra_in = {
        "old_per_token_logps": kw["old_logps"],
        "ref_per_token_logps": kw["ref_logps"],
        "num_items_in_batch": inp["completion_mask"].sum(),
    }
    cfg = {k: v for k, v in opts.items() if k != "compile"}
    stub_vllm_ratio_is_one = torch.ones(B, T)  # the stub has use_vllm=True: TRL multiplies by the ratio
    lt, mt = trl_compute_loss(
        logp,
        ent,
        inp["completion_mask"],
        inp["advantages"],
        inputs_extra={**extra_in, "importance_sampling_ratio": stub_vllm_ratio_is_one},
        **cfg,
    )
    lt.backward()
    lo, go, mo = run_ours(inp, kw, chunk_size=5, **opts)
    assert abs(float(lo) - lt.item()) <= 1e-5
    for a, x in zip(go, (h, w, b)):
        assert_close_to_ref(a, x.grad)
    for k in mt:
        vo = float(mo[k])
        assert (math.isnan(vo) and math.isnan(mt[k])) or abs(vo - mt[k]) <= 1e-5, (k, vo, mt[k])
    if level == "sequence" and loss_type == "cispo":
        assert abs(float(mo["cispo_clip_ratio"]) - 1 / 3) <= 1e-6


# --------------------------------------------------------------------------------------------------
def test_hand_computed():
    """On-policy dapo, β=0: value -A (ratio 1), dL/dz_t = -(A/N)·(e_y - p_t); two tokens, V=2."""
    h = torch.tensor([[[1.0], [2.0]]], requires_grad=True)
    w = torch.tensor([[1.0], [0.0]], requires_grad=True)
    ids = torch.tensor([[0, 1]])
    a = 0.5
    mod = FusedLinearGRPOLoss(compile=False, chunk_size=1)
    loss = mod(h, w, ids, torch.ones(1, 2), torch.tensor([a]))
    loss.backward()
    s1, s2 = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-2))
    assert abs(loss.item() + a) < 1e-6
    # grad_h[t] = dL/dz_t[0]·w[0] + dL/dz_t[1]·w[1] = dL/dz_t[0]
    expect = torch.tensor([[[-(a / 2) * (1 - s1)], [-(a / 2) * (0 - s2)]]])
    assert_close_to_ref(h.grad, expect)

    def bin_ent(p):
        return -(p * math.log(p) + (1 - p) * math.log(1 - p))

    assert abs(mod.metrics["entropy"].item() - (bin_ent(s1) + bin_ent(s2)) / 2) < 1e-6
    assert mod.metrics["clip_ratio/region_mean"].item() == 0.0


@pytest.mark.parametrize("case", ["token_kl_head", "sequence_onepass", "entropy_two_pass"])
def test_compiled(case):
    """torch.compile on the three execution paths (token loss, one-pass and two-pass sequence loss)."""
    if case == "token_kl_head":
        inp, kw = make_inputs(ref_head=True)
        opts = grid_opts("dapo", "token", beta=0.04)
    elif case == "sequence_onepass":
        inp, kw = make_inputs()
        opts = grid_opts("grpo", "sequence", beta=0.04)
    else:
        inp, kw = make_inputs(adv_2d=True)
        opts = grid_opts("dapo", "token", beta=0.04, top_entropy_quantile=0.3, entropy_coef=0.1)
    ref = run_ref(inp, kw, opts)
    opts["compile"] = True
    assert_close_fp32(run_ours(inp, kw, chunk_size=40, **opts), ref)


def test_compiled_kl_with_entropy_bonus():
    """beta and entropy_coef together in the compiled token step: torch 2.13's CPU inductor fails to build it
    (``KeyError: 'buf9'`` in its outer-loop fusion, every input), so the step falls back to eager with a
    RuntimeWarning (``base._RowDynamic``) and still equals the reference."""
    inp, kw = make_inputs()
    opts = grid_opts("dapo", "token", beta=0.04, entropy_coef=0.05)
    ref = run_ref(inp, kw, opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's, where the compiler fails
        got = run_ours(inp, kw, chunk_size=3, **dict(opts, compile=True))
    assert_close_fp32(got, ref)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_compiled_one_sequence_per_chunk(level):
    """Compiled, with chunks of one sequence (one-pass sequence path) and a batch of one sequence: inductor's
    CPU codegen failed on the per-sequence metric scatter into a 1-element buffer."""
    inp, kw = make_inputs()
    opts = grid_opts("grpo", level, beta=0.04)
    assert_close_fp32(run_ours(inp, kw, chunk_size=T, **dict(opts, compile=True)), run_ref(inp, kw, opts))
    one = dict(inp, hidden=inp["hidden"].detach()[:1].requires_grad_(True))
    for k in ("completion_ids", "completion_mask", "advantages"):
        one[k] = inp[k][:1]
    kw1 = {k: v[:1] for k, v in kw.items()}
    assert_close_fp32(run_ours(one, kw1, **dict(opts, compile=True)), run_ref(one, kw1, opts))


@pytest.mark.parametrize(
    "opts",
    [
        dict(loss_type="dapo", beta=0.04),
        dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
        dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.1),
        dict(loss_type="cispo", epsilon_high=1.2),
        dict(loss_type="dapo", beta=0.04, softcap=3.0, logit_scale=1.5, temperature=0.9),
    ],
)
def test_bf16(opts):
    """bf16 against the fp32 reference, with the materialised bf16 torch loss's error as the yardstick."""
    inp, kw = make_inputs(dtype=torch.bfloat16)
    opts = {"compile": False, **opts}
    l32, g32, _ = run_ref(inp, kw, opts)
    lt, gt, _ = run_ref(inp, kw, opts, dtype=torch.bfloat16)
    lo, go, _ = run_ours(inp, kw, chunk_size=7, **opts)
    assert_close_to_ref(lo, l32, lt, "loss", dtype=torch.bfloat16)
    for i, (a, b, r) in enumerate(zip(go, gt, g32)):
        assert_close_to_ref(a, r, b, f"grad {i}", dtype=torch.bfloat16)


def test_no_grad_inputs():
    """Gradients are None for inputs that do not require grad; the loss is unchanged."""
    inp, kw = make_inputs()
    inp["weight"].requires_grad_(False)
    inp["bias"].requires_grad_(False)
    mod = FusedLinearGRPOLoss(compile=False, beta=0.04, chunk_size=4)
    loss = mod(**inp, **kw)
    loss.backward()
    assert inp["weight"].grad is None and inp["bias"].grad is None
    assert inp["hidden"].grad is not None
    with torch.no_grad():
        assert torch.equal(mod(**inp, **kw), loss.detach())


def test_all_masked():
    """Every completion empty: loss 0, zero gradients, NaN min/max metrics (TRL's nanmin of nothing)."""
    inp, kw = make_inputs()
    inp["completion_mask"] = torch.zeros(B, T, dtype=torch.long)
    for lt in ("dapo", "grpo"):
        for level in ("token", "sequence"):
            lo, go, mo = run_ours(
                inp, kw, compile=False, chunk_size=4, beta=0.04, loss_type=lt, importance_sampling_level=level
            )
            lr, _, mr = run_ref(inp, kw, dict(beta=0.04, loss_type=lt, importance_sampling_level=level))
            assert lo == 0.0 and lr == 0.0
            assert all(float(g.abs().max()) == 0.0 for g in go)
            for k in mr:
                assert (math.isnan(float(mr[k])) and math.isnan(float(mo[k]))) or float(mr[k]) == float(
                    mo[k]
                ), k


def test_bad_inputs():
    inp, kw = make_inputs()
    mod = FusedLinearGRPOLoss(compile=False, beta=0.04)
    with pytest.raises(ValueError, match="completion_mask"):
        mod(**{**inp, "completion_mask": inp["completion_mask"][:, :-1]}, **kw)
    with pytest.raises(ValueError, match="completion_ids"):
        mod(**{**inp, "completion_ids": inp["completion_ids"][:-1]}, **kw)
    with pytest.raises(ValueError, match="completion_ids holds"):
        ids = inp["completion_ids"].clone()
        ids[0, 0] = V
        mod(**{**inp, "completion_ids": ids}, **kw)
    with pytest.raises(ValueError, match="advantages"):
        mod(**{**inp, "advantages": torch.randn(B + 1)}, **kw)
    with pytest.raises(ValueError, match="ref_logps"):
        mod(**inp, old_logps=kw["old_logps"])
    with pytest.raises(ValueError, match="old_logps"):
        mod(**inp, old_logps=kw["old_logps"][:, :3], ref_logps=kw["ref_logps"])
    with pytest.raises(ValueError, match="max_completion_length"):
        FusedLinearGRPOLoss(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="use_adaptive_entropy"):
        FusedLinearGRPOLoss(use_adaptive_entropy=True)
    with pytest.raises(ValueError, match="loss_type"):
        FusedLinearGRPOLoss(loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        FusedLinearGRPOLoss(importance_sampling_level="tok")
    with pytest.raises(ValueError, match="softcap"):
        FusedLinearGRPOLoss(softcap=0.0)
    with pytest.raises(ValueError, match="logit_scale"):
        FusedLinearGRPOLoss(logit_scale=-1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        FusedLinearGRPOLoss(epsilon=0.2)
    with pytest.raises(ValueError, match="token-level importance_sampling_ratio"):
        FusedLinearGRPOLoss(loss_type="vespo")(**inp, importance_sampling_ratio=torch.ones(B))


# Entropy mask with β ≠ 0: every chunk runs its backward in pass 1 with the entropy quantile of the rows seen
# so far (``FusedLinearGRPOLoss.pass_1_estimates``), pass 2 re-projects the rows on the other side of the
# final threshold and adds the change. Besides the references (test_options_fp32), these check the premise:
# how many rows each pass projects, and that a wrong estimate is corrected exactly.
def _count_projections(monkeypatch, weight):
    from chunkloss.engine import loop as base

    projected, real = [], base.project_head

    def spy(x, w, bias):
        if w is weight:
            projected.append(x.shape[0])
        return real(x, w, bias)

    monkeypatch.setattr(base, "project_head", spy)
    return projected


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "sapo", "luspo"])
@pytest.mark.parametrize("kl", ["precomputed", "head"])
def test_entropy_mask_backward_in_pass_1(loss_type, kl, monkeypatch):
    inp, kw = make_inputs(ref_head=kl == "head")
    opts = grid_opts(loss_type, "token", beta=0.04, top_entropy_quantile=0.3)
    ref = run_ref(inp, kw, opts)
    n_valid = int(inp["completion_mask"].sum())
    for chunk in (1, 3, 7, 1000):
        projected = _count_projections(monkeypatch, inp["weight"])
        assert_close_fp32(run_ours(inp, kw, chunk_size=chunk, **opts), ref)
        # Pass 1 projects every row once; pass 2 only rows whose mask the estimate got wrong. With one chunk
        # the estimate is the final threshold: no pass 2 at all.
        assert sum(projected[: -(-n_valid // chunk)]) == n_valid
        if chunk == 1000:
            assert projected == [n_valid]


def test_entropy_mask_wrong_estimate_is_corrected(monkeypatch):
    """An estimate that drops every row in pass 1: pass 2 projects some of the rows the final mask keeps, and
    the result is still the reference's. Without the hook, pass 2 projects every row again."""
    inp, kw = make_inputs()
    opts = grid_opts("dapo", "token", beta=0.04, top_entropy_quantile=0.3)
    ref = run_ref(inp, kw, opts)
    n_valid = int(inp["completion_mask"].sum())
    real = FusedLinearGRPOLoss.pass_1_estimates

    def wrong(self, batch):
        estimate, calls = real(self, batch), []

        def first_wrong(stats):  # one call per chunk of pass 1, then the final one
            calls.append(1)
            thr = estimate(stats)["entropy_threshold"]
            return {"entropy_threshold": thr + float("inf") if len(calls) <= -(-n_valid // 4) else thr}

        return first_wrong

    monkeypatch.setattr(FusedLinearGRPOLoss, "pass_1_estimates", wrong)
    projected = _count_projections(monkeypatch, inp["weight"])
    assert_close_fp32(run_ours(inp, kw, chunk_size=4, **opts), ref)
    n_kept = int(torch.tensor(n_valid * 0.7).ceil())  # rows at or above the 0.7 quantile of n_valid values
    # Pass 2: the kept rows whose policy term has a gradient (a clipped ratio has none).
    assert n_valid < sum(projected) <= n_valid + n_kept, (projected, n_valid, n_kept)
    monkeypatch.setattr(FusedLinearGRPOLoss, "pass_1_estimates", lambda self, batch: None)
    projected.clear()
    assert_close_fp32(run_ours(inp, kw, chunk_size=4, **opts), ref)
    assert sum(projected) == 2 * n_valid


def test_quantile_equals_torch_and_compiles():
    """The entropy threshold's quantile is torch.quantile bit for bit (sizes 1 to 20k, q at 0, 1 and between),
    and compiles in one graph with a dynamic length (torch 2.11's torch.quantile does not)."""
    from chunkloss.losses.common import quantile

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 20000, (1,), generator=g))
        q = (0.0, 1.0, 0.8, 0.5)[trial % 4] if trial % 2 else float(torch.rand((), generator=g))
        e = torch.randn(n, generator=g) * 3 + 7
        assert torch.equal(quantile(e, q), torch.quantile(e, q)), (n, q)
    compiled = torch.compile(quantile, dynamic=True, fullgraph=True)
    for n in (2, 37, 1000):
        e = torch.rand(n, generator=g)
        assert torch.equal(compiled(e, 0.8), torch.quantile(e, 0.8))


@pytest.mark.parametrize("compile", [False, True])
def test_entropy_coef_per_call(compile):
    """A coefficient passed to the call (a float or a 0-d tensor) acts as the constructor's would, and one
    compiled module takes every value: the adaptive controller's steps do not recompile."""
    inp, kw = make_inputs()
    base = grid_opts("dapo", "token", top_entropy_quantile=0.5)
    mod = FusedLinearGRPOLoss(**dict(base, entropy_coef=1.0, compile=compile))
    for coef in (0.07, torch.tensor(0.02), 0.0):
        ref = run_ref(inp, kw, dict(base, entropy_coef=float(coef)))
        ref = (ref[0], ref[1], {**ref[2], "policy_loss": ref[2].get("policy_loss", ref[0])})
        for x in leaves(inp):
            x.grad = None
        loss = mod(**inp, **kw, entropy_coef=coef)
        loss.backward()
        assert_close_fp32((loss.detach(), [x.grad for x in leaves(inp)], mod.metrics), ref)
    with pytest.raises(ValueError, match="needs the entropy bonus switched on"):
        FusedLinearGRPOLoss(**base)(**inp, **kw, entropy_coef=0.1)
