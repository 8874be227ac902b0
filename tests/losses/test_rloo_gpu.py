"""GPU checks of FusedLinearRLOOLoss at a realistic shape (bf16, 4 completions of up to 1024 tokens, H=1024,
V=32000), on its CUDA steps (Triton row kernels), against the fp32 reference under the suite's tolerance
rule (tests/tolerances.py), with the materialised bf16 torch loss's error as the yardstick."""

from __future__ import annotations

import pytest
import torch

from chunkloss.engine import StepKind
from chunkloss.engine.steps import step_for
from chunkloss.losses import rloo
from chunkloss.losses.rloo import FusedLinearRLOOLoss
from chunkloss.testing.reference import rloo_loss_from_logps_ref, rloo_ref
from tests.tolerances import assert_close_to_ref

B, T, H, V = 4, 1024, 1024, 32000
# Sequence ratios the old log-probs are set to and the advantages' signs (as tests/losses/test_rloo.py):
# one completion clipped above, one below, one above the range with A < 0 (unclipped), one inside; each
# ratio at least 0.1 from a clip boundary, so bf16 rounding of the summed log-probs flips no flag.
RATIOS = (1.45, 0.6, 1.4, 1.05)
SIGNS = (1.0, -1.0, -1.0, 1.0)


def _inputs(temperature=1.0, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = "cuda"
    h = (torch.randn(B, T, H, generator=g) * 0.5).to(dev, torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.03).to(dev, torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g).to(dev)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, T - T // 8 :] = 0
    mask[1, 300:] = 0
    mask = mask.to(dev)
    with torch.no_grad():
        z = h.float() @ w.float().t() / temperature
        cur = torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0]
    old = (cur * mask).sum(1) - torch.log(torch.tensor(RATIOS, device=dev))
    adv = ((torch.rand(B, generator=g) + 0.5) * torch.tensor(SIGNS)).to(dev)
    return h, w, ids, mask, adv, old


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 256], ids=["one_pass", "two_passes"])
@pytest.mark.parametrize(
    "opts", [dict(), dict(epsilon_high=0.28, temperature=0.8)], ids=["default", "options"]
)
def test_rloo_gpu(chunk, opts):
    h, w, ids, mask, adv, old = _inputs(opts.get("temperature", 1.0))
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    l32, m32 = rloo_ref(h32, w32, ids, mask, adv, old_logps=old, **opts)
    l32.backward()
    # plain torch in bf16: bf16 logits, fp32 log-softmax
    hb, wb = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lp_all = torch.log_softmax((hb @ wb.t()).float() / opts.get("temperature", 1.0), -1)
    logp = lp_all.gather(-1, ids[..., None])[..., 0]
    ent = -(lp_all.exp() * lp_all).sum(-1)
    lt, mt = rloo_loss_from_logps_ref(logp, ent, mask, adv, old_logps=old, **opts)
    lt.backward()
    mod = FusedLinearRLOOLoss(**opts, chunk_size=chunk)
    assert step_for(mod, StepKind.STATS, "cuda").func is rloo.rloo_stats
    lo = mod(h, w, ids, mask, adv, old_logps=old)
    lo.backward()
    bf16 = torch.bfloat16
    assert_close_to_ref(lo.float(), l32, lt, "loss", dtype=bf16)
    assert_close_to_ref(h.grad.float(), h32.grad, hb.grad.float(), "grad hidden", dtype=bf16)
    assert_close_to_ref(w.grad.float(), w32.grad, wb.grad.float(), "grad weight", dtype=bf16)
    for k, v in m32.items():
        assert_close_to_ref(float(mod.metrics[k]), float(v), float(mt[k]), k, dtype=bf16)
    assert float(m32["clip_ratio/region_mean"]) == 0.5  # completions 0 and 1
