"""FusedLinearJSDLoss against the fp32 reference ``jsd_ref``, TRL's ``generalized_jsd_loss`` and the
DistillationTrainer's ``_chunked_divergence_loss``."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from chunkloss.losses.jsd import FusedLinearJSDLoss
from chunkloss.testing.reference import jsd_ref
from tests.tolerances import assert_close_to_ref

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)


def _inputs(
    n=39, hs=31, ht=17, v=123, ignored=0.3, bias=True, dtype=torch.float32, shape=None, teacher_spread=1.0
):
    """Odd shapes by default: 39 rows (3×13), student H=31, teacher H=17 (different widths), V=123."""
    g = torch.Generator().manual_seed(1)
    x_s = (torch.randn(n, hs, generator=g) * 0.5).to(dtype).requires_grad_(True)
    w_s = (torch.randn(v, hs, generator=g) * 0.5).to(dtype).requires_grad_(True)
    x_t = (torch.randn(n, ht, generator=g) * 0.5 * teacher_spread).to(dtype)
    w_t = (torch.randn(v, ht, generator=g) * 0.5).to(dtype)
    b_s = (torch.randn(v, generator=g) * 0.1).to(dtype).requires_grad_(True) if bias else None
    b_t = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignored] = -100
    if shape is not None:
        x_s = x_s.detach().reshape(*shape, hs).requires_grad_(True)
        x_t = x_t.reshape(*shape, ht)
        y = y.reshape(shape)
    return dict(x_s=x_s, w_s=w_s, x_t=x_t, w_t=w_t, y=y, b_s=b_s, b_t=b_t)


def _leaves(d):
    return [t for t in (d["x_s"], d["w_s"], d["b_s"]) if t is not None]


def _grads(loss, d):
    leaves = [t for t in _leaves(d) if t.requires_grad]
    gs = iter(torch.autograd.grad(loss, leaves))
    return [next(gs) if (t is not None and t.requires_grad) else None for t in (d["x_s"], d["w_s"], d["b_s"])]


def _ours(d, num_items_in_batch=None, **opts):
    mod = FusedLinearJSDLoss(**opts)
    loss = mod(
        d["x_s"],
        d["w_s"],
        d["x_t"],
        d["w_t"],
        d["y"],
        bias=d["b_s"],
        teacher_bias=d["b_t"],
        num_items_in_batch=num_items_in_batch,
    )
    return loss, _grads(loss, d), mod.metrics


_REF_KEYS = (
    "beta",
    "temperature",
    "weight_hard_loss",
    "weight_soft_loss",
    "ignore_index",
    "reduction",
    "student_logit_scale",
    "teacher_logit_scale",
    "student_softcap",
    "teacher_softcap",
)


def _ref(d, num_items_in_batch=None, **opts):
    kw = {k: v for k, v in opts.items() if k in _REF_KEYS}
    f32 = {
        k: (v.detach().float().requires_grad_(v.requires_grad) if v is not None else None)
        for k, v in d.items()
    }
    f32["y"] = d["y"]
    loss, metrics = jsd_ref(
        f32["x_s"],
        f32["w_s"],
        f32["x_t"],
        f32["w_t"],
        f32["y"],
        f32["b_s"],
        f32["b_t"],
        num_items_in_batch=num_items_in_batch,
        **kw,
    )
    return loss, _grads(loss, f32), metrics


def _assert_close_all(ours, ref):
    """Loss, metrics and gradients against the fp32 reference (tests/tolerances.py's fp32 row)."""
    loss, grads, metrics = ours
    r_loss, r_grads, r_metrics = ref
    assert_close_to_ref(loss.float(), r_loss.float(), name="loss")
    for name, v in metrics.items():
        assert_close_to_ref(v.float(), r_metrics[name].float(), name=f"metric {name}")
    for i, (g, r) in enumerate(zip(grads, r_grads)):
        assert (g is None) == (r is None), f"grad {i}: None mismatch"
        if g is not None:
            assert_close_to_ref(g.float(), r.float(), name=f"grad {i}")


# --------------------------------------------------------------------------------------------------
# fp32 grid, eager.
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])  # one row, odd, larger than N
def test_fp32_beta_chunks(beta, chunk_size):
    d = _inputs(bias=chunk_size != 7)
    opts = dict(beta=beta, chunk_size=chunk_size, compile=False)
    ours = _ours(d, **opts)
    _assert_close_all(ours, _ref(d, **opts))
    assert torch.isfinite(ours[0])
    assert set(ours[2]) == {"num_tokens", "soft_loss", "entropy"}


@pytest.mark.parametrize(
    "opts",
    [
        dict(temperature=2.0),
        dict(temperature=0.5, beta=0.0),
        dict(temperature=0.7, beta=1.0),
        dict(weight_hard_loss=0.5, weight_soft_loss=0.5),
        dict(weight_hard_loss=1.0, weight_soft_loss=0.0, beta=0.9),
        dict(weight_hard_loss=0.3, temperature=3.0, beta=0.1),  # hard loss ignores the temperature
        dict(reduction="sum"),
        dict(reduction="mean", beta=0.0),
        dict(student_logit_scale=0.5, teacher_logit_scale=2.0),
        dict(student_softcap=3.0, teacher_softcap=2.0, temperature=1.5),
        dict(accum_dtype=None),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_fp32_options(opts):
    d = _inputs()
    opts = dict(chunk_size=8, compile=False, **opts)
    ours = _ours(d, **opts)
    _assert_close_all(ours, _ref(d, **opts))
    if opts.get("weight_hard_loss"):
        assert "hard_loss" in ours[2]


@pytest.mark.parametrize("num_items", [50, "tensor"])
def test_num_items_in_batch(num_items):
    d = _inputs()
    n = torch.tensor(50) if num_items == "tensor" else num_items
    opts = dict(beta=0.5, weight_hard_loss=0.2, chunk_size=16, compile=False)
    ours = _ours(d, num_items_in_batch=n, **opts)
    _assert_close_all(ours, _ref(d, num_items_in_batch=50, **opts))


@pytest.mark.parametrize("ignored", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_ignored_fraction(ignored, beta):
    d = _inputs(ignored=ignored)
    opts = dict(beta=beta, weight_hard_loss=0.5, chunk_size=10, compile=False)
    ours = _ours(d, **opts)
    _assert_close_all(ours, _ref(d, **opts))
    if ignored == 1.0:
        # TRL's clamp_min(1): a batch with nothing labelled gives a finite 0 and zero gradients.
        assert ours[0].item() == 0.0
        assert all(g.abs().max().item() == 0.0 for g in ours[1])
        assert all(v.item() == 0.0 for v in ours[2].values())


def test_3d_input_and_shapes():
    d = _inputs(n=2 * 19, shape=(2, 19))
    opts = dict(beta=0.5, chunk_size=5, compile=False)
    ours = _ours(d, **opts)
    assert ours[1][0].shape == d["x_s"].shape
    _assert_close_all(ours, _ref(d, **opts))


def test_same_hidden_sizes_and_large_vocab_spread():
    # Same widths, a teacher much sharper than the student: large divergences, log M far from both.
    d = _inputs(hs=24, ht=24, v=257, teacher_spread=8.0)
    for beta in BETAS:
        opts = dict(beta=beta, chunk_size=9, compile=False)
        ours = _ours(d, **opts)
        assert torch.isfinite(ours[0]) and all(torch.isfinite(g).all() for g in ours[1])
        _assert_close_all(ours, _ref(d, **opts))


def test_chunk_size_invariance():
    d = _inputs(n=45)
    results = [
        _ours(d, beta=0.3, weight_hard_loss=0.4, temperature=1.3, chunk_size=cs, compile=False)
        for cs in (1, 4, 13, 45, 1000)
    ]
    first = results[0]
    for other in results[1:]:
        _assert_close_all(other, first)


def test_grad_none_when_not_required_and_teacher_gets_none():
    d = _inputs()
    d["w_s"].requires_grad_(False)
    d["b_s"].requires_grad_(False)
    x_t = d["x_t"].clone().requires_grad_(True)
    w_t = d["w_t"].clone().requires_grad_(True)
    mod = FusedLinearJSDLoss(chunk_size=8, compile=False)
    loss = mod(d["x_s"], d["w_s"], x_t, w_t, d["y"], bias=d["b_s"], teacher_bias=d["b_t"])
    loss.backward()
    assert d["x_s"].grad is not None
    assert d["w_s"].grad is None and d["b_s"].grad is None
    assert x_t.grad is None and w_t.grad is None
    ref = _ref(d, beta=0.5)
    assert_close_to_ref(d["x_s"].grad, ref[1][0])


def test_grad_output_scaling():
    d = _inputs()
    mod = FusedLinearJSDLoss(chunk_size=8, compile=False)
    loss = mod(d["x_s"], d["w_s"], d["x_t"], d["w_t"], d["y"], bias=d["b_s"], teacher_bias=d["b_t"])
    grads = _grads(3.0 * loss, d)
    ref = _ref(d)
    for g, r in zip(grads, ref[1]):
        assert_close_to_ref(g, 3.0 * r)


def test_no_grad_forward():
    d = _inputs()
    with torch.no_grad():
        loss = FusedLinearJSDLoss(chunk_size=8, compile=False)(
            d["x_s"], d["w_s"], d["x_t"], d["w_t"], d["y"], bias=d["b_s"], teacher_bias=d["b_t"]
        )
    assert_close_to_ref(loss, _ref(d)[0].detach())


# --------------------------------------------------------------------------------------------------
# Compiled: a few representative cases (each costs a compile on CPU).
@pytest.mark.parametrize(
    "opts",
    [
        dict(beta=0.5, temperature=2.0, weight_hard_loss=0.3),
        dict(beta=0.0, student_softcap=5.0),
        dict(beta=1.0, reduction="sum"),
    ],
    ids=["jsd-T2-hard", "fkl-softcap", "rkl-sum"],
)
def test_compiled(opts):
    d = _inputs()
    opts = dict(chunk_size=11, compile=True, **opts)
    _assert_close_all(_ours(d, **opts), _ref(d, **opts))


# --------------------------------------------------------------------------------------------------
# bf16: at most K× plain bf16 PyTorch's error (logits and softmax in bf16) against fp32.
def _torch_same_dtype(d, beta, temperature, weight_hard_loss):
    z_s = F.linear(d["x_s"], d["w_s"], d["b_s"])
    with torch.no_grad():
        z_t = F.linear(d["x_t"], d["w_t"], d["b_t"])
    log_s = F.log_softmax(z_s / temperature, -1)
    log_t = F.log_softmax(z_t / temperature, -1)
    if beta == 0:
        jsd = F.kl_div(log_s, log_t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(log_t, log_s, reduction="none", log_target=True)
    else:
        log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
        jsd = beta * F.kl_div(log_m, log_t, reduction="none", log_target=True) + (1 - beta) * F.kl_div(
            log_m, log_s, reduction="none", log_target=True
        )
    valid = d["y"] != -100
    n = valid.sum().clamp(min=1)
    loss = (jsd.sum(-1) * valid).sum() / n
    if weight_hard_loss:
        loss = loss + weight_hard_loss * F.cross_entropy(z_s, d["y"], reduction="sum") / n
    return loss, _grads(loss, d)


# Compiled on one beta only (CPU compile time).
@pytest.mark.parametrize(
    "beta, compile_",
    [(0.0, False), (0.5, False), (1.0, False), (0.5, True)],
    ids=["fkl", "jsd", "rkl", "jsd-c"],
)
def test_bf16(beta, compile_):
    d = _inputs(n=64, hs=32, ht=48, v=200, dtype=torch.bfloat16)
    opts = dict(beta=beta, temperature=1.5, weight_hard_loss=0.2, chunk_size=24, compile=compile_)
    loss, grads, metrics = _ours(d, **opts)
    r_loss, r_grads, r_metrics = _ref(d, **opts)
    t_loss, t_grads = _torch_same_dtype(d, beta, 1.5, 0.2)
    assert loss.dtype == torch.float32
    assert all(g.dtype == torch.bfloat16 for g in grads)
    assert_close_to_ref(loss, r_loss, t_loss, "loss", dtype=torch.bfloat16)
    for name in metrics:  # plain torch has no metrics: at most the table's bf16 atol off the reference
        assert_close_to_ref(metrics[name], r_metrics[name], name=name, dtype=torch.bfloat16)
    for i, (g, r, t) in enumerate(zip(grads, r_grads, t_grads)):
        assert_close_to_ref(g, r, t, f"grad {i}", dtype=torch.bfloat16)


# --------------------------------------------------------------------------------------------------
def test_hand_computed():
    """V=2, identity heads: S = (1/2, 1/2), T = (3/4, 1/4), every value by hand."""
    x_s = torch.zeros(1, 2, requires_grad=True)
    w = torch.eye(2, requires_grad=True)
    x_t = torch.tensor([[math.log(3.0), 0.0]])
    y = torch.tensor([0])
    s, t = (0.5, 0.5), (0.75, 0.25)
    fkl = sum(ti * math.log(ti / si) for si, ti in zip(s, t))
    rkl = sum(si * math.log(si / ti) for si, ti in zip(s, t))
    m = tuple(0.5 * si + 0.5 * ti for si, ti in zip(s, t))  # (0.625, 0.375)
    jsd = 0.5 * sum(ti * math.log(ti / mi) for ti, mi in zip(t, m)) + 0.5 * sum(
        si * math.log(si / mi) for si, mi in zip(s, m)
    )
    for beta, expected in ((0.0, fkl), (1.0, rkl), (0.5, jsd)):
        mod = FusedLinearJSDLoss(beta=beta, weight_hard_loss=1.0, chunk_size=1, compile=False)
        loss = mod(x_s, w, x_t, w.detach(), y)
        assert loss.item() == pytest.approx(expected + math.log(2.0), abs=1e-6)
        assert mod.metrics["soft_loss"].item() == pytest.approx(expected, abs=1e-6)
        assert mod.metrics["hard_loss"].item() == pytest.approx(math.log(2.0), abs=1e-6)
        assert mod.metrics["entropy"].item() == pytest.approx(math.log(2.0), abs=1e-6)
    # Forward KL: d/dz_s KL(T‖S) = S − T = (−1/4, 1/4); the hard CE adds S − onehot(0) = (−1/2, 1/2).
    mod = FusedLinearJSDLoss(beta=0.0, weight_hard_loss=1.0, chunk_size=1, compile=False)
    (g,) = torch.autograd.grad(mod(x_s, w, x_t, w.detach(), y), x_s)
    torch.testing.assert_close(g, torch.tensor([[-0.75, 0.75]]))


# --------------------------------------------------------------------------------------------------
# Parity with TRL's own functions on the same inputs.
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize(
    "kw", [dict(), dict(temperature=2.0), dict(reduction="sum"), dict(reduction="mean"), dict(num_items=40)]
)
def test_trl_gkd_generalized_jsd_loss(beta, kw):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    d = _inputs(n=2 * 17, shape=(2, 17), bias=True)
    temperature = kw.get("temperature", 1.0)
    reduction = kw.get("reduction", "batchmean")
    num_items = kw.get("num_items")
    # TRL on materialised fp32 logits of the same heads, with autograd through them.
    z_s = F.linear(d["x_s"], d["w_s"], d["b_s"])
    z_t = F.linear(d["x_t"], d["w_t"], d["b_t"])
    trl_loss = GKDTrainer.generalized_jsd_loss(
        z_s,
        z_t,
        labels=d["y"],
        beta=beta,
        temperature=temperature,
        reduction=reduction,
        num_items_in_batch=num_items,
    )
    trl_grads = _grads(trl_loss, d)
    opts = dict(beta=beta, temperature=temperature, reduction=reduction, chunk_size=6, compile=False)
    loss, grads, _ = _ours(d, num_items_in_batch=num_items, **opts)
    assert_close_to_ref(loss, trl_loss)
    for g, r in zip(grads, trl_grads):
        assert_close_to_ref(g, r)


@pytest.mark.parametrize(
    "kw",
    [
        dict(beta=0.0),
        dict(beta=1.0),
        dict(beta=0.5, temperature=1.7),
        dict(beta=0.2, student_logit_scale=0.5, teacher_logit_scale=1.5, num_items=30),
        dict(beta=0.8, student_softcap=4.0, teacher_softcap=3.0, temperature=0.8),
    ],
    ids=["fkl", "rkl", "jsd-T", "jsd-scale-nitems", "jsd-softcap"],
)
def test_trl_distillation_chunked_divergence(kw):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    d = _inputs(n=2 * 17, shape=(2, 17), bias=True)
    mask = (d["y"] != -100).long()
    temperature = kw.get("temperature", 1.0)
    trl_loss, entropy_sum, n_valid = _chunked_divergence_loss(
        d["x_s"],
        d["x_t"],
        d["w_s"],
        d["w_t"],
        mask,
        kw["beta"],
        num_items_in_batch=kw.get("num_items"),
        student_lm_head_bias=d["b_s"],
        teacher_lm_head_bias=d["b_t"],
        student_logit_scale=kw.get("student_logit_scale", 1.0),
        teacher_logit_scale=kw.get("teacher_logit_scale", 1.0),
        student_final_logit_softcapping=kw.get("student_softcap"),
        teacher_final_logit_softcapping=kw.get("teacher_softcap"),
        temperature=temperature,
    )
    trl_grads = _grads(trl_loss, d)
    opts = {k: v for k, v in kw.items() if k != "num_items"}
    loss, grads, metrics = _ours(
        d, num_items_in_batch=kw.get("num_items"), chunk_size=7, compile=False, **opts
    )
    assert_close_to_ref(loss, trl_loss)
    assert_close_to_ref(metrics["entropy"], entropy_sum / n_valid)
    for g, r in zip(grads, trl_grads):
        assert_close_to_ref(g, r)


# --------------------------------------------------------------------------------------------------
# Bad inputs.
def test_bad_vocab_mismatch():
    d = _inputs()
    with pytest.raises(ValueError, match="vocabularies differ"):
        FusedLinearJSDLoss(compile=False)(d["x_s"], d["w_s"], d["x_t"], d["w_t"][:-1], d["y"])


def test_bad_teacher_rows():
    d = _inputs()
    with pytest.raises(ValueError, match="teacher_hidden leading shape"):
        FusedLinearJSDLoss(compile=False)(d["x_s"], d["w_s"], d["x_t"][:-1], d["w_t"], d["y"])


def test_bad_teacher_head():
    d = _inputs()
    with pytest.raises(ValueError, match="teacher head"):
        FusedLinearJSDLoss(compile=False)(d["x_s"], d["w_s"], d["x_t"], d["w_t"][:, :-1], d["y"])
    with pytest.raises(TypeError, match="teacher head"):
        FusedLinearJSDLoss(compile=False)(d["x_s"], d["w_s"], d["x_t"].double(), d["w_t"], d["y"])
    with pytest.raises(ValueError, match="teacher head.*bias"):
        FusedLinearJSDLoss(compile=False)(
            d["x_s"], d["w_s"], d["x_t"], d["w_t"], d["y"], teacher_bias=torch.zeros(3)
        )


def test_bad_student_and_labels():
    d = _inputs()
    with pytest.raises(ValueError, match="hidden.s last dim"):
        FusedLinearJSDLoss(compile=False)(d["x_s"][:, :-1], d["w_s"], d["x_t"], d["w_t"], d["y"])
    y = d["y"].clone()
    y[0] = 123
    with pytest.raises(ValueError, match="outside"):
        FusedLinearJSDLoss(compile=False)(d["x_s"], d["w_s"], d["x_t"], d["w_t"], y)
    with pytest.raises(TypeError, match="integer"):
        FusedLinearJSDLoss(compile=False)(d["x_s"], d["w_s"], d["x_t"], d["w_t"], d["y"].float())
    with pytest.raises(ValueError, match="labels shape"):
        FusedLinearJSDLoss(compile=False)(d["x_s"], d["w_s"], d["x_t"], d["w_t"], d["y"][:-1])


@pytest.mark.parametrize(
    "opts, exc, match",
    [
        (dict(beta=-0.1), ValueError, "beta"),
        (dict(beta=1.5), ValueError, "beta"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(reduction="none"), ValueError, "reduction"),
        (dict(student_softcap=0.0), ValueError, "student_softcap"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(alpha=0.5), TypeError, "unexpected keyword argument 'alpha'"),
    ],
)
def test_bad_options(opts, exc, match):
    with pytest.raises(exc, match=match):
        FusedLinearJSDLoss(**opts)
