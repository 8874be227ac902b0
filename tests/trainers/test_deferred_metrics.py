"""``trainers._metrics``: the numbers the chunked trainers log equal TRL's ``.item()`` ones.

The trainers' parity tests compare whole logged steps with TRL's; these pin the two helpers on the edge cases
those batches may not reach (a zero count, float64 means, NaN, values already fetched by TRL's own code).
"""

import math

import torch

from chunkloss.trainers._metrics import fetch_metrics, mean_or_zero


def test_mean_or_zero_is_trls_guarded_mean():
    total32 = torch.tensor(7.3, dtype=torch.float32)
    total64 = total32.double()  # DPO's logits means: TRL divides two fetched Python numbers
    for count in (0, 1, 3, 1000):
        n = torch.tensor(count)
        for total in (total32, total64):
            want = (total / n).item() if n > 0 else 0.0
            got = mean_or_zero(total, n)
            assert got.dtype == total.dtype and got.dim() == 0
            assert got.item() == want
    assert mean_or_zero(torch.tensor(float("nan")), torch.tensor(0)).item() == 0.0


def test_fetch_metrics_replaces_tensors_in_place():
    store = {
        "entropy": [0.25, torch.tensor(1.5), torch.tensor(2.0 / 3.0)],  # 2/3 is not exact in fp32
        "kl": [torch.tensor(float("nan"))],
        "num_tokens": [12],
    }
    other = {"logps/chosen": [torch.tensor(-3.25, dtype=torch.float64)]}
    want = {
        "entropy": [0.25, 1.5, torch.tensor(2.0 / 3.0).item()],
        "logps/chosen": [-3.25],
        "num_tokens": [12],
    }
    fetch_metrics(store, other)
    assert store["entropy"] == want["entropy"] and all(type(v) is float for v in store["entropy"])
    assert math.isnan(store["kl"][0]) and type(store["kl"][0]) is float
    assert store["num_tokens"] == [12] and type(store["num_tokens"][0]) is int
    assert other["logps/chosen"] == want["logps/chosen"]
    fetch_metrics({}, {"empty": []})  # nothing to fetch
