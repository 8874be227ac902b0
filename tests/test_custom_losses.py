"""Three losses written only against the public contract of ``chunkloss.engine`` (the README quotes them): a
token loss, a pairwise sequence loss and a non-pairwise sequence loss. Each is checked against the same math
on materialised fp64 logits in plain PyTorch: the loss and every gradient, with one-pass and two-pass
chunkings, and the token loss with ``reduction='none'`` under a non-uniform ``grad_output``. Then a loss
author's mistakes (a mean per chunk, the loss without its metrics, a plain method, a per-row record that is
not a ``Rows``, a label out of range in the guide's loss), each caught with one error line; and the metrics
of a call where no row takes part, which read 0."""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from chunkloss.engine import (
    Batch,
    FusedLinearBase,
    FusedOptions,
    Rows,
    Sequences,
    segment_sum,
    sequence_batch,
)
from tests.tolerances import assert_close_to_ref


# --------------------------------------------------------------------------------------------------
# (a) A token loss: focal loss (arXiv:1708.02002), -(1 - p_y)^γ · log p_y per token.
@dataclass(frozen=True)
class FocalOptions(FusedOptions):
    gamma: float = 2.0
    reduction: str = "mean"  # or "none": one loss per token, 0 where the label is ignored


@dataclass
class Labels(Rows):
    labels: Tensor  # (N,) the target of each row


@dataclass
class TokenCount:
    n_tokens: Tensor  # 0-d: the labelled rows (at least 1)


class FusedLinearFocalLoss(FusedLinearBase):
    options_cls = FocalOptions

    @property
    def token_outputs(self):
        # Returned per row with reduction='none'; the engine applies grad_output.
        return ("loss",) if self.options.reduction == "none" else ()

    @staticmethod
    def chunk_loss(logits, extra_logits, token: Labels, scalars: TokenCount, opts):
        logp = logits.float().log_softmax(-1).gather(-1, token.labels[:, None]).squeeze(1)
        loss = -((1 - logp.exp()) ** opts.gamma) * logp
        return loss.sum() / scalars.n_tokens, ({"loss": loss} if opts.reduction == "none" else {})

    def forward(self, hidden, weight, labels):  # hidden (..., H), weight (V, H), labels (...)
        x, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        rows = (y != -100).nonzero().squeeze(1)
        n_tokens = torch.full((), float(max(rows.numel(), 1)), device=x.device)
        batch = Batch(rows=rows, token=Labels(y[rows]), scalars=TokenCount(n_tokens), num_rows=len(y))
        out = self.run(x, weight, None, batch)
        return out.view(labels.shape) if self.token_outputs else out


# --------------------------------------------------------------------------------------------------
# Sequence losses see each row through a few statistics; here the label log-prob.
def label_logprob(logits, extra_logits, token: Labels, opts):
    """(C, 1): log p(label) of each row."""
    return logits.float().log_softmax(-1).gather(-1, token.labels[:, None])


# (b) A pairwise loss: -log σ(β·(log p(chosen) - log p(rejected))), DPO without a reference model.
@dataclass(frozen=True)
class PairOptions(FusedOptions):
    beta: float = 0.1


@dataclass
class PairCount:
    n_pairs: Tensor


class FusedLinearPairLoss(FusedLinearBase):
    options_cls = PairOptions
    seqs_per_group = 2  # a chosen and a rejected sequence share a chunk
    token_stats = staticmethod(label_logprob)

    @staticmethod
    def sequence_loss(stats, seq_id, num_seqs, token, sequence, scalars, opts):
        logps = segment_sum(stats[:, 0], seq_id, num_seqs).view(-1, 2)  # (pairs, [chosen, rejected])
        margin = logps[:, 0] - logps[:, 1]
        loss = -F.logsigmoid(opts.beta * margin).sum() / scalars.n_pairs
        return loss, {"margin": margin.sum() / scalars.n_pairs}

    def forward(self, hidden, weight, labels):  # hidden (2B, T, H): B chosen rows, then B rejected
        n_pairs = hidden.shape[0] // 2
        pair = torch.arange(2 * n_pairs, device=hidden.device) % n_pairs  # sequences g and B + g: pair g
        batch, _ = sequence_batch(
            labels != -100,
            pair,
            token=Labels(labels.clamp(min=0)),
            scalars=PairCount(torch.full((), float(n_pairs), device=hidden.device)),
        )
        return self.run(hidden.reshape(-1, hidden.shape[-1]), weight, None, batch)


# (c) A loss per sequence: minus the average over sequences of each sequence's mean token log-prob.
@dataclass
class SequenceLengths(Sequences):
    n_tokens: Tensor  # (S,) the labelled rows of each sequence


@dataclass
class SequenceCount:
    n_seqs: Tensor


class FusedLinearMeanLogProbLoss(FusedLinearBase):
    seqs_per_group = 1
    token_stats = staticmethod(label_logprob)

    @staticmethod
    def sequence_loss(stats, seq_id, num_seqs, token, sequence, scalars, opts):
        mean_logp = segment_sum(stats[:, 0], seq_id, num_seqs) / sequence.n_tokens.clamp(min=1)
        return -mean_logp.sum() / scalars.n_seqs, {}

    def forward(self, hidden, weight, labels):  # hidden (S, T, H), labels (S, T)
        keep = labels != -100
        n_seqs = hidden.shape[0]
        batch, _ = sequence_batch(
            keep,
            torch.arange(n_seqs, device=hidden.device),  # each sequence its own group
            token=Labels(labels.clamp(min=0)),
            sequence=SequenceLengths(keep.sum(1)),
            scalars=SequenceCount(torch.full((), float(n_seqs), device=hidden.device)),
        )
        return self.run(hidden.reshape(-1, hidden.shape[-1]), weight, None, batch)


# --------------------------------------------------------------------------------------------------
# References: the same math on the materialised logits, in fp64.
def focal_ref(logits, labels, gamma=2.0, reduction="mean"):
    keep = labels != -100
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    loss = torch.where(keep, -((1 - logp.exp()) ** gamma) * logp, 0.0)
    return loss if reduction == "none" else loss.sum() / keep.sum().clamp(min=1)


def seq_logps(logits, labels):
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    keep = labels != -100
    return (logp * keep).sum(-1), keep.sum(-1)


def pair_ref(logits, labels, beta=0.1):
    logps, _ = seq_logps(logits, labels)
    chosen, rejected = logps.chunk(2)
    return -F.logsigmoid(beta * (chosen - rejected)).mean()


def mean_logprob_ref(logits, labels):
    logps, n = seq_logps(logits, labels)
    return -(logps / n.clamp(min=1)).mean()


def inputs(n_seqs, t=7, h=16, v=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_seqs, t, h, generator=g)
    weight = 0.5 * torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n_seqs, t), generator=g)
    labels[:, :2] = -100  # a prompt
    labels[1, 5:] = -100  # and a shorter completion
    return hidden, weight, labels


def run(fn, hidden, weight, grad_output=None):
    """(output, grad_hidden, grad_weight) of ``fn(hidden, weight)`` in the inputs' dtype."""
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fn(hidden, weight)
    out.backward(torch.ones_like(out) if grad_output is None else grad_output.to(out.dtype))
    return out.detach(), hidden.grad, weight.grad


def check(loss_fn, ref_fn, hidden, weight, grad_output=None):
    ours = run(loss_fn, hidden, weight, grad_output)
    ref = run(lambda x, w: ref_fn(x @ w.T), hidden.double(), weight.double(), grad_output)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), ours, ref):
        assert_close_to_ref(a, b, name=name)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("chunk_size", [4, 1000])
def test_token_loss(chunk_size, compile):
    hidden, weight, labels = inputs(3)
    loss = FusedLinearFocalLoss(gamma=2.0, chunk_size=chunk_size, compile=compile)
    check(lambda x, w: loss(x, w, labels), lambda z: focal_ref(z, labels), hidden, weight)


@pytest.mark.parametrize("chunk_size", [4, 1000])
def test_token_loss_per_row_with_grad_output(chunk_size):
    """reduction='none': the loss never sees ``grad_output``; the engine weights each row's gradient by it."""
    hidden, weight, labels = inputs(3)
    grad_output = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) * 3 - 1
    loss = FusedLinearFocalLoss(reduction="none", chunk_size=chunk_size, compile=False)
    ref = lambda z: focal_ref(z, labels, reduction="none")  # noqa: E731
    check(lambda x, w: loss(x, w, labels), ref, hidden, weight, grad_output.double())
    assert loss(hidden, weight, labels)[labels == -100].eq(0).all()


@pytest.mark.parametrize("chunk_size", [4, 1000], ids=["two-pass", "one-pass"])
def test_pairwise_sequence_loss(chunk_size):
    """A chunk of 4 rows holds no whole pair (two passes); one of 1000 rows holds them all (one pass)."""
    hidden, weight, labels = inputs(4)
    loss = FusedLinearPairLoss(beta=0.5, chunk_size=chunk_size, compile=False)
    check(lambda x, w: loss(x, w, labels), lambda z: pair_ref(z, labels, beta=0.5), hidden, weight)
    margin = seq_logps(hidden.double() @ weight.double().T, labels)[0].view(2, 2)
    assert_close_to_ref(loss.metrics["margin"], (margin[0] - margin[1]).mean(), name="margin")


@pytest.mark.parametrize("chunk_size", [4, 1000], ids=["two-pass", "one-pass"])
def test_sequence_loss(chunk_size):
    hidden, weight, labels = inputs(3)
    loss = FusedLinearMeanLogProbLoss(chunk_size=chunk_size, compile=False)
    check(lambda x, w: loss(x, w, labels), lambda z: mean_logprob_ref(z, labels), hidden, weight)


@pytest.mark.parametrize(
    "make, n_seqs",
    [(FusedLinearPairLoss, 2), (FusedLinearMeanLogProbLoss, 3)],
    ids=["pairwise", "per-sequence"],
)
def test_sequence_losses_compiled(make, n_seqs):
    hidden, weight, labels = inputs(n_seqs)
    ref_fn = pair_ref if make is FusedLinearPairLoss else mean_logprob_ref
    ref = lambda z: ref_fn(z, labels)  # noqa: E731
    for chunk_size in (4, 1000):
        check(lambda x, w: make(chunk_size=chunk_size)(x, w, labels), ref, hidden, weight)


# --------------------------------------------------------------------------------------------------
# A loss author's mistakes: each one is one clear error line, raised before the engine trips over it.
@dataclass(frozen=True)
class MistakeOptions(FocalOptions):
    mean: bool = False  # the mistake: a mean over the chunk's rows in place of a sum over a batch count


def focal_rows(logits, token: Labels):
    logp = logits.float().log_softmax(-1).gather(-1, token.labels[:, None]).squeeze(1)
    return -((1 - logp.exp()) ** 2) * logp


def new_token_loss(chunk_loss, name="FusedLinearUserLoss"):
    """A new token loss class (each checked on its own first call) with the focal loss's ``forward``."""
    return type(name, (FusedLinearFocalLoss,), {"options_cls": MistakeOptions, "chunk_loss": chunk_loss})


@staticmethod
def mean_chunk_loss(logits, extra_logits, token, scalars, opts):
    loss = focal_rows(logits, token)
    if opts.mean:
        return loss.mean(), {}
    return loss.sum() / scalars.n_tokens, {}


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_mean_over_the_chunk_is_refused(compile):
    """``.mean()`` per chunk adds up one mean per chunk (8 chunks of 16 rows here); the first call says so."""
    hidden, weight, labels = inputs(4, t=40)
    loss = new_token_loss(mean_chunk_loss)(mean=True, chunk_size=16, compile=compile)
    with pytest.raises(
        ValueError, match=r"^FusedLinearUserLoss.chunk_loss must return a sum over the chunk's "
    ):
        loss(hidden, weight, labels)
    with pytest.raises(ValueError, match="not a mean"):  # still, on the next call
        loss(hidden, weight, labels)


def test_a_mean_metric_is_refused():
    @staticmethod
    def chunk_loss(logits, extra_logits, token, scalars, opts):
        loss = focal_rows(logits, token)
        return loss.sum() / scalars.n_tokens, {"focal": loss.mean()}

    hidden, weight, labels = inputs(3)
    with pytest.raises(ValueError, match=r"chunk_loss's metric 'focal' must return a sum .* not a mean"):
        new_token_loss(chunk_loss)(chunk_size=4, compile=False)(hidden, weight, labels)


def test_the_sum_check_runs_once_per_class_or_every_call(monkeypatch):
    """A class passes on its first call and is not checked again; ``CHUNKLOSS_CHECK_EVERY_CALL=1`` checks
    every call (here, an instance whose options turn the mean on)."""
    hidden, weight, labels = inputs(3)
    cls = new_token_loss(mean_chunk_loss)
    right = cls(chunk_size=4, compile=False)(hidden, weight, labels)
    assert_close_to_ref(right, focal_ref(hidden.double() @ weight.double().T, labels), name="loss")
    wrong = cls(mean=True, chunk_size=4, compile=False)
    assert wrong(hidden, weight, labels) > 2 * right  # unchecked: several chunks' means added up
    monkeypatch.setenv("CHUNKLOSS_CHECK_EVERY_CALL", "1")
    with pytest.raises(ValueError, match="not a mean"):
        wrong(hidden, weight, labels)


def test_a_mean_over_sequences_is_refused():
    class MeanOverSequences(FusedLinearMeanLogProbLoss):
        @staticmethod
        def sequence_loss(stats, seq_id, num_seqs, token, sequence, scalars, opts):
            mean_logp = segment_sum(stats[:, 0], seq_id, num_seqs) / sequence.n_tokens.clamp(min=1)
            return -mean_logp.mean(), {}

    hidden, weight, labels = inputs(3)
    match = r"^MeanOverSequences.sequence_loss must return a sum over its sequences .* not a mean"
    with pytest.raises(ValueError, match=match):
        MeanOverSequences(chunk_size=1000, compile=False)(hidden, weight, labels)


def guide_block() -> str:
    """The first Python block of docs/writing-a-loss.md (the token loss)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "writing-a-loss.md").read_text()
    return re.search(r"^```python\n(.*?)^```$", text, flags=re.M | re.S).group(1)


def test_the_guides_loss_names_a_label_out_of_range(monkeypatch):
    module = types.ModuleType("guide_block")  # as a script runs: a registered module for its dataclasses
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(guide_block(), "writing-a-loss.md", "exec"), module.__dict__)
    hidden, weight = torch.randn(2, 8, 64), torch.randn(100, 64)
    labels = torch.randint(0, 100, (2, 8))
    labels[1, 3] = 100  # V: one past the vocabulary
    with pytest.raises(ValueError, match=r"^labels holds 100, outside \[0, 100\) and not ignore_index=-100$"):
        module.FusedLinearFocalLoss(compile=False)(hidden, weight, labels)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_returning_the_loss_alone_is_named(compile):
    @staticmethod
    def chunk_loss(logits, extra_logits, token, scalars, opts):
        return focal_rows(logits, token).sum() / scalars.n_tokens

    hidden, weight, labels = inputs(3)
    match = r"^FusedLinearUserLoss.chunk_loss must return \(loss, metrics\): .*, got a Tensor$"
    with pytest.raises(TypeError, match=match):
        new_token_loss(chunk_loss)(chunk_size=4, compile=compile)(hidden, weight, labels)


def test_a_sequence_loss_returning_the_loss_alone_is_named():
    class LossAlone(FusedLinearPairLoss):
        @staticmethod
        def sequence_loss(stats, seq_id, num_seqs, token, sequence, scalars, opts):
            return FusedLinearPairLoss.sequence_loss(stats, seq_id, num_seqs, token, sequence, scalars, opts)[
                0
            ]

    hidden, weight, labels = inputs(4)
    for chunk_size in (4, 1000):  # two passes, then one
        with pytest.raises(TypeError, match=r"^LossAlone.sequence_loss must return \(loss, metrics\)"):
            LossAlone(chunk_size=chunk_size, compile=False)(hidden, weight, labels)


@pytest.mark.parametrize("name", ["chunk_loss", "token_stats", "sequence_loss", "extra_token_stats"])
def test_a_per_chunk_method_without_staticmethod_is_refused_at_class_definition(name):
    def method(self, *args):
        return None

    with pytest.raises(
        TypeError, match=rf"^Forgetful.{name} must be a @staticmethod: the engine calls it as"
    ):
        type("Forgetful", (FusedLinearBase,), {name: method})


@dataclass
class PlainLabels:  # the mistake: not a Rows
    labels: Tensor


class UndeclaredLabels(Rows):  # the mistake: no @dataclass, so `labels` is no field the engine indexes
    def __init__(self, labels):
        super().__init__()
        self.labels = labels


@pytest.mark.parametrize(
    "token, match",
    [
        (lambda y, rows: PlainLabels(y[rows]), r"^Batch.token must be a dataclass subclassing .*Rows"),
        (lambda y, rows: UndeclaredLabels(y[rows]), r"^UndeclaredLabels.labels is not a dataclass field"),
        (lambda y, rows: Labels(y.tolist()), r"^Labels.labels must be a tensor or None, got list$"),
        (lambda y, rows: Labels(y), r"^Labels.labels has shape \(21,\), but Batch.rows has 13 rows"),
    ],
    ids=["not-rows", "no-dataclass", "not-a-tensor", "not-restricted-to-rows"],
)
def test_a_per_row_record_is_checked_when_the_batch_is_built(token, match):
    hidden, weight, labels = inputs(3)
    y = labels.reshape(-1)
    rows = (y != -100).nonzero().squeeze(1)
    with pytest.raises((TypeError, ValueError), match=match):
        Batch(rows=rows, token=token(y, rows))


def test_sequence_batch_checks_its_records():
    keep = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"^sequence_batch's token must be a dataclass subclassing .*Rows"):
        sequence_batch(keep, torch.arange(2), token=PlainLabels(torch.zeros(2, 3, dtype=torch.long)))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_metrics_read_zero_when_no_row_takes_part(reduction):
    @staticmethod
    def chunk_loss(logits, extra_logits, token, scalars, opts):
        loss = focal_rows(logits, token)
        metrics = {
            "n_tokens": torch.ones_like(loss).sum(),
            "per_class": torch.zeros(3).index_add(0, token.labels % 3, loss),
        }
        return loss.sum() / scalars.n_tokens, metrics | ({"loss": loss} if opts.reduction == "none" else {})

    cls = type("MetricsLoss", (FusedLinearFocalLoss,), {"chunk_loss": chunk_loss})
    hidden, weight, labels = inputs(3)
    loss = cls(reduction=reduction, chunk_size=4, compile=False)
    loss(hidden, weight, labels)
    assert sorted(loss.metrics) == ["n_tokens", "per_class"] and loss.metrics["n_tokens"] == 13
    out = loss(hidden, weight, torch.full_like(labels, -100))
    assert out.eq(0).all()
    assert sorted(loss.metrics) == ["n_tokens", "per_class"]
    assert loss.metrics["n_tokens"].eq(0) and loss.metrics["per_class"].eq(0).all()
    assert loss.metrics["per_class"].shape == (3,)


def test_a_missing_per_row_output_is_named():
    @staticmethod
    def chunk_loss(logits, extra_logits, token, scalars, opts):
        return focal_rows(logits, token).sum() / scalars.n_tokens, {}  # reduction='none' wants {"loss": ...}

    hidden, weight, labels = inputs(3)
    match = (
        r"^FusedLinearUserLoss.chunk_loss must return the per-row output 'loss' \(named in token_outputs\)"
    )
    with pytest.raises(ValueError, match=match):
        new_token_loss(chunk_loss)(reduction="none", compile=False)(hidden, weight, labels)
