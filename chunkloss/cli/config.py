"""Reading a ``chunkloss train`` config.

TRL's ``TrlParser`` parses the YAML keys into the chosen trainer's config class, TRL's ``ModelConfig`` and
:class:`RunArguments`, and the config classes check their own values. This module adds only what they do not
do: picking the trainer, the ``tiny_model`` and dataset keys, the values TRL accepts but training later
fails on (a negative learning rate, an unknown loss type, a missing data file, ...), and one-line errors that
name the key.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
from dataclasses import dataclass, field
from typing import Literal

from .checks import check_run
from .errors import ConfigError

__all__ = [
    "TRAINERS",
    "ConfigError",
    "RunArguments",
    "TrainerEntry",
    "load_config",
    "make_parser",
    "read_yaml",
    "trainer_classes",
    "trainer_name",
]


@dataclass(frozen=True)
class TrainerEntry:
    """Where the trainer of one ``trainer:`` value lives and what data it trains on."""

    module: str  # module under chunkloss.trainers
    trainer: str  # trainer class name
    config: str  # config class name
    data: str  # kind passed to chunkloss.data.tiny_dataset
    about: str  # one line for --help

    @classmethod
    def of(cls, name: str, stem: str, about: str, data: str | None = None) -> TrainerEntry:
        """``Chunked<stem>Trainer`` and ``Chunked<stem>Config`` of ``chunkloss.trainers.<name>``, trained on
        data of kind ``data`` (default: ``name``)."""
        trainer, config = f"Chunked{stem}Trainer", f"Chunked{stem}Config"
        return cls(f"chunkloss.trainers.{name}", trainer, config, data or name, about)


TRAINERS: dict[str, TrainerEntry] = {
    "sft": TrainerEntry.of("sft", "SFT", "supervised fine-tuning (chunked cross-entropy / DFT)"),
    "grpo": TrainerEntry.of("grpo", "GRPO", "online RL with group-relative advantages (needs reward_funcs)"),
    "rloo": TrainerEntry.of(
        "rloo", "RLOO", "online RL with leave-one-out advantages (needs reward_funcs)", data="grpo"
    ),
    "dpo": TrainerEntry.of("dpo", "DPO", "direct preference optimisation (prompt/chosen/rejected)"),
    "orpo": TrainerEntry.of("orpo", "ORPO", "odds-ratio preference optimisation, no reference model"),
    "kto": TrainerEntry.of("kto", "KTO", "Kahneman-Tversky optimisation (prompt/completion/label, unpaired)"),
    "gkd": TrainerEntry.of("gkd", "GKD", "generalised knowledge distillation (needs a teacher)"),
    "distillation": TrainerEntry.of(
        "distillation", "Distillation", "on-policy distillation (needs a teacher)"
    ),
    "medusa": TrainerEntry.of(
        "medusa", "Medusa", "Medusa heads: extra heads predicting tokens further ahead (SFT data)", data="sft"
    ),
}


@dataclass
class RunArguments:
    """chunkloss's own run keys (the rest of a config is the trainer's config and TRL's ModelConfig)."""

    trainer: Literal["sft", "grpo", "rloo", "dpo", "orpo", "kto", "gkd", "distillation", "medusa"] = field(
        default=None, metadata={"help": "Which trainer runs: " + ", ".join(TRAINERS) + "."}
    )
    tiny_model: dict | None = field(
        default=None,
        metadata={
            "help": "Build a randomly initialised model instead of loading one: a mapping with keys "
            "family (a transformers model type, e.g. qwen3, llama), hidden_size (a multiple of 4), "
            "num_layers. Uses the built-in tokenizer."
        },
    )
    teacher_tiny_model: dict | None = field(
        default=None,
        metadata={
            "help": "gkd/distillation: a random teacher of this shape (keys as tiny_model) instead of "
            "teacher_model_name_or_path."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer hub id or path (default: model_name_or_path)."}
    )
    dataset: str = field(
        default="tiny",
        metadata={
            "help": "'tiny' (the built-in counting task), a hub dataset id, or a local path: a "
            "save_to_disk folder, a .json/.jsonl/.csv/.parquet file, or anything load_dataset reads."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    dataset_size: int = field(default=256, metadata={"help": "Rows of the tiny dataset."})
    cpu_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch.set_num_threads for the run (restored after). The tiny configs use 1: a "
            "64-wide model's ops are too small to split, and threads that wait on a busy machine cost "
            "far more than they save."
        },
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["count"],
        metadata={
            "help": "grpo, rloo: reward functions: a name registered in chunkloss.data.REWARD_FUNCS (count, "
            "length), 'module:function', or a reward model (local folder or hub id org/name)."
        },
    )


# ---------------------------------------------------------------------------------------------------------
# Parsing


def trainer_classes(name: str) -> tuple[type, type]:
    """(trainer class, config class) of the ``trainer:`` value ``name``."""
    spec = TRAINERS[name]
    module = importlib.import_module(spec.module)
    return getattr(module, spec.trainer), getattr(module, spec.config)


_TYPE_NAMES = {
    "int": "an integer",
    "float": "a number",
    "string_to_bool": "true or false",
    "dict": "a mapping",
}


def _convert(action: argparse.Action, key: str, value):
    """``value`` converted as argparse converts the same value given on the command line.

    argparse converts (and so checks) only defaults that are strings; YAML scalars are handed over as the
    strings a command line would carry, so ``max_steps: 1.5`` fails as ``--max_steps 1.5`` does.
    """
    if value is None or action.type is None:
        return value
    if action.nargs in ("+", "*"):
        return [_convert_one(action, key, v) for v in (value if isinstance(value, list) else [value])]
    return _convert_one(action, key, value)


def _convert_one(action: argparse.Action, key: str, value):
    kind = getattr(action.type, "__name__", "")
    if isinstance(value, list | dict):
        if kind in _TYPE_NAMES and not (kind == "dict" and isinstance(value, dict)):
            raise ConfigError(f"key {key!r} must be {_TYPE_NAMES[kind]}, got {value!r}")
        return value  # str-typed fields of TRL that also take a mapping or a list (model_init_kwargs, ...)
    try:
        converted = action.type(value if isinstance(value, str) else str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise ConfigError(f"key {key!r} must be {_TYPE_NAMES.get(kind, kind)}, got {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise ConfigError(f"key {key!r} must be one of {choices}, got {value!r}")
    return converted


def make_parser(name: str):
    """TRL's ``TrlParser`` for the trainer ``name`` (its config class, ``ModelConfig``, :class:`RunArguments`)
    that raises :class:`ConfigError` instead of exiting, and converts YAML values as command-line values."""
    from trl import ModelConfig, TrlParser

    class Parser(TrlParser):
        def error(self, message):  # argparse prints and exits; raise so the caller reports it in one line
            raise ConfigError(message)

        def set_defaults_with_config(self, **config) -> list[str]:
            actions: dict[str, argparse.Action] = {}
            for action in self._actions:  # the first action of a dest carries its type (not --no_<dest>)
                actions.setdefault(action.dest, action)
            config = _checkpointing_keys(config)
            config = {k: _convert(actions[k], k, v) if k in actions else v for k, v in config.items()}
            return super().set_defaults_with_config(**config)

    classes = [RunArguments, ModelConfig, trainer_classes(name)[1]]
    return Parser(classes, prog=f"chunkloss train (trainer: {name})")


def _checkpointing_names(renamed: bool | None = None) -> dict[str, str]:
    """{name a config may use: the name transformers reads}: transformers 5.23 renamed gradient_checkpointing*
    to activation_checkpointing* (``renamed``; None: whether the installed version did) and warns
    (FutureWarning) on the old names; a config may use either, and the parser passes on the name read."""
    from chunkloss._compat.transformers import CHECKPOINTING_RENAMED, CHECKPOINTING_RENAMES

    if CHECKPOINTING_RENAMED if renamed is None else renamed:
        return dict(CHECKPOINTING_RENAMES)
    return {new: old for old, new in CHECKPOINTING_RENAMES.items()}


def _checkpointing_keys(config: dict, renamed: bool | None = None) -> dict:
    config = dict(config)
    for given, used in _checkpointing_names(renamed).items():
        if given in config:
            if used in config:
                raise ConfigError(f"set only one of {given} and {used} (two names of one option)")
            config[used] = config.pop(given)
    # TRL's default (on) when neither name is set is the chunked config class's own (CheckpointingDefault).
    return config


def _checkpointing_overrides(overrides: list[str]) -> list[str]:
    """Command-line ``--gradient_checkpointing`` (and the like) as the installed transformers names it."""
    names = _checkpointing_names()
    out = []
    for token in overrides:
        flag = token[2:].replace("-", "_") if token.startswith("--") else None
        out.append(f"--{names[flag]}" if flag in names else token)
    return out


def read_yaml(path: str) -> dict:
    """The mapping of a YAML config file, or ConfigError."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: must be a YAML mapping of keys to values")
    return config


def trainer_name(config: dict, overrides: list[str]) -> str:
    """The ``trainer:`` value of a config (a ``--trainer`` override wins)."""
    name = config.get("trainer")
    if "--trainer" in overrides:
        i = overrides.index("--trainer")
        if i + 1 >= len(overrides):
            raise ConfigError("--trainer needs a value")
        name = overrides[i + 1]
    if name is None:
        raise ConfigError(f"missing key 'trainer' (one of {', '.join(TRAINERS)})")
    if name not in TRAINERS:
        raise ConfigError(f"key 'trainer' must be one of {', '.join(TRAINERS)}, got {name!r}")
    return name


def _unknown(parser, from_file: list[str], from_args: list[str], name: str) -> None:
    """ConfigError for the keys and options TrlParser left unused."""
    if from_file:
        key = from_file[0][2:]
        close = difflib.get_close_matches(key, [a.dest for a in parser._actions], n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(
            f"unknown key {key!r} for trainer {name!r}{hint} (see `chunkloss train --trainer {name} --help`)"
        )
    if from_args:
        raise ConfigError(f"unknown option {from_args[0]!r} (see `chunkloss train --trainer {name} --help`)")


@contextlib.contextmanager
def _in_file(path: str):
    """ConfigError prefixed with the config's path for every ValueError raised inside."""
    try:
        yield
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_config(path: str, overrides: list[str] | None = None):
    """Parse a config file (and ``--key value`` overrides) with TRL's ``TrlParser``, then check the values
    that only fail once training has started.

    Returns ``(run_args, model_args, training_args)``: :class:`RunArguments`, ``trl.ModelConfig`` and the
    chunked trainer's config. Raises :class:`ConfigError` with a one-line message that names the file and
    the key.
    """
    config = read_yaml(path)
    with _in_file(path):
        name = trainer_name(config, list(overrides or []))
        parser = make_parser(name)
        overrides = _checkpointing_overrides(list(overrides or []))
        *parsed, from_file, from_args = parser.parse_args_and_config(
            ["--config", path, *overrides], return_remaining_strings=True, separate_remaining_strings=True
        )
        _unknown(parser, from_file, from_args, name)
        run_args, model_args, training_args = parsed
        check_run(name, run_args, model_args, training_args)
    return run_args, model_args, training_args
