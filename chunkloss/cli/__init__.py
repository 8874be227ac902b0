"""The ``chunkloss`` command: ``chunkloss train CONFIG`` and ``chunkloss bench``.

``chunkloss train configs/sft-tiny.yaml [--key value ...]`` (or ``--config configs/sft-tiny.yaml``, as
TRL's scripts take it) reads a YAML file whose keys are the fields of the chosen trainer's config class
(TRL's fields plus chunkloss's ``chunk_*`` fields), of TRL's ``ModelConfig`` (``model_name_or_path``,
``dtype``, ``use_peft``, ...) and of :class:`RunArguments` (``trainer``, ``tiny_model``, ``dataset``,
``reward_funcs``, ...). Parsing is TRL's own ``TrlParser``; command-line ``--key value`` pairs override the
file.

Every mistake in a config or on the command line (``chunkloss`` alone included: its usage) is reported on
stderr with exit status 2, in one line; any other error in one line with exit status 1. ``--debug`` (or
``CHUNKLOSS_DEBUG=1``) shows the traceback instead; a config mistake still exits with status 2.
``chunkloss --version`` prints the version.

``chunkloss bench losses|kernels|e2e|all [args]`` runs the benchmark scripts of a source checkout's
``benchmarks/`` folder; it refuses to run without CUDA (CPU timings say nothing about the GPU).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from .bench import bench as _bench
from .config import TRAINERS, RunArguments, load_config, make_parser, read_yaml, trainer_name
from .errors import ConfigError
from .help import USAGE, train_overview
from .run import train

__all__ = ["TRAINERS", "ConfigError", "RunArguments", "load_config", "main", "train"]

# bitsandbytes (0.50, on CPUs with AVX512-BF16), imported with PEFT when TRL loads (later, in `train`),
# tries at import to fetch a CPU 4-bit GEMM kernel from the Hugging Face Hub through the `kernels` package
# and logs a warning on every command when that fails; nothing is fetched at run time here, and its CPU
# path runs without that kernel.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def _config_path(args: list[str]) -> tuple[str | None, list[str]]:
    """The config file and the other arguments: ``CONFIG.yaml`` first, or ``--config CONFIG.yaml`` (or
    ``--config=CONFIG.yaml``, TRL's ``TrlParser`` form) anywhere; ``None`` without one."""
    paths, rest = [], []
    if args and not args[0].startswith("-"):
        paths.append(args[0])
        args = args[1:]
    i = 0
    while i < len(args):
        if args[i] == "--config":
            if i + 1 >= len(args) or args[i + 1].startswith("-"):
                raise ConfigError("--config needs a value: chunkloss train --config CONFIG.yaml")
            paths.append(args[i + 1])
            i += 2
            continue
        if args[i].startswith("--config="):
            paths.append(args[i].partition("=")[2])
        else:
            rest.append(args[i])
        i += 1
    if len(paths) > 1:
        raise ConfigError(f"train takes one config file, got {len(paths)}: {', '.join(paths)}")
    return (paths[0] if paths else None), rest


def _train_command(argv: list[str]) -> int:
    wants_help = any(a in ("-h", "--help") for a in argv)
    path, overrides = _config_path([a for a in argv if a not in ("-h", "--help")])
    if wants_help:
        if path is None and "--trainer" not in overrides:
            print(train_overview())
            return 0
        make_parser(trainer_name({} if path is None else read_yaml(path), overrides)).print_help()
        return 0
    if path is None:
        raise ConfigError(
            "train needs a config file: chunkloss train CONFIG.yaml, or --config CONFIG.yaml "
            "(chunkloss train --help)"
        )
    train(path, overrides)
    return 0


def _command(argv: list[str]) -> int:
    if not argv:  # a usage error: the usage goes to stderr, as argparse prints it
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        from chunkloss import __version__

        print(f"chunkloss {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        return _train_command(rest)
    if command == "bench":
        return _bench(rest)
    raise ConfigError(f"unknown command {command!r}; choose train or bench (chunkloss --help)")


def _one_line(text: str, limit: int = 600) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    """The console script; returns the exit status: 0 done, 2 a usage or config mistake, 1 any other error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("CHUNKLOSS_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        return _command(argv)
    except Exception as exc:
        if isinstance(exc, ConfigError):
            if debug:
                traceback.print_exc()
            print(f"chunkloss: error: {_one_line(str(exc))}", file=sys.stderr)
            return 2
        if debug:
            raise
        message = _one_line(f"{type(exc).__name__}: {exc}")
        print(
            f"chunkloss: error: {message} (--debug or CHUNKLOSS_DEBUG=1 shows the traceback)", file=sys.stderr
        )
        return 1
