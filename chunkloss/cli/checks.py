"""The checks of a parsed config that TRL's config classes do not make.

Each value here is one that TRL accepts when the config is parsed but that fails later, after the model has
loaded or mid-training, with a traceback from deep inside: they are checked at load time instead.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .errors import ConfigError
from .rewards import reward_funcs

# Lower bounds of TrainingArguments fields that transformers does not check when the config is built.
_AT_LEAST = {
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "learning_rate": 0.0,
    "weight_decay": 0.0,
}

# Suffixes read as local data files (a dataset value without one may be a hub id).
DATA_FILES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def check_run(name: str, run_args, model_args, training_args) -> None:
    """Raise :class:`ConfigError` (or ValueError) for the first value that cannot train."""
    from chunkloss.trainers._arguments import check_max_steps

    _check_models(name, run_args, model_args, training_args)
    check_max_steps(training_args)  # as the trainer refuses it, before any model loads
    for key, low in _AT_LEAST.items():
        value = getattr(training_args, key, None)
        if value is not None and value < low:
            raise ConfigError(f"key {key!r} must be at least {low:g}, got {value}")
    _check_loss_options(name, training_args)
    _check_dataset(run_args)
    if name in ("grpo", "rloo"):
        reward_funcs(run_args.reward_funcs)


def _check_models(name: str, run_args, model_args, training_args) -> None:
    from chunkloss.data import check_tiny_model

    if run_args.tiny_model is None and model_args.model_name_or_path is None:
        raise ConfigError("set either model_name_or_path (hub id or local path) or a tiny_model block")
    if run_args.tiny_model is not None and model_args.model_name_or_path is not None:
        raise ConfigError("set only one of model_name_or_path and tiny_model")
    if name in ("gkd", "distillation"):
        if run_args.teacher_tiny_model is None and training_args.teacher_model_name_or_path is None:
            raise ConfigError(f"{name} needs a teacher: set teacher_model_name_or_path or teacher_tiny_model")
    for key in ("load_in_4bit", "load_in_8bit"):  # TRL's ModelConfig: bitsandbytes quantises while loading
        if not getattr(model_args, key, False):
            continue
        if "quantization_config" in (training_args.model_init_kwargs or {}):
            raise ConfigError(f"set {key} or model_init_kwargs.quantization_config, not both")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"{key} needs bitsandbytes: pip install 'chunkloss[qlora]'")
    for key in ("tiny_model", "teacher_tiny_model"):
        spec = getattr(run_args, key)
        if spec is not None:
            try:
                check_tiny_model(spec)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc}") from None


def _check_loss_options(name: str, args) -> None:
    """Build the trainer's loss from the config's options (a module without weights: cheap), so that an
    option the loss refuses fails before any model loads."""
    import chunkloss
    from chunkloss.trainers._arguments import chunk_options

    opts = {**chunk_options(args), "compile": False}
    if name == "dpo":
        chunkloss.FusedLinearDPOLoss(
            beta=float(args.beta),
            loss_type=tuple(args.loss_type),
            loss_weights=None if args.loss_weights is None else tuple(args.loss_weights),
            label_smoothing=float(args.label_smoothing),
            **opts,
        )
    elif name == "orpo":
        chunkloss.FusedLinearORPOLoss(beta=float(args.beta), **opts)
    elif name == "kto":
        chunkloss.FusedLinearKTOLoss(
            beta=float(args.beta),
            loss_type=args.loss_type,
            desirable_weight=float(args.desirable_weight),
            undesirable_weight=float(args.undesirable_weight),
            **opts,
        )
    elif name == "grpo":
        chunkloss.FusedLinearGRPOLoss(
            loss_type=args.loss_type,
            beta=float(args.beta),
            importance_sampling_level=args.importance_sampling_level,
            max_completion_length=args.max_completion_length,
            **opts,
        )
    elif name == "rloo":
        chunkloss.FusedLinearRLOOLoss(
            epsilon_low=float(args.epsilon),
            epsilon_high=None if args.epsilon_high is None else float(args.epsilon_high),
            temperature=float(args.temperature),
            **opts,
        )
    elif name in ("gkd", "distillation"):
        temperature = float(args.temperature) if name == "distillation" else 1.0
        chunkloss.FusedLinearJSDLoss(beta=float(args.beta), temperature=temperature, **opts)


def _check_dataset(run_args) -> None:
    path = run_args.dataset
    if path == "tiny":
        if run_args.dataset_size < 1:
            raise ConfigError(f"key 'dataset_size' must be at least 1, got {run_args.dataset_size}")
        return
    looks_local = Path(path).suffix in DATA_FILES or path.startswith((".", "/", "~"))
    if looks_local and not os.path.exists(os.path.expanduser(path)):
        raise ConfigError(f"dataset: no such file or folder: {path}")
