"""RLOO case: GRPO's B=16 x T=1024 completions (Llama-3-8B head, bf16, the last 1/8 of each masked) under
TRL 1.16's RLOO loss (PPO clip ε=0.2 on the ratio of whole-completion log-probs), the old log-probs given:
the policy's own (no grad) plus N(0, 0.2²) nats, so that some ratios clip. torch and TRL's fused head (with
the entropy RLOOTrainer asks it for) feed the loss's fp32 transcription. Floor 6·N_valid·H·V.
"""

from __future__ import annotations

import torch

from benchmarks.cases_grpo import TENSORS, H, V, inputs, materialised_logps, trl_head_logps
from benchmarks.cases_preference import nograd_logps
from benchmarks.harness import Case, optional
from chunkloss.losses.rloo import FusedLinearRLOOLoss
from chunkloss.testing.reference import rloo_loss_from_logps_ref

B, T = 16, 1024


def _inputs(device):
    i = inputs(B, T)(device)
    noise = 0.2 * torch.randn(B, generator=torch.Generator(device="cpu").manual_seed(1))
    i["old_logps"] = nograd_logps(i["hidden"], i["weight"], i["ids"].masked_fill(i["mask"] == 0, -100))
    i["old_logps"] += noise.to(device)
    return i


def _trl_loss(i, logps, entropies=None):
    """RLOOTrainer._compute_loss's loss (tests/losses/test_rloo.py checks the transcription against it)."""
    ent = torch.zeros_like(logps) if entropies is None else entropies
    return rloo_loss_from_logps_ref(logps, ent, i["mask"], i["adv"], old_logps=i["old_logps"])[0]


def impls() -> dict:
    ours = FusedLinearRLOOLoss()
    out = {
        "chunkloss": lambda i: ours(*(i[k] for k in TENSORS), old_logps=i["old_logps"]),
        "torch": lambda i: _trl_loss(i, *materialised_logps(i)),
    }
    if optional("trl.kernels.chunked_logprob", "ChunkedLogProbFunction"):
        out["trl 1.16 head"] = lambda i: _trl_loss(i, *trl_head_logps(i))
    return out


def cases() -> list[Case]:
    meta = {"H": H, "V": V, "B": B, "T": T, "epsilon": 0.2}
    floor = 6 * B * (T - T // 8) * H * V
    return [Case(f"rloo B={B} T={T}", "rloo", B * T, floor, _inputs, impls(), meta)]
