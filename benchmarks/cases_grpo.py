"""GRPO cases: Llama-3-8B head (H=4096, V=128256), bf16, loss_type='dapo', β=0.04 with precomputed
reference log-probs, old log-probs given, the last 1/8 of each completion masked. Token-level ratios at three
shapes, and at B=16, T=1024 the modes that are sequence losses in chunkloss: GSPO (sequence-level ratios; one
pass when each completion fits a chunk) and entropy masking (a quantile over the whole batch: two passes).
Floor FLOPs: 6·N_valid·H·V (the policy head's forward and its two gradient GEMMs).
"""

from __future__ import annotations

import torch

from benchmarks.harness import Case, head_inputs, optional
from chunkloss.losses.grpo import FusedLinearGRPOLoss
from chunkloss.testing.reference import grpo_loss_from_logps_ref

H, V = 4096, 128256
BETA = 0.04
SHAPES = ((16, 1024), (2, 16384), (2, 32768))
# Sequence-loss modes: (case label, FusedLinearGRPOLoss / reference options), at B=16, T=1024.
MODES = (
    ("gspo", {"importance_sampling_level": "sequence"}),
    ("entropy mask 0.2", {"top_entropy_quantile": 0.2}),
    # TRL's default β=0: no KL term, so the masked 80% of tokens have no gradient; the second pass skips them.
    ("entropy mask 0.2 beta=0", {"top_entropy_quantile": 0.2, "beta": 0.0}),
)


TENSORS = ("hidden", "weight", "ids", "mask", "adv")  # the losses' tensor arguments, in order


def inputs(b: int, t: int):
    def make(device):
        g, hidden, weight = head_inputs(device, b, t, hidden=H, vocab=V)
        ids = torch.randint(0, V, (b, t), generator=g).to(device)
        mask = torch.ones(b, t, dtype=torch.long)
        mask[:, t - t // 8 :] = 0
        # Old/ref log-probs near a uniform-ish policy's (log 1/V ≈ -11.8), so ratios are O(1).
        old = (-11.8 + 0.1 * torch.randn(b, t, generator=g)).to(device)
        ref = (-11.8 + 0.1 * torch.randn(b, t, generator=g)).to(device)
        adv = torch.randn(b, generator=g).to(device)
        return dict(hidden=hidden, weight=weight, ids=ids, mask=mask.to(device), adv=adv, old=old, ref=ref)

    return make


def _trl_loss(i, logps, entropies=None, **mode):
    """TRL 1.16's dapo loss on per-token log-probs (fp32 transcription, tests/losses/test_grpo.py checks it
    against GRPOTrainer._compute_loss); ``mode``: the case's extra options."""
    ent = torch.zeros_like(logps) if entropies is None else entropies
    mode = {"beta": BETA, **mode}
    ref = i["ref"] if mode["beta"] else None
    return grpo_loss_from_logps_ref(
        logps, ent, i["mask"], i["adv"], old_logps=i["old"], ref_logps=ref, loss_type="dapo", **mode
    )[0]


def materialised_logps(i, entropy: bool = False):
    """bf16 logits -> fp32 selective log-softmax (TRL's selective_log_softmax): the log-probs of ``ids``
    (B, T) and, with ``entropy``, each row's entropy (no grad; else None)."""
    logits = i["hidden"] @ i["weight"].t()
    logp_all = torch.log_softmax(logits.float(), -1)
    logps = logp_all.gather(-1, i["ids"].unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logps, None
    with torch.no_grad():
        return logps, -(logp_all.exp() * logp_all).sum(-1)


def trl_head_logps(i):
    """TRL 1.16's fused head on every position: the log-probs of ``ids`` (B, T) and the entropy that TRL's
    online trainers ask it for (their ``entropy`` metric)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    b, t, h = i["hidden"].shape
    args = (i["hidden"].reshape(b * t, h), i["weight"], None, i["ids"].reshape(-1), 1.0, 4096)
    logps, ent = ChunkedLogProbFunction.apply(*args, None, 1.0, ("entropy",))[:2]
    return logps.view(b, t), ent.view(b, t).detach()


def impls(**mode) -> dict:
    ours = FusedLinearGRPOLoss(**{"loss_type": "dapo", "beta": BETA, **mode})
    with_ref = ours.options.beta != 0.0
    entropy = mode.get("top_entropy_quantile", 1.0) < 1.0  # the mask needs the materialised entropies
    out = {
        "chunkloss": lambda i: ours(
            *(i[k] for k in TENSORS), old_logps=i["old"], ref_logps=i["ref"] if with_ref else None
        ),
        "torch": lambda i: _trl_loss(i, *materialised_logps(i, entropy), **mode),
    }
    if optional("trl.kernels.chunked_logprob", "ChunkedLogProbFunction"):
        out["trl 1.16 head"] = lambda i: _trl_loss(i, *trl_head_logps(i), **mode)
    if mode:  # Liger's GRPO has no entropy masking; its sequence level is not TRL 1.16's GSPO transcription
        return out
    if liger := optional("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss"):
        liger_grpo = liger(beta=BETA, use_ref_model=True, loss_type="dapo")
        out["liger"] = lambda i: liger_grpo(
            *(i[k] for k in TENSORS), ref_per_token_logps=i["ref"], old_per_token_logps=i["old"]
        )[0]
    return out


def cases() -> list[Case]:
    runs = [("dapo", "grpo", b, t, {}) for b, t in SHAPES]
    runs += [(f"dapo {label}", "grpo_modes", 16, 1024, opts) for label, opts in MODES]
    out = []
    for label, group, b, t, mode in runs:
        n_valid = b * (t - t // 8)
        meta = {"H": H, "V": V, "B": b, "T": t, "loss_type": "dapo", "beta": BETA, **mode}
        flops = 6 * n_valid * H * V
        out.append(Case(f"grpo {label} B={b} T={t}", group, b * t, flops, inputs(b, t), impls(**mode), meta))
    return out
