"""The ``batching`` and ``effect`` benchmark scenarios: one real ``--quick`` run of both
(shapes servers the harness starts, real sockets; ~25 s), checked for sane figures and
for what the server says it did (``/stats``), not for speed; plus their pure parts.

The run is shared by the tests of this module, each checking one property of its report,
so that a regression names what broke.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import run as bench
from bench._client import SessionClient
from bench._report import make_verdict, median_and_range
from bench._server import Endpoint
from bench.scenarios._own_server import chunk_rate
from bench.scenarios.batching import MODES

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "run.py"
QUICK = bench.BatchingPreset.named("quick")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``--quick --scenario batching,effect`` run: its JSON report and stdout."""
    output = tmp_path_factory.mktemp("bench") / "batching.json"
    done = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--quick",
            "--scenario",
            "batching,effect",
            "--output",
            str(output),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        "report": json.loads(output.read_text()),
        "stdout": done.stdout,
        "stderr": done.stderr,
    }


def _figures(quick: dict[str, Any], scenario: str) -> dict[str, Any]:
    return quick["report"][scenario]["figures"]


def _figure(quick: dict[str, Any], scenario: str, name: str) -> dict[str, Any]:
    figures = _figures(quick, scenario)
    assert name in figures, f"{name} missing; have {sorted(figures)}"
    return figures[name]


def test_quick_run_runs_the_quick_preset(quick: dict[str, Any]) -> None:
    # Not how long it took: a wall-clock bound fails on a loaded machine (it did, under
    # three other test runs) and says nothing about behaviour.
    assert quick["report"]["settings"]["scenarios"] == ["batching", "effect"]
    assert quick["report"]["batching"]["preset"]["name"] == "quick"


def test_batching_figures_are_sane_for_every_mode_and_level(quick: dict[str, Any]) -> None:
    for mode in MODES:
        for level in QUICK.levels:
            prefix = f"batching.{mode}.n{level}"
            aggregate = _figure(quick, "batching", f"{prefix}.aggregate_fps")
            assert aggregate["n"] == 1 and aggregate["min"] > 0, prefix
            per_session = _figure(quick, "batching", f"{prefix}.session_fps")
            assert per_session["n"] == level and per_session["min"] > 0, prefix
            # The sessions' rates add up to the aggregate.
            assert per_session["median"] <= aggregate["median"] * 1.0001, prefix
            ttfc = _figure(quick, "batching", f"{prefix}.ttfc_ms")
            expected = level + (QUICK.ttfc_sessions - 1 if level == 1 else 0)
            assert ttfc["n"] == expected, prefix
            assert 0 < ttfc["min"] <= ttfc["median"] <= ttfc["p99"] < 30_000, prefix
            stop = _figure(quick, "batching", f"{prefix}.stop_done_ms")
            assert stop["n"] == expected and 0 < stop["min"] <= stop["p99"] < 30_000, prefix
            for count in ("errors", "ended_early"):
                assert _figure(quick, "batching", f"{prefix}.{count}")["max"] == 0, prefix


def test_the_server_batches_rows_only_when_batching_is_on(quick: dict[str, Any]) -> None:
    for level in QUICK.levels:
        assert _figure(quick, "batching", f"batching.on.n{level}.batch_rows")["min"] > 0
        assert _figure(quick, "batching", f"batching.off.n{level}.batch_rows")["max"] == 0
        assert f"batching.off.n{level}.mean_batch" not in _figures(quick, "batching")
    # Alone, a session's rows run one at a time; 8 sessions share their batches.
    assert _figure(quick, "batching", "batching.on.n1.mean_batch")["median"] == 1
    assert _figure(quick, "batching", "batching.on.n8.mean_batch")["median"] > 1


def test_ratios_are_taken_within_the_run(quick: dict[str, Any]) -> None:
    figures = _figures(quick, "batching")
    for level in QUICK.levels:
        on = figures[f"batching.on.n{level}.aggregate_fps"]["median"]
        off = figures[f"batching.off.n{level}.aggregate_fps"]["median"]
        assert figures[f"batching.n{level}.fps_ratio"]["median"] == pytest.approx(on / off)
        on = figures[f"batching.on.n{level}.ttfc_ms"]["median"]
        off = figures[f"batching.off.n{level}.ttfc_ms"]["median"]
        assert figures[f"batching.n{level}.ttfc_ratio"]["median"] == pytest.approx(on / off)


def test_batching_servers_and_their_order(quick: dict[str, Any]) -> None:
    result = quick["report"]["batching"]
    run = result["runs"][0]
    assert run["order"] == ["on", "off"]  # and off, on in the next run
    for mode in MODES:
        assert [lv["level"] for lv in run["modes"][mode]["levels"]] == list(QUICK.levels)
        assert run["modes"][mode]["server_exit"] == 0
        assert not _alive(run["modes"][mode]["server_pid"])
    servers = result["servers"]
    assert servers["on"]["engine"] == servers["off"]["engine"] == "shapes"
    assert servers["on"]["engine_args"] == {"max_batch": "8"}
    assert servers["off"]["engine_args"] == {"max_batch": "1"}
    assert all(check["ok"] is True for check in result["checks"]), result["checks"]


def test_effect_latencies_are_positive_and_ordered(quick: dict[str, Any]) -> None:
    settings = quick["report"]["settings"]
    interactions = settings["effect_interactions"]
    for chunk_frames in settings["effect_chunk_frames"]:
        for level in settings["effect_levels"]:
            prefix = f"effect.c{chunk_frames}.n{level}"
            latency = _figure(quick, "effect", f"{prefix}.latency_ms")
            assert latency["n"] == level * interactions, prefix
            assert 0 < latency["min"] <= latency["median"] <= latency["p99"] < 30_000, prefix
            queued = _figure(quick, "effect", f"{prefix}.queued_ms")
            assert 0 < queued["median"] <= queued["p99"], prefix
            # The acknowledgement comes before the frames that show the change.
            assert queued["median"] < latency["median"], prefix
            assert _figure(quick, "effect", f"{prefix}.aggregate_fps")["min"] > 0, prefix
            assert _figure(quick, "effect", f"{prefix}.unresolved")["max"] == 0, prefix
            assert _figure(quick, "effect", f"{prefix}.errors")["max"] == 0, prefix
    result = quick["report"]["effect"]
    assert result["server"]["engine"] == "shapes"
    assert result["runs"][0]["server_exit"] == 0
    assert all(check["ok"] is True for check in result["checks"]), result["checks"]


def test_shorter_chunks_deliver_fewer_frames(quick: dict[str, Any]) -> None:
    # The model makes its full chunk whatever the size kept: 2-frame chunks are a
    # fraction of the frames per second of 8-frame ones.
    fps = {c: _figure(quick, "effect", f"effect.c{c}.n1.aggregate_fps")["median"] for c in (8, 2)}
    assert fps[2] < fps[8]


def test_targets_are_judged_and_printed(quick: dict[str, Any]) -> None:
    report = quick["report"]
    names = [v["target"] for v in report["batching"]["targets"] + report["effect"]["targets"]]
    assert len(names) == 5
    assert "batching: aggregate fps at 8 sessions, batched / unbatched" in names
    for verdict in report["batching"]["targets"] + report["effect"]["targets"]:
        assert verdict["status"] in ("PASS", "FAIL"), verdict
    ratio = report["batching"]["targets"][0]
    assert ratio["threshold"] == 1.3
    assert ratio["status"] == ("PASS" if ratio["measured"] >= 1.3 else "FAIL")
    effect = report["effect"]["targets"][0]
    assert effect["threshold"] == pytest.approx(8 / 24 * 1000 + 100)
    assert effect["measured"] == report["effect"]["figures"]["effect.c8.n1.latency_ms"]["median"]
    stdout = quick["stdout"]
    assert stdout.count("- **PASS**") + stdout.count("- **FAIL**") == 5
    assert "| batching.on.n8.aggregate_fps | fps |" in stdout
    assert "| effect.c8.n1.latency_ms | ms |" in stdout
    # Only scenarios with servers of their own ran: no table for the main target.
    assert report["results"]["A"]["figures"] == {}
    assert "Target A:" not in stdout


# ------------------------------------------------------------------- pure parts


def test_all_leaves_them_out_and_a_url_is_refused() -> None:
    parse = bench.build_parser().parse_args
    chosen = bench.settings_from(parse([])).scenarios
    assert "batching" not in chosen and "effect" not in chosen
    both = bench.settings_from(parse(["--scenario", "effect,batching"])).scenarios
    assert both == ("batching", "effect")
    for name in ("batching", "effect"):
        with pytest.raises(SystemExit):
            bench.settings_from(parse(["--scenario", name, "--url", "ws://h:1/v"]))
    quick = bench.settings_from(
        parse(["--quick", "--scenario", "batching", "--batching-preset", "cpu"])
    )
    assert quick.batching_preset == "cpu" and quick.quick


def test_presets() -> None:
    for name in bench.BATCHING_PRESETS:
        preset = bench.BatchingPreset.named(name)
        assert 8 in preset.levels and 1 in preset.levels  # the targets' levels
        assert preset.max_batch > 1 and preset.width % 16 == 0
        assert preset.engine_args("off") == (("max_batch", "1"),)
    gpu = bench.BatchingPreset.named("gpu")
    assert gpu.device == "cuda" and gpu.max_batch == 32 and max(gpu.levels) > 32
    assert bench.BatchingPreset.default(quick=True).name == "quick"
    with pytest.raises(ValueError, match="unknown batching preset 'huge'"):
        bench.BatchingPreset.named("huge")
    settings = bench.Settings(scenarios=("batching",))
    scenario = bench.BatchingScenario(settings, gpu, ["--server-arg-x"])
    command = scenario.targets["on"].command
    assert command is not None
    # More sessions than the server's default 16, longer videos than its default 2400.
    assert "--max-sessions" in command and command[command.index("--max-sessions") + 1] == "64"
    assert command[command.index("--max-num-frames") + 1] == str(gpu.num_frames)
    assert command.index("--device=cuda") < command.index("--server-arg-x")


def test_catalogue_knows_every_name() -> None:
    for name in (
        "batching.on.n16.aggregate_fps",
        "batching.off.n1.batch_rows",
        "batching.n8.fps_ratio",
        "effect.c2.n8.latency_ms",
    ):
        assert bench.catalogue_key(name) in bench.CATALOGUE, name


def test_chunk_rate_counts_between_arrivals() -> None:
    client = SessionClient(Endpoint.parse("ws://127.0.0.1:1/"), None)
    # 8-frame chunks in bursts every 0.4 s: 20 fps, whatever the window's edges.
    client.arrivals = [(10.0 + 0.4 * i, 8, 100) for i in range(10)]
    assert chunk_rate(client, 10.1, 11.5) == pytest.approx(20.0)
    assert chunk_rate(client, 10.1, 10.5) is None  # one chunk: no rate


def test_a_verdict_can_require_at_least() -> None:
    assert make_verdict("x", 1.4, 1.3, "", at_least=True)["status"] == "PASS"
    assert make_verdict("x", 1.2, 1.3, "", at_least=True)["status"] == "FAIL"
    assert make_verdict("x", 1.2, 1.3, "")["status"] == "PASS"
    assert make_verdict("x", None, 1.3, "")["status"] == "N/A"


def test_a_report_cell_is_the_median_and_the_range_where_runs_differ() -> None:
    assert median_and_range([]) == "n/a"
    assert median_and_range([6.0, 6.0, 6.0]) == "6"  # counts stay counts
    assert median_and_range([12.0, 11.0, 12.0]) == "12 (11 - 12)"
    assert median_and_range([1.234, 0.5, 2.0]) == "1.23 (0.500 - 2)"  # 3 figures or so
