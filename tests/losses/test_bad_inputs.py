"""Bad and degenerate inputs of every public loss: a clear one-line error that names the argument, or a
defined finite result; never a crash deep inside torch, a NaN or a layout-dependent result.

Covered: a bias that is no tensor, an empty vocabulary or hidden size, the argument names in head errors
(``bias``, ``ref_bias``, ``teacher_bias``), tensors on another device than the hidden, ``num_items_in_batch``
of 0, of several elements, negative or not a number, GRPO's ``num_processes``/``gradient_accumulation_steps``/
``steps_per_generation`` of 0, an ``importance_sampling_ratio`` that is no tensor, target ids outside the
vocabulary (GRPO's ``completion_ids`` under the mask), and GRPO masks holding a value other than 0 and 1.
Small shapes: H=16, V=50.
"""

from __future__ import annotations

import math

import pytest
import torch

from chunkloss import (
    FusedLinearCPOLoss,
    FusedLinearCrossEntropyLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearJSDLoss,
    FusedLinearORPOLoss,
    FusedLinearSimPOLoss,
)
from chunkloss.testing.reference import cpo_ref, cross_entropy_ref, dpo_ref, grpo_ref, jsd_ref, orpo_ref
from tests.tolerances import assert_close_to_ref

# fp32, ours against the reference or one layout against another: the same math in another summation order;
# measured ≤ 5e-7 absolute here (ORPO's loss of ≈ 5 against its reference): tests/tolerances.py's fp32 row.

B, T, H, V, H_T = 2, 5, 16, 50, 12  # H_T: the JSD teacher's hidden size, unlike the student's

LOSSES = {
    "ce": (FusedLinearCrossEntropyLoss, {}),
    "dpo": (FusedLinearDPOLoss, {}),
    "orpo": (FusedLinearORPOLoss, {}),
    "simpo": (FusedLinearSimPOLoss, {}),
    "cpo": (FusedLinearCPOLoss, {}),
    "grpo": (FusedLinearGRPOLoss, dict(beta=0.04)),  # token path (one pass, token loss)
    "grpo_seq": (FusedLinearGRPOLoss, dict(beta=0.04, importance_sampling_level="sequence")),  # sequence path
    "jsd": (FusedLinearJSDLoss, {}),
}
KINDS = list(LOSSES)
PREFERENCE = ("dpo", "orpo", "simpo", "cpo")
GRPO = ("grpo", "grpo_seq")
# GRPO's min/max over sequences of nothing is NaN by design (TRL's nanmin/nanmax of an empty set).
NAN_BY_DESIGN = {"clip_ratio/low_min", "clip_ratio/high_max"}


def head_names(kind):
    """Names of the forward's hidden, weight and bias arguments (the same in every loss)."""
    return ("hidden", "weight", "bias")


def make(kind, rows=B, t=T, seed=0):
    """Forward keyword arguments of ``kind``: ``rows`` sequences (pairs) of ``t`` positions, some ignored."""
    g = torch.Generator().manual_seed(seed)
    h, w, b = head_names(kind)
    n = 2 * rows if kind in PREFERENCE else rows
    d = {
        h: torch.randn(n, t, H, generator=g).requires_grad_(),
        w: (0.3 * torch.randn(V, H, generator=g)).requires_grad_(),
        b: (0.1 * torch.randn(V, generator=g)).requires_grad_(),
    }
    y = torch.randint(0, V, (n, t), generator=g)
    y[:, :1] = -100  # a prompt position
    if kind in ("ce", "jsd"):
        d["labels"] = y
    if kind == "jsd":
        d["teacher_hidden"] = torch.randn(rows, t, H_T, generator=g)
        d["teacher_weight"] = 0.3 * torch.randn(V, H_T, generator=g)
    if kind in PREFERENCE:
        d["chosen"], d["rejected"] = y[:rows], y[rows:]
    if kind in GRPO:
        mask = torch.ones(rows, t, dtype=torch.long)
        if rows > 1:
            mask[0, t - 2 :] = 0  # the first completion ends early
        d.update(
            completion_ids=torch.randint(0, V, (rows, t), generator=g),
            completion_mask=mask,
            advantages=torch.randn(rows, generator=g),
            old_logps=-4.0 + 0.3 * torch.randn(rows, t, generator=g),
            ref_logps=-4.0 + 0.3 * torch.randn(rows, t, generator=g),
        )
    return d


def module(kind, compile=False, **opts):
    cls, base = LOSSES[kind]
    return cls(compile=compile, chunk_size=3, **{**base, **opts})


def run(kind, d, compile=False, **call):
    """(loss, gradients of hidden/weight/bias by name (None where not required), metrics) of the forward on
    ``d`` and the further arguments ``call``."""
    mod = module(kind, compile)
    leaves = {k: d[k] for k in head_names(kind)}
    for v in leaves.values():
        if isinstance(v, torch.Tensor):
            v.grad = None
    loss = mod(**d, **call)
    if loss.requires_grad:
        loss.backward()
    grads = {k: v.grad if isinstance(v, torch.Tensor) and v.is_leaf else None for k, v in leaves.items()}
    return loss.detach(), grads, mod.metrics


def labels_of(kind):
    return {"ce": "labels", "jsd": "labels", "grpo": "completion_ids", "grpo_seq": "completion_ids"}.get(
        kind, "chosen"
    )


# --------------------------------------------------------------------------------------------------
# The head: errors name the argument (student_/ref_/teacher_ forms included).
HEAD_CASES = {
    "bias_not_tensor": (lambda d, h, w, b: {**d, b: 0.0}, TypeError, "{b} must be a torch.Tensor, got float"),
    "empty_vocab": (
        lambda d, h, w, b: {**d, w: torch.zeros(0, H), b: None},
        ValueError,
        r"{w} must be \(V, H\) with V ≥ 1 and H ≥ 1, got shape \(0, 16\)",
    ),
    "empty_hidden_size": (
        lambda d, h, w, b: {**d, h: d[h].detach()[..., :0], w: torch.zeros(V, 0), b: None},
        ValueError,
        r"{w} must be \(V, H\) with V ≥ 1 and H ≥ 1, got shape \(50, 0\)",
    ),
    "bias_other_device": (
        lambda d, h, w, b: {**d, b: torch.zeros(V, device="meta")},
        ValueError,
        "{b} is on meta but {w} is on cpu",
    ),
    "bias_shape": (
        lambda d, h, w, b: {**d, b: torch.zeros(V + 1)},
        ValueError,
        r"{b} must be \(V,\)=\(50,\), got \(51,\)",
    ),
    "dtype_mismatch": (
        lambda d, h, w, b: {**d, h: d[h].detach().double()},
        TypeError,
        "{h} dtype torch.float64 differs from {w} dtype torch.float32",
    ),
    # A (H, V) weight, e.g. lm_head.weight.T: said to look transposed (was: "must equal H=50").
    "transposed_weight": (
        lambda d, h, w, b: {**d, w: d[w].detach().t()},
        ValueError,
        r"{w} of shape \(16, 50\) looks transposed: .* must be \(V, H\)=\(50, 16\)",
    ),
    # The shape in single brackets (was: "last dim ((2, 5, 15))").
    "hidden_size": (
        lambda d, h, w, b: {**d, h: d[h].detach()[..., :-1]},
        ValueError,
        r"{h}'s last dim 15 \(shape \(\d+, 5, 15\)\) must equal {w}'s hidden size H=16",
    ),
}


@pytest.mark.parametrize("case", list(HEAD_CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_head_errors_name_the_argument(kind, case):
    change, exc, match = HEAD_CASES[case]
    h, w, b = head_names(kind)
    with pytest.raises(exc, match=match.format(h=h, w=w, b=b)):
        module(kind)(**change(make(kind), h, w, b))


@pytest.mark.parametrize(
    "kind,change,exc,match",
    [
        ("dpo", dict(ref_bias=torch.zeros(3)), ValueError, r"ref_bias must be \(V,\)=\(50,\), got \(3,\)"),
        ("grpo", dict(ref_bias=torch.zeros(3)), ValueError, r"ref_bias must be \(V,\)=\(50,\), got \(3,\)"),
        (
            "dpo",
            dict(ref_weight=torch.zeros(V, H, dtype=torch.float64)),
            TypeError,
            "ref_hidden dtype torch.float32 differs from ref_weight dtype torch.float64",
        ),
        ("grpo", dict(ref_weight=torch.zeros(V, 0)), ValueError, r"ref_weight must be \(V, H\) with V ≥ 1"),
        (
            "grpo",
            dict(ref_hidden=torch.zeros(B, T, H, device="meta"), ref_weight=torch.zeros(V, H, device="meta")),
            ValueError,
            "ref_hidden is on meta but hidden is on cpu",
        ),
        ("jsd", dict(teacher_bias=torch.zeros(3)), ValueError, r"teacher head: teacher_bias must be \(V,\)"),
        ("jsd", dict(teacher_weight=torch.zeros(V, 0)), ValueError, r"teacher head: teacher_weight must be"),
    ],
)
def test_extra_head_errors_name_the_argument(kind, change, exc, match):
    d = make(kind)
    if kind in PREFERENCE + GRPO:
        rows = d["hidden"].shape[:2]
        d.update(ref_hidden=torch.randn(*rows, H), ref_weight=torch.randn(V, H), ref_logps=None)
        d = {k: v for k, v in d.items() if v is not None}
    d.update(change)
    with pytest.raises(exc, match=match):
        module(kind)(**d)


# --------------------------------------------------------------------------------------------------
# Per-token and per-sequence tensors on another device than the hidden: torch's own errors deep in the loop
# before ("Expected all tensors to be on the same device", "indices should be either on cpu or ...", seen on
# CUDA with CPU labels); now a ValueError naming the argument. "meta" stands in for another device on CPU.
def _extras(kind):
    """Optional arguments of ``kind`` to move, with valid values."""
    g = torch.Generator().manual_seed(1)
    if kind == "dpo":
        return dict(
            ref_chosen_logps=torch.randn(B, generator=g), ref_rejected_logps=torch.randn(B, generator=g)
        )
    if kind == "orpo":
        return dict(nll_labels=torch.randint(0, V, (B, T), generator=g))
    if kind == "grpo":
        return dict(
            importance_sampling_ratio=torch.ones(B, T),
            tool_mask=torch.ones(B, T, dtype=torch.long),
            sampling_logps=torch.full((B, T), -4.0),
        )
    return {}


DEVICE_CASES = [
    ("ce", "labels"),
    ("jsd", "labels"),
    ("dpo", "chosen"),
    ("dpo", "rejected"),
    ("dpo", "ref_chosen_logps"),
    ("orpo", "nll_labels"),
    ("grpo", "completion_ids"),
    ("grpo", "completion_mask"),
    ("grpo", "advantages"),
    ("grpo", "old_logps"),
    ("grpo", "ref_logps"),
    ("grpo", "importance_sampling_ratio"),
    ("grpo", "tool_mask"),
    ("grpo", "sampling_logps"),
]


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_meta_device_is_one_clear_line(kind, autocast):
    """Every tensor on the meta device (a model built without its weights): a ValueError naming the first
    argument, with or without autocast (was: "unknown device type for autocast" from inside torch)."""
    d = {k: v.detach().to("meta") if isinstance(v, torch.Tensor) else v for k, v in make(kind).items()}
    h = head_names(kind)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with pytest.raises(
            ValueError, match=f"^{h} is on the meta device .*: load or materialise the weights"
        ):
            module(kind)(**d)


@pytest.mark.parametrize("kind,arg", DEVICE_CASES)
def test_tensor_on_another_device(kind, arg):
    d = {**make(kind), **_extras(kind)}
    d[arg] = d[arg].to("meta")
    with pytest.raises(ValueError, match=f"{arg} is on meta but hidden is on cpu"):
        module(kind)(**d)


# --------------------------------------------------------------------------------------------------
# num_items_in_batch (CE, JSD, GRPO's dapo).
NUM_ITEMS_KINDS = ("ce", "jsd", "grpo")


@pytest.mark.parametrize("zero", [0, torch.tensor(0)], ids=["int", "tensor"])
@pytest.mark.parametrize("kind", NUM_ITEMS_KINDS)
def test_num_items_zero_divides_by_one(kind, zero):
    """A global count of 0 (was: loss inf, gradients inf/NaN) divides by 1: the summed loss, exactly."""
    d = make(kind)
    loss0, grads0, _ = run(kind, d, num_items_in_batch=zero)
    loss1, grads1, _ = run(kind, d, num_items_in_batch=1)
    assert math.isfinite(loss0.item()) and loss0.item() != 0.0
    assert torch.equal(loss0, loss1)
    for k in grads0:
        assert torch.equal(grads0[k], grads1[k]), k


@pytest.mark.parametrize("kind", NUM_ITEMS_KINDS)
def test_num_items_zero_and_nothing_labelled(kind):
    """The case a count of 0 comes from: nothing labelled anywhere. Loss 0, zero gradients, metrics 0."""
    d = make(kind)
    if kind in GRPO:
        d["completion_mask"] = torch.zeros(B, T, dtype=torch.long)
    else:
        d["labels"] = torch.full((B, T), -100)
    loss, grads, metrics = run(kind, d, num_items_in_batch=0)
    assert loss.item() == 0.0
    assert all(g.abs().max().item() == 0.0 for g in grads.values())
    assert all(v.item() == 0.0 for k, v in metrics.items() if k not in NAN_BY_DESIGN), metrics


@pytest.mark.parametrize(
    "value,exc,match",
    [
        (
            torch.tensor([7, 7]),
            ValueError,
            r"num_items_in_batch must be a number or a one-element tensor, "
            r"got shape \(2,\)",
        ),
        (-3, ValueError, "num_items_in_batch must be a count ≥ 0, got -3"),
        (float("nan"), ValueError, "num_items_in_batch must be a count ≥ 0, got nan"),
        ("7", TypeError, "num_items_in_batch must be a number or a one-element tensor, got str"),
        (True, TypeError, "num_items_in_batch must be a number or a one-element tensor, got bool"),
    ],
)
@pytest.mark.parametrize("kind", NUM_ITEMS_KINDS)
def test_num_items_bad(kind, value, exc, match):
    with pytest.raises(exc, match=match):
        module(kind)(**make(kind), num_items_in_batch=value)


# --------------------------------------------------------------------------------------------------
# GRPO's trainer state and importance-sampling ratio.
@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("arg", ["num_processes", "gradient_accumulation_steps", "steps_per_generation"])
def test_grpo_trainer_state_must_be_positive(arg, value):
    """0 gave a loss of NaN (gradient_accumulation_steps) or silently 0 (num_processes,
    steps_per_generation)."""
    with pytest.raises(ValueError, match=f"{arg} must be a positive number, got {value}"):
        module("grpo")(**make("grpo"), **{arg: value})


@pytest.mark.parametrize(
    "ratio,exc,match",
    [
        ([1.0, 1.0], TypeError, "importance_sampling_ratio must be a torch.Tensor, got list"),
        (1.0, TypeError, "importance_sampling_ratio must be a torch.Tensor, got float"),
        (torch.ones(B, 2), ValueError, r"must be \(B, T\)=\(2, 5\), \(B, 1\) or \(B,\), got \(2, 2\)"),
        (torch.ones(B + 1), ValueError, r"must be \(B, T\)=\(2, 5\), \(B, 1\) or \(B,\), got \(3,\)"),
    ],
)
def test_grpo_importance_sampling_ratio_bad(ratio, exc, match):
    with pytest.raises(exc, match=match):
        module("grpo")(**make("grpo"), importance_sampling_ratio=ratio)


@pytest.mark.parametrize("shape", [(B,), (B, 1), (B, T)])
@pytest.mark.parametrize("kind", GRPO)
def test_grpo_importance_sampling_ratio_of_ones_changes_nothing(kind, shape):
    d = make(kind)
    base, base_grads, _ = run(kind, d)
    loss, grads, _ = run(kind, d, importance_sampling_ratio=torch.ones(shape))
    assert torch.equal(loss, base)
    assert all(torch.equal(grads[k], base_grads[k]) for k in grads)


# --------------------------------------------------------------------------------------------------
# Labels: the checks other tests do not reach.
def _with(labels, value):
    """``labels`` with ``value`` at a position that is labelled and inside the completion mask."""
    out = labels.clone()
    out[-1, 1] = value
    return out


@pytest.mark.parametrize(
    "kind,change,exc,match",
    [
        (
            "grpo",
            lambda y: y.float(),
            TypeError,
            "completion_ids must be an integer tensor, got torch.float32",
        ),
        ("grpo", lambda y: _with(y, -2), ValueError, "completion_ids holds -2, outside"),
        ("jsd", lambda y: _with(y, -2), ValueError, "labels holds -2, outside"),
        ("jsd", lambda y: y.bool(), TypeError, "labels must be an integer tensor, got torch.bool"),
        ("cpo", lambda y: y.reshape(-1), ValueError, r"chosen shape \(10,\) must equal"),
    ],
)
def test_label_errors(kind, change, exc, match):
    d = make(kind)
    d[labels_of(kind)] = change(d[labels_of(kind)])
    with pytest.raises(exc, match=match):
        module(kind)(**d)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("value", [-1, -100, V])
@pytest.mark.parametrize("kind", GRPO)
def test_grpo_ids_under_the_mask_must_be_in_the_vocabulary(kind, value, compile):
    """GRPO takes no ignore_index: an id where the mask is 1 outside [0, V) is one error, compiled or not
    (-1 was taken for an ignored id: a finite loss compiled, an IndexError eagerly)."""
    d = make(kind)
    d["completion_ids"] = _with(d["completion_ids"], value)
    with pytest.raises(ValueError, match=rf"^completion_ids holds {value}, outside \[0, {V}\)$"):
        module(kind, compile)(**d)


@pytest.mark.parametrize("compile", [False, True])
def test_grpo_ids_outside_the_mask_are_not_read(compile):
    d = make("grpo")
    d["completion_mask"][-1, 1] = 0
    expect = run("grpo", d, compile)[0]
    d["completion_ids"] = _with(d["completion_ids"], -1)
    assert torch.equal(run("grpo", d, compile)[0], expect)


# Values a 0/1 mask must not hold: a weight (the loss reads the mask as a bool: it would count as 1), a count,
# a negative, NaN.
@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, float("nan")])
@pytest.mark.parametrize("arg", ["completion_mask", "tool_mask"])
@pytest.mark.parametrize("kind", GRPO)
def test_grpo_mask_outside_0_1_is_one_error(kind, arg, value):
    d = make(kind)
    d[arg] = torch.ones(B, T) if arg == "tool_mask" else d[arg].float()
    d[arg][-1, 1] = value
    with pytest.raises(ValueError, match=rf"^{arg} holds {value}, outside \{{0, 1\}} \(1 marks a token"):
        module(kind)(**d)


@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.float32])
def test_grpo_mask_of_0_and_1_in_any_dtype_gives_one_result(dtype):
    d = make("grpo")
    expect = run("grpo", d)[0]
    d["completion_mask"] = d["completion_mask"].to(dtype)
    assert torch.equal(run("grpo", d)[0], expect)


@pytest.mark.parametrize("compile", [False, True])
def test_ce_label_outside_the_vocabulary_is_the_same_error_compiled(compile):
    d = make("ce")
    d["labels"] = _with(d["labels"], -1)
    with pytest.raises(ValueError, match=rf"^labels holds -1, outside \[0, {V}\) and not ignore_index=-100$"):
        module("ce", compile)(**d)


@pytest.mark.parametrize("kind", KINDS)
def test_int32_labels_give_the_int64_result(kind):
    d = make(kind)
    loss, grads, _ = run(kind, d)
    for k in (labels_of(kind), "rejected"):
        if k in d:
            d[k] = d[k].int()
    loss32, grads32, _ = run(kind, d)
    assert torch.equal(loss32, loss)
    assert all(torch.equal(grads32[k], grads[k]) for k in grads)


# --------------------------------------------------------------------------------------------------
# Layouts: non-contiguous inputs give what the same values made contiguous give.
def _noncontiguous(t):
    """The same values in a non-contiguous leaf tensor (a transposed copy seen transposed back; 1-D: every
    other element of a longer buffer)."""
    if t.dim() >= 2:
        out = t.detach().transpose(0, -1).contiguous().transpose(0, -1)
    else:
        out = torch.stack([t.detach(), torch.zeros_like(t)], 1)[:, 0]
    assert not out.is_contiguous() and torch.equal(out, t.detach())
    return out.requires_grad_(t.requires_grad)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])  # a compile per loss
@pytest.mark.parametrize("kind", KINDS)
def test_noncontiguous_inputs_match_contiguous(kind, compile):
    """Every tensor argument non-contiguous at once; the hidden a strided view (non-leaf) into a wider
    buffer, whose gradient lands on the buffer's used positions only."""
    d = {**make(kind), **_extras(kind)}
    loss, grads, metrics = run(kind, d, compile)
    h = head_names(kind)[0]
    n, t = d[h].shape[:2]
    buf = torch.zeros(n, 2 * t, H)
    buf[:, ::2] = d[h].detach()
    buf.requires_grad_()
    nc = {k: (_noncontiguous(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in d.items()}
    nc[h] = buf[:, ::2]
    loss_nc, grads_nc, metrics_nc = run(kind, nc, compile)
    assert_close_to_ref(loss_nc, loss)
    assert_close_to_ref(buf.grad[:, ::2], grads[h])
    assert buf.grad[:, 1::2].abs().max().item() == 0.0
    for k in head_names(kind)[1:]:
        assert_close_to_ref(grads_nc[k], grads[k])
    for k in metrics:
        assert_close_to_ref(metrics_nc[k], metrics[k], name=k)


# --------------------------------------------------------------------------------------------------
# Degenerate shapes.
def _nothing_labelled(kind, d):
    if kind in GRPO:
        d["completion_mask"] = torch.zeros_like(d["completion_mask"])
    for k in ("labels", "chosen", "rejected"):
        if k in d:
            d[k] = torch.full_like(d[k], -100)
    return d


@pytest.mark.parametrize("kind", KINDS)
def test_zero_positions_is_nothing_labelled(kind):
    """T = 0 gives what the same batch with every position ignored gives (0, or the loss of empty completions
    for the preference losses: -logσ(0) for DPO), with zero gradients and finite metrics."""
    loss0, grads0, metrics0 = run(kind, make(kind, t=0))
    loss1, grads1, metrics1 = run(kind, _nothing_labelled(kind, make(kind, t=1)))
    assert math.isfinite(loss0.item())
    assert torch.equal(loss0, loss1)
    h = head_names(kind)[0]
    assert grads0[h].shape == (2 * B if kind in PREFERENCE else B, 0, H)
    assert all(grads0[k].abs().max().item() == 0.0 for k in head_names(kind)[1:])
    assert metrics0.keys() == metrics1.keys()
    for k, v in metrics0.items():
        assert k in NAN_BY_DESIGN or (math.isfinite(v.item()) and torch.equal(v, metrics1[k])), (k, v)


@pytest.mark.parametrize("kind", ("grpo", "grpo_seq", "jsd"))
def test_zero_rows(kind):
    """An empty batch (CE and the preference losses have their own tests): loss 0, zero gradients."""
    loss, grads, metrics = run(kind, make(kind, rows=0))
    assert loss.item() == 0.0
    h, w, b = head_names(kind)
    assert grads[h].shape == (0, T, H)
    assert grads[w].abs().max().item() == 0.0 and grads[b].abs().max().item() == 0.0
    assert all(v.item() == 0.0 for k, v in metrics.items() if k not in NAN_BY_DESIGN), metrics


def _reference(kind, d):
    """The fp32 reference loss on fresh leaves, and those leaves (hidden, weight, bias)."""
    h, w, b = (d[k].detach().clone().requires_grad_() for k in head_names(kind))
    if kind == "ce":
        loss, _ = cross_entropy_ref(h, w, d["labels"], b)
    elif kind == "jsd":
        loss, _ = jsd_ref(h, w, d["teacher_hidden"], d["teacher_weight"], d["labels"], b)
    elif kind in GRPO:
        opts = dict(LOSSES[kind][1])
        extra = {k: d[k] for k in ("old_logps", "ref_logps")}
        loss, _ = grpo_ref(
            h, w, d["completion_ids"], d["completion_mask"], d["advantages"], b, **extra, **opts
        )
    else:
        ref = {"dpo": dpo_ref, "orpo": orpo_ref, "cpo": cpo_ref}.get(kind)
        opts = {}
        if kind == "simpo":
            ref, opts = cpo_ref, dict(loss_type="simpo", cpo_alpha=0.0)
        loss, _ = ref(h, w, d["chosen"], d["rejected"], b, **opts)
    loss.backward()
    return loss.detach(), (h, w, b)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_one_position_matches_reference(kind, compile):
    """One position per sequence (one row, or one pair of rows): matches the fp32 reference."""
    d = make(kind, rows=1, t=2)
    for k in ("labels", "chosen", "rejected"):
        if k in d:
            d[k] = d[k][:, 1:].clone()  # the one labelled position
    h = head_names(kind)[0]
    d[h] = d[h].detach()[:, 1:].clone().requires_grad_()
    for k in ("teacher_hidden", "completion_ids", "completion_mask", "old_logps", "ref_logps"):
        if k in d:
            d[k] = d[k][:, 1:].clone()
    loss, grads, _ = run(kind, d, compile)
    ref_loss, ref_leaves = _reference(kind, d)
    assert_close_to_ref(loss, ref_loss.float())
    for k, leaf in zip(head_names(kind), ref_leaves):
        assert_close_to_ref(grads[k], leaf.grad, name=k)


@pytest.mark.parametrize("frozen", ["hidden", "weight_and_bias"])
@pytest.mark.parametrize("kind", KINDS)
def test_frozen_inputs_get_no_gradient(kind, frozen):
    """A frozen hidden or a frozen head: None for those gradients, the others and the loss unchanged."""
    d = make(kind)
    full_loss, full, _ = run(kind, d)
    h, w, b = head_names(kind)
    names = [h] if frozen == "hidden" else [w, b]
    for k in names:
        d[k] = d[k].detach()
    loss, grads, _ = run(kind, d)
    assert_close_to_ref(loss, full_loss)
    for k in (h, w, b):
        if k in names:
            assert grads[k] is None, k
        else:
            assert_close_to_ref(grads[k], full[k], name=k)
