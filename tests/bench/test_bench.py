"""The benchmark harness: one real ``--quick`` run (a server subprocess, real sockets),
checked for a complete, sane report; plus the helpers it computes its figures with.

The quick run is shared by the tests of this module (one run, ~20 s): each test checks one
property of its report, so a regression names what broke. It names the synthetic-engine
scenarios; the ``diffusers`` scenario (part of ``all`` where diffusers is installed) has a
quick run of its own below.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import run as bench

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "run.py"

SYNTHETIC_SCENARIOS = "resources,latency,concurrency,abort,encoder"
QUICK_FIGURES = (
    "calib.engine_first_chunk_ms",
    "calib.encode_first_chunk_ms",
    "latency.connect_ms",
    "latency.video_start_ms",
    "latency.ttfc_ms",
    "latency.interarrival_ms",
    "latency.rtf",
    "latency.transport_overhead_ms",
    "concurrency.n1.aggregate_fps",
    "concurrency.n8.aggregate_fps",
    "concurrency.n8.session_fps",
    "concurrency.n8.fairness",
    "concurrency.n8.ping_rtt_ms",
    "abort.idle.stop_done_ms",
    "abort.load.stop_done_ms",
    "abort.idle.disconnect_closed_ms",
    "abort.load.disconnect_closed_ms",
    "resources.rss_idle_connection_kib",
    "resources.rss_streaming_session_mib",
    "resources.threads_return_s",
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose but the process table.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``--quick`` run of every scenario: its JSON report and output."""
    output = tmp_path_factory.mktemp("bench") / "quick.json"
    done = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--quick",
            "--scenario",
            SYNTHETIC_SCENARIOS,
            "--output",
            str(output),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard, not a speed check
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(output.read_text())
    return {
        "report": report,
        "stdout": done.stdout,
        "stderr": done.stderr,
        "markdown": output.with_suffix(".md"),
    }


def _figure(quick: dict[str, Any], name: str) -> dict[str, Any]:
    figures = quick["report"]["results"]["A"]["figures"]
    assert name in figures, f"{name} missing; have {sorted(figures)}"
    return figures[name]


def test_report_describes_machine_settings_and_target(quick: dict[str, Any]) -> None:
    report = quick["report"]
    machine = report["machine"]
    for key in ("cpu_model", "cpu_count", "ram_gib", "os", "python", "kernel"):
        assert machine[key], key
    for package in ("trio", "trio-websocket", "av", "numpy", "torch"):
        assert package in machine["versions"]
    assert machine["versions"]["trio"] and machine["versions"]["av"]
    assert len(machine["git"].get("commit", "")) == 40
    settings = report["settings"]
    assert settings["quick"] is True and settings["width"] == 832 and settings["height"] == 480
    assert settings["chunk_frames"] == 16
    target = report["targets"]["A"]
    assert target["engine"] == "synthetic"
    assert target["engine_args"] == {"chunk_frames": "16", "steps": "4", "step_delay": "0.01"}
    assert "--port" in target["command"]


def test_every_figure_is_present_with_its_statistics(quick: dict[str, Any]) -> None:
    for name in QUICK_FIGURES:
        figure = _figure(quick, name)
        assert figure["n"] >= 1, name
        assert figure["min"] <= figure["median"] <= figure["p99"] <= figure["max"], name
        assert len(figure["runs"]) == 1 and figure["runs"][0]["values"], name
        assert figure["run_medians"] == [figure["runs"][0]["median"]]
    assert quick["report"]["results"]["A"]["unavailable"] == {}


def test_latencies_are_positive_and_in_order(quick: dict[str, Any]) -> None:
    for name in (
        "latency.connect_ms",
        "latency.video_start_ms",
        "latency.ttfc_ms",
        "latency.interarrival_ms",
        "concurrency.n8.ping_rtt_ms",
        "abort.idle.stop_done_ms",
        "abort.load.stop_done_ms",
        "abort.idle.disconnect_closed_ms",
        "abort.load.disconnect_closed_ms",
        "calib.engine_first_chunk_ms",
    ):
        figure = _figure(quick, name)
        assert figure["min"] > 0 and figure["max"] < 30_000, (name, figure)
    # The first chunk cannot come before video.start, nor before the engine made it.
    assert (
        _figure(quick, "latency.ttfc_ms")["min"] > _figure(quick, "latency.video_start_ms")["min"]
    )
    assert _figure(quick, "latency.ttfc_ms")["median"] > 4 * 10  # four 10 ms steps at least


def test_throughput_figures_are_sane(quick: dict[str, Any]) -> None:
    assert _figure(quick, "latency.rtf")["min"] > 0
    assert _figure(quick, "concurrency.n8.aggregate_fps")["min"] > 0
    fairness = _figure(quick, "concurrency.n8.fairness")
    assert 0 < fairness["min"] <= fairness["max"] <= 1
    assert _figure(quick, "concurrency.n8.pings_unanswered")["max"] == 0
    assert _figure(quick, "concurrency.n8.errors")["max"] == 0
    assert _figure(quick, "abort.idle.stop_not_done")["max"] == 0


def test_no_stream_session_or_worker_thread_left_after_any_scenario(quick: dict[str, Any]) -> None:
    result = quick["report"]["results"]["A"]
    checks = result["checks"]
    assert [c["scenario"] for c in checks] == ["resources", "latency", "concurrency", "abort"]
    for check in checks:
        assert check["ok"] is True, check
        assert check["sessions_active"] == check["streams_open"] == check["worker_threads"] == 0
    threads = result["runs"][0]["threads"]
    assert threads["returned_s"] is not None, threads
    assert threads["after"] <= threads["baseline"]


def test_resource_and_encoder_figures(quick: dict[str, Any]) -> None:
    rss = _figure(quick, "resources.rss_streaming_session_mib")
    assert 0 < rss["median"] < 1024
    local = quick["report"]["local"]["figures"]
    for size in ("256x256", "832x480"):
        per_frame = local[f"encoder.{size}.ms_per_frame"]
        share = local[f"encoder.{size}.chunk_period_share_pct"]
        assert 0 < per_frame["median"] < 1000
        assert 0 < share["median"] < 100
    assert (
        local["encoder.256x256.ms_per_frame"]["median"]
        < local["encoder.832x480.ms_per_frame"]["median"]
    )


def test_targets_are_judged_and_printed(quick: dict[str, Any]) -> None:
    verdicts = quick["report"]["results"]["A"]["targets"]
    assert len(verdicts) == 5
    assert all(v["status"] in ("PASS", "FAIL") for v in verdicts), verdicts
    stdout = quick["stdout"]
    assert "| metric | unit | median | p99 | run medians (min - max) | n |" in stdout
    assert stdout.count("- **PASS**") + stdout.count("- **FAIL**") == 5
    assert quick["markdown"].read_text().strip() == stdout.strip()


def test_the_started_server_is_gone(quick: dict[str, Any]) -> None:
    run = quick["report"]["results"]["A"]["runs"][0]
    assert run["server_exit"] == 0  # graceful shutdown on SIGTERM
    assert not _alive(run["server_pid"])


def test_ctrl_c_stops_the_server_too(tmp_path: Path) -> None:
    """Ctrl-C mid-run: the harness exits 130 and the server it started is gone, even
    started from a background shell, which leaves it SIGINT ignored (as CI may).

    The run cannot end before the signal: its one concurrency window lasts an hour
    (``--window 3600``), and the signal goes once the harness reports that the scenario
    has begun, with the server up. (A quick run with its usual window could finish
    before the signal arrived, and exit 0, on a busy machine.)
    """
    output = tmp_path / "x.json"
    harness = subprocess.Popen(
        [
            sys.executable,
            str(RUN),
            "--quick",
            "--scenario",
            "concurrency",
            "--levels",
            "1",
            "--window",
            "3600",
            "--output",
            str(output),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # only the harness gets the SIGINT, not the server
    )
    pid = None
    try:
        assert harness.stderr is not None
        for line in harness.stderr:
            if "server pid" in line:
                pid = int(line.split("server pid", 1)[1].split()[0])
            if "concurrency N=1" in line:  # the window has begun, or is about to
                break
        assert pid is not None and _alive(pid)
        harness.send_signal(signal.SIGINT)
        try:
            _, rest = harness.communicate(timeout=30)  # reading on: it reports as it stops
        except subprocess.TimeoutExpired:
            harness.kill()  # what it said on the way, for the failure
            _, rest = harness.communicate(timeout=10)
            pytest.fail(f"the harness went on 30 s after SIGINT:\n{rest[-3000:]}")
        assert harness.returncode == 130, rest
        assert "interrupted" in rest
        assert not _alive(pid)
        assert not output.exists()  # stopped mid-run, not at its end
    finally:
        if harness.poll() is None:
            harness.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------- pure helpers


def test_percentile_interpolates_like_numpy() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert bench.percentile(values, 50) == 3.0
    assert bench.percentile(values, 0) == 1.0 and bench.percentile(values, 100) == 5.0
    assert bench.percentile(values, 99) == pytest.approx(4.96)
    assert math.isnan(bench.percentile([], 50))
    assert bench.summarize([]) == {"n": 0, "min": None, "median": None, "p99": None, "max": None}


def test_target_specs() -> None:
    url = bench.make_target("A", "ws://10.0.0.2:9000/v1/realtime/video", max_sessions_needed=16)
    assert url.command is None and url.url and url.step_s is None and not url.calibratable
    flags = bench.make_target(
        "B",
        "--engine synthetic --engine-arg step_delay=0.02 --engine-arg=steps=3",
        max_sessions_needed=24,
    )
    assert flags.command is not None
    assert flags.command[:3] == (sys.executable, "-m", "trio_vstream")
    assert flags.command[-4:] == ("--port", "0", "--max-sessions", "24")
    assert dict(flags.engine_args) == {"step_delay": "0.02", "steps": "3"}
    assert flags.step_s == 0.02 and flags.calibratable
    command = bench.make_target("C", "/opt/py -m trio_vstream --port 7000", max_sessions_needed=8)
    assert command.command == ("/opt/py", "-m", "trio_vstream", "--port", "7000")
    assert command.engine is None and command.step_s is None
    declared = bench.make_target("D", "ws://h:1/x", max_sessions_needed=1, declared_step=0.5)
    assert declared.step_s == 0.5


def test_endpoint_parsing() -> None:
    endpoint = bench.Endpoint.parse("ws://127.0.0.1:8000/v1/realtime/video?x=1")
    assert (endpoint.host, endpoint.port, endpoint.resource) == (
        "127.0.0.1",
        8000,
        "/v1/realtime/video?x=1",
    )
    assert endpoint.host_header == "127.0.0.1:8000" and endpoint.is_local
    assert bench.Endpoint.parse("wss://example.org/v").port == 443
    with pytest.raises(ValueError, match="not a ws:// or wss:// URL"):
        bench.Endpoint.parse("http://example.org/")


def test_session_fps_uses_whole_chunks() -> None:
    client = bench.SessionClient(bench.Endpoint.parse("ws://127.0.0.1:1/"), None)
    # 16-frame chunks every 0.5 s: 32 fps, whatever the window's edges.
    client.arrivals = [(10.0 + 0.5 * i, 16, 100) for i in range(10)]
    assert bench.session_fps(client, 10.2, 12.4) == pytest.approx(32.0)
    client.arrivals = [(10.0, 16, 100)]
    assert bench.session_fps(client, 9.0, 11.0) == pytest.approx(8.0)


def test_compare_rows_give_b_over_a() -> None:
    a, b = bench.Figures(), bench.Figures()
    a.add(0, "latency.ttfc_ms", [10.0, 10.0])
    b.add(0, "latency.ttfc_ms", [15.0, 15.0])
    b.add(0, "latency.rtf", [1.0])
    rows = bench.compare_rows(a, b)
    assert [row[0] for row in rows] == ["latency.ttfc_ms"]
    assert rows[0][4] == "1.50"


# ------------------------------------------------------- a server without /metrics


async def _fake_session(request: Any) -> None:
    """The protocol and nothing else: what a reference server looks like to the harness
    (trio-websocket answers a plain GET /metrics with 400)."""
    import trio
    from trio_websocket import ConnectionClosed

    from trio_vstream import protocol

    ws = await request.accept()
    try:
        start = json.loads(await ws.get_message())
        request_id = "video_stream-fake"
        await ws.send_message(protocol.VideoStart(request_id, "m4s", {}).to_json())
        stopped = trio.Event()

        async def receive() -> None:
            while True:
                message = json.loads(await ws.get_message())
                if message["type"] == "session.ping":
                    await ws.send_message(protocol.Pong().to_json())
                elif message["type"] == "session.stop":
                    stopped.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            sent = 0
            while sent < start["num_frames"] and not stopped.is_set():
                await trio.sleep(0.01)
                metadata = protocol.ChunkMetadata(
                    request_id, "media", 16, 1000, sent // 16, (), (), (), sent // 16
                )
                await ws.send_message(metadata.to_json())
                await ws.send_message(b"\0" * 1000)
                sent += 16
            done = protocol.SessionDone(request_id, sent // 16, stopped.is_set())
            await ws.send_message(done.to_json())
            nursery.cancel_scope.cancel()
        await ws.aclose()
    except* ConnectionClosed:
        pass  # the harness cut the connection: that is one of its scenarios


async def test_a_server_without_metrics_gets_unavailable_figures(tmp_path: Path) -> None:
    import trio
    from trio_websocket import serve_websocket

    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve_websocket, _fake_session, "127.0.0.1", 0, None)
        url = f"ws://127.0.0.1:{server.port}/v1/realtime/video"
        output = tmp_path / "fake.json"
        flags = f"--quick --url {url} --scenario latency,abort,resources --output {output}"
        args = bench.build_parser().parse_args(flags.split())
        assert await bench.main_async(args) == 0
        nursery.cancel_scope.cancel()
    result = json.loads(output.read_text())["results"]["A"]
    figures, unavailable = result["figures"], result["unavailable"]
    assert figures["latency.ttfc_ms"]["min"] > 0
    assert figures["abort.idle.stop_done_ms"]["n"] == 2
    for name in (
        "calib.engine_first_chunk_ms",
        "abort.idle.disconnect_closed_ms",
        "resources.rss_streaming_session_mib",
        "resources.threads_return_s",
    ):
        assert name in unavailable and name not in figures
    verdicts = {v["target"].split(":")[0]: v["status"] for v in result["targets"]}
    assert verdicts["cleanup"] == "N/A" and verdicts["transport overhead"] == "N/A"
    assert verdicts["abort"] == "N/A"  # no engine step known for a URL


# ------------------------------------------------------------------ the diffusers scenario

DIFFUSERS_FIGURES = (
    "diffusers.inproc.first_segment_ms",
    "diffusers.inproc.segment_ms",
    "diffusers.inproc.fps",
    "diffusers.engine.first_segment_ms",
    "diffusers.engine.segment_ms",
    "diffusers.server.ttfc_ms",
    "diffusers.server.interarrival_ms",
    "diffusers.server.fps",
)


def test_diffusers_scenario_quick(tmp_path: Path) -> None:
    """A quick run of the diffusers scenario alone (the tests' tiny pipeline): its JSON has
    every figure, per side as many segments as asked, and a verdict that follows from them."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    output = tmp_path / "diffusers.json"
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--scenario", "diffusers", "--output", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["settings"]["scenarios"] == ["diffusers"]
    result = report["diffusers"]
    preset = result["preset"]
    assert preset["name"] == "tiny" and preset["device"] == "cpu"
    assert result["engine_args"]["threads"] == "1"
    assert result["engine_args"]["segment_frames"] == str(preset["segment_frames"])
    assert result["inproc_torch_threads"] == 1  # the direct side runs as the server does
    assert "--engine" in result["command"] and "diffusers" in result["command"]
    segments = result["segments"]
    assert segments == report["settings"]["diffusers_segments"] >= 2
    figures = result["figures"]
    for name in DIFFUSERS_FIGURES:
        figure = figures[name]
        assert 0 < figure["min"] <= figure["median"] <= figure["max"] < 30_000, name
        assert len(figure["runs"]) == 1, name
    # The first segment apart; every later one is a sample, on each side.
    for name in ("diffusers.inproc.segment_ms", "diffusers.engine.segment_ms"):
        assert figures[name]["n"] == segments - 1, name
    assert figures["diffusers.server.interarrival_ms"]["n"] == segments - 1
    assert figures["diffusers.server.errors"]["max"] == 0
    # Both sides make the same frames: their rates are of one order.
    ratio = figures["diffusers.server.fps"]["median"] / figures["diffusers.inproc.fps"]["median"]
    assert 0.1 < ratio < 10
    for side in ("inproc", "engine", "server"):
        assert figures[f"diffusers.{side}.faults_per_segment"]["min"] >= 0
        assert figures[f"diffusers.{side}.cpu_ms_per_segment"]["min"] > 0
    overhead, server, inproc = (
        figures["diffusers.overhead_pct"]["median"],
        figures["diffusers.server.interarrival_ms"]["median"],
        figures["diffusers.inproc.segment_ms"]["median"],
    )
    assert overhead == pytest.approx(100 * (server / inproc - 1))
    verdicts = {v["target"]: v for v in result["targets"]}
    assert len(verdicts) == 4
    verdict = verdicts["diffusers: server overhead per segment"]
    assert verdict["threshold"] == 5.0 and verdict["measured"] == pytest.approx(overhead)
    assert verdict["status"] == ("PASS" if overhead <= 5.0 else "FAIL")
    # Streamed chunk by chunk (Helios) and window by window (SkyReels DF): the first
    # chunk's share of the whole call, against 1.5 / k.
    for target, figure in (
        ("diffusers: chunked first chunk", "diffusers.chunked.first_chunk_fraction"),
        ("diffusers: diffusion-forcing first window", "diffusers.forcing.first_chunk_fraction"),
    ):
        streamed = verdicts[target]
        fraction = figures[figure]["median"]
        # Two wall-clock times: a loaded machine can put the first chunk past the whole
        # call (1.68 once), so only the sign is the code's; the verdict must follow.
        assert fraction > 0 and streamed["measured"] == pytest.approx(fraction), target
        assert streamed["threshold"] == pytest.approx(1.5 / segments), target
        assert streamed["status"] == ("PASS" if fraction <= 1.5 / segments else "FAIL"), target
    assert verdicts["diffusers: cleanup"]["status"] == "PASS", result["checks"]
    assert result["runs"][0]["server_exit"] == 0 and result["worker_exit"] == 0
    assert not _alive(result["runs"][0]["server_pid"])
    # Only the diffusers scenario ran: no table or verdicts for the synthetic target.
    assert report["results"]["A"]["figures"] == {}
    assert done.stdout.count("- **PASS**") + done.stdout.count("- **FAIL**") == 4
    assert "| diffusers.overhead_pct | % |" in done.stdout


def test_diffusers_presets_make_valid_requests() -> None:
    for name in bench.DIFFUSERS_PRESETS:
        preset = bench.DiffusersPreset.named(name)
        assert preset.width % 16 == 0 and preset.height % 16 == 0  # Wan's size multiple
        assert (preset.segment_frames - 1) % 4 == 0  # Wan's 4n+1 frames
        assert preset.engine_args(Path("/m"))["threads"] == "1"
        fields = preset.start_fields(3 * preset.segment_frames, seed=7)
        assert fields["size"] == f"{preset.width}x{preset.height}" and fields["seed"] == 7
    assert bench.DiffusersPreset.named("gpu").device == "cuda"
    assert bench.DiffusersPreset.default(quick=True).name == "tiny"
    with pytest.raises(ValueError, match="unknown diffusers preset 'huge'"):
        bench.DiffusersPreset.named("huge")


def test_all_includes_diffusers_only_where_it_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = bench.build_parser().parse_args
    monkeypatch.setattr(bench, "diffusers_available", lambda: True)
    assert bench.settings_from(parse([])).scenarios[-1] == "diffusers"
    assert "diffusers" not in bench.settings_from(parse(["--url", "ws://h:1/v"])).scenarios
    assert (
        "diffusers"
        not in bench.settings_from(parse(["--compare", "ws://a:1/v", "ws://b:1/v"])).scenarios
    )
    monkeypatch.setattr(bench, "diffusers_available", lambda: False)
    assert bench.settings_from(parse([])).scenarios == bench.ALL_SCENARIOS
    with pytest.raises(SystemExit):
        bench.settings_from(parse(["--scenario", "diffusers"]))
    assert bench.catalogue_key("diffusers.server.faults_per_segment") in bench.CATALOGUE
