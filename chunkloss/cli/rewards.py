"""Resolving the ``reward_funcs`` of a GRPO config.

Each entry is, in this order: a name registered in :data:`chunkloss.data.REWARD_FUNCS`; ``module:function``
(or TRL's dotted ``module.function``); a local reward model folder; or a hub model id ``org/name``, which is
looked up on the hub (or, with ``HF_HUB_OFFLINE`` set, in the local cache) before it is accepted. Anything
else fails at once with the registered names.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from collections.abc import Callable

from .errors import ConfigError

# A hub model id: "org/name" of letters, digits, '-', '_' and '.'.
_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def reward_funcs(names: list[str]) -> list[Callable | str]:
    """The reward functions of ``names`` (a reward model stays a string: GRPOTrainer loads it)."""
    if isinstance(names, str):
        names = [names]
    if not names:
        raise ConfigError("reward_funcs: name at least one reward")
    return [_resolve(name) for name in names]


def _resolve(name: str) -> Callable | str:
    from chunkloss.data import REWARD_FUNCS

    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]
    if ":" in name and not os.path.exists(name):
        return _import(name, *name.split(":", 1))
    if os.path.isdir(name):
        return name
    if "." in name and "/" not in name and not name.startswith("."):
        return _import(name, *name.rsplit(".", 1))
    if _MODEL_ID.fullmatch(name):
        return _hub_model(name)
    raise ConfigError(
        f"reward_funcs: unknown reward {name!r}; use a registered name ({', '.join(REWARD_FUNCS)}), "
        "'module:function', a local reward model folder or a hub model id (org/name)"
    )


def _import(name: str, module: str, attr: str) -> Callable:
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"reward_funcs: cannot import {name!r}: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"reward_funcs: {name!r} is not a function")
    return fn


@functools.cache
def _hub_model(name: str) -> str:
    """``name`` if the hub (or, offline, the local cache) has that model; ConfigError otherwise."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    if constants.HF_HUB_OFFLINE:
        if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
            return name
        raise ConfigError(
            f"reward_funcs: {name!r} is not a registered reward or an importable function, and the reward "
            "model is not in the local cache (HF_HUB_OFFLINE is set)"
        )
    try:
        huggingface_hub.model_info(name, timeout=10)
    except errors.GatedRepoError:
        return name  # exists; access is checked when the model loads
    except errors.RepositoryNotFoundError:
        raise ConfigError(
            f"reward_funcs: {name!r} is not a registered reward, an importable function or a model on the hub"
        ) from None
    except Exception as exc:  # no network, proxy, server error: only a cached copy can be used
        if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
            return name
        raise ConfigError(
            f"reward_funcs: cannot reach the hub to look up {name!r} ({type(exc).__name__})"
        ) from None
    return name
