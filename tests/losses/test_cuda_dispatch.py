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
from chunkloss.trainers._losses import FusedLinearDFTLoss

import chunkloss.base as base
from chunkloss.base import FusedLinearBase
from chunkloss.losses.common import scale_logits
from chunkloss.losses.cross_entropy import FusedLinearCrossEntropyLoss

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the CUDA steps run in the *_gpu tests on CUDA tensors"
)

TOL = dict(rtol=1e-5, atol=1e-6)  # fp32, summation order only (as tests/losses/test_cross_entropy.py)


@pytest.fixture
def cuda_steps(monkeypatch):
    """Every loss builds the steps it would build on CUDA, for whatever device its tensors are on."""
    monkeypatch.setattr(base, "_SHARED_STEPS", {})
    real = FusedLinearBase._step_fn
    monkeypatch.setattr(
        FusedLinearBase, "_step_fn", lambda self, kind, device_type="cuda": real(self, kind, "cuda")
    )


def _focal_chunk(logits, extra_logits, token, scalars, opts):
    """A user's loss on a cross-entropy subclass: focal loss, γ = 2."""
    z = scale_logits(logits.float(), opts.logit_scale, opts.softcap, opts.temperature)
    logp = torch.log_softmax(z, -1).gather(-1, token["labels"][:, None])[:, 0]
    return -(((1 - logp.exp()) ** 2) * logp).sum() / scalars["normaliser"], {}


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
        torch.testing.assert_close(a, b, **TOL)
    assert set(ours[3]) == set(eager[3])
    for k in eager[3]:
        torch.testing.assert_close(ours[3][k], eager[3][k], **TOL, msg=k)
    if cls is not FusedLinearCrossEntropyLoss:  # and it is not the cross-entropy
        ce = _run(FusedLinearCrossEntropyLoss, False, **opts)
        assert abs(float(ce[0]) - float(ours[0])) > 1e-3
