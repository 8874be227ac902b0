import os

# Triton kernels run through the interpreter on machines without CUDA (CI); it reads this at import.
if not os.environ.get("CUDA_VISIBLE_DEVICES") == "" and os.path.exists("/dev/nvidiactl"):
    pass
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """GPU and multi-GPU tests are skipped without the devices. The quick check (``-m "not slow"``) runs a
    parametrized test at its first parameter set only: every parameter set after the first is marked
    ``slow``, beside the end-to-end runs marked by hand."""
    has_cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if has_cuda else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA devices")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(callspec.indices.values()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def cuda_steps():
    """Every loss builds the per-chunk steps it builds on CUDA (Triton kernels where it registered them)
    whatever device its tensors are on, so CPU tests run them through TRITON_INTERPRET=1; no step built by an
    earlier test is reused. Yields the ``StepSelection`` (the steps built)."""
    from chunkloss.engine.steps import select_steps

    with select_steps("cuda") as selection:
        yield selection


@pytest.fixture
def fresh_steps():
    """Every loss builds its per-chunk steps afresh (none built by an earlier test is reused)."""
    from chunkloss.engine.steps import select_steps

    with select_steps() as selection:
        yield selection
