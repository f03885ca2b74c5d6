"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and can fail.

tox's test environment runs ``lint-imports`` beside ruff; these tests run it too, on the
tree as it is and on copies with one forbidden import added, so that a contract that
could never fail (a typo in a module name, a wildcard that matches nothing) shows up
here rather than in a review years later. The protocol's cycle that issue 21 removed
(``_errors`` importing ``_messages``) is one of the copies.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent

# Runs lint-imports in a fresh interpreter whose working directory is the tree to check:
# lint-imports puts that directory first on sys.path, so it analyses that tree's
# trio_vstream, not the one this process imported.
LINT_IMPORTS = "from importlinter.cli import lint_imports_command; lint_imports_command()"
# A contract's line in lint-imports' report: "<name> KEPT" or "<name> BROKEN", with a
# count of ignored imports after it when the contract has some.
VERDICT = re.compile(r"(?P<name>.+) (?P<verdict>KEPT|BROKEN)(?: \(.*\))?")


def _contract_names() -> dict[str, str]:
    """Each contract's name (what lint-imports prints) to its id in pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["name"]: c["id"] for c in config["tool"]["importlinter"]["contracts"]}


def _lint_imports(tree: Path) -> tuple[int, dict[str, str], str]:
    """Run lint-imports on ``tree``: its exit status, each contract's verdict by id
    (``KEPT`` or ``BROKEN``), and its output (for the assertion messages)."""
    # Wide and plain, so that no contract's name is wrapped across lines.
    env = {**os.environ, "COLUMNS": "300", "NO_COLOR": "1", "TERM": "dumb"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    names = _contract_names()
    verdicts = {
        names[match["name"]]: match["verdict"]
        for line in output.splitlines()
        if (match := VERDICT.fullmatch(line.strip())) and match["name"] in names
    }
    return result.returncode, verdicts, output


def test_contracts_hold_on_the_tree() -> None:
    status, verdicts, output = _lint_imports(ROOT)
    # Every contract was checked and kept (one with a bad option fails the run before
    # any verdict is printed).
    assert status == 0, output
    assert verdicts == dict.fromkeys(_contract_names().values(), "KEPT"), output


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the package and its contracts, to break on purpose."""
    shutil.copytree(
        ROOT / "trio_vstream",
        tmp_path / "trio_vstream",
        ignore=shutil.ignore_patterns("__pycache__", "*.safetensors", "static"),
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


# (module file, the line added to it, the contracts that must break). Each contract of
# pyproject.toml is broken by at least one of these.
FORBIDDEN_IMPORTS = {
    "the protocol's old cycle: errors import messages": (
        "protocol/_errors.py",
        "from trio_vstream.protocol._messages import Error",
        {"protocol-layers", "protocol-errors", "acyclic"},
    ),
    "limits import from the package": (
        "protocol/_limits.py",
        "from trio_vstream.values import Camera",
        {"protocol-errors"},
    ),
    "the protocol imports Trio": ("protocol/_wire.py", "import trio", {"protocol-pure"}),
    # Below the protocol in the layers, so only the allow-list of protocol-pure sees it.
    "the protocol imports a helper it has no use for": (
        "protocol/_start.py",
        "from trio_vstream import logsafe",
        {"protocol-pure"},
    ),
    "an engine imports the session": (
        "engines/synthetic.py",
        "import trio_vstream.session.session",
        {"layers", "engines", "acyclic"},
    ),
    "an engine imports Trio": ("engines/contract.py", "import trio", {"engines"}),
    "a model imports an engine": (
        "models/shapes/vocab.py",
        "import trio_vstream.engines.contract",
        {"layers", "models", "acyclic"},
    ),
    "the client imports torch": ("client/_results.py", "import torch", {"client"}),
    "a module of the server's reaches into the protocol's private modules": (
        "server/http.py",
        "from trio_vstream.protocol import _wire",
        {"private"},
    ),
    "a new module without a layer": ("newcomer.py", "import json", {"layers"}),
    "the client imports a recording's writer": (
        "client/_results.py",
        "import trio_vstream.outputs.recording",
        {"client"},
    ),
    # A floor reaching up: the session to the server's metrics, a watch link to the
    # server's HTTP (each was so before issue 31 gave them Protocols and a seam).
    "the session imports the server's metrics": (
        "session/resources.py",
        "import trio_vstream.server.metrics",
        {"layers", "acyclic"},
    ),
    "a watch link imports the server's HTTP": (
        "outputs/watch.py",
        "from trio_vstream.server import http",
        {"layers", "acyclic"},
    ),
    # Inside each floor, a module reaching up to one that builds on it.
    "serve's flag values import the serving process": (
        "cli/serve_config.py",
        "import trio_vstream.cli.serve",
        {"cli-layers", "acyclic"},
    ),
    "access imports the server's app": (
        "server/access.py",
        "import trio_vstream.server.app",
        {"server-layers", "acyclic"},
    ),
    "the ending rules import the session's preparation": (
        "session/endings.py",
        "import trio_vstream.session.prepare",
        {"session-layers", "acyclic"},
    ),
    "the taps import a watch link": (
        "outputs/taps.py",
        "import trio_vstream.outputs.watch",
        {"outputs-layers", "acyclic"},
    ),
    "the batcher imports the checkpoint": (
        "scheduling/batcher.py",
        "import trio_vstream.scheduling.checkpoint",
        {"scheduling-layers", "acyclic"},
    ),
    # (No cycle since the image decoder left the encoder: only the layers see this one.)
    "the image header imports the encoder": (
        "media/image_header.py",
        "import trio_vstream.media.encoding",
        {"media-layers"},
    ),
    "the image header imports its decoder": (
        "media/image_header.py",
        "import trio_vstream.media.image_decode",
        {"media-layers", "acyclic"},
    ),
    "the fMP4 box writer imports PyAV": ("media/fmp4.py", "import av", {"media-fmp4-pure"}),
    "the contract imports a helper built on it": (
        "engines/contract.py",
        "import trio_vstream.engines.frames",
        {"engines-layers", "acyclic"},
    ),
    "the shapes engine's steering rules import its streams": (
        "engines/shapes/steering.py",
        "import trio_vstream.engines.shapes.engine",
        {"engines-shapes-layers", "acyclic"},
    ),
}


@pytest.mark.parametrize(
    ("module", "line", "contracts"), FORBIDDEN_IMPORTS.values(), ids=FORBIDDEN_IMPORTS.keys()
)
def test_a_forbidden_import_breaks_its_contracts(
    tree: Path, module: str, line: str, contracts: set[str]
) -> None:
    path = tree / "trio_vstream" / module
    text = path.read_text() if path.exists() else ""
    path.write_text(f"{text}\n{line}\n")
    status, verdicts, output = _lint_imports(tree)
    assert status != 0, output
    assert len(verdicts) == len(_contract_names()), output
    assert {id for id, verdict in verdicts.items() if verdict == "BROKEN"} == contracts, output


def test_every_contract_is_broken_by_some_case() -> None:
    broken = set().union(*(contracts for _, _, contracts in FORBIDDEN_IMPORTS.values()))
    assert broken == set(_contract_names().values())


# What the protocol may import from outside the package: the standard library modules it
# uses (none of them does I/O), attrs and cattrs. A new one belongs here only if it does no
# I/O and needs no event loop: the protocol is sans-IO, shared by the server and clients.
PROTOCOL_MAY_IMPORT = frozenset(
    {
        "__future__",
        "base64",
        "binascii",
        "collections",
        "difflib",
        "enum",
        "ipaddress",
        "json",
        "math",
        "re",
        "typing",
        "urllib",
        "attrs",
        "cattrs",
    }
)


def test_the_protocol_imports_only_what_its_allow_list_names() -> None:
    graph = grimp.build_graph("trio_vstream", include_external_packages=True, cache_dir=None)
    protocol = {"trio_vstream.protocol", *graph.find_descendants("trio_vstream.protocol")}
    imported = {
        name.partition(".")[0]
        for module in protocol
        for name in graph.find_modules_directly_imported_by(module)
        if not name.startswith("trio_vstream.")
    }
    assert imported <= PROTOCOL_MAY_IMPORT, sorted(imported - PROTOCOL_MAY_IMPORT)


def test_the_cycles_left_out_are_type_hints_only() -> None:
    """Each import the acyclic contract ignores is made, and only under TYPE_CHECKING: at
    run time the package has no import cycle. (lint-imports ignores such an import made
    at run time too, as when the diffusers stream imported its families' registry for
    ``WorldLoop``, a circle through the families' protocol.)"""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (acyclic,) = (c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "acyclic")
    hinted = grimp.build_graph("trio_vstream", cache_dir=None)
    run = grimp.build_graph("trio_vstream", cache_dir=None, exclude_type_checking_imports=True)
    for ignored in acyclic["ignore_imports"]:
        importer, _, imported = (part.strip() for part in ignored.partition("->"))
        assert hinted.direct_import_exists(importer=importer, imported=imported), ignored
        assert not run.direct_import_exists(importer=importer, imported=imported), ignored
