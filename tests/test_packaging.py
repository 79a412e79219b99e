"""The built wheel holds every module and every Hydra config of the source tree, warning-free;
the subpackages import one another only in the direction the README's Layout states.

The tests run against the editable install, which reads the folders directly; a regular install
(`pip install draftsmith`, a wheel) only has what pyproject.toml's package list and package data
name, so a config group or module missing there would only fail on a user's machine.
"""

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import requires
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# top-level folders -> the package each becomes (pyproject.toml's package-dir)
PACKAGE_DIRS = {
    "core": "draftsmith",
    "heads": "draftsmith/heads",
    "train": "draftsmith/train",
    "inference": "draftsmith/inference",
    "conf": "draftsmith/conf",
}


def test_wheel_holds_every_module_and_config(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ and *.egg-info/ beside the sources.
    src = tmp_path / "src"
    for folder in PACKAGE_DIRS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    # No build isolation: the venv's setuptools builds it, so the test needs no network.
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    # setuptools' warnings are tomorrow's build errors (a deprecated license table, folders it
    # can import but was not told about)
    assert "BuildBackendWarning" not in build.stdout + build.stderr
    (wheel,) = tmp_path.glob("draftsmith-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if n.endswith((".py", ".yaml"))}
    expected = {
        f"{package}/{path.relative_to(src / folder).as_posix()}"
        for folder, package in PACKAGE_DIRS.items()
        for pattern in ("*.py", "*.yaml")
        for path in (src / folder).rglob(pattern)
    }
    assert any(n.startswith("draftsmith/conf/experiment/") for n in expected)
    assert shipped == expected


# train -> heads <- inference, all over the root package: inference never imports train
FORBIDDEN_IMPORTS = {
    "heads": ("draftsmith.train", "draftsmith.inference"),
    "inference": ("draftsmith.train",),
}


def test_import_direction() -> None:
    for folder, forbidden in FORBIDDEN_IMPORTS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                for name in names:
                    assert not name.startswith(forbidden), f"{folder}/{path.name} imports {name}"


def test_every_dependency_has_a_floor() -> None:
    """scripts/floors.sh tests the floors by pinning each `name>=x` to `name==x`: a dependency
    without one would float there, untested at its lowest."""
    deps = [d for d in requires("draftsmith") or [] if "extra ==" not in d]  # as pip reads them
    assert deps and all(re.fullmatch(r"[A-Za-z0-9_.-]+>=[0-9][0-9.]*", d) for d in deps), deps
