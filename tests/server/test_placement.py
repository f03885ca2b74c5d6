"""Placement respects capacity, through a real server on loopback: a server with no
session slot free refuses a new session's upgrade with HTTP 503 (so that a balancer
tries another server), upgrades just accepted claim their slots for a short window,
and viewers of watch links neither count as sessions nor are refused for them.

The balancer's side, real nginx in front of three servers, is
``tests/server/test_deploy_placement.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.conftest import CLIENT_MAX_MESSAGE, Transcript, is_type, receive_into, receive_until
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.server.app import VideoServer

START = {"type": "session.start", "prompt": "a red circle", "size": "32x32", "num_frames": 16}
LONG = {**START, "num_frames": 1200}
"""A session that holds its slot until it is stopped (minutes of 0.1 s steps)."""
SLOW = SyntheticSettings(step_delay=0.1)


def refusal_of(rejected: ConnectionRejected) -> dict[str, Any]:
    """A refused upgrade's JSON body, once its status and headers say what it is."""
    headers = {name.decode().lower(): value.decode() for name, value in rejected.headers}
    assert rejected.status_code == 503, rejected
    assert headers["retry-after"] == "1"
    assert headers["content-type"] == "application/json"
    body: dict[str, Any] = json.loads(rejected.body or b"")
    return body


def refused_busy(server: VideoServer) -> float:
    """The server's count of upgrades refused for want of a slot, from /metrics."""
    line = next(
        line
        for line in server.metrics.exposition().decode().splitlines()
        if line.startswith("trio_vstream_sessions_refused_total{")
        and 'reason="server_busy"' in line
    )
    return float(line.rsplit(" ", 1)[1])


async def until(done: Any) -> None:
    """Until ``done()``: each round lets every task run until all wait (the caller's
    clock or pytest's timeout bounds it)."""
    while not done():
        await trio.testing.wait_all_tasks_blocked()


async def test_two_upgrades_racing_for_the_last_slot_get_one_session_and_one_503(
    start_server: Any,
) -> None:
    """Both upgrades arrive before either sends session.start. Without claims both would
    be accepted and the second start refused after its acceptance, too late for a
    balancer to place it elsewhere: here it is refused before, with server_busy."""
    running = await start_server(max_sessions=1)
    rejections: list[ConnectionRejected] = []
    transcripts: list[Transcript] = []
    both_answered = trio.Event()

    async def upgrade() -> None:
        try:
            async with running.connect() as ws:
                await both_answered.wait()  # no session.start before both are decided
                transcript = Transcript()
                await ws.send_message(json.dumps(START))
                await receive_into(ws, transcript)
                transcripts.append(transcript)
        except ConnectionRejected as exc:
            rejections.append(exc)

    async def answered() -> None:
        await until(lambda: len(rejections) + running.server.claimed_sessions == 2)
        both_answered.set()

    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(upgrade)
            nursery.start_soon(upgrade)
            nursery.start_soon(answered)
    [rejected] = rejections
    assert refusal_of(rejected) == {
        "type": "error",
        "code": "server_busy",
        "message": "Server busy: 1 sessions running; try again later",
    }
    [transcript] = transcripts
    assert transcript.types[0] == "video.start"
    assert transcript.terminal[0]["type"] == "session.done"
    await running.wait_sessions_ended(1)
    assert [s.outcome.value for s in running.summaries] == ["completed"]
    assert refused_busy(running.server) == 1


async def test_a_viewer_gets_in_while_sessions_take_every_slot(start_server: Any) -> None:
    """Watch links are never refused for want of a session slot, and a viewer takes
    none: the server is full for sessions before and after the viewer joins."""
    running = await start_server(SLOW, max_sessions=1)
    async with running.connect() as owner:
        await owner.send_message(json.dumps(LONG))
        video_start = await receive_until(owner, Transcript(), is_type("video.start"))
        with pytest.raises(ConnectionRejected) as before:
            async with running.connect():
                pass
        assert refusal_of(before.value)["code"] == "server_busy"
        url = running.url.replace("/v1/realtime/video", video_start["watch_path"])
        async with open_websocket_url(url, max_message_size=CLIENT_MAX_MESSAGE) as viewer:
            watched = await receive_until(viewer, Transcript(), is_type("watch.start"))
            assert watched["request_id"] == video_start["request_id"]
            with pytest.raises(ConnectionRejected) as during:
                async with running.connect():
                    pass
            assert refusal_of(during.value)["code"] == "server_busy"
            assert running.server.running_sessions == 1
        await owner.send_message('{"type": "session.stop"}')
        done = Transcript()
        await receive_into(owner, done)
    assert done.terminal[0]["type"] == "session.done"
    assert refused_busy(running.server) == 2


async def test_an_upgrade_that_leaves_before_its_start_gives_its_claim_back(
    mock_clock: trio.testing.MockClock, start_server: Any
) -> None:
    """Its claim ends with its connection, not with its window: on a clock that does not
    move, the next upgrade is accepted as soon as the server has seen the close."""
    running = await start_server(max_sessions=1, start_timeout=60.0)
    async with running.connect() as leaving:
        assert running.server.claimed_sessions == 1
        stats = running.server.stats_snapshot()
        assert (stats["sessions_claimed"], stats["sessions_running"]) == (1, 0)
        await leaving.aclose()
    await until(lambda: running.server.claimed_sessions == 0)
    transcript = await running.run_session(START)
    assert transcript.types[0] == "video.start"
    assert transcript.terminal[0]["type"] == "session.done"
    assert refused_busy(running.server) == 0
