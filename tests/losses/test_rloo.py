"""FusedLinearRLOOLoss against the fp32 reference (chunkloss.testing.reference.rloo_ref) and TRL 1.16's own
``RLOOTrainer._compute_loss`` (called unbound on a stub trainer whose model returns given log-probs)."""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch
from trl.trainer.rloo_trainer import RLOOTrainer

from chunkloss.engine import StepKind
from chunkloss.engine.steps import step_for
from chunkloss.losses import rloo
from chunkloss.losses.common import scale_logits
from chunkloss.losses.rloo import FusedLinearRLOOLoss
from chunkloss.testing.reference import grpo_logps_ref, rloo_loss_from_logps_ref, rloo_ref
from tests.child_process import in_child_process
from tests.losses.test_grpo import leaves, run_loss
from tests.tolerances import assert_close_to_ref

# Odd shapes. Completion 2 is empty, 1 has a hole, 4 holds one token; 0 is the longest (9 tokens).
B, T, H, V = 5, 13, 31, 123
# Sequence ratios r_s = exp(S_s - old_s) the inputs are built to (off-policy), and the advantages' signs:
# completion 0 is clipped above for ε_high 0.2 and 0.28 (r > 1 + ε_high, A > 0), not for 0.5; 1 below
# (r < 0.8, A < 0); 4 is above the range with A < 0, where the unclipped term is the minimum (it keeps its
# gradient); 2 (empty) and 3 are inside. Each ratio is at least 0.1 from the boundaries of ε 0.2 and 0.28,
# so bf16 rounding flips no flag there.
RATIOS = (1.45, 0.6, 1.1, 0.95, 1.4)
SIGNS = (1.0, -1.0, 1.0, -1.0, -1.0)


def completion_mask() -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 9:] = 0
    mask[1, 4] = 0
    mask[1, 10:] = 0
    mask[2] = 0
    mask[3, 7:] = 0
    mask[4, 1:] = 0
    return mask


def make_inputs(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_(True) if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = completion_mask()
    adv = (torch.rand(B, generator=g) + 0.5) * torch.tensor(SIGNS)
    with torch.no_grad():
        logp, _ = grpo_logps_ref(h, w, b, ids)
        seq = (logp * mask).sum(1)
    old = seq - torch.log(torch.tensor(RATIOS))
    inp = dict(hidden=h, weight=w, completion_ids=ids, completion_mask=mask, advantages=adv, bias=b)
    return inp, dict(old_logps=old)


def run_ours(inp, kw, **opts):
    return run_loss(FusedLinearRLOOLoss, inp, kw, **opts)


def run_ref(inp, kw, opts, dtype=torch.float32):
    """The fp32 reference (``dtype`` float32), or plain PyTorch with the logits in ``dtype``."""
    opts = {k: v for k, v in opts.items() if k not in ("chunk_size", "compile")}
    tf = {k: opts.pop(k) for k in ("temperature", "logit_scale", "softcap") if k in opts}
    xs = [x.detach().to(dtype).requires_grad_(True) for x in leaves(inp)]
    h, w, b = xs[0], xs[1], xs[2] if len(xs) > 2 else None
    args = (inp["completion_ids"], inp["completion_mask"], inp["advantages"])
    if dtype == torch.float32:
        loss, m = rloo_ref(h, w, *args, b, **tf, **kw, **opts)
    else:
        z = scale_logits((h @ w.t() + (b if b is not None else 0)).float(), **tf)
        lp_all = torch.log_softmax(z, -1)
        logp = lp_all.gather(-1, inp["completion_ids"][..., None])[..., 0]
        ent = -(lp_all.exp() * lp_all).sum(-1)
        loss, m = rloo_loss_from_logps_ref(logp, ent, *args[1:], **kw, **opts)
    loss.backward()
    return loss.detach().float(), [x.grad.float() for x in xs], m


def assert_close_fp32(ours, ref):
    """Loss, every gradient and every metric against the fp32 reference (tests/tolerances.py's fp32 row)."""
    (lo, go, mo), (lr, gr, mr) = ours, ref
    assert_close_to_ref(lo, lr, name="loss")
    assert len(go) == len(gr)
    for i, (a, b) in enumerate(zip(go, gr)):
        assert_close_to_ref(a, b, name=f"grad {i}")
    assert set(mo) == set(mr), (set(mo), set(mr))
    for k in mr:
        assert_close_to_ref(float(mo[k]), float(mr[k]), name=k)


# --------------------------------------------------------------------------------------------------
# Against the fp32 reference. Chunk sizes: 1 (two passes: every completion longer than a chunk), 4 (two
# passes), 9 (one pass, the longest completion fills a chunk), 1000 (one pass, every row in one chunk).
@pytest.mark.parametrize("chunk", [1, 4, 9, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32(chunk, bias):
    """Off-policy and on-policy, ε_high unset (= ε_low) and 0.5."""
    inp, kw = make_inputs(bias=bias)
    for on_policy in (False, True):
        kw_i = {} if on_policy else kw
        for eps_high in (None, 0.5):
            opts = dict(compile=False, epsilon_high=eps_high)
            got = run_ours(inp, kw_i, chunk_size=chunk, **opts)
            ref = run_ref(inp, kw_i, opts)
            assert_close_fp32(got, ref)


def test_clip_flags():
    """The inputs reach every clip case the fp32 tests compare: off-policy one completion clipped below and
    one above (ε_high 0.2 and 0.28; none above at 0.5), on-policy none."""
    inp, kw = make_inputs()
    for eps_high in (None, 0.28, 0.5):
        _, _, m = run_ours(inp, kw, chunk_size=5, compile=False, epsilon_high=eps_high)
        n_high = 0 if eps_high == 0.5 else 1
        assert float(m["clip_ratio/low_mean"]) == pytest.approx(1 / B)
        assert float(m["clip_ratio/high_mean"]) == pytest.approx(n_high / B)
        assert float(m["clip_ratio/region_mean"]) == pytest.approx((1 + n_high) / B)
        assert float(m["clip_ratio/low_min"]) == 0.0 and float(m["clip_ratio/high_max"]) == n_high
    _, _, m = run_ours(inp, {}, chunk_size=5, compile=False)
    assert float(m["clip_ratio/region_mean"]) == 0.0 and float(m["clip_ratio/high_max"]) == 0.0


@pytest.mark.parametrize("chunk", [3, 1000])
def test_logit_transforms(chunk):
    """logit_scale, softcap and temperature (in that order), on the two-pass and the one-pass path."""
    inp, kw = make_inputs()
    opts = dict(compile=False, logit_scale=1.7, softcap=2.5, temperature=0.8, epsilon_high=0.28)
    ref = run_ref(inp, kw, opts)
    assert_close_fp32(run_ours(inp, kw, chunk_size=chunk, **opts), ref)
    plain = run_ref(inp, kw, dict(epsilon_high=0.28))
    assert abs(plain[0] - ref[0]) > 1e-3  # the transforms change the result


def test_chunk_sizes_agree():
    """Loss, gradients and metrics agree across chunk sizes 1, odd, and larger than B·T."""
    inp, kw = make_inputs()
    results = [run_ours(inp, kw, chunk_size=cs, compile=False, epsilon_high=0.28) for cs in (1, 5, 1000)]
    for other in results[1:]:
        assert_close_to_ref(other[0], results[0][0], name="loss")
        for a, b in zip(other[1], results[0][1]):
            assert_close_to_ref(a, b)
        for k, v in results[0][2].items():
            assert_close_to_ref(float(other[2][k]), float(v), name=k)


@pytest.mark.parametrize(
    "opts", [dict(), dict(epsilon_high=0.28, softcap=3.0, logit_scale=1.5, temperature=0.9)]
)
def test_bf16(opts):
    """bf16 against the fp32 reference, with the materialised bf16 torch loss's error as the yardstick."""
    inp, kw = make_inputs(dtype=torch.bfloat16)
    opts = {"compile": False, **opts}
    l32, g32, m32 = run_ref(inp, kw, opts)
    lt, gt, mt = run_ref(inp, kw, opts, dtype=torch.bfloat16)
    lo, go, mo = run_ours(inp, kw, chunk_size=7, **opts)
    assert_close_to_ref(lo, l32, lt, "loss", dtype=torch.bfloat16)
    for i, (a, b, r) in enumerate(zip(go, gt, g32)):
        assert_close_to_ref(a, r, b, f"grad {i}", dtype=torch.bfloat16)
    for k in m32:
        assert_close_to_ref(float(mo[k]), float(m32[k]), float(mt[k]), k, dtype=torch.bfloat16)


def test_hand_computed():
    """On-policy (r = 1), V = 2, H = 1: L = -(A_0 + A_1)/2 and dL/dz_t = -(A_s/B)·(e_y - p_t)."""
    h = torch.tensor([[[1.0], [2.0]], [[-1.0], [0.5]]], requires_grad=True)
    w = torch.tensor([[1.0], [0.0]], requires_grad=True)
    ids = torch.tensor([[0, 1], [1, 0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([0.5, -1.5])
    mod = FusedLinearRLOOLoss(compile=False, chunk_size=1)
    loss = mod(h, w, ids, mask, adv)
    loss.backward()
    assert abs(loss.item() - 0.5) < 1e-6
    # p(token 0) = sigmoid(h·w_0 - h·w_1) = sigmoid(h); grad_h[t] = dL/dz_t[0] (w_1 = 0).
    p0 = torch.sigmoid(h.detach()[..., 0])
    onehot0 = (ids == 0).float()
    expect = (-(adv[:, None] / 2) * (onehot0 - p0) * mask).unsqueeze(-1)
    assert_close_to_ref(h.grad, expect)

    def bin_ent(p):
        return -(p * math.log(p) + (1 - p) * math.log(1 - p))

    ent = sum(bin_ent(float(p0[s, t])) for s, t in ((0, 0), (0, 1), (1, 0))) / 3
    assert abs(mod.metrics["entropy"].item() - ent) < 1e-6
    assert mod.metrics["clip_ratio/region_mean"].item() == 0.0


def test_all_completions_empty():
    """Every completion empty: the loss is TRL's -mean(min(r·A, clip(r)·A)) with r = exp(-old) (a value
    without gradient), zero gradients, entropy 0 and the flags of those ratios."""
    inp, kw = make_inputs()
    inp["completion_mask"] = torch.zeros(B, T, dtype=torch.long)
    kw = dict(old_logps=-torch.log(torch.tensor(RATIOS)))  # TRL's old_logps of empty completions are 0
    for chunk in (4, 1000):
        got = run_ours(inp, kw, chunk_size=chunk, compile=False)
        assert_close_fp32(got, run_ref(inp, kw, {}))
        assert all(float(g.abs().max()) == 0.0 for g in got[1])
        assert float(got[0]) != 0.0 and float(got[2]["entropy"]) == 0.0


def test_no_grad_inputs():
    """Gradients are None for inputs that do not require grad; the loss is unchanged."""
    inp, kw = make_inputs()
    inp["weight"].requires_grad_(False)
    inp["bias"].requires_grad_(False)
    mod = FusedLinearRLOOLoss(compile=False, chunk_size=4)
    loss = mod(**inp, **kw)
    loss.backward()
    assert inp["weight"].grad is None and inp["bias"].grad is None
    assert inp["hidden"].grad is not None
    with torch.no_grad():
        assert torch.equal(mod(**inp, **kw), loss.detach())


@pytest.mark.parametrize("chunk", [3, 9])
def test_compiled(chunk):
    """torch.compile on the two-pass (3 rows a chunk) and the one-pass path (9)."""
    inp, kw = make_inputs()
    opts = dict(epsilon_high=0.28, temperature=0.7)
    ref = run_ref(inp, kw, opts)
    assert_close_fp32(run_ours(inp, kw, chunk_size=chunk, compile=True, **opts), ref)


def test_one_pass_projects_each_row_once(monkeypatch):
    """Where every completion fits in a chunk the loss runs in one pass: the head projects each row once."""
    from chunkloss.engine import loop

    inp, kw = make_inputs()
    projected, real = [], loop.project_head

    def spy(x, w, bias):
        if w is inp["weight"]:
            projected.append(x.shape[0])
        return real(x, w, bias)

    monkeypatch.setattr(loop, "project_head", spy)
    n_valid = int(completion_mask().sum())
    run_ours(inp, kw, chunk_size=1000, compile=False)
    assert projected == [n_valid]


def test_bad_inputs():
    inp, kw = make_inputs()
    mod = FusedLinearRLOOLoss(compile=False)
    with pytest.raises(ValueError, match=r"advantages must be \(B,\)"):
        mod(**{**inp, "advantages": torch.randn(B, T)}, **kw)
    with pytest.raises(ValueError, match=r"old_logps must be \(B,\)"):
        mod(**inp, old_logps=torch.randn(B, T))
    with pytest.raises(ValueError, match="completion_mask"):
        mod(**{**inp, "completion_mask": inp["completion_mask"][:, :-1]}, **kw)
    with pytest.raises(ValueError, match="completion_mask holds"):
        mod(**{**inp, "completion_mask": inp["completion_mask"] * 2}, **kw)
    ids = inp["completion_ids"].clone()
    ids[0, 0] = V
    with pytest.raises(ValueError, match="completion_ids holds"):
        mod(**{**inp, "completion_ids": ids}, **kw)
    with pytest.raises(ValueError, match="temperature"):
        FusedLinearRLOOLoss(temperature=0.0)
    with pytest.raises(ValueError, match="softcap"):
        FusedLinearRLOOLoss(softcap=0.0)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        FusedLinearRLOOLoss(epsilon=0.2)


def test_metrics_are_documented():
    inp, kw = make_inputs()
    mod = FusedLinearRLOOLoss(compile=False)
    mod(**inp, **kw)
    names = {
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    }
    assert set(mod.metrics) == names
    assert all(v.dim() == 0 and not v.requires_grad for v in mod.metrics.values())
    for name in names:
        assert f"``{name}``" in FusedLinearRLOOLoss.__doc__


# --------------------------------------------------------------------------------------------------
# Parity with TRL's own code: RLOOTrainer._compute_loss, unbound, on a stub trainer.
class _Accel:
    num_processes = 1

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_compute_loss(logps, entropies, mask, advantages, old_logps, epsilon_low=0.2, epsilon_high=None):
    """TRL 1.16's RLOO loss on given per-token log-probs and entropies: (loss, metrics)."""
    stub = types.SimpleNamespace(
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_low if epsilon_high is None else epsilon_high,
        aux_loss_enabled=False,
        accelerator=_Accel(),
        model=types.SimpleNamespace(training=True),
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    stub._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    b = mask.shape[0]
    inputs = {
        "prompt_ids": torch.zeros(b, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(b, 0, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask),
        "completion_mask": mask,
        "old_logps": old_logps,
        "advantages": advantages,
    }
    loss = RLOOTrainer._compute_loss(stub, None, inputs)
    return loss, {k: v[0] for k, v in stub._metrics["train"].items()}


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_reference_matches_trl(epsilon_high):
    """The fp32 reference equals TRL's _compute_loss (value, d/dlogps, metrics)."""
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(6, 9, generator=g) > 0.2).long()
    mask[3] = 0
    logps = (-torch.rand(6, 9, generator=g) * 3).requires_grad_(True)
    ent = torch.rand(6, 9, generator=g) * 2
    adv = torch.randn(6, generator=g)
    old = (logps.detach() * mask).sum(1) + 0.4 * torch.randn(6, generator=g)
    old[3] = 0.0  # TRL's summed old log-probs of an empty completion
    lt, mt = trl_compute_loss(logps, ent, mask, adv, old, epsilon_high=epsilon_high)
    (gt,) = torch.autograd.grad(lt, logps)
    lr, mr = rloo_loss_from_logps_ref(logps, ent, mask, adv, old_logps=old, epsilon_high=epsilon_high)
    (gr,) = torch.autograd.grad(lr, logps)
    assert_close_to_ref(lr, lt)
    assert_close_to_ref(gr, gt)
    assert set(mr) == set(mt), (set(mr), set(mt))
    for k in mt:
        assert abs(float(mr[k]) - mt[k]) <= 1e-6, (k, float(mr[k]), mt[k])
    assert 0 < mt["clip_ratio/region_mean"] < 1  # some completions clipped, some not


@pytest.mark.parametrize("chunk,epsilon_high", [(4, 0.28), (1000, 0.5)])
def test_module_matches_trl(chunk, epsilon_high):
    """End to end: the chunked module against TRL's _compute_loss on the fp32 log-probs of the same head
    (TRL's summed old log-probs: 0 for the empty completion), two passes and one."""
    inp, kw = make_inputs()
    kw["old_logps"] = kw["old_logps"] * (completion_mask().sum(1) > 0)
    opts = dict(epsilon_high=epsilon_high)
    h, w, b = (x.detach().requires_grad_(True) for x in leaves(inp))
    logp, ent = grpo_logps_ref(h, w, b, inp["completion_ids"])
    args = (inp["completion_mask"], inp["advantages"], kw["old_logps"])
    lt, mt = trl_compute_loss(logp, ent, *args, epsilon_high=epsilon_high)
    lt.backward()
    lo, go, mo = run_ours(inp, kw, chunk_size=chunk, compile=False, **opts)
    assert_close_to_ref(lo, lt.detach(), name="loss")
    for a, x in zip(go, (h, w, b)):
        assert_close_to_ref(a, x.grad)
    assert set(mo) == set(mt)
    for k in mt:
        assert abs(float(mo[k]) - mt[k]) <= 1e-6, (k, float(mo[k]), mt[k])


# --------------------------------------------------------------------------------------------------
# The CUDA steps (Triton row kernels), through TRITON_INTERPRET=1 on CPU (as tests/losses/test_row_steps.py).
@in_child_process
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Triton cannot take these CPU tensors")
@pytest.mark.parametrize("chunk", [4, 1000])
def test_cuda_steps(chunk, cuda_steps):
    """The STATS and SEQ_PASS2 Triton steps, two passes (4) and one (1000), with the logit transforms."""
    inp, kw = make_inputs()
    opts = dict(epsilon_high=0.28, logit_scale=1.3, softcap=4.0, temperature=0.9)
    mod = FusedLinearRLOOLoss(**opts, chunk_size=chunk)
    assert step_for(mod, StepKind.STATS, "cpu").func is rloo.rloo_stats  # the fixture took effect
    assert_close_fp32(run_ours(inp, kw, chunk_size=chunk, **opts), run_ref(inp, kw, opts))
