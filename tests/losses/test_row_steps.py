"""The CUDA steps of the GRPO and preference losses (Triton row kernels of ``chunkloss.kernels.logprob``, the
loss on (C,) statistics in between) and of the JSD loss (``chunkloss.kernels.jsd``) through the whole engine,
against the same fp32 references as the compiled and eager steps.

On CUDA these steps are what ``compile=True`` runs (``tests/losses/test_*_gpu.py``). Here, on CPU, the kernels
run through TRITON_INTERPRET=1 and the steps are put in place of the compiled ones by hand, at the small odd
shapes of ``test_grpo.py`` and ``test_preference.py``: token path, one-pass and two-pass sequence paths, every
GRPO loss type and importance-sampling level, KL from precomputed log-probs and from a reference head, the
entropy bonus (token, one- and two-pass sequence paths) and mask, the off-policy mask and trainer inputs,
logit transforms (GRPO and the preference losses), every preference loss family, ORPO's own NLL targets and
logits rows, WPO and the token metrics, no-grad calls. Tolerances are those files' own (the kernels differ
from the references in summation order only: measured ≤ 7.6e-6 on entropies and ≤ 5.5e-6 on fp32 logit
gradients, tests/kernels/test_logprob.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from chunkloss.engine import StepKind, compiled
from chunkloss.engine.steps import step_for
from chunkloss.losses import cross_entropy, grpo, jsd
from chunkloss.losses.cpo import FusedLinearCPOLoss
from chunkloss.losses.dpo import FusedLinearDPOLoss
from chunkloss.losses.grpo import LOSS_TYPES, FusedLinearGRPOLoss
from chunkloss.losses.orpo import FusedLinearORPOLoss
from chunkloss.losses.simpo import FusedLinearSimPOLoss
from chunkloss.testing import select_steps
from chunkloss.testing.reference import cpo_ref, dpo_ref, orpo_ref
from tests.child_process import in_child_process
from tests.losses import test_grpo as tg
from tests.losses import test_jsd as tj
from tests.losses import test_preference as tp
from tests.tolerances import assert_close_to_ref

pytestmark = [
    in_child_process,  # Triton's interpreter, CPU-heavy: in the child process beside the suite
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="with a GPU, Triton compiles for it and cannot take these CPU tensors (tests/conftest.py sets "
        "TRITON_INTERPRET=1 only without one); there the same steps run in the *_gpu tests",
    ),
]


# --------------------------------------------------------------------------------------------------
# GRPO
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
def test_grpo_grid(loss_type, level, cuda_steps):
    """Every loss type x IS level; the KL source and the chunk size (one pass or two below the completion
    length on the sequence path) alternate over the grid; old log-probs and on-policy."""
    i = LOSS_TYPES.index(loss_type) + ["token", "sequence", "sequence_token"].index(level)
    kl = ("none", "precomputed", "head")[i % 3]
    chunk = (5, 1000)[i % 2]
    for adv_2d, on_policy in ((False, False), (True, True)):
        inp, kw = tg.make_inputs(adv_2d=adv_2d, ref_head=kl == "head")
        if kl == "none":
            kw = {k: v for k, v in kw.items() if not k.startswith("ref_")}
        if on_policy:
            kw.pop("old_logps")
        opts = tg.grid_opts(loss_type, level, beta=0.0 if kl == "none" else 0.04)
        ours = tg.run_ours(inp, kw, chunk_size=chunk, **dict(opts, compile=True))
        tg.assert_close_fp32(ours, tg.run_ref(inp, kw, opts))


@pytest.mark.parametrize(
    "opts",
    [
        *tg.ENTROPY_OPTIONS,
        dict(loss_type="dapo", beta=0.04, logit_scale=1.7, softcap=2.5, temperature=0.8),
        dict(loss_type="grpo", importance_sampling_level="sequence", softcap=2.5, temperature=0.8),
        # The entropy column's coefficient in the one-pass and two-pass "seq_pass2" step, without the mask.
        dict(loss_type="dapo", importance_sampling_level="sequence", entropy_coef=0.1, beta=0.04),
        dict(loss_type="vespo", entropy_coef=0.05, temperature=1.3),
    ],
    ids=[
        "entropy-mask",
        "entropy-mask-bonus-seq",
        "entropy-bonus",
        "transforms-token",
        "transforms-seq",
        "entropy-bonus-seq",
        "entropy-bonus-vespo",
    ],
)
@pytest.mark.parametrize("chunk", [4, 1000])
def test_grpo_options(opts, chunk, cuda_steps):
    inp, kw = tg.make_inputs(adv_2d=True, ref_head=True)
    opts = dict(opts)
    opts = tg.grid_opts(opts.pop("loss_type"), opts.pop("importance_sampling_level", "token"), **opts)
    ours = tg.run_ours(inp, kw, chunk_size=chunk, **dict(opts, compile=True))
    tg.assert_close_fp32(ours, tg.run_ref(inp, kw, opts))


def test_grpo_bf16(cuda_steps):
    """bf16 against the fp32 reference, with the materialised bf16 torch loss's error as the yardstick."""
    inp, kw = tg.make_inputs(dtype=torch.bfloat16)
    opts = dict(loss_type="dapo", beta=0.04, entropy_coef=0.05, compile=False)
    l32, g32, _ = tg.run_ref(inp, kw, opts)
    lt, gt, _ = tg.run_ref(inp, kw, opts, dtype=torch.bfloat16)
    lo, go, _ = tg.run_ours(inp, kw, chunk_size=7, **dict(opts, compile=True))
    assert_close_to_ref(lo, l32, lt, "loss", dtype=torch.bfloat16)
    for i, (a, b, r) in enumerate(zip(go, gt, g32)):
        assert_close_to_ref(a, r, b, f"grad {i}", dtype=torch.bfloat16)


@pytest.mark.parametrize("level, chunk", [("token", 1000), ("sequence", 1000), ("sequence", 4)])
def test_grpo_no_grad(level, chunk, cuda_steps):
    """The "token_value" step, and the "stats" step alone on the one-pass and two-pass sequence paths (no
    coefficient, no pass 2): the loss without gradients equals the reference."""
    inp, kw = tg.make_inputs()
    opts = tg.grid_opts("dapo", level, beta=0.04, entropy_coef=0.05)
    mod = FusedLinearGRPOLoss(**dict(opts, compile=True, chunk_size=chunk))
    assert step_for(mod, StepKind.TOKEN_VALUE, "cpu").func is grpo.grpo_token  # the fixture took effect
    with torch.no_grad():
        loss = mod(**inp, **kw)
    assert_close_to_ref(loss, tg.run_ref(inp, kw, opts)[0], name="loss")


@pytest.mark.parametrize("opts", list(tg.MORE_OPTIONS.values()), ids=list(tg.MORE_OPTIONS))
def test_grpo_more_options(opts, cuda_steps):
    """test_grpo.py's remaining options (off-policy mask, delta, SAPO temperatures, an entropy quantile of 0)
    through the Triton steps; chunks of 3 (two passes on the sequence path) and 1000."""
    tg.test_options_fp32(opts, adv_2d=False)


@pytest.mark.parametrize("loss_type,isr_shape", [("dapo", "token"), ("vespo", "token")])
def test_grpo_trainer_inputs(loss_type, isr_shape, cuda_steps):
    """vLLM IS ratio, tool mask, sampling log-probs, num_items_in_batch, processes and accumulation."""
    tg.test_trainer_inputs(loss_type, isr_shape)


# --------------------------------------------------------------------------------------------------
# Preference losses (always sequence losses: "stats" and "seq_pass2" steps)
@pytest.mark.parametrize("chunk", [1, tp.TWO_PASS, tp.ONE_PASS])
@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(loss_type=("sigmoid", "bco_pair", "sft"), loss_weights=(1.0, 0.5, 0.3)),
        dict(use_weighting=True, ld_alpha=0.4),
        dict(loss_type="ipo", average_log_prob=True),
    ],
    ids=["sigmoid", "mix-sft", "wpo-ld_alpha", "ipo-avg"],
)
def test_dpo(opts, chunk, cuda_steps):
    d = tp._inputs()
    ours = tp._run(FusedLinearDPOLoss, d, tp._ref_kwargs(d, "model"), chunk_size=chunk, compile=True, **opts)
    tp._check(ours, tp._dpo_ref_call(d, "model", **opts), d)


@pytest.mark.parametrize("chunk", [1, tp.TWO_PASS, tp.ONE_PASS])
@pytest.mark.parametrize("own_nll", [False, True])
def test_orpo(chunk, own_nll, cuda_steps):
    d = tp._inputs(ref=False)
    kw = dict(nll_labels=d["nll"]) if own_nll else {}
    ours = tp._run(FusedLinearORPOLoss, d, kw, chunk_size=chunk, compile=True, beta=0.2, softcap=2.0)
    ref = orpo_ref(d["x"], d["w"], d["chosen"], d["rejected"], d["b"], beta=0.2, softcap=2.0, **kw)
    tp._check(ours, ref, d)


@pytest.mark.parametrize("chunk", [tp.TWO_PASS, tp.ONE_PASS])
def test_cpo_simpo(chunk, cuda_steps):
    d = tp._inputs(ref=False)
    opts = dict(beta=0.2, loss_type="simpo", simpo_gamma=0.7, cpo_alpha=0.5)
    ours = tp._run(FusedLinearCPOLoss, d, None, chunk_size=chunk, compile=True, **opts)
    tp._check(ours, cpo_ref(d["x"], d["w"], d["chosen"], d["rejected"], d["b"], **opts), d)
    ours = tp._run(FusedLinearSimPOLoss, d, None, chunk_size=chunk, compile=True)
    eager = tp._run(FusedLinearSimPOLoss, d, None, chunk_size=chunk, compile=False)
    assert_close_to_ref(ours[0], eager[0])


def test_dpo_token_metrics(cuda_steps):
    """Entropy and top-1 columns (``return_token_metrics``) equal the eager steps'."""
    d = tp._inputs()
    kw = tp._ref_kwargs(d, "model")
    ours = tp._run(FusedLinearDPOLoss, d, kw, chunk_size=tp.TWO_PASS, compile=True, return_token_metrics=True)
    eager = tp._run(  # compile=False: the eager steps
        FusedLinearDPOLoss, d, kw, chunk_size=tp.TWO_PASS, compile=False, return_token_metrics=True
    )
    assert set(ours[2]) == set(eager[2]) and any("entropy" in k for k in ours[2])
    for k in eager[2]:
        assert_close_to_ref(ours[2][k], eager[2][k], name=k)
    for a, b in zip(ours[1], eager[1]):
        assert_close_to_ref(a, b)


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("chunk", [1, tp.ONE_PASS])
def test_preference_transforms_and_token_metrics(case, chunk, cuda_steps):
    """logit_scale and softcap in the "stats" and "seq_pass2" steps (the policy and DPO's reference head),
    the entropy / top-1 columns, WPO, ORPO and CPO's NLL column, an empty completion: test_preference.py's
    own case, through the Triton steps."""
    cases = [
        (FusedLinearDPOLoss, dpo_ref, dict(loss_type="sigmoid", beta=0.3)),
        (FusedLinearDPOLoss, dpo_ref, dict(loss_type=("sigmoid", "sft"), use_weighting=True, beta=0.3)),
        (FusedLinearORPOLoss, orpo_ref, dict(beta=0.2)),
        (FusedLinearCPOLoss, cpo_ref, dict(loss_type="ipo", beta=0.3)),
        (FusedLinearSimPOLoss, cpo_ref, dict(beta=2.0, loss_type="simpo", cpo_alpha=0.0)),
    ]
    tp.test_logit_transforms_and_token_metrics(*cases[case], chunk)


@pytest.mark.parametrize("chunk", [1, tp.ONE_PASS])
def test_orpo_logit_rows_and_no_grad(chunk, cuda_steps):
    """ORPO's logits/* rows beyond the completions (rows with no loss coefficient); then the same loss without
    gradients (the "stats" step alone)."""
    tp.test_orpo_logit_rows(chunk)
    d = tp._inputs(ref=False)
    kw = dict(nll_labels=d["nll"])
    with torch.no_grad():
        loss = FusedLinearORPOLoss(chunk_size=chunk, compile=True, beta=0.2, softcap=2.0)(
            d["x"], d["w"], d["chosen"], d["rejected"], bias=d["b"], **kw
        )
    ref = orpo_ref(d["x"], d["w"], d["chosen"], d["rejected"], d["b"], beta=0.2, softcap=2.0, **kw)[0]
    assert_close_to_ref(loss, ref.detach().float())


# --------------------------------------------------------------------------------------------------
# JSD ("token" step)
@pytest.mark.parametrize("beta", tj.BETAS)
@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(temperature=1.5, weight_hard_loss=0.2),
        dict(reduction="mean", student_softcap=3.0, teacher_logit_scale=0.7, weight_soft_loss=0.5),
    ],
    ids=["plain", "temperature-hard", "mean-transforms"],
)
@pytest.mark.parametrize("chunk", [4, 1000])
def test_jsd(beta, opts, chunk, cuda_steps):
    d = tj._inputs()
    ours = tj._ours(d, beta=beta, chunk_size=chunk, compile=True, **opts)
    tj._assert_close_all(ours, tj._ref(d, beta=beta, **opts))


def test_jsd_accumulation_and_no_grad(cuda_steps):
    """``num_items_in_batch`` reaches the kernel's normaliser; without grad the loss is the compiled one's."""
    d = tj._inputs()
    # The fixture took effect:
    assert step_for(jsd.FusedLinearJSDLoss(), StepKind.TOKEN, "cpu").func is jsd.jsd_token
    tj._assert_close_all(tj._ours(d, 17, beta=0.3, compile=True), tj._ref(d, 17, beta=0.3))
    with torch.no_grad():
        loss = jsd.FusedLinearJSDLoss(beta=0.3)(
            d["x_s"], d["w_s"], d["x_t"], d["w_t"], d["y"], bias=d["b_s"], teacher_bias=d["b_t"]
        )
    assert_close_to_ref(loss, tj._ref(d, beta=0.3)[0].float())


# --------------------------------------------------------------------------------------------------
# Cross-entropy with reduction='none': the forward's "token_value" step and the backward's "token_rows" step
# (the kernel with the rows' grad_output as its per-row weights).
@pytest.mark.parametrize("chunk", [5, 1000])
def test_cross_entropy_per_row_backward(chunk, cuda_steps):
    from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 7, 16, generator=g), 0.5 * torch.randn(37, 16, generator=g)
    y = torch.randint(0, 37, (3, 7), generator=g)
    y[0, :3] = -100
    grad_out = torch.rand(3, 7, generator=g) * 3 - 1
    mod = FusedLinearCrossEntropyLoss(reduction="none", label_smoothing=0.1, chunk_size=chunk)
    assert step_for(mod, StepKind.TOKEN_ROWS, "cpu").func is cross_entropy.cross_entropy_token_rows
    ours = [t.clone().requires_grad_(True) for t in (x, w)]
    ref = [t.double().requires_grad_(True) for t in (x, w)]
    loss = mod(ours[0], ours[1], y)
    loss.backward(grad_out)
    ref_loss = torch.nn.functional.cross_entropy(
        (ref[0] @ ref[1].T).transpose(1, 2), y, reduction="none", label_smoothing=0.1
    )
    ref_loss.backward(grad_out.double())
    assert_close_to_ref(loss, ref_loss, name="loss")
    for name, a, b in zip(("grad_hidden", "grad_weight"), ours, ref):
        assert_close_to_ref(a.grad, b.grad, name=name)


# --------------------------------------------------------------------------------------------------
# One pass hands the statistics of a chunk's logits from its "stats" step to its "seq_pass2" step; so do two
# passes for the chunks of the last rows that run their backward in pass 1 (DPO's; ``rows_in_pass_1``),
# and for no chunk of pass 2.
@pytest.mark.parametrize("loss", ["grpo-sequence", "dpo"])
def test_one_pass_hands_statistics_to_pass_2(loss, cuda_steps, monkeypatch):
    import chunkloss.kernels.logprob as lp

    handed = []
    real = lp.row_grad_

    def row_grad_(*args, lse=None, **kwargs):
        handed.append(lse is not None)
        return real(*args, lse=lse, **kwargs)

    monkeypatch.setattr(lp, "row_grad_", row_grad_)
    for chunk, one_pass in ((1000, True), (4, False)):
        handed.clear()
        if loss == "dpo":
            d = tp._inputs()
            ours = tp._run(FusedLinearDPOLoss, d, tp._ref_kwargs(d, "model"), chunk_size=chunk, compile=True)
            tp._check(ours, tp._dpo_ref_call(d, "model"), d)
        else:
            inp, kw = tg.make_inputs()
            opts = tg.grid_opts("grpo", "sequence", beta=0.04, entropy_coef=0.1)
            ours = tg.run_ours(inp, kw, chunk_size=chunk, **dict(opts, compile=True))
            tg.assert_close_fp32(ours, tg.run_ref(inp, kw, opts))
        if one_pass or loss != "dpo":
            assert handed and all(h == one_pass for h in handed), (chunk, handed)
        else:
            # Pass 1 runs the last sequence's chunks first-hand, then pass 2 the other rows' chunks.
            n_last = sum(handed)
            assert 0 < n_last < len(handed) and not any(handed[n_last:]), handed


# --------------------------------------------------------------------------------------------------
# Beside the Triton steps, "seq_coef" (sequence_loss and dL/dstats) is compiled
# (``chunkloss.engine.compiled.SequenceDynamic``).
def _run_seq_case(case, chunk, grad=True):
    """(loss, gradients, metrics) of one sequence loss on test_preference.py's / test_grpo.py's inputs."""
    if case == "grpo-sequence":
        inp, kw = tg.make_inputs(adv_2d=False, ref_head=True)
        opts = tg.grid_opts("dapo", "sequence", beta=0.04, entropy_coef=0.1)
        if grad:
            return tg.run_ours(inp, kw, chunk_size=chunk, **dict(opts, compile=True))
        inp = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inp.items()}
        mod = FusedLinearGRPOLoss(**dict(opts, compile=True, chunk_size=chunk))
        return mod(**inp, **kw), None, mod.metrics
    d = tp._inputs(ref=case == "dpo-ref-head")
    if case == "dpo-ref-head":
        cls, kw, opts = FusedLinearDPOLoss, tp._ref_kwargs(d, "model"), dict(use_weighting=True, ld_alpha=0.4)
    else:
        cls, kw, opts = FusedLinearORPOLoss, dict(nll_labels=d["nll"]), dict(beta=0.2, softcap=2.0)
    if grad:
        return tp._run(cls, d, kw, chunk_size=chunk, compile=True, **opts)
    mod = cls(chunk_size=chunk, compile=True, **opts)
    loss = mod(d["x"].detach(), d["w"].detach(), d["chosen"], d["rejected"], bias=d["b"].detach(), **kw)
    return loss, None, mod.metrics


@pytest.mark.parametrize("chunk", [tp.TWO_PASS, tp.ONE_PASS])
@pytest.mark.parametrize("case", ["dpo-ref-head", "orpo", "grpo-sequence"])
def test_compiled_sequence_coef_equals_eager(case, chunk, cuda_steps):
    """The compiled "seq_coef" step gives the loss, metrics and gradients of the eager one (``sequence_loss``
    with ``torch.autograd.grad``) beside the same Triton steps, with and without gradients; test_preference.py
    and test_grpo.py's fp32 tolerances. Its graph compiled (no fallback to eager) and ran."""
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _run_seq_case(case, chunk)
        ours_value = _run_seq_case(case, chunk, grad=False)
    assert not [w for w in caught if "could not build" in str(w.message)], [str(w.message) for w in caught]
    built = [v for (kind, *_), v in cuda_steps.built.items() if kind is StepKind.SEQ_COEF]
    assert len(built) == 1 and isinstance(built[0], compiled.SequenceDynamic) and built[0].fn is not None
    assert counters["stats"]["unique_graphs"] >= 1 and counters["frames"]["ok"] == counters["frames"]["total"]

    with select_steps("cuda", eager_seq_coef=True) as eager_steps:
        eager = _run_seq_case(case, chunk)
        eager_value = _run_seq_case(case, chunk, grad=False)
    assert all(callable(v) and not isinstance(v, compiled.RowDynamic) for v in eager_steps.built.values())
    for (loss, grads, metrics), (e_loss, e_grads, e_metrics) in ((ours, eager), (ours_value, eager_value)):
        if case == "grpo-sequence":
            tg.assert_close_fp32((loss, grads or [], metrics), (e_loss, e_grads or [], e_metrics))
            continue
        assert_close_to_ref(loss, e_loss)
        assert set(metrics) == set(e_metrics)
        for k in e_metrics:
            assert_close_to_ref(metrics[k], e_metrics[k], name=k)
        for g, e_g in zip(grads or [], e_grads or [], strict=True):
            assert (g is None) == (e_g is None)
            if g is not None:
                assert_close_to_ref(g, e_g)


@pytest.mark.parametrize("chunk", [4, 1000])
def test_grpo_entropy_mask_estimates_compiled(chunk, cuda_steps, monkeypatch):
    """The entropy mask's per-chunk estimates and final coefficients through the compiled "seq_coef" step
    beside the Triton steps: the reference's result, no eager fallback, and with one chunk no second
    projection (the guess and the final coefficient come from the same graph on the same rows)."""
    inp, kw = tg.make_inputs(ref_head=True)
    opts = tg.grid_opts("dapo", "token", beta=0.04, top_entropy_quantile=0.3)
    projected = tg._count_projections(monkeypatch, inp["weight"])
    mod = FusedLinearGRPOLoss(chunk_size=chunk, **dict(opts, compile=True))
    for x in tg.leaves(inp):
        x.grad = None
    loss = mod(**inp, **kw)
    loss.backward()
    ours = loss.detach().float(), [x.grad.float() for x in tg.leaves(inp)], mod.metrics
    tg.assert_close_fp32(ours, tg.run_ref(inp, kw, opts))
    n_valid = int(inp["completion_mask"].sum())
    assert sum(projected[: -(-n_valid // chunk)]) == n_valid
    if chunk == 1000:
        assert projected == [n_valid]
    step = step_for(mod, StepKind.SEQ_COEF, "cuda")
    assert isinstance(step, compiled.SequenceDynamic) and step.fn is not None  # compiled, no eager fallback
