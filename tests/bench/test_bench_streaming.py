"""The ``streaming`` benchmark scenario (issue 22): its figures computed from synthetic
arrivals (pure functions, tables of numbers), the paused-sessions rule, and one real
``--quick`` run (a shapes server the harness starts, real sockets) checked for a whole,
sane report rather than for speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import run as bench
from bench._client import SessionClient
from bench._server import Endpoint
from bench.scenarios.streaming import (
    CONFIGURATIONS,
    MIN_NOISE,
    MODES,
    chunks_since,
    paused_verdict,
    stream_figures,
)

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "run.py"

# ------------------------------------------------------------------- pure parts


def test_a_stream_faster_than_real_time() -> None:
    # session.start at 10.0; 8-frame chunks at 24 fps (1/3 s each) every 0.1 s from 10.5.
    arrivals = [(10.5 + 0.1 * i, 8, 1000) for i in range(6)]
    figures = stream_figures(arrivals, 10.0, 11.05, 24)
    assert figures is not None
    assert figures.ttfc_s == pytest.approx(0.5)
    assert figures.interarrival_s == pytest.approx((0.1,) * 5)
    assert figures.rtf == pytest.approx(2.0 / 1.0)  # 2 s of media by 11.0
    assert (figures.on_time_share, figures.continuous_play_ratio) == (1.0, 1.0)
    assert (figures.underruns, figures.stall_s) == (0, 0.0)


def test_a_stream_slower_than_real_time_stalls_at_every_chunk() -> None:
    # 1/3 s chunks every 0.5 s: every chunk after the first is 1/6 s late.
    arrivals = [(1.0 + 0.5 * i, 8, 1000) for i in range(4)]
    figures = stream_figures(arrivals, 0.0, None, 24)
    assert figures is not None
    assert figures.ttfc_s == 1.0
    assert figures.rtf == pytest.approx((4 / 3) / 2.5)
    assert figures.on_time_share == 0.25
    assert figures.underruns == 3
    assert figures.stall_s == pytest.approx(0.5)
    # Played 4/3 s, stalled 1/2 s.
    assert figures.continuous_play_ratio == pytest.approx((4 / 3) / (4 / 3 + 0.5))


def test_a_startup_threshold_delays_the_first_frame_and_absorbs_jitter() -> None:
    # Chunks at exactly real time (1/3 s apart), one of them 0.1 s late.
    arrivals = [(0.3, 8, 1), (0.633, 8, 1), (1.066, 8, 1), (1.3, 8, 1)]
    at_once = stream_figures(arrivals, 0.0, 1.3, 24)
    assert at_once is not None and at_once.ttff_s == at_once.ttfc_s == 0.3
    assert at_once.underruns == 1 and at_once.stall_s == pytest.approx(0.1, abs=1e-3)
    # Half a second buffered first: the first frame waits for the second chunk, and the
    # late chunk is still in time.
    buffered = stream_figures(arrivals, 0.0, 1.3, 24, startup_s=0.5)
    assert buffered is not None and buffered.ttfc_s == 0.3 and buffered.ttff_s == 0.633
    assert (buffered.underruns, buffered.stall_s, buffered.continuous_play_ratio) == (0, 0, 1)


def test_the_end_of_the_stream_is_not_a_stall() -> None:
    # The last chunk, then session.done: the viewer plays what it has, to the end.
    figures = stream_figures([(0.2, 24, 1), (0.4, 24, 1)], 0.0, 0.45, 24)
    assert figures is not None
    assert (figures.underruns, figures.stall_s, figures.continuous_play_ratio) == (0, 0, 1)
    assert stream_figures([], 0.0, 1.0, 24) is None


@pytest.mark.parametrize(
    ("alone", "paused", "status", "threshold"),
    [
        ([100.0, 102.0, 98.0], [99.0, 97.0, 101.0], "PASS", 1 - MIN_NOISE),
        ([100.0, 101.0, 99.0], [90.0, 91.0, 89.0], "FAIL", 1 - MIN_NOISE),
        # Noisy alone runs (20 % spread) allow as much.
        ([100.0, 120.0, 110.0], [92.0, 95.0, 90.0], "PASS", 1 - 20 / 110),
        # Paused sessions that were not paused: half the fps.
        ([100.0], [50.0], "FAIL", 1 - MIN_NOISE),
    ],
)
def test_paused_sessions_cost_no_more_than_noise(
    alone: list[float], paused: list[float], status: str, threshold: float
) -> None:
    verdict = paused_verdict(alone, paused)
    assert verdict["status"] == status
    assert verdict["threshold"] == pytest.approx(threshold)
    median = sorted(paused)[len(paused) // 2] / sorted(alone)[len(alone) // 2]
    assert verdict["measured"] == pytest.approx(median)


def test_chunks_since_counts_arrivals_from_a_time() -> None:
    client = SessionClient(Endpoint.parse("ws://127.0.0.1:1/"), None)
    client.arrivals = [(1.0, 8, 1), (2.0, 8, 1), (3.0, 8, 1)]
    assert [chunks_since(client, t) for t in (0.0, 2.0, 2.5, 4.0)] == [3, 2, 1, 0]


def test_paused_verdict_needs_both_measurements() -> None:
    assert paused_verdict([], [1.0])["status"] == "N/A"
    assert paused_verdict([1.0], [])["status"] == "N/A"


def test_catalogue_and_settings() -> None:
    for name in (
        "streaming.paced.n8.continuous_play_ratio",
        "streaming.unpaced.n1.interarrival_ms",
        "streaming.paused.alone.active_fps",
        "streaming.paused.paused.idle_fps",
        "streaming.paused.fps_ratio",
    ):
        assert bench.catalogue_key(name) in bench.CATALOGUE, name
    parse = bench.build_parser().parse_args
    assert "streaming" not in bench.settings_from(parse([])).scenarios
    assert bench.settings_from(parse(["--scenario", "streaming"])).streaming_levels == (1, 4, 8)
    with pytest.raises(SystemExit):
        bench.settings_from(parse(["--scenario", "streaming", "--url", "ws://h:1/v"]))
    startup = parse(["--scenario", "streaming", "--streaming-startup", "0.5"])
    assert bench.settings_from(startup).streaming_startup_s == 0.5
    for bad in ("1", "-1"):  # at the 1 s window, or below 0
        with pytest.raises(SystemExit, match="--streaming-startup"):
            bench.settings_from(parse(["--scenario", "streaming", "--streaming-startup", bad]))
    target = bench.StreamingScenario(bench.Settings(scenarios=("streaming",)), []).target
    assert target.engine == "shapes"


# ------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``--quick --scenario streaming`` run: its JSON report and stdout."""
    output = tmp_path_factory.mktemp("bench") / "streaming.json"
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--scenario", "streaming", "--output", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        "report": json.loads(output.read_text()),
        "stdout": done.stdout,
        "stderr": done.stderr,
    }


def _figure(quick: dict[str, Any], name: str) -> dict[str, Any]:
    figures = quick["report"]["streaming"]["figures"]
    assert name in figures, f"{name} missing; have {sorted(figures)}"
    return figures[name]


def test_every_mode_and_level_has_sane_figures(quick: dict[str, Any]) -> None:
    settings = quick["report"]["settings"]
    for mode in MODES:
        for level in settings["streaming_levels"]:
            prefix = f"streaming.{mode}.n{level}"
            assert _figure(quick, f"{prefix}.errors")["max"] == 0, quick["stderr"][-3000:]
            ttfc = _figure(quick, f"{prefix}.ttfc_ms")
            assert ttfc["n"] == level and 0 < ttfc["min"] <= ttfc["p99"] < 30_000, prefix
            # No startup threshold: the first frame shows as the first chunk arrives.
            assert _figure(quick, f"{prefix}.ttff_ms")["runs"] == ttfc["runs"], prefix
            assert _figure(quick, f"{prefix}.interarrival_ms")["min"] >= 0, prefix
            assert _figure(quick, f"{prefix}.rtf")["min"] > 0, prefix
            for ratio in ("on_time_share", "continuous_play_ratio"):
                figure = _figure(quick, f"{prefix}.{ratio}")
                assert figure["n"] == level and 0 < figure["min"] <= figure["max"] <= 1, prefix
            assert _figure(quick, f"{prefix}.underruns")["min"] >= 0, prefix
            assert _figure(quick, f"{prefix}.stall_ms")["min"] >= 0, prefix
    run = quick["report"]["streaming"]["runs"][0]
    reports = {(p["mode"], p["level"]): p["playback_reports"] for p in run["parts"]}
    # Paced sessions told the server where they were; unpaced ones sent nothing.
    assert all(count > 0 for count in reports[("paced", 1)])
    assert all(count == 0 for count in reports[("unpaced", 1)])


def test_paused_sessions_were_measured_and_waited(quick: dict[str, Any]) -> None:
    assert _figure(quick, "streaming.paused.errors")["max"] == 0, quick["stderr"][-3000:]
    for configuration in CONFIGURATIONS:
        assert _figure(quick, f"streaming.paused.{configuration}.active_fps")["min"] > 0
    # Paused sessions receive (about) nothing while the others stream; active ones do.
    paused = _figure(quick, "streaming.paused.paused.idle_fps")["max"]
    active = _figure(quick, "streaming.paused.active.idle_fps")["min"]
    assert paused < active / 4
    ratio = _figure(quick, "streaming.paused.fps_ratio")
    alone = _figure(quick, "streaming.paused.alone.active_fps")["median"]
    beside = _figure(quick, "streaming.paused.paused.active_fps")["median"]
    assert ratio["median"] == pytest.approx(beside / alone)


def test_targets_are_judged_and_printed(quick: dict[str, Any]) -> None:
    report = quick["report"]
    verdicts = report["streaming"]["targets"]
    assert len(verdicts) == 3
    assert all(v["status"] in ("PASS", "FAIL") for v in verdicts), verdicts
    cleanup = verdicts[2]
    assert cleanup["status"] == "PASS", report["streaming"]["checks"]
    stdout = quick["stdout"]
    assert "| streaming.paced.n1.continuous_play_ratio | ratio |" in stdout
    assert "| streaming.paused.fps_ratio | x |" in stdout
    assert stdout.count("- **PASS**") + stdout.count("- **FAIL**") == 3
