"""The ``fleet`` benchmark scenario: how it tells a session's and a viewer's fate and a
viewer's delay (pure functions on made-up results), the one-line nginx configuration of
one server alone, the skip without nginx, and one real ``--quick`` run (one server and
three behind real nginx) checked for a whole report whose targets are judged, not for
speed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import run as bench
from bench._nginx import NGINX, NGINX_CONF, nginx_command, render_nginx_conf
from bench.scenarios import fleet
from bench.scenarios.fleet import (
    SETUPS,
    FleetScenario,
    chunk_delays,
    exact_verdict,
    session_outcome,
    viewer_problem,
)
from trio_vstream import protocol
from trio_vstream.client import StreamOutcome, StreamResult
from trio_vstream.client._results import ReceivedChunk

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "run.py"

needs_nginx = pytest.mark.skipif(
    not NGINX.exists(),
    reason="no /usr/sbin/nginx: `apt-get install nginx` (Debian's package; .ci/run does it)",
)


# ------------------------------------------------------------------- made-up results


def _chunk(index: int, at: float, frames: int = 8) -> ReceivedChunk:
    metadata = protocol.ChunkMetadata(
        request_id="r",
        kind="media" if frames else "trailer",
        num_frames=frames,
        byte_length=10,
        generation_chunk_index=index,
        started_event_ids=(),
        active_event_ids=(),
        completed_event_ids=(),
        transport_chunk_index=index,
    )
    return ReceivedChunk(metadata=metadata, size=10, received_at=at)


def _result(
    chunks: list[tuple[int, float]],
    *,
    outcome: StreamOutcome = StreamOutcome.COMPLETED,
    stopped: bool = False,
    close: int = 1000,
    error: str | None = None,
    started: bool = True,
) -> StreamResult:
    """A session's (or a viewer's) result: media chunks (index, received at), then the
    trailer, ended as told."""
    result = StreamResult(url="ws://x/", request={}, started_at=0.0)
    result.chunks = [_chunk(index, at) for index, at in chunks]
    if chunks:
        result.chunks.append(_chunk(chunks[-1][0] + 1, chunks[-1][1], frames=0))
    result.outcome = outcome
    result.close_code = close
    if outcome in (StreamOutcome.COMPLETED, StreamOutcome.STOPPED):
        result.done = protocol.SessionDone(request_id="r", chunks=len(chunks), stopped=stopped)
    if error is not None:
        result.error = protocol.Error(protocol.ErrorCode(error), "no")
    if started:
        result.video_start = protocol.VideoStart(request_id="r", format="mp4", config={})
    return result


OWNER = [(n, 1.0 + n * 0.2) for n in range(6)]
"""The owner's six media chunks, 0.2 s apart."""


def test_a_session_completes_only_with_its_whole_video_and_a_normal_end() -> None:
    assert session_outcome(_result(OWNER), None, None, 48) == "completed"
    assert session_outcome(_result(OWNER), None, None, 56) == "failed"  # short
    stopped = _result(OWNER, outcome=StreamOutcome.STOPPED, stopped=True)
    assert session_outcome(stopped, None, None, 48) == "failed"
    assert session_outcome(_result(OWNER, close=1006), None, None, 48) == "failed"


@pytest.mark.parametrize(
    ("result", "failure", "status", "outcome"),
    [
        # Today's servers: accepted, then server_busy before video.start.
        (
            _result([], outcome=StreamOutcome.ERROR, error="server_busy", started=False),
            None,
            None,
            "refused",
        ),
        # A server that refuses the upgrade: nginx passes the last 503 on.
        (None, "cannot connect: the server refused the request: 503", 503, "refused"),
        # Any other error, or no connection at all, is a failure.
        (
            _result([], outcome=StreamOutcome.ERROR, error="engine_unavailable", started=False),
            None,
            None,
            "failed",
        ),
        (None, "cannot connect: HTTP 502", 502, "failed"),
        (None, "timed out", None, "failed"),
    ],
)
def test_refused_is_server_busy_either_way(
    result: StreamResult | None, failure: str | None, status: int | None, outcome: str
) -> None:
    assert session_outcome(result, failure, status, 48) == outcome


def test_a_viewer_needs_every_chunk_from_where_it_joined_and_the_end() -> None:
    owner = _result(OWNER)
    joined_late = _result([(n, at + 0.003) for n, at in OWNER[2:]])
    assert viewer_problem(joined_late, owner) is None
    missed = _result([(n, at) for n, at in OWNER[2:] if n != 4])
    assert "missing [4]" in (viewer_problem(missed, owner) or "")
    no_end = _result(OWNER[2:], outcome=StreamOutcome.DISCONNECTED, close=1006)
    assert "outcome disconnected" in (viewer_problem(no_end, owner) or "")
    assert viewer_problem(_result([]), owner) == "no chunk"


def test_delays_match_chunks_by_their_transport_index() -> None:
    owner = _result(OWNER)
    viewer = _result([(n, at + 0.001 * n) for n, at in OWNER[3:]])
    assert chunk_delays(viewer, owner) == pytest.approx([0.003, 0.004, 0.005])


def test_counts_must_be_exact() -> None:
    expected = {"completed": 6, "refused": 2, "failed": 0}
    assert exact_verdict("t", "r", [expected, expected], expected)["status"] == "PASS"
    more = {"completed": 7, "refused": 1, "failed": 0}
    assert exact_verdict("t", "r", [expected, more], expected)["status"] == "FAIL"
    assert exact_verdict("t", "r", [], expected)["status"] == "N/A"


def test_one_server_alone_is_one_server_line(tmp_path: Path) -> None:
    shipped = NGINX_CONF.read_text()
    one = render_nginx_conf(
        shipped,
        listen_port=8000,
        backend_ports=[9001],
        backend_hosts=["127.0.0.2"],
        prefix=tmp_path,
        fewer_backends=True,
    )
    # One line in each upstream block: the sessions' and the watch links'.
    listed = re.findall(r"^\s*server (\S+) max_fails", one, flags=re.MULTILINE)
    assert listed == ["127.0.0.2:9001"] * 2
    with pytest.raises(ValueError, match="asked for 1"):
        render_nginx_conf(shipped, listen_port=8000, backend_ports=[9001], prefix=tmp_path)
    if NGINX.exists():
        conf = tmp_path / "nginx.conf"
        conf.write_text(one)
        done = subprocess.run(
            nginx_command(conf, tmp_path, "-t"), capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr


def test_settings_catalogue_and_the_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = bench.build_parser().parse_args
    assert "fleet" not in bench.settings_from(parse([])).scenarios
    chosen = bench.settings_from(parse(["--scenario", "fleet"]))
    assert chosen.scenarios == ("fleet",)
    assert chosen.fleet_sessions > 3 * chosen.fleet_max_sessions > chosen.fleet_max_sessions
    with pytest.raises(SystemExit):
        bench.settings_from(parse(["--scenario", "fleet", "--url", "ws://h:1/v"]))
    for setup in SETUPS:
        for name in ("sessions_refused", "relayed_delay_p50_ms", "direct_delay_ms", "wave_s"):
            assert bench.catalogue_key(f"fleet.{setup}.{name}") in bench.CATALOGUE
    monkeypatch.setattr(fleet, "NGINX", Path("/nonexistent/nginx"))
    skipped = FleetScenario(chosen, [])
    assert skipped.skipped is not None and "apt-get install nginx" in skipped.skipped
    (verdict,) = skipped.evaluate()
    assert verdict["status"] == "N/A"
    assert any(line.startswith("Skipped: ") for line in skipped.markdown())


# ------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``--quick --scenario fleet`` run: its JSON report and stdout."""
    output = tmp_path_factory.mktemp("bench") / "fleet.json"
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--scenario", "fleet", "--output", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {"report": json.loads(output.read_text()), "stdout": done.stdout}


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(240)
def test_a_quick_run_reports_both_setups_and_judges_every_target(quick: dict[str, Any]) -> None:
    report = quick["report"]
    s = report["settings"]
    section = report["fleet"]
    figures = section["figures"]
    for setup in SETUPS:
        for name in ("completed", "refused", "failed"):
            assert figures[f"fleet.{setup}.sessions_{name}"]["n"] == 1, name
        total = sum(
            figures[f"fleet.{setup}.sessions_{k}"]["median"]
            for k in ("completed", "refused", "failed")
        )
        assert total == s["fleet_sessions"]
        assert f"fleet.{setup}.direct_delay_p50_ms" in figures
    # Alone, every viewer enters where its session runs.
    assert figures["fleet.one.viewers_relayed"]["max"] == 0
    assert "fleet.one.relayed_delay_ms" not in figures
    (run,) = section["runs"]
    assert sorted(run["order"]) == sorted(SETUPS)
    three = run["setups"]["three"]
    assert len(three["servers"]) == 3 and len(run["setups"]["one"]["servers"]) == 1
    assert three["relayed_by_the_servers"] == three["viewers_relayed"]
    verdicts = section["targets"]
    assert len(verdicts) == 6
    assert all(v["status"] in ("PASS", "FAIL") for v in verdicts), verdicts
    assert verdicts[-1]["status"] == "PASS", section["checks"]  # cleanup
    stdout = quick["stdout"]
    assert "| sessions completed / refused / failed |" in stdout
    assert stdout.count("- **PASS**") + stdout.count("- **FAIL**") == 6
