"""Talking to the server: one ``session.start`` per connection, control messages into
one long-running session, and a plain ``GET`` for ``/health``.

The client only records (``StartTranscript``, ``Exchange``); the ``oracle`` judges. A
control session that follows an input video numbers the binary messages it sends (the
server's frame numbers), and keeps what each frame must get and what became of it, so
that a refusal arriving later, once the decoder has tried, is judged against its frame.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio
from trio_websocket import (
    ConnectionClosed,
    DisconnectionTimeout,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from bench._fuzz.oracle import (
    Exchange,
    Problem,
    SentFrame,
    StartTranscript,
    asks_input_video,
    check_reply,
    fault_injected,
    frame_error_problems,
    frame_expectation,
    frame_number,
    input_count_problems,
    is_terminal,
    judge_control,
    shorten,
)
from bench._fuzz.settings import (
    CLIENT_MAX_MESSAGE,
    FIRST_CHUNK_WAIT,
    REPLY_TIMEOUT,
    SETTLE_CHUNKS,
    START_TIMEOUT,
    STUCK_AFTER,
    control_start,
)
from bench._fuzz.wire import (
    Wire,
    wire_size,
)
from trio_vstream import protocol


def connect(url: str) -> Any:
    return open_websocket_url(
        url, max_message_size=CLIENT_MAX_MESSAGE, connect_timeout=10, disconnect_timeout=5
    )


def _close_code(exc: ConnectionClosed) -> int | None:
    """The close code (trio-websocket types the reason optional; it sets it first)."""
    return exc.reason.code if exc.reason is not None else None


async def _send(ws: WebSocketConnection, wire: Wire) -> None:
    """Send, ignoring a closed connection: what the server said before is still read."""
    with contextlib.suppress(ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
        await ws.send_message(wire)


async def run_start(url: str, wire: Wire) -> StartTranscript:
    """One connection: send ``wire`` as the first message, read to the close. An accepted
    session is stopped after its first chunk (right away if it asked for a fault); one
    that asked for an input video is told at once that its input has ended
    (``input_video.end``), so that its chunks do not wait for frames."""
    transcript = StartTranscript(sent_bytes=wire_size(wire), fault_injected=fault_injected(wire))
    with trio.move_on_after(START_TIMEOUT) as scope:
        try:
            async with connect(url) as ws:
                await _send(ws, wire)
                await _read_start(ws, transcript, input_video=asks_input_video(wire))
        except DisconnectionTimeout:
            transcript.close_code = None  # judged as a connection that never closed
            transcript.timed_out = True
        except (HandshakeError, OSError) as exc:
            transcript.connect_error = f"{type(exc).__name__}: {exc}"
    transcript.timed_out = transcript.timed_out or scope.cancelled_caught
    return transcript


async def _read_start(
    ws: WebSocketConnection, transcript: StartTranscript, *, input_video: bool
) -> None:
    accepted = stop_sent = False
    stop_at = math.inf
    while True:
        with trio.move_on_at(stop_at) as wait:
            try:
                raw = await ws.get_message()
            except ConnectionClosed as exc:
                transcript.close_code = _close_code(exc)
                return
        if wait.cancelled_caught:  # no first chunk yet: stop anyway
            stop_sent, stop_at = True, math.inf
            await _send(ws, protocol.STOP_MESSAGE)
            continue
        transcript.messages.append(raw)
        if not accepted and len(transcript.messages) == 1 and _is_video_start(raw):
            accepted = True
            if input_video:
                await _send(ws, protocol.INPUT_END_MESSAGE)
            if transcript.fault_injected:
                stop_sent = True
                await _send(ws, protocol.STOP_MESSAGE)
            else:
                stop_at = trio.current_time() + FIRST_CHUNK_WAIT
        elif accepted and not stop_sent and isinstance(raw, bytes):
            stop_sent, stop_at = True, math.inf
            await _send(ws, protocol.STOP_MESSAGE)


def _is_video_start(raw: Wire) -> bool:
    if isinstance(raw, bytes):
        return False
    try:
        message = json.loads(raw)
    except ValueError:
        return False
    return isinstance(message, dict) and message.get("type") == "video.start"


@attrs.define
class ControlSession:
    """One running session that control inputs are sent into."""

    ws: WebSocketConnection
    request_id: str | None = None
    alive: bool = True
    chunks: int = 0
    last_chunk_at: float = attrs.field(factory=trio.current_time)
    since_chunk: list[int] = attrs.field(factory=list)
    """Inputs sent since the last chunk: the suspects when the video stops moving."""
    pending: dict[str, int] = attrs.field(factory=dict)
    """Queued interactions not yet seen in a chunk's ``started_event_ids``: event id ->
    input index. When the session fails, these are the suspects."""
    input_format: str | None = None
    """The format of the input video the session follows; None: it follows none."""
    frames: dict[int, SentFrame] = attrs.field(factory=dict)
    """The frames sent, by number (every binary message, in a session with input video)."""
    refusals: Counter[int] = attrs.field(factory=Counter)
    """Errors that refused each frame, by number."""
    shown: set[int] = attrs.field(factory=set)
    """Frames a chunk was made from (its ``input_frames.last``)."""
    counted: int = 0
    """Frames the chunks counted as used or dropped, so far."""

    @property
    def stuck(self) -> bool:
        return trio.current_time() - self.last_chunk_at > STUCK_AFTER

    def frame(self, wire: Wire, index: int, kind: str) -> SentFrame | None:
        """``wire`` as the session's next frame (input ``index`` of ``kind``), when it is
        one: a binary message, in a session that follows an input video."""
        if self.input_format is None or not isinstance(wire, bytes):
            return None
        frame = SentFrame(
            number=len(self.frames),
            input_index=index,
            size=len(wire),
            expect=frame_expectation(kind, self.input_format),
        )
        self.frames[frame.number] = frame
        return frame


class HarnessError(Exception):
    """The run could not go on for a reason that is not the server's answer."""


class SessionRefused(Exception):
    """The server would not start the control session."""


async def open_session(ws: WebSocketConnection, input_format: str | None) -> ControlSession:
    """Start a control session, with an input video of ``input_format`` or none."""
    session = ControlSession(ws, input_format=input_format)
    await _send(ws, control_start(input_format))
    with trio.move_on_after(REPLY_TIMEOUT):
        while True:
            try:
                raw = await ws.get_message()
            except ConnectionClosed as exc:
                raise SessionRefused(f"closed {_close_code(exc)}") from None
            if isinstance(raw, bytes):
                continue
            message, _ = check_reply(raw)
            if message is not None and message["type"] == "video.start":
                session.request_id = message.get("request_id")
                return session
            raise SessionRefused(shorten(raw))
    raise SessionRefused(f"no video.start in {REPLY_TIMEOUT:.0f} s")


async def _collect(
    session: ControlSession, exchange: Exchange, index: int, done: Callable[[], bool]
) -> None:
    """Read until ``done()``; after a terminal message, on to the close."""
    while exchange.terminal is not None or not done():
        try:
            raw = await session.ws.get_message()
        except ConnectionClosed as exc:
            exchange.close_code = _close_code(exc)
            session.alive = False
            return
        if isinstance(raw, bytes):
            continue
        message, problems = check_reply(raw)
        exchange.problems += problems
        if message is None:
            exchange.messages.append(raw)
            continue
        if message["type"] == "video.chunk_metadata":
            session.chunks += 1
            session.last_chunk_at = trio.current_time()
            session.since_chunk.clear()
            for event_id in message.get("started_event_ids") or ():
                session.pending.pop(event_id, None)
            if session.input_format is not None and message.get("kind") == "media":
                _count_input(session, exchange, index, message.get("input_frames"))
            continue
        exchange.messages.append(raw)
        number = frame_number(message) if session.input_format is not None else None
        if number is not None and exchange.terminal is None:
            _frame_refused(session, exchange, index, number, str(message["code"]))
            continue
        if exchange.terminal is not None:
            exchange.problems.append(Problem("message-after-terminal", message["type"]))
        elif is_terminal(message):
            exchange.terminal = message
            session.alive = False
        else:
            exchange.replies.append(message)
            if message["type"] == "session.interaction.queued":
                session.pending[str(message.get("event_id"))] = index


def _count_input(session: ControlSession, exchange: Exchange, index: int, counts: Any) -> None:
    """A media chunk's ``input_frames``, against the frames sent and refused so far."""
    if isinstance(counts, dict):
        for key in ("used", "dropped"):
            value = counts.get(key)
            session.counted += value if isinstance(value, int) else 0
    problems = input_count_problems(counts, session.counted, len(session.frames), session.refusals)
    exchange.frame_problems += [(index, problem) for problem in problems]
    last = counts.get("last") if isinstance(counts, dict) else None
    if isinstance(last, int):
        session.shown.add(last)


def _frame_refused(
    session: ControlSession, exchange: Exchange, index: int, number: int, code: str
) -> None:
    """An error that refuses frame ``number``: beside the answers, judged against it."""
    exchange.frame_errors.append((number, code))
    current = exchange.frame.number if exchange.frame is not None else None
    problems = frame_error_problems(
        number,
        code,
        session.frames,
        earlier=session.refusals[number],
        current=current,
        shown=session.shown,
    )
    session.refusals[number] += 1
    frame = session.frames.get(number)
    blamed = frame.input_index if frame is not None else index
    exchange.frame_problems += [(blamed, problem) for problem in problems]


async def exchange(session: ControlSession, wire: Wire, index: int, kind: str = "") -> Exchange:
    """Send ``wire`` (input ``index``, of ``kind``) then a ping; read the answers (and any
    terminal message): the input's and the pong, or only the pong after a frame or
    ``input_video.end`` in a session that follows an input video."""
    frame = session.frame(wire, index, kind)
    ends_input = session.input_format is not None and kind == "control.input-end"
    result = Exchange(
        sent_bytes=wire_size(wire),
        answers=1 if frame is not None or ends_input else 2,
        frame=frame,
        binary=isinstance(wire, bytes) and session.input_format is None,
    )
    with trio.move_on_after(REPLY_TIMEOUT) as scope:
        await _send(session.ws, wire)
        await _send(session.ws, protocol.PING_MESSAGE)
        await _collect(session, result, index, lambda: len(result.replies) >= result.answers)
    result.timed_out = scope.cancelled_caught
    return result


async def settle(session: ControlSession, index: int) -> Exchange:
    """Let `SETTLE_CHUNKS` chunks pass, so that what was queued has been applied."""
    result = Exchange(sent_bytes=0)
    target = session.chunks + SETTLE_CHUNKS
    with trio.move_on_after(REPLY_TIMEOUT) as scope:
        await _collect(session, result, index, lambda: session.chunks >= target)
    result.timed_out = scope.cancelled_caught
    return result


async def end_session(session: ControlSession, limit: int) -> tuple[str, list[Problem], Exchange]:
    """Stop a session that is still running; it must end with ``session.done``."""
    result = await exchange(session, protocol.STOP_MESSAGE, -1)
    outcome, problems = judge_control(result, limit)
    problems += [problem for _, problem in result.frame_problems]
    if outcome not in ("stopped", "completed") and not problems:
        problems.append(Problem("stop-not-done", outcome))
    return outcome, problems, result


def request_id_of(messages: Sequence[Wire]) -> str | None:
    for raw in messages:
        if isinstance(raw, str):
            match = re.search(r'"request_id":"([^"]+)"', raw)
            if match:
                return match.group(1)
    return None


async def control_alone(
    url: str,
    wire: Wire,
    limit: int,
    *,
    kind: str = "",
    input_format: str | None = None,
    limits: protocol.Limits = protocol.DEFAULT_LIMITS,
) -> tuple[list[Problem], list[Wire], int | None, str | None]:
    """One control input (of ``kind``) alone in a fresh session (following an input
    video of ``input_format``, or none), given time to take effect: its problems, the
    messages, the close code and the session's request id."""
    problems: list[Problem] = []
    messages: list[Wire] = []
    close_code: int | None = None
    request_id: str | None = None
    try:
        async with connect(url) as ws:
            session = await open_session(ws, input_format)
            request_id = session.request_id
            result = await exchange(session, wire, 0, kind)
            _, found = judge_control(result, limit, limits=limits)
            problems += found + [problem for _, problem in result.frame_problems]
            messages += result.messages
            close_code = result.close_code
            if session.alive:
                later = await settle(session, 0)
                messages += later.messages
                close_code = later.close_code
                _, found = judge_control(later, limit, answers=0)
                problems += found + [problem for _, problem in later.frame_problems]
                if session.alive and session.stuck:
                    problems.append(Problem("session-stuck", f"no chunk for {STUCK_AFTER:.0f} s"))
            if session.alive:
                _, found, result = await end_session(session, limit)
                problems += found
                messages += result.messages
                close_code = result.close_code
    except (SessionRefused, HandshakeError, OSError) as exc:
        problems.append(Problem("control-session-refused", str(exc)))
    return problems, messages, close_code, request_id
