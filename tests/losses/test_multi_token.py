"""FusedLinearMultiTokenLoss against K separate materialised cross-entropies in fp64, over weight and hidden
forms, dtypes, odd shapes, ignored labels, options and bad inputs."""

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from chunkloss import FusedLinearCrossEntropyLoss, FusedLinearMultiTokenLoss
from chunkloss.engine import FusedLinearBase
from chunkloss.losses.common import scale_logits
from tests.losses.test_cross_entropy import OPTION_CASES as CE_OPTION_CASES
from tests.tolerances import assert_close_to_ref

# Odd shapes: N = 3·17 rows per head is no multiple of the chunk sizes used, H and V are odd.
K, B, T, H, V = 3, 3, 17, 31, 123
HEAD_WEIGHTS = (1.0, 0.8, 0.64)


def multi_token_ref(
    hiddens,
    weights,
    labels,
    biases=None,
    *,
    head_weights=None,
    ignore_index=-100,
    reduction="mean",
    num_items_in_batch=None,
    label_smoothing=0.0,
    lse_square_scale=0.0,
    softcap=None,
    temperature=1.0,
    logit_scale=1.0,
    logits_dtype=None,
):
    """K separate ``F.cross_entropy`` calls on materialised logits: head k on ``hiddens[k][:, t]`` against
    ``labels[:, t + k]``, weighted by ``head_weights[k]`` and summed. ``logits_dtype`` None: everything in
    fp64 (ground truth); a dtype: the logits in that dtype, the loss in fp32 (what users write).
    Returns ``(loss, metrics)``, 'none' giving (K, B, T) per-position ``w_k·ℓ``."""
    k_heads = len(hiddens)
    biases = biases or [None] * k_heads
    head_weights = head_weights or (1.0,) * k_heads
    per_head, metrics = [], {}
    t = labels.shape[1]
    for k in range(k_heads):
        target = torch.full_like(labels, ignore_index)
        target[:, : max(t - k, 0)] = labels[:, k:]
        cast = (lambda x: x.double()) if logits_dtype is None else (lambda x: x)
        z = cast(hiddens[k]) @ cast(weights[k]).t()
        if biases[k] is not None:
            z = z + cast(biases[k])
        z = scale_logits(z if logits_dtype is None else z.float(), logit_scale, softcap, temperature)
        z, y = z.reshape(-1, z.shape[-1]), target.reshape(-1)
        valid = y != ignore_index
        lse = torch.logsumexp(z, -1)
        row = F.cross_entropy(
            z, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
        )
        row = (row + lse_square_scale * lse.square()) * valid
        n = valid.sum().clamp(min=1)
        if num_items_in_batch is not None:
            n = num_items_in_batch[k] if isinstance(num_items_in_batch, (list, tuple)) else num_items_in_batch
        if reduction == "none":
            per_head.append(row.view(labels.shape) * head_weights[k])
        else:
            per_head.append(
                row.sum() * head_weights[k] / (1 if reduction == "sum" and num_items_in_batch is None else n)
            )
        count = valid.sum().clamp(min=1)
        metrics[f"head{k}/loss"] = row.sum() / count
        metrics[f"head{k}/accuracy"] = ((z.argmax(-1) == y) & valid).sum() / count
        metrics[f"head{k}/num_tokens"] = valid.sum().float()
        metrics[f"head{k}/z_loss"] = (lse_square_scale * lse.square() * valid).sum() / count
        p = torch.softmax(z, -1)
        metrics[f"head{k}/entropy"] = ((lse - (p * z).sum(-1)) * valid).sum() / count
    loss = torch.stack(per_head) if reduction == "none" else sum(per_head)
    return loss, metrics


def make(dtype, form="shared", bias=True, ignore_frac=0.3, seed=0, k=K, t=T):
    """Leaves: hiddens (K, B, T, H); weight (V, H) shared or (K, V, H); bias (V,) or (K, V); labels (B, T)."""
    g = torch.Generator().manual_seed(seed)
    hiddens = torch.randn(k, B, t, H, generator=g).to(dtype).requires_grad_()
    wshape = (V, H) if form == "shared" else (k, V, H)
    weight = (torch.randn(*wshape, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(*wshape[:-1], generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, t), generator=g)
    labels[torch.rand(B, t, generator=g) < ignore_frac] = -100
    return hiddens, weight, b, labels


def per_head(t, k, shared_dims):
    """A leaf's K per-head tensors: a shared one (``shared_dims`` dims) K times, a stacked one unbound."""
    if t is None:
        return None
    return [t] * k if t.dim() == shared_dims else list(t)


def run_ours(hiddens, weight, bias, labels, listed=False, grad_out=1.0, **opts):
    leaves = [x for x in (hiddens, weight, bias) if x is not None]
    for x in leaves:
        x.grad = None
    num_items = opts.pop("num_items_in_batch", None)
    fn = FusedLinearMultiTokenLoss(**opts)
    h = list(hiddens.unbind(0)) if listed else hiddens
    w = list(weight.unbind(0)) if listed and weight.dim() == 3 else weight
    b = list(bias.unbind(0)) if listed and bias is not None and bias.dim() == 2 else bias
    loss = fn(h, w, labels, bias=b, num_items_in_batch=num_items)
    (loss * grad_out).sum().backward()
    return loss.detach(), [x.grad for x in leaves], fn.metrics


def run_ref(hiddens, weight, bias, labels, grad_out=1.0, logits_dtype=None, **opts):
    # The ground truth takes fp64 copies of the leaves (its gradients unrounded); plain PyTorch in low
    # precision takes the leaves in their own dtype.
    as_leaf = (lambda x: x.detach().double()) if logits_dtype is None else (lambda x: x.detach().clone())
    leaves = [as_leaf(x).requires_grad_() for x in (hiddens, weight, bias) if x is not None]
    h, w = leaves[0], leaves[1]
    b = leaves[2] if bias is not None else None
    k = h.shape[0]
    loss, metrics = multi_token_ref(
        list(h), per_head(w, k, 2), labels, per_head(b, k, 1), logits_dtype=logits_dtype, **opts
    )
    (loss * grad_out).sum().backward()
    return loss.detach(), [x.grad for x in leaves], metrics


def check(ours, ref, low=None, metric_names=("loss", "accuracy", "num_tokens"), k=K, dtype=torch.float32):
    """Loss, gradients and per-head metrics against the reference; ``low``: plain PyTorch in ``dtype``."""
    loss, grads, metrics = ours
    ref_loss, ref_grads, ref_metrics = ref
    low_loss, low_grads = (None, [None] * len(grads)) if low is None else low[:2]
    assert_close_to_ref(loss, ref_loss, low_loss, "loss", dtype=dtype)
    for i, (g, r, lo) in enumerate(zip(grads, ref_grads, low_grads)):
        assert g.dtype == dtype
        assert_close_to_ref(g, r, lo, f"grad {i}", dtype=dtype)
    for head in range(k):
        for name in metric_names:
            key = f"head{head}/{name}"
            # Metrics are computed from the logits in fp32 in either dtype: compared at fp32's tolerance in
            # fp32, and in low precision against torch's same-dtype value the same way as the loss.
            low_metric = None if low is None else low[2][key]
            assert_close_to_ref(metrics[key], ref_metrics[key], low_metric, key, dtype=dtype)


GRID = list(
    itertools.product(
        [torch.float32, torch.bfloat16],  # dtype
        ["shared", "per_head"],  # one (V, H) head or (K, V, H)
        [False, True],  # hiddens (and per-head weights) as sequences instead of stacked tensors
        [True, False],  # bias
        [0.0, 0.3],  # ignored fraction
    )
)


@pytest.mark.parametrize("dtype,form,listed,bias,ignore_frac", GRID)
def test_matches_reference(dtype, form, listed, bias, ignore_frac):
    hiddens, weight, b, labels = make(dtype, form, bias, ignore_frac)
    kw = dict(head_weights=HEAD_WEIGHTS)
    ours = run_ours(hiddens, weight, b, labels, listed, chunk_size=16, compile=False, **kw)
    ref = run_ref(hiddens, weight, b, labels, **kw)
    low = run_ref(hiddens, weight, b, labels, logits_dtype=dtype, **kw) if dtype != torch.float32 else None
    # Accuracy flips where two logits tie to within bf16 rounding: compared in fp32 only.
    names = ("loss", "accuracy", "num_tokens") if low is None else ("loss", "num_tokens")
    check(ours, ref, low, names, dtype=dtype)


# The cross-entropy's option grid (its last case sets every option at once), with per-head counts.
OPTION_CASES = [
    *CE_OPTION_CASES[:-1],
    {"num_items_in_batch": 40},
    {"num_items_in_batch": [40, 35, 30]},
    CE_OPTION_CASES[-1],
]


def _ours_opts(opts):
    n = opts.get("num_items_in_batch")
    return {**opts, "num_items_in_batch": torch.tensor(n) if isinstance(n, list) else n}


@pytest.mark.parametrize("opts", OPTION_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("form", ["shared", "per_head"])
def test_options_match_reference(opts, form):
    hiddens, weight, b, labels = make(torch.float32, form)
    grad_out = torch.rand(K, B, T) * 2.5 if opts.get("reduction") == "none" else 2.5
    kw = dict(head_weights=HEAD_WEIGHTS)
    ours = run_ours(
        hiddens,
        weight,
        b,
        labels,
        False,
        grad_out,
        chunk_size=16,
        compile=False,
        return_entropy=True,
        **kw,
        **_ours_opts(opts),
    )
    ref = run_ref(hiddens, weight, b, labels, grad_out, **kw, **opts)
    names = ("loss", "accuracy", "num_tokens", "entropy")
    check(ours, ref, None, names + (("z_loss",) if "lse_square_scale" in opts else ()))


def test_none_sums_to_sum():
    hiddens, weight, b, labels = make(torch.float32)
    kw = dict(head_weights=HEAD_WEIGHTS, chunk_size=16, compile=False)
    none = FusedLinearMultiTokenLoss(reduction="none", **kw)(hiddens, weight, labels, bias=b)
    total = FusedLinearMultiTokenLoss(reduction="sum", **kw)(hiddens, weight, labels, bias=b)
    assert none.shape == (K, B, T)
    torch.testing.assert_close(none.sum(), total)


def test_single_head_is_cross_entropy():
    hiddens, weight, b, labels = make(torch.float32, k=1)
    ours = run_ours(hiddens, weight, b, labels, chunk_size=16, compile=False)
    ce = FusedLinearCrossEntropyLoss(chunk_size=16, compile=False, return_token_accuracy=True)
    h = hiddens.detach()[0].requires_grad_()
    w, bb = weight.detach().requires_grad_(), b.detach().requires_grad_()
    loss = ce(h, w, labels, bias=bb)
    loss.backward()
    torch.testing.assert_close(ours[0], loss.detach())
    for g, r in zip(ours[1], (h.grad[None], w.grad, bb.grad)):
        torch.testing.assert_close(g, r)
    torch.testing.assert_close(ours[2]["head0/accuracy"], ce.metrics["mean_token_accuracy"])


def test_hand_computed():
    # H=1, V=2, T=2, K=2. logits (w0·x, w1·x) = (x, 3x). Head 0 at t=0: x=1, label 0: log(1 + e^2); at t=1:
    # x=2, label 1: log(1 + e^-4). Head 1 at t=0 (target labels[:, 1] = 1): x=-1: logits (-1, -3), label 1:
    # log(1 + e^2); no target at t=1. Weights (1, 0.5): 0.5·(log(1+e^2) + log(1+e^-4)) + 0.5·log(1+e^2).
    hiddens = torch.tensor([[[[1.0], [2.0]]], [[[-1.0], [5.0]]]], requires_grad=True)
    weight = torch.tensor([[1.0], [3.0]])
    loss_fn = FusedLinearMultiTokenLoss(head_weights=(1.0, 0.5), compile=False)
    loss = loss_fn(hiddens, weight, torch.tensor([[0, 1]]))
    a, c = torch.log1p(torch.exp(torch.tensor(2.0))), torch.log1p(torch.exp(torch.tensor(-4.0)))
    torch.testing.assert_close(loss, 0.5 * (a + c) + 0.5 * a)
    torch.testing.assert_close(loss_fn.metrics["head1/loss"], a)
    assert loss_fn.metrics["head1/num_tokens"] == 1
    loss.backward()
    assert hiddens.grad[1, 0, 1, 0] == 0  # head 1 has no target at t = T - 1


def test_heads_past_the_sequence_have_no_targets():
    """T ≤ K - 1: the last heads have no target; they add 0, their metrics are 0 and say they had none."""
    hiddens, weight, b, labels = make(torch.float32, "per_head", k=5, t=3, ignore_frac=0.0)
    ours = run_ours(hiddens, weight, b, labels, chunk_size=16, compile=False)
    ref = run_ref(hiddens, weight, b, labels)
    check(ours, ref, k=5)
    _, (g_h, g_w, g_b), metrics = ours
    for k in (3, 4):
        assert metrics[f"head{k}/num_tokens"] == 0 and metrics[f"head{k}/loss"] == 0
        assert metrics[f"head{k}/accuracy"] == 0
        assert not g_h[k].any() and not g_w[k].any() and not g_b[k].any()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_is_zero(reduction):
    hiddens, weight, b, labels = make(torch.float32, ignore_frac=1.0)
    loss, grads, metrics = run_ours(hiddens, weight, b, labels, reduction=reduction, compile=False)
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    assert all(not torch.isnan(v) and v == 0 for v in metrics.values())


def test_chunk_sizes_agree():
    hiddens, weight, b, labels = make(torch.float32)
    results = [run_ours(hiddens, weight, b, labels, chunk_size=c, compile=False) for c in (1, 7, 64, 10_000)]
    for loss, grads, metrics in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        for g, g0 in zip(grads, results[0][1]):
            torch.testing.assert_close(g, g0)
        for key, v in metrics.items():
            torch.testing.assert_close(v, results[0][2][key])


def _count_runs(monkeypatch):
    calls = []
    real = FusedLinearBase.run

    def run(self, hidden, weight, bias, batch):
        calls.append(hidden.shape[0])
        return real(self, hidden, weight, bias, batch)

    monkeypatch.setattr(FusedLinearBase, "run", run)
    return calls


def test_one_engine_call_per_distinct_weight(monkeypatch):
    """A shared head is one chunk loop over all heads' rows; per-head weights one each; a sequence naming the
    same weight twice groups those heads."""
    calls = _count_runs(monkeypatch)
    hiddens, weight, _, labels = make(torch.float32, bias=False)
    fn = FusedLinearMultiTokenLoss(compile=False)
    fn(hiddens, weight, labels)
    assert calls == [K * B * T]
    calls.clear()
    fn(hiddens, torch.stack([weight] * K), labels)
    assert calls == [B * T] * K
    calls.clear()
    other = weight.detach().clone()
    fn(list(hiddens), [weight, other, weight], labels)
    assert calls == [2 * B * T, B * T]


def test_grouped_heads_match_reference():
    hiddens, weight, b, labels = make(torch.float32, bias=False)
    other = (weight.detach() * 0.5).requires_grad_()
    fn = FusedLinearMultiTokenLoss(head_weights=HEAD_WEIGHTS, chunk_size=16, compile=False)
    loss = fn(list(hiddens), [weight, other, weight], labels)
    loss.backward()
    h, w, o = (x.detach().clone().requires_grad_() for x in (hiddens, weight, other))
    ref, _ = multi_token_ref(list(h), [w, o, w], labels, head_weights=HEAD_WEIGHTS)
    ref.backward()
    assert_close_to_ref(loss, ref, name="loss")
    for g, r in ((hiddens.grad, h.grad), (weight.grad, w.grad), (other.grad, o.grad)):
        assert_close_to_ref(g, r, name="grad")


def test_frozen_inputs_get_no_gradient():
    hiddens, weight, b, labels = make(torch.float32)
    weight.requires_grad_(False)
    b.requires_grad_(False)
    FusedLinearMultiTokenLoss(compile=False)(hiddens, weight, labels, bias=b).backward()
    assert weight.grad is None and b.grad is None and hiddens.grad is not None


def test_autocast_runs_heads_in_autocast_dtype():
    hiddens, weight, b, labels = make(torch.float32, "per_head")
    fn = FusedLinearMultiTokenLoss(chunk_size=16, compile=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fn(list(hiddens), list(weight), labels, bias=list(b))
    loss.backward()
    assert hiddens.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    cast = [x.detach().bfloat16().requires_grad_() for x in (hiddens, weight, b)]
    low = FusedLinearMultiTokenLoss(chunk_size=16, compile=False)(*cast[:2], labels, bias=cast[2])
    low.backward()
    torch.testing.assert_close(loss, low)
    torch.testing.assert_close(hiddens.grad, cast[0].grad.float())


def test_compiled_step_matches_reference():
    hiddens, weight, b, labels = make(torch.float32)
    kw = dict(head_weights=HEAD_WEIGHTS, label_smoothing=0.1, lse_square_scale=1e-3)
    ours = run_ours(hiddens, weight, b, labels, chunk_size=64, compile=True, **kw)
    check(ours, run_ref(hiddens, weight, b, labels, **kw), None, ("loss", "accuracy", "z_loss"))


@pytest.mark.parametrize("opts", [{}, {"reduction": "none"}, OPTION_CASES[-1]], ids=["mean", "none", "all"])
def test_triton_step_matches_reference(opts, cuda_steps, monkeypatch):
    """On CUDA the "token" step is the cross-entropy Triton kernel with each row's head weight as its
    ``grad_scale``; here it runs on CPU through TRITON_INTERPRET=1 inside the whole loss."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors reach the Triton kernel only under TRITON_INTERPRET=1")
    import chunkloss.kernels.cross_entropy as kernel

    calls = []
    real = kernel.cross_entropy_step
    monkeypatch.setattr(kernel, "cross_entropy_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    hiddens, weight, b, labels = make(torch.float32, "per_head")
    grad_out = torch.rand(K, B, T) * 2.5 if opts.get("reduction") == "none" else 2.5
    kw = dict(head_weights=HEAD_WEIGHTS, **opts)
    ours = run_ours(hiddens, weight, b, labels, False, grad_out, chunk_size=16, **kw)
    assert calls, "the Triton step did not run"
    check(ours, run_ref(hiddens, weight, b, labels, grad_out, **kw))


BAD_INPUTS = [
    ("no heads", lambda h, w, y: ([], w, y), ValueError, "K ≥ 1"),
    ("stacked K=0", lambda h, w, y: (h[:0], w, y), ValueError, "K ≥ 1"),
    ("3-d hiddens", lambda h, w, y: (h[0], w, y), ValueError, r"\(K, B, T, H\)"),
    ("2 weights for 3 heads", lambda h, w, y: (h, [w, w], y), ValueError, "holds 2 heads, hiddens 3"),
    ("stacked weights", lambda h, w, y: (h, torch.stack([w, w]), y), ValueError, "holds 2 heads"),
    ("hidden shapes", lambda h, w, y: ([h[0], h[1], h[2, :, :-1]], w, y), ValueError, "differs from"),
    ("hidden size", lambda h, w, y: (h, w[:, :-1], y), ValueError, "hidden size"),
    ("dtype", lambda h, w, y: (h, w.double(), y), TypeError, "dtype"),
    ("labels shape", lambda h, w, y: (h, w, y[:, :-1]), ValueError, "labels shape"),
    ("labels range", lambda h, w, y: (h, w, y.clamp(min=0) + V), ValueError, "outside"),
    ("float labels", lambda h, w, y: (h, w, y.float()), TypeError, "integer"),
    ("hiddens type", lambda h, w, y: ("x", w, y), TypeError, "hiddens"),
    ("vocab per head", lambda h, w, y: (h, [w, w, w[:-1]], y), ValueError, "V="),
]


@pytest.mark.parametrize("name,mutate,exc,match", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs(name, mutate, exc, match):
    hiddens, weight, _, labels = make(torch.float32, bias=False)
    with pytest.raises(exc, match=match):
        FusedLinearMultiTokenLoss(compile=False)(*mutate(hiddens, weight, labels))


@pytest.mark.parametrize(
    "head_weights,exc,match",
    [
        ((), ValueError, "K ≥ 1"),
        ((1.0, -1.0), ValueError, "≥ 0"),
        ("ab", TypeError, "sequence"),
        ((1.0, float("nan")), ValueError, "finite"),
    ],
)
def test_bad_head_weights(head_weights, exc, match):
    with pytest.raises(exc, match=match):
        FusedLinearMultiTokenLoss(head_weights=head_weights)


def test_head_weights_of_wrong_length():
    hiddens, weight, _, labels = make(torch.float32, bias=False)
    with pytest.raises(ValueError, match="head_weights holds 2 weights for 3 heads"):
        FusedLinearMultiTokenLoss(head_weights=(1.0, 0.5), compile=False)(hiddens, weight, labels)


def test_bias_count_mismatch():
    hiddens, weight, b, labels = make(torch.float32)
    with pytest.raises(ValueError, match="bias holds 2 heads"):
        FusedLinearMultiTokenLoss(compile=False)(hiddens, weight, labels, bias=[b, b])


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["shared", "per_head"])
def test_cuda_bf16_matches_reference(form):
    """On CUDA (Triton token steps, automatic chunks) at Llama-3's vocabulary, bf16, against fp64."""
    g = torch.Generator().manual_seed(0)
    k, b, t, h, v = 3, 2, 512, 256, 128256
    hiddens = torch.randn(k, b, t, h, generator=g).bfloat16().cuda().requires_grad_()
    shape = (v, h) if form == "shared" else (k, v, h)
    weight = (torch.randn(*shape, generator=g) * h**-0.5).bfloat16().cuda().requires_grad_()
    labels = torch.randint(0, v, (b, t), generator=g).cuda()
    labels[:, :7] = -100
    ours = run_ours(hiddens, weight, None, labels, head_weights=HEAD_WEIGHTS)
    ref = run_ref(hiddens, weight, None, labels, head_weights=HEAD_WEIGHTS)
    low = run_ref(hiddens, weight, None, labels, logits_dtype=torch.bfloat16, head_weights=HEAD_WEIGHTS)
    check(ours, ref, low, ("loss", "num_tokens"), dtype=torch.bfloat16)
