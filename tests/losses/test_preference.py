"""FusedLinearDPOLoss / ORPO / CPO / SimPO against their fp32 references (``dpo_ref``, ``orpo_ref``,
``cpo_ref``), in one-pass and two-pass mode, plus bad inputs and a hand-computed case."""

from __future__ import annotations

import math

import pytest
import torch

from chunkloss.engine.plan import chunk_rows
from chunkloss.engine.plan import plan_chunks as _plan_chunks
from chunkloss.losses.cpo import FusedLinearCPOLoss
from chunkloss.losses.dpo import DPO_LOSS_TYPES, FusedLinearDPOLoss
from chunkloss.losses.orpo import FusedLinearORPOLoss
from chunkloss.losses.simpo import FusedLinearSimPOLoss
from chunkloss.testing.reference import cpo_ref, dpo_ref, orpo_ref
from tests.tolerances import assert_close_to_ref

B, T, H, V = 3, 13, 31, 123  # odd shapes: 3 pairs of 13 tokens, H=31, V=123
ONE_PASS, TWO_PASS = 1000, 7  # 1000 ≥ any pair's tokens (one pass); 7 < a pair's tokens (two passes)


def _inputs(b=B, t=T, h=H, v=V, bias=True, dtype=torch.float32, empty_pair=False, ref=True, seed=1):
    """Pairs whose first 2..4 positions are prompt (ignored) and whose completions end at different
    lengths (padding ignored); ``empty_pair`` gives pair 1 a completion of zero tokens."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2 * b, t, h, generator=g) * 0.5).to(dtype).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_(True)
    bb = (torch.randn(v, generator=g) * 0.1).to(dtype).requires_grad_(True) if bias else None
    y = torch.randint(0, v, (2 * b, t), generator=g)
    prompt = torch.randint(2, 5, (2 * b,), generator=g)
    end = t - torch.randint(0, 4, (2 * b,), generator=g)
    pos = torch.arange(t)
    y[(pos < prompt[:, None]) | (pos >= end[:, None])] = -100
    nll = torch.where(pos < end[:, None], torch.randint(0, v, (2 * b, t), generator=g), -100)[:b]
    if empty_pair and b > 1:
        y[1] = -100  # chosen completion of pair 1 is empty
    d = dict(x=x, w=w, b=bb, chosen=y[:b], rejected=y[b:], nll=nll)
    if ref:
        d["rx"] = (x.detach().float() + 0.3 * torch.randn(2 * b, t, h, generator=g)).to(dtype)
        d["rw"] = (w.detach().float() + 0.1 * torch.randn(v, h, generator=g)).to(dtype)
        d["rb"] = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
    return d


def _leaves(d):
    return [d["x"], d["w"], d["b"]]


def _grads(loss, d):
    leaves = [t for t in _leaves(d) if t is not None and t.requires_grad]
    gs = iter(torch.autograd.grad(loss, leaves))
    return [next(gs) if (t is not None and t.requires_grad) else None for t in _leaves(d)]


def _ref_kwargs(d, ref_mode):
    if ref_mode == "model":
        return dict(ref_hidden=d["rx"], ref_weight=d["rw"], ref_bias=d["rb"])
    if ref_mode == "logps":  # the reference head's sequence log-probs, precomputed
        c, r = _seq_logps(d)
        return dict(ref_chosen_logps=c, ref_rejected_logps=r)
    return {}


def _seq_logps(d):
    labels = torch.cat([d["chosen"], d["rejected"]])
    z = d["rx"].float() @ d["rw"].float().t() + (d["rb"].float() if d["rb"] is not None else 0)
    lp = torch.log_softmax(z, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    s = (lp * (labels != -100)).sum(1)
    return s[: d["chosen"].shape[0]], s[d["chosen"].shape[0] :]


def _run(cls, d, call_kw=None, **opts):
    mod = cls(**opts)
    loss = mod(d["x"], d["w"], d["chosen"], d["rejected"], bias=d["b"], **(call_kw or {}))
    return loss, _grads(loss, d), mod.metrics


def _check(ours, ref, d):
    """Loss, metrics and gradients against the fp32 reference (tests/tolerances.py's fp32 row)."""
    loss, grads, metrics = ours
    ref_loss, ref_metrics = ref
    ref_grads = _grads(ref_loss, d)
    assert_close_to_ref(loss, ref_loss.float(), name="loss")
    assert set(metrics) == set(ref_metrics)
    for k in ref_metrics:
        assert_close_to_ref(metrics[k], ref_metrics[k].float(), name=k)
    for i, (g, rg) in enumerate(zip(grads, ref_grads)):
        assert (g is None) == (rg is None)
        if g is not None:
            assert_close_to_ref(g, rg, name=f"grad {i}")


def _dpo_ref_call(d, ref_mode, **opts):
    kw = _ref_kwargs(d, ref_mode)
    return dpo_ref(d["x"], d["w"], d["chosen"], d["rejected"], d["b"], **kw, **opts)


# --------------------------------------------------------------------------------------------------
def test_one_and_two_pass_are_what_the_chunk_sizes_pick():
    d = _inputs()
    mod = FusedLinearDPOLoss(chunk_size=ONE_PASS)
    from chunkloss.engine import sequence_batch

    keep = torch.cat([d["chosen"], d["rejected"]]) != -100
    batch, _ = sequence_batch(keep, torch.arange(2 * B) % B)
    n = batch.rows.numel()
    assert _plan_chunks(mod, batch, n, ONE_PASS)[1] is True
    assert _plan_chunks(mod, batch, n, TWO_PASS)[1] is False
    # The automatic chunk size picks one pass too when every pair fits (3 GEMMs instead of 4).
    auto = FusedLinearDPOLoss()
    assert _plan_chunks(auto, batch, n, chunk_rows(auto, d["w"], d["x"]))[1] is True


def _loss_opts(loss_type):
    opts = dict(loss_type=loss_type, beta=0.3)
    if loss_type in ("exo_pair", "robust", "aot", "aot_unpaired"):
        opts["label_smoothing"] = 0.1
    return opts


@pytest.mark.parametrize("chunk", [ONE_PASS, TWO_PASS])
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_every_loss_type(loss_type, chunk):
    d = _inputs()
    opts = _loss_opts(loss_type)
    ours = _run(FusedLinearDPOLoss, d, _ref_kwargs(d, "model"), chunk_size=chunk, compile=False, **opts)
    _check(ours, _dpo_ref_call(d, "model", **opts), d)


@pytest.mark.parametrize("ref_mode", ["model", "logps", "none"])
@pytest.mark.parametrize("chunk", [1, TWO_PASS, ONE_PASS])
def test_dpo_reference_modes(ref_mode, chunk):
    d = _inputs(bias=ref_mode != "none")
    ours = _run(FusedLinearDPOLoss, d, _ref_kwargs(d, ref_mode), chunk_size=chunk, compile=False)
    _check(ours, _dpo_ref_call(d, ref_mode), d)


@pytest.mark.parametrize(
    "opts",
    [
        dict(f_divergence_type="forward_kl"),
        dict(f_divergence_type="js_divergence", loss_type="hinge"),
        dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3, loss_type="ipo"),
        dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=1.0),
        dict(ld_alpha=0.4),
        dict(ld_alpha=0.0, loss_type="sigmoid_norm"),
        dict(use_weighting=True),
        dict(use_weighting=True, loss_type=("sigmoid", "sft"), loss_weights=(0.8, 0.2)),
        dict(loss_type=("sigmoid", "bco_pair", "sft"), loss_weights=(1.0, 0.5, 0.3)),
        dict(loss_type="robust", label_smoothing=0.2),
        dict(average_log_prob=True),
        dict(loss_type=("aot", "sigmoid"), label_smoothing=0.05),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
@pytest.mark.parametrize("chunk", [ONE_PASS, TWO_PASS])
def test_dpo_options(opts, chunk):
    d = _inputs()
    ours = _run(FusedLinearDPOLoss, d, _ref_kwargs(d, "model"), chunk_size=chunk, compile=False, **opts)
    _check(ours, _dpo_ref_call(d, "model", **opts), d)


@pytest.mark.parametrize("chunk", [1, TWO_PASS, ONE_PASS])
@pytest.mark.parametrize("own_nll", [False, True])
def test_orpo(chunk, own_nll):
    d = _inputs(ref=False)
    kw = dict(nll_labels=d["nll"]) if own_nll else {}
    ours = _run(FusedLinearORPOLoss, d, kw, chunk_size=chunk, compile=False, beta=0.2)
    _check(ours, orpo_ref(d["x"], d["w"], d["chosen"], d["rejected"], d["b"], beta=0.2, **kw), d)


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(loss_type="hinge"),
        dict(loss_type="ipo", cpo_alpha=0.5),
        dict(loss_type="simpo", simpo_gamma=0.7, label_smoothing=0.1),
        dict(alpha=0.25, loss_type="simpo"),  # AlphaPO on mean log-probs (on sums p^-α explodes)
        dict(cpo_alpha=0.0),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default",
)
@pytest.mark.parametrize("chunk", [TWO_PASS, ONE_PASS])
def test_cpo(opts, chunk):
    d = _inputs(ref=False)
    ours = _run(FusedLinearCPOLoss, d, None, chunk_size=chunk, compile=False, beta=0.2, **opts)
    _check(ours, cpo_ref(d["x"], d["w"], d["chosen"], d["rejected"], d["b"], beta=0.2, **opts), d)


@pytest.mark.parametrize("chunk", [TWO_PASS, ONE_PASS])
def test_simpo_is_cpo_with_simpo_defaults(chunk):
    d = _inputs(ref=False)
    ours = _run(FusedLinearSimPOLoss, d, None, chunk_size=chunk, compile=False, beta=2.0, simpo_gamma=0.5)
    ref = cpo_ref(
        d["x"],
        d["w"],
        d["chosen"],
        d["rejected"],
        d["b"],
        beta=2.0,
        loss_type="simpo",
        simpo_gamma=0.5,
        cpo_alpha=0.0,
    )
    _check(ours, ref, d)
    assert "nll_loss" not in ours[2]


@pytest.mark.parametrize(
    "cls,opts,ref_fn",
    [
        (FusedLinearDPOLoss, dict(loss_type="ipo"), _dpo_ref_call),
        (FusedLinearDPOLoss, dict(), _dpo_ref_call),
        (FusedLinearORPOLoss, dict(), None),
        (FusedLinearSimPOLoss, dict(), None),
    ],
)
@pytest.mark.parametrize("chunk", [1, ONE_PASS])
def test_pair_with_empty_completion(cls, opts, ref_fn, chunk):
    """Pair 1's chosen completion has no tokens: a finite loss and finite gradients."""
    d = _inputs(empty_pair=True)
    call = _ref_kwargs(d, "model") if cls is FusedLinearDPOLoss else None
    ours = _run(cls, d, call, chunk_size=chunk, compile=False, **opts)
    assert torch.isfinite(ours[0]) and all(torch.isfinite(g).all() for g in ours[1])
    assert all(torch.isfinite(v) for v in ours[2].values())
    args = (d["x"], d["w"], d["chosen"], d["rejected"], d["b"])
    if cls is FusedLinearDPOLoss:
        ref = _dpo_ref_call(d, "model", **opts)
    elif cls is FusedLinearORPOLoss:
        ref = orpo_ref(*args)
    else:
        ref = cpo_ref(*args, loss_type="simpo", cpo_alpha=0.0)
    _check(ours, ref, d)


def test_all_tokens_ignored_gives_defined_result():
    d = _inputs(ref=False)
    d["chosen"] = torch.full_like(d["chosen"], -100)
    d["rejected"] = torch.full_like(d["rejected"], -100)
    loss, grads, metrics = _run(FusedLinearDPOLoss, d, None, chunk_size=5, compile=False)
    torch.testing.assert_close(loss, torch.tensor(math.log(2)))  # -logσ(0)
    assert all(g is not None and not g.any() for g in grads)


@pytest.mark.parametrize("chunk", [1, 5, 17, 1000])
def test_chunk_invariance(chunk):
    d = _inputs()
    kw = _ref_kwargs(d, "model")
    base = _run(FusedLinearDPOLoss, d, kw, chunk_size=1000, compile=False, use_weighting=True, ld_alpha=0.5)
    other = _run(FusedLinearDPOLoss, d, kw, chunk_size=chunk, compile=False, use_weighting=True, ld_alpha=0.5)
    assert_close_to_ref(other[0], base[0])
    for g, gb in zip(other[1], base[1]):
        assert_close_to_ref(g, gb)
    for k in base[2]:
        assert_close_to_ref(other[2][k], base[2][k])


def test_no_grad_inputs_give_none():
    d = _inputs(ref=False)
    d["w"].requires_grad_(False)
    d["b"].requires_grad_(False)
    loss, grads, _ = _run(FusedLinearORPOLoss, d, None, chunk_size=TWO_PASS, compile=False)
    ref_loss, _ = orpo_ref(d["x"], d["w"], d["chosen"], d["rejected"], d["b"])
    assert grads[1] is None and grads[2] is None
    assert_close_to_ref(grads[0], _grads(ref_loss, d)[0])


@pytest.mark.parametrize(
    "cls,opts", [(FusedLinearDPOLoss, dict(loss_type=("sigmoid", "ipo"))), (FusedLinearORPOLoss, dict())]
)
@pytest.mark.parametrize("chunk", [TWO_PASS, ONE_PASS])
def test_compiled(cls, opts, chunk):
    d = _inputs()
    call = _ref_kwargs(d, "model") if cls is FusedLinearDPOLoss else None
    ours = _run(cls, d, call, chunk_size=chunk, compile=True, **opts)
    args = (d["x"], d["w"], d["chosen"], d["rejected"], d["b"])
    ref = _dpo_ref_call(d, "model", **opts) if cls is FusedLinearDPOLoss else orpo_ref(*args)
    _check(ours, ref, d)


@pytest.mark.parametrize("cls", [FusedLinearDPOLoss, FusedLinearORPOLoss, FusedLinearSimPOLoss])
@pytest.mark.parametrize("chunk", [TWO_PASS, ONE_PASS])
def test_bf16(cls, chunk):
    """Three-way: fp32 reference on the bf16 inputs, plain bf16 torch, ours."""
    d = _inputs(dtype=torch.bfloat16)
    args = (d["x"], d["w"], d["chosen"], d["rejected"], d["b"])
    if cls is FusedLinearDPOLoss:
        call = _ref_kwargs(d, "model")
        ref_fn = dpo_ref
    elif cls is FusedLinearORPOLoss:
        call, ref_fn = None, orpo_ref
    else:
        call = None

        def ref_fn(*a, **k):
            return cpo_ref(*a, **k, loss_type="simpo", cpo_alpha=0.0)

    ours = _run(cls, d, call, chunk_size=chunk, compile=False)
    ref_loss, ref_m = ref_fn(*args, **(call or {}))
    ref_g = _grads(ref_loss, d)
    # Plain bf16 torch: the reference's math with bf16 logits (its logits_ref upcasts, so emulate
    # the bf16 model head by rounding the inputs' product to bf16 before the fp32 softmax would
    # hide torch's error; instead run the reference on bf16 logits by a bf16 "identity" head).
    z16 = (d["x"] @ d["w"].t() + d["b"]).detach().requires_grad_(True)
    eye = torch.eye(V, dtype=torch.bfloat16)
    t_args = (z16, eye, d["chosen"], d["rejected"], None)
    t_call = None
    if call:
        rz = (call["ref_hidden"] @ call["ref_weight"].t() + call["ref_bias"]).detach()
        t_call = dict(ref_hidden=rz, ref_weight=eye)
    t_loss, t_m = ref_fn(*t_args, **(t_call or {}))
    (gz,) = torch.autograd.grad(t_loss, z16)
    gz = gz.to(torch.bfloat16)
    t_grads = [gz @ d["w"], gz.reshape(-1, V).t() @ d["x"].reshape(-1, H), gz.reshape(-1, V).sum(0)]
    bf16 = torch.bfloat16
    assert_close_to_ref(ours[0], ref_loss, t_loss, "loss", dtype=bf16)
    for i, (g, rg, tg) in enumerate(zip(ours[1], ref_g, t_grads)):
        assert_close_to_ref(g, rg, tg, f"grad {i}", dtype=bf16)
    for k in ref_m:
        assert_close_to_ref(ours[2][k], ref_m[k].float(), t_m[k].float(), k, dtype=bf16)


def test_hand_computed_tiny_case():
    """One pair, V=2, H=1, weight = [[1], [-1]], one completion token each: logits ±x."""
    x = torch.tensor([[[1.0]], [[0.0]]], requires_grad=True)  # chosen row x=1, rejected row x=0
    w = torch.tensor([[1.0], [-1.0]], requires_grad=True)
    chosen, rejected = torch.tensor([[0]]), torch.tensor([[0]])
    mod = FusedLinearDPOLoss(beta=1.0, compile=False)
    loss = mod(x, w, chosen, rejected)
    # log p_c = log σ(2) (logits [1, -1]); log p_r = log ½; reference-free.
    lc, lr = math.log(1 / (1 + math.exp(-2))), math.log(0.5)
    expected = -math.log(1 / (1 + math.exp(-(lc - lr))))
    torch.testing.assert_close(loss, torch.tensor(expected))
    loss.backward()
    # dL/dlc = -(1 - σ(lc - lr)); dlc/dx = 2·(1 - σ(2))
    s = 1 / (1 + math.exp(-(lc - lr)))
    torch.testing.assert_close(x.grad[0, 0, 0], torch.tensor(-(1 - s) * 2 * (1 - 1 / (1 + math.exp(-2)))))
    torch.testing.assert_close(mod.metrics["rewards/margins"], torch.tensor(lc - lr))
    torch.testing.assert_close(mod.metrics["logits/chosen"], torch.tensor(0.0))


@pytest.mark.parametrize("chunk", [None, 32768])  # two passes, one pass
def test_long_sequence_logps_are_summed_to_fp32_precision(chunk):
    """One pair of 16k tokens: the sequence log-probs (≈ -5e4) equal their float64 sum within 2 fp32 ulps.
    Summed one row at a time in fp32 (``index_add``) they were ~30 ulps off (0.32 nats at V=128256,
    which moved a DPO loss by 2.5%)."""
    t, v, h = 16384, 64, 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, t, h, generator=g, requires_grad=True)
    w = torch.randn(v, h, generator=g, requires_grad=True)
    y = torch.randint(0, v, (2, t), generator=g)
    y[:, : t // 4] = -100
    mod = FusedLinearDPOLoss(compile=False, chunk_size=chunk)
    loss = mod(x, w, y[:1], y[1:])
    lp = torch.log_softmax(x.detach().double() @ w.detach().double().t(), -1)
    seq = (lp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (y != -100)).sum(1)
    for name, exact in (("logps/chosen", seq[0]), ("logps/rejected", seq[1])):
        ulp = torch.finfo(torch.float32).eps * exact.abs()
        assert (mod.metrics[name].double() - exact).abs() <= 2 * ulp, name
    # The loss sees c - r with those 2 + 2 ulps: |Δloss| ≤ σ(-β·d)·β·4 ulps.
    d = seq[0] - seq[1]
    exact_loss = -torch.nn.functional.logsigmoid(0.1 * d)
    bound = torch.sigmoid(-0.1 * d) * 0.1 * 4 * torch.finfo(torch.float32).eps * seq.abs().max()
    assert (loss.double() - exact_loss).abs() <= bound


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cls", [FusedLinearDPOLoss, FusedLinearORPOLoss, FusedLinearSimPOLoss, FusedLinearCPOLoss]
)
def test_no_pairs(cls):
    """A batch of zero pairs: loss and every metric 0 (a mean over no pairs was 0/0 = NaN), zero gradients."""
    w = torch.randn(V, H, requires_grad=True)
    x = torch.randn(0, T, H, requires_grad=True)
    y = torch.zeros(0, T, dtype=torch.long)
    mod = cls(compile=False)
    loss = mod(x, w, y, y)
    loss.backward()
    assert loss.item() == 0.0
    assert mod.metrics and all(v.item() == 0.0 for v in mod.metrics.values()), mod.metrics
    assert w.grad.abs().sum().item() == 0.0 and x.grad.shape == x.shape


def test_bad_inputs():
    d = _inputs()
    dpo, orpo = FusedLinearDPOLoss(compile=False), FusedLinearORPOLoss(compile=False)
    x, w, c, r = d["x"], d["w"], d["chosen"], d["rejected"]
    with pytest.raises(ValueError, match="chosen shape"):
        dpo(x, w, c[:, :-1], r)
    with pytest.raises(ValueError, match="rejected shape"):
        dpo(x, w, c, r[:-1])
    # Out-of-range labels: the deferred range checks raise in sequence_batch's sync, before any chunk runs.
    for bad in (V, -2):
        for loss in (dpo, orpo):
            with pytest.raises(ValueError, match=f"chosen holds {bad}, outside"):
                loss(x, w, c.masked_fill(c == c.max(), bad), r)
            with pytest.raises(ValueError, match=f"rejected holds {bad}, outside"):
                loss(x, w, c, r.masked_fill(r == r.max(), bad))
        with pytest.raises(ValueError, match=f"nll_labels holds {bad}, outside"):
            orpo(x, w, c, r, nll_labels=c.masked_fill(c == c.max(), bad))
    with pytest.raises(ValueError, match=r"\(2B, T, H\)"):
        dpo(x[:-1], w, c, r)
    with pytest.raises(ValueError, match=r"\(2B, T, H\)"):
        dpo(x.reshape(-1, H), w, c, r)
    with pytest.raises(ValueError, match="ref_hidden and ref_weight"):
        dpo(x, w, c, r, ref_hidden=d["rx"])
    with pytest.raises(ValueError, match="not both"):
        dpo(
            x,
            w,
            c,
            r,
            ref_hidden=d["rx"],
            ref_weight=d["rw"],
            ref_chosen_logps=torch.zeros(B),
            ref_rejected_logps=torch.zeros(B),
        )
    with pytest.raises(ValueError, match="both ref_chosen_logps"):
        dpo(x, w, c, r, ref_chosen_logps=torch.zeros(B))
    with pytest.raises(ValueError, match="ref_chosen_logps must be"):
        dpo(x, w, c, r, ref_chosen_logps=torch.zeros(B + 1), ref_rejected_logps=torch.zeros(B))
    with pytest.raises(ValueError, match="ref_hidden rows"):
        dpo(x, w, c, r, ref_hidden=d["rx"][:, :-1], ref_weight=d["rw"])
    with pytest.raises(ValueError, match="ref_weight vocab"):
        dpo(x, w, c, r, ref_hidden=d["rx"], ref_weight=d["rw"][:-1])
    with pytest.raises(ValueError, match="takes no reference"):
        orpo(x, w, c, r, ref_hidden=d["rx"], ref_weight=d["rw"])
    with pytest.raises(ValueError, match="no NLL term"):
        dpo(x, w, c, r, nll_labels=c)
    with pytest.raises(ValueError, match="no NLL term"):
        FusedLinearSimPOLoss(compile=False)(x, w, c, r, nll_labels=c)
    with pytest.raises(ValueError, match="outside"):
        dpo(x, w, c.clamp(min=0) + V, r)
    with pytest.raises(TypeError, match="integer"):
        dpo(x, w, c.float(), r)


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(loss_type="kto"), "unknown loss_type"),
        (dict(loss_type=("sigmoid", "ipo"), loss_weights=(1.0,)), "one weight per loss_type"),
        (dict(f_divergence_type="tv"), "f_divergence_type must be"),
        (dict(f_divergence_type="forward_kl", loss_type="bco_pair"), "only supports"),
        (dict(use_weighting=True, loss_type="aot"), "use_weighting"),
        (dict(loss_type="exo_pair"), "exo_pair"),
        (dict(loss_type="robust", label_smoothing=0.5), "robust"),
        (dict(ld_alpha=1.5), "ld_alpha"),
        (dict(beta=0.0), "beta"),
        (dict(rpo_alpha=1.0), "unexpected keyword argument 'rpo_alpha'"),
    ],
)
def test_bad_options(opts, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FusedLinearDPOLoss(**opts)


def test_cpo_bad_options():
    with pytest.raises(ValueError, match="loss_type"):
        FusedLinearCPOLoss(loss_type="sppo_hard")


# --------------------------------------------------------------------------------------------------
# Model-side logit transforms and the token metrics (TRL DPOTrainer's entropy / mean_token_accuracy).
@pytest.mark.parametrize(
    "cls,ref_fn,opts",
    [
        (FusedLinearDPOLoss, dpo_ref, dict(loss_type="sigmoid", beta=0.3)),
        (FusedLinearDPOLoss, dpo_ref, dict(loss_type=("sigmoid", "sft"), use_weighting=True, beta=0.3)),
        (FusedLinearORPOLoss, orpo_ref, dict(beta=0.2)),
        (FusedLinearCPOLoss, cpo_ref, dict(loss_type="ipo", beta=0.3)),
        (FusedLinearSimPOLoss, cpo_ref, dict(beta=2.0, loss_type="simpo", cpo_alpha=0.0)),
    ],
)
@pytest.mark.parametrize("chunk", [1, ONE_PASS])
def test_logit_transforms_and_token_metrics(cls, ref_fn, opts, chunk):
    """logit_scale then softcap on the policy (and DPO's reference head), with the entropy and top-1
    accuracy metrics; one and two passes."""
    d = _inputs(empty_pair=True)
    tf = dict(logit_scale=1.7, softcap=1.5, return_token_metrics=True)
    call_kw = _ref_kwargs(d, "model") if cls is FusedLinearDPOLoss else {}
    ours = _run(cls, d, call_kw, chunk_size=chunk, compile=False, **opts, **tf)
    ref_opts = {k: v for k, v in opts.items() if not (cls is FusedLinearSimPOLoss and k == "cpo_alpha")}
    if cls is FusedLinearSimPOLoss:
        ref_opts["cpo_alpha"] = 0.0
    ref = ref_fn(d["x"], d["w"], d["chosen"], d["rejected"], d["b"], **call_kw, **ref_opts, **tf)
    _check(ours, ref, d)
    assert {"entropy", "mean_token_accuracy"} <= set(ours[2])
    # softcap 1.5 binds (|z|·1.7 reaches well past it): the transforms change the loss.
    plain = ref_fn(d["x"], d["w"], d["chosen"], d["rejected"], d["b"], **call_kw, **ref_opts)[0]
    assert abs(float(plain.detach()) - float(ref[0].detach())) > 1e-3


@pytest.mark.parametrize("chunk", [1, ONE_PASS])
def test_orpo_logit_rows(chunk):
    """ORPO's logits/* over every position (TRL: the mean of the padded [B, T-1, V] logits): the extra
    rows are projected for the metric only; loss and gradients are unchanged."""
    d = _inputs()
    rows = torch.ones(2 * B, T, dtype=torch.bool)
    rows[0, -2:] = False  # any row set works, not just all
    kw = dict(nll_labels=d["nll"])
    ours = _run(FusedLinearORPOLoss, d, dict(kw, logit_rows=rows), chunk_size=chunk, compile=False)
    ref = orpo_ref(d["x"], d["w"], d["chosen"], d["rejected"], d["b"], logit_rows=rows, **kw)
    _check(ours, ref, d)
    z = d["x"].detach() @ d["w"].detach().t() + d["b"].detach()
    zm = z.mean(-1)
    assert_close_to_ref(ours[2]["logits/rejected"], zm[B:].mean())
    assert_close_to_ref(ours[2]["logits/chosen"], zm[:B][rows[:B]].mean())


def test_token_metrics_hand_computed():
    """Two chosen/rejected tokens, V=2: entropy of σ(z) per token, accuracy 1 where the label is the
    argmax (a tie goes to the first index, as TRL's is_top1)."""
    x = torch.tensor([[[1.0]], [[0.0]]])  # (2B=2, T=1, H=1)
    w = torch.tensor([[1.0], [0.0]])  # z = (x, 0)
    chosen, rejected = torch.tensor([[0]]), torch.tensor([[1]])
    mod = FusedLinearDPOLoss(compile=False, return_token_metrics=True)
    mod(x, w, chosen, rejected)
    p = 1 / (1 + math.exp(-1.0))
    ent1 = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert abs(mod.metrics["entropy"].item() - (ent1 + math.log(2)) / 2) < 1e-6
    assert mod.metrics["mean_token_accuracy"].item() == 1.0  # chosen label 0 is the argmax
    mod(x, w, torch.tensor([[1]]), rejected)
    assert mod.metrics["mean_token_accuracy"].item() == 0.0


def test_transform_bad_inputs():
    d = _inputs()
    with pytest.raises(ValueError, match="softcap"):
        FusedLinearDPOLoss(softcap=0.0)
    with pytest.raises(ValueError, match="logit_scale"):
        FusedLinearORPOLoss(logit_scale=0.0)
    with pytest.raises(ValueError, match="logit_rows"):
        FusedLinearORPOLoss(compile=False)(
            d["x"], d["w"], d["chosen"], d["rejected"], bias=d["b"], logit_rows=torch.ones(B, T, dtype=bool)
        )


# --------------------------------------------------------------------------------------------------
# Two passes run the batch's last rows in pass 1 (the last pair when its loss depends on its margin alone,
# else its rejected sequence) with coefficient m·e_LOGP and scale their gradients by λ afterwards
# (``rows_in_pass_1``); the references above check the result, these check the premise for every loss form
# and that pass 2 skips those rows.
_LAST_ROWS_CASES = [
    *[(FusedLinearDPOLoss, _loss_opts(t), "model") for t in DPO_LOSS_TYPES],
    (FusedLinearDPOLoss, dict(ld_alpha=0.4, use_weighting=True), "logps"),
    (FusedLinearDPOLoss, dict(loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.3)), "none"),
    (FusedLinearDPOLoss, dict(loss_type=("sigmoid", "hinge"), average_log_prob=True), "model"),
    (FusedLinearDPOLoss, dict(loss_type=("sigmoid", "ipo")), "model"),
    (FusedLinearDPOLoss, dict(f_divergence_type="js_divergence"), "model"),
    (FusedLinearDPOLoss, dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=1.0), "model"),
    (FusedLinearORPOLoss, dict(beta=0.2), None),
    (FusedLinearCPOLoss, dict(loss_type="ipo", cpo_alpha=0.5), None),
    (FusedLinearCPOLoss, dict(loss_type="hinge", cpo_alpha=0.0), None),
    (FusedLinearCPOLoss, dict(loss_type="simpo", cpo_alpha=0.0, alpha=0.25), None),
    (FusedLinearSimPOLoss, dict(), None),
]
# Those whose whole last pair runs in pass 1 (a function of the margin alone), with their ``margin_power``.
_MARGIN = {0: 0, 1: 0, 2: 1, 3: 0, 5: 0, 12: 0, 14: 1, 15: 0, 17: 1, 20: 0, 23: 0, 25: 1}


@pytest.mark.parametrize(
    "case", range(len(_LAST_ROWS_CASES)), ids=lambda i: f"{i}-{_LAST_ROWS_CASES[i][0].__name__}"
)
def test_last_rows_get_one_column_of_gradient(case, monkeypatch, fresh_steps):
    from chunkloss.engine import loop, steps
    from chunkloss.losses.preference import LOGP, LOGP_RAW, NLL

    cls, opts, ref_mode = _LAST_ROWS_CASES[case]
    coefs, projected, deferred = [], [], []
    real_coef, real_project, real_rows = steps.sequence_coef_eager, loop.project_head, cls.rows_in_pass_1

    def spy_coef(*args, **kwargs):
        out = real_coef(*args, **kwargs)
        coefs.append((out[0], args[3], args[4]))  # dL/dstats, seq_id, num_seqs
        return out

    def spy_project(x, weight, bias):
        if weight is d["w"]:
            projected.append(x.shape[0])
        return real_project(x, weight, bias)

    def spy_rows(self, batch):
        deferred.append(real_rows(self, batch))
        return deferred[-1]

    monkeypatch.setattr(steps, "sequence_coef_eager", spy_coef)
    monkeypatch.setattr(loop, "project_head", spy_project)
    monkeypatch.setattr(cls, "rows_in_pass_1", spy_rows)
    d = _inputs()
    call_kw = _ref_kwargs(d, ref_mode) if ref_mode else {}
    _run(cls, d, call_kw, chunk_size=TWO_PASS, compile=False, **opts)
    ((coef, seq_id, num_seqs),) = coefs
    ((col, n, m),) = deferred
    assert col == LOGP and m.shape == (n,)
    assert cls.margin_power(cls(**opts).options) == _MARGIN.get(case)
    last_seqs = 2 if case in _MARGIN else 1  # the whole last pair, or its rejected sequence
    assert n == int((seq_id >= num_seqs - last_seqs).sum()) > 0
    tail = coef[-n:]
    lam = tail[-1, LOGP] / m[-1]  # may be 0 (loss_type "sft" trains the chosen rows only)
    assert_close_to_ref(tail[:, LOGP], lam * m)
    # The other columns with a logits gradient are 0 (REF_LOGP, MEAN_LOGIT, WPO, ... are the reference's or
    # detached: the pass-2 step reads LOGP, LOGP_RAW and NLL only).
    assert not tail[:, [LOGP_RAW, NLL]].any()
    # Pass 1 projects every row, pass 2 the rows with a gradient but the last ones.
    live = int(coef[:-n].ne(0).any(1).sum())
    assert live > 0 and sum(projected) == seq_id.numel() + live


def test_rows_in_pass_1_is_dropped_by_subclasses_with_their_own_math():
    class OwnLoss(FusedLinearDPOLoss):
        @staticmethod
        def sequence_loss(stats, seq_id, num_seqs, token, sequence, scalars, opts):
            return stats[:, 1].sum(), {}

    class OwnPairLoss(FusedLinearDPOLoss):
        @staticmethod
        def pair_loss(pair, scalars, opts):
            return -pair.chosen, pair.chosen, pair.rejected, {}

    assert not OwnLoss.own_math_rows_in_pass_1
    assert OwnPairLoss.own_math_rows_in_pass_1 and OwnPairLoss.margin_power(OwnPairLoss().options) is not None
