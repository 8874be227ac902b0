"""Cross-entropy cases: Llama-3-8B head (H=4096, V=128256), bf16, 1/7 of the labels ignored."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from benchmarks.harness import Case
from chunkloss import FusedLinearCrossEntropyLoss

H, V = 4096, 128256


def _inputs(n: int):
    def make(device):
        g = torch.Generator(device="cpu").manual_seed(0)
        hidden = (torch.randn(n, H, generator=g) * 0.5).to(device, torch.bfloat16).requires_grad_()
        weight = (torch.randn(V, H, generator=g) * 0.02).to(device, torch.bfloat16).requires_grad_()
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
    with contextlib.suppress(ImportError):
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        def trl_head(i):
            mask = i["labels"] != -100
            logps = ChunkedLogProbFunction.apply(
                i["hidden"][mask], i["weight"], None, i["labels"][mask], 1.0, 4096, None, 1.0, ()
            )[0]
            return -logps.sum() / mask.sum().clamp(min=1)

        out["trl 1.16 head"] = trl_head
    with contextlib.suppress(ImportError):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda i: liger(i["weight"], i["hidden"], i["labels"])
    with contextlib.suppress(ImportError):
        from cut_cross_entropy import linear_cross_entropy

        out["cce"] = lambda i: linear_cross_entropy(i["hidden"], i["weight"], i["labels"])
    return out


def cases() -> list[Case]:
    fns = impls()
    out = []
    for n in (8192, 32768):
        n_valid = n - (n + 6) // 7
        out.append(
            Case(f"ce N={n}", "cross_entropy", n, 6 * n_valid * H * V, _inputs(n), fns, {"H": H, "V": V})
        )
    return out
