"""One client connection, and the per-kind drivers that decide what it sends.

``Conn`` records every message into the session's transcript and lets a driver wait for
what it needs (``video.start``, an answer, the close); the drivers only act (send, wait,
give up) and never judge: judging is ``checks``' job, afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import attrs
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
)

from bench._frames import encoded_frame
from bench._output import now
from bench._soak.plans import (
    Plan,
    padded_start,
)
from bench._soak.settings import INPUT_FRAME_FORMAT, INPUT_PICTURES, Timing
from bench._soak.transcript import (
    REPLY_TYPES,
    Event,
    Transcript,
)
from trio_vstream import protocol


def describe_error(exc: BaseException) -> str:
    """A client's exception in a line, for its transcript: nurseries' groups of one
    unwrapped (trio-websocket raises a refused upgrade in its reader task, so it leaves
    the connection's nursery in a group), and a refused upgrade with its HTTP status
    and body, which say why (``503 engine_unavailable: ...``)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, ConnectionRejected):
        body = (exc.body or b"").decode(errors="replace").strip()
        return f"WebSocket upgrade refused: HTTP {exc.status_code}: {body[:200]}"
    if isinstance(exc, HandshakeError):
        return f"WebSocket handshake failed: {type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def rejected_upgrade(exc: BaseException) -> ConnectionRejected | None:
    """The refused upgrade ``exc`` is, alone or in groups of one (see `describe_error`)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, ConnectionRejected) else None


def refusal_message(exc: BaseException) -> dict[str, Any] | None:
    """The ``error`` message a refused upgrade's body carries, if it is one (a full
    server's 503 says ``server_busy`` so); None for any other failure or body."""
    rejected = rejected_upgrade(exc)
    if rejected is None:
        return None
    try:
        message = json.loads(rejected.body or b"")
    except ValueError:
        return None
    return message if isinstance(message, dict) and message.get("type") == "error" else None


@attrs.frozen
class Abandon:
    """What a driver decided: give the session up, this way."""

    how: str
    """fin, rst, close or stop_reading."""


class Conn:
    """One WebSocket client: records every message into the transcript, and lets the
    kind's driver wait for what it needs (video.start, an answer, the close)."""

    def __init__(self, ws: WebSocketConnection, tr: Transcript) -> None:
        self.ws = ws
        self.tr = tr
        self.closed = trio.Event()
        self.stopped_reading = trio.Event()
        self.read_delays: list[float] = []
        self.read_limit: int | None = None
        self.video_started = False
        self.answers = 0
        self.terminal_seen = False
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def read_loop(self) -> None:
        delays = iter(self.read_delays)
        while True:
            if self.read_limit is not None and len(self.tr.received()) >= self.read_limit:
                self.stopped_reading.set()
                self._notify()
                return
            delay = next(delays, 0.0)
            if delay:
                await trio.sleep(delay)
            try:
                raw = await self.ws.get_message()
            except ConnectionClosed as exc:
                reason = exc.reason
                self.tr.close_code = getattr(reason, "code", None)
                self.tr.close_reason = getattr(reason, "reason", None)
                self.tr.closed_at = now()
                self.closed.set()
                self._notify()
                return
            if isinstance(raw, bytes):
                self.tr.events.append(Event(now(), "in", size=len(raw)))
            else:
                self.tr.events.append(Event(now(), "in", text=raw, size=len(raw)))
                self._note(raw)
            self._notify()

    def _note(self, raw: str) -> None:
        try:
            message = json.loads(raw)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        kind = message.get("type")
        if kind == "video.start":
            self.video_started = True
        elif kind in REPLY_TYPES:
            self.answers += 1
        if kind == "session.done":
            self.terminal_seen = True

    async def send(self, data: str | bytes, label: str, expect: str | None = None) -> bool:
        """Send one message; False (and recorded as undelivered) once the connection is
        closed, which drivers treat as the end of what they had to say."""
        event = Event(now(), "out", size=len(data), label=label, expect=expect)
        self.tr.events.append(event)
        try:
            await self.ws.send_message(data)
        except ConnectionClosed:
            event.delivered = False
            return False
        return True

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds; False on timeout or once the connection closed."""
        with trio.move_on_after(timeout):
            while not predicate():
                if self.closed.is_set() or self.stopped_reading.is_set():
                    return predicate()
                await self._changed.wait()
            return True
        return False


Driver = Callable[[Conn, Plan, Timing], Awaitable[Abandon | None]]


async def _send_start(c: Conn, plan: Plan) -> bool:
    return await c.send(plan.start_text(), "session.start")


async def _send_controls(c: Conn, steps: Sequence[dict[str, Any]], timing: Timing) -> None:
    """Each control message after its delay, waiting for its answer before the next, so
    that all of them reach the server while the session is surely still streaming."""
    for step in steps:
        if step.get("delay"):
            await trio.sleep(step["delay"])
        before = c.answers
        data: str | bytes = bytes.fromhex(step["hex"]) if "hex" in step else step["text"]
        if not await c.send(data, step["label"], step.get("expect")):
            return

        def answered(before: int = before) -> bool:
            return c.answers > before

        if step.get("expect") and not await c.wait_for(answered, timing.reply_wait):
            return


async def drive_normal(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    await _send_start(c, plan)
    return None


async def drive_stop(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    if not await _send_start(c, plan):
        return None
    with trio.move_on_after(plan.params["stop_after_s"]):
        await c.closed.wait()
    if not c.closed.is_set() and not c.terminal_seen:
        await c.send('{"type": "session.stop"}', "session.stop")
    return None


async def drive_controls(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    """chatty, garbage_mid, oversized_control: controls once video.start has come."""
    if not await _send_start(c, plan):
        return None
    if await c.wait_for(lambda: c.video_started, timing.reply_wait):
        await _send_controls(c, plan.params["controls"], timing)
    return None


async def drive_input_video(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    """Once ``video.start`` has come, JPEG frames of the session's size at the input's
    rate (on its clock: no drift) while the video streams, then ``input_video.end``; a
    video that ends first ends the sending."""
    if not await _send_start(c, plan):
        return None
    if not await c.wait_for(lambda: c.video_started, timing.reply_wait):
        return None
    assert plan.start is not None
    width, height = plan.start["width"], plan.start["height"]
    fps, first = plan.params["fps"], plan.params["first_picture"]
    began = trio.current_time()
    for number in range(plan.params["frames"]):
        await trio.sleep_until(began + number / fps)
        if c.closed.is_set():
            return None
        picture = (first + number) % INPUT_PICTURES
        frame = encoded_frame(INPUT_FRAME_FORMAT, width, height, picture)
        if not await c.send(frame, f"frame {number}"):
            return None
    await c.send(protocol.INPUT_END_MESSAGE, "input_video.end")
    return None


async def drive_pings_to_close(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    if not await _send_start(c, plan):
        return None
    while not c.closed.is_set():
        if not await c.send('{"type": "session.ping"}', "ping", "pong"):
            break
        with trio.move_on_after(plan.params["ping_every_s"]):
            await c.closed.wait()
    return None


async def drive_garbage_start(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    step = plan.params["garbage"]
    data: str | bytes = bytes.fromhex(step["hex"]) if "hex" in step else step["text"]
    await c.send(data, step["label"])
    return None


async def drive_oversized_start(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    await c.send(plan.params["text"], f"oversized start:{plan.params['bytes']}")
    return None


async def drive_oversized_frame(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    if plan.params["where"] == "mid":
        if not await _send_start(c, plan):
            return None
        if not await c.wait_for(lambda: c.video_started, timing.reply_wait):
            return None
    size = plan.params["bytes"]
    await c.send(padded_start(plan.start or {}, size), f"oversized frame:{size}")
    return None


async def drive_no_start(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    return None


async def drive_disconnect(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    how = plan.kind
    phase = plan.params["phase"]
    if phase != "before_start" and not await _send_start(c, plan):
        return Abandon(how)
    if phase == "after_start":
        await trio.sleep(plan.params["delay_s"] / 100)  # 0-3 ms: usually before video.start
    elif phase == "mid_stream":
        await c.wait_for(lambda: c.video_started, timing.reply_wait)
        with trio.move_on_after(plan.params["delay_s"]):
            await c.closed.wait()
    return Abandon(how)


async def drive_stopped_reader(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    c.read_limit = plan.params["read_messages"]
    if not await _send_start(c, plan):
        return None
    await c.wait_for(lambda: False, timing.reply_wait)  # until it stopped reading
    if c.closed.is_set():
        return None  # the server ended it before the client stopped reading
    return Abandon("stop_reading")


DRIVERS: Final[dict[str, Driver]] = {
    "normal": drive_normal,
    "stop": drive_stop,
    "chatty": drive_controls,
    "pings_to_close": drive_pings_to_close,
    "slow_reader": drive_normal,  # the reading is slow: see Conn.read_delays
    "stopped_reader": drive_stopped_reader,
    "fin": drive_disconnect,
    "rst": drive_disconnect,
    "close": drive_disconnect,
    "garbage_start": drive_garbage_start,
    "garbage_mid": drive_controls,
    "oversized_start": drive_oversized_start,
    "oversized_control": drive_controls,
    "oversized_frame": drive_oversized_frame,
    "no_start": drive_no_start,
    "engine_fail": drive_normal,
    "engine_hang": drive_normal,
    "engine_stuck": drive_normal,
    "input_video": drive_input_video,
    "held": drive_normal,  # the batched part's wedge rounds: its rows wait, held
}
