"""Each subcommand of ``python -m trio_vstream`` loads its own modules, no others.

``client``, ``watch`` and ``replay`` need none of the server's modules, and none of the
libraries behind them (torch, prometheus_client, diffusers): the client starts quickly,
and runs where torch is missing or broken. tox's client environment installs the
package like every other, so nothing but this keeps the client light; the command line
(trio_vstream/cli/) imports each subcommand's modules only when it runs.

What the client commands may not load is the ``client`` contract of pyproject.toml
(what the client package may not import): one list for both. Each case runs the real
entry point (``python -m trio_vstream ...``, through runpy) in a fresh interpreter and
reads what it loaded; ``--help`` parses and prints everything a subcommand defines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs `python -m trio_vstream ARGS...` in this interpreter (the first argument is where
# to write what it loaded), and writes its exit status and sys.modules as JSON. Run with
# the repository as the working directory, so that `-c` imports its trio_vstream.
DRIVER = """\
import json, runpy, sys
out, sys.argv = sys.argv[1], ["trio_vstream", *sys.argv[2:]]
try:
    runpy.run_module("trio_vstream", run_name="__main__", alter_sys=True)
    status = None
except SystemExit as exc:
    status = exc.code
with open(out, "w") as file:
    json.dump({"status": status, "modules": sorted(sys.modules)}, file)
"""


def loaded_by(tmp_path: Path, *args: str) -> tuple[set[str], str]:
    """The modules ``python -m trio_vstream ARGS`` loaded, and what it printed."""
    out = tmp_path / "modules.json"
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    ran = json.loads(out.read_text())
    assert ran["status"] in (0, None), result.stderr
    return set(ran["modules"]), result.stdout


def client_may_not_load() -> list[str]:
    """The ``client`` import contract's forbidden modules (pyproject.toml)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = (c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "client")
    return list(contract["forbidden_modules"])


# The command line's parser builds every subcommand's flags, so each command loads the
# command line itself (trio_vstream.cli and its modules) and the server's plain option
# helpers (whose constants and checks the serve flags use); nothing else of the server.
PARSER_LOADS = frozenset(
    {
        "trio_vstream.cli",
        "trio_vstream.server",
        "trio_vstream.server.access",
        "trio_vstream.server.connections",
        "trio_vstream.server.memory",
        "trio_vstream.server.last_resort",
    }
)


def among(modules: set[str], names: list[str]) -> list[str]:
    """The modules that are one of ``names`` or inside one, less what the parser loads
    (`PARSER_LOADS`)."""
    return sorted(
        m
        for m in modules - PARSER_LOADS
        if not m.startswith("trio_vstream.cli.")
        and any(m == n or m.startswith(f"{n}.") for n in names)
    )


def test_the_contract_names_what_serving_loads() -> None:
    forbidden = client_may_not_load()
    for name in ("torch", "prometheus_client", "diffusers", "trio_vstream.server"):
        assert name in forbidden
    assert {"trio_vstream.session", "trio_vstream.engines"} <= set(forbidden)


@pytest.mark.parametrize("command", ["client", "watch", "replay"])
def test_a_client_command_loads_no_server_and_no_torch(tmp_path: Path, command: str) -> None:
    modules, printed = loaded_by(tmp_path, command, "--help")
    assert printed.startswith(f"usage: python -m trio_vstream {command} ")
    assert "trio_vstream.client" in modules
    assert among(modules, client_may_not_load()) == []


def test_serving_loads_the_server_and_no_client(tmp_path: Path) -> None:
    """The other way round, and the check above can see a module: ``serve`` loads the
    server, the session and the engines, and not the client."""
    modules, printed = loaded_by(tmp_path, "serve", "--help")
    assert "--max-sessions" in printed
    assert {
        "trio_vstream.server.app",
        "trio_vstream.session.session",
        "trio_vstream.engines",
    } <= modules
    assert "prometheus_client" in modules
    assert among(modules, ["trio_vstream.client"]) == []


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_the_top_level_flags_load_no_subcommand(tmp_path: Path, flag: str) -> None:
    modules, printed = loaded_by(tmp_path, flag)
    assert printed
    assert among(modules, ["trio_vstream.client", *client_may_not_load()]) == []
