"""``chunkloss train --help``: the trainers and chunkloss's own keys (with ``--trainer NAME``: every key)."""

from __future__ import annotations

import dataclasses
import textwrap

from .config import TRAINERS, RunArguments

__all__ = ["USAGE", "train_overview"]

USAGE = """usage: chunkloss {train,bench} ... [--debug]
       chunkloss --version

  chunkloss train CONFIG.yaml [--key value ...]   train with a TRL trainer using chunked losses
                                                  (--config CONFIG.yaml works too, as in TRL's scripts)
  chunkloss train --help                          trainers and options
  chunkloss bench [losses|kernels|e2e|all]        GPU benchmarks against installed peers (needs CUDA and
                                                  a source checkout)

A config mistake is reported in one line (exit status 2). --debug, or CHUNKLOSS_DEBUG=1, also shows the
traceback of any error (a config mistake still exits with status 2)."""


def _field_help(cls) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        text = f"{f.metadata.get('help', '')} (default {default!r})"
        out.append(
            textwrap.fill(text, width=108, initial_indent=f"  {f.name:<23} ", subsequent_indent=" " * 26)
        )
    return out


def train_overview() -> str:
    """The text of ``chunkloss train --help``."""
    from chunkloss.trainers._arguments import ChunkedArguments

    lines = [
        "usage: chunkloss train CONFIG.yaml [--key value ...]     (--config CONFIG.yaml works too)",
        "       chunkloss train --trainer NAME --help     (every option of that trainer)",
        "",
        "Train with a YAML config. Its keys are the trainer's TRL config fields (plus chunkloss's",
        "chunk_* fields), TRL's ModelConfig fields (model_name_or_path, dtype, use_peft, lora_r, ...)",
        "and the run keys below. `--key value` on the command line overrides the file. Examples:",
        "  chunkloss train configs/sft-tiny.yaml                 (tiny random model on CPU, under a minute)",
        "  chunkloss train configs/grpo-qwen3-0.6b.yaml --max_steps 50",
        "",
        "trainers (key `trainer:`):",
    ]
    lines += [f"  {key:<13} {spec.trainer:<27} {spec.about}" for key, spec in TRAINERS.items()]
    lines += ["", "run keys (chunkloss):", *_field_help(RunArguments)]
    lines += ["", "chunk options (every trainer):", *_field_help(ChunkedArguments)]
    lines += [
        "",
        "model keys (TRL ModelConfig): model_name_or_path, model_revision, dtype,",
        "  attn_implementation, use_peft, lora_r, lora_alpha, lora_dropout, lora_target_modules,",
        "  load_in_4bit, bnb_4bit_quant_type, use_bnb_nested_quant (QLoRA: needs bitsandbytes), ...",
        "  (`chunkloss train --trainer NAME --help` lists every key of a trainer)",
    ]
    return "\n".join(lines)
