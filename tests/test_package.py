"""Installed layout: every module lives under chunkloss/, and no folder at the repository's root can shadow an
installed distribution when the root is on sys.path (``python -m pytest``, ``python -m chunkloss.cli``)."""

import importlib.metadata
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def root_import_names(root: pathlib.Path = ROOT) -> set[str]:
    """The names under which something at the root is importable: regular packages and modules. A folder
    without ``__init__.py`` is only a namespace portion, which any installed package of its name wins over."""
    names = {p.parent.name for p in root.glob("*/__init__.py")}
    return names | {p.stem for p in root.glob("*.py")}


def shadowed(root: pathlib.Path = ROOT) -> list[str]:
    """``name -> distribution`` for each root import name that an installed distribution also provides."""
    provided = importlib.metadata.packages_distributions()
    return sorted(
        f"{name} -> {', '.join(sorted(set(provided[name])))}"
        for name in root_import_names(root) - {"chunkloss"}
        if name in provided
    )


def test_no_root_folder_shadows_an_installed_distribution():
    assert shadowed() == []


def test_the_shadow_check_fails_on_a_root_folder_named_after_a_distribution(tmp_path):
    """A root ``yaml/`` package (pyyaml is a dependency) is caught; a folder without ``__init__.py`` is
    not."""
    (tmp_path / "yaml").mkdir()
    (tmp_path / "yaml" / "__init__.py").write_text("")
    (tmp_path / "torch").mkdir()
    assert shadowed(tmp_path) == ["yaml -> PyYAML"]


def test_subpackages_installed_inside_chunkloss():
    import chunkloss.kernels
    import chunkloss.trainers

    assert pathlib.Path(chunkloss.kernels.__file__).resolve().parent == ROOT / "chunkloss" / "kernels"
    assert pathlib.Path(chunkloss.trainers.__file__).resolve().parent == ROOT / "chunkloss" / "trainers"


def test_transformers_imports_from_the_root():
    """From the root (on sys.path, as under ``python -m``), transformers' own ``kernels`` import resolves to
    the installed distribution, not to a folder of ours."""
    code = (
        "import importlib.util, chunkloss.trainers\n"
        "s = importlib.util.find_spec('kernels')\n"
        "print(None if s is None else s.origin)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    origin = out.stdout.strip()
    assert origin == "None" or not origin.startswith(str(ROOT / "kernels")), origin


def test_wheel_contains_only_chunkloss(tmp_path):
    """`pip install .` builds this wheel: every module sits under chunkloss/."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("chunkloss-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"chunkloss", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert "chunkloss/kernels/__init__.py" in names and "chunkloss/trainers/__init__.py" in names
