"""The protocol fuzz (``bench/fuzz.py``): its short form against a real server process.

The short form is what CI runs: 2,000 inputs, half ``session.start`` and half control
messages, with zero violations allowed. A fuzz whose oracle never fires proves nothing:
the modules' own tests (``test_fuzz_oracle.py``, ``test_fuzz_client.py``,
``test_fuzz_strategies.py``, ``test_fuzz_shrinker.py``, ``test_fuzz_serverlog.py``) feed
each part the failures it exists to catch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench._fuzz.settings import CONTROL_INPUT_FORMATS, server_command
from trio_vstream import protocol

REPO = Path(__file__).resolve().parents[2]
FUZZ = REPO / "bench" / "fuzz.py"


@pytest.mark.timeout(200)
def test_short_form_finds_no_violation(tmp_path: Path) -> None:
    output = tmp_path / "fuzz.json"
    done = subprocess.run(
        [
            sys.executable,
            str(FUZZ),
            "--inputs",
            "2000",
            "--seed",
            "1",
            "--json",
            str(output),
            "--time-limit",
            "170",
            "--shrink-time",
            "40",
            "--server-log",
            str(tmp_path / "server.log"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=190,
    )
    assert output.exists(), done.stderr[-3000:]
    report = json.loads(output.read_text())
    # The summary names each violation with its minimal input and the server's log.
    assert report["violations"] == [], done.stdout[-8000:]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["complete"] and report["inputs_run"] == 2000
    assert report["server"]["exit_status"] == 0
    # Both phases got past the first check: some inputs accepted, many refused.
    assert report["accepted"]["start"] > 50 and report["accepted"]["control"] > 50
    assert {"invalid_json", "invalid_message", "invalid_request", "message_too_large"} <= set(
        report["errors"]
    )
    # Video in: starts with an input video accepted, and a control session of each input
    # video (and one without) whose frames were taken, refused from their header, over the
    # byte cap, and refused by the decoder after their pong.
    assert report["input_video_starts"].get("accepted", 0) > 5
    assert report["control_sessions"] >= len(CONTROL_INPUT_FORMATS)
    frames = report["frames"]
    assert frames.get("taken", 0) > 20 and frames.get("error:invalid_input_frame", 0) > 50
    assert frames.get("error:message_too_large", 0) > 0 and frames.get("refused later", 0) > 0


def test_the_server_command_only_listens_on_loopback() -> None:
    limits = protocol.Limits(max_start_bytes=4096, max_control_bytes=1024)
    command = server_command(limits, ["--log-level", "DEBUG"])
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--max-start-bytes") + 1] == "4096"
    assert command[command.index("--max-control-bytes") + 1] == "1024"
    assert command[-2:] == ["--log-level", "DEBUG"]
