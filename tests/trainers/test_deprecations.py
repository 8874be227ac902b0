"""The chunked trainers raise no deprecation warning their user did not ask for.

transformers 5.23 renamed ``gradient_checkpointing`` to ``activation_checkpointing`` (config field and model
methods) and warns on every use of the old names; TRL 1.16's configs default the old field to True and its
trainers call the old methods around generation. The chunked configs keep TRL's default under the new name,
and the trainers drop the warnings of TRL's own calls while they train (chunkloss/trainers/_checkpointing.py).
"""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path

import pytest
from transformers import TrainingArguments

from chunkloss.trainers import (
    ChunkedDistillationConfig,
    ChunkedDPOConfig,
    ChunkedGKDConfig,
    ChunkedGRPOConfig,
    ChunkedMedusaConfig,
    ChunkedORPOConfig,
    ChunkedRLOOConfig,
    ChunkedSFTConfig,
)
from tests.test_readme import _blocks

REPO = str(Path(__file__).resolve().parents[2])
renamed = pytest.mark.skipif(
    "activation_checkpointing" not in TrainingArguments.__dataclass_fields__,
    reason="transformers before 5.23 has only gradient_checkpointing (and no deprecation of it)",
)
CONFIGS = [
    ChunkedSFTConfig,
    ChunkedGRPOConfig,
    ChunkedRLOOConfig,
    ChunkedDPOConfig,
    ChunkedORPOConfig,
    ChunkedGKDConfig,
    ChunkedDistillationConfig,
    ChunkedMedusaConfig,
]


def _deprecations(records) -> list[str]:
    """FutureWarnings and DeprecationWarnings about checkpointing (from anywhere), or raised in chunkloss's
    own files."""
    return [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in records
        if issubclass(w.category, FutureWarning | DeprecationWarning)
        and ("checkpointing" in str(w.message) or w.filename.startswith(REPO))
    ]


@renamed
@pytest.mark.parametrize("config", CONFIGS, ids=[c.__name__ for c in CONFIGS])
def test_config_keeps_trls_checkpointing_default_without_a_warning(tmp_path, config):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        default = config(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        off = config(output_dir=str(tmp_path), use_cpu=True, report_to="none", activation_checkpointing=False)
    assert _deprecations(seen) == []
    assert default.activation_checkpointing is True, "TRL's default"
    assert default.gradient_checkpointing is True, "mirrored under the old name"
    assert off.activation_checkpointing is False and off.gradient_checkpointing is False


@renamed
def test_the_old_name_still_works_and_warns_as_transformers_does(tmp_path):
    with pytest.warns(FutureWarning, match="`gradient_checkpointing` is deprecated"):
        args = ChunkedSFTConfig(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=False)
    assert args.activation_checkpointing is False and args.gradient_checkpointing is False


@pytest.mark.slow  # generation, twice
def test_readme_grpo_example_warns_nothing_deprecated(tmp_path, monkeypatch):
    """The README's trainer example as written (activation checkpointing on, TRL's default, so TRL turns it
    off and on around each generation): built and trained with every warning recorded."""
    (code,) = [code for _, code in _blocks("python") if "ChunkedGRPOTrainer(" in code]
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType("readme_block")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        exec(compile(code, "README.md", "exec"), module.__dict__)
    trainer = module.__dict__["trainer"]
    assert trainer.args.gradient_checkpointing is True, "TRL's default (under either name)"
    assert trainer.state.global_step == 2
    assert _deprecations(seen) == []
