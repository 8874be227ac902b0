# The patched models' tests build on CUDA when there is one, as the kernels' tests do.
from tests.kernels.conftest import _kernel_device  # noqa: F401
