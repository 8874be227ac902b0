"""Chunk planning: how many rows a chunk holds, where the chunks start and end, and whether a sequence loss
runs in one pass or two (docs/design.md, "Chunk size" and "One pass or two")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from chunkloss.engine.batch import Batch, ExtraHead
from chunkloss.engine.contract import LossContract
from chunkloss.engine.options import default_chunk_size
from chunkloss.engine.steps import step_upcasts_extra

__all__ = ["ONE_CHUNK_DEVICES", "Plan", "chunk_rows", "even_bounds", "one_pass_possible", "plan_chunks"]

#: Devices where one chunk's weight gradient is one GEMM into the weight's dtype (no fp32 copies), so that
#: :func:`chunk_rows` may take a call's rows as one chunk in the fp32 accumulator's memory. "meta" for
#: shape-only checks.
ONE_CHUNK_DEVICES = ("cuda", "meta")


def chunk_rows(
    loss: LossContract,
    weight: Tensor,
    hidden: Tensor,
    extra: list[ExtraHead] = (),
    fp32_grad_w: bool = False,
    whole: int = 0,
) -> int:
    """Rows per chunk: ``chunk_size``, or as many as ``logits_budget_mb`` holds.

    With an fp32 weight-gradient accumulator (``fp32_grad_w``) the backward holds the accumulator and its
    cast to the weight's dtype at once, so a chunk whose logits take no more than that cast's V·H bytes
    leaves the step's peak where it is; the loss then takes that larger budget, with the logits of extra
    heads (a teacher) counted twice where the step makes an fp32 copy of them
    (``chunkloss.engine.steps.step_upcasts_extra``). Sequence losses take it too: automatic chunks run them
    in two passes, each holding one [C, V] tensor.

    ``whole``: the call's rows, when one chunk of them all would be the loop's only weight-gradient
    contribution (a token loss, or a sequence loss that then runs in one pass); 0 otherwise. One chunk needs
    no fp32 accumulator of a bf16/fp16 weight: on CUDA its GEMM writes the weight's dtype. So up to the rows
    whose logits take the accumulator's 4·V·H bytes, one chunk holds no more memory than chunks of the budget
    above plus the accumulator, and saves the accumulator's reads, writes and cast (:data:`ONE_CHUNK_DEVICES`;
    on CPU that GEMM goes through fp32 copies of its operands: the rule is off).
    """
    opts = loss.options
    if opts.chunk_size is not None:
        return opts.chunk_size
    if loss.extra_token_stats is not None:
        # Each extra head's logits are reduced and freed before the next projection.
        extra_vocab = max([e.weight.shape[0] - weight.shape[0] for e in extra] + [0])
    else:
        extra_vocab = sum(e.weight.shape[0] for e in extra)
    budget = opts.logits_budget_mb
    v, itemsize = weight.shape[0], hidden.element_size()
    if fp32_grad_w and opts.compile:
        budget = max(budget, weight.numel() * weight.element_size() // 2**20)
        if step_upcasts_extra(loss, hidden.device.type):
            extra_vocab *= 2
    rows = default_chunk_size(v, itemsize, budget, extra_vocab, grad_in_place=opts.compile)
    one_gemm = hidden.device.type in ONE_CHUNK_DEVICES and weight.dtype in (torch.bfloat16, torch.float16)
    if fp32_grad_w and opts.compile and one_gemm and whole > rows:
        acc_mb = weight.numel() * 4 // 2**20
        if whole <= default_chunk_size(v, itemsize, acc_mb, extra_vocab, grad_in_place=True):
            return whole
    return rows


@dataclass
class Plan:
    """Chunk boundaries over ``batch.rows`` and, for one-pass sequence losses, the sequences each
    chunk holds."""

    bounds: list[tuple[int, int]]
    seq_bounds: list[tuple[int, int]] | None = None  # sequences [s0, s1) of each chunk


def one_pass_possible(loss: LossContract, batch: Batch) -> bool:
    """Whether the loss can run in one pass given chunks that hold whole groups: a token loss always; a
    sequence loss when it needs no batch-wide statistics first and the batch carries its group sizes."""
    if not loss.is_sequence_loss:
        return True
    return not (loss.needs_global_stats or batch.tokens_per_group is None or batch.seqs_per_group is None)


def plan_chunks(loss: LossContract, batch: Batch, n_rows: int, chunk: int) -> tuple[Plan, bool]:
    """Chunk boundaries, and whether a sequence loss runs in one pass: where every group fits a chunk, chunks
    hold whole groups (packed greedily, each ending on a group boundary) and the loss runs in one pass."""
    if not loss.is_sequence_loss:
        return Plan(even_bounds(n_rows, chunk)), True
    counts = batch.tokens_per_group
    if not one_pass_possible(loss, batch) or n_rows == 0 or max(counts) > chunk:
        return Plan(even_bounds(n_rows, chunk)), False
    bounds, seq_bounds = [], []
    r0 = r = s0 = s = 0
    for n_tok, n_seq in zip(counts, batch.seqs_per_group):
        if r + n_tok - r0 > chunk:
            bounds.append((r0, r))
            seq_bounds.append((s0, s))
            r0, s0 = r, s
        r += n_tok
        s += n_seq
    bounds.append((r0, r))
    seq_bounds.append((s0, s))
    return Plan(bounds, seq_bounds), True


def even_bounds(n_rows: int, chunk: int) -> list[tuple[int, int]]:
    """At most ``chunk`` rows per chunk, in as few chunks as possible, of nearly equal size (multiples of
    128 where the chunk allows it) rather than full chunks and a small tail that runs the GEMMs badly."""
    if n_rows == 0:
        return []
    n_chunks = -(-n_rows // chunk)
    size = -(-n_rows // n_chunks)
    if chunk >= 128:
        size = min(chunk, -(-size // 128) * 128)
    return [(s, min(s + size, n_rows)) for s in range(0, n_rows, size)]
