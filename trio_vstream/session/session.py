"""One client session: a nursery of a receive loop, a generation loop and a stall guard.

The session owns one WebSocket from the first message to the close. Its
structure is the whole design:

* the **receive loop** reads control messages (stop, ping, interaction) for
  the whole session, so pings are answered and stops take effect even while
  the engine is busy;
* the **generation loop** is two tasks joined by a one-slot channel: a
  producer that runs the engine's blocking ``next_chunk`` in a worker thread,
  and a deliverer that encodes each chunk in a worker thread and sends it. At
  most three chunks exist at once (being generated, waiting, being
  delivered), so a client that stops reading stalls the engine instead of
  filling memory;
* the **stall guard** is a ``trio.move_on_after`` that every sign of
  progress (a denoising step, a chunk generated or sent, a client ping)
  pushes back; when it expires the session is aborted. A session queued
  behind others (for a step slot, or inside the engine's
  ``checkpoint.waiting()``) is pushed back by every step the engine takes for
  any session: waiting behind sessions that progress is not a stall, while an
  engine that makes no progress at all is caught within the stall timeout.

How a session ends decides what is cancelled. A stop, an engine failure or a
graceful shutdown cancels only the producer (the engine sees it at its next
checkpoint, within one step); the deliverer finishes the chunk it is sending,
so the socket stays usable for the terminal message. A
disconnect or a stall aborts everything, including a send stuck on a client
that does not read, and stops waiting for an engine call stuck outside a
checkpoint (it is left to finish in its thread: `calls`). Sends are
otherwise shielded: a cancelled half-written WebSocket frame would corrupt the
stream, so a send is only ever interrupted on purpose, and then the socket is
marked broken and left alone (`sending`).

The outcome is decided when it happens, and the first reason wins: once the
engine has produced the last chunk the video is complete, and a stop or a
shutdown after that changes nothing; a client that goes away is a disconnect
whichever task notices it first (the rules: `endings`).

Every session the client did not abandon ends with exactly one terminal
message (``session.done`` or ``error``) and a normal close.

This module keeps the nursery, the stall guard and the outcome: the tasks of a session
share that state (the outcome, the cancel scopes, the stall clock), and how a session
ends reads best in one place. The parts that need none of it live beside it, each
tested alone: what the receive loop does with a message (`receiving`), how a chunk is
encoded and sent (`delivery`), and the session's units (`endings`, `sending`, `pacing`,
`interactions`, ...); the package's docstring says what each holds.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import uuid

import numpy as np
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from trio_vstream import protocol
from trio_vstream.engines.contract import Chunk, EngineStream
from trio_vstream.engines.frames import frame_count
from trio_vstream.engines.interfaces import interaction_kinds, supports_seed
from trio_vstream.logsafe import get_logger
from trio_vstream.outputs.taps import TapSet, open_taps
from trio_vstream.protocol import ErrorCode
from trio_vstream.scheduling.checkpoint import SessionCheckpoint
from trio_vstream.session.calls import SessionCalls, release_chunk
from trio_vstream.session.delivery import Delivery
from trio_vstream.session.early_messages import EarlyMessages
from trio_vstream.session.endings import (
    Ending,
    Outcome,
    SessionError,
    SessionSummary,
    engine_failure,
)
from trio_vstream.session.input_video import InputVideo
from trio_vstream.session.interactions import Interactions
from trio_vstream.session.pacing import PlaybackGate, sleep_until_keeping_alive
from trio_vstream.session.prepare import StartFailure, first_failure, prepare, receive_start
from trio_vstream.session.receiving import Receiver, hold_early_messages
from trio_vstream.session.request import config_echo
from trio_vstream.session.resources import (
    IMAGE_DECODES_AT_ONCE,
    ServerCounters,
    ServerResources,
    SessionConfig,
)
from trio_vstream.session.sending import Sender, SocketBroken

__all__ = [  # what the server and its tests use, whichever module holds it
    "IMAGE_DECODES_AT_ONCE",
    "Outcome",
    "ServerCounters",
    "ServerResources",
    "Session",
    "SessionConfig",
    "SessionSummary",
]

logger = get_logger(__name__)

_ROUTINE_CLOSE_ERRORS = (
    ConnectionClosed,
    trio.BrokenResourceError,
    trio.BusyResourceError,
    trio.ClosedResourceError,
)
"""What closing a WebSocket may raise when the client closed or went at the same time:
the end of a session, not a failure of the server (``http.ReplayStream`` removes the
cause of ``BusyResourceError``; this keeps any other path to it a one-line matter)."""


class Session:
    """One WebSocket connection's session. ``await Session(...).run()``, once."""

    def __init__(self, ws: WebSocketConnection, resources: ServerResources) -> None:
        self._ws = ws
        self._res = resources
        self._config = resources.config
        self.request_id: str | None = None
        self._ending = Ending()
        """How the session ends (`trio_vstream.session.endings`): decided when it happens."""
        self._sender = Sender(
            ws,
            timeout=self._config.stall_timeout,
            on_closed=self._disconnected,
            on_stuck=self._client_stopped_reading,
        )
        """Every write to the socket (`trio_vstream.session.sending`)."""
        self._disconnect_logged = False
        self._session_scope = trio.CancelScope()
        self._streaming = False
        self.admitted = False
        """True from the ``session.start`` that took a session slot: an upgrade still
        waiting for its ``session.start`` is not a running session (the server counts a
        short claim for it instead, ``trio_vstream.server.slots``)."""
        self.finishing = False
        """True once the session only has its last message and the close left to do:
        it no longer counts against the server's session limit."""
        self._producer_scope = trio.CancelScope()
        self._stopping = threading.Event()
        """Set when the session stops or aborts: read by the encoder's thread between frames."""
        self._last_progress = 0.0
        """When the session last made progress (`_touch`): the stall guard's clock."""
        self._calls = SessionCalls(resources)
        """Its worker-thread calls and its engine stream (`trio_vstream.session.calls`)."""
        self._checkpoint = SessionCheckpoint(
            resources.step_limiter, resources.engine_progress, self._touch, resources.batcher
        )
        self._started_at = time.monotonic()
        self._fps = 1
        self._metrics = resources.metrics
        self._start_received_at = 0.0
        self._stop_requested_at: float | None = None
        self._gate: PlaybackGate | None = None
        """Set when the client asked for ``streaming_buffer_seconds`` (`pacing` too)."""
        self._taps = TapSet("", ())
        self._delivery = Delivery(
            resources,
            self._calls,
            self._sender,
            self._ending,
            progress=self._touch,
            fail=self.stop,
            stopping=self._stopping.is_set,
        )
        """The deliverer, its encoder and its counts (`trio_vstream.session.delivery`)."""
        self._interactions = Interactions(interaction_kinds(resources.engine))
        """Its live interactions and scripts (`trio_vstream.session.interactions`)."""
        self._input: InputVideo | None = None
        """The input video it follows, if it asked for one (`trio_vstream.session.input_video`)."""

    # ----------------------------------------------------------------- entry

    async def run(self) -> SessionSummary:
        """Serve the session to its end. Raises only on outer cancellation."""
        stats = self._res.stats
        stats.sessions_active += 1
        stats.sessions_total += 1
        self._metrics.session_started()
        try:
            with self._session_scope:
                try:
                    await self._run()
                # Several tasks may fail at once (a close noticed by two of them, while a
                # third is cancelled): every part of a group is handled, and whatever
                # cancellation is left is this scope's to absorb, or the caller's.
                except* ConnectionClosed:
                    self._disconnected()
                except* StartFailure as failures:  # a failure before streaming began
                    failure = first_failure(failures)
                    self._ending.end(Outcome.FAILED, (failure.code, failure.message))
                except* Exception as errors:
                    logger.error("session %s: internal error", self.request_id, exc_info=errors)
                    self._ending.end(
                        Outcome.FAILED, (ErrorCode.INTERNAL_ERROR, "Internal server error")
                    )
            # Closed already, unless the producer never ran: then the close goes on while
            # the terminal message is sent (a stuck close must not hold it), and the
            # session's end waits for it like for any call it left running.
            self._calls.close_stream_soon()
            await self._finish()
            # A close timeout for the calls the session stopped waiting for to return, so
            # that their streams are closed before it ends. Not shielded: a server that
            # stops now (the end of a drain) does not wait.
            with trio.move_on_after(self._config.close_timeout):
                await self._calls.wait_detached()
        finally:
            self._calls.close_stream_soon()
            await self._delivery.close_encoder()
            # Cancelled here, past the session's own scope, only by the server stopping
            # (a second signal, a drain's end): then nothing waited for the calls.
            self._calls.abandon_detached(at_stop=trio.current_effective_deadline() == -math.inf)
            stats.sessions_active -= 1
            self._metrics.session_ended((self._ending.outcome or Outcome.FAILED).value)
        return self.summary()

    def summary(self) -> SessionSummary:
        outcome = self._ending.outcome or Outcome.FAILED
        error = self._ending.error
        return SessionSummary(
            request_id=self.request_id,
            outcome=outcome,
            chunks_sent=self._delivery.chunks_sent,
            frames_generated=self._delivery.frames_generated,
            error_code=error[0].value if error else None,
            error_message=error[1] if error else None,
            started_at=self._started_at,
            stream_closed_at=self._calls.stream_closed_at,
            ended_at=time.monotonic(),
        )

    def stop(self, outcome: Outcome = Outcome.STOPPED, error: SessionError | None = None) -> None:
        """End the session gracefully: the engine stops at its next checkpoint, the
        chunk being sent is finished, and the stream is closed properly.

        Once the engine has made the last chunk, the video is complete: a stop or a
        shutdown then changes nothing, and the chunks still on their way are sent.
        """
        if self._ending.stop(outcome, error):
            self._producer_scope.cancel()
            self._delivery.stop_waiting()
            self._stopping.set()

    def abort(self, outcome: Outcome, error: SessionError | None = None) -> None:
        """End the session now, interrupting even a send stuck on the socket."""
        self._ending.end(outcome, error)
        self._stopping.set()
        self._producer_scope.cancel()
        self._session_scope.cancel()
        self._sender.interrupt()

    def shutdown(self) -> None:
        """The server is going away: streaming sessions wind down, others end at once.

        Even those are not cut mid-send: a session that is sending its ``video.start``
        finishes that message, then says ``server_shutdown``.
        """
        error = (ErrorCode.SERVER_SHUTDOWN, "Server is shutting down")
        if self._streaming:
            self.stop(Outcome.SHUTDOWN, error)
        elif self._ending.end(Outcome.SHUTDOWN, error):
            self._producer_scope.cancel()
            self._session_scope.cancel()

    def _disconnected(self) -> None:
        """The client closed the connection: whichever task noticed, one line, no traceback.

        Its slot is free from here: what is left (one engine step, a close) is cleanup.
        """
        self.finishing = True
        if not self._disconnect_logged:
            self._disconnect_logged = True
            logger.info("session %s: client disconnected", self.request_id)
        self.abort(Outcome.DISCONNECTED)

    def _client_stopped_reading(self) -> None:
        """A send ran out of time: the client stopped reading. A no-op for the outcome
        when the session already ended some other way."""
        self.abort(
            Outcome.STALLED, (ErrorCode.STALL_TIMEOUT, "Stall timeout: the client stopped reading")
        )

    # ----------------------------------------------------------- the session

    async def _run(self) -> None:
        received = await receive_start(self._ws, self._res, self._ending)
        if received is None:
            return
        start, self._start_received_at = received
        # The session slot is taken here, not at the upgrade; no checkpoint between the
        # server's count and this flag, so two starts can never take one slot.
        refusal = self._res.admit() if self._res.admit is not None else None
        if refusal is not None:
            self._ending.end(Outcome.REJECTED, refusal)
            return
        self.admitted = True
        self.request_id = self._calls.request_id = f"video_stream-{uuid.uuid4().hex}"
        self._interactions.request_id = self.request_id
        # Preparing may take a while (an image fetch, the engine opening its stream): a
        # client that goes away meanwhile ends it at once, and what it sends is kept.
        frame_bytes = start.input_video.max_frame_bytes if start.input_video else None
        early = EarlyMessages(self._config.limits, frame_bytes)
        async with trio.open_nursery() as preparing:
            preparing.start_soon(hold_early_messages, self._ws, early, self._disconnected)
            prepared = await prepare(
                start,
                self.request_id,
                self._res,
                self._calls,
                self._ending,
                self._delivery.keep_encoder,
            )
            preparing.cancel_scope.cancel()
        request, self._gate = prepared.request, prepared.gate
        if start.input_video is not None:
            self._input = InputVideo(
                start.input_video,
                (start.video.height, start.video.width),
                start.video.fps,
                in_thread=self._calls.in_thread,
                limiter=self._res.image_limiter,
            )
        self._interactions.prepared(prepared.scripts, prepared.queue)
        self._fps = start.video.fps
        # From here a shutdown lets the session say goodbye properly, rather than
        # cutting the video.start about to be sent.
        self._streaming = True
        taps = open_taps(self._res.taps, self.request_id, start)
        stream = self._calls.stream
        video_start = protocol.VideoStart(
            self.request_id,
            start.format,
            config_echo(
                start, stream.seed if supports_seed(stream) else None, audio=self._delivery.audio
            ),
            **taps.video_start_fields,
        )
        await self._sender.send(video_start)
        self._taps = TapSet(self.request_id, taps.taps)
        self._delivery.started(
            self.request_id,
            self._taps,
            (start.video.width, start.video.height),
            start.video.fps,
            prepared.pacer,
            self._start_received_at,
        )
        self._taps.call("started", video_start, start)
        self._metrics.video_started(trio.current_time() - self._start_received_at)
        self._touch()
        logger.info(
            "session %s started: %dx%d, %d frames at %d fps",
            self.request_id,
            request.width,
            request.height,
            request.num_frames,
            request.fps,
        )
        async with trio.open_nursery() as nursery:
            receiver = self._receiver()
            nursery.start_soon(receiver.run, early)
            if self._input is not None:
                nursery.start_soon(self._input.decode_frames, receiver.refuse_frame)
            nursery.start_soon(self._stall_guard)
            nursery.start_soon(self._sender.send_replies)  # the receive loop's replies
            await self._generate()
            nursery.cancel_scope.cancel()
        if self._ending.outcome is None:
            self._ending.end(Outcome.COMPLETED)

    # --------------------------------------------------------- receive loop

    def _receiver(self) -> Receiver:
        """The receive loop (`trio_vstream.session.receiving`), once ``video.start`` is out."""
        assert self.request_id is not None
        return Receiver(
            self._ws,
            self.request_id,
            limits=self._config.limits,
            sender=self._sender,
            interactions=self._interactions,
            calls=self._calls,
            gate=self._gate,
            taps=self._taps,
            ending=self._ending,
            stop_requested=self._stop_requested,
            stop=self.stop,
            disconnected=self._disconnected,
            progress=self._touch,
            input_video=self._input,
        )

    def _stop_requested(self) -> None:
        """The client sent ``session.stop``: a graceful stop, timed from the first one."""
        logger.info("session %s: stop requested", self.request_id)
        if self._stop_requested_at is None:
            self._stop_requested_at = trio.current_time()
        self.stop()

    # ---------------------------------------------------------- stall guard

    def _touch(self) -> None:
        """Progress happened: restart the stall clock.

        A time stamp, not an event the guard waits on: progress comes at every engine
        step, every chunk made and every chunk sent (about seven times a chunk), and
        waking the guard each time cost the event loop a task switch and a cancel
        scope's deadline, a sixth of its CPU under load. The guard reads the stamp
        once per timeout instead.
        """
        self._last_progress = trio.current_time()

    async def _stall_guard(self) -> None:
        timeout = self._config.stall_timeout
        self._touch()  # the clock starts with the guard
        # Polling on purpose (see `_touch`): it wakes once per timeout, not per step.
        while (deadline := self._last_progress + timeout) > trio.current_time():  # noqa: ASYNC110
            await trio.sleep_until(deadline)
        if self._sender.sending:
            # Nothing moved because a send is stuck: the engine waits for the channel.
            reason = "Stall timeout: the client stopped reading"
        else:
            reason = "Stall timeout: no generation progress"  # the reference's words
        logger.warning(
            "session %s: %s for %.1f s, aborting", self.request_id, reason.lower(), timeout
        )
        self.abort(Outcome.STALLED, (ErrorCode.STALL_TIMEOUT, reason))
        return

    # ------------------------------------------------------ generation loop

    async def _generate(self) -> None:
        send_chunks, receive_chunks = trio.open_memory_channel[Chunk](1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._produce, send_chunks)
            await self._delivery.deliver(receive_chunks)

    async def _produce(self, send_chunks: trio.MemorySendChannel[Chunk]) -> None:
        stream = self._calls.stream
        assert stream is not None
        async with send_chunks:
            try:
                with self._producer_scope:
                    await self._generate_chunks(stream, send_chunks)
                await self._video_ended()
                # After a stop, the engine's call sees it at its next checkpoint, within
                # a step, and closes the stream as it returns: wait for that, so the
                # stream is closed before the terminal message. An engine stuck outside a
                # checkpoint is not waited for past the stall guard's abort.
                await self._calls.wait_detached()
            finally:
                # The engine is done with this session: free the model's memory now,
                # not after the last chunk has been encoded and sent.
                await self._calls.close_stream()

    async def _video_ended(self) -> None:
        """No chunk will start any more (the last one made, a stop, an engine failure):
        the interactions held for one get their error, before the terminal message.
        (An aborted session skips this: its client is gone, or gets its error.)"""
        for event_id, refusal in self._interactions.end():
            error = protocol.Error(*refusal, self.request_id, event_id)
            self._taps.call("interaction_refused", event_id, error)
            await self._sender.reply(error)

    async def _generate_chunks(
        self, stream: EngineStream, send_chunks: trio.MemorySendChannel[Chunk]
    ) -> None:
        index = 0  # of the chunk about to be generated
        while True:
            await self._before_chunk(stream)
            feed = counts = None
            if self._input is not None:
                window = await self._input_window(stream)
                if window is None:
                    return
                feed, counts = window
            began = trio.current_time()
            try:
                # The scripts' entries for this chunk, queued at its boundary.
                for change in self._interactions.scripts.before_chunk(index):
                    stream.interact(change)
                chunk = await self._calls.next_chunk(stream, self._checkpoint, feed)
            except trio.Cancelled:
                raise
            except Exception as exc:
                logger.exception("session %s: engine failed while generating", self.request_id)
                # The chunks the engine made before it failed are the user's video so far:
                # they are still sent (at most the one waiting and the one being sent),
                # then the error. The producer ends here, so nothing needs cancelling.
                self._ending.engine_failed(engine_failure(exc, "generating", self.request_id))
                return
            if chunk is None:
                # The video is complete: what is left is delivery, which a stop or a
                # shutdown no longer interrupts.
                self._ending.generated_all = True
                return
            index += 1
            frames = frame_count(chunk.frames)
            if feed is not None and counts is not None:
                if frames != len(feed):
                    release_chunk(chunk, self.request_id)
                    self._ending.engine_failed(
                        (
                            ErrorCode.GENERATION_FAILED,
                            f"{self._res.engine.name} made {frames} frames "
                            f"from {len(feed)} input frames",
                        )
                    )
                    return
                self._delivery.input_frames[chunk.index] = counts
            self._interactions.chunk_generated(
                chunk.started_event_ids, began, frames / self._fps, 1 / self._fps
            )
            if self._gate is not None:
                self._gate.generated(frames)
            waited = self._checkpoint.take_waited()
            self._metrics.chunk_generated(trio.current_time() - began - waited, waited)
            self._touch()
            try:
                await send_chunks.send(chunk)
            except BaseException:  # cancelled, or the deliverer is gone: never sent
                release_chunk(chunk, self.request_id)
                raise

    async def _input_window(
        self, stream: EngineStream
    ) -> tuple[np.ndarray | None, protocol.InputFrameCounts | None] | None:
        """The next chunk's input, for a session that follows an input video (none for
        the call that ends a complete video); None when generation ends here instead: its
        input has ended and the client asked to end with it, or the engine's
        ``next_chunk_frames`` is not a whole number (a broken engine)."""
        assert self._input is not None
        if self._input.finished:
            self._ending.generated_all = True
            return None
        wanted = getattr(stream, "next_chunk_frames", None)  # FollowsInput: checked at start
        if wanted == 0 and not isinstance(wanted, bool):
            return None, None  # the video is complete: next_chunk says so, with no input
        if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
            self._ending.engine_failed(
                (
                    ErrorCode.GENERATION_FAILED,
                    f"{self._res.engine.name}: next_chunk_frames must be a whole "
                    f"number, got {wanted!r}",
                )
            )
            return None
        window = await self._input.window(wanted)
        if window is None:  # its input ended while the chunk waited for it
            self._ending.generated_all = True
        return window

    async def _before_chunk(self, stream: EngineStream) -> None:
        """A paced session's waits at a chunk boundary, then the live changes due.

        First the end of the last chunk's action window (a paced camera session's; a
        deliberate wait of at most a chunk's media time, so progress for the stall guard
        however long a chunk is), then the playback gate: not progress, and nothing of
        the engine's is held meanwhile (a step slot or a batch row only inside
        ``next_chunk``). A stop ends either wait. Then the interactions
        held for this chunk, handed over: one the engine refuses gets its error now."""
        gate = self._gate
        if gate is not None:
            if gate.finished:  # the engine's next call ends the video: nothing to wait for
                return
            deadline = self._interactions.deadline
            if deadline is not None:  # a deliberate wait: progress, like a paced send
                await sleep_until_keeping_alive(
                    deadline, self._touch, self._config.stall_timeout / 2
                )
            await gate.wait()
        for event_id, refusal in self._interactions.take_due(stream):
            error = protocol.Error(*refusal, self.request_id, event_id)
            self._taps.call("interaction_refused", event_id, error)
            await self._sender.reply(error)  # out before the chunk it would have been in

    # --------------------------------------------------------------- ending

    async def _finish(self) -> None:
        """Send the one terminal message, then close the WebSocket normally.

        Both within ``close_timeout``: a client that stops reading at the end holds
        its session slot that long, not a stall timeout. After a half-written frame
        the socket is left alone: a close frame would only add to the garbage.
        """
        self.finishing = True
        trailer: bytes | None = b""
        if self._ending.settle() is Outcome.COMPLETED:
            # Like the reference, only a completed stream gets the encoder's trailer: after
            # a stop it would be an extra message, and it carries no frames (an index box).
            trailer = await self._delivery.finish_encoder()  # None: the video is broken, a failure
        outcome = self._ending.settle()
        if self._ending.says_goodbye and not self._sender.broken:
            deadline = trio.current_time() + self._config.close_timeout
            with contextlib.suppress(ConnectionClosed, SocketBroken):
                if outcome is Outcome.COMPLETED and trailer:
                    await self._delivery.send_trailer(trailer, deadline)
                await self._send_terminal(outcome, deadline)
            if self._sender.broken:
                logger.warning("session %s: client did not take the last message", self.request_id)
        self._taps.call("ended", outcome.value, self._terminal())
        if not self._sender.broken:
            with trio.move_on_after(self._config.close_timeout):
                try:
                    await self._ws.aclose()
                except _ROUTINE_CLOSE_ERRORS as exc:
                    # The peer went or closed first: the close is done all the same. A
                    # client can cause this at will, so it is a line, never a traceback.
                    logger.debug("session %s: close: %r", self.request_id, exc)
        error = self._ending.error
        logger.info(
            "session %s ended: %s, %d chunks sent%s",
            self.request_id,
            outcome.value,
            self._delivery.chunks_sent,
            f" ({error[0].value}: {error[1]})" if error else "",
        )

    def _terminal(self) -> protocol.SessionDone | protocol.Error:
        return self._ending.terminal(self.request_id, self._delivery.chunks_sent)

    async def _send_terminal(self, outcome: Outcome, deadline: float) -> None:
        await self._sender.send(self._terminal(), deadline=deadline)
        if outcome is Outcome.STOPPED and self._stop_requested_at is not None:
            self._metrics.stopped(trio.current_time() - self._stop_requested_at)
