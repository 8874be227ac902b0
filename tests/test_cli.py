"""The ``chunkloss`` command on CPU: help and usage errors, the tiny configs end to end (each for its full
run, with no deprecation warning of chunkloss's making), what a run leaves in its output folder (summary,
checkpoint, trainer state, loss curve), every trainer from a local model folder and from its GPU config, and
``chunkloss bench``'s dispatch, usage lines and refusals."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from chunkloss import cli
from chunkloss.cli import bench as bench_cli
from tests.child_process import in_child_process

# CPU-heavy and independent of the rest: in the child process beside the suite (tests/child_process.py).
pytestmark = in_child_process

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def _train(name: str, tmp_path: Path, *overrides: str) -> tuple[dict, Path]:
    out = tmp_path / name
    threads = torch.get_num_threads()
    summary = cli.train(str(CONFIG_DIR / f"{name}.yaml"), ["--output_dir", str(out), *overrides])
    assert torch.get_num_threads() == threads, "cpu_threads is restored after the run"
    return summary, out


def _check_run(summary: dict, out: Path, steps: int) -> None:
    """All steps done, finite numbers, a checkpoint that loads, the summary on disk as returned."""
    assert summary["steps"] == steps
    assert summary["losses"] and all(math.isfinite(v) for v in summary["losses"])
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] == summary["losses"][-1]
    assert summary["tokens"] > 0 and summary["tokens_per_s"] > 0
    assert summary["peak_memory_mib"] > 0
    expected_kind = "GPU" if torch.cuda.is_available() else "CPU"
    assert summary["peak_memory_kind"].startswith(expected_kind)
    assert summary["checkpoint"] == str(out.resolve())
    assert json.loads((out / "chunkloss_summary.json").read_text()) == summary
    assert _moved(out / "model.safetensors", out / "tiny-init" / "model.safetensors")
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == steps
    assert [h["loss"] for h in state["log_history"] if "loss" in h] == summary["losses"]
    assert summary["loss_curve"] == str(out.resolve() / "loss_curve.png")
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _moved(trained_file: Path, initial_file: Path) -> bool:
    """Every initial weight is saved, and some weight differs from its initial value (or is new: Medusa's
    heads, trained on a frozen backbone)."""
    trained, initial = load_file(trained_file), load_file(initial_file)
    assert initial.keys() <= trained.keys()
    return any(k not in initial or not torch.equal(trained[k], initial[k]) for k in trained)


def _our_deprecations(records) -> list[str]:
    """The FutureWarnings and DeprecationWarnings raised in chunkloss's code, or by transformers'
    TrainingArguments for a config key chunkloss passed on."""
    repo = str(Path(__file__).resolve().parent.parent)
    return [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in records
        if issubclass(w.category, FutureWarning | DeprecationWarning)
        and (w.filename.startswith(repo) or w.filename.endswith("training_args.py"))
    ]


def _falls(losses: list[float]) -> bool:
    """The second half of the logged losses averages below the first half, and the last is below the first."""
    half = len(losses) // 2
    return sum(losses[half:]) / (len(losses) - half) < sum(losses[:half]) / half and losses[-1] < losses[0]


# Full 30-step runs of every tiny config, the loss logged at every step. GRPO and RLOO are apart: their loss
# is a policy-gradient surrogate (zero-mean advantages), not a quantity that falls as the policy improves.
FALLING = ["sft-tiny", "dpo-tiny", "orpo-tiny", "kto-tiny", "gkd-tiny", "distillation-tiny", "medusa-tiny"]


@pytest.mark.slow  # 30 steps of a tiny config, and TRL's generation for DPO/GKD/distillation
@pytest.mark.parametrize("name", FALLING)
def test_tiny_config_full_run_loss_falls(tmp_path, capsys, recwarn, name):
    summary, out = _train(name, tmp_path, "--logging_steps", "1")
    assert _our_deprecations(recwarn.list) == []
    _check_run(summary, out, steps=30)
    assert summary["trainer"] == cli.TRAINERS[name.split("-")[0]].trainer
    assert len(summary["losses"]) == 30
    assert _falls(summary["losses"]), summary["losses"]
    if name == "sft-tiny":
        # The counting task is learnable: cross-entropy falls well below its start (about log V at init).
        assert summary["final_loss"] < 0.6 * summary["first_loss"], summary["losses"]
    if name == "dpo-tiny":
        # At step 1 the policy is the reference (a reload of the same tiny-init weights): -logsigmoid(0).
        assert summary["losses"][0] == pytest.approx(math.log(2), abs=1e-4)
    if name == "kto-tiny":
        # At step 1 the policy is the reference and the KL term 0: 1 - sigmoid(0) for every completion.
        assert summary["losses"][0] == pytest.approx(0.5, abs=1e-4)
    printed = capsys.readouterr().out
    for line in ("final loss", "tokens/s", "peak memory", "checkpoint"):
        assert line in printed
    assert str(out.resolve()) in printed


@pytest.mark.slow
def test_grpo_tiny_full_run_reward_rises(tmp_path, capsys, recwarn):
    summary, out = _train("grpo-tiny", tmp_path)
    assert _our_deprecations(recwarn.list) == []
    _check_run(summary, out, steps=30)
    assert summary["trainer"] == "ChunkedGRPOTrainer"
    rewards = summary["rewards"]
    assert len(rewards) == 6 and all(math.isfinite(r) for r in rewards)
    assert rewards[-1] > rewards[0], rewards
    printed = capsys.readouterr().out
    assert "final reward" in printed and "watch the reward" in printed


@pytest.mark.slow
def test_rloo_tiny_full_run_reward_rises(tmp_path, recwarn):
    summary, out = _train("rloo-tiny", tmp_path)
    assert _our_deprecations(recwarn.list) == []
    _check_run(summary, out, steps=30)
    assert summary["trainer"] == "ChunkedRLOOTrainer"
    rewards = summary["rewards"]
    assert len(rewards) == 6 and all(math.isfinite(r) for r in rewards)
    assert rewards[-1] > rewards[0], rewards


# Every tiny config, and SFT with label smoothing (TRL's SFTTrainer warns about it from our constructor).
QUIET = [(p.stem, ()) for p in sorted(CONFIG_DIR.glob("*-tiny.yaml"))]
QUIET += [("sft-tiny", ("--label_smoothing_factor", "0.1"))]


@pytest.mark.parametrize("name, extra", QUIET, ids=[" ".join((n, *e)) for n, e in QUIET])
def test_tiny_config_warns_nothing_of_ours(tmp_path, name, extra):
    """Two steps of every tiny config (generation included) with every warning raised from chunkloss's
    modules an error, and no deprecation warning reaching the user from anywhere (the trainers drop those of
    TRL's calls of transformers' deprecated checkpointing names: chunkloss/trainers/_checkpointing.py)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("error", module=r"chunkloss(\.|$)")
        summary, _ = _train(name, tmp_path, "--max_steps", "2", "--logging_steps", "1", *extra)
    assert summary["steps"] == 2
    deprecations = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in seen
        if issubclass(w.category, FutureWarning | DeprecationWarning)
    ]
    assert deprecations == []


PNG = b"\x89PNG\r\n\x1a\n"


def test_output_folder_holds_the_trainer_state_and_the_loss_curve(tmp_path, capsys):
    summary, out = _train("sft-tiny", tmp_path, "--max_steps", "2", "--logging_steps", "1")
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert [h["loss"] for h in state["log_history"] if "loss" in h] == summary["losses"]
    png = out / "loss_curve.png"
    assert png.read_bytes()[:8] == PNG
    assert summary["loss_curve"] == str(png.resolve())
    assert f"  loss curve    {png.resolve()}" in capsys.readouterr().out.splitlines()


def test_without_matplotlib_the_loss_curve_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure fails
    summary, out = _train("sft-tiny", tmp_path, "--max_steps", "1")
    assert summary["loss_curve"] is None and not (out / "loss_curve.png").exists()
    assert (out / "trainer_state.json").exists() and (out / "chunkloss_summary.json").exists()
    lines = [line for line in capsys.readouterr().out.splitlines() if "loss curve" in line]
    assert lines == ["  loss curve    not drawn: matplotlib is not installed (pip install matplotlib)"]


def test_main_help_lists_commands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "chunkloss train" in out and "chunkloss bench" in out


def test_version_is_the_package_version_and_pyproject_agrees(capsys):
    import chunkloss

    for flag in ("--version", "-V"):
        assert cli.main([flag]) == 0
        assert capsys.readouterr().out == f"chunkloss {chunkloss.__version__}\n"
    pyproject = (CONFIG_DIR.parent / "pyproject.toml").read_text()  # tomllib needs Python 3.11
    assert re.findall(r'(?m)^version = "(.*)"$', pyproject) == [chunkloss.__version__]


def test_no_arguments_is_a_usage_error(capsys):
    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "", "a usage error goes to stderr, as argparse prints it"
    assert captured.err.startswith("usage: chunkloss") and "chunkloss train CONFIG.yaml" in captured.err
    assert cli.main(["fly"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "unknown command 'fly'" in captured.err


def test_train_takes_the_config_as_trls_config_option(capsys):
    """``--config CONFIG`` (TRL's scripts' form) and ``--config=CONFIG`` read the file as the positional
    form does: a mistake in the file is reported the same way."""
    path = str(CONFIG_DIR / "sft-tiny.yaml")
    assert cli.main(["train", "--config", path, "--help"]) == 0
    assert "--completion_only_loss" in capsys.readouterr().out, "the sft trainer's options, from the file"
    outcomes = []
    for argv in (
        [path, "--max_steps", "0"],
        ["--config", path, "--max_steps", "0"],
        [f"--config={path}", "--max_steps", "0"],
        ["--max_steps", "0", "--config", path],
    ):
        outcomes.append((cli.main(["train", *argv]), capsys.readouterr().err))
    assert len(set(outcomes)) == 1, outcomes
    status, err = outcomes[0]
    assert status == 2 and err.startswith(f"chunkloss: error: {path}: max_steps=0 would train one step"), err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config"], "--config needs a value"),
        (["--config", "--max_steps", "2"], "--config needs a value"),
        (["a.yaml", "--config", "b.yaml"], "train takes one config file, got 2: a.yaml, b.yaml"),
        ([], "train needs a config file: chunkloss train CONFIG.yaml, or --config CONFIG.yaml"),
    ],
)
def test_train_config_mistakes_are_usage_errors(capsys, argv, message):
    assert cli.main(["train", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"chunkloss: error: {message}"), captured.err


def test_train_help_lists_trainers_and_options(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for name, spec in cli.TRAINERS.items():
        assert name in out and spec.trainer in out
    for key in (
        "tiny_model",
        "dataset",
        "reward_funcs",
        "chunk_size",
        "chunk_accum_dtype",
        "chunk_compile",
        "model_name_or_path",
    ):
        assert key in out


@pytest.mark.parametrize("name", list(cli.TRAINERS))
def test_train_help_of_one_trainer_lists_every_option(capsys, name):
    assert cli.main(["train", "--trainer", name, "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--learning_rate",
        "--chunk_size",
        "--chunk_compile",
        "--tiny_model",
        "--model_name_or_path",
    ):
        assert flag in out
    own = {
        "grpo": "--num_generations",
        "rloo": "--num_generations",
        "dpo": "--beta",
        "orpo": "--beta",
        "kto": "--desirable_weight",
        "gkd": "--lmbda",
        "distillation": "--teacher_model_name_or_path",
        "sft": "--completion_only_loss",
        "medusa": "--medusa_num_heads",
    }[name]
    assert own in out


def test_train_help_from_a_config_file(capsys):
    assert cli.main(["train", str(CONFIG_DIR / "grpo-tiny.yaml"), "--help"]) == 0
    assert "--num_generations" in capsys.readouterr().out


def test_module_entry_point_runs_in_a_fresh_interpreter():
    ok = subprocess.run(
        [sys.executable, "-m", "chunkloss.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert "chunkloss train" in ok.stdout


# ---------------------------------------------------------------------------------------------------------
# bench


def test_bench_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["bench"], ["bench", "losses"], ["bench", "all", "--quick"]):
        assert cli.main(argv) != 0
        err = capsys.readouterr().err
        assert "no CUDA device" in err and len(err.splitlines()) == 1


def test_bench_help_says_it_needs_a_source_checkout(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: chunkloss bench") and "losses" in out
    assert "source checkout" in out and "Clone the" in out


def test_bench_without_a_checkout_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "benchmarks_dir", lambda: None)
    assert cli.main(["bench", "losses"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "source checkout" in err


def test_bench_unknown_name(capsys):
    assert cli.main(["bench", "speed"]) == 2
    assert "unknown benchmark 'speed'" in capsys.readouterr().err


def _fake_benchmarks(tmp_path: Path, names: list[str]) -> Path:
    root = tmp_path / "checkout" / "benchmarks"
    root.mkdir(parents=True)
    for name in names:
        # bench_kernels.main() reads sys.argv; the others take argv. Each parses with argparse's default prog.
        head = "def main():\n    argv = sys.argv[1:]\n" if name == "kernels" else "def main(argv=None):\n"
        (root / f"bench_{name}.py").write_text(
            "import argparse, json, os, sys\n"
            + head
            + "    argparse.ArgumentParser().parse_known_args(argv)\n"
            f"    with open(os.path.join(os.path.dirname(__file__), 'calls.jsonl'), 'a') as f:\n"
            f"        f.write(json.dumps([{name!r}, argv]) + '\\n')\n"
            "    return 0\n"
        )
    return root


def _calls(root: Path) -> list:
    path = root / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def fake_checkout(tmp_path, monkeypatch):
    root = _fake_benchmarks(tmp_path, ["losses", "kernels", "e2e"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_cli, "benchmarks_dir", lambda: root)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("losses", "kernels", "e2e"):  # the fake modules must not outlive the test
        monkeypatch.delitem(sys.modules, f"benchmarks.bench_{name}", raising=False)
        monkeypatch.setitem(sys.modules, f"benchmarks.bench_{name}", None)
    return root


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "losses", "--quick", "--out", "r"], [["losses", ["--quick", "--out", "r"]]]),
        (["bench", "e2e"], [["e2e", []]]),
        (["bench", "kernels", "--quick"], [["kernels", ["--quick"]]]),
        (["bench"], [["losses", []], ["kernels", []]]),
        (["bench", "all", "-q"], [["losses", ["-q"]], ["kernels", ["-q"]], ["e2e", ["-q"]]]),
    ],
)
def test_bench_dispatches_to_the_checkout_scripts(fake_checkout, argv, expected):
    assert cli.main(argv) == 0
    assert _calls(fake_checkout) == expected


@pytest.mark.parametrize("name", ["losses", "kernels"])
def test_bench_script_help_names_the_subcommand(fake_checkout, capsys, name):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", name, "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: chunkloss bench {name} [-h]")


def test_bench_losses_help_of_the_repository_script(capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "benchmarks.bench_losses", raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "losses", "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: chunkloss bench losses ")


def test_bench_missing_script_is_a_clear_error(tmp_path, monkeypatch, capsys):
    root = _fake_benchmarks(tmp_path, ["losses"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_cli, "benchmarks_dir", lambda: root)
    assert cli.main(["bench", "kernels"]) == 2
    assert "bench_kernels.py not found" in capsys.readouterr().err
    assert _calls(root) == []


def test_bench_finds_the_repository_benchmarks():
    repo = Path(__file__).resolve().parent.parent
    assert bench_cli.benchmarks_dir() == repo / "benchmarks"
    assert (repo / "benchmarks" / "bench_losses.py").is_file()


def test_bench_of_an_installed_package_runs_from_the_root_of_a_clone(tmp_path, monkeypatch):
    import chunkloss

    installed = tmp_path / "site-packages" / "chunkloss"
    installed.mkdir(parents=True)
    monkeypatch.setattr(chunkloss, "__file__", str(installed / "__init__.py"))
    clone = _fake_benchmarks(tmp_path, ["losses"]).parent
    monkeypatch.chdir(clone)
    assert bench_cli.benchmarks_dir() == clone / "benchmarks"
    monkeypatch.chdir(tmp_path)
    assert bench_cli.benchmarks_dir() is None


# ---------------------------------------------------------------------------------------------------------
# datasets and models other than the built-in ones


@pytest.mark.parametrize("suffix", [".jsonl", "-saved"])
def test_train_on_a_local_dataset(tmp_path, suffix):
    from chunkloss.data import tiny_dataset

    rows = tiny_dataset("sft", 64, seed=1)
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        rows.to_json(str(path))
    else:
        rows.save_to_disk(str(path))
    summary, out = _train(
        "sft-tiny", tmp_path, "--dataset", str(path), "--max_steps", "2", "--logging_steps", "1"
    )
    _check_run(summary, out, steps=2)


@pytest.mark.parametrize("kind", list(cli.TRAINERS))
def test_model_from_a_local_path(tmp_path, kind):
    # The GPU configs' route (model_name_or_path, teacher_model_name_or_path, dtype), on saved tiny models.
    import yaml

    from chunkloss.data import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    for name, hidden in (("student", 64), ("teacher", 128)):
        tiny_model(tokenizer, hidden_size=hidden).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    raw = yaml.safe_load((CONFIG_DIR / f"{kind}-tiny.yaml").read_text())
    del raw["tiny_model"]
    raw.pop("teacher_tiny_model", None)
    raw.update(
        model_name_or_path=str(tmp_path / "student"),
        dtype="float32",
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        logging_steps=1,
    )
    if kind in ("gkd", "distillation"):
        raw.update(
            teacher_model_name_or_path=str(tmp_path / "teacher"),
            teacher_model_init_kwargs={"dtype": "float32"},
        )
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(raw))
    summary = cli.train(str(config))
    assert summary["steps"] == 2 and all(math.isfinite(v) for v in summary["losses"])
    assert _moved(tmp_path / "out" / "model.safetensors", tmp_path / "student" / "model.safetensors")


GPU_CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.yaml") if not p.stem.endswith("-tiny"))


@pytest.mark.parametrize("gpu_config", GPU_CONFIGS, ids=[p.stem for p in GPU_CONFIGS])
def test_gpu_config_runs_one_step_on_cpu_with_a_tiny_model(tmp_path, gpu_config):
    # Every key of the GPU-scale config is used as written except the ones that size the run for a GPU
    # (model, device, batch, lengths, steps, compile): catches keys that parse but break the trainer.
    import yaml

    from chunkloss.data import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    for name, hidden in (("student", 64), ("teacher", 128)):
        tiny_model(tokenizer, hidden_size=hidden).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    raw = yaml.safe_load(gpu_config.read_text())
    raw.update(
        model_name_or_path=str(tmp_path / "student"),
        bf16=False,
        use_cpu=True,
        max_steps=1,
        dataset_size=32,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        chunk_compile=False,
        output_dir=str(tmp_path / "out"),
        logging_steps=1,
    )
    for key, cap in (("max_length", 64), ("max_completion_length", 8), ("max_new_tokens", 8)):
        if key in raw:
            raw[key] = min(raw[key], cap)
    if "teacher_model_name_or_path" in raw:
        raw["teacher_model_name_or_path"] = str(tmp_path / "teacher")
    config = tmp_path / "gpu-on-cpu.yaml"
    config.write_text(yaml.safe_dump(raw))
    summary = cli.train(str(config))
    assert summary["steps"] == 1 and all(math.isfinite(v) for v in summary["losses"])


def test_a_model_folder_that_holds_no_model_is_one_line(tmp_path, capsys):
    # Found only when the trainer is built: what transformers raises becomes the one-line config error.
    import yaml

    raw = yaml.safe_load((CONFIG_DIR / "sft-tiny.yaml").read_text())
    del raw["tiny_model"]
    (tmp_path / "empty").mkdir()
    raw.update(model_name_or_path=str(tmp_path / "empty"), output_dir=str(tmp_path / "out"))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(config)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"chunkloss: error: {config}: cannot build the sft trainer: ")
