import gc
import os

# Triton kernels run through the interpreter on machines without CUDA (CI); it reads this at import.
if not os.environ.get("CUDA_VISIBLE_DEVICES") == "" and os.path.exists("/dev/nvidiactl"):
    pass
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor compiles in the test process (and in the processes the tests start): on a 2-core CPU its pool of
# compile workers, each importing torch, costs more to start than it saves (test_recompile.py's two
# sequence cases measured 43 s -> 32 s). Code generation only; guards and generated code are unchanged.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest
import torch

from tests import child_process

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import triton_interpreter

    triton_interpreter.install()


def pytest_configure(config):
    config.addinivalue_line("markers", "in_child_process: runs in the child process (tests/child_process.py)")


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


def pytest_collection_finish(session):
    """Moves what the imports and the collection made (torch, transformers, TRL, the test modules: most of the
    process's objects) out of the garbage collector's view. Trainers call ``gc.collect()`` at every ``train``
    (accelerate's ``free_memory``), and each full collection walked all of them: about a quarter of the CPU
    time of the trainer tests. Objects the tests make are collected as before."""
    gc.collect()
    gc.freeze()
    if not session.config.option.collectonly:
        child_process.start(session.items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    return child_process.runtest_protocol(item)


def pytest_sessionfinish(session):
    child_process.stop()
    gc.unfreeze()  # the interpreter's exit frees them as usual


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def cuda_steps():
    """Every loss builds the per-chunk steps it builds on CUDA (Triton kernels where it registered them)
    whatever device its tensors are on, so CPU tests run them through TRITON_INTERPRET=1; no step built by an
    earlier test is reused. Yields the ``StepCache`` (the steps built)."""
    from chunkloss.testing import select_steps

    with select_steps("cuda") as selection:
        yield selection


@pytest.fixture
def fresh_steps():
    """Every loss builds its per-chunk steps afresh (none built by an earlier test is reused)."""
    from chunkloss.testing import select_steps

    with select_steps() as selection:
        yield selection
