"""FusedLinearKTOLoss on CUDA at a realistic shape (bf16, 8 completions × 512 tokens, H=1024, V=32000): ours
(the Triton row kernels with ``compile=True``, the eager steps without) vs the fp32 reference, compared with
plain PyTorch's own error in the same dtype (bf16 logits, fp32 log-softmax, as TRL computes them). One pass
(chunk ≥ a completion) and two passes (chunk < a completion)."""

import pytest
import torch

from chunkloss.losses.kto import KTO_LOSS_TYPES, FusedLinearKTOLoss
from chunkloss.testing.reference import kto_ref
from tests.tolerances import assert_close_to_ref

pytestmark = pytest.mark.gpu

B, T, H, V = 8, 512, 1024, 32000


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(B, T, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, V, (B, T), device="cuda", generator=g)
    y[:, : T // 4] = -100
    y[1, -100:] = -100  # completions of different lengths
    desirable = torch.tensor([True, False, True, True, False, False, True, False], device="cuda")
    with torch.no_grad():  # the policy's own sequence log-probs, so that the log-ratios are O(1/β)
        lp = torch.log_softmax(x.float() @ w.float().t(), -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
        seq = (lp * (y != -100)).sum(1)
    ref_logps = seq + torch.randn(B, device="cuda", generator=g) * 5
    kl_logps = seq.roll(1) + torch.randn(B, device="cuda", generator=g) * 5
    kw = dict(ref_logps=ref_logps, kl_logps=kl_logps, ref_kl_logps=kl_logps - 1.0)
    return x, w, y, desirable, kw


@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
@pytest.mark.parametrize("chunk", [4096, 300])  # 4096 ≥ a completion's ≤ 384 tokens: one pass; 300: two
@pytest.mark.parametrize("compile", [True, False])
def test_kto_cuda(loss_type, chunk, compile):
    x, w, y, desirable, kw = _inputs()
    if loss_type != "kto":
        kw = dict(ref_logps=kw["ref_logps"])
    opts = dict(beta=0.1, loss_type=loss_type, return_token_metrics=True)
    mod = FusedLinearKTOLoss(chunk_size=chunk, compile=compile, **opts)
    loss = mod(x, w, y, desirable, **kw)
    grads = torch.autograd.grad(loss, (x, w))
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref, ref_m = kto_ref(xr, wr, y, desirable, **kw, **opts)
    ref_grads = torch.autograd.grad(ref, (xr, wr))
    # Plain PyTorch in bf16: the reference's math on bf16 logits (a head of identity weight).
    z = (x @ w.t()).detach().requires_grad_()
    pt, pt_m = kto_ref(z, torch.eye(V, device="cuda", dtype=torch.bfloat16), y, desirable, **kw, **opts)
    (gz,) = torch.autograd.grad(pt, z)
    gz = gz.bfloat16()
    pt_grads = [gz @ w, gz.flatten(0, 1).t() @ x.flatten(0, 1)]
    bf16 = torch.bfloat16
    assert_close_to_ref(loss, ref, pt, "loss", dtype=bf16)
    for name, g, gp, gr in zip(("hidden", "weight"), grads, pt_grads, ref_grads):
        assert g.dtype == torch.bfloat16
        assert_close_to_ref(g, gr, gp, f"grad {name}", dtype=bf16)
    for k in ref_m:
        assert_close_to_ref(mod.metrics[k], ref_m[k].float(), pt_m[k].float(), k, dtype=bf16)
