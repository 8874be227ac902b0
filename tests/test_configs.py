"""Every file under configs/ parses with TRL's TrlParser into the chunked trainer's config; every mistake a
config can hold is refused when it is loaded, in one line that names the file and the key, with exit status
2 from the command (CPU only, no training)."""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from chunkloss.cli import TRAINERS, ConfigError, load_config, main
from chunkloss.cli.config import _checkpointing_keys, trainer_classes

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
    assert {p.stem.split("-")[0] for p in TINY} == set(TRAINERS)
    assert {p.stem.split("-")[0] for p in GPU} == set(TRAINERS)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses_into_the_chunked_config_without_warnings(path):
    raw = _read(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # e.g. transformers' gradient_checkpointing rename
        warnings.simplefilter("error", DeprecationWarning)
        run_args, model_args, training_args = load_config(str(path), _overrides(raw))
    assert run_args.trainer == raw["trainer"] == path.stem.split("-")[0]
    assert type(training_args) is trainer_classes(run_args.trainer)[1]
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


# ---------------------------------------------------------------------------------------------------------
# Either name of the activation checkpointing option, whichever transformers reads


@pytest.mark.parametrize("key", ["gradient_checkpointing", "activation_checkpointing"])
@pytest.mark.parametrize("value", [True, False])
def test_either_checkpointing_name_is_accepted_without_a_warning(tmp_path, key, value):
    raw = _read(CONFIG_DIR / "sft-tiny.yaml")
    raw.pop("activation_checkpointing")
    raw[key] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _, _, args = load_config(str(path))
        _, _, on_command_line = load_config(str(path), [f"--{key}", str(not value)])
    assert args.gradient_checkpointing is value
    assert on_command_line.gradient_checkpointing is (not value)


def test_trl_default_checkpointing_is_kept_without_a_warning(tmp_path):
    raw = _read(CONFIG_DIR / "sft-tiny.yaml")
    raw.pop("activation_checkpointing")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _, _, args = load_config(str(path))
    assert args.gradient_checkpointing is True, "TRL's default"


def test_checkpointing_name_for_transformers_before_the_rename():
    # transformers < 5.23 has only gradient_checkpointing*: the new names are passed on as the old ones.
    old = False
    config = {"activation_checkpointing": False, "activation_checkpointing_kwargs": {"use_reentrant": False}}
    assert _checkpointing_keys(config, old) == {
        "gradient_checkpointing": False,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
    }
    assert _checkpointing_keys({}, old) == {}, "TRL's default is left to the config class"
    new = True
    assert _checkpointing_keys({"gradient_checkpointing": False}, new) == {"activation_checkpointing": False}
    assert _checkpointing_keys({}, new) == {}, "TRL's default is the chunked config class's own"


# ---------------------------------------------------------------------------------------------------------
# Mistakes: one line, exit status 2, refused at load time

TINY_SFT = """
trainer: sft
tiny_model: {family: qwen3, hidden_size: 64, num_layers: 2}
output_dir: outputs/x
use_cpu: true
"""


def _tiny(kind: str, extra: str) -> str:
    """The shipped tiny config of ``kind`` with the YAML ``extra`` keys set."""
    raw = _read(CONFIG_DIR / f"{kind}-tiny.yaml")
    raw.update(yaml.safe_load(extra))
    return yaml.safe_dump(raw)


# (config text, substring the one-line error must contain)
MISTAKES = {
    # values TRL accepts and training used to fail on, deep inside
    "chunk_size_zero": (_tiny("sft", "chunk_size: 0"), "chunk_size must be a positive int or None, got 0"),
    "chunk_size_negative": (_tiny("sft", "chunk_size: -8"), "chunk_size must be a positive int"),
    "chunk_accum_dtype": (_tiny("sft", "chunk_accum_dtype: float8"), "chunk_accum_dtype must be one of"),
    "negative_learning_rate": (_tiny("sft", "learning_rate: -1.0e-3"), "'learning_rate' must be at least 0"),
    "batch_size_zero": (
        _tiny("sft", "per_device_train_batch_size: 0"),
        "'per_device_train_batch_size' must be at least 1",
    ),
    "max_steps_zero": (_tiny("sft", "max_steps: 0"), "max_steps=0 would train one step"),
    "dpo_loss_type": (_tiny("dpo", "loss_type: [sigmoidd]"), "unknown loss_type ['sigmoidd']"),
    "dpo_loss_type_string": (_tiny("dpo", "loss_type: sigmoidd"), "unknown loss_type ['sigmoidd']"),
    "dpo_beta": (_tiny("dpo", "beta: -1"), "beta must be positive, got -1.0"),
    "orpo_beta": (_tiny("orpo", "beta: 0"), "beta must be positive"),
    "grpo_loss_type": (_tiny("grpo", "loss_type: foo"), "loss_type must be one of"),
    "gkd_beta": (_tiny("gkd", "beta: 2"), "beta must be in"),
    "distillation_temperature": (_tiny("distillation", "temperature: 0"), "temperature must be"),
    "unknown_model_family": (
        _tiny("sft", "tiny_model: {family: nosuch}"),
        "unknown causal LM family 'nosuch'",
    ),
    "misspelt_model_family": (_tiny("sft", "tiny_model: {family: qwen}"), "did you mean qwen3"),
    "odd_hidden_size": (_tiny("sft", "tiny_model: {hidden_size: 30}"), "hidden_size must be a multiple of 4"),
    "missing_dataset_file": (
        _tiny("sft", "dataset: data/missing.jsonl"),
        "dataset: no such file or folder: data/missing.jsonl",
    ),
    "missing_dataset_folder": (_tiny("sft", "dataset: ./nowhere"), "no such file or folder: ./nowhere"),
    "unknown_reward": (_tiny("grpo", "reward_funcs: [nosuch]"), "unknown reward 'nosuch'; use a registered"),
    "unimportable_reward": (
        _tiny("grpo", "reward_funcs: ['chunkloss.data:nope']"),
        "cannot import 'chunkloss.data:nope'",
    ),
    "two_quantization_configs": (
        _tiny("sft", "load_in_4bit: true\nmodel_init_kwargs: {quantization_config: {load_in_8bit: true}}"),
        "set load_in_4bit or model_init_kwargs.quantization_config, not both",
    ),
    # keys and types (TrlParser's checks, reported by key)
    "unknown_key": (TINY_SFT + "learning_rat: 0.1\n", "unknown key 'learning_rat' for trainer 'sft'"),
    "unknown_key_suggestion": (TINY_SFT + "learning_rat: 0.1\n", "did you mean learning_rate"),
    "int_as_word": (TINY_SFT + "max_steps: ten\n", "key 'max_steps' must be an integer, got 'ten'"),
    "int_as_float": (TINY_SFT + "max_steps: 1.5\n", "key 'max_steps' must be an integer, got 1.5"),
    "float_as_word": (TINY_SFT + "learning_rate: fast\n", "key 'learning_rate' must be a number"),
    "float_as_list": (TINY_SFT + "learning_rate: [0.1]\n", "key 'learning_rate' must be a number"),
    "bool_as_word": (TINY_SFT + "use_cpu: sometimes\n", "key 'use_cpu' must be true or false"),
    "enum_value": (TINY_SFT + "save_strategy: sometimes\n", "key 'save_strategy' must be one of 'no'"),
    "choice_value": (TINY_SFT + "dtype: float8\n", "key 'dtype' must be one of 'auto'"),
    "chunk_size_type": (TINY_SFT + "chunk_size: auto\n", "key 'chunk_size' must be an integer, got 'auto'"),
    "tiny_model_key": (TINY_SFT.replace("num_layers: 2", "layers: 2"), "tiny_model: unknown key 'layers'"),
    "tiny_model_value": (
        TINY_SFT.replace("hidden_size: 64", "hidden_size: -8"),
        "tiny_model: hidden_size must be a positive integer",
    ),
    "tiny_model_not_mapping": (
        TINY_SFT.replace("{family: qwen3, hidden_size: 64, num_layers: 2}", "qwen3"),
        "key 'tiny_model' must be a mapping",
    ),
    "both_checkpointing_names": (
        TINY_SFT + "gradient_checkpointing: true\nactivation_checkpointing: true\n",
        "set only one of gradient_checkpointing and activation_checkpointing",
    ),
    # the run keys
    "missing_trainer": (TINY_SFT.replace("trainer: sft\n", ""), "missing key 'trainer'"),
    "unknown_trainer": (TINY_SFT.replace("trainer: sft", "trainer: ppo"), "key 'trainer' must be one of"),
    "no_model": (
        TINY_SFT.replace("tiny_model: {family: qwen3, hidden_size: 64, num_layers: 2}\n", ""),
        "set either model_name_or_path",
    ),
    "two_models": (TINY_SFT + "model_name_or_path: Qwen/Qwen3-0.6B\n", "only one of model_name_or_path"),
    "teacher_missing": (TINY_SFT.replace("trainer: sft", "trainer: gkd"), "gkd needs a teacher"),
    "rejected_by_trl": (
        TINY_SFT.replace("sft", "grpo") + "per_device_train_batch_size: 8\nnum_generations: 3\n",
        "must be divisible by num_generations",
    ),
    "not_a_mapping": ("- trainer\n- sft\n", "must be a YAML mapping"),
    "not_yaml": ("trainer: [sft\n", "not valid YAML"),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_config_mistake_is_one_line_with_exit_status_2(tmp_path, monkeypatch, capsys, name):
    text, message = MISTAKES[name]
    monkeypatch.chdir(tmp_path)  # relative dataset paths resolve here
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert message in str(info.value)
    assert str(path) in str(info.value), "the message says which file"
    assert main(["train", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0] == f"chunkloss: error: {' '.join(str(info.value).split())}", lines
    assert captured.out == ""


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--max_steps", "ten"], "argument --max_steps/--max-steps: invalid int value: 'ten'"),
        (["--nope", "1"], "unknown option '--nope'"),
        (["--trainer", "ppo"], "key 'trainer' must be one of"),
        (["--chunk_size", "0"], "chunk_size must be a positive int"),
        (["--learning_rate", "-1"], "'learning_rate' must be at least 0"),
    ],
)
def test_bad_command_line_override(capsys, overrides, message):
    path = str(CONFIG_DIR / "sft-tiny.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert message in str(info.value)
    assert main(["train", path, *overrides]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_command_line_overrides_the_file():
    _, _, args = load_config(str(CONFIG_DIR / "sft-tiny.yaml"), ["--max_steps", "3", "--chunk_size", "7"])
    assert args.max_steps == 3 and args.chunk_size == 7
    assert args.learning_rate == _read(CONFIG_DIR / "sft-tiny.yaml")["learning_rate"]


def test_missing_file(capsys):
    with pytest.raises(ConfigError, match="config file not found: nowhere.yaml"):
        load_config("nowhere.yaml")
    assert main(["train", "nowhere.yaml"]) == 2
    assert capsys.readouterr().err == "chunkloss: error: config file not found: nowhere.yaml\n"


def test_usage_mistakes_are_one_line(capsys):
    for argv in (["fly"], ["train"], ["train", "--trainer", "ppo", "--help"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith("chunkloss: error:"), err


def test_a_failure_that_is_not_a_config_mistake_is_one_line_with_exit_status_1(monkeypatch, capsys):
    import chunkloss.cli

    def broken(argv):
        raise RuntimeError("something broke\ninside")

    monkeypatch.setattr(chunkloss.cli, "_command", broken)
    assert main(["train", "x.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "chunkloss: error: RuntimeError: something broke inside "
        "(--debug or CHUNKLOSS_DEBUG=1 shows the traceback)"
    ]
    with pytest.raises(RuntimeError, match="something broke"):
        main(["train", "x.yaml", "--debug"])
    monkeypatch.setenv("CHUNKLOSS_DEBUG", "1")
    with pytest.raises(RuntimeError, match="something broke"):
        main(["train", "x.yaml"])


def _command(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # What the console script (pyproject: chunkloss = "chunkloss.cli:main") does, with its exit status.
    code = "import sys; from chunkloss.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_the_command_prints_one_line_and_no_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(MISTAKES["dpo_beta"][0])
    plain = _command("train", str(path), env={"CHUNKLOSS_DEBUG": ""})
    assert plain.returncode == 2
    # What other packages print while being imported (torchao's warnings, through transformers) is theirs.
    ours = [line for line in plain.stderr.splitlines() if line.startswith("chunkloss")]
    assert ours == [f"chunkloss: error: {path}: beta must be positive, got -1.0"], plain.stderr
    assert "Traceback" not in plain.stderr, plain.stderr


@pytest.mark.parametrize("how", ["--debug", "CHUNKLOSS_DEBUG=1"])
def test_a_config_mistake_exits_2_with_debug_too(tmp_path, monkeypatch, capsys, how):
    path = tmp_path / "bad.yaml"
    path.write_text(MISTAKES["dpo_beta"][0])
    monkeypatch.setenv("CHUNKLOSS_DEBUG", "1" if how.startswith("CHUNKLOSS") else "")
    assert main(["train", str(path), *([how] if how == "--debug" else [])]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err
    assert err.endswith(f"chunkloss: error: {path}: beta must be positive, got -1.0\n"), err


# ---------------------------------------------------------------------------------------------------------
# reward_funcs


def test_unknown_reward_fails_at_once_listing_the_registered_names(tmp_path, capsys):
    from chunkloss.data import REWARD_FUNCS

    path = tmp_path / "bad.yaml"
    path.write_text(MISTAKES["unknown_reward"][0])
    start = time.perf_counter()
    assert main(["train", str(path)]) == 2
    assert time.perf_counter() - start < 2.0, "no hub lookup for a name that is not a model id"
    err = capsys.readouterr().err
    assert all(name in err for name in REWARD_FUNCS) and len(err.splitlines()) == 1


def test_reward_funcs_resolve_by_name_import_path_and_folder(tmp_path):
    from chunkloss.cli.rewards import reward_funcs
    from chunkloss.data import count_reward, length_reward

    (tmp_path / "reward-model").mkdir()
    folder = str(tmp_path / "reward-model")
    names = ["count", "length", "chunkloss.data:count_reward", "chunkloss.data.length_reward", folder]
    funcs = reward_funcs(names)
    assert funcs == [count_reward, length_reward, count_reward, length_reward, folder]
    with pytest.raises(ConfigError, match="'chunkloss.data:REWARD_FUNCS' is not a function"):
        reward_funcs(["chunkloss.data:REWARD_FUNCS"])


def test_hub_reward_model_offline_needs_the_local_cache(monkeypatch):
    from huggingface_hub import constants

    from chunkloss.cli import rewards

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    rewards._hub_model.cache_clear()
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="not in the local cache .HF_HUB_OFFLINE is set"):
        rewards.reward_funcs(["no-such-org/no-such-reward-model"])
    assert time.perf_counter() - start < 10.0, "no network retries"


def test_hub_reward_model_is_looked_up_once(monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants, errors

    from chunkloss.cli import rewards

    class Missing(errors.RepositoryNotFoundError):
        def __init__(self):  # the hub's 404, without an HTTP response object
            Exception.__init__(self, "404")

    calls = []

    def model_info(name, timeout=None):
        calls.append(name)
        if name == "org/missing":
            raise Missing()
        return object()

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    rewards._hub_model.cache_clear()
    assert rewards.reward_funcs(["org/reward", "org/reward"]) == ["org/reward", "org/reward"]
    with pytest.raises(ConfigError, match="is not a registered reward, an importable function or a model"):
        rewards.reward_funcs(["org/missing"])
    assert calls == ["org/reward", "org/missing"]
    rewards._hub_model.cache_clear()


QLORA = "load_in_4bit: true\nuse_bnb_nested_quant: true\nuse_peft: true\n"


def test_load_in_4bit_reaches_the_trainer_as_a_quantization_config(tmp_path, monkeypatch):
    """TRL's ModelConfig keys load_in_4bit / bnb_4bit_quant_type / use_bnb_nested_quant become the
    BitsAndBytesConfig the trainer loads the model with (model_init_kwargs), as TRL's scripts pass it."""
    pytest.importorskip("bitsandbytes")
    from chunkloss.cli import run

    seen = {}

    class Trainer:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(run, "trainer_classes", lambda name: (Trainer, None))
    path = tmp_path / "qlora.yaml"
    path.write_text(_tiny("sft", QLORA + f"output_dir: {tmp_path / 'out'}\n"))
    run.build(str(path), *load_config(str(path)))
    config = seen["args"].model_init_kwargs["quantization_config"]
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert seen["peft_config"] is not None


def test_load_in_4bit_without_bitsandbytes_is_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    path = tmp_path / "qlora.yaml"
    path.write_text(_tiny("sft", QLORA))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    message = "load_in_4bit needs bitsandbytes: pip install 'chunkloss[qlora]'"
    assert err == [f"chunkloss: error: {path}: {message}"]


def test_zero3_config_leaves_accumulation_and_clipping_to_the_trainer():
    """DeepSpeed refuses a config value that differs from the trainer's (transformers: "Please correct the
    following DeepSpeed config values that mismatch TrainingArguments values"), so the accelerate config
    leaves out what the trainer's config sets: with gradient_accumulation_steps: 1 in it, a trainer with
    gradient_accumulation_steps=2 did not start (DeepSpeed 0.19.8, accelerate 1.15, on CPU)."""
    ds = _read(CONFIG_DIR / "accelerate" / "zero3.yaml")["deepspeed_config"]
    assert ds["zero_stage"] == 3
    assert not {"gradient_accumulation_steps", "gradient_clipping"} & set(ds)
