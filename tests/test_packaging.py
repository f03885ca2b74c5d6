"""How the package is built and developed: one version, one list of dependencies, and
a pre-commit config in step with pyproject.toml.

The version is ``trio_vstream.__version__``; pyproject.toml declares it dynamic and
setuptools reads it from the package's ``__init__.py``. The dependencies are
pyproject.toml's, which every tox environment installs. Two copies drift (a release
whose metadata says one version and whose ``--version`` says another; a client
environment missing a dependency added since), so these tests check that there is one
of each, and that the build really takes the version from the package.
"""

from __future__ import annotations

import configparser
import importlib
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement  # packaging comes with pytest
from packaging.version import Version

import trio_vstream

# PyYAML comes with mkdocs (the test extra), which reads mkdocs.yml with it. It ships no
# type hints: imported by name, it is a plain module to a type checker.
yaml = importlib.import_module("yaml")

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


# .pre-commit-config.yaml: the hook repositories cannot be fetched here (nor in CI, which
# runs the same tools through tox), so these tests hold the file to pyproject.toml.


def _hooks() -> dict[str, dict[str, Any]]:
    """The pre-commit config's repositories by URL (``local`` for the project's own)."""
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    return {repo["repo"]: repo for repo in config["repos"]}


def _test_extra() -> dict[str, Requirement]:
    extra = _pyproject()["project"]["optional-dependencies"]["test"]
    return {_name(r): Requirement(r) for r in extra}


def test_the_ruff_hooks_run_a_ruff_the_project_admits() -> None:
    """The hooks' ruff is one the test extra's requirement admits, so pre-commit and tox
    lint with compatible rules; both hooks of ruff, linter and formatter, are there."""
    ruff = _hooks()["https://github.com/astral-sh/ruff-pre-commit"]
    assert re.fullmatch(r"v\d+\.\d+\.\d+", ruff["rev"]), ruff["rev"]
    assert Version(ruff["rev"].removeprefix("v")) in _test_extra()["ruff"].specifier
    assert [hook["id"] for hook in ruff["hooks"]] == ["ruff-check", "ruff-format"]


def test_every_hook_repository_is_pinned_to_a_release() -> None:
    remote = [repo for url, repo in _hooks().items() if url != "local"]
    assert remote
    for repo in remote:
        assert re.fullmatch(r"v\d+\.\d+\.\d+", repo["rev"]), repo


def test_the_local_hooks_run_the_project_tools_as_tox_does() -> None:
    """lint-imports and mypy, from the environment, on the whole tree with their
    configuration in pyproject.toml: no file names, no arguments of their own."""
    local = {hook["id"]: hook for hook in _hooks()["local"]["hooks"]}
    assert set(local) == {"lint-imports", "mypy"}
    for hook_id, hook in local.items():
        assert (hook["entry"], hook["language"], hook["pass_filenames"]) == (
            hook_id,
            "system",
            False,
        )
        assert "args" not in hook
        assert re.search(hook["files"], "pyproject.toml"), hook
        assert re.search(hook["files"], "trio_vstream/session/session.py"), hook
    assert "import-linter" in _test_extra()
    assert "importlinter" in _pyproject()["tool"]


def test_mypy_is_configured_with_what_to_check() -> None:
    """The mypy hook passes no file names: pyproject.toml's [tool.mypy] names what mypy
    checks (``files`` or ``packages``), as for tox."""
    config = _pyproject()["tool"].get("mypy")
    if config is None:
        pytest.skip("no [tool.mypy] in pyproject.toml yet")
    assert config.get("files") or config.get("packages"), config
