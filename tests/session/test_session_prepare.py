"""`session_prepare` without a session: the first message and its outcomes, the order of
the checks before ``video.start``, and what an engine too slow to open its stream leaves.

The socket is a stand-in with only ``get_message``; the clock is virtual (autojump), so
a start timeout or a stall timeout costs no wall time.
"""

from __future__ import annotations

import json
import threading
from typing import Any, cast

import pytest
import trio
import trio.testing
from trio_websocket import CloseReason, ConnectionClosed, WebSocketConnection

from trio_vstream import protocol
from trio_vstream.engines.contract import GenerationRequest
from trio_vstream.engines.synthetic import SyntheticEngine
from trio_vstream.media.encoding import FragmentedMP4Encoder
from trio_vstream.protocol import ErrorCode
from trio_vstream.session.calls import SessionCalls
from trio_vstream.session.endings import Ending, Outcome
from trio_vstream.session.prepare import (
    STALLED_OPENING,
    StartFailure,
    first_failure,
    prepare,
    receive_start,
)
from trio_vstream.session.resources import ServerCounters, ServerResources, SessionConfig

START = {"type": "session.start", "prompt": "a lighthouse", "width": 64, "height": 64}


class Socket:
    """``get_message`` gives each of ``messages`` in turn (an exception is raised), then
    waits for good."""

    def __init__(self, *messages: str | BaseException) -> None:
        self.messages = list(messages)

    async def get_message(self) -> str:
        if not self.messages:
            await trio.sleep_forever()
        message = self.messages.pop(0)
        if isinstance(message, BaseException):
            raise message
        return message


class SlowEngine(SyntheticEngine):
    """Opens its stream only once the test lets it (in its thread, outside a checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def open_stream(self, request: GenerationRequest) -> Any:
        assert self.go.wait(10)
        return super().open_stream(request)


def resources(engine: SyntheticEngine | None = None) -> ServerResources:
    return ServerResources(
        engine=engine or SyntheticEngine(),
        config=SessionConfig(start_timeout=5.0, stall_timeout=7.0),
        stats=ServerCounters(),
        step_limiter=None,
        thread_limiter=trio.CapacityLimiter(4),
        encode_limiter=trio.CapacityLimiter(1),
    )


async def receive(*messages: str | BaseException) -> tuple[Any, Ending]:
    ending = Ending()
    ws = cast(WebSocketConnection, Socket(*messages))
    return await receive_start(ws, resources(), ending), ending


async def test_a_start_is_parsed_and_its_time_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    received, ending = await receive(json.dumps(START))
    start, received_at = received
    assert (start.video.width, start.video.height, received_at) == (64, 64, 0.0)
    assert ending.outcome is None


async def test_a_client_gone_or_a_bad_start_ends_the_session_without_a_failure() -> None:
    received, ending = await receive(ConnectionClosed(CloseReason(1000, None)))
    assert received is None and ending.outcome is Outcome.DISCONNECTED
    received, ending = await receive("{not json")
    assert received is None and ending.outcome is Outcome.REJECTED
    assert ending.error is not None and ending.error[0] is ErrorCode.INVALID_JSON


async def test_no_start_within_the_start_timeout_is_a_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.raises(StartFailure) as failed:
        await receive()
    assert (failed.value.code, failed.value.message) == (
        ErrorCode.START_TIMEOUT,
        "Timeout waiting for session.start",
    )
    assert trio.current_time() == 5.0


async def test_a_refused_script_fails_before_the_encoder_or_the_engine_is_asked() -> None:
    start = protocol.parse_start(
        json.dumps({**START, "extra_params": {"camera_action_script": [[["w"], [], []]]}})
    )
    res = resources()
    calls = SessionCalls(res)
    kept: list[FragmentedMP4Encoder] = []
    with pytest.raises(StartFailure) as failed:
        await prepare(start, "r1", res, calls, Ending(), kept.append)
    assert failed.value.code is ErrorCode.INVALID_REQUEST
    assert failed.value.message.startswith(
        "Invalid session.start: extra_params.camera_action_script: "
    )
    assert (kept, calls.stream, res.stats.streams_open) == ([], None, 0)


async def test_an_engine_too_slow_to_open_stalls_the_session_and_leaves_it_its_encoder(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SlowEngine()
    res = resources(engine)
    calls = SessionCalls(res)
    ending = Ending()
    kept: list[FragmentedMP4Encoder] = []
    start = protocol.parse_start(json.dumps(START))
    with pytest.raises(StartFailure) as failed:
        await prepare(start, "r1", res, calls, ending, kept.append)
    try:
        assert (failed.value.code, failed.value.message) == STALLED_OPENING
        assert (ending.outcome, ending.error) == (Outcome.STALLED, STALLED_OPENING)
        assert trio.current_time() == 7.0  # the stall timeout, the engine's deadline
        assert len(kept) == 1  # the session's to close, although the stream never opened
        assert calls.stream is None
    finally:
        engine.go.set()  # the call left running returns, and closes what it opened
        await calls.wait_detached()
        kept[0].close()
    assert res.stats.streams_open == 0


def test_the_failure_of_a_group_is_its_first_leaf() -> None:
    first = StartFailure(ErrorCode.INVALID_REQUEST, "first")
    second = StartFailure(ErrorCode.START_TIMEOUT, "second")
    group = BaseExceptionGroup("", [BaseExceptionGroup("", [first]), second])
    assert first_failure(group) is first
