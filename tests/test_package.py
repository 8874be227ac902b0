"""Installed layout: kernels/ and trainers/ live inside chunkloss; nothing shadows the `kernels` package."""

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_subpackages_installed_inside_chunkloss():
    import chunkloss.kernels
    import chunkloss.trainers

    assert pathlib.Path(chunkloss.kernels.__file__).resolve().parent == ROOT / "kernels"
    assert pathlib.Path(chunkloss.trainers.__file__).resolve().parent == ROOT / "trainers"


def test_installed_environment_has_no_top_level_kernels_or_trainers(tmp_path):
    """Outside the checkout (so the repository folder is not on sys.path), `kernels` and `trainers`
    do not resolve to our folders, while chunkloss.kernels does."""
    code = (
        "import importlib.util, chunkloss.kernels, chunkloss.trainers\n"
        "for n in ('kernels', 'trainers'):\n"
        "    s = importlib.util.find_spec(n)\n"
        "    print(n, None if s is None else s.origin)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    for line in out.stdout.splitlines():
        name, origin = line.split(" ", 1)
        assert origin == "None" or not origin.startswith(str(ROOT / name)), line


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
