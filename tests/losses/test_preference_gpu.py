"""Preference losses on CUDA at a realistic shape (bf16, 2×4 rows × 512 tokens, H=1024, V=32000): ours
vs the fp32 reference, compared with plain PyTorch's own error in the same dtype (bf16 logits, fp32
log-softmax, as TRL computes them). One pass (chunk ≥ a pair) and two passes (chunk < a pair)."""

import pytest
import torch

from chunkloss.losses.dpo import FusedLinearDPOLoss
from chunkloss.losses.orpo import FusedLinearORPOLoss
from chunkloss.losses.simpo import FusedLinearSimPOLoss
from chunkloss.testing.reference import cpo_ref, dpo_ref, orpo_ref
from tests.cuda_memory import beyond_grads
from tests.tolerances import rel_err

pytestmark = pytest.mark.gpu

B, T, H, V = 4, 512, 1024, 32000


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2 * B, T, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, V, (2 * B, T), device="cuda", generator=g)
    y[:, : T // 4] = -100
    y[1, -100:] = -100  # rows of different lengths
    rx = (x.detach().float() + 0.1 * torch.randn(2 * B, T, H, device="cuda", generator=g)).bfloat16()
    rw = (w.detach().float() + 0.002 * torch.randn(V, H, device="cuda", generator=g)).bfloat16()
    return x, w, y, rx, rw


def _bf16_torch_logits(x, w, ref_fn, *args, **kw):
    """Plain PyTorch in bf16: the reference's math on bf16 logits (as a head of identity weight)."""
    z = (x @ w.t()).detach().requires_grad_()
    eye = torch.eye(V, device="cuda", dtype=torch.bfloat16)
    loss, _ = ref_fn(z, eye, *args, **kw)
    (gz,) = torch.autograd.grad(loss, z)
    gz = gz.bfloat16()
    return loss, [gz @ w, gz.flatten(0, 1).t() @ x.flatten(0, 1)]


@pytest.mark.parametrize("kind", ["dpo", "orpo", "simpo"])
@pytest.mark.parametrize(
    "chunk", [4096, 1000]
)  # 4096 ≥ a pair's 768..1024 tokens: one pass; 1000 < 1536: two
@pytest.mark.parametrize("compile", [True, False])
def test_preference_cuda(kind, chunk, compile):
    x, w, y, rx, rw = _inputs()
    c, r = y[:B], y[B:]
    if kind == "dpo":
        mod, ref_fn = FusedLinearDPOLoss(chunk_size=chunk, compile=compile), dpo_ref
        kw = dict(ref_hidden=rx, ref_weight=rw)
        t_kw = dict(ref_hidden=(rx @ rw.t()), ref_weight=torch.eye(V, device="cuda", dtype=torch.bfloat16))
    elif kind == "orpo":
        mod, ref_fn, kw, t_kw = FusedLinearORPOLoss(chunk_size=chunk, compile=compile), orpo_ref, {}, {}
    else:
        mod, kw, t_kw = FusedLinearSimPOLoss(chunk_size=chunk, compile=compile), {}, {}

        def ref_fn(*a, **k):
            return cpo_ref(*a, **k, loss_type="simpo", cpo_alpha=0.0)

    loss = mod(x, w, c, r, **kw)
    grads = torch.autograd.grad(loss, (x, w))
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref_kw = {k: v.float() for k, v in kw.items()}
    ref, ref_m = ref_fn(xr, wr, c, r, **ref_kw)
    ref_grads = torch.autograd.grad(ref, (xr, wr))
    pt, pt_grads = _bf16_torch_logits(x, w, ref_fn, c, r, **t_kw)
    assert abs(loss.item() - ref.item()) <= 2 * abs(pt.item() - ref.item()) + 1e-3 * abs(ref.item()) + 1e-4
    for name, g, gp, gr in zip(("hidden", "weight"), grads, pt_grads, ref_grads):
        assert g.dtype == torch.bfloat16
        assert rel_err(g, gr) <= 2 * rel_err(gp, gr) + 2e-3, (name, rel_err(g, gr), rel_err(gp, gr))
    # bf16 metrics against fp32: means of bf16-rounded log-probs (bf16 eps 7.8e-3 relative per value).
    for k, v in ref_m.items():
        torch.testing.assert_close(mod.metrics[k].float(), v.float(), rtol=1e-2, atol=1e-2, msg=k)


@pytest.mark.parametrize("pairs,t", [(4, 1024), (1, 16384)])  # automatic chunks: one pass, two passes
@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_preference_cuda_automatic_chunks_within_memory_budget(kind, pairs, t):
    """At Llama-3-8B's head with automatic chunks, DPO (with a reference head) and ORPO stay within
    0.5 GiB + 4·V·H bytes beyond the gradients, whether pairs fit a chunk (one pass) or not (two)."""
    h, v = 4096, 128256
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2 * pairs, t, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, v, (2 * pairs, t), device="cuda", generator=g)
    y[:, : t // 4] = -100
    if kind == "dpo":
        mod, kw = FusedLinearDPOLoss(), dict(ref_hidden=x.detach().clone(), ref_weight=w.detach().clone())
    else:
        mod, kw = FusedLinearORPOLoss(), {}
    beyond, loss = beyond_grads(lambda: mod(x, w, y[:pairs], y[pairs:], **kw), (x, w))
    assert torch.isfinite(loss)
    assert beyond <= 4 * v * h + 2**29, beyond / 2**30
