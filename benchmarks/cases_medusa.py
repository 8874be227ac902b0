"""Multi-token (Medusa) heads, Llama-3-8B's head (H=4096, V=128256), bf16, N = 8 x 1024 positions; not in
``bench_losses``' default run (``python -m benchmarks.bench_losses --only medusa --name medusa``).

Head k predicts the token k places ahead from its own hidden state, weight 0.8^k; one shared (V, H) weight or
one per head. ``FusedLinearMultiTokenLoss`` (fp32 accumulator; bf16 accumulator as Liger's; with Liger's rows
per chunk, ``next_pow2(ceil(N / ceil(V / H)))``), materialised fp32 logits per head (Medusa's code), Liger's
fused cross-entropy per head, and chunkloss's cross-entropy on one head (the unit of ``K x one head``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness import Case, optional
from chunkloss import FusedLinearCrossEntropyLoss, FusedLinearMultiTokenLoss

B, T, H, V = 8, 1024, 4096, 128256
N = B * T


def head_weights(k: int) -> tuple[float, ...]:
    return tuple(0.8**i for i in range(k))


def _inputs(k: int, form: str):
    """``hidden{i}`` (B, T, H) per head; ``weight`` (V, H) shared or ``weight{i}`` per head; ``labels``."""

    def make(device):
        g = torch.Generator(device="cpu").manual_seed(0)

        def leaf(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16).requires_grad_()

        inputs = {f"hidden{i}": leaf(B, T, H) for i in range(k)}
        names = ["weight"] if form == "shared" else [f"weight{i}" for i in range(k)]
        inputs.update({name: leaf(V, H, scale=H**-0.5) for name in names})
        inputs["labels"] = torch.randint(0, V, (B, T), generator=g).to(device)
        return inputs

    return make


def _head(inputs: dict, i: int):
    """Head i's hidden state, weight and targets shifted by i (ignored at the end)."""
    labels = inputs["labels"]
    target = torch.full_like(labels, -100)
    target[:, : labels.shape[1] - i] = labels[:, i:]
    return inputs[f"hidden{i}"], inputs.get("weight", inputs.get(f"weight{i}")), target


def _weighted(k: int, head_loss):
    """``inputs -> Σ_i 0.8^i · head_loss(hidden_i, weight_i, target_i, i)`` over the ``k`` heads."""
    return lambda inp: sum(w_i * head_loss(*_head(inp, i), i) for i, w_i in enumerate(head_weights(k)))


def liger_chunk_rows(n: int, hidden: int, vocab: int) -> int:
    rows = -(-n // -(-vocab // hidden))
    return 1 << (rows - 1).bit_length()


def impls(k: int) -> dict:
    def lists(inp):
        w = inp["weight"] if "weight" in inp else [inp[f"weight{i}"] for i in range(k)]
        return [inp[f"hidden{i}"] for i in range(k)], w, inp["labels"]

    ours = FusedLinearMultiTokenLoss(head_weights(k))
    bf16 = FusedLinearMultiTokenLoss(head_weights(k), accum_dtype=torch.bfloat16)
    liger_rows = liger_chunk_rows(N, H, V)
    small = FusedLinearMultiTokenLoss(head_weights(k), accum_dtype=torch.bfloat16, chunk_size=liger_rows)

    def materialised(h, w, target, i):  # one head's fp32 logits, as Medusa's code
        z = h[:, : T - i] @ w.t()
        return F.cross_entropy(z.float().flatten(0, 1), target[:, : T - i].flatten())

    out = {
        "chunkloss": lambda i: ours(*lists(i)),
        "chunkloss_bf16_accum": lambda i: bf16(*lists(i)),
        "chunkloss_bf16_accum_liger_chunks": lambda i: small(*lists(i)),
        "torch": _weighted(k, materialised),
    }
    if liger := optional("liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss"):
        liger_ce = liger()
        out["liger"] = _weighted(k, lambda h, w, target, i: liger_ce(w, h.reshape(-1, H), target.reshape(-1)))
    return out


def cases() -> list[Case]:
    ce = FusedLinearCrossEntropyLoss()

    def single(device):
        inputs = _inputs(1, "shared")(device)
        return {"hidden": inputs.pop("hidden0"), **inputs}

    one = {"chunkloss_single_head": lambda i: ce(i["hidden"], i["weight"], i["labels"])}
    out = [Case(f"single head N={N}", "medusa", N, 6 * N * H * V, single, one, {"heads": 1})]
    for k in (3, 5):
        for form in ("shared", "per_head"):
            flops = 6 * sum(N - B * i for i in range(k)) * H * V
            meta = {"heads": k, "form": form}
            out.append(Case(f"K={k} {form} N={N}", "medusa", N, flops, _inputs(k, form), impls(k), meta))
    return out
