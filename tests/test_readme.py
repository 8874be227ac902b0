"""Every code block of the README, and of the docs pages it sends a newcomer to, runs as written.

Python blocks run with ``exec`` in a fresh namespace, in a temporary working directory, on CPU (their shapes
are tiny); a block whose first line is ``# needs: ...`` (a GPU, a download) is skipped with that reason.
Shell blocks are checked without installing anything: each command parses, names a program that exists, and
its arguments name what exists (the pinned torch, the extras, the config, pytest's options); CI runs the
full test command as the README writes it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The README and the pages it moves its longer examples to.
PAGES = (
    README,
    ROOT / "docs" / "writing-a-loss.md",
    ROOT / "docs" / "writing-a-kernel.md",
    ROOT / "docs" / "kernels.md",
)
NEEDS = "# needs:"
# Blocks that run an end-to-end training (generation included): over 20 s on a busy 2-core machine.
SLOW = ("ChunkedGRPOTrainer(",)


def _blocks(language: str) -> list[tuple[str, str]]:
    """(id, code) of each ``language`` block: the id is the section's heading and the block's index in it."""
    found, counts = [], {}
    for page in PAGES:
        section = page.stem.lower()
        for part in re.split(r"(^#+ [^\n]*$|^```\w*\n.*?^```$)", page.read_text(), flags=re.M | re.S):
            if part.startswith("#"):
                section = part.lstrip("#").strip().lower().replace(" ", "-").replace("`", "")
            elif part.startswith(f"```{language}\n"):
                counts[section] = counts.get(section, 0) + 1
                found.append((f"{section}-{counts[section]}", part[len(language) + 4 : -3]))
    return found


def _params(language: str):
    out = []
    for name, code in _blocks(language):
        marks = [pytest.mark.slow] if any(s in code for s in SLOW) else []
        out.append(pytest.param(code, id=name, marks=marks))
    return out


def test_the_readme_has_python_and_shell_blocks():
    assert len(_blocks("python")) >= 4 and len(_blocks("bash")) >= 3
    needing = [code.splitlines()[0] for _, code in _blocks("python") if code.startswith(NEEDS)]
    assert len(needing) <= 2, f"keep the blocks that cannot run on CPU few: {needing}"


@pytest.mark.parametrize("code", _params("python"))
def test_python_block_runs_as_written(code, tmp_path, monkeypatch):
    first = code.splitlines()[0]
    if first.startswith(NEEDS):
        pytest.skip(first[len(NEEDS) :].strip())
    monkeypatch.chdir(tmp_path)  # whatever a block writes (a trainer's output_dir) stays in tmp_path
    threads = torch.get_num_threads()
    try:
        # As a script runs: its own registered module, so a dataclass in the block resolves its annotations.
        # From a file of its own: triton.jit reads a kernel's source through inspect.
        module = types.ModuleType("readme_block")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        path = tmp_path / "readme_block.py"
        path.write_text(code)
        exec(compile(code, str(path), "exec"), module.__dict__)
    finally:
        torch.set_num_threads(threads)


def _commands(code: str) -> list[list[str]]:
    """The commands of a shell block: every line, split at ``&&``."""
    out = []
    for line in code.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            out += [shlex.split(part) for part in line.split("&&")]
    return out


def _pinned(requirement: str) -> str:
    name, _, version = requirement.partition("==")
    assert name == "torch" and version, f"the README pins only torch, got {requirement!r}"
    return version


def _check_pip(args: list[str]) -> None:
    assert args[0] == "install", args
    for arg in args[1:]:
        if arg == "-e":
            continue
        if "==" in arg:
            version = _pinned(arg)
            assert version in (ROOT / ".ci" / "run").read_text(), "CI installs the torch the README pins"
            continue
        path, _, extras = arg.partition("[")
        assert (ROOT / path / "pyproject.toml").exists(), arg
        pyproject = (ROOT / "pyproject.toml").read_text()
        for extra in filter(None, extras.rstrip("]").split(",")):
            assert re.search(rf"(?m)^{re.escape(extra)} = \[", pyproject), f"extra {extra!r} is not declared"


def _check_chunkloss(args: list[str]) -> None:
    from chunkloss.cli import load_config

    assert args[0] == "train", args
    load_config(str(ROOT / args[1]), args[2:])  # parses and checks the config as the command does


def _check_pytest(args: list[str]) -> None:
    assert args[:2] == ["-m", "pytest"], args
    # The same options, collecting this file only: pytest refuses an unknown option or marker expression.
    paths = [a for a in args[2:] if (ROOT / a).exists() and not a.startswith("-")]
    assert paths == ["tests"], args
    options = [a for a in args[2:] if a not in paths]
    command = [sys.executable, "-m", "pytest", *options, "--collect-only", "--strict-markers", __file__]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_python_block_runs_as_written" in done.stdout


CHECKS = {"pip": _check_pip, "chunkloss": _check_chunkloss, "python": _check_pytest}


@pytest.mark.parametrize("code", _params("bash"))
def test_shell_block_parses_and_names_what_exists(code):
    assert subprocess.run(["bash", "-n"], input=code, text=True).returncode == 0
    for program, *args in _commands(code):
        assert program in CHECKS, f"no check for {program!r}: add one"
        assert shutil.which(program) or program == "python", f"{program} is not installed"
        CHECKS[program](args)


def test_ci_runs_the_readme_full_test_command():
    full = [c for _, code in _blocks("bash") for c in _commands(code) if c[:3] == ["python", "-m", "pytest"]]
    assert full, "the README gives a test command"
    ci = [shlex.split(line, comments=True) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci_tests = [c[1:] for c in ci if c[:3] == ["python3", "-m", "pytest"]]
    assert ci_tests == [full[0][1:]], "CI runs the README's first (full) test command"
    assert "-m" not in full[0][3:], "the first test command is the full suite"


@pytest.mark.slow  # two collections of the whole suite, about 30 s
def test_the_readme_quick_check_collects_a_subset_without_errors():
    """The README's second test command (the quick check), as written, collects without an error and selects
    part of the full suite: a marker renamed or a path moved fails here, not on a newcomer's machine."""
    commands = [c for _, code in _blocks("bash") for c in _commands(code)]
    commands = [c for c in commands if c[:3] == ["python", "-m", "pytest"]]
    assert len(commands) >= 2, "the README gives the full test command and the quick check"
    full, quick = commands[0], commands[1]
    assert "-m" in quick[3:] and quick[-1] == full[-1], quick

    def collected(command: list[str]) -> int:
        run = subprocess.run(
            [sys.executable, *command[1:], "--collect-only"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return int(re.search(r"^(\d+)(?:/\d+)? tests? collected", run.stdout, re.M).group(1))

    assert 0 < collected(quick) < collected(full)
