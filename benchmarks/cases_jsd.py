"""Generalized JSD (distillation) cases: student and teacher Llama-3-8B heads (H=4096 both, V=128256),
bf16, β=0.5, every token labelled.

GEMM floor: the student's 3 GEMMs (forward, grad_hidden, grad_weight) and the teacher's forward,
``8·N·H·V`` FLOPs. The teacher's weight and hidden need no grad.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from benchmarks.harness import Case
from chunkloss.losses.jsd import FusedLinearJSDLoss

H, V = 4096, 128256
BETA = 0.5


def _inputs(n: int):
    def make(device):
        g = torch.Generator(device="cpu").manual_seed(0)

        def randn(*shape, scale):
            return (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16)

        return {
            "student_hidden": randn(n, H, scale=0.5).requires_grad_(),
            "student_weight": randn(V, H, scale=0.02).requires_grad_(),
            "teacher_hidden": randn(n, H, scale=0.5),
            "teacher_weight": randn(V, H, scale=0.02),
            "labels": torch.randint(0, V, (n,), generator=g).to(device),
        }

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

    def chunkloss(i):
        return ours(
            i["student_hidden"], i["student_weight"], i["teacher_hidden"], i["teacher_weight"], i["labels"]
        )

    out = {"chunkloss": chunkloss, "torch": _torch, "torch.compile": torch.compile(_torch)}
    with contextlib.suppress(ImportError):
        from trl.trainer.distillation_trainer import _chunked_divergence_loss

        def trl_distill(i):
            mask = i["labels"] != -100
            return _chunked_divergence_loss(
                i["student_hidden"], i["teacher_hidden"], i["student_weight"], i["teacher_weight"], mask, BETA
            )[0]

        out["trl 1.16 chunked divergence"] = trl_distill
    with contextlib.suppress(ImportError):
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        # Liger's mixture is β·S + (1-β)·T (the mirror of TRL's), identical at β=0.5.
        liger = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA)

        def liger_jsd(i):
            loss = liger(
                i["student_hidden"],
                i["student_weight"],
                i["teacher_hidden"],
                i["teacher_weight"],
                i["labels"],
                None,
                None,
            )
            return loss[0] if isinstance(loss, tuple) else loss

        out["liger"] = liger_jsd
    return out


def cases() -> list[Case]:
    fns = impls()
    return [
        Case(f"jsd N={n}", "jsd", n, 8 * n * H * V, _inputs(n), fns, {"H": H, "V": V, "beta": BETA})
        for n in (8192, 16384)
    ]
