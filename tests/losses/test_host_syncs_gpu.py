"""Host syncs per forward+backward on CUDA: each one idles the GPU while the host catches up.

The engine needs the number of rows that take part before it can plan chunks, so a loss syncs once for its
label check and row count; a sequence loss brings its label checks' counts to the host in the same sync as
its per-group counts (``sequence_batch``'s ``host_checks``: GRPO synced twice and DPO three times before).
Everything else (normalisers, metrics) stays on the device. Before this was counted, GRPO's step synced ~12
times (``torch.tensor(x, device=cuda)`` copies from pageable memory and waits for the stream; boolean
indexing of the clip metrics; four syncs in ``sequence_batch``), idling an H100 for a seventh of the step
(docs/design.md).

``torch.cuda.set_sync_debug_mode`` sees the syncs CUDA reports (``cudaStreamSynchronize``, blocking copies);
it is a prototype and may miss some, so these are upper bounds on what it sees, not proofs of none.
"""

import warnings

import pytest
import torch

from chunkloss import FusedLinearCrossEntropyLoss, FusedLinearDPOLoss, FusedLinearGRPOLoss

pytestmark = pytest.mark.gpu
H, V = 64, 512


def _syncs(step) -> list[str]:
    step()  # compile outside the count
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(c.message)[:80] for c in caught if "synchroniz" in str(c.message).lower()]


def _head(rows: int):
    hidden = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return hidden, weight


def test_cross_entropy_one_sync():
    hidden, weight = _head(300)
    labels = torch.randint(0, V, (300,), device="cuda")
    labels[::7] = -100
    loss = FusedLinearCrossEntropyLoss(chunk_size=128)
    syncs = _syncs(lambda: loss(hidden, weight, labels).backward())
    assert len(syncs) <= 1, syncs


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_one_sync(level):
    b, t = 4, 50
    hidden, weight = _head(b * t)
    hidden = hidden.detach().view(b, t, H).requires_grad_()
    ids = torch.randint(0, V, (b, t), device="cuda")
    mask = torch.ones(b, t, dtype=torch.long, device="cuda")
    mask[:, -7:] = 0
    adv = torch.randn(b, device="cuda")
    old, ref = (-6 + 0.1 * torch.randn(b, t, device="cuda") for _ in range(2))
    loss = FusedLinearGRPOLoss(beta=0.04, importance_sampling_level=level, chunk_size=128)
    syncs = _syncs(lambda: loss(hidden, weight, ids, mask, adv, old_logps=old, ref_logps=ref).backward())
    assert len(syncs) <= 1, syncs


def test_dpo_one_sync():
    """The chosen and rejected label checks and the pairs' counts (one pass) in one sync."""
    b, t = 3, 40
    hidden, weight = _head(2 * b * t)
    hidden = hidden.detach().view(2 * b, t, H).requires_grad_()
    chosen, rejected = (torch.randint(0, V, (b, t), device="cuda") for _ in range(2))
    chosen[:, :10] = rejected[:, :10] = -100
    ref_c, ref_r = (-200 * torch.rand(b, device="cuda") for _ in range(2))
    loss = FusedLinearDPOLoss(chunk_size=128)
    syncs = _syncs(
        lambda: loss(
            hidden, weight, chosen, rejected, ref_chosen_logps=ref_c, ref_rejected_logps=ref_r
        ).backward()
    )
    assert len(syncs) <= 1, syncs
