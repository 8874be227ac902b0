"""``chunkloss bench``: runs the benchmark scripts of a source checkout's ``benchmarks/`` folder.

The benchmarks are not part of the installed package (they import every peer library and write results
into the checkout). They are found beside the ``chunkloss`` package (an editable install) or in the current
directory (the root of a clone).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path

__all__ = ["BENCHES", "bench", "benchmarks_dir"]

BENCHES = ("losses", "kernels", "e2e")

USAGE = """usage: chunkloss bench [losses|kernels|e2e|all] [args...]

Runs benchmarks/bench_<name>.py against every installed peer and writes a markdown table and PNG plots
under benchmarks/results/. Without a name: losses, then kernels (end-to-end only when asked: `e2e` or
`all`). Arguments after the name go to that script: `chunkloss bench losses --help` shows them.

Needs a CUDA GPU and a source checkout: the benchmarks are not installed with the package. Clone the
chunkloss repository, run `pip install -e ".[bench]"` in it, and run `chunkloss bench` from its root."""


def benchmarks_dir() -> Path | None:
    """The ``benchmarks/`` folder of a source checkout: beside the package, else in the current directory."""
    import chunkloss

    for root in (Path(chunkloss.__file__).resolve().parent.parent, Path(os.getcwd())):
        if (root / "benchmarks" / "bench_losses.py").is_file():
            return root / "benchmarks"
    return None


def _call_main(fn, prog: str, argv: list[str]):
    """``fn(argv)`` (``fn()`` for a ``main`` reading ``sys.argv``) with ``sys.argv[0]`` set to ``prog``: the
    script's argparse usage line then reads ``usage: chunkloss bench <name> ...``."""
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        return fn(argv) if inspect.signature(fn).parameters else fn()
    finally:
        sys.argv = saved


def _targets(argv: list[str]) -> tuple[list[str], list[str]]:
    if not argv or argv[0].startswith("-"):
        return ["losses", "kernels"], argv
    if argv[0] == "all":
        return list(BENCHES), argv[1:]
    return [argv[0]], argv[1:]


def bench(argv: list[str]) -> int:
    """``chunkloss bench [losses|kernels|e2e|all] [args...]``: dispatch to ``benchmarks/bench_<name>.py``."""
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    targets, rest = _targets(argv)
    for t in targets:
        if t not in BENCHES:
            print(
                f"chunkloss: error: unknown benchmark {t!r}; choose losses, kernels, e2e or all",
                file=sys.stderr,
            )
            return 2
    root = benchmarks_dir()
    if root is None:
        print(
            "chunkloss: error: no benchmarks/ folder: `chunkloss bench` runs the benchmark scripts of a "
            "source checkout (clone the chunkloss repository and run it from there; `chunkloss bench "
            "--help`)",
            file=sys.stderr,
        )
        return 2
    wants_help = any(a in ("-h", "--help") for a in rest)
    import torch

    if not torch.cuda.is_available() and not wants_help:
        print(
            "chunkloss: error: no CUDA device found. The benchmarks time GPU kernels and GPU memory; "
            "they do not print CPU numbers. Run this on a machine with a CUDA GPU.",
            file=sys.stderr,
        )
        return 1
    for t in targets:
        if not (root / f"bench_{t}.py").is_file():
            print(f"chunkloss: error: {root / f'bench_{t}.py'} not found", file=sys.stderr)
            return 2
    if str(root.parent) not in sys.path:  # the scripts import benchmarks.harness and benchmarks.cases_*
        sys.path.insert(0, str(root.parent))
    for t in targets:
        if not wants_help:
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
