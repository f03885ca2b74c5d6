"""The ``camera_in`` benchmark scenario: how its parts are read (the server's histograms,
the page's windows, a chunk's lag), its settings, and one real ``--quick`` run (a shapes
server, chromium with a fake camera at 24 fps, the page with Camera in) checked for a
whole report whose figures are finite and whose target is judged, not for speed (the
500 ms target lives in the bench)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import run as bench
from bench.scenarios.camera_in import (
    chunk_lags_ms,
    histogram_totals,
    mean_ms_between,
    new_samples,
)
from tests.player.test_player import CHROMIUM

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "run.py"


def test_the_servers_histograms_give_means_over_the_measured_span() -> None:
    text = """# HELP trio_vstream_engine_chunk_seconds ...
trio_vstream_engine_chunk_seconds_bucket{le="0.1",model="shapes"} 3.0
trio_vstream_engine_chunk_seconds_count{model="shapes"} 4.0
trio_vstream_engine_chunk_seconds_sum{model="shapes"} 0.9
trio_vstream_encode_seconds_count{model="shapes"} 4.0
trio_vstream_encode_seconds_sum{model="shapes"} 0.1
"""
    before = histogram_totals(text)
    assert before == {"engine_chunk_ms": (0.9, 4.0), "encode_ms": (0.1, 4.0)}
    after = {"engine_chunk_ms": (1.5, 10.0), "encode_ms": (0.1, 4.0)}
    # 6 chunks in 0.6 s between the reads; no encode between them: no figure.
    assert mean_ms_between(before, after) == pytest.approx({"engine_chunk_ms": 100.0})
    assert histogram_totals("") == {}


def test_each_read_of_the_page_takes_what_it_measured_since_the_last() -> None:
    stats = {"measured": 7, "latencies": [1.0, 2.0, 3.0, 4.0], "parts": [[0, 1]] * 4}
    latencies, parts, total, lost = new_samples(stats, seen=5)
    assert (latencies, total, lost) == ([3.0, 4.0], 7, 0)
    assert len(parts) == 2
    # Read too seldom: the window let two new ones go, and says so.
    latencies, _, total, lost = new_samples(stats, seen=1)
    assert (latencies, total, lost) == ([1.0, 2.0, 3.0, 4.0], 7, 2)
    assert new_samples({}, seen=0) == ([], [], 0, 0)


def test_a_chunks_lag_runs_from_its_arrival_to_its_first_frame_presented() -> None:
    fps = 24.0
    frames = [[i / fps, 10_000.0 + 1000.0 * i / fps + 90.0] for i in range(24)]
    arrivals = [[0.0, 9_950.0], [8 / fps, 10_000.0 + 1000.0 * 8 / fps], [2.0, 12_000.0]]
    # The first arrived before the span; the third's frames were never presented.
    assert chunk_lags_ms(frames, arrivals, since_ms=10_000.0) == pytest.approx([90.0])
    assert chunk_lags_ms([], arrivals, since_ms=0.0) == []


def test_camera_in_is_asked_for_by_name_and_starts_its_own_server() -> None:
    parse = bench.build_parser().parse_args
    assert "camera_in" not in bench.settings_from(parse([])).scenarios
    assert bench.settings_from(parse(["--scenario", "camera_in"])).scenarios == ("camera_in",)
    with pytest.raises(SystemExit):
        bench.settings_from(parse(["--scenario", "camera_in", "--url", "ws://h:1/v"]))
    quick = bench.settings_from(parse(["--quick", "--scenario", "camera_in"]))
    assert quick.repeat == 1
    assert quick.camera_in_seconds < bench.Settings(scenarios=()).camera_in_seconds


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``--quick --scenario camera_in`` run: its JSON report and stdout."""
    output = tmp_path_factory.mktemp("bench") / "camera.json"
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--scenario", "camera_in", "--output", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {"report": json.loads(output.read_text()), "stdout": done.stdout}


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install chromium)")
@pytest.mark.timeout(150)
def test_a_quick_run_measures_camera_to_frame_and_its_parts(quick: dict[str, Any]) -> None:
    section = quick["report"]["camera_in"]
    assert section["skipped"] is None, section["skipped"]
    (run,) = section["runs"]
    assert run["page_errors"] == []
    assert run["defaults"]["live"] is True
    # The page sent its camera, and the server dropped none of it (paced to the chunks).
    assert run["inputs_sent"] > 0 and run["inputs_dropped"] == 0
    # Captures at the session's rate, on a clock that does not drift (setInterval's
    # whole milliseconds made 24.4 a second, and the server's input queue grew).
    assert run["capture_fps"] == pytest.approx(24.0, abs=0.5)
    # A figure for (nearly) every chunk of the span: none lost to the page's window, none
    # to a capture forgotten before its chunk's last frame was on screen.
    assert run["samples_lost"] == 0
    assert len(run["camera_to_frame_ms"]) >= run["chunks"] - 2 >= 4
    figures = section["figures"]
    for name in (
        "camera_to_frame_ms",
        "drawn_to_arrival_ms",
        "arrival_to_frame_ms",
        "buffer_ms",
        "player_lag_ms",
        "engine_chunk_ms",
        "encode_ms",
    ):
        figure = figures[f"camera_in.{name}"]
        assert figure["n"] >= 1, name
        assert math.isfinite(figure["median"]) and figure["median"] >= 0, (name, figure)
    # The parts add up: drawn -> arrived -> presented is the whole.
    whole = figures["camera_in.camera_to_frame_ms"]["median"]
    parts = (
        figures["camera_in.drawn_to_arrival_ms"]["median"]
        + figures["camera_in.arrival_to_frame_ms"]["median"]
    )
    assert parts == pytest.approx(whole, rel=0.15)
    assert all(value is not None and math.isfinite(value) for value in section["parts"].values())
    (verdict,) = section["targets"]
    assert verdict["status"] in ("PASS", "FAIL"), verdict
    assert "camera_in: input frame drawn" in quick["stdout"]
