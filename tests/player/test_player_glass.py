"""The ``glass`` benchmark scenario, run short (``bench/run.py --quick --scenario glass``):
the player page in chromium with its defaults on the shapes engine, D and A pressed in
turn. Checked for behaviour, not speed (the 400 ms target lives in the bench): the page
produced its key-to-frame figure, frames were presented, every press's turn showed in
the presented pixels, and the play ratio and underruns were read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.player.test_player import CHROMIUM

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
    pytest.mark.slow,
    pytest.mark.timeout(240),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    output = tmp_path_factory.mktemp("glass") / "glass.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "run.py"),
            "--quick",
            "--scenario",
            "glass",
            "--output",
            str(output),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(output.read_text())
    report["stdout"] = done.stdout
    return report


def test_the_page_measures_key_to_frame_and_the_pixels_show_each_turn(
    report: dict[str, Any],
) -> None:
    glass = report["glass"]
    [run] = glass["runs"]
    assert run["page_errors"] == []
    # The page's defaults: Live on, a session that runs until stopped.
    assert run["defaults"]["live"] is True
    assert run["buffer_s"] is not None and run["buffer_s"] > 0
    assert run["reports"] > 0  # it reported its playhead
    settings = report["settings"]
    presses = round(settings["glass_seconds"] / settings["glass_press_every_s"])
    assert run["presses"] == presses
    # Frames presented all along: about fps a second, loosely.
    span = settings["glass_warmup_s"] + settings["glass_seconds"]
    assert run["presented"] >= 0.5 * 24 * span, run["presented"]
    # The page's figure for every press, and each turn seen in the pixels.
    assert len(run["page_ms"]) == presses
    assert all(ms > 0 for ms in run["page_ms"])
    assert run["missed"] == 0
    assert len(run["pixel_ms"]) == presses
    assert all(ms > 0 for ms in run["pixel_ms"])
    assert 0 < run["play_ratio"] <= 1
    assert run["underruns"] >= 0 and run["stall_ms"] >= 0


def test_the_targets_are_judged_and_printed(report: dict[str, Any]) -> None:
    verdicts = report["glass"]["targets"]
    assert len(verdicts) == 3
    assert all(v["status"] in ("PASS", "FAIL") for v in verdicts), verdicts
    assert "glass: key -> first presented frame" in report["stdout"]
    figures = report["glass"]["figures"]
    for name in ("glass.page_key_to_frame_ms", "glass.pixel_key_to_frame_ms", "glass.play_ratio"):
        assert figures[name]["n"] >= 1, name
