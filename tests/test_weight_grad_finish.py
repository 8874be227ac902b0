"""The engine's weight gradient (``chunkloss.engine.weight_grad.WeightGrad``): how the last contribution and
the deferred rows' scale reach the weight's dtype.

With one chunk the weight gradient is one GEMM in the weight's dtype and no fp32 accumulator exists; with
several, the last chunk (at most ``MAX_ROWS`` rows) or the scale alone go through
``kernels.weight_grad.finish_weight_grad``, which on CUDA replaces cuBLAS's addmm into the fp32 accumulator
and the cast. Here the kernel runs on CPU through TRITON_INTERPRET=1 (``WeightGrad.fuse_off_cuda``), and each
loss's bf16 gradients must equal those of the unfused path (accumulate, scale, cast) up to where the two fp32
sums round differently: one bf16 ulp, plus the fp32 sums' own error. Each case also asserts the path it
exercised (kernel calls and their row counts), so a change that stops fusing fails here.
"""

import pytest
import torch

import chunkloss.kernels.weight_grad as wg
from chunkloss import FusedLinearCrossEntropyLoss, FusedLinearDPOLoss, FusedLinearGRPOLoss
from chunkloss.engine import plan, weight_grad
from tests.tolerances import assert_close_to_ref

V, H = 37, 24
DT = torch.bfloat16


@pytest.fixture
def spy(monkeypatch):
    """Records each ``finish_weight_grad`` call's row count (None: the scale and cast alone) and counts the
    fp32 accumulations; ``spy.fuse(on)`` switches the kernel on for CPU tensors."""
    if not wg._INTERPRETED and not torch.cuda.is_available():
        pytest.skip("CPU tensors reach the Triton kernel only under TRITON_INTERPRET=1")
    calls = {"finish": [], "accumulate": 0}
    real_finish, real_acc = wg.finish_weight_grad, weight_grad.accumulate_weight_grad

    def finish(acc, g, x, s, dtype, **kw):
        calls["finish"].append((None if g is None else g.shape[0], s is not None))
        return real_finish(acc, g, x, s, dtype, **kw)

    def accumulate(*args, **kw):
        calls["accumulate"] += 1
        return real_acc(*args, **kw)

    monkeypatch.setattr(wg, "finish_weight_grad", finish)
    monkeypatch.setattr(weight_grad, "accumulate_weight_grad", accumulate)
    calls["fuse"] = lambda on: monkeypatch.setattr(weight_grad.WeightGrad, "fuse_off_cuda", on)
    return calls


def leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def grads(fn, *xs):
    xs = leaves(*xs)
    loss = fn(*xs)
    loss.backward()
    return loss.detach(), [x.grad for x in xs]


def assert_same_up_to_rounding(ours, unfused, x_abs_sum):
    """bf16 results of two fp32 sums of the same terms: within one bf16 ulp of each other plus the sums' error
    bound ``x_abs_sum`` (an upper bound of 2⁻²⁰·Σ|terms| per element, generous for these sizes)."""
    assert ours.dtype == unfused.dtype == DT
    a, b = ours.double(), unfused.double()
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)
    bad = (a - b).abs() > ulp + x_abs_sum
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements differ by more than the bound"


def weight_terms_bound(hidden_rows, n_terms=64):
    """Per-element bound on an fp32 weight-gradient sum's rounding: ``n_terms``·2⁻²⁴·max|g|·Σ|x|, with |g| ≤ 1
    (probability differences scaled by at most 1)."""
    return n_terms * 2.0**-24 * hidden_rows.abs().sum(0).double().max()


def ce_inputs(n=40):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, H, generator=g).to(DT)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(DT)
    labels = torch.randint(0, V, (n,), generator=g)
    labels[::7] = -100
    return hidden, weight, labels


def test_one_chunk_needs_no_fp32_accumulator(spy):
    """One chunk: one GEMM in bf16, no accumulator; the same gradient as three chunks accumulated in fp32."""
    hidden, weight, labels = ce_inputs()
    _, (gh_3, gw_3) = grads(
        lambda h, w: FusedLinearCrossEntropyLoss(chunk_size=16)(h, w, labels), hidden, weight
    )
    assert spy["accumulate"] == 3
    spy["accumulate"] = 0
    spy["fuse"](True)
    _, (gh_1, gw_1) = grads(
        lambda h, w: FusedLinearCrossEntropyLoss(chunk_size=1000)(h, w, labels), hidden, weight
    )
    assert spy["accumulate"] == 0 and spy["finish"] == []
    assert torch.equal(gh_1, gh_3)
    assert_same_up_to_rounding(gw_1, gw_3, weight_terms_bound(hidden))


@pytest.mark.parametrize("chunk", [16, 5])
def test_cross_entropy_last_chunk_fused(spy, chunk):
    hidden, weight, labels = ce_inputs()
    n_valid = int((labels != -100).sum())
    bounds = plan.even_bounds(n_valid, chunk)

    def run():
        return grads(lambda h, w: FusedLinearCrossEntropyLoss(chunk_size=chunk)(h, w, labels), hidden, weight)

    loss_u, (gh_u, gw_u) = run()
    spy["fuse"](True)
    loss_f, (gh_f, gw_f) = run()
    assert spy["finish"] == [(bounds[-1][1] - bounds[-1][0], False)]
    assert torch.equal(loss_f, loss_u) and torch.equal(gh_f, gh_u)
    assert_same_up_to_rounding(gw_f, gw_u, weight_terms_bound(hidden))


def test_strided_hidden_is_not_fused(spy):
    """Hidden rows with a non-unit column stride (a transposed buffer, sliced per chunk without a gather when
    no row is dropped) go through cuBLAS's addmm, which takes any strides; the result is the contiguous
    one's."""
    hidden, weight, labels = ce_inputs()
    labels = labels.clamp_min(0)  # every row takes part: chunks are slices of the hidden buffer
    strided = hidden.t().contiguous().t()
    assert strided.stride(1) != 1
    spy["fuse"](True)
    loss_mod = FusedLinearCrossEntropyLoss(chunk_size=16)
    _, (gh_s, gw_s) = grads(lambda h, w: loss_mod(h, w, labels), strided, weight)
    assert spy["finish"] == []
    _, (gh_c, gw_c) = grads(lambda h, w: loss_mod(h, w, labels), hidden, weight)
    assert len(spy["finish"]) == 1
    assert_close_to_ref(gh_s, gh_c, name="hidden grad")  # the strided GEMM may sum in another order
    assert_same_up_to_rounding(gw_s, gw_c, weight_terms_bound(hidden))


def grpo_inputs(b=4, t=9):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(b, t, H, generator=g).to(DT)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(DT)
    ids = torch.randint(0, V, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 6:] = 0
    adv = torch.randn(b, generator=g)
    with torch.no_grad():
        cur = torch.log_softmax(hidden.float() @ weight.float().t(), -1).gather(-1, ids[..., None])[..., 0]
    old = cur + 0.3 * torch.randn(b, t, generator=g)
    ref = cur + 0.3 * torch.randn(b, t, generator=g)
    return hidden, weight, ids, mask, adv, old, ref


def test_grpo_entropy_mask_pass_2_fused(spy):
    """Two passes with estimates: pass 2 re-projects only the rows whose coefficient changed, and its one
    chunk is the last contribution."""
    hidden, weight, ids, mask, adv, old, ref = grpo_inputs()
    loss_mod = FusedLinearGRPOLoss(beta=0.04, top_entropy_quantile=0.3, chunk_size=4, compile=False)

    def run():
        return grads(
            lambda h, w: loss_mod(h, w, ids, mask, adv, old_logps=old, ref_logps=ref), hidden, weight
        )

    loss_u, (gh_u, gw_u) = run()
    spy["fuse"](True)
    loss_f, (gh_f, gw_f) = run()
    assert len(spy["finish"]) == 1 and spy["finish"][0][0] >= 1, spy["finish"]  # pass 2 had rows
    assert torch.equal(loss_f, loss_u) and torch.equal(gh_f, gh_u)
    assert_same_up_to_rounding(gw_f, gw_u, weight_terms_bound(hidden.reshape(-1, H)))


def dpo_inputs(pairs, t=12):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2 * pairs, t, H, generator=g).to(DT)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(DT)
    chosen = torch.randint(0, V, (pairs, t), generator=g)
    rejected = torch.randint(0, V, (pairs, t), generator=g)
    chosen[:, :3] = rejected[:, :3] = -100  # the prompt
    ref_c, ref_r = -30 + torch.randn(pairs, generator=g), -30 + torch.randn(pairs, generator=g)
    return hidden, weight, chosen, rejected, ref_c, ref_r


@pytest.mark.parametrize("case", ["one pair", "short pair first"])
def test_dpo_deferred_rows_scale_fused(spy, case):
    """Two passes (a pair longer than a chunk): the last pair runs its backward in pass 1 and its gradients
    are scaled by λ once the loss is known. One pair: nothing is left for pass 2, and the scale and cast run
    alone. A short pair before it: pass 2 is one chunk (the short pair), and the scale goes into it."""
    hidden, weight, chosen, rejected, ref_c, ref_r = dpo_inputs(1 if case == "one pair" else 2)
    if case == "short pair first":
        chosen[0, 7:] = rejected[
            0, 7:
        ] = -100  # 4 + 4 rows: fits the 10-row chunks; pair 1 (18 rows) does not
    loss_mod = FusedLinearDPOLoss(beta=0.1, chunk_size=10, compile=False)

    def run():
        return grads(
            lambda h, w: loss_mod(h, w, chosen, rejected, ref_chosen_logps=ref_c, ref_rejected_logps=ref_r),
            hidden,
            weight,
        )

    loss_u, (gh_u, gw_u) = run()
    spy["fuse"](True)
    loss_f, (gh_f, gw_f) = run()
    assert spy["finish"] == ([(None, True)] if case == "one pair" else [(8, True)])
    assert torch.equal(loss_f, loss_u) and torch.equal(gh_f, gh_u)
    assert_same_up_to_rounding(gw_f, gw_u, weight_terms_bound(hidden.reshape(-1, H)))


def test_no_rows_gives_zero_gradient(spy):
    hidden, weight, labels = ce_inputs()
    spy["fuse"](True)
    _, (gh, gw) = grads(
        lambda h, w: FusedLinearCrossEntropyLoss(reduction="sum")(h, w, torch.full_like(labels, -100)),
        hidden,
        weight,
    )
    assert gw.dtype == DT and not gw.any() and not gh.any()
