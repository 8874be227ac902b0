"""Every file under configs/ parses with TRL's TrlParser into the chunked trainer's config, and bad configs
fail with a message that names the offending key (CPU only, no training)."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest
import torch
import yaml

from chunkloss.cli import TRAINERS, ConfigError, _trainer_classes, load_config, main

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
TINY = [p for p in CONFIGS if p.stem.endswith("-tiny")]
GPU = [p for p in CONFIGS if not p.stem.endswith("-tiny")]


def _read(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _overrides(raw: dict) -> list[str]:
    # GPU configs ask for bf16, which TrainingArguments refuses on a machine without a GPU; every other key
    # is parsed as written.
    return ["--bf16", "false"] if raw.get("bf16") and not torch.cuda.is_available() else []


def test_a_tiny_and_a_gpu_config_for_every_trainer():
    kinds = {p.stem.split("-")[0] for p in TINY}
    assert kinds == set(TRAINERS), kinds
    assert {p.stem.split("-")[0] for p in GPU} == set(TRAINERS)
    assert (CONFIG_DIR / "grpo-tiny.yaml").exists() and (CONFIG_DIR / "grpo-qwen3-0.6b.yaml").exists()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses_into_the_chunked_config(path):
    raw = _read(path)
    run_args, model_args, training_args = load_config(str(path), _overrides(raw))
    assert run_args.trainer == raw["trainer"] == path.stem.split("-")[0]
    assert type(training_args) is _trainer_classes(run_args.trainer)[1]
    assert type(training_args).__name__.startswith("Chunked")
    # Every key of the file landed in one of the three dataclasses with the value written.
    for key, value in raw.items():
        if key == "bf16" and _overrides(raw):
            continue
        owner = next(o for o in (run_args, model_args, training_args) if hasattr(o, key))
        got = getattr(owner, key)
        got = got.value if isinstance(got, enum.Enum) else got
        if key == "report_to" and value == "none":
            assert got in ([], "none", ["none"]), got
        else:
            assert got == value, (key, value, got)


@pytest.mark.parametrize("path", TINY, ids=[p.name for p in TINY])
def test_tiny_configs_are_cpu_sized(path):
    raw = _read(path)
    assert raw["use_cpu"] is True and raw["bf16"] is False and raw["report_to"] == "none"
    assert raw["output_dir"].startswith("outputs/")
    assert 20 <= raw["max_steps"] <= 60, "a few dozen steps"
    assert raw["tiny_model"]["hidden_size"] <= 64 and raw["tiny_model"]["num_layers"] <= 2
    assert raw["dataset"] == "tiny"
    assert raw["chunk_compile"] is False, "torch.compile on CPU costs more than the whole run"
    assert raw["cpu_threads"] == 1
    assert "model_name_or_path" not in raw


@pytest.mark.parametrize("path", GPU, ids=[p.name for p in GPU])
def test_gpu_configs_load_a_model_and_use_bf16(path):
    raw = _read(path)
    assert raw["model_name_or_path"] and "tiny_model" not in raw
    assert raw["bf16"] is True and raw.get("use_cpu") in (None, False)
    assert raw["chunk_compile"] is True
    if raw["trainer"] in ("gkd", "distillation"):
        assert raw["teacher_model_name_or_path"]


TINY_SFT = """
trainer: sft
tiny_model: {family: qwen3, hidden_size: 64, num_layers: 2}
output_dir: outputs/x
use_cpu: true
"""

# (extra YAML appended to TINY_SFT or a whole file, substring the error must contain)
BAD = {
    "unknown_key": (TINY_SFT + "learning_rat: 0.1\n", "unknown key 'learning_rat'"),
    "unknown_key_suggestion": (TINY_SFT + "learning_rat: 0.1\n", "did you mean learning_rate"),
    "int_as_word": (TINY_SFT + "max_steps: ten\n", "key 'max_steps' must be an integer, got 'ten'"),
    "int_as_float": (TINY_SFT + "max_steps: 1.5\n", "key 'max_steps' must be an integer"),
    "float_as_word": (TINY_SFT + "learning_rate: fast\n", "key 'learning_rate' must be a number"),
    "bool_as_word": (TINY_SFT + "use_cpu: sometimes\n", "key 'use_cpu' must be true/false"),
    "enum_value": (TINY_SFT + "save_strategy: sometimes\n", "key 'save_strategy' must be one of 'no'"),
    "list_as_scalar": (TINY_SFT.replace("sft", "grpo") + "reward_funcs: count\n",
                       "key 'reward_funcs' must be a list of strings"),
    "chunk_size_type": (TINY_SFT + "chunk_size: auto\n", "key 'chunk_size' must be an integer or null"),
    "tiny_model_key": (TINY_SFT.replace("num_layers: 2", "layers: 2"), "unknown key tiny_model.layers"),
    "tiny_model_value": (TINY_SFT.replace("hidden_size: 64", "hidden_size: -8"), "tiny_model.hidden_size"),
    "tiny_model_not_mapping": (TINY_SFT.replace("{family: qwen3, hidden_size: 64, num_layers: 2}", "qwen3"),
                               "key 'tiny_model' must be a mapping"),
    "missing_trainer": (TINY_SFT.replace("trainer: sft\n", ""), "missing key 'trainer'"),
    "unknown_trainer": (TINY_SFT.replace("trainer: sft", "trainer: ppo"), "key 'trainer' must be one of"),
    "no_model": (TINY_SFT.replace("tiny_model: {family: qwen3, hidden_size: 64, num_layers: 2}\n", ""),
                 "set either model_name_or_path"),
    "two_models": (TINY_SFT + "model_name_or_path: Qwen/Qwen3-0.6B\n", "only one of model_name_or_path"),
    "teacher_missing": (TINY_SFT.replace("trainer: sft", "trainer: gkd"), "gkd needs a teacher"),
    "rejected_by_trl": (
        TINY_SFT.replace("sft", "grpo") + "per_device_train_batch_size: 8\nnum_generations: 3\n",
        "must be divisible by num_generations",
    ),
    "not_a_mapping": ("- trainer\n- sft\n", "must be a YAML mapping"),
    "not_yaml": ("trainer: [sft\n", "not valid YAML"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_config_names_the_key(tmp_path, name):
    text, message = BAD[name]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert message in str(info.value)
    assert str(path) in str(info.value), "the message says which file"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--max_steps", "ten"], "argument --max_steps/--max-steps: invalid int value: 'ten'"),
        (["--nope", "1"], "['--nope', '1']"),
        (["--trainer", "ppo"], "key 'trainer' must be one of"),
    ],
)
def test_bad_command_line_override(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(str(CONFIG_DIR / "sft-tiny.yaml"), overrides)
    assert message in str(info.value)


def test_command_line_overrides_the_file():
    _, _, args = load_config(str(CONFIG_DIR / "sft-tiny.yaml"), ["--max_steps", "3", "--chunk_size", "7"])
    assert args.max_steps == 3 and args.chunk_size == 7
    assert args.learning_rate == _read(CONFIG_DIR / "sft-tiny.yaml")["learning_rate"]


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: nowhere.yaml"):
        load_config("nowhere.yaml")


def test_bad_config_through_the_command_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(TINY_SFT + "max_steps: ten\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("chunkloss: error:") and "'max_steps'" in err and "Traceback" not in err
