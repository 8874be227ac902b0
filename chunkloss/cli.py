"""The ``chunkloss`` command: ``chunkloss train CONFIG`` and ``chunkloss bench``.

``chunkloss train configs/sft-tiny.yaml [--key value ...]`` reads a YAML file whose keys are the fields
of the chosen trainer's config class (TRL's fields plus chunkloss's ``chunk_*`` fields), of TRL's
``ModelConfig`` (``model_name_or_path``, ``dtype``, ``use_peft``, ...) and of :class:`RunArguments`
(``trainer``, ``tiny_model``, ``dataset``, ``reward_funcs``, ...). Parsing is TRL's own ``TrlParser``;
before it runs, every key of the file is checked so that an unknown key or a value of the wrong type is
reported by name. Command-line ``--key value`` pairs override the file.

``chunkloss bench losses|kernels|e2e|all [args]`` runs the benchmark scripts of the repository's
``benchmarks/`` folder; it refuses to run without CUDA (CPU timings say nothing about the GPU).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import importlib.util
import json
import os
import sys
import textwrap
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["TRAINERS", "ConfigError", "RunArguments", "load_config", "main", "train"]


class ConfigError(ValueError):
    """A config file or command-line override that cannot be used; the message names the key."""


@dataclass(frozen=True)
class TrainerSpec:
    """Where the trainer of one ``trainer:`` value lives and what data it trains on."""

    module: str  # module under chunkloss.trainers
    trainer: str  # trainer class name
    config: str  # config class name
    data: str  # kind passed to chunkloss.data.tiny_dataset
    about: str  # one line for --help


TRAINERS: dict[str, TrainerSpec] = {
    "sft": TrainerSpec(
        "chunkloss.trainers.sft",
        "ChunkedSFTTrainer",
        "ChunkedSFTConfig",
        "sft",
        "supervised fine-tuning (chunked cross-entropy / DFT)",
    ),
    "grpo": TrainerSpec(
        "chunkloss.trainers.grpo",
        "ChunkedGRPOTrainer",
        "ChunkedGRPOConfig",
        "grpo",
        "online RL with group-relative advantages (needs reward_funcs)",
    ),
    "dpo": TrainerSpec(
        "chunkloss.trainers.dpo",
        "ChunkedDPOTrainer",
        "ChunkedDPOConfig",
        "dpo",
        "direct preference optimisation (prompt/chosen/rejected)",
    ),
    "orpo": TrainerSpec(
        "chunkloss.trainers.orpo",
        "ChunkedORPOTrainer",
        "ChunkedORPOConfig",
        "orpo",
        "odds-ratio preference optimisation, no reference model",
    ),
    "gkd": TrainerSpec(
        "chunkloss.trainers.gkd",
        "ChunkedGKDTrainer",
        "ChunkedGKDConfig",
        "gkd",
        "generalised knowledge distillation (needs a teacher)",
    ),
    "distillation": TrainerSpec(
        "chunkloss.trainers.distillation",
        "ChunkedDistillationTrainer",
        "ChunkedDistillationConfig",
        "distillation",
        "on-policy distillation (needs a teacher)",
    ),
}

TINY_MODEL_KEYS = ("family", "hidden_size", "num_layers")


@dataclass
class RunArguments:
    """chunkloss's own run keys (the rest of a config is the trainer's config and TRL's ModelConfig)."""

    trainer: Literal["sft", "grpo", "dpo", "orpo", "gkd", "distillation"] = field(
        default=None, metadata={"help": "Which trainer runs: " + ", ".join(TRAINERS) + "."}
    )
    tiny_model: dict | None = field(
        default=None,
        metadata={
            "help": "Build a randomly initialised model instead of loading one: a mapping with keys "
            "family (e.g. qwen3, llama), hidden_size, num_layers. Uses the built-in tokenizer."
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
            "help": "grpo: reward functions: 'count' (the tiny task's reward), 'module:function', or a "
            "reward model hub id / path."
        },
    )


# ---------------------------------------------------------------------------------------------------------
# Parsing


def _trainer_classes(name: str) -> tuple[type, type]:
    """(trainer class, config class) of ``name``, or ConfigError if it is not available."""
    if name not in TRAINERS:
        raise ConfigError(f"trainer: unknown trainer {name!r}; choose one of {', '.join(TRAINERS)}")
    spec = TRAINERS[name]
    try:
        mod = importlib.import_module(spec.module)
    except ModuleNotFoundError as exc:
        if exc.name != spec.module:
            raise
        raise ConfigError(
            f"trainer: {name!r} is not available in this version of chunkloss ({spec.module} is missing)"
        ) from None
    try:
        return getattr(mod, spec.trainer), getattr(mod, spec.config)
    except AttributeError:
        raise ConfigError(
            f"trainer: {name!r} is not available: {spec.module} does not define "
            f"{spec.trainer} and {spec.config}"
        ) from None


def _available(name: str) -> bool:
    try:
        _trainer_classes(name)
        return True
    except ConfigError:
        return False


def _dataclass_types(name: str) -> list[type]:
    from trl import ModelConfig

    return [RunArguments, ModelConfig, _trainer_classes(name)[1]]


def _make_parser(name: str):
    from trl import TrlParser

    class _Parser(TrlParser):
        # argparse prints and exits on a bad value; raise instead so callers (and tests) see the message.
        def error(self, message):
            raise ConfigError(message)

    return _Parser(_dataclass_types(name), prog=f"chunkloss train (trainer: {name})")


def _enum_values(tp) -> list | None:
    return [e.value for e in tp] if isinstance(tp, type) and issubclass(tp, enum.Enum) else None


def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        enums = [a for a in args if _enum_values(a)]
        if enums:
            return "one of " + ", ".join(map(repr, _enum_values(enums[0])))
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if tp is type(None):
        return "null"
    if origin in (list, dict):
        plural = {str: "strings", int: "integers", float: "numbers", bool: "true/false values"}
        inner = f" of {', '.join(plural.get(a, _describe(a)) for a in args)}" if args else ""
        return f"a {origin.__name__}{inner}"
    if _enum_values(tp):
        return "one of " + ", ".join(map(repr, _enum_values(tp)))
    return {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a mapping",
        list: "a list",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def _matches(value, tp) -> bool:
    """Whether a YAML value can become a field of type ``tp`` (strings in the form argparse converts pass)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        enums = [a for a in args if _enum_values(a)]
        if enums:  # `SaveStrategy | str`: the str is only there for the enum's values
            return value in _enum_values(enums[0]) or isinstance(value, enums[0])
        return any(_matches(value, a) for a in args)
    if origin is Literal:
        return value in args
    if tp is type(None):
        return value is None
    if _enum_values(tp):
        return value in _enum_values(tp) or isinstance(value, tp)
    if tp is bool:
        return isinstance(value, bool) or (
            isinstance(value, str)
            and value.lower() in ("true", "false", "yes", "no", "t", "f", "y", "n", "1", "0")
        )
    if tp is int:
        if isinstance(value, str):
            try:
                int(value)
                return True
            except ValueError:
                return False
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        if isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string; argparse's float() takes it
            try:
                float(value)
                return True
            except ValueError:
                return False
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is list or tp is list:
        return isinstance(value, list) and (not args or all(_matches(v, args[0]) for v in value))
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _check_keys(config: dict, name: str, where: str) -> None:
    """Reject unknown keys and values of the wrong type, naming the key (before TrlParser sees them)."""
    hints: dict[str, Any] = {}
    for cls in _dataclass_types(name):
        th = typing.get_type_hints(cls)
        hints.update({f.name: th[f.name] for f in dataclasses.fields(cls) if f.init})
    for key, value in config.items():
        if key == "env":  # TrlParser sets these as environment variables
            continue
        if key not in hints:
            close = difflib.get_close_matches(key, list(hints), n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(
                f"{where}: unknown key {key!r} for trainer {name!r}{hint} "
                f"(see `chunkloss train --trainer {name} --help`)"
            )
        if not _matches(value, hints[key]):
            raise ConfigError(
                f"{where}: key {key!r} must be {_describe(hints[key])}, got {value!r} "
                f"({type(value).__name__})"
            )
    for key in ("tiny_model", "teacher_tiny_model"):
        block = config.get(key)
        if isinstance(block, dict):
            for k, v in block.items():
                if k not in TINY_MODEL_KEYS:
                    raise ConfigError(
                        f"{where}: unknown key {key}.{k}; expected {', '.join(TINY_MODEL_KEYS)}"
                    )
                if k == "family":
                    ok = isinstance(v, str)
                else:
                    ok = isinstance(v, int) and not isinstance(v, bool) and v > 0
                if not ok:
                    want = "a model family name (e.g. qwen3)" if k == "family" else "a positive integer"
                    raise ConfigError(f"{where}: key {key}.{k} must be {want}, got {v!r}")


def _read_yaml(path: str) -> dict:
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


def _trainer_from(config: dict, overrides: list[str], where: str) -> str:
    name = config.get("trainer")
    for flag in ("--trainer",):
        if flag in overrides:
            i = overrides.index(flag)
            if i + 1 >= len(overrides):
                raise ConfigError("--trainer needs a value")
            name = overrides[i + 1]
    if name is None:
        raise ConfigError(f"{where}: missing key 'trainer' (one of {', '.join(TRAINERS)})")
    if name not in TRAINERS:
        raise ConfigError(f"{where}: key 'trainer' must be one of {', '.join(TRAINERS)}, got {name!r}")
    return name


def load_config(path: str, overrides: list[str] | None = None):
    """Parse a config file (and ``--key value`` overrides) with TRL's ``TrlParser``.

    Returns ``(run_args, model_args, training_args)``: :class:`RunArguments`, ``trl.ModelConfig`` and the
    chunked trainer's config. Raises :class:`ConfigError` naming the key for unknown keys, wrong types and
    values the config classes reject.
    """
    overrides = list(overrides or [])
    config = _read_yaml(path)
    name = _trainer_from(config, overrides, path)
    _check_keys(config, name, path)
    parser = _make_parser(name)
    try:
        run_args, model_args, training_args = parser.parse_args_and_config(["--config", path, *overrides])
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except ValueError as exc:  # raised by the config classes' __post_init__
        raise ConfigError(f"{path}: {exc}") from None
    if run_args.tiny_model is None and model_args.model_name_or_path is None:
        raise ConfigError(
            f"{path}: set either model_name_or_path (hub id or local path) or a tiny_model block"
        )
    if run_args.tiny_model is not None and model_args.model_name_or_path is not None:
        raise ConfigError(f"{path}: set only one of model_name_or_path and tiny_model")
    if name in ("gkd", "distillation"):
        if run_args.teacher_tiny_model is None and training_args.teacher_model_name_or_path is None:
            raise ConfigError(
                f"{path}: {name} needs a teacher: set teacher_model_name_or_path or teacher_tiny_model"
            )
    return run_args, model_args, training_args


# ---------------------------------------------------------------------------------------------------------
# Building the run


def _reward_funcs(names: list[str]) -> list:
    from chunkloss.data import count_reward

    out = []
    for name in names:
        if name == "count":
            out.append(count_reward)
        elif ":" in name and not os.path.exists(name):
            mod_name, fn_name = name.split(":", 1)
            try:
                out.append(getattr(importlib.import_module(mod_name), fn_name))
            except (ImportError, AttributeError) as exc:
                raise ConfigError(f"reward_funcs: cannot import {name!r}: {exc}") from None
        else:
            out.append(name)  # a reward model: GRPOTrainer loads it
    return out


def _load_dataset(run_args, kind: str, seed: int):
    from chunkloss.data import tiny_dataset

    if run_args.dataset == "tiny":
        return tiny_dataset(kind, run_args.dataset_size, seed=seed)
    import datasets

    path = run_args.dataset
    if os.path.isdir(path) and (Path(path) / "dataset_info.json").exists():
        ds = datasets.load_from_disk(path)
        return ds[run_args.dataset_split] if isinstance(ds, datasets.DatasetDict) else ds
    builder = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}.get(Path(path).suffix)
    if builder is not None and os.path.isfile(path):
        return datasets.load_dataset(builder, data_files=path, split="train")
    return datasets.load_dataset(path, name=run_args.dataset_config, split=run_args.dataset_split)


def _build(name: str, run_args, model_args, training_args):
    """The trainer of ``name`` with its model, tokenizer and dataset, ready to train."""
    import transformers
    from trl import get_peft_config

    from chunkloss.data import tiny_model, tiny_tokenizer

    trainer_cls, _ = _trainer_classes(name)
    spec = TRAINERS[name]
    transformers.set_seed(training_args.seed)

    if run_args.tiny_model is not None:
        tokenizer = tiny_tokenizer()
        # Saved and passed by path, like a hub model: TRL builds reference models (DPO, GRPO with beta > 0)
        # by reloading the policy from its path.
        model = os.path.join(os.path.abspath(training_args.output_dir), "tiny-init")
        with training_args.main_process_first(desc="tiny model"):
            if training_args.process_index == 0:
                tiny_model(tokenizer, **run_args.tiny_model).save_pretrained(model)
                tokenizer.save_pretrained(model)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            run_args.tokenizer_name_or_path or model_args.model_name_or_path,
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
        )
        # The trainer loads the model with model_init_kwargs, as TRL's own scripts do.
        model = model_args.model_name_or_path
        init = dict(
            revision=model_args.model_revision,
            attn_implementation=model_args.attn_implementation,
            dtype=model_args.dtype,
        )
        init.update(training_args.model_init_kwargs or {})
        training_args.model_init_kwargs = {k: v for k, v in init.items() if v is not None}
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    kwargs: dict[str, Any] = dict(
        model=model,
        args=training_args,
        processing_class=tokenizer,
        train_dataset=_load_dataset(run_args, spec.data, training_args.seed),
    )
    peft_config = get_peft_config(model_args)
    if peft_config is not None:
        kwargs["peft_config"] = peft_config
    if name == "grpo":
        kwargs["reward_funcs"] = _reward_funcs(run_args.reward_funcs)
    if name in ("gkd", "distillation"):
        if run_args.teacher_tiny_model is not None:
            kwargs["teacher_model"] = tiny_model(tokenizer, **run_args.teacher_tiny_model)
        else:
            kwargs["teacher_model"] = training_args.teacher_model_name_or_path
    return trainer_cls(**kwargs)


class _TokenCounter:
    """Counts non-padding tokens fed to ``training_step`` (every ``*attention_mask`` of the batch), for the
    trainers that do not log TRL's ``num_tokens`` metric."""

    def __init__(self, trainer):
        self.tokens = 0
        step = trainer.training_step

        def counted(model, inputs, *args, **kwargs):
            if isinstance(inputs, dict):  # GRPO passes raw rows (a list); it logs num_tokens itself
                for key, value in inputs.items():
                    if key.endswith("attention_mask") and hasattr(value, "sum"):
                        self.tokens += int(value.sum())
            return step(model, inputs, *args, **kwargs)

        trainer.training_step = counted


def _peak_memory() -> tuple[float, str]:
    """(MiB, what was measured)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return torch.cuda.max_memory_allocated() / 2**20, "GPU: torch.cuda.max_memory_allocated"
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10, "CPU: process peak RSS"  # bytes / KiB


def train(path: str, overrides: list[str] | None = None) -> dict:
    """Train from a config file; print and return the summary (also written to ``chunkloss_summary.json``)."""
    import torch

    t0 = time.perf_counter()
    run_args, model_args, training_args = load_config(path, overrides)
    threads = torch.get_num_threads()
    if run_args.cpu_threads is not None:
        torch.set_num_threads(run_args.cpu_threads)
    try:
        return _train(path, run_args, model_args, training_args, t0)
    finally:
        torch.set_num_threads(threads)


def _train(path, run_args, model_args, training_args, t0) -> dict:
    name = run_args.trainer
    trainer = _build(name, run_args, model_args, training_args)
    counter = _TokenCounter(trainer)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    out_dir = os.path.abspath(training_args.output_dir)
    trainer.save_model(out_dir)

    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    logged_tokens = [h["num_tokens"] for h in history if "num_tokens" in h]
    tokens = int(logged_tokens[-1]) if logged_tokens else counter.tokens
    runtime = result.metrics.get("train_runtime") or (time.perf_counter() - t0)
    peak_mib, peak_what = _peak_memory()
    summary = {
        "trainer": type(trainer).__name__,
        "config": os.path.abspath(path),
        "steps": trainer.state.global_step,
        "final_loss": losses[-1] if losses else result.training_loss,
        "first_loss": losses[0] if losses else None,
        "losses": losses,
        "tokens": tokens,
        "train_runtime_s": runtime,
        "tokens_per_s": tokens / runtime if runtime > 0 else None,
        "peak_memory_mib": peak_mib,
        "peak_memory_kind": peak_what,
        "checkpoint": out_dir,
        "wall_s": time.perf_counter() - t0,
    }
    rewards = [h["reward"] for h in history if "reward" in h]
    if rewards:
        summary["rewards"] = rewards
    if trainer.is_world_process_zero():
        with open(os.path.join(out_dir, "chunkloss_summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        _print_summary(summary)
    return summary


def _print_summary(s: dict) -> None:
    first = f"   (first logged {s['first_loss']:.4g})" if s["first_loss"] is not None else ""
    lines = [
        f"chunkloss: {s['trainer']} finished {s['steps']} steps in {s['wall_s']:.1f} s",
        f"  final loss    {s['final_loss']:.4g}{first}",
    ]
    if "rewards" in s:
        lines.append(f"  final reward  {s['rewards'][-1]:.4g}   (first logged {s['rewards'][0]:.4g})")
    tps = f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] else "n/a"
    lines += [
        f"  tokens/s      {tps}   ({s['tokens']} tokens in {s['train_runtime_s']:.1f} s of training)",
        f"  peak memory   {s['peak_memory_mib']:.0f} MiB   ({s['peak_memory_kind']})",
        f"  checkpoint    {s['checkpoint']}",
    ]
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------------------------------------
# Help


def _field_help(cls) -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        text = f"{f.metadata.get('help', '')} ({_describe(hints[f.name])}; default {default!r})"
        out.append(
            textwrap.fill(text, width=108, initial_indent=f"  {f.name:<23} ", subsequent_indent=" " * 26)
        )
    return out


def _train_overview() -> str:
    lines = [
        "usage: chunkloss train CONFIG.yaml [--key value ...]",
        "       chunkloss train --trainer NAME --help     (every option of that trainer)",
        "",
        "Train with a YAML config. Its keys are the trainer's TRL config fields (plus chunkloss's",
        "chunk_* fields), TRL's ModelConfig fields (model_name_or_path, dtype, use_peft, lora_r, ...)",
        "and the run keys below. `--key value` on the command line overrides the file. Examples:",
        "  chunkloss train configs/grpo-tiny.yaml                (tiny random model on CPU, under a minute)",
        "  chunkloss train configs/grpo-qwen3-0.6b.yaml --max_steps 50",
        "",
        "trainers (key `trainer:`):",
    ]
    for key, spec in TRAINERS.items():
        status = spec.trainer if _available(key) else f"{spec.trainer} (not available)"
        lines.append(f"  {key:<13} {status:<27} {spec.about}")
    lines += ["", "run keys (chunkloss):", *_field_help(RunArguments)]
    try:
        from chunkloss.trainers._common import ChunkedArguments

        lines += ["", "chunk options (every trainer):", *_field_help(ChunkedArguments)]
    except ImportError:
        pass
    lines += [
        "",
        "model keys (TRL ModelConfig): model_name_or_path, model_revision, dtype,",
        "  attn_implementation, use_peft, lora_r, lora_alpha, lora_dropout, lora_target_modules, ...",
        "  (`chunkloss train --trainer NAME --help` lists every key of a trainer)",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Bench

BENCHES = ("losses", "kernels", "e2e")


def _benchmarks_dir() -> Path:
    """The repository's ``benchmarks/`` folder (beside the ``chunkloss`` package of a checkout)."""
    import chunkloss

    return Path(chunkloss.__file__).resolve().parent.parent / "benchmarks"


def _call_main(fn, prog: str, argv: list[str]):
    """``fn(argv)``, or ``fn()`` with ``sys.argv`` set for scripts whose ``main`` reads it."""
    import inspect

    if inspect.signature(fn).parameters:
        return fn(argv)
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        return fn()
    finally:
        sys.argv = saved


def bench(argv: list[str]) -> int:
    """``chunkloss bench [losses|kernels|e2e|all] [args...]``: dispatch to ``benchmarks/bench_<name>.py``."""
    if argv and argv[0] in ("-h", "--help"):
        print(
            "usage: chunkloss bench [losses|kernels|e2e|all] [args...]\n\n"
            "Runs benchmarks/bench_<name>.py of the checkout against every installed peer and writes a\n"
            "markdown table and PNG plots under its results folder. Without a name: losses, then kernels\n"
            "(end-to-end only when asked: `e2e` or `all`). Arguments after the name go to that script;\n"
            "`chunkloss bench losses --help` shows them. Needs a CUDA GPU."
        )
        return 0
    targets, rest = (
        (["losses", "kernels"], [])
        if not argv
        else ((list(BENCHES), argv[1:]) if argv[0] == "all" else ([argv[0]], argv[1:]))
    )
    for t in targets:
        if t not in BENCHES:
            print(
                f"chunkloss bench: unknown benchmark {t!r}; choose losses, kernels, e2e or all",
                file=sys.stderr,
            )
            return 2
    import torch

    wants_help = any(a in ("-h", "--help") for a in rest)
    if not torch.cuda.is_available() and not wants_help:
        print(
            "chunkloss bench: no CUDA device found. The benchmarks time GPU kernels and GPU memory; "
            "they do not print CPU numbers. Run this on a machine with a CUDA GPU.",
            file=sys.stderr,
        )
        return 1
    root = _benchmarks_dir()
    for t in targets:
        script = root / f"bench_{t}.py"
        if not script.is_file():
            print(
                f"chunkloss bench: {script} not found. `chunkloss bench` runs the benchmark scripts of a "
                "source checkout (git clone the repository and `pip install -e .`).",
                file=sys.stderr,
            )
            return 2
    if str(root.parent) not in sys.path:  # the scripts import benchmarks.harness and benchmarks.cases_*
        sys.path.insert(0, str(root.parent))
    for t in targets:
        print(f"chunkloss bench: running {t} ({root / f'bench_{t}.py'}) ...", flush=True)
        name = f"benchmarks.bench_{t}"
        spec = importlib.util.spec_from_file_location(name, root / f"bench_{t}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        rc = _call_main(module.main, f"chunkloss bench {t}", list(rest))
        if rc:
            return int(rc)
    return 0


# ---------------------------------------------------------------------------------------------------------
# Entry point

_USAGE = """usage: chunkloss {train,bench} ...

  chunkloss train CONFIG.yaml [--key value ...]   train with a TRL trainer using chunked losses
  chunkloss train --help                          trainers and options
  chunkloss bench [losses|kernels|e2e|all]        GPU benchmarks against installed peers (needs CUDA)
"""


def _train_cli(argv: list[str]) -> int:
    wants_help = any(a in ("-h", "--help") for a in argv)
    rest = [a for a in argv if a not in ("-h", "--help")]
    path = rest[0] if rest and not rest[0].startswith("-") else None
    overrides = rest[1:] if path else rest
    if wants_help:
        name = None
        if "--trainer" in overrides:
            i = overrides.index("--trainer")
            name = overrides[i + 1] if i + 1 < len(overrides) else None
        elif path is not None:
            name = _read_yaml(path).get("trainer")
        if name is None:
            print(_train_overview())
            return 0
        _make_parser(name).print_help()
        return 0
    if path is None:
        print(_train_overview(), file=sys.stderr)
        return 2
    train(path, overrides)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "train":
            return _train_cli(rest)
        if command == "bench":
            return bench(rest)
    except ConfigError as exc:
        print(f"chunkloss: error: {exc}", file=sys.stderr)
        return 2
    print(f"chunkloss: unknown command {command!r}\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
