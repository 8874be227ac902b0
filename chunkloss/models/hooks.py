"""Fused calls that read the parameters of several modules, run inside those modules' forwards.

FSDP2 (``fully_shard``) and DeepSpeed ZeRO-3 keep a parameter sharded outside the forward of the module that
holds it. The module's forward pre-hook gathers it; a hook on the forward's outputs gathers it again before
their backward; the backward of the forward's inputs frees it, and FSDP2 reduce-scatters its gradient there
(ZeRO-3 in a hook on the parameter's gradient accumulation, which needs the parameter gathered). A fused call
that reads ``q_proj.weight``, ``k_proj.weight``, ... or ``lm_head.weight`` without calling those modules
would see shards, and its gradients would reach a parameter that is no longer gathered.

:func:`run_inside` calls ``fn(x)`` as the forward of the innermost of those modules, nested in the forwards of
the others, so that each module's hooks run around it as they run around the module's own forward: before
the call, on its outputs before their backward and on its input after its backward. Hooks that do other things
(accelerate's ``_hf_hook``, a user's, backward hooks) would see ``fn``'s result as the module's output;
:func:`gathering_hooks_only` tells the fused kernels which modules they may run inside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from chunkloss._compat import accelerate as accelerate_compat
from chunkloss._compat import torch as torch_compat

__all__ = ["gathering_hooks_only", "hooked_owners", "run_inside"]

# The modules that define FSDP2's and DeepSpeed's forward hooks (torch_compat.FSDP2_HOOK_MODULE; ZeRO-3's
# _pre_forward_module_hook, _post_backward_module_hook, _pre_backward_module_hook and
# _post_forward_module_hook, the last wrapped by deepspeed.utils.nvtx).
_GATHERING_HOOKS = (torch_compat.FSDP2_HOOK_MODULE, "deepspeed.")


def gathering_hooks_only(module: nn.Module) -> bool:
    """Whether ``module`` has no forward hooks or only FSDP2's and DeepSpeed's, and no backward hook or
    accelerate ``_hf_hook``: a fused call that reads its parameters may run inside its forward."""
    if accelerate_compat.has_hf_hook(module) or torch_compat.backward_hooks(module):
        return False
    hooks = torch_compat.forward_hooks(module)
    return all(str(getattr(h, "__module__", "")).startswith(_GATHERING_HOOKS) for h in hooks)


def hooked_owners(roots: Iterable[nn.Module], recurse: bool = True) -> list[nn.Module]:
    """The modules of ``roots`` (with their submodules when ``recurse``) that have forward hooks and hold
    parameters, each once, outermost first: the forwards a fused call reading those parameters runs inside."""
    out, seen = [], set()
    for root in roots:
        for module in root.modules() if recurse else (root,):
            # Hooks first: ``id`` of a module traced by Dynamo guards on that very object, and would give each
            # decoder layer a graph of its own under torch.compile.
            if not torch_compat.forward_hooks(module) or id(module) in seen:
                continue
            seen.add(id(module))
            if next(module.parameters(), None) is not None:
                out.append(module)
    return out


_NO_FORWARD = object()


def run_inside(modules: list[nn.Module], fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn(x)`` run as the forward of ``modules[-1]``, called from the forward of ``modules[-2]``, ... and
    of ``modules[0]`` (each receives what the hooks before it pass on); ``fn(x)`` itself when ``modules`` is
    empty. Each module's forward is its own again when the call returns or raises."""
    if not modules:
        return fn(x)
    module, rest = modules[0], modules[1:]
    own = module.__dict__.get("forward", _NO_FORWARD)
    module.forward = (lambda y: run_inside(rest, fn, y)) if rest else fn
    try:
        return module(x)
    finally:
        if own is _NO_FORWARD:
            del module.forward
        else:
            module.forward = own
