"""``chunk_long_context``: what a chunked trainer turns on to train long sequences on one GPU.

1. **Checkpointing** (``activation_checkpointing``, the trainer's own): each decoder layer keeps only its
   input for the backward, which runs the layer's forward again.
2. **Offloading what checkpointing keeps** (TRL's ``OffloadActivations``,
   ``trl/models/activation_offloading.py``, after torchtune's): saved-tensor hooks copy each saved tensor of 1
   KiB or more (under checkpointing: each layer's input) to pinned host memory on a side stream during the
   forward and bring it back, ahead of the backward that reads it, on another; the LM head's saved tensors
   stay on the GPU. TRL's SFT and DPO trainers build it from their own ``activation_offloading`` field, which
   this sets; for the other trainers it is built here and entered around each training step, as TRL's trainers
   do.
3. **The tiled MLP** (with the kernels): the fused MLP saves only its input and runs over tiles of
   :data:`MLP_TILE` tokens (``chunkloss.models.patch(..., mlp_recompute=True, mlp_tile=...)``), so its
   ``(tokens, intermediate)`` tensors exist for one tile at a time.
4. **The attention's norm recomputed** (with the kernels): the fused norm + q/k/v + RoPE call keeps its input
   and the per-token ``rstd``, not the normalised input, in the checkpoint's recompute too
   (``patch(..., norm_recompute=True)``): H elements per token fewer in the backward of each layer.

What the GPU then holds grows with the sequence by one layer's working set plus the chunked head's input,
not by the layer count; docs/design.md has the measurement. What the host holds grows by every layer's input,
each in a pinned block that PyTorch's caching host allocator rounds up to a power of two:
:class:`HostMemoryCheck` refuses, in one line before the forward, a batch whose blocks cannot fit in the
machine's memory at all, where the kernel's out-of-memory killer would otherwise end the process mid-step.
"""

from __future__ import annotations

import contextlib
import os
import re

import torch

from chunkloss._compat import transformers as transformers_compat

from ._arguments import ChunkedArguments
from ._common import decoder_layers

#: Tokens per tile of the fused MLP under ``chunk_long_context`` (when ``chunk_kernels_mlp_tile`` is unset):
#: each (tile, I) bf16 tensor is 128 MiB at Llama-3.2-1B's I = 8192, 224 MiB at Llama-3.1-8B's 14336. With
#: these tiles and offloading the step takes the time of checkpointing alone (docs/design.md).
MLP_TILE = 8192


def layer_options(args) -> dict:
    """``patch``'s layer options from a config: ``chunk_kernels_mlp_recompute``, ``chunk_kernels_mlp_tile``
    and ``chunk_kernels_norm_recompute``, all on under ``chunk_long_context``."""
    chunked = ChunkedArguments.of(args)
    long_context, tile = bool(chunked.chunk_long_context), chunked.chunk_kernels_mlp_tile
    if tile is not None and (not isinstance(tile, int) or isinstance(tile, bool) or tile <= 0):
        raise ValueError(f"chunk_kernels_mlp_tile must be a positive int or None, got {tile!r}")
    return {
        "mlp_recompute": bool(chunked.chunk_kernels_mlp_recompute) or long_context,
        "mlp_tile": tile if tile is not None else MLP_TILE if long_context else None,
        "norm_recompute": bool(chunked.chunk_kernels_norm_recompute) or long_context,
    }


def _offloads(args) -> bool:
    """Whether offloading has somewhere to offload from: an accelerator that the run uses (on the CPU the
    activations are in host memory already, and TRL's context needs an accelerator)."""
    return torch.accelerator.current_accelerator() is not None and not args.use_cpu


def enable(args) -> None:
    """Turn on checkpointing, and TRL's activation offloading where the config has the field, before TRL's
    constructor reads them."""
    if not ChunkedArguments.of(args).chunk_long_context:
        return
    transformers_compat.enable_activation_checkpointing(args)
    if hasattr(args, "activation_offloading") and _offloads(args):
        args.activation_offloading = True


def offload_context(trainer):
    """TRL's offloading context for a trainer whose TRL class builds none (GRPO, ORPO, GKD, distillation);
    None when the trainer builds its own, ``chunk_long_context`` is off or the run is on the CPU."""
    args = trainer.args
    if not ChunkedArguments.of(args).chunk_long_context or hasattr(args, "activation_offloading"):
        return None
    if not _offloads(args):
        return None
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    return get_act_offloading_ctx_manager(model=trainer.model)


class LongContextStep:
    """Mixin: each training step inside :func:`offload_context`'s context, when there is one."""

    _chunk_offload = None

    def training_step(self, *args, **kwargs):
        with self._chunk_offload or contextlib.nullcontext():
            return super().training_step(*args, **kwargs)


#: ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` keys (torch 2.13) above whose size, in MiB, a pinned
#: block is not rounded up.
_UNROUNDED_ABOVE = re.compile(r"pinned_max_(?:cached_size|round_threshold)_mb:(\d+)")
GiB = 2**30


def pinned_block_bytes(nbytes: int, env=os.environ) -> int:
    """The pinned host memory PyTorch's caching host allocator takes for an ``nbytes`` request: the next power
    of two, or ``nbytes`` above a size the allocator's config (``env``) exempts from rounding."""
    config = ",".join(env.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    limits = [int(mb) * 2**20 for mb in _UNROUNDED_ABOVE.findall(config)]
    if limits and nbytes > min(limits):
        return nbytes
    return 1 << max(nbytes - 1, 0).bit_length()


class HostMemoryCheck:
    """Forward pre-hook of the first decoder layer while offloading: each new largest batch's pinned blocks
    (one per decoder layer, ``pinned_block_bytes`` of the layer input's bytes) plus what the process held when
    the trainer was built, against the machine's memory. A batch that cannot fit raises ``MemoryError`` with
    one line before its forward runs.

    Args:
        layers: the decoder layers whose inputs are offloaded.
        held: the process's resident bytes before training, less file-backed and shared pages.
        total: the machine's memory in bytes.
    """

    def __init__(self, layers: int, held: int, total: int):
        self.layers, self.held, self.total = layers, held, total
        self.largest = 0  # elements of the largest layer input checked so far

    def __call__(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            return  # a compiled layer: no guard on the batch's size (the check runs in eager steps)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if not (torch.is_grad_enabled() and module.training and isinstance(hidden, torch.Tensor)):
            return  # nothing is saved, so nothing is offloaded
        if hidden.numel() <= self.largest:
            return
        self.largest = hidden.numel()
        nbytes = hidden.numel() * hidden.element_size()
        block = pinned_block_bytes(nbytes)
        need = self.layers * block
        if need + self.held > self.total:
            tokens = hidden.numel() // hidden.shape[-1]
            raise MemoryError(
                f"chunk_long_context: offloading this batch's {tokens} tokens needs {need / GiB:.1f} GiB "
                f"of pinned host memory ({self.layers} decoder-layer inputs of {nbytes / GiB:.2f} GiB, each "
                f"taking {block / GiB:.2f}: PyTorch's pinned-memory allocator rounds blocks up to a power of "
                f"two) on top of the {self.held / GiB:.1f} GiB this process holds, more than the machine's "
                f'{self.total / GiB:.1f} GiB; train fewer tokens per device (docs/design.md, "Long context")'
            )


def check_host_memory(trainer):
    """Put :class:`HostMemoryCheck` on the first decoder layer of a trainer that offloads
    (``chunk_long_context`` on an accelerator); the hook's handle, or None."""
    args = trainer.args
    if not ChunkedArguments.of(args).chunk_long_context or not _offloads(args):
        return None
    import psutil  # accelerate's dependency, as TRL's offloading's

    layers = decoder_layers(trainer)
    if not layers:
        return None
    # Resident memory less its file-backed and shared pages (a model read through mmap, which the kernel can
    # reclaim): what the process holds that pinned blocks cannot take.
    mem = psutil.Process().memory_info()
    held, total = mem.rss - getattr(mem, "shared", 0), psutil.virtual_memory().total
    return layers[0].register_forward_pre_hook(HostMemoryCheck(len(layers), held, total), with_kwargs=True)
