"""How the package is built and installed: one version, one list of dependencies.

The version is ``trio_vstream.__version__``; pyproject.toml declares it dynamic and
setuptools reads it from the package's ``__init__.py``. The dependencies are
pyproject.toml's, which every tox environment installs. Two copies drift (a release
whose metadata says one version and whose ``--version`` says another; a client
environment missing a dependency added since), so these tests check that there is one
of each, and that the build really takes the version from the package.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import trio_vstream

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once() -> None:
    config = _pyproject()
    assert "version" not in config["project"], "pyproject.toml writes the version itself"
    assert "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "trio_vstream.__version__"
    }


# What a build backend asks setuptools for first: the metadata, from which the wheel's
# name and METADATA's Version come.
PREPARE_METADATA = """\
import pathlib, tempfile
import setuptools.build_meta as backend
out = tempfile.mkdtemp()
name = backend.prepare_metadata_for_build_wheel(out)
print((pathlib.Path(out) / name / "METADATA").read_text())
"""


def test_the_build_takes_the_version_from_the_package(tmp_path: Path) -> None:
    """A copy of the project whose ``__version__`` alone is changed builds with that
    version. The package in the copy raises when imported: setuptools reads the literal
    from the file, so building needs none of the package's dependencies."""
    pytest.importorskip("setuptools.build_meta", reason="setuptools builds the package")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copy(ROOT / "README.md", tmp_path)  # the long description
    package = tmp_path / "trio_vstream"
    package.mkdir()
    init = (ROOT / "trio_vstream" / "__init__.py").read_text()
    assert f'__version__ = "{trio_vstream.__version__}"' in init
    changed = init.replace(f'"{trio_vstream.__version__}"', '"9.8.7"')
    (package / "__init__.py").write_text(f'{changed}\nraise RuntimeError("imported")\n')
    result = subprocess.run(
        [sys.executable, "-c", PREPARE_METADATA],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    metadata = result.stdout.splitlines()
    assert "Name: trio-vstream" in metadata
    assert "Version: 9.8.7" in metadata


def test_the_installed_metadata_says_the_same_version() -> None:
    """Where the package is installed (tox installs it in every environment), its
    metadata carries ``__version__``. A development install made before a version
    change fails here until it is made again (``pip install -e .``)."""
    try:
        installed = importlib.metadata.version("trio-vstream")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("trio-vstream is not installed (run from the source tree)")
    assert installed == trio_vstream.__version__


def test_the_command_line_says_its_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trio_vstream", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"trio_vstream {trio_vstream.__version__}\n"


def _tox() -> configparser.ConfigParser:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    return tox


def _name(requirement: str) -> str:
    """A requirement's project name, normalised (PEP 503)."""
    match = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def test_the_client_environment_installs_the_package() -> None:
    """One list of dependencies, pyproject.toml's: tox's client environment installs the
    package as the others do, rather than a hand-made copy of its dependencies run from
    the source tree (tests/test_cli_imports.py keeps the client light instead)."""
    client = _tox()["testenv:client"]
    assert client.get("skip_install", "false").strip().lower() == "false"
    assert "deps" not in client
    assert "PYTHONPATH" not in client.get("set_env", "")
    assert client["commands"].split()[:4] == ["python", "-m", "trio_vstream", "client"]


def test_tox_pins_only_what_the_package_asks_for() -> None:
    """tox's own dependencies (torch's pin) are versions of the package's, never a
    package of their own."""
    declared = {_name(r) for r in _pyproject()["project"]["dependencies"]}
    pinned = [line for line in _tox()["testenv"]["deps"].splitlines() if line.strip()]
    assert pinned
    assert {_name(r) for r in pinned} <= declared
