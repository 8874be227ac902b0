"""The import map points one way: every import of a module of ``chunkloss/`` (at module level, inside
functions, or under ``TYPE_CHECKING``) goes to a module of the same layer or one below, and no modules import
each other in a cycle.

Layers, bottom to top::

    compat    chunkloss._compat: every private name borrowed from torch, transformers, TRL and accelerate;
              imports nothing else of chunkloss
    kernels   chunkloss.kernels: imports nothing else of chunkloss but chunkloss._compat (a leaf)
    engine    chunkloss.engine
    losses    chunkloss.losses, chunkloss.heads, chunkloss.data, and the package chunkloss itself (it
              re-exports the engine and the losses)
    models    chunkloss.models: what puts kernels and losses into transformers models
    trainers  chunkloss.trainers
    cli       chunkloss.cli
    testing   chunkloss.testing: the references and seams tests and benchmarks use (and chunkloss.reference,
              its deprecated alias); nothing else of chunkloss imports it
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = (
    ("compat", ("chunkloss._compat",)),
    ("kernels", ("chunkloss.kernels",)),
    ("engine", ("chunkloss.engine",)),
    ("losses", ("chunkloss.losses", "chunkloss.heads", "chunkloss.data", "chunkloss")),
    ("models", ("chunkloss.models",)),
    ("trainers", ("chunkloss.trainers",)),
    ("cli", ("chunkloss.cli",)),
    ("testing", ("chunkloss.testing", "chunkloss.reference")),
)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of ``chunkloss/`` by its dotted name."""
    out = {}
    for path in sorted((root / "chunkloss").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int | None:
    """The layer of a chunkloss module (the longest prefix that names one), None outside chunkloss."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The chunkloss modules ``module`` imports anywhere in its file. ``from a import b`` names the module
    ``a.b`` where that is a module, else ``a``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join([*base, node.module] if node.module else base)
            else:
                base = node.module or ""
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(n for n in names if n == "chunkloss" or n.startswith("chunkloss."))
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    known = set(files)
    graph = {}
    for module, path in files.items():
        graph[module] = imports_of(module, path, known) - {module}
    return graph


#: Layers whose modules import only modules of their own layer or of a leaf below.
LEAVES = ("compat", "kernels")


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a module in a higher layer, or from a leaf (:data:`LEAVES`) of a layer
    that is not a leaf below it."""
    bad = []
    for a, targets in graph.items():
        la = layer_of(a)
        for b in sorted(targets):
            lb = layer_of(b)
            leaf = la is not None and LAYERS[la][0] in LEAVES and lb != la
            leaf = leaf and not (lb is not None and lb < la and LAYERS[lb][0] in LEAVES)
            if la is not None and lb is not None and (lb > la or leaf):
                bad.append(f"{a} ({LAYERS[la][0]}) -> {b} ({LAYERS[lb][0]})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_point_down_the_layers():
    assert wrong_way(import_graph()) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def private_uses(root: Path = ROOT) -> list[str]:
    """``module: name`` for each ``_private`` name of another chunkloss module that a module of the engine or
    the losses imports (``from m import _f``) or reads (``m._f``, ``m`` an imported chunkloss module)."""
    files = module_files(root)
    found = []
    for module, path in files.items():
        if not module.startswith(("chunkloss.engine", "chunkloss.losses")):
            continue
        tree = ast.parse(path.read_text())
        modules = set()  # local names bound to chunkloss modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("chunkloss"):
                found += [f"{module}: {a.name}" for a in node.names if a.name.startswith("_")]
                modules |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in files}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{module}: {node.value.id}.{node.attr}")
    return found


def test_engine_and_losses_use_no_private_names_of_other_modules():
    """Each loss registers its own CUDA steps from its own module, with no other module's ``_private``
    names."""
    assert private_uses() == []


@pytest.mark.parametrize(
    "files, problem",
    [
        ({"chunkloss/kernels/scale.py": "from chunkloss.engine import Batch\n"}, "wrong way"),
        ({"chunkloss/kernels/scale.py": "from chunkloss.heads import MedusaHeads\n"}, "wrong way"),
        ({"chunkloss/_compat/trl.py": "from chunkloss.engine import Batch\n"}, "wrong way"),
        ({"chunkloss/_compat/torch.py": "import chunkloss\n"}, "wrong way"),
        (
            {"chunkloss/kernels/scale.py": "def f():\n    import chunkloss.losses.cross_entropy\n"},
            "wrong way",
        ),
        ({"chunkloss/engine/steps.py": "from chunkloss.losses import common\n"}, "wrong way"),
        (
            {
                "chunkloss/losses/jsd.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from chunkloss.trainers import gkd\n"
            },
            "wrong way",
        ),
        ({"chunkloss/trainers/sft.py": "from chunkloss.cli import main\n"}, "wrong way"),
        ({"chunkloss/cli/run.py": "from chunkloss.testing import select_steps\n"}, "wrong way"),
        ({"chunkloss/engine/loop.py": "from chunkloss.testing.reference import grpo_ref\n"}, "wrong way"),
        ({"chunkloss/engine/plan.py": "from chunkloss.engine import loop\n"}, "cycle"),
        (
            {"chunkloss/losses/a.py": "from . import b\n", "chunkloss/losses/b.py": "from .a import x\n"},
            "cycle",
        ),
        ({"chunkloss/losses/grpo_options.py": "from chunkloss.losses.grpo import LOSS_TYPES\n"}, "cycle"),
        (
            {
                "chunkloss/losses/dft.py": "from chunkloss.losses import cross_entropy\n"
                "f = cross_entropy._chunk_sums\n"
            },
            "private",
        ),
        ({"chunkloss/losses/jsd.py": "from chunkloss.losses.cross_entropy import _chunk_sums\n"}, "private"),
    ],
)
def test_the_check_fails_on_a_bad_import(tmp_path, files, problem):
    """The checks catch each kind of bad edge, in a copy of the sources with one import added."""
    for path in (ROOT / "chunkloss").rglob("*.py"):
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    assert wrong_way(import_graph(tmp_path)) == [] and cycles(import_graph(tmp_path)) == []
    assert private_uses(tmp_path) == []
    for rel, text in files.items():
        target = tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((target.read_text() if target.exists() else "") + text)
    graph = import_graph(tmp_path)
    if problem == "wrong way":
        assert wrong_way(graph)
    elif problem == "private":
        assert private_uses(tmp_path)
    else:
        assert cycles(graph)


def test_benchmarks_import_no_cycle():
    """The benchmark scripts import each other one way (shared pieces live in ``benchmarks.harness`` and
    ``benchmarks.report``), at module level or inside functions."""
    graph = {}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        module = f"benchmarks.{path.stem}"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                targets.add(node.module)
            elif isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                targets |= {f"benchmarks.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("benchmarks.")}
        graph[module] = targets - {module}
    assert cycles(graph) == []
