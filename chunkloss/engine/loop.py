"""The chunk loop: project a chunk of rows, run the loss's step on its logits, turn ``dL/dlogits`` into the
gradients, drop the logits::

    logits_c     = x_c @ W.T (+ b)            # GEMM 1 (forward)
    grad_x[c]    = g_c @ W                    # GEMM 2, written into a preallocated buffer
    grad_W      += g_c.T @ x_c                # GEMM 3, accumulated (fp32 by default, see weight_grad.py)
    grad_b      += g_c.sum(0)

A token loss runs one pass of that (:meth:`ChunkLoop.token_pass`). A sequence loss whose groups fit the
chunks runs one pass too (:meth:`ChunkLoop.one_pass`): statistics, ``sequence_loss`` on the chunk's whole
sequences, and the pull-back of ``dL/dstats`` to the same logits. Otherwise it takes two passes
(:meth:`ChunkLoop.two_passes`): pass 1 projects every chunk for its statistics, the loss runs over the whole
batch, and pass 2 projects the rows again for the gradient. docs/design.md, "One pass or two".

Heads without grad (a reference model, a teacher) ride along: their logits for the same rows are projected
in the same chunk and handed to the loss as ``extra_logits``, or reduced at once by ``extra_token_stats``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from chunkloss._compat import torch as torch_compat
from chunkloss.engine.batch import Batch
from chunkloss.engine.contract import (
    LossContract,
    check_chunk_loss,
    check_due,
    check_sequence_loss,
    loss_and_metrics,
)
from chunkloss.engine.plan import chunk_rows, even_bounds, one_pass_possible, plan_chunks
from chunkloss.engine.steps import StepKind, step_for
from chunkloss.engine.weight_grad import WeightGrad

__all__ = ["ChunkLoop", "project_head"]


def project_head(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T (+ bias)``: every projection of the loop (a chunk's logits, an extra head's)."""
    return torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()


class ChunkLoop:
    """One call of the chunk loop.

    Args:
        loss: the loss module (its per-chunk steps, options and pass hooks).
        hidden, weight, bias: the head, ``hidden`` (N, H) flattened.
        batch: the rows that take part and their tensors.
        need: whether ``(hidden, weight, bias)`` need a gradient.
        row_weight: the backward of a per-row output (``token_outputs``): ``grad_output`` of the rows that
            take part (N_valid,); the loop then computes only the gradients of ``Σ_i row_weight_i·out_i``.
    """

    def __init__(self, loss: LossContract, hidden, weight, bias, batch: Batch, need, row_weight=None):
        self.mod, self.opts, self.batch = loss, loss.options, batch
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.need_h, self.need_w, self.need_b = need
        self.any_grad = any(need)
        self.row_weight = row_weight
        self.n_rows = batch.rows.numel()
        self.dev = hidden.device.type
        self.accum = self.opts.accum_dtype or weight.dtype
        # Every row is written when all rows take part; otherwise dropped rows keep a zero gradient.
        new_grad_h = torch.empty if batch.all_rows else torch.zeros
        self.grad_h = None
        if self.need_h:
            self.grad_h = new_grad_h(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        self.grad_w = WeightGrad(weight, self.accum) if self.need_w else None
        self.grad_b = torch.zeros(bias.shape, dtype=self.accum, device=bias.device) if self.need_b else None
        self.loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        self.metrics: dict[str, Tensor] = {}
        outputs = loss.token_outputs if row_weight is None else ()
        self.token_out = {
            k: torch.zeros(batch.num_rows, dtype=torch.float32, device=hidden.device) for k in outputs
        }
        # Where one pass is possible, one chunk of every row runs in one pass and is the loop's only
        # weight-gradient contribution; two passes may contribute twice.
        self.chunk = chunk_rows(
            loss,
            weight,
            hidden,
            batch.extra,
            fp32_grad_w=self.need_w and self.accum == torch.float32,
            whole=self.n_rows if one_pass_possible(loss, batch) else 0,
        )
        self.plan, self.is_one_pass = plan_chunks(loss, batch, self.n_rows, self.chunk)
        # Rows in natural order with nothing dropped: chunks are slices (rows=None), no gather/scatter copies.
        # Otherwise ``rows`` holds the flattened hidden's row of each position, and chunk [a, b) gathers them.
        self.rows_all = None if batch.all_rows else batch.rows
        self.reduce_extra = loss.extra_token_stats is not None and bool(batch.extra)
        self.extra_stats_parts: list[Tensor] = []
        # The contract's check (``contract.check_due``): on the first chunk (token loss) or the first call of
        # ``sequence_loss``; not in the backward of a per-row output, whose forward ran it.
        self.check = row_weight is None and check_due(loss)

    def step(self, kind: StepKind):
        return step_for(self.mod, kind, self.dev)

    def run(self):
        """Returns ``(output, (grad_hidden, grad_weight, grad_bias), metrics)``: the loss (0-d) or the per-row
        output (N,), and the gradients in their inputs' dtypes (None where not needed)."""
        # No saved-tensor hooks (activation offloading's, a checkpoint's) inside: the loop keeps nothing for
        # autograd beyond its call (its gradients come out of the forward), and ``torch.func``'s transforms,
        # which the eager steps use, refuse to run under such hooks.
        with torch.no_grad(), torch_compat.no_saved_tensor_hooks():
            if not self.mod.is_sequence_loss:
                self.token_pass()
            elif self.is_one_pass:
                self.one_pass()
            else:
                self.two_passes()
        # The gradients leave in the parameters' dtype: an fp32 accumulator would otherwise stay alive, at
        # twice the size, from here until the backward reaches the head, i.e. across the model's activation
        # peak.
        grad_w = self.grad_w.finish() if self.need_w else None
        grad_b = self.grad_b.to(self.bias.dtype) if self.need_b else None
        out = next(iter(self.token_out.values())) if self.token_out else self.loss
        return out, (self.grad_h, grad_w, grad_b), self.metrics

    # ----------------------------------------------------------------------------------------------
    # One chunk.
    def gather(self, h: Tensor, rows: Tensor | None, a: int, b: int) -> Tensor:
        return h[a:b] if rows is None else h.index_select(0, rows[a:b])

    def project(self, rows, a, b, token, extra_stats=None):
        """(x, logits, extra_logits, token) of positions [a, b); the extra heads are reduced first when the
        loss can, or their statistics from the first pass come in as ``extra_stats`` (no projection)."""
        batch = self.batch
        if self.reduce_extra:
            if extra_stats is None:
                extra = [
                    project_head(self.gather(e.hidden, rows, a, b), e.weight, e.bias) for e in batch.extra
                ]
                self.extra_stats_parts.append(self.mod.extra_token_stats(extra, token, self.opts))
                del extra
                token = dataclasses.replace(token, extra_stats=self.extra_stats_parts[-1])
            else:
                token = dataclasses.replace(token, extra_stats=extra_stats[a:b])
            extra = []
        else:
            extra = [project_head(self.gather(e.hidden, rows, a, b), e.weight, e.bias) for e in batch.extra]
        x = self.gather(self.hidden, rows, a, b)
        return x, project_head(x, self.weight, self.bias), extra, token

    def backprop(self, g, x, rows, a, b, add=False, last=False):
        """Gradients of positions [a, b) from their logits gradient ``g``; ``add``: onto the hidden rows'
        gradient from pass 1 rather than over it; ``last``: the loop's last weight-gradient contribution."""
        if self.need_w:
            self.grad_w.add(g, x, last)
        if self.need_b:
            self.grad_b.add_(g.sum(0, dtype=self.accum))
        if self.need_h:
            grad_h, weight = self.grad_h, self.weight
            if rows is None:
                if add:
                    grad_h[a:b].addmm_(g, weight)
                else:
                    torch.mm(g, weight, out=grad_h[a:b])
                return
            # x is the chunk's gathered copy and the weight gradient has read it (same stream): the rows'
            # hidden gradient goes into its buffer rather than into a new (C, H) tensor.
            dx = torch.mm(g, weight, out=x) if x.dtype == g.dtype and x.is_contiguous() else g @ weight
            if add:
                grad_h.index_add_(0, rows[a:b], dx)
            else:
                grad_h.index_copy_(0, rows[a:b], dx)

    def add_metrics(self, m):
        for k, v in m.items():
            if k in self.token_out:
                continue
            self.metrics[k] = self.metrics[k] + v.float() if k in self.metrics else v.float()

    def sequence_coef(self, stats, seq_id, num_seqs, token, sequence, scalars=None):
        """Run ``sequence_loss`` on the rows' statistics (adding its loss and metrics) and return
        ``dL/dstats``, the per-row coefficient the pointwise step pulls back to the logits (None without
        grads)."""
        scalars = self.batch.scalars if scalars is None else scalars
        if self.check:
            self.check = False
            check_sequence_loss(self.mod, stats, seq_id, num_seqs, token, sequence, scalars)
        coef, loss, m = self.step(StepKind.SEQ_COEF)(
            stats, seq_id, num_seqs, token, sequence, scalars, need_grad=self.any_grad
        )
        self.loss.add_(loss)
        self.add_metrics(m)
        return coef

    def one_pass_chunk(self, a, b, token, coef_of, last=False):
        """Positions [a, b) in one pass: project, the ``STATS`` step, the coefficient
        ``coef_of(stats, token)`` (None without grads), and the ``SEQ_PASS2`` step on the same logits with
        what the stats step carried over (e.g. their logsumexp); returns the chunk's statistics. ``last``: as
        for :meth:`backprop`."""
        x, logits, extra, token = self.project(self.rows_all, a, b, token)
        stats, carry = _stats_and_carry(self.step(StepKind.STATS)(logits, extra, token))
        coef = coef_of(stats, token)
        if coef is not None:
            args = (coef,) if carry is None else (coef, carry)
            g = self.step(StepKind.SEQ_PASS2)(logits, extra, token, *args)
            self.backprop(g, x, self.rows_all, a, b, last=last)
        del x, logits, extra, carry  # free this chunk's [C, V] buffer before the next is projected
        return stats

    # ----------------------------------------------------------------------------------------------
    # The passes.
    def token_pass(self):
        """A token loss: each chunk's step gives its gradient (``TOKEN``), its value alone (``TOKEN_VALUE``),
        or, for the backward of a per-row output, the gradient weighted by ``row_weight`` (``TOKEN_ROWS``)."""
        batch, weighted = self.batch, self.row_weight is not None
        kind = StepKind.TOKEN_ROWS if weighted else StepKind.TOKEN if self.any_grad else StepKind.TOKEN_VALUE
        step = self.step(kind)
        for a, b in self.plan.bounds:
            x, logits, extra, token = self.project(self.rows_all, a, b, batch.token[a:b])
            if self.check:
                self.check = False
                check_chunk_loss(self.mod, logits, extra, token, batch.scalars)
            if weighted:
                g = step(logits, extra, token, batch.scalars, self.row_weight[a:b])
            else:
                g, loss, m = step(logits, extra, token, batch.scalars)
                self.loss += loss
                self.add_metrics(m)
                for k, out in self.token_out.items():
                    out.index_copy_(0, batch.rows[a:b], m[k].float())
            if self.any_grad:
                self.backprop(g, x, self.rows_all, a, b, last=b == self.n_rows)
            del x, logits, extra, g  # free this chunk's [C, V] buffer before the next is projected
        if not self.n_rows and not weighted:
            self.metrics = self.zero_metrics()

    def zero_metrics(self) -> dict[str, Tensor]:
        """A token loss's metrics when no row takes part: each metric ``chunk_loss`` returns (on zero rows,
        eagerly), as zeros. Per-row outputs are left out, as with rows."""
        _, logits, extra, token = self.project(self.rows_all, 0, 0, self.batch.token[0:0])
        fn = type(self.mod).chunk_loss
        metrics = loss_and_metrics(fn(logits, extra, token, self.batch.scalars, self.opts), fn)[1]
        return {
            k: torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for k, v in metrics.items()
            if k not in self.mod.token_outputs
        }

    def one_pass(self):
        """A sequence loss whose chunks hold whole groups: ``sequence_loss`` on each chunk's sequences."""
        batch = self.batch
        for (a, b), (s0, s1) in zip(self.plan.bounds, self.plan.seq_bounds):

            def coef_of(stats, token, a=a, b=b, s0=s0, s1=s1):
                seq_id, sequence = batch.seq_id[a:b] - s0, batch.sequence[s0:s1]
                return self.sequence_coef(stats, seq_id, s1 - s0, token, sequence)

            self.one_pass_chunk(a, b, batch.token[a:b], coef_of, last=b == self.n_rows)

    def two_passes(self):
        """A sequence loss over the whole batch. Either every chunk runs its backward in pass 1 with
        estimated scalars (``pass_1_estimates``), or the last rows [n_rest, n_rows) do with coefficient
        m·e_col (``rows_in_pass_1``) and pass 2 covers rows [0, n_rest) only."""
        batch, mod = self.batch, self.mod
        estimate = mod.pass_1_estimates(batch) if self.any_grad else None
        deferred = mod.rows_in_pass_1(batch) if self.any_grad and estimate is None else None
        col, n_def, mult = deferred if deferred is not None else (None, 0, None)
        n_rest = self.n_rows - n_def
        parts, guesses = [], []  # statistics of pass 1's chunks; their coefficients with estimates
        if estimate is not None:
            self._pass_1_with_estimates(estimate, parts, guesses)
        else:
            for a, b in even_bounds(n_rest, self.chunk):
                _, logits, extra, token = self.project(self.rows_all, a, b, batch.token[a:b])
                parts.append(_stats_and_carry(self.step(StepKind.STATS)(logits, extra, token))[0])
                del logits, extra  # (no carry: pass 2 projects other logits)
        if n_def:
            self._pass_1_deferred(n_rest, n_def, col, mult, parts)
        stats = torch.cat(parts) if parts else _empty_stats(mod, self.hidden, self.weight, batch)
        extra_stats = torch.cat(self.extra_stats_parts) if self.extra_stats_parts else None
        # With guesses, the final scalars (the ones ``sequence_loss`` computes) go in too: the same step and
        # graph as the guesses, so a row whose coefficient did not change gets the guess bit for bit
        # (coefficients are per row) and pass 2 projects only the changed rows.
        scalars = dataclasses.replace(batch.scalars, **estimate(parts)) if guesses else batch.scalars
        coef = self.sequence_coef(stats, batch.seq_id, batch.num_seqs, batch.token, batch.sequence, scalars)
        if guesses:
            coef = coef - torch.cat(guesses)
        if coef is not None and n_def:
            # Each deferred row's coefficient is λ·m·e_col: its gradients so far are λ = 1's.
            lam = coef[self.n_rows - 1, col] / mult[-1]
            _scale_rows(self.grad_h, self.rows_all, n_rest, self.n_rows, lam)
            if self.need_w:
                self.grad_w.scale(lam)
            if self.need_b:
                self.grad_b.mul_(lam)
            coef = coef[:n_rest]
            extra_stats = None if extra_stats is None else extra_stats[:n_rest]
        if coef is not None and n_rest:  # none left when the last rows were all of them (one long pair)
            self._pass_2(coef, n_rest, extra_stats, add=bool(guesses))

    def _pass_1_with_estimates(self, estimate, parts, guesses):
        """Pass 1 where every chunk runs its backward with the coefficients of ``sequence_loss`` on the chunk
        alone, the batch's scalars estimated from the statistics so far."""
        batch = self.batch
        for a, b in even_bounds(self.n_rows, self.chunk):

            def guess(stats, token, a=a, b=b):
                # The per-row tensors without the extra heads' reduced statistics, as in the final call: one
                # step, one graph.
                token = dataclasses.replace(token, extra_stats=None)
                scalars = dataclasses.replace(batch.scalars, **estimate([*parts, stats]))
                coef, _, _ = self.step(StepKind.SEQ_COEF)(
                    stats, batch.seq_id[a:b], batch.num_seqs, token, batch.sequence, scalars, need_grad=True
                )
                guesses.append(coef)
                return coef

            parts.append(self.one_pass_chunk(a, b, batch.token[a:b], guess))

    def _pass_1_deferred(self, n_rest, n_def, col, mult, parts):
        """Pass 1 of the last ``n_def`` rows, with their backward at coefficient ``mult·e_col`` (λ = 1)."""
        # Its per-row tensors start at offset 0, as pass 2's do: a compiled step specialises on it.
        token_def = self.batch.token.map(lambda v: v[n_rest:].clone())
        for a, b in even_bounds(n_def, self.chunk):

            def unit(stats, token, a=a, b=b):
                coef = torch.zeros_like(stats)
                coef[:, col] = mult[a:b]
                return coef

            parts.append(self.one_pass_chunk(n_rest + a, n_rest + b, token_def[a:b], unit))

    def _pass_2(self, coef, n_rest, extra_stats, add):
        """Re-project the rows [0, n_rest) with a gradient and pull ``coef`` back to their logits; ``add``:
        onto pass 1's gradients (the coefficients' change)."""
        batch, rows, token_all = self.batch, self.rows_all, self.batch.token
        # A row whose coefficients are all 0 (an entropy mask keeping the top 20% of tokens drops the other
        # 80%) contributes exactly 0: pass 2 re-projects only the others.
        idx = coef.ne(0).any(1).nonzero().squeeze(1)  # the one host sync of the second pass
        n_live = idx.numel()
        if n_live < n_rest:
            rows, coef = batch.rows[idx], coef[idx]
            token_all = batch.token[idx]
            extra_stats = None if extra_stats is None else extra_stats[idx]
            if self.need_h and batch.all_rows and not add:
                self.grad_h[:n_rest].zero_()  # the skipped rows are not written
        step = self.step(StepKind.SEQ_PASS2)
        for a, b in even_bounds(n_live, self.chunk):
            # Heads without grad are not projected again: their reduced statistics from pass 1 come in as
            # token.extra_stats.
            x, logits, extra, token = self.project(rows, a, b, token_all[a:b], extra_stats)
            self.backprop(step(logits, extra, token, coef[a:b]), x, rows, a, b, add, last=b == n_live)
            del x, logits, extra  # free this chunk's [C, V] buffer before the next is projected


def _scale_rows(grad_h: Tensor | None, rows: Tensor | None, a: int, b: int, lam: Tensor) -> None:
    """``grad_h`` of positions [a, b) (hidden rows ``rows[a:b]``, or rows a..b with ``rows`` None) times λ."""
    if grad_h is None or a == b:
        return
    if rows is None:
        grad_h[a:b].mul_(lam)
    else:
        r = rows[a:b]
        grad_h.index_copy_(0, r, grad_h.index_select(0, r).mul_(lam))


def _stats_and_carry(out) -> tuple[Tensor, object]:
    """A ``STATS`` step returns the rows' statistics, or ``(statistics, carry)``: ``carry`` is handed to the
    ``SEQ_PASS2`` step of the same chunk in one pass, on the same logits (two passes drop it)."""
    return out if isinstance(out, tuple) else (out, None)


def _empty_stats(loss_mod, hidden, weight, batch) -> Tensor:
    """Statistics of zero rows, with the loss's own width (evaluated on a 1-row dummy)."""
    dummy = torch.zeros(1, weight.shape[0], dtype=torch.float32, device=hidden.device)
    extra = [
        torch.zeros(1, e.weight.shape[0], dtype=torch.float32, device=hidden.device) for e in batch.extra
    ]
    token = batch.token.map(lambda v: v.new_zeros((1, *v.shape[1:])))
    if loss_mod.extra_token_stats is not None and extra:
        stats = type(loss_mod).extra_token_stats(extra, token, loss_mod.options)
        token, extra = dataclasses.replace(token, extra_stats=stats), []
    width = type(loss_mod).token_stats(dummy, extra, token, loss_mod.options).shape[1]
    return torch.zeros(0, width, dtype=torch.float32, device=hidden.device)
