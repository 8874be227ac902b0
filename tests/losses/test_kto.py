"""FusedLinearKTOLoss against its fp32 reference (``kto_ref``) and against TRL 1.16's own
``KTOTrainer._compute_loss``: every loss type, fp32 and bf16, odd shapes, ignored tokens, chunk sizes in one
pass and two, batches of one side only, the KL term, bad inputs and a hand-computed case."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from chunkloss.losses.kto import KTO_LOSS_TYPES, FusedLinearKTOLoss
from chunkloss.testing.reference import kto_ref
from tests.child_process import in_child_process
from tests.tolerances import assert_close_to_ref

B, T, H, V = 5, 13, 31, 123  # odd shapes: 5 completions of 13 tokens, H=31, V=123
# 1: a chunk per row; 7: fewer rows than a completion (two passes); 1000: more than all rows (one pass).
CHUNKS = [1, 7, 1000]
SIDES = {  # which completions are desirable
    "mixed": [True, False, False, True, False],
    "all_desirable": [True] * B,
    "all_undesirable": [False] * B,
}


def _inputs(side="mixed", bias=True, dtype=torch.float32, ignored="some", seed=1):
    """Completions whose first 2..4 positions are prompt and whose ends are padding (``ignored="some"``),
    none ignored ("none"), or every label ignored ("all"); the reference's sequence log-probs and the KL
    batch's log-probs (policy and reference) as the trainer hands them over (fp32, no grad)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, T, H, generator=g) * 0.5).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_(True)
    bb = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_(True) if bias else None
    y = torch.randint(0, V, (B, T), generator=g)
    prompt = torch.randint(2, 5, (B,), generator=g)
    end = T - torch.randint(0, 4, (B,), generator=g)
    pos = torch.arange(T)
    if ignored == "some":
        y[(pos < prompt[:, None]) | (pos >= end[:, None])] = -100
    elif ignored == "all":
        y[:] = -100
    ref_logps = -(torch.rand(B, generator=g) * 10 + 20)  # near the policy's (about -T·log V ≈ -50 .. -60)
    kl_logps = -(torch.rand(B, generator=g) * 10 + 40)
    return dict(
        x=x,
        w=w,
        b=bb,
        y=y,
        desirable=torch.tensor(SIDES[side]),
        ref_logps=ref_logps,
        kl_logps=kl_logps,
        ref_kl_logps=kl_logps - torch.rand(B, generator=g) - 0.2,
    )


def _call_kw(d, loss_type):
    kw = dict(ref_logps=d["ref_logps"])
    if loss_type == "kto":
        kw.update(kl_logps=d["kl_logps"], ref_kl_logps=d["ref_kl_logps"])
    return kw


def _leaves(d):
    return [d["x"], d["w"], d["b"]]


def _grads(loss, d):
    leaves = [t for t in _leaves(d) if t is not None and t.requires_grad]
    gs = iter(torch.autograd.grad(loss, leaves))
    return [next(gs) if (t is not None and t.requires_grad) else None for t in _leaves(d)]


def _run(d, loss_type="kto", call_kw=None, **opts):
    mod = FusedLinearKTOLoss(loss_type=loss_type, **opts)
    kw = _call_kw(d, loss_type) | (call_kw or {})
    loss = mod(d["x"], d["w"], d["y"], d["desirable"], bias=d["b"], **kw)
    return loss, _grads(loss, d), mod.metrics


def _ref(d, loss_type="kto", call_kw=None, **opts):
    kw = _call_kw(d, loss_type) | (call_kw or {})
    return kto_ref(d["x"], d["w"], d["y"], d["desirable"], d["b"], loss_type=loss_type, **kw, **opts)


def _check(ours, ref, d):
    """Loss, every metric and every gradient against the fp32 reference (tests/tolerances.py's fp32 row)."""
    loss, grads, metrics = ours
    ref_loss, ref_metrics = ref
    assert_close_to_ref(loss, ref_loss.float(), name="loss")
    assert set(metrics) == set(ref_metrics)
    for k in ref_metrics:
        assert_close_to_ref(metrics[k], ref_metrics[k].float(), name=k)
    for i, (g, rg) in enumerate(zip(grads, _grads(ref_loss, d))):
        assert (g is None) == (rg is None)
        if g is not None:
            assert_close_to_ref(g, rg, name=f"grad {i}")


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
def test_every_loss_type_side_and_chunk_size(loss_type, side, chunk):
    d = _inputs(side)
    opts = dict(beta=0.3, desirable_weight=1.3, undesirable_weight=0.7, return_token_metrics=True)
    ours = _run(d, loss_type, chunk_size=chunk, compile=False, **opts)
    _check(ours, _ref(d, loss_type, **opts), d)


@pytest.mark.parametrize("ignored", ["none", "some", "all"])
@pytest.mark.parametrize("chunk", [7, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_ignored_tokens_and_bias(ignored, chunk, bias):
    """No label ignored, prompt and padding ignored, every label ignored (each completion's log-prob is 0:
    the loss is still defined, and every gradient 0)."""
    d = _inputs(bias=bias, ignored=ignored)
    ours = _run(d, chunk_size=chunk, compile=False)
    _check(ours, _ref(d), d)
    if ignored == "all":
        assert all(g is None or not g.any() for g in ours[1])


def test_empty_completion_counts_in_the_mean():
    """A completion with no token still counts in TRL's mean over the batch (its log-prob is 0)."""
    d = _inputs()
    d["y"][1] = -100
    for chunk in CHUNKS:
        _check(_run(d, chunk_size=chunk, compile=False), _ref(d), d)


@pytest.mark.parametrize("logit_scale,softcap", [(0.5, None), (1.0, 2.0), (1.5, 3.0)])
def test_logit_transforms(logit_scale, softcap):
    d = _inputs()
    opts = dict(logit_scale=logit_scale, softcap=softcap, return_token_metrics=True)
    _check(_run(d, chunk_size=7, compile=False, **opts), _ref(d, **opts), d)


def test_negative_kl_is_clamped_and_gathered():
    """TRL's KL: the KL batch's mean log-ratio, detached, gathered across processes, averaged, clamped at 0.
    Here this process's mean is negative; a gather standing in for two processes whose mean is positive."""
    d = _inputs()
    d["ref_kl_logps"] = d["kl_logps"] + 0.5  # mean log-ratio -0.5
    loss, grads, metrics = _run(d, chunk_size=7, compile=False)
    assert metrics["kl"].item() == 0.0
    _check((loss, grads, metrics), _ref(d), d)

    def gather(t):  # another process's mean of +1.5: (−0.5 + 1.5) / 2 = 0.5
        return torch.stack([t, torch.tensor(1.5)])

    ours = _run(d, chunk_size=7, compile=False, call_kw=dict(kl_gather=gather))
    assert ours[2]["kl"].item() == pytest.approx(0.5)
    _check(ours, _ref(d, call_kw=dict(kl_gather=gather)), d)


def test_kl_term_carries_no_gradient():
    """KL log-probs given with a graph (TRL computes them under no_grad): the loss detaches them."""
    d = _inputs()
    kl = d["kl_logps"].clone().requires_grad_(True)
    mod = FusedLinearKTOLoss(chunk_size=7, compile=False)
    loss = mod(
        d["x"],
        d["w"],
        d["y"],
        d["desirable"],
        bias=d["b"],
        ref_logps=d["ref_logps"],
        kl_logps=kl,
        ref_kl_logps=d["ref_kl_logps"],
    )
    loss.backward()
    assert kl.grad is None and not mod.metrics["kl"].requires_grad


@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
@pytest.mark.parametrize("chunk", [7, 1000])
def test_compiled(loss_type, chunk):
    d = _inputs()
    opts = dict(return_token_metrics=True)
    _check(_run(d, loss_type, chunk_size=chunk, compile=True, **opts), _ref(d, loss_type, **opts), d)


@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
@pytest.mark.parametrize("chunk", [7, 1000])
def test_bf16(loss_type, chunk):
    """Three-way: the fp32 reference on the bf16 inputs, plain bf16 torch (the reference on bf16 logits, its
    gradients through bf16 GEMMs), ours."""
    d = _inputs(dtype=torch.bfloat16)
    opts = dict(beta=0.3, return_token_metrics=True)
    ours = _run(d, loss_type, chunk_size=chunk, compile=False, **opts)
    ref_loss, ref_m = _ref(d, loss_type, **opts)
    ref_g = _grads(ref_loss, d)
    z16 = (d["x"] @ d["w"].t() + d["b"]).detach().requires_grad_(True)
    eye = torch.eye(V, dtype=torch.bfloat16)
    t_loss, t_m = kto_ref(
        z16, eye, d["y"], d["desirable"], loss_type=loss_type, **_call_kw(d, loss_type), **opts
    )
    (gz,) = torch.autograd.grad(t_loss, z16)
    gz = gz.to(torch.bfloat16)
    t_grads = [gz @ d["w"], gz.reshape(-1, V).t() @ d["x"].reshape(-1, H), gz.reshape(-1, V).sum(0)]
    bf16 = torch.bfloat16
    assert_close_to_ref(ours[0], ref_loss, t_loss, "loss", dtype=bf16)
    for i, (g, rg, tg) in enumerate(zip(ours[1], ref_g, t_grads)):
        assert_close_to_ref(g, rg, tg, f"grad {i}", dtype=bf16)
    for k in ref_m:
        assert_close_to_ref(ours[2][k], ref_m[k].float(), t_m[k].float(), k, dtype=bf16)


def test_no_grad_inputs_give_none():
    d = _inputs()
    d["w"].requires_grad_(False)
    d["b"].requires_grad_(False)
    loss, grads, _ = _run(d, chunk_size=7, compile=False)
    assert grads[1] is None and grads[2] is None
    assert_close_to_ref(grads[0], _grads(_ref(d)[0], d)[0])


def test_hand_computed_tiny_case():
    """Two completions of one token, V=2, H=1, weight [[1], [-1]]: logits ±x; completion 0 desirable with
    x=1, completion 1 undesirable with x=0; references log ½; KL batch log-ratio 0.2."""
    x = torch.tensor([[[1.0]], [[0.0]]], requires_grad=True)
    w = torch.tensor([[1.0], [-1.0]])
    mod = FusedLinearKTOLoss(beta=1.0, compile=False)
    half = math.log(0.5)
    kl = dict(kl_logps=torch.tensor([-1.0]), ref_kl_logps=torch.tensor([-1.2]))
    loss = mod(
        x, w, torch.tensor([[0], [0]]), torch.tensor([True, False]), ref_logps=torch.full((2,), half), **kl
    )
    lc = math.log(1 / (1 + math.exp(-2)))  # log p of logits [1, -1] at label 0
    r_c, r_r, z = lc - half, 0.0, 0.2

    def sig(v):
        return 1 / (1 + math.exp(-v))

    expected = ((1 - sig(r_c - z)) + (1 - sig(z - r_r))) / 2
    torch.testing.assert_close(loss, torch.tensor(expected))
    loss.backward()
    # dℓ/dx = 1 - tanh(x): 2·(1 - σ(2)) at x=1, 1 at x=0; dL/dℓ_c = -σ'(r_c - z)/2, dL/dℓ_r = σ'(z - r_r)/2.
    grad_c = -sig(r_c - z) * (1 - sig(r_c - z)) / 2 * 2 * (1 - sig(2))
    grad_r = sig(z - r_r) * (1 - sig(z - r_r)) / 2
    torch.testing.assert_close(x.grad[:, 0, 0], torch.tensor([grad_c, grad_r]))
    torch.testing.assert_close(mod.metrics["rewards/chosen"], torch.tensor(r_c))
    torch.testing.assert_close(mod.metrics["kl"], torch.tensor(z))


def test_no_completions():
    """A batch of zero completions: loss and every metric 0, zero gradients."""
    w = torch.randn(V, H, requires_grad=True)
    x = torch.randn(0, T, H, requires_grad=True)
    mod = FusedLinearKTOLoss(loss_type="apo_zero_unpaired", compile=False)
    loss = mod(
        x, w, torch.zeros(0, T, dtype=torch.long), torch.zeros(0, dtype=torch.bool), ref_logps=torch.zeros(0)
    )
    loss.backward()
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in mod.metrics.values()), mod.metrics
    assert w.grad.abs().sum().item() == 0.0 and x.grad.shape == x.shape


def test_bad_inputs():
    d = _inputs()
    mod = FusedLinearKTOLoss(compile=False)
    x, w, y, des, kw = d["x"], d["w"], d["y"], d["desirable"], _call_kw(d, "kto")
    with pytest.raises(ValueError, match="labels shape"):
        mod(x, w, y[:, :-1], des, **kw)
    with pytest.raises(ValueError, match=rf"labels holds {V}, outside"):
        mod(x, w, y.masked_fill(y == y.max(), V), des, **kw)
    with pytest.raises(ValueError, match=r"desirable must be a \(5,\) tensor"):
        mod(x, w, y, des[:-1], **kw)
    with pytest.raises(ValueError, match=r"ref_logps must be a \(5,\) tensor"):
        mod(x, w, y, des, **(kw | dict(ref_logps=d["ref_logps"][:2])))
    with pytest.raises(ValueError, match="needs the KL batch"):
        mod(x, w, y, des, ref_logps=d["ref_logps"])
    with pytest.raises(ValueError, match=r"ref_kl_logps must be a \(5,\) tensor"):
        mod(x, w, y, des, **(kw | dict(ref_kl_logps=d["ref_kl_logps"][:3])))
    with pytest.raises(ValueError, match="has no KL term"):
        FusedLinearKTOLoss(loss_type="apo_zero_unpaired", compile=False)(x, w, y, des, **kw)
    with pytest.raises(ValueError, match=r"hidden must be \(B, T, H\)"):
        mod(x.reshape(-1, H), w, y.reshape(-1), des, **kw)


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(loss_type="sigmoid"), "loss_type must be one of"),
        (dict(beta=0.0), "beta must be positive"),
        (dict(softcap=0.0), "softcap must be positive"),
    ],
)
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        FusedLinearKTOLoss(**opts)


@in_child_process  # Triton's interpreter: CPU-heavy
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Triton cannot take these CPU tensors")
@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_cuda_steps(loss_type, chunk, cuda_steps):
    """The Triton steps (``chunkloss.kernels.logprob``'s row kernels, through TRITON_INTERPRET=1) against the
    fp32 reference, with the logit transforms and the entropy column."""
    d = _inputs()
    opts = dict(beta=0.3, softcap=3.0, logit_scale=0.7, return_token_metrics=True)
    _check(_run(d, loss_type, chunk_size=chunk, compile=True, **opts), _ref(d, loss_type, **opts), d)


# --------------------------------------------------------------------------------------------------
# Parity with TRL 1.16's own code: ``KTOTrainer._compute_loss`` run on a stub trainer whose models return
# the per-token outputs of TRL's fused LM head, computed in fp32 from an embedding table (hidden state of
# a token = its row) and a head, so that the KL batch's sequences get their own hidden states.


def _fused_head_model(emb, weight):
    def model(input_ids, labels, **_):
        z = emb[input_ids][:, :-1].float() @ weight.float().t()
        y = labels[:, 1:]
        lp = torch.log_softmax(z, -1)
        return SimpleNamespace(
            log_probs=lp.gather(-1, y.clamp(min=0)[..., None])[..., 0] * (y != -100),
            entropy=-(lp.exp() * lp).sum(-1).detach(),
            mean_logits=z.mean(-1).detach(),
        )

    return model


def _trl_batch(labels, seed=0):
    """Examples of random prompts and completions as TRL's collator pads them, KL completions rotated by
    one within the batch (TRL's ``add_kl_completion_ids``)."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    g = torch.Generator().manual_seed(seed)
    rows = []
    for label in labels:
        p, c = torch.randint(2, 5, (), generator=g).item(), torch.randint(1, 7, (), generator=g).item()
        prompt, completion = torch.randint(1, V, (p,), generator=g), torch.randint(1, V, (c,), generator=g)
        rows.append(dict(prompt_ids=prompt.tolist(), completion_ids=completion.tolist(), label=label))
    completions = [r["completion_ids"] for r in rows]
    for r, kl in zip(rows, [completions[-1], *completions[:-1]]):
        r["KL_completion_ids"] = kl
    return DataCollatorForUnpairedPreference(pad_token_id=0)(rows)


def _trl_kto(policy, ref, batch, loss_type, **cfg):
    from trl.trainer.kto_trainer import KTOTrainer

    module = torch.nn.Module()
    module.is_gradient_checkpointing = False
    stub = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t),
        model=module,
        ref_model=ref,
        calculate_KL=loss_type == "kto",
        aux_loss_enabled=False,
        precompute_ref_logps=False,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        beta=cfg.get("beta", 0.1),
        loss_type=loss_type,
        desirable_weight=cfg.get("desirable_weight", 1.0),
        undesirable_weight=cfg.get("undesirable_weight", 1.0),
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    stub._compute_kl_logps = lambda model, b: KTOTrainer._compute_kl_logps(stub, model, b)
    loss = KTOTrainer._compute_loss(stub, policy, dict(batch), return_outputs=False)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items() if k != "num_tokens"}


def _seq_logps(model, ids, completion_mask):
    labels = ids.masked_fill(completion_mask == 0, -100)
    with torch.no_grad():
        return model(input_ids=ids, labels=labels).log_probs.sum(-1)


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
def test_matches_trl(loss_type, side):
    g = torch.Generator().manual_seed(3)
    emb = (torch.randn(V, H, generator=g) * 0.5).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_(True)
    ref = _fused_head_model(emb.detach() + 0.3 * torch.randn(V, H, generator=g), w.detach() * 1.1)
    policy = _fused_head_model(emb, w)
    batch = _trl_batch(SIDES[side])
    cfg = dict(beta=0.5, desirable_weight=1.2, undesirable_weight=0.8)

    ids, completion = batch["input_ids"], batch["completion_mask"]
    kw = dict(ref_logps=_seq_logps(ref, ids, completion))
    if loss_type == "kto":
        kl_ids, kl_completion = batch["KL_input_ids"], batch["KL_completion_mask"]
        kw.update(
            kl_logps=_seq_logps(policy, kl_ids, kl_completion),
            ref_kl_logps=_seq_logps(ref, kl_ids, kl_completion),
        )
        assert kw["kl_logps"].mean() > kw["ref_kl_logps"].mean()  # a KL term above its clamp
    mod = FusedLinearKTOLoss(
        loss_type=loss_type, chunk_size=5, compile=False, return_token_metrics=True, **cfg
    )
    labels = ids.masked_fill(completion == 0, -100)[:, 1:]
    loss = mod(emb[ids][:, :-1], w, labels, batch["label"], **kw)
    grads = torch.autograd.grad(loss, (emb, w))
    trl_loss, trl_m = _trl_kto(policy, ref, batch, loss_type, **cfg)
    assert_close_to_ref(loss, trl_loss, name="loss")
    for a, b, name in zip(grads, torch.autograd.grad(trl_loss, (emb, w)), ("embedding", "weight")):
        assert_close_to_ref(a, b, name=f"grad {name}")
    logged = {k for k in mod.metrics if not (side == "all_desirable" and k.endswith("rejected"))}
    logged = {k for k in logged if not (side == "all_undesirable" and k.endswith("chosen"))}
    if side != "mixed":
        logged.discard("rewards/margins")  # TRL logs the margin only when both sides are present
    assert set(trl_m) == logged
    for k in logged:
        assert_close_to_ref(mod.metrics[k], float(trl_m[k]), name=k)
