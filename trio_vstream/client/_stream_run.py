"""`StreamRun`: one session on an open WebSocket, around `protocol.ClientProtocol`.

Where `stream_video` and `watch_video` (``_stream``) open the connection and settle the
result, this module is what happens on it: the receive loop that feeds every message
to the protocol machine and keeps what it hands back (chunks, timings, the terminal
message), and beside it the loops that send: a stop when asked, the interactions at
their media time, the playhead's reports of a simulated real-time viewer. Kept apart
from the connecting so that each reads whole: here the session's course, there its
connection's failures and their explanation.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Final

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from trio_vstream import protocol
from trio_vstream.client._input_video import InputPacer, InputSource
from trio_vstream.client._mp4 import StreamTiming
from trio_vstream.client._results import (
    ReceivedChunk,
    StreamOutcome,
    StreamResult,
)
from trio_vstream.client._viewer import PlaybackViewer

__all__ = ["CLOSE_WAIT", "ChunkCallback", "MessageCallback", "StreamRun", "seconds_text"]

#: How long to wait for the server's close after its terminal message, before closing
#: ourselves. The server closes right away; this only bounds a misbehaving one.
CLOSE_WAIT: Final = 2.0

ChunkCallback = Callable[[ReceivedChunk, StreamResult], None]
MessageCallback = Callable[[protocol.ServerMessage, StreamResult], None]


class StreamRun:
    """One run of `stream_video`: the I/O and bookkeeping around a `ClientProtocol`."""

    def __init__(
        self,
        result: StreamResult,
        machine: protocol.ClientProtocol,
        *,
        stop_event: trio.Event,
        stop_timeout: float,
        on_chunk: ChunkCallback | None,
        on_message: MessageCallback | None,
    ) -> None:
        self.result = result
        self.machine = machine
        self.stop_event = stop_event
        self.stop_timeout = stop_timeout
        self.on_chunk = on_chunk
        self.on_message = on_message
        self.aborted = False
        self.connect_failure: str | None = None
        self.connect_status: int | None = None  # the HTTP status of a refused handshake
        self.finished = trio.Event()  # a terminal message arrived
        self._received = trio.Event()  # set (and replaced) at every message
        self.records = {record.event_id: record for record in result.interactions}
        self.next_interaction = 0  # index into result.interactions (sorted by time)
        self.send_failed = False  # the connection refused an interaction
        self.timing = StreamTiming()
        self.announced_rate: Fraction | None = None  # config.fps, else the requested fps
        self.viewer_startup: float | None = None  # set: simulate a real-time viewer
        self.reports = False  # send the viewer's playhead (the session opted into pacing)
        self.input: InputSource | None = None  # set: send this input video
        self.pacer: InputPacer | None = None

    def outcome(self) -> StreamOutcome:
        result = self.result
        if result.done is not None:
            return StreamOutcome.STOPPED if result.done.stopped else StreamOutcome.COMPLETED
        if result.error is not None:
            return StreamOutcome.ERROR
        if self.aborted:
            return StreamOutcome.ABORTED
        # A normal close right after an error means the server meant it as terminal,
        # even if it was one of the codes that usually are not.
        if result.close_code == 1000 and result.errors:
            result.error = result.errors[-1]
            return StreamOutcome.ERROR
        return StreamOutcome.DISCONNECTED

    def explain_unsent(self) -> None:
        """Say, on each interaction that was never sent, why: the warnings show it.

        Runs once the outcome is known, because that is what decides the reason.
        """
        result = self.result
        media = result.media_time
        reached = "" if media is None else f" at {seconds_text(media)} s"
        if result.rejected:
            reason = "the server rejected the session"
        elif result.video_start is None:
            reason = "the session never started"
        elif media is None:
            reason = (
                "the frame rate is unknown (not readable from the stream, and no fps in "
                "video.start's config or in the request), so media time is unknown"
            )
        elif self.send_failed:
            reason = f"the connection closed{reached}"
        elif result.outcome is StreamOutcome.COMPLETED:
            reason = f"the video ended{reached}"
        elif result.outcome is StreamOutcome.STOPPED:
            reason = f"the session was stopped{reached}"
        elif result.outcome is StreamOutcome.ERROR:
            reason = f"the session ended with an error{reached}"
        elif result.outcome is StreamOutcome.DISCONNECTED:
            reason = f"the connection ended{reached}"
        else:
            reason = f"the client gave up{reached}"
        for record in result.interactions:
            if record.sent_at is None:
                record.not_sent = reason

    async def watch_abort(self, abort_event: trio.Event, scope: trio.CancelScope) -> None:
        """Cancel everything on abort, or on a stop before the session exists."""
        async with trio.open_nursery() as nursery:

            async def abort_on(event: trio.Event, only_before_start: bool) -> None:
                await event.wait()
                if only_before_start and self.result.start_sent_at is not None:
                    return  # the in-session stop task handles it
                self.aborted = True
                scope.cancel()

            nursery.start_soon(abort_on, abort_event, False)
            nursery.start_soon(abort_on, self.stop_event, True)

    async def run(self, ws: WebSocketConnection, start_text: str | None) -> None:
        """``start_text`` None: a viewer, which sends nothing; its times count from now."""
        # If the server spoke first and closed (server_busy, server_shutdown), what it
        # said is still queued for the receive loop.
        if start_text is not None:
            with contextlib.suppress(ConnectionClosed):
                await ws.send_message(start_text)
        self.result.start_sent_at = trio.current_time()
        if self.viewer_startup is not None:
            self.result.viewer = PlaybackViewer(
                self.result.start_sent_at, startup_seconds=self.viewer_startup
            )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_when_asked, ws, nursery.cancel_scope)
            if self.reports:
                nursery.start_soon(self._report_playback, ws)
            if self.result.viewer is not None and self.result.interactions:
                nursery.start_soon(self._interact_at_playhead, ws, self.result.viewer)
            if self.input is not None:
                nursery.start_soon(self._send_input, ws, self.input)
            await self._receive(ws)
            nursery.cancel_scope.cancel()

    def refused(self, body: bytes | None) -> bool:
        """A refused handshake whose body is an ``error`` message (a full server's 503:
        ``server_busy``): handled as that message arriving on the connection, so the
        outcome, ``result.error`` and ``on_message`` are what the same refusal after the
        upgrade gives. False, and nothing recorded, for any other body."""
        text = (body or b"").decode("utf-8", errors="replace")
        try:
            message = protocol.parse_server_message(text)
        except protocol.ProtocolError:
            return False
        if not isinstance(message, protocol.Error):
            return False
        self._handle(text)  # text: bytes would be taken for a binary message
        return True

    # ------------------------------------------------------------------ receiving

    async def _receive(self, ws: WebSocketConnection) -> None:
        try:
            while not self.finished.is_set():
                self._handle(await ws.get_message())
                if self.result.viewer is None:
                    # Here rather than in a task of its own: an interaction is then sent
                    # before the next message is read, exactly at its chunk boundary.
                    await self._send_due_interactions(ws)
            # The server closes after its terminal message; give it the chance, so the
            # close is its normal one and we learn the close code.
            with trio.move_on_after(CLOSE_WAIT):
                while True:
                    self._handle(await ws.get_message())
        except ConnectionClosed as exc:
            # trio-websocket types the reason optional; it is set before ConnectionClosed.
            self.result.close_code = exc.reason.code if exc.reason is not None else None

    def _handle(self, raw: str | bytes) -> None:
        now = trio.current_time()
        self._received.set()  # after this call: what a waiting sender looks at has moved
        self._received = trio.Event()
        try:
            events = self.machine.receive(raw)
        except protocol.ServerProtocolError as exc:
            # Kept, not raised: what arrived may still be a good video.
            self.result.problems.append(exc.message)
            events = exc.events
            if exc.data is not None:
                self._chunk(None, exc.data, now)
        for event in events:
            if isinstance(event, protocol.ChunkReceived):
                self._chunk(event.metadata, event.data, now)
            else:
                self._message(event, now)
        if self.machine.ended:
            self.finished.set()
            if self.result.viewer is not None:
                self.result.viewer.end(now)  # the stream ends here, not at the close

    def _message(self, event: protocol.Event, now: float) -> None:
        """Record a text message's event; `ChunkReceived` goes to `_chunk` instead."""
        result = self.result
        assert not isinstance(event, protocol.ChunkReceived)
        message = event.message
        result.messages.append(message)
        if isinstance(event, protocol.VideoStarted):
            result.video_start = event.start
            result.video_start_at = now
            echoed = _announced_rate(event.start.config.get("fps"))
            self.announced_rate = echoed or _announced_rate(result.request.get("fps"))
            result.frame_rate = self.timing.frame_rate or self.announced_rate
        elif isinstance(event, protocol.WatchStarted):
            result.watch_start = event.start
            result.video_start_at = now
            self.announced_rate = _announced_rate(event.start.config.get("fps"))
            result.frame_rate = self.timing.frame_rate or self.announced_rate
        elif isinstance(event, protocol.InteractionAccepted):
            record = self.records.get(event.event_id)
            if record is not None and record.queued_at is None:
                record.queued_at = now
        elif isinstance(event, protocol.SessionEnded):
            result.done = event.done
        elif isinstance(event, protocol.ErrorReceived):
            error = event.error
            result.errors.append(error)
            record = self.records.get(error.event_id) if error.event_id else None
            if record is not None:
                record.error = error
            if event.ends_session:
                result.error = error
        if self.on_message is not None:
            self.on_message(message, result)

    def _chunk(self, metadata: protocol.ChunkMetadata | None, data: bytes, now: float) -> None:
        """Record one binary message (``metadata`` None: the server did not announce it)."""
        result = self.result
        chunk = ReceivedChunk(metadata=metadata, size=len(data), received_at=now)
        if self.timing.frame_rate is None:
            self.timing.feed(data)
            result.frame_rate = self.timing.frame_rate or self.announced_rate
        result.binary_messages.append(data)
        result.chunks.append(chunk)
        if result.first_chunk_at is None:
            result.first_chunk_at = now
        if chunk.num_frames:
            result.last_media_at = now
            rate = result.frame_rate
            if result.viewer is not None and rate is not None:
                result.viewer.receive(now, chunk.num_frames * rate.denominator / rate.numerator)
        if metadata is not None and metadata.input_frames is not None and self.pacer is not None:
            self.pacer.acknowledge(metadata.input_frames.last)
        if metadata is not None:
            for event_id in metadata.started_event_ids:
                record = self.records.get(event_id)
                if record is not None and record.started_in_chunk is None:
                    record.started_in_chunk = metadata.generation_chunk_index
        if self.on_chunk is not None:
            self.on_chunk(chunk, result)

    # -------------------------------------------------------------------- sending

    async def _stop_when_asked(self, ws: WebSocketConnection, scope: trio.CancelScope) -> None:
        await self.stop_event.wait()
        if self.finished.is_set():
            return
        self.result.stop_requested_at = trio.current_time()
        with contextlib.suppress(ConnectionClosed):
            await ws.send_message(self.machine.stop())
        with trio.move_on_after(self.stop_timeout):
            await self.finished.wait()
            return
        self.result.stop_timed_out = True
        self.aborted = True
        scope.cancel()

    async def _send_input(self, ws: WebSocketConnection, source: InputSource) -> None:
        """The input video: its frames after ``video.start``, each when the pacer lets
        it go, then ``input_video.end``. A task of its own, so that receiving never
        waits on a decode or on the pacing; a stop ends it (the server ends the session
        soon, and frames would only be dropped), and so does the session's end."""
        result = self.result
        pacer = self.pacer = InputPacer(source.fps)
        async with trio.open_nursery() as nursery:

            async def cancel_on_stop() -> None:
                await self.stop_event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_on_stop)
            # One frame waits in the channel while the next decodes: prefetched, bounded.
            send_frames, frames = trio.open_memory_channel[bytes](1)
            nursery.start_soon(self._read_input, source, send_frames)
            try:
                async with frames:
                    async for data in frames:
                        await self._when_pacer_allows(pacer)
                        if self.finished.is_set() or self.stop_event.is_set():
                            break  # checked here too: the stop's cancel may come later
                        pacer.sending(trio.current_time())
                        await ws.send_message(data)
                        result.input_frames_sent = (result.input_frames_sent or 0) + 1
                    else:
                        await self._when_pacer_allows(None)  # after video.start, even so
                        if not (self.finished.is_set() or self.stop_event.is_set()):
                            await ws.send_message(protocol.INPUT_END_MESSAGE)
                            result.input_ended = True
            except ConnectionClosed:
                pass  # the receive loop learns why
            nursery.cancel_scope.cancel()

    async def _when_pacer_allows(self, pacer: InputPacer | None) -> None:
        """Return once the session streams and the pacer (if any) lets the next frame
        go, or the session has ended; wakes at each message, for its acknowledgement."""
        while not self.finished.is_set():
            now = trio.current_time()
            at = None  # before video.start: wait for it
            if self.result.video_start is not None:
                if pacer is None:
                    return
                at = pacer.send_at(now)
            if at is not None and at <= now:
                return
            received = self._received
            with trio.move_on_at(math.inf if at is None else at):
                await received.wait()

    async def _read_input(
        self, source: InputSource, send_frames: trio.MemorySendChannel[bytes]
    ) -> None:
        """Decode and encode the file's frames, one at a time in a worker thread, into
        ``send_frames``; a file that fails part way ends there, with a problem saying
        so (the frames before it were good, and the input still ends properly)."""
        async with send_frames:
            frames = source.frames()
            try:
                while (data := await trio.to_thread.run_sync(next, frames, None)) is not None:
                    await send_frames.send(data)
            except ValueError as exc:  # how frames() says why
                self.result.problems.append(
                    f"input video {source.video.path}: stopped after "
                    f"{self.result.input_frames_sent} frames sent: {exc}"
                )
            finally:
                frames.close()

    async def _report_playback(self, ws: WebSocketConnection) -> None:
        """Send the viewer's playhead whenever it has a report (every 100 ms while it
        plays), until the session stops: a stopping session needs no more pacing."""
        viewer = self.result.viewer
        assert viewer is not None
        while True:
            due = viewer.next_report_at
            # Before the first frame there is no schedule yet: look again a tick later.
            await trio.sleep_until(
                due if due is not None else trio.current_time() + viewer.report_interval
            )
            state = self.machine.state
            if state is not protocol.ClientState.STREAMING:
                if state is protocol.ClientState.STARTING:
                    continue
                return
            position = viewer.report(trio.current_time())
            if position is None:
                continue
            try:
                await ws.send_message(self.machine.playback(position))
            except ConnectionClosed:
                return  # the receive loop learns why
            self.result.playback_sent.append((trio.current_time(), position))

    async def _interact_at_playhead(self, ws: WebSocketConnection, viewer: PlaybackViewer) -> None:
        """A viewer's interactions: each sent when the playhead reaches its time, as a
        person watching presses a key at what they see, not at what has arrived ahead of
        it. Wakes when the playhead gets there, or at each message (more media, the
        end), whichever comes first."""
        records = self.result.interactions
        while True:
            await self._send_due_interactions(ws)
            if (
                self.next_interaction >= len(records)
                or self.send_failed
                or self.stop_event.is_set()
                or self.finished.is_set()
            ):
                return
            # Not yet due (the call above sent all that was): a time is in the future.
            # Before video.start nothing is due (the playhead is at 0 all the same).
            wake = None
            if self.result.video_start_at is not None:
                wake = viewer.reaches_at(records[self.next_interaction].interaction.at)
            received = self._received
            with trio.move_on_at(math.inf if wake is None else wake):
                await received.wait()

    async def _send_due_interactions(self, ws: WebSocketConnection) -> None:
        """Send every interaction whose time the video has reached: the media delivered,
        or for a simulated viewer its playhead."""
        result = self.result
        records = result.interactions
        if (
            self.next_interaction >= len(records)
            or result.video_start_at is None
            or self.send_failed
            or self.stop_event.is_set()
            or self.finished.is_set()
        ):
            return
        media = result.media_time
        if result.viewer is not None:
            result.viewer.advance(trio.current_time())
            media = result.viewer.position
        while media is not None and self.next_interaction < len(records):
            record = records[self.next_interaction]
            item = record.interaction
            if media < item.at:
                return
            message = self.machine.interact(
                item.prompt,
                event_id=record.event_id,
                transition_chunks=item.transition_chunks,
                camera=item.camera,
            )
            try:
                await ws.send_message(message)
            except ConnectionClosed:
                # Keep reading: what the server said before closing is still queued.
                self.send_failed = True
                return
            record.sent_at = trio.current_time()
            record.sent_media_time = media
            self.next_interaction += 1


def _announced_rate(value: object) -> Fraction | None:
    """An fps from JSON (``config.fps`` or the request), if it is a usable number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return Fraction(value)


def seconds_text(value: float) -> str:
    """``2``, ``0.25``, ``1.333``: short, and never ``2.0000000000000004``."""
    return f"{round(value, 3):g}"
