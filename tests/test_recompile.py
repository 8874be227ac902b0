"""torch.compile does not recompile as B and T vary: at most 2 graphs per loss.

Each loss compiles one graph per per-chunk step *kind* it runs (``chunkloss.engine.steps.build_step``):
"token" (token losses with grad), or "stats" and "seq_pass2" (sequence losses: the statistics, then the
pointwise pull-back to the logits). Rows are marked dynamic and the vocabulary is static, so later batches
of other shapes reuse those graphs. A no-grad reference head is reduced to its label log-prob outside the
compiled steps (``chunkloss.losses.common.nograd_label_logprob``: a Triton kernel on CUDA), so it adds no
graph; a chunk of a single row runs its step eagerly (dynamo would specialise size 1 into a graph of its own).

Where the steps are Triton kernels (CUDA; here the ``cuda_steps`` fixture) they compile no graph, and a
sequence loss compiles its "seq_coef" step instead: ``sequence_loss`` and its gradient on the rows'
statistics.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from chunkloss import (
    FusedLinearCPOLoss,
    FusedLinearCrossEntropyLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearJSDLoss,
    FusedLinearORPOLoss,
    FusedLinearSimPOLoss,
)
from chunkloss.engine import compiled, loop
from chunkloss.testing import steps_of
from tests.child_process import in_child_process

H, V = 16, 64  # a tiny head: the test is about graphs, not numerics
H_REF = 8  # the teacher / reference head is narrower than the policy's
CHUNK = 16  # fixed and small, so every batch runs several chunks

# (B, T): B and T both change from call to call. Sequence losses run one pass when a group fits in a chunk:
# a preference pair has 2·(T - T//3) tokens (the first T//3 are prompt), a GRPO completion at most T, so
# T ≤ 12 runs one pass and T ≥ 17 two passes (a GRPO completion of T ≤ 16 would fit too).
FIRST = (2, 21)  # two passes
LATER = [
    (3, 34),  # two passes again: T changes, the mode does not
    (1, 40),  # two passes, a single pair / completion
    (3, 12),  # one pass
    (2, 10),  # one pass again: T changes, the mode does not
    (4, 17),  # back to two passes
]
ONE_PASS = {21: False, 34: False, 40: False, 12: True, 10: True, 17: False}  # by T


def _grpo(mod, b, t, g, ref_head=False, grad=True):
    hidden = torch.randn(b, t, H, generator=g, requires_grad=grad)
    weight = torch.randn(V, H, generator=g, requires_grad=grad)
    ids = torch.randint(0, V, (b, t), generator=g)
    # Completion i is padded after T - i tokens: lengths differ within the batch.
    mask = (torch.arange(t) < (t - torch.arange(b))[:, None].clamp(min=1)).long()
    advantages = torch.randn(b, generator=g)
    kw = {}
    if ref_head:
        kw = dict(
            ref_hidden=torch.randn(b, t, H_REF, generator=g), ref_weight=torch.randn(V, H_REF, generator=g)
        )
    # On-policy (old = logp): ratios of 1 sit inside the clip range, so every row has a gradient and
    # sequence-level pass 2 is not skipped (a clipped row's coefficient is 0 and pass 2 drops it).
    return mod(hidden, weight, ids, mask, advantages, **kw)


def _preference(mod, b, t, g, ref=None, grad=True):
    hidden = torch.randn(2 * b, t, H, generator=g, requires_grad=grad)
    weight = torch.randn(V, H, generator=g, requires_grad=grad)
    labels = torch.randint(0, V, (2 * b, t), generator=g)
    labels[:, : t // 3] = -100  # prompt
    kw = {}
    if ref == "head":
        kw = dict(
            ref_hidden=torch.randn(2 * b, t, H_REF, generator=g),
            ref_weight=torch.randn(V, H_REF, generator=g),
        )
    elif ref == "logps":
        kw = dict(
            ref_chosen_logps=-20 * torch.rand(b, generator=g),
            ref_rejected_logps=-20 * torch.rand(b, generator=g),
        )
    return mod(hidden, weight, labels[:b], labels[b:], **kw)


def _jsd(mod, b, t, g):
    student = torch.randn(b, t, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (b, t), generator=g)
    labels[:, :2] = -100
    return mod(
        student, weight, torch.randn(b, t, H_REF, generator=g), torch.randn(V, H_REF, generator=g), labels
    )


def _cross_entropy(mod, b, t, g):
    hidden = torch.randn(b, t, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (b, t), generator=g)
    labels[:, :2] = -100
    return mod(hidden, weight, labels)


# (loss class, options, input builder, builder kwargs, the step kinds it runs and why).
CASES = {
    "grpo-token": (FusedLinearGRPOLoss, {}, _grpo, {}, {"token"}),
    # Sequence-level ratios: a sequence loss (statistics, then pass 2).
    "grpo-sequence": (
        FusedLinearGRPOLoss,
        dict(importance_sampling_level="sequence"),
        _grpo,
        {},
        {"stats", "seq_pass2"},
    ),
    # The reference head is reduced to its label log-prob before the policy's projection, uncompiled.
    "grpo-token-ref-head": (FusedLinearGRPOLoss, dict(beta=0.1), _grpo, dict(ref_head=True), {"token"}),
    "grpo-sequence-ref-head": (
        FusedLinearGRPOLoss,
        dict(beta=0.1, importance_sampling_level="sequence"),
        _grpo,
        dict(ref_head=True),
        {"stats", "seq_pass2"},
    ),
    "dpo-ref-head": (FusedLinearDPOLoss, {}, _preference, dict(ref="head"), {"stats", "seq_pass2"}),
    "dpo-ref-logps": (FusedLinearDPOLoss, {}, _preference, dict(ref="logps"), {"stats", "seq_pass2"}),
    "orpo": (FusedLinearORPOLoss, {}, _preference, {}, {"stats", "seq_pass2"}),
    "simpo": (FusedLinearSimPOLoss, {}, _preference, {}, {"stats", "seq_pass2"}),
    "cpo": (FusedLinearCPOLoss, {}, _preference, {}, {"stats", "seq_pass2"}),
    # The teacher's whole distribution enters the divergence: projected as extra logits into the token step.
    "jsd": (FusedLinearJSDLoss, {}, _jsd, {}, {"token"}),
}


def _graphs_per_step(mod) -> dict[str, int]:
    """Compiled graphs held by each compiled step ``mod`` has run, by kind: the dynamo cache entries of the
    step's code object (each step has one of its own, see ``chunkloss.engine.compiled.bind``). Triton steps
    and an eager "seq_coef" step hold none and are not listed."""
    out = {}
    for (kind, _), step in steps_of(mod).items():
        if isinstance(step, compiled.RowDynamic):
            code = step.fn._torchdynamo_orig_callable.__code__
            out[kind] = len(_debug_get_cache_entry_list(code))
    return out


@pytest.fixture
def plans(monkeypatch):
    """Records (one_pass, rows of each chunk) of every chunk plan the engine makes (pass 2 of a two-pass
    loss re-chunks its live rows without a plan)."""
    seen = []

    def record(*args):
        plan, one_pass = real(*args)
        seen.append((one_pass, [b - a for a, b in plan.bounds]))
        return plan, one_pass

    real = loop.plan_chunks
    monkeypatch.setattr(loop, "plan_chunks", record)
    return seen


@pytest.mark.parametrize("case", CASES)
@in_child_process
def test_no_recompile_as_batch_and_length_vary(case, plans):
    cls, opts, build, build_kw, kinds = CASES[case]
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    mod = cls(chunk_size=CHUNK, **opts)
    build(mod, *FIRST, g, **build_kw).backward()
    # One graph per kind, each of them actually run (a step created but never called holds 0 graphs).
    assert _graphs_per_step(mod) == dict.fromkeys(kinds, 1), _graphs_per_step(mod)
    assert counters["stats"]["unique_graphs"] == len(kinds), counters["stats"]
    for b, t in LATER:
        build(mod, b, t, g, **build_kw).backward()
    assert counters["stats"]["unique_graphs"] == len(kinds), (counters["stats"], _graphs_per_step(mod))
    assert _graphs_per_step(mod) == dict.fromkeys(kinds, 1), _graphs_per_step(mod)
    assert counters["frames"]["ok"] == counters["frames"]["total"] == len(kinds), counters["frames"]
    # Several chunks in the first batch, other chunk counts later, and sequence losses ran both modes as
    # the shapes above say.
    n_chunks = [len(sizes) for _, sizes in plans]
    assert len(plans) == 1 + len(LATER) and n_chunks[0] > 1 and len(set(n_chunks)) > 1, plans
    if "token" not in kinds:
        assert [one_pass for one_pass, _ in plans] == [ONE_PASS[t] for _, t in [FIRST, *LATER]]


ONE_ROW = {
    "cross-entropy": (FusedLinearCrossEntropyLoss, {}, _cross_entropy, {}, {"token"}),
    **{k: CASES[k] for k in ("grpo-token", "grpo-token-ref-head", "grpo-sequence", "grpo-sequence-ref-head")},
    "jsd": CASES["jsd"],
}


@pytest.mark.parametrize("case", ONE_ROW)
@in_child_process
def test_one_row_chunk_adds_no_graph(case, plans):
    """A batch of one labelled row (T=3 with 2 prompt rows for CE and JSD; one completion token for GRPO)
    runs a chunk of 1 row between batches of several chunks, and the loss still holds one graph per kind."""
    cls, opts, build, build_kw, kinds = ONE_ROW[case]
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    mod = cls(chunk_size=CHUNK, **opts)
    t_one_row = 1 if cls is FusedLinearGRPOLoss else 3
    for b, t in [FIRST, (1, t_one_row), *LATER[:2]]:
        build(mod, b, t, g, **build_kw).backward()
    assert plans[1][1] == [1], plans  # the one-row batch ran a chunk of 1 row
    assert _graphs_per_step(mod) == dict.fromkeys(kinds, 1), _graphs_per_step(mod)
    assert counters["stats"]["unique_graphs"] == len(kinds), counters["stats"]
    assert counters["frames"]["ok"] == counters["frames"]["total"], counters["frames"]


SEQUENCE_CASES = [case for case, (*_, kinds) in CASES.items() if "stats" in kinds]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the cuda_steps fixture runs Triton on CPU tensors (TRITON_INTERPRET=1)"
)
@pytest.mark.parametrize("case", SEQUENCE_CASES)
@in_child_process
def test_sequence_coef_beside_triton_steps(case, plans, cuda_steps):
    """With Triton "stats" and "seq_pass2" steps a sequence loss's graphs are those of its compiled "seq_coef"
    step: 1, or 2 for a preference loss that also meets chunks of a single pair (its (S/2, 2, K) view of the
    pairs specialises S/2 = 1), across both modes, several pair / sequence counts per chunk and batch shapes;
    a call without gradients runs the same graph."""
    cls, opts, build, build_kw, _ = CASES[case]
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    mod = cls(chunk_size=CHUNK, **opts)
    for b, t in [FIRST, *LATER]:
        build(mod, b, t, g, **build_kw).backward()
    assert not build(mod, 3, 10, g, grad=False, **build_kw).requires_grad  # no gradient asked for
    graphs = _graphs_per_step(mod)
    assert set(graphs) == {"seq_coef"} and 1 <= graphs["seq_coef"] <= 2, graphs
    if cls is FusedLinearGRPOLoss:
        assert graphs["seq_coef"] == 1, graphs
    assert counters["stats"]["unique_graphs"] == graphs["seq_coef"], counters["stats"]
    assert counters["frames"]["ok"] == counters["frames"]["total"], counters["frames"]
    assert [one_pass for one_pass, _ in plans[: 1 + len(LATER)]] == [ONE_PASS[t] for _, t in [FIRST, *LATER]]


@pytest.mark.parametrize("level", ["token", "sequence"])
@in_child_process
def test_no_recompile_as_the_entropy_coefficient_changes(level):
    """GRPO's entropy-bonus coefficient passed per call (what an adaptive controller changes every optimizer
    step) is a tensor input of the compiled steps, not a constant baked into them."""
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    mod = FusedLinearGRPOLoss(chunk_size=CHUNK, entropy_coef=1.0, importance_sampling_level=level)
    first = True
    for coef in (0.05, 0.055, 0.0, torch.tensor(0.06)):
        hidden = torch.randn(2, 21, H, generator=g, requires_grad=True)
        weight = torch.randn(V, H, generator=g, requires_grad=True)
        ids = torch.randint(0, V, (2, 21), generator=g)
        mask = torch.ones(2, 21, dtype=torch.long)
        mod(hidden, weight, ids, mask, torch.randn(2, generator=g), entropy_coef=coef).backward()
        if first:
            graphs, first = dict(counters["stats"]), False
    assert counters["stats"]["unique_graphs"] == graphs["unique_graphs"], counters["stats"]
    assert set(_graphs_per_step(mod).values()) == {1}, _graphs_per_step(mod)
