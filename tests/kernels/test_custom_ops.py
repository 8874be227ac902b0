"""The kernels' custom ops: each defined once per process, through ``chunkloss.kernels._utils.custom_op``.

``torch.library.custom_op`` silently replaces an op defined a second time and frees the first definition
under every ``OpOverload`` handed out before, so the helper refuses a second definition. The processes here
are fresh ones: what they import and define is the subject of the test, and a broken guard would free ops
that the rest of the suite uses.
"""

import ast
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGE = _ROOT / "chunkloss"
_KERNELS = _PACKAGE / "kernels"
_HELPER = _KERNELS / "_utils.py"


def _python(script: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", script]
    return subprocess.run(command, cwd=_ROOT, capture_output=True, text=True, timeout=300)


# Imports every module of chunkloss (kernels, engine, losses, models, trainers, cli) with the kernels' logger
# at DEBUG, and prints the ops each definition logged, the helper's record and the dispatcher's chunkloss ops.
_IMPORT_ALL = """
import importlib, json, logging, pkgutil
logged = []
class Record(logging.Handler):
    def emit(self, record):
        logged.append(record.args[0])
log = logging.getLogger("chunkloss.kernels")
log.setLevel(logging.DEBUG)
log.addHandler(Record())
import chunkloss
for info in pkgutil.walk_packages(chunkloss.__path__, "chunkloss."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
import torch
from chunkloss.kernels._utils import defined_ops
registered = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("chunkloss::")]
print(json.dumps({"logged": logged, "defined": defined_ops(), "registered": registered}))
"""


def _definition_sites() -> list[tuple[str, ast.expr]]:
    """``(file, first argument)`` of every ``custom_op(...)`` call in the package's source, the helper's own
    call of ``torch.library.custom_op`` left out."""
    sites = []
    for path in sorted(set(_PACKAGE.rglob("*.py")) - {_HELPER}):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name == "custom_op" and node.args:
                    sites.append((str(path.relative_to(_ROOT)), node.args[0]))
    return sites


def test_every_op_is_defined_once_through_the_helper():
    done = _python(_IMPORT_ALL)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    logged = Counter(result["logged"])
    assert logged and all(n == 1 for n in logged.values()), logged
    assert set(logged) == set(result["defined"]) == set(result["registered"]), result
    assert len(result["registered"]) == len(set(result["registered"]))
    # Each op's record names the kernel module that defines it, by its one import name.
    for qualname, where in result["defined"].items():
        module = where.split(" ", 1)[0]
        assert module.startswith("chunkloss.kernels."), (qualname, where)
        assert where.endswith(f"({_ROOT / Path(*module.split('.'))}.py)"), (qualname, where)

    # No factory: every definition site names its op with a literal, each name at one site, and those are the
    # ops the imports defined; nothing else in the package defines ops.
    sites = _definition_sites()
    names = [arg.value for _, arg in sites if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
    assert len(names) == len(sites), [(f, ast.unparse(a)) for f, a in sites]
    assert Counter(names).most_common(1)[0][1] == 1, names
    assert {f"chunkloss::{n}" for n in names} == set(logged)
    defining = re.compile(r"torch\.library|import library|triton_op|\bLibrary\(")
    others = [p for p in set(_PACKAGE.rglob("*.py")) - {_HELPER} if defining.search(p.read_text())]
    assert others == [], others


def _last_line(done: subprocess.CompletedProcess) -> str:
    return done.stderr.strip().splitlines()[-1]


# After the refused definition the first one still runs: the launch through torch.ops gives glu_ref's values.
_STILL_RUNS = """
a, b = torch.randn(3, 5), torch.randn(3, 5)
torch.testing.assert_close(op(a, b, "silu"), glu_ref(a, b, "silu"))
print("first definition intact")
"""


def test_a_kernel_module_loaded_under_a_second_name_is_refused():
    script = f"""
import importlib.util, sys, torch
from chunkloss.kernels.glu import glu_ref
op = torch.ops.chunkloss.glu_fwd.default
spec = importlib.util.spec_from_file_location("chunkloss.kernels.glu_again", {str(_KERNELS / "glu.py")!r})
try:
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
except RuntimeError as e:
    {_STILL_RUNS.strip().replace(chr(10), chr(10) + "    ")}
    raise
"""
    done = _python(script)
    assert done.returncode == 1 and done.stdout.strip() == "first definition intact", done.stderr[-4000:]
    glu = _KERNELS / "glu.py"
    assert _last_line(done) == (
        f"RuntimeError: chunkloss::glu_fwd is defined twice: by chunkloss.kernels.glu ({glu}), then by "
        f"chunkloss.kernels.glu_again ({glu}); redefining it would free the first definition under every "
        "graph that holds it. Import each chunkloss.kernels module once, by one name (no reload, no second "
        "copy of chunkloss on sys.path)"
    )


def test_a_second_copy_of_the_kernels_is_refused():
    """A second copy of the package has a record of its own, empty: torch's registry still knows the op."""
    script = f"""
import importlib.util, sys, torch
from chunkloss.kernels.glu import glu_ref
op = torch.ops.chunkloss.glu_fwd.default
spec = importlib.util.spec_from_file_location(
    "kernels_copy", {str(_KERNELS / "__init__.py")!r}, submodule_search_locations=[{str(_KERNELS)!r}]
)
sys.modules["kernels_copy"] = importlib.util.module_from_spec(spec)
try:
    spec.loader.exec_module(sys.modules["kernels_copy"])
except RuntimeError as e:
    {_STILL_RUNS.strip().replace(chr(10), chr(10) + "    ")}
    raise
"""
    done = _python(script)
    assert done.returncode == 1 and done.stdout.strip() == "first definition intact", done.stderr[-4000:]
    line = _last_line(done)
    assert line.startswith(
        "RuntimeError: chunkloss::rope is defined twice: by a definition outside this copy of "
        f"chunkloss.kernels (a second copy on sys.path?), then by kernels_copy.rope ({_KERNELS / 'rope.py'});"
    ), line
