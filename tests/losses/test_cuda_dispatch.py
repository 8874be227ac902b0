"""Each loss's CUDA steps compute that loss: the steps ``_build_step`` returns for ``device_type="cuda"``
(Triton kernels where a loss has them), run here on CPU tensors through TRITON_INTERPRET=1, against the same
loss's eager steps.

A subclass inherits its parent's ``_build_step``: the cross-entropy kernel computes cross-entropy whatever the
subclass's ``chunk_loss`` says, so a subclass with its own loss must not get it. ``FusedLinearDFTLoss`` (SFT's
``loss_type="dft"``) did, from the CE kernel's introduction until this test: on CUDA it trained cross-entropy.
"""

from __future__ import annotations

import pytest
import torch

from chunkloss.losses.common import scale_logits
from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss
from chunkloss.losses.dft import FusedLinearDFTLoss
from chunkloss.losses.grpo import FusedLinearGRPOLoss, grpo_chunk
from chunkloss.losses.jsd import FusedLinearJSDLoss, jsd_chunk
from tests.losses import test_grpo as tg
from tests.losses import test_jsd as tj
from tests.tolerances import assert_close_to_ref

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="with a GPU, Triton compiles for it and cannot take these CPU tensors (tests/conftest.py sets "
    "TRITON_INTERPRET=1 only without one)",
)


def _focal_chunk(logits, extra_logits, token, scalars, opts):
    """A user's loss on a cross-entropy subclass: focal loss, γ = 2."""
    z = scale_logits(logits.float(), opts.logit_scale, opts.softcap, opts.temperature)
    logp = torch.log_softmax(z, -1).gather(-1, token.labels[:, None])[:, 0]
    return -(((1 - logp.exp()) ** 2) * logp).sum() / scalars.normaliser, {}


class FocalLoss(FusedLinearCrossEntropyLoss):
    chunk_loss = staticmethod(_focal_chunk)


def _run(cls, compile, **opts):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 16, generator=g).requires_grad_(True)
    w = (0.5 * torch.randn(37, 16, generator=g)).requires_grad_(True)
    y = torch.randint(0, 37, (3, 7), generator=g)
    y[0, :3] = -100
    mod = cls(compile=compile, chunk_size=5, **opts)
    loss = mod(x, w, y)
    loss.backward()
    return loss.detach(), x.grad, w.grad, mod.metrics


@pytest.mark.parametrize(
    "cls, opts",
    [
        (FusedLinearCrossEntropyLoss, dict(return_token_accuracy=True, return_entropy=True)),
        (FusedLinearDFTLoss, dict(return_token_accuracy=True, return_entropy=True)),
        (FusedLinearDFTLoss, dict(softcap=3.0, temperature=0.7)),
        (FocalLoss, {}),
    ],
    ids=["cross-entropy", "dft-metrics", "dft-transforms", "ce-subclass"],
)
def test_cuda_steps_compute_the_class_loss(cls, opts, cuda_steps):
    ours = _run(cls, True, **opts)
    eager = _run(cls, False, **opts)
    for a, b in zip(ours[:3], eager[:3]):
        assert_close_to_ref(a, b)
    assert set(ours[3]) == set(eager[3])
    for k in eager[3]:
        assert_close_to_ref(ours[3][k], eager[3][k], name=k)
    if cls is not FusedLinearCrossEntropyLoss:  # and it is not the cross-entropy
        ce = _run(FusedLinearCrossEntropyLoss, False, **opts)
        assert abs(float(ce[0]) - float(ours[0])) > 1e-3


def _double(chunk_loss):
    """A user's variant of a loss: twice its chunk loss (metrics unchanged)."""

    def chunk(*args):
        loss, metrics = chunk_loss(*args)
        return 2 * loss, metrics

    return staticmethod(chunk)


class DoubledGRPO(FusedLinearGRPOLoss):
    chunk_loss = _double(grpo_chunk)


class DoubledJSD(FusedLinearJSDLoss):
    chunk_loss = _double(jsd_chunk)


@pytest.mark.parametrize("cls", [DoubledGRPO, DoubledJSD])
def test_subclass_with_its_own_loss_keeps_its_loss(cls, cuda_steps):
    """GRPO's and JSD's kernels compute their own class's loss; a subclass with another one gets twice the
    parent's loss and gradients here, on the CUDA steps as eagerly."""
    if cls is DoubledGRPO:
        inp, kw = tg.make_inputs()
        opts = tg.grid_opts("dapo", "token", beta=0.04)

        def run(c, compile):
            for x in tg.leaves(inp):
                x.grad = None
            mod = c(chunk_size=5, **dict(opts, compile=compile))
            loss = mod(**inp, **kw)
            loss.backward()
            return loss.detach(), [x.grad.clone() for x in tg.leaves(inp)], mod.metrics
    else:
        d = tj._inputs()

        def run(c, compile):
            mod = c(beta=0.3, chunk_size=5, compile=compile)
            loss = mod(d["x_s"], d["w_s"], d["x_t"], d["w_t"], d["y"], bias=d["b_s"], teacher_bias=d["b_t"])
            return loss.detach(), tj._grads(loss, d), mod.metrics

    ours, eager, parent = run(cls, True), run(cls, False), run(cls.__mro__[1], False)
    assert_close_to_ref(ours[0], eager[0])
    assert_close_to_ref(ours[0], 2 * parent[0])
    for a, b in zip(ours[1], parent[1]):
        assert_close_to_ref(a, 2 * b)
