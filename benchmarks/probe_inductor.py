"""The compiled CE step at one chunk (C=3584 rows, V=128256) under inductor settings, with the kernel source.

python -m benchmarks.probe_inductor
"""

import torch
import torch._inductor.config as inductor_config
import triton.testing

from chunkloss import FusedLinearCrossEntropyLoss
from chunkloss.engine._core import _bind, _token_step

V, C = 128256, 3584
SETTINGS = {
    "default": {},
    "online_softmax off": {"online_softmax": False},
    "persistent off": {"triton.persistent_reductions": False},
    "multi_kernel": {"triton.multi_kernel": 1},
    "max_autotune reductions": {"max_autotune_pointwise": True, "coordinate_descent_tuning": True},
}


def main():
    loss = FusedLinearCrossEntropyLoss()
    logits0 = (torch.randn(C, V, device="cuda") * 2).bfloat16()
    tok = {"labels": torch.randint(0, V, (C,), device="cuda")}
    n = torch.tensor(float(C), device="cuda")
    sc = {"normaliser": n, "n_valid": n}
    gib = 2 * C * V / 2**30
    for name, cfg in SETTINGS.items():
        torch._dynamo.reset()
        with inductor_config.patch(cfg):
            fn = torch.compile(_bind(_token_step, type(loss).chunk_loss, loss.options))
            logits = logits0.clone()
            fn(logits, [], tok, sc)
            ms = triton.testing.do_bench(lambda: fn(logits, [], tok, sc), warmup=10, rep=100)
        tbps = 2 * gib * 2**30 / (ms * 1e-3) / 1e12
        print(f"{name:28s} {ms:.3f} ms  ({tbps:.2f} TB/s counting one read and one write)", flush=True)


if __name__ == "__main__":
    main()
