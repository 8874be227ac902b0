"""Running ``chunkloss train``: the model, tokenizer and dataset of a parsed config, the trainer, and what
the run leaves in ``output_dir`` beside the model: the summary printed at the end
(``chunkloss_summary.json``), transformers' ``trainer_state.json`` (the logged history) and the loss curve
(:data:`LOSS_CURVE`)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .checks import DATA_FILES
from .config import TRAINERS, load_config, trainer_classes
from .errors import ConfigError
from .rewards import reward_funcs

__all__ = ["LOSS_CURVE", "train"]

#: The loss curve's file in ``output_dir``: the logged loss (and GRPO's reward) against the step. Drawn with
#: matplotlib, which chunkloss does not require: without it the summary says it was not drawn.
LOSS_CURVE = "loss_curve.png"
_NO_CURVE = "not drawn: matplotlib is not installed (pip install matplotlib)"


def _load_dataset(run_args, kind: str, seed: int):
    from chunkloss.data import tiny_dataset

    if run_args.dataset == "tiny":
        return tiny_dataset(kind, run_args.dataset_size, seed=seed)
    import datasets

    path = os.path.expanduser(run_args.dataset)
    if os.path.isdir(path) and (Path(path) / "dataset_info.json").exists():
        ds = datasets.load_from_disk(path)
        return ds[run_args.dataset_split] if isinstance(ds, datasets.DatasetDict) else ds
    builder = DATA_FILES.get(Path(path).suffix)
    if builder is not None and os.path.isfile(path):
        return datasets.load_dataset(builder, data_files=path, split="train")
    return datasets.load_dataset(path, name=run_args.dataset_config, split=run_args.dataset_split)


def build(path: str, run_args, model_args, training_args):
    """The trainer of a parsed config, ready to train.

    What TRL, transformers or datasets raise here for a value of the config (a model or dataset that cannot
    be found or read, an option the trainer refuses) becomes a :class:`ConfigError` naming the file.
    """
    try:
        return _build(run_args.trainer, run_args, model_args, training_args)
    except ConfigError:
        raise
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{path}: cannot build the {run_args.trainer} trainer: {exc}") from exc


def _build(name: str, run_args, model_args, training_args):
    """The trainer of ``name`` with its model, tokenizer and dataset, ready to train."""
    import transformers
    from trl import get_peft_config, get_quantization_config

    from chunkloss.data import tiny_model, tiny_tokenizer

    trainer_cls, _ = trainer_classes(name)
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
    quantization = get_quantization_config(model_args)  # load_in_4bit / load_in_8bit, as TRL reads them
    if quantization is not None:  # every trainer loads the model by path with model_init_kwargs
        init = training_args.model_init_kwargs or {}
        training_args.model_init_kwargs = {**init, "quantization_config": quantization}
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
    if name in ("grpo", "rloo"):
        kwargs["reward_funcs"] = reward_funcs(run_args.reward_funcs)
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


def _resume_from(path: str, training_args) -> str | None:
    """The checkpoint folder ``resume_from_checkpoint`` names; ``true``: the last complete one of
    ``output_dir`` (a save interrupted by a crash leaves one that is not)."""
    from chunkloss.trainers._resume import is_complete_checkpoint, last_complete_checkpoint

    resume = training_args.resume_from_checkpoint
    if resume is None:
        return None
    if str(resume).lower() == "true":
        found = last_complete_checkpoint(training_args.output_dir)
        if found is None:
            where = training_args.output_dir
            raise ConfigError(f"{path}: resume_from_checkpoint: true, but {where} holds no complete one")
        return found
    if not is_complete_checkpoint(resume):
        last = last_complete_checkpoint(os.path.dirname(os.path.normpath(resume)))
        raise ConfigError(
            f"{path}: resume_from_checkpoint: {resume} is not a complete checkpoint (missing, or its save "
            f"was interrupted); the last complete one beside it: {last}"
        )
    return resume


def _train(path, run_args, model_args, training_args, t0) -> dict:
    resume = _resume_from(path, training_args)  # before anything is built
    trainer = build(path, run_args, model_args, training_args)
    counter = _TokenCounter(trainer)
    result = trainer.train(resume_from_checkpoint=resume)
    out_dir = os.path.abspath(training_args.output_dir)
    trainer.save_model(out_dir)
    trainer.save_state()  # trainer_state.json in output_dir: the logged history, as in a checkpoint

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
        "loss_curve": None,
        "wall_s": time.perf_counter() - t0,
    }
    rewards = [h["reward"] for h in history if "reward" in h]
    if rewards:
        summary["rewards"] = rewards
    if trainer.is_world_process_zero():
        summary["loss_curve"] = _draw_curves(history, os.path.join(out_dir, LOSS_CURVE), summary["trainer"])
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
        # GRPO's loss is a surrogate whose value does not track the policy's quality (the advantages have
        # zero mean in each group; the KL and entropy terms move it either way), so it may rise while the
        # reward rises.
        lines.append("  watch the reward: it measures the policy; the loss may rise while the reward rises")
    tps = f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] else "n/a"
    lines += [
        f"  tokens/s      {tps}   ({s['tokens']} tokens in {s['train_runtime_s']:.1f} s of training)",
        f"  peak memory   {s['peak_memory_mib']:.0f} MiB   ({s['peak_memory_kind']})",
        f"  checkpoint    {s['checkpoint']}",
        f"  loss curve    {s['loss_curve'] or _NO_CURVE}",
    ]
    print("\n".join(lines), flush=True)


def _draw_curves(history: list[dict], path: str, title: str) -> str | None:
    """The logged ``loss`` (and ``reward``, where logged) against the step, drawn into the PNG ``path`` by
    matplotlib's Agg renderer (a ``Figure`` without pyplot: the process's backend is left as it is); returns
    ``path``, or ``None`` without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    curves = {key: [(h["step"], h[key]) for h in history if key in h] for key in ("loss", "reward")}
    curves = {key: points for key, points in curves.items() if points} or {"loss": []}
    fig = Figure(figsize=(6.4, 2.4 * len(curves) + 0.6), layout="constrained")
    axes = fig.subplots(len(curves), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, points) in zip(axes, curves.items()):
        ax.plot([s for s, _ in points], [v for _, v in points], marker=".")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0].set_title(title)
    axes[-1].set_xlabel("step")
    fig.savefig(path, dpi=100)
    return path
