"""Decoder layers that do not keep their pre-norms' outputs for the backward.

In a pre-norm decoder layer the RMSNorm's output feeds the q/k/v projections (and, after attention, the MLP),
and each of them saves it for its weight gradient: H elements per token for each such norm, while the norm's
own backward already keeps its input. :class:`SavedNorms` is a context for one layer's forward: a norm
registers its output and how to recompute it from that input (:func:`offer`), and every tensor autograd
saves while the context is open that shares the output's storage, unmodified since (its version counter), is
packed as a recipe instead of the tensor. In the backward the first consumer to unpack it runs the same norm
kernel again, once for all of them: the same inputs and the same kernel give the same bits, so the gradients
are those of the run that keeps the output.

Saved-tensor hooks open when the context opens (an offloading ``torch.autograd.graph.save_on_cpu``, a
measurement) keep receiving every other tensor: the context packs through them. Under gradient
checkpointing the layer keeps nothing anyway, and ``patch`` does not open the context.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from chunkloss._compat import torch as torch_compat

__all__ = ["SavedNorms", "offer"]

_ACTIVE: list[SavedNorms] = []


class _Recipe:
    """A norm's output, recomputed on first use in the backward and shared by its consumers."""

    __slots__ = ("fn", "value")

    def __init__(self, fn: Callable[[], Tensor]):
        self.fn, self.value = fn, None

    def get(self) -> Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.fn()
        return self.value


class _View:
    """A saved view of a norm's output: its recipe and where the view lies in the output's storage."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: _Recipe, t: Tensor, base_offset: int):
        self.recipe, self.size, self.stride = recipe, t.size(), t.stride()
        self.offset = t.storage_offset() - base_offset


class _Outer:
    """A tensor packed by the hooks that were open before the context."""

    __slots__ = ("unpack", "packed")

    def __init__(self, unpack, packed):
        self.unpack, self.packed = unpack, packed


def _storage(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if t.numel() else None
    except (RuntimeError, NotImplementedError):  # tensors without a storage (subclasses, fake tensors)
        return None


class SavedNorms:
    """Saved-tensor hooks for one decoder layer's forward; see the module docstring."""

    def __init__(self):
        self.outputs: dict[int, tuple[Tensor, int, _Recipe]] = {}
        self.outer = torch_compat.top_saved_tensor_hooks()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def __enter__(self) -> SavedNorms:
        _ACTIVE.append(self)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        _ACTIVE.remove(self)
        self.outputs.clear()

    def add(self, out: Tensor, recompute: Callable[[], Tensor]) -> None:
        ptr = _storage(out)
        if ptr is not None:
            self.outputs[ptr] = (out, torch_compat.version_counter(out), _Recipe(recompute))

    def pack(self, t: Tensor):
        hit = self.outputs.get(_storage(t))
        if hit is not None:
            out, version, recipe = hit
            if torch_compat.version_counter(t) == version and t.dtype == out.dtype and t.device == out.device:
                return _View(recipe, t, out.storage_offset())
        if self.outer is None:
            return t
        return _Outer(self.outer[1], self.outer[0](t))

    @staticmethod
    def unpack(packed) -> Tensor:
        if type(packed) is _View:
            base = packed.recipe.get()
            return base.as_strided(packed.size, packed.stride, base.storage_offset() + packed.offset)
        if type(packed) is _Outer:
            return packed.unpack(packed.packed)
        return packed


def offer(out: Tensor, recompute: Callable[[], Tensor]) -> None:
    """Register a norm's ``out`` with the innermost open :class:`SavedNorms`, if any: ``recompute()`` gives
    the same values from tensors the backward keeps anyway. An output without grad is left alone: its norm
    has no backward to keep the input, and holding the input instead of the output would save nothing."""
    if _ACTIVE and out.requires_grad:
        _ACTIVE[-1].add(out, recompute)
