import pytest

import chunkloss.base as base


@pytest.fixture
def cuda_steps(monkeypatch):
    """Every loss builds the per-chunk steps it builds on CUDA (its own ``_build_step``: Triton kernels where
    it has them) whatever device its tensors are on, so CPU tests run them through TRITON_INTERPRET=1."""
    monkeypatch.setattr(base, "_SHARED_STEPS", {})  # no step built by an earlier test is reused
    real = base.FusedLinearBase._step_fn
    monkeypatch.setattr(
        base.FusedLinearBase, "_step_fn", lambda self, kind, device_type="cuda": real(self, kind, "cuda")
    )
