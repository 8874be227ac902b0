import pytest
import torch


@pytest.fixture(autouse=True)
def _kernel_device():
    """Kernel tests build their tensors and models on CUDA when there is one.

    Without a GPU they run on CPU through TRITON_INTERPRET=1 (tests/conftest.py); with one, Triton is
    compiled for the GPU and cannot take CPU tensors, so the same small-shape grid runs there instead.
    """
    if not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device(None)
