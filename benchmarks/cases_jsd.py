"""Generalized JSD (distillation) cases: student and teacher Llama-3-8B heads (H=4096 both, V=128256),
bf16, β=0.5, every token labelled.

GEMM floor: the student's 3 GEMMs (forward, grad_hidden, grad_weight) and the teacher's forward,
``8·N·H·V`` FLOPs. The teacher's weight and hidden need no grad.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from benchmarks.harness import Case, head_inputs, optional
from chunkloss.losses.jsd import FusedLinearJSDLoss

H, V = 4096, 128256
BETA = 0.5


# The losses' tensor arguments, in order.
TENSORS = ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight", "labels")


def _inputs(n: int):
    def make(device):
        g, hidden, weight = head_inputs(device, n, hidden=H, vocab=V)
        teacher_hidden = (torch.randn(n, H, generator=g) * 0.5).to(device, torch.bfloat16)
        teacher_weight = (torch.randn(V, H, generator=g) * 0.02).to(device, torch.bfloat16)
        labels = torch.randint(0, V, (n,), generator=g).to(device)
        return dict(zip(TENSORS, (hidden, weight, teacher_hidden, teacher_weight, labels), strict=True))

    return make


def _torch(inp):
    """Materialised bf16 logits of both heads, the divergence in fp32 (TRL GKD's math)."""
    z_s = (inp["student_hidden"] @ inp["student_weight"].t()).float()
    with torch.no_grad():
        z_t = (inp["teacher_hidden"] @ inp["teacher_weight"].t()).float()
    log_s = F.log_softmax(z_s, -1)
    log_t = F.log_softmax(z_t, -1)
    log_m = torch.logaddexp(log_s + math.log1p(-BETA), log_t + math.log(BETA))
    kl = functools.partial(F.kl_div, reduction="none", log_target=True)
    jsd = BETA * kl(log_m, log_t) + (1 - BETA) * kl(log_m, log_s)
    valid = inp["labels"] != -100
    return (jsd.sum(-1) * valid).sum() / valid.sum().clamp(min=1)


def impls() -> dict:
    ours = FusedLinearJSDLoss(beta=BETA)
    out = {
        "chunkloss": lambda i: ours(*(i[k] for k in TENSORS)),
        "torch": _torch,
        "torch.compile": torch.compile(_torch),
    }
    if trl_divergence := optional("trl.trainer.distillation_trainer", "_chunked_divergence_loss"):

        def trl_distill(i):  # TRL's order: both hidden states, then both weights
            student_h, student_w, teacher_h, teacher_w, labels = (i[k] for k in TENSORS)
            return trl_divergence(student_h, teacher_h, student_w, teacher_w, labels != -100, BETA)[0]

        out["trl 1.16 chunked divergence"] = trl_distill
    if liger := optional("liger_kernel.chunked_loss", "LigerFusedLinearJSDLoss"):
        # Liger's mixture is β·S + (1-β)·T (the mirror of TRL's), identical at β=0.5.
        liger_jsd = liger(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA)

        def liger_loss(i):
            loss = liger_jsd(*(i[k] for k in TENSORS), None, None)
            return loss[0] if isinstance(loss, tuple) else loss

        out["liger"] = liger_loss
    return out


def cases() -> list[Case]:
    fns = impls()
    return [
        Case(f"jsd N={n}", "jsd", n, 8 * n * H * V, _inputs(n), fns, {"H": H, "V": V, "beta": BETA})
        for n in (8192, 16384)
    ]
