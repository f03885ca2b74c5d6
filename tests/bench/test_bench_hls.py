"""The ``hls`` benchmark scenario and its viewers (`bench._hls`): how a viewer reads a
playlist and where it asks next, when it counts as complete, how nginx's log gives the
server's share (pure functions on made-up input), the settings and the skip, and one
real ``--quick`` run (a small crowd behind real nginx) checked for a whole report whose
targets are judged, not for speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import run as bench
from bench._hls import (
    HlsViewer,
    next_place,
    origin_requests,
    parse_listing,
    part_place,
    parts_origin_counts,
)
from bench._nginx import NGINX, LogEntry, read_requests
from bench.scenarios import hls
from bench.scenarios.hls import SETUPS, HlsScenario
from trio_vstream.outputs.hls import FIRST_MSN

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "run.py"

needs_nginx = pytest.mark.skipif(
    not NGINX.exists(),
    reason="no /usr/sbin/nginx: `apt-get install nginx` (Debian's package; .ci/run does it)",
)

LIVE = b"""#EXTM3U
#EXT-X-VERSION:6
#EXT-X-TARGETDURATION:1
#EXT-X-MEDIA-SEQUENCE:3
#EXT-X-SERVER-CONTROL:CAN-BLOCK-RELOAD=YES,PART-HOLD-BACK=1.5
#EXT-X-PART-INF:PART-TARGET=0.5
#EXT-X-MAP:URI="init.mp4"
#EXT-X-PART:DURATION=0.5,URI="part/3.0.m4s",INDEPENDENT=YES
#EXT-X-PART:DURATION=0.5,URI="part/3.1.m4s",INDEPENDENT=YES
#EXTINF:1.0,
seg/3.m4s
#EXT-X-PART:DURATION=0.5,URI="part/4.0.m4s",INDEPENDENT=YES
#EXT-X-PRELOAD-HINT:TYPE=PART,URI="part/4.1.m4s"
"""
"""Segment 3 complete (two parts), segment 4 open with one part so far."""


def test_a_viewer_reads_the_parts_and_asks_for_the_next_one() -> None:
    listing = parse_listing(LIVE)
    assert [place for place, _ in listing.parts] == [(3, 0), (3, 1), (4, 0)]
    assert listing.parts[-1][1] == "part/4.0.m4s"
    assert listing.complete == {3} and listing.map_uri == "init.mp4" and not listing.ended
    assert listing.first_msn == 3
    # After the last part of a complete segment: part 0 of the next; else the next index.
    assert next_place(listing, (3, 1)) == (4, 0)
    assert next_place(listing, (3, 0)) == (3, 1)
    assert next_place(listing, (4, 0)) == (4, 1)
    assert parse_listing(LIVE) is listing  # one parse for a crowd's identical answers
    ended = parse_listing(LIVE.replace(b"#EXT-X-PRELOAD-HINT", b"#EXT-X-ENDLIST\n#X"))
    assert ended.ended


def _viewer(places: list[tuple[int, int]], failure: str | None = None) -> HlsViewer:
    viewer = HlsViewer("v", "127.0.0.1", 1, "/w/t/hls/index.m3u8", 10)
    viewer.places, viewer.failure = places, failure
    viewer.final = parse_listing(LIVE.replace(b"#EXT-X-PRELOAD-HINT", b"#EXT-X-ENDLIST\n#X"))
    return viewer


def test_a_viewer_is_complete_from_the_first_part_to_the_last_listed() -> None:
    # From the stream's first part (FIRST_MSN's part 0) to the final listing's last.
    assert FIRST_MSN <= 3  # the final listing below begins at segment 3
    whole = [(msn, index) for msn in range(FIRST_MSN, 4) for index in range(2)] + [(4, 0)]
    assert _viewer(whole).complete
    assert not _viewer(whole[1:]).complete  # did not start at the first part
    assert not _viewer(whole[:-1]).complete  # missed the last
    assert not _viewer(whole, failure="GET ...: 503").complete
    assert not _viewer([]).complete
    assert _viewer(whole).base == "/w/t/hls"


def _entry(path: str, upstream: str, cache: str) -> LogEntry:
    return LogEntry(path, 200, (upstream,), ("200",) if upstream != "-" else ("-",), cache)


def test_the_servers_share_is_what_nginx_did_not_answer_itself() -> None:
    base = "/w/t/hls/"
    log = [
        _entry(f"{base}part/0.0.m4s", "127.0.0.1:9", "MISS"),
        *[_entry(f"{base}part/0.0.m4s", "-", "HIT") for _ in range(5)],
        _entry(f"{base}part/0.1.m4s", "127.0.0.1:9", "MISS"),
        _entry(f"{base}part/0.1.m4s", "127.0.0.1:9", "EXPIRED"),
        _entry(f"{base}index.m3u8?_HLS_msn=0&_HLS_part=1", "127.0.0.1:9", "MISS"),
        _entry("/w/other/hls/part/0.0.m4s", "127.0.0.1:9", "MISS"),
    ]
    assert part_place(f"{base}part/12.3.m4s?x=1") == (12, 3)
    assert part_place(f"{base}seg/1.m4s") is None
    counts = parts_origin_counts(log, base, [(0, 0), (0, 1), (0, 2)])
    assert counts == {(0, 0): 1, (0, 1): 2, (0, 2): 0}
    assert origin_requests(log, base)[f"{base}index.m3u8?_HLS_msn=0&_HLS_part=1"] == 1
    assert sum(origin_requests(log, base).values()) == 4


def test_the_log_format_reads_with_and_without_the_cache_status(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    log.write_text(
        '127.0.0.1 [t] "GET /w/t/hls/part/0.0.m4s HTTP/1.1" 200 9 rt=0.000 upstream=- '
        "ustatus=- urt=- cache=HIT\n"
        '127.0.0.1 [t] "GET /w/t/hls/index.m3u8?_HLS_msn=0&_HLS_part=0 HTTP/1.1" 200 9 '
        "rt=0.4 upstream=127.0.0.1:1, 127.0.0.1:2 ustatus=502, 200 urt=0.0, 0.4 cache=MISS\n"
        '127.0.0.1 [t] "GET /v1/realtime/video?session=a HTTP/1.1" 101 9 rt=2 '
        "upstream=127.0.0.1:1 ustatus=101 urt=2.0\n"
    )
    hit, miss, old = read_requests(log)
    assert (hit.cache, hit.reached_a_backend) == ("HIT", False)
    assert (miss.cache, miss.reached_a_backend, miss.served_by) == ("MISS", True, "127.0.0.1:2")
    assert miss.upstream_statuses == ("502", "200")
    assert (old.cache, old.status, old.reached_a_backend) == ("-", 101, True)


def test_settings_catalogue_and_the_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = bench.build_parser().parse_args
    assert "hls" not in bench.settings_from(parse([])).scenarios
    chosen = bench.settings_from(parse(["--scenario", "hls"]))
    assert chosen.scenarios == ("hls",) and chosen.hls_viewers == 500
    with pytest.raises(SystemExit):
        bench.settings_from(parse(["--scenario", "hls", "--url", "ws://h:1/v"]))
    for setup in SETUPS:
        assert bench.catalogue_key(f"hls.{setup}.cpu_ms_per_frame") in bench.CATALOGUE
    for name in ("cpu_ratio", "origin_per_part_max", "part_delay_p95_ms", "cache_hit_pct"):
        assert f"hls.{name}" in bench.CATALOGUE
    monkeypatch.setattr(hls, "NGINX", Path("/nonexistent/nginx"))
    skipped = HlsScenario(chosen, [])
    assert skipped.skipped is not None and "apt-get install nginx" in skipped.skipped
    (verdict,) = skipped.evaluate()
    assert verdict["status"] == "N/A"
    assert any(line.startswith("Skipped: ") for line in skipped.markdown())


# ------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``--quick --scenario hls`` run: its JSON report and stdout."""
    output = tmp_path_factory.mktemp("bench") / "hls.json"
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--scenario", "hls", "--output", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {"report": json.loads(output.read_text()), "stdout": done.stdout}


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(150)
def test_a_quick_run_reports_both_setups_and_judges_every_target(quick: dict[str, Any]) -> None:
    report = quick["report"]
    s = report["settings"]
    section = report["hls"]
    assert section["skipped"] is None
    figures = section["figures"]
    for setup in SETUPS:
        assert figures[f"hls.{setup}.cpu_ms_per_frame"]["n"] == 1, setup
    for name in ("cpu_ratio", "origin_per_part_max", "viewers_complete", "cache_hit_pct"):
        assert figures[f"hls.{name}"]["n"] == 1, name
    # Every part counted: as many as the session has, each reaching the server once or so.
    parts = s["hls_frames"] // s["hls_chunk_frames"]
    assert figures["hls.origin_per_part"]["n"] == parts
    assert figures["hls.viewer_requests"]["median"] > figures["hls.origin_requests"]["median"]
    (run,) = section["runs"]
    assert sorted(run["order"]) == sorted(SETUPS)
    crowd = run["setups"]["crowd"]
    assert crowd["session_completed"] and crowd["frames"] == s["hls_frames"]
    assert set(crowd["origin_per_part"]) == {f"{m}.{i}" for m, i in _places(parts)}
    verdicts = section["targets"]
    assert len(verdicts) == 4
    assert all(v["status"] in ("PASS", "FAIL") for v in verdicts), verdicts
    # Correctness, not speed: every viewer complete, nothing left on the server.
    assert verdicts[1]["status"] == "PASS", verdicts[1]
    assert verdicts[-1]["status"] == "PASS", section["checks"]
    stdout = quick["stdout"]
    assert "| viewers complete / failed |" in stdout
    assert stdout.count("- **PASS**") + stdout.count("- **FAIL**") == 4


def _places(parts: int) -> list[tuple[int, int]]:
    """Places of the quick run's parts: one segment (2 s), the first, holds them all."""
    return [(FIRST_MSN, index) for index in range(parts)]
