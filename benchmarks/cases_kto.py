"""KTO cases: the 16 rows of the 8-pair preference cases (Llama-3-8B head, bf16, the first quarter of each
row prompt) as unpaired completions, the first 8 desirable; TRL 1.16's ``loss_type='kto'``, β=0.1.

``kto 16x1024``: the reference's sequence log-probs and the KL batch's (the policy's and the reference's of
each prompt with the previous row's completion) given, as ``FusedLinearKTOLoss`` and a KTOTrainer with
precomputed reference log-probs take them; floor 6·N_valid·H·V. ``kto+ref 16x1024``: the reference head
(no grad) in the step, floor 8·N_valid·H·V, the form Liger's fused KTO takes (it computes the reference
log-probs itself); the KL term is given in both. chunkloss as ChunkedKTOTrainer runs it (the entropy and
mean-logit metrics too, as TRL's head computes them for its KTOTrainer); torch: bf16 logits, fp32
log-softmax, KTOTrainer's loss.
"""

from __future__ import annotations

import torch

from benchmarks.cases_preference import H, V, inputs, nograd_logps, seq_logps, trl_seq_logps
from benchmarks.harness import Case, optional
from chunkloss import FusedLinearCrossEntropyLoss
from chunkloss.losses.kto import FusedLinearKTOLoss

PAIRS, T, BETA = 8, 1024, 0.1


def _inputs(ref_head: bool):
    base = inputs(PAIRS, T, ref=True)

    def make(device):
        i = base(device)
        y, kl_y = i["labels"], i["labels"].roll(1, 0)
        i["desirable"] = torch.arange(2 * PAIRS, device=device) < PAIRS
        i["ref_logps"] = nograd_logps(i["ref_hidden"], i["ref_weight"], y)
        i["kl_logps"] = nograd_logps(i["hidden"], i["weight"], kl_y)
        i["ref_kl_logps"] = nograd_logps(i["ref_hidden"], i["ref_weight"], kl_y)
        if not ref_head:
            del i["ref_hidden"], i["ref_weight"]
        return i

    return make


def kl_term(i):
    """KTOTrainer's KL term (one process): the KL batch's mean log-ratio, detached, clamped at 0."""
    return (i["kl_logps"] - i["ref_kl_logps"]).mean().detach().clamp(min=0)


def kto_loss(i, logps, ref_fn):
    """KTOTrainer._compute_loss's loss (TRL 1.16, unit weights) from the policy's sequence log-probs; the
    reference's given, or ``ref_fn(ref_hidden, ref_weight, labels)`` without grad."""
    if "ref_hidden" in i:
        with torch.no_grad():
            ref = ref_fn(i["ref_hidden"], i["ref_weight"], i["labels"])
    else:
        ref = i["ref_logps"]
    d, kl = i["desirable"], kl_term(i)
    c, r = torch.nonzero(d).view(-1), torch.nonzero(~d).view(-1)
    chosen = 1 - torch.sigmoid(BETA * ((logps[c] - ref[c]) - kl))
    rejected = 1 - torch.sigmoid(BETA * (kl - (logps[r] - ref[r])))
    return torch.cat((chosen, rejected)).nanmean()


def impls(ref_head: bool) -> dict:
    ours = FusedLinearKTOLoss(beta=BETA, return_token_metrics=True)
    token_loss = FusedLinearCrossEntropyLoss(reduction="none")

    def chunkloss(i):
        y, ref = i["labels"], i["ref_logps"]
        if ref_head:  # the reference's token log-probs through the chunked head, as the trainer's LoRA path
            with torch.no_grad():
                ref = -token_loss(i["ref_hidden"], i["ref_weight"], y).sum(-1)
        kl = {"kl_logps": i["kl_logps"], "ref_kl_logps": i["ref_kl_logps"]}
        return ours(i["hidden"], i["weight"], y, i["desirable"], ref_logps=ref, **kl)

    out = {
        "chunkloss": chunkloss,
        "torch": lambda i: kto_loss(
            i, seq_logps(i["hidden"], i["weight"], i["labels"])[0], lambda *a: seq_logps(*a)[0]
        ),
    }
    if optional("trl.kernels.chunked_logprob", "ChunkedLogProbFunction"):
        # KTOTrainer asks the policy's head for the entropy and mean logits too, the reference's for none.
        out["trl 1.16 head"] = lambda i: kto_loss(
            i, trl_seq_logps(i["hidden"], i["weight"], i["labels"], ("entropy", "mean_logits")), trl_seq_logps
        )
    if not ref_head:
        return out
    if liger := optional("liger_kernel.chunked_loss", "LigerFusedLinearKTOLoss"):
        liger_kto = liger(beta=BETA, use_ref_model=True)

        def liger_loss(i):
            policy, ref = (i["hidden"], i["weight"], i["labels"]), (i["ref_hidden"], i["ref_weight"])
            return liger_kto(*policy, None, i["desirable"], *ref, None, kl_term(i))[0]

        out["liger"] = liger_loss
    return out


def cases() -> list[Case]:
    rows = 2 * PAIRS
    n_valid = rows * (T - T // 4)
    meta = {"H": H, "V": V, "B": rows, "T": T, "prompt": T // 4, "desirable": PAIRS, "beta": BETA}
    out = []
    for name, ref in (("kto", False), ("kto+ref", True)):
        flops = (8 if ref else 6) * n_valid * H * V
        out.append(Case(f"{name} {rows}x{T}", "kto", rows * T, flops, _inputs(ref), impls(ref), meta))
    return out
