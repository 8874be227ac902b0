"""Preference cases (ORPO, DPO with a reference model): Llama-3-8B head (H=4096, V=128256), bf16,
the first quarter of every row is prompt (ignored).

Floor FLOPs: 6·N_valid·H·V for the policy head (forward + two gradient GEMMs) plus 2·N_valid·H·V for
the reference head (forward only). The long-context DPO cases (1 pair × 16k / 32k tokens) are where
chunking over pairs (Liger) grows with T and chunking over tokens (ours, two passes) does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness import Case, head_inputs, optional
from chunkloss.losses.dpo import FusedLinearDPOLoss
from chunkloss.losses.orpo import FusedLinearORPOLoss

H, V = 4096, 128256


def inputs(pairs: int, t: int, ref: bool):
    def make(device):
        g, hidden, weight = head_inputs(device, 2 * pairs, t, hidden=H, vocab=V)
        labels = torch.randint(0, V, (2 * pairs, t), generator=g)
        labels[:, : t // 4] = -100
        out = {"hidden": hidden, "weight": weight, "labels": labels.to(device), "pairs": pairs}
        if ref:
            noise = torch.randn(2 * pairs, t, H, generator=g).to(device)
            out["ref_hidden"] = (hidden.detach().float() + 0.1 * noise).to(torch.bfloat16)
            noise = torch.randn(V, H, generator=g).to(device)
            out["ref_weight"] = (weight.detach().float() + 0.002 * noise).to(torch.bfloat16)
        return out

    return make


def seq_logps(hidden, weight, labels, average: bool = False):
    """Materialised: bf16 model logits, then fp32 log-softmax (as TRL's trainers do)."""
    logits = hidden @ weight.t()
    mask = labels != -100
    lp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    s = (lp * mask).sum(-1)
    return (s / mask.sum(-1).clamp(min=1) if average else s), logits


def nograd_logps(hidden, weight, labels):
    """:func:`seq_logps` without grad, one row at a time (a case's given log-probs)."""
    with torch.no_grad():
        return torch.cat([seq_logps(h[None], weight, y[None])[0] for h, y in zip(hidden, labels)])


def trl_seq_logps(hidden, weight, labels, outputs: tuple[str, ...] = ()):
    """TRL 1.16's fused head (``ChunkedLogProbFunction``) on the completion tokens, asked for ``outputs`` as
    well, summed per sequence as TRL's trainers take them: a masked torch.sum over each row (pairwise, where
    index_add's one-at-a-time fp32 sum drifts by ~0.3 nats over 16k tokens)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    mask = labels != -100
    args = (hidden[mask], weight, None, labels[mask], 1.0, 4096, None, 1.0, outputs)
    lp = ChunkedLogProbFunction.apply(*args)[0]
    return torch.zeros(labels.shape, device=lp.device, dtype=lp.dtype).masked_scatter(mask, lp).sum(-1)


def _torch_orpo(i, beta=0.1):
    b = i["pairs"]
    logps, logits = seq_logps(i["hidden"], i["weight"], i["labels"], True)
    c, r = logps[:b], logps[b:]
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    nll = F.cross_entropy(logits[:b].float().flatten(0, 1), i["labels"][:b].flatten())
    return nll - beta * F.logsigmoid(log_odds).mean()


def _torch_dpo(i, beta=0.1):
    b = i["pairs"]
    logps, _ = seq_logps(i["hidden"], i["weight"], i["labels"], False)
    with torch.no_grad():
        ref, _ = seq_logps(i["ref_hidden"], i["ref_weight"], i["labels"], False)
    d = (logps[:b] - ref[:b]) - (logps[b:] - ref[b:])
    return -F.logsigmoid(beta * d).mean()


def _orpo_impls() -> dict:
    ours = FusedLinearORPOLoss()
    b = lambda i: i["pairs"]  # noqa: E731
    out = {
        "chunkloss": lambda i: ours(i["hidden"], i["weight"], i["labels"][: b(i)], i["labels"][b(i) :]),
        "torch": _torch_orpo,
    }
    if liger := optional("liger_kernel.chunked_loss", "LigerFusedLinearORPOLoss"):
        liger_orpo = liger()
        out["liger"] = lambda i: liger_orpo(i["weight"], i["hidden"], i["labels"])[0]
    return out


def _dpo_impls() -> dict:
    ours = FusedLinearDPOLoss()

    def chunkloss(i):
        b, y, ref = i["pairs"], i["labels"], dict(ref_hidden=i["ref_hidden"], ref_weight=i["ref_weight"])
        return ours(i["hidden"], i["weight"], y[:b], y[b:], **ref)

    out = {"chunkloss": chunkloss, "torch": _torch_dpo}
    if liger := optional("liger_kernel.chunked_loss", "LigerFusedLinearDPOLoss"):
        liger_dpo = liger(use_ref_model=True)
        out["liger"] = lambda i: liger_dpo(
            i["weight"], i["hidden"], i["labels"], None, i["ref_hidden"], i["ref_weight"]
        )[0]
    if optional("trl.kernels.chunked_logprob", "ChunkedLogProbFunction"):

        def trl_head(i, beta=0.1):
            """TRL 1.16's fused head on the completion tokens, then DPOTrainer's sigmoid loss."""
            b, y = i["pairs"], i["labels"]
            pol = trl_seq_logps(i["hidden"], i["weight"], y)
            with torch.no_grad():
                ref = trl_seq_logps(i["ref_hidden"], i["ref_weight"], y)
            d = (pol[:b] - ref[:b]) - (pol[b:] - ref[b:])
            return -F.logsigmoid(beta * d.float()).mean()

        out["trl 1.16 head"] = trl_head
    return out


def cases() -> list[Case]:
    out = []
    orpo, dpo = _orpo_impls(), _dpo_impls()
    for name, group, pairs, t, fns, ref in [
        ("orpo 8x1024", "orpo", 8, 1024, orpo, False),
        ("dpo+ref 8x1024", "dpo", 8, 1024, dpo, True),
        ("dpo+ref 1x16384", "dpo", 1, 16384, dpo, True),
        ("dpo+ref 1x32768", "dpo", 1, 32768, dpo, True),
    ]:
        n_valid = 2 * pairs * (t - t // 4)
        flops = (6 + (2 if ref else 0)) * n_valid * H * V
        meta = {"H": H, "V": V, "pairs": pairs, "T": t, "prompt": t // 4}
        out.append(Case(name, group, 2 * pairs * t, flops, inputs(pairs, t, ref), fns, meta))
    return out
