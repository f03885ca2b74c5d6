"""Idle connections must not hold the server (issue 20, item 6).

The attacks: WebSocket upgrades that never send ``session.start`` took every session
slot (``server_busy`` for everyone else, for as long as the start timeout, again and
again); idle TCP connections used up the descriptors until ``accept()`` failed with
EMFILE and ``/health`` went unanswered; a request head sent slowly held its connection
for the start timeout. Each test goes through a real server on loopback.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import trio
import trio.testing

from tests.conftest import Transcript, is_type, receive_into, receive_until
from trio_vstream.engines.synthetic import SyntheticSettings

START = {"type": "session.start", "prompt": "x", "size": "32x32", "num_frames": 4}


# ----------------------------------------------------------- session slots


async def test_idle_upgrades_do_not_keep_a_real_client_out(start_server: Any) -> None:
    """Twice as many upgrades as session slots, none sending session.start: they hold
    connections, not sessions, and a real client is served at once."""
    running = await start_server(max_sessions=2, start_timeout=60.0)
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(4):
            await stack.enter_async_context(running.connect())
        await trio.testing.wait_all_tasks_blocked()
        assert running.server.running_sessions == 0
        transcript = await running.run_session(START)
    assert transcript.types[0] == "video.start"
    assert transcript.terminal == [transcript.of_type("session.done")[0]]
    assert transcript.close_code == 1000


async def test_a_start_that_finds_every_session_slot_taken_gets_server_busy(
    start_server: Any,
) -> None:
    """The slot goes to the first session.start, not to the first upgrade: an earlier
    idle upgrade that starts later gets server_busy (the same error as today's upgrade
    refusal), and an upgrade while the slot is taken is still refused at once."""
    running = await start_server(
        SyntheticSettings(hang_at_chunk=0), max_sessions=1, start_timeout=60.0
    )
    async with running.connect() as early:
        await trio.testing.wait_all_tasks_blocked()
        async with running.connect() as first:
            await first.send_message(json.dumps(START))
            await receive_until(first, Transcript(), is_type("video.start"))
            late = Transcript()
            await early.send_message(json.dumps(START))
            await receive_into(early, late)
            assert late.json == [
                {
                    "type": "error",
                    "code": "server_busy",
                    "message": "Server busy: 1 sessions running; try again later",
                }
            ]
            assert late.close_code == 1000
            refused = Transcript()
            async with running.connect() as another:
                await receive_into(another, refused)
            assert [(m["type"], m["code"]) for m in refused.json] == [("error", "server_busy")]
            assert refused.close_code == 1000
            await first.send_message('{"type": "session.stop"}')
            done = Transcript()
            await receive_into(first, done)
    assert done.terminal[0]["type"] == "session.done"
    await running.wait_sessions_ended(2)
    busy = [s for s in running.summaries if s.error_code == "server_busy"]
    assert [(s.outcome.value, s.request_id) for s in busy] == [("rejected", None)]
