"""torch's private names that chunkloss uses, and its version workarounds.

Supported: torch 2.6 and later (``pyproject.toml``); each accessor names the versions it was written for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = [
    "FSDP2_HOOK_MODULE",
    "GUARD_LOCATION_BUG",
    "PRIVATE_NAMES",
    "backward_hooks",
    "dynamo_error",
    "forward_hooks",
    "guard_location_fix",
    "has_scaled_mm",
    "mark_rows_dynamic",
    "no_saved_tensor_hooks",
    "scaled_mm",
    "top_saved_tensor_hooks",
    "version_counter",
]

#: Every private torch name used here, as ``(object path, attribute)``: ``tests/test_compat.py`` checks each.
PRIVATE_NAMES = (
    ("torch._C._autograd", "_top_saved_tensors_default_hooks"),
    ("torch._C._autograd", "_pop_saved_tensors_default_hooks"),
    ("torch._C._autograd", "_push_saved_tensors_default_hooks"),
    ("torch._dynamo", "maybe_mark_dynamic"),
    ("torch._dynamo.exc", "TorchDynamoException"),
    ("torch._guards", "SLoc"),
    ("torch.utils._traceback", "format_frame"),
    ("torch.distributed.fsdp._fully_shard", "FSDPModule"),
    ("torch", "_scaled_mm"),
)

#: The module prefix of FSDP2's forward hooks (``FSDPState._pre_forward`` / ``_post_forward`` and their
#: grouped wrappers), torch 2.6 and later: ``torch.distributed.fsdp._fully_shard``.
FSDP2_HOOK_MODULE = "torch.distributed.fsdp._fully_shard."


# --- saved-tensor hooks ---------------------------------------------------------------------------------


def top_saved_tensor_hooks() -> tuple | None:
    """The innermost ``(pack, unpack)`` saved-tensor hooks open now, or None:
    ``torch._C._autograd._top_saved_tensors_default_hooks(False)`` (torch 2.6 and later)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@contextlib.contextmanager
def no_saved_tensor_hooks() -> Iterator[None]:
    """The block runs with no saved-tensor hooks open; those open before it are put back after it, in their
    order. torch has no public way to suspend them: ``torch._C._autograd``'s ``_top_``, ``_pop_`` and
    ``_push_saved_tensors_default_hooks`` (torch 2.6 and later)."""
    autograd = torch._C._autograd
    stack = []
    while (top := autograd._top_saved_tensors_default_hooks(False)) is not None:
        stack.append(top)
        autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            autograd._push_saved_tensors_default_hooks(pack, unpack)


def version_counter(t: Tensor) -> int:
    """``t._version``: the count of in-place writes to ``t``'s storage (torch 1.x and later)."""
    return t._version


# --- module hooks ---------------------------------------------------------------------------------------


def forward_hooks(module: nn.Module) -> list:
    """``module``'s forward pre-hooks and forward hooks, in that order (``nn.Module._forward_pre_hooks`` and
    ``_forward_hooks``, torch 1.x and later; torch has no public reader)."""
    return [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]


def backward_hooks(module: nn.Module) -> list:
    """``module``'s backward pre-hooks and backward hooks (``nn.Module._backward_pre_hooks`` and
    ``_backward_hooks``, torch 2.0 and later)."""
    return [*module._backward_pre_hooks.values(), *module._backward_hooks.values()]


# --- fp8 GEMM -----------------------------------------------------------------------------------------


def has_scaled_mm() -> bool:
    """Whether this torch has ``torch._scaled_mm``, its fp8 GEMM (written for torch 2.11 to 2.13, whose CUDA
    and CPU builds take row-wise scales; torch has no public fp8 matmul)."""
    return hasattr(torch, "_scaled_mm")


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias, out_dtype) -> Tensor:
    """``torch._scaled_mm``: ``(scale_a ⊙ a)·(b ⊙ scale_b) + bias`` in ``out_dtype`` for e4m3 ``a`` (M, K)
    and ``b`` (K, N), one fp32 scale per row of ``a`` and per column of ``b`` (torch 2.11 to 2.13)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)


# --- torch.compile ------------------------------------------------------------------------------------


def mark_rows_dynamic(t: Tensor) -> None:
    """Dim 0 of ``t`` dynamic for the next compiled call, unless dynamo must specialise it:
    ``torch._dynamo.maybe_mark_dynamic(t, 0)`` (torch 2.1 and later; no ``torch.compiler`` name in 2.13)."""
    torch._dynamo.maybe_mark_dynamic(t, 0)


def dynamo_error() -> type[Exception]:
    """The base class of dynamo's errors, ``torch._dynamo.exc.TorchDynamoException`` (torch 2.0 and later),
    which the backend's failures (``BackendCompilerFailed``) derive from."""
    return torch._dynamo.exc.TorchDynamoException


#: torch versions whose ``SLoc.__str__`` calls ``format_frame(None)`` for a shape guard without a source
#: location (``AttributeError: 'NoneType' object has no attribute 'filename'`` while dynamo builds the
#: guards; met with torch 2.11, fixed in 2.13).
GUARD_LOCATION_BUG = torch.__version__ < "2.13"


def _sloc_str(self) -> str:
    """torch 2.13's ``SLoc.__str__``: a location of ``None`` prints as empty."""
    from torch.utils._traceback import format_frame

    loc = self.framework_loc
    floc = loc if isinstance(loc, str) else "" if loc is None else format_frame(loc)
    return f"{self.maybe_user_loc} ({floc})" if self.maybe_user_loc is not None else f"({floc})"


@contextlib.contextmanager
def guard_location_fix() -> Iterator[None]:
    """On torch < 2.13 where ``str(SLoc(None, None))`` raises, ``torch._guards.SLoc.__str__`` is torch 2.13's
    for the duration of the block and the original afterwards; elsewhere nothing changes. Can go once the
    minimum torch is 2.13."""
    if not GUARD_LOCATION_BUG:
        yield
        return
    from torch._guards import SLoc

    original = SLoc.__str__
    try:
        str(SLoc(None, None))
        broken = False
    except AttributeError:
        broken = True
    if broken:
        SLoc.__str__ = _sloc_str
    try:
        yield
    finally:
        if broken:
            SLoc.__str__ = original
