"""bench_losses' KTO and RLOO cases on CPU with a tiny head (H=32, V=512; the cases' own B and T): every
implementation installed here runs forward + backward once and agrees with the materialised torch one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from benchmarks import cases_grpo, cases_kto, cases_preference, cases_rloo  # noqa: E402
from tests.child_process import in_child_process  # noqa: E402


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.slow  # the chunked losses compile on CPU
@in_child_process
def test_kto_and_rloo_cases_agree_with_torch_on_a_tiny_head(monkeypatch):
    for mod in (cases_preference, cases_grpo):
        monkeypatch.setattr(mod, "H", 32)
        monkeypatch.setattr(mod, "V", 512)
    cases = cases_kto.cases() + cases_rloo.cases()
    assert [c.name for c in cases] == ["kto 16x1024", "kto+ref 16x1024", "rloo B=16 T=1024"]
    for case in cases:
        inputs = case.make_inputs(torch.device("cpu"))
        leaves = [inputs["hidden"], inputs["weight"]]
        assert {"chunkloss", "torch", "trl 1.16 head"} <= set(case.impls), case.name
        results = {}
        for impl, fn in case.impls.items():
            for t in leaves:
                t.grad = None
            loss = fn(inputs)
            loss.backward()
            results[impl] = (loss.detach().float(), [t.grad.clone() for t in leaves])
        ref_loss, ref_grads = results.pop("torch")
        for impl, (loss, grads) in results.items():
            assert loss == pytest.approx(float(ref_loss), rel=2e-3), (case.name, impl)
            assert max(_rel(g, r) for g, r in zip(grads, ref_grads, strict=True)) < 1e-2, (case.name, impl)
