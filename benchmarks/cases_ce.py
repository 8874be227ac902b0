"""Cross-entropy cases: Llama-3-8B head (H=4096, V=128256), bf16, 1/7 of the labels ignored."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness import Case, head_inputs, optional
from chunkloss import FusedLinearCrossEntropyLoss

H, V = 4096, 128256


def _inputs(n: int):
    def make(device):
        g, hidden, weight = head_inputs(device, n, hidden=H, vocab=V)
        labels = torch.randint(0, V, (n,), generator=g)
        labels[torch.arange(n) % 7 == 0] = -100
        return {"hidden": hidden, "weight": weight, "labels": labels.to(device)}

    return make


def _torch(inp):
    logits = inp["hidden"] @ inp["weight"].t()
    return F.cross_entropy(logits.float(), inp["labels"])


def impls() -> dict:
    ours = FusedLinearCrossEntropyLoss()
    ours_bf16_acc = FusedLinearCrossEntropyLoss(accum_dtype=None)
    out = {
        "chunkloss": lambda i: ours(i["hidden"], i["weight"], i["labels"]),
        "chunkloss (bf16 accum)": lambda i: ours_bf16_acc(i["hidden"], i["weight"], i["labels"]),
        "torch": _torch,
        "torch.compile": torch.compile(_torch),
    }
    if trl_head := optional("trl.kernels.chunked_logprob", "ChunkedLogProbFunction"):

        def trl_loss(i):
            mask = i["labels"] != -100
            args = (i["hidden"][mask], i["weight"], None, i["labels"][mask], 1.0, 4096, None, 1.0, ())
            return -trl_head.apply(*args)[0].sum() / mask.sum().clamp(min=1)

        out["trl 1.16 head"] = trl_loss
    if liger := optional("liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss"):
        liger_ce = liger()
        out["liger"] = lambda i: liger_ce(i["weight"], i["hidden"], i["labels"])
    if cce := optional("cut_cross_entropy", "linear_cross_entropy"):
        out["cce"] = lambda i: cce(i["hidden"], i["weight"], i["labels"])
    return out


def cases() -> list[Case]:
    fns, meta = impls(), {"H": H, "V": V}
    return [
        Case(f"ce N={n}", "cross_entropy", n, 6 * (n - (n + 6) // 7) * H * V, _inputs(n), fns, meta)
        for n in (8192, 32768)
    ]
