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
  progress (a chunk generated or sent, a client ping) pushes back; when it
  expires the session is aborted.

How a session ends decides what is cancelled. A stop, an engine failure or a
graceful shutdown cancels only the producer (the engine sees it at its next
checkpoint, within one step); the deliverer finishes the chunk it is sending,
so the socket stays usable for the terminal message. A
disconnect or a stall aborts everything, including a send stuck on a client
that does not read. Sends are otherwise shielded: a cancelled half-written
WebSocket frame would corrupt the stream, so a send is only ever interrupted
on purpose, and then the socket is marked broken and left alone.

Every session the client did not abandon ends with exactly one terminal
message (``session.done`` or ``error``) and a normal close.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import attrs
import numpy as np
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from trio_vstream import protocol
from trio_vstream.encoding import EncodingError, FragmentedMP4Encoder, decode_image
from trio_vstream.engines.base import (
    Chunk,
    Engine,
    EngineStream,
    GenerationRequest,
    InvalidRequestError,
    PromptChange,
    frames_to_uint8_array,
)
from trio_vstream.protocol import ErrorCode

logger = logging.getLogger(__name__)

T = TypeVar("T")


@attrs.frozen(kw_only=True)
class SessionConfig:
    """Per-session timeouts and limits (the reference's defaults)."""

    start_timeout: float = 10.0
    stall_timeout: float = 60.0
    close_timeout: float = 5.0
    """How long to wait for a last message to go out and for the client's close reply."""
    limits: protocol.Limits = protocol.DEFAULT_LIMITS
    served_model: str | None = None


class Outcome(enum.Enum):
    """How a session ended; decides its terminal message."""

    COMPLETED = "completed"
    STOPPED = "stopped"
    SHUTDOWN = "shutdown"
    STALLED = "stalled"
    FAILED = "failed"
    DISCONNECTED = "disconnected"
    REJECTED = "rejected"
    """Never started streaming: bad or missing session.start."""


@attrs.define
class SessionStats:
    """Counters shared by every session of a server, read by tests, logs and benchmarks."""

    sessions_active: int = 0
    streams_open: int = 0
    worker_threads: int = 0
    sessions_total: int = 0
    chunks_sent: int = 0


@attrs.frozen(kw_only=True)
class SessionSummary:
    """What one finished session did; handed to the server's ``on_session_end`` hook."""

    request_id: str | None
    outcome: Outcome
    chunks_sent: int
    frames_generated: int
    error_code: str | None
    started_at: float
    """``time.monotonic()`` when the connection's session began."""
    stream_closed_at: float | None
    """When the engine stream was closed (None: the session never opened one)."""
    ended_at: float


class _StepGate:
    """The ``checkpoint`` an engine calls between steps, from its worker thread.

    It raises ``trio.Cancelled`` once the producer is cancelled, which is what
    stops the engine within one step. With an engine step limit it also hands
    the engine's step slots round fairly: a session that holds a slot gives it
    up at every checkpoint where another session is waiting, and
    ``trio.CapacityLimiter`` serves waiters first come, first served.
    """

    def __init__(self, limiter: trio.CapacityLimiter | None) -> None:
        self._limiter = limiter
        self._holding = False

    def __call__(self) -> None:
        trio.from_thread.check_cancelled()
        if self._limiter is not None:
            # The limiter is only touched from the Trio thread: one round trip per step,
            # small beside a denoising step.
            trio.from_thread.run(self._take_turn)

    async def _take_turn(self) -> None:
        assert self._limiter is not None
        if self._holding:
            if self._limiter.statistics().tasks_waiting == 0:
                return
            self._limiter.release_on_behalf_of(self)
            self._holding = False
        await self._limiter.acquire_on_behalf_of(self)
        self._holding = True

    def release(self) -> None:
        """Give the slot back when the engine call returns (from the Trio thread)."""
        if self._holding and self._limiter is not None:
            self._limiter.release_on_behalf_of(self)
            self._holding = False


class _SocketBroken(Exception):
    """A send was interrupted mid-frame; nothing more can be written."""


class _Failure(Exception):
    """Ends the session with an ``error`` message (a request or engine problem)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@attrs.frozen
class ServerResources:
    """What a session borrows from the server."""

    engine: Engine
    config: SessionConfig
    stats: SessionStats
    step_limiter: trio.CapacityLimiter | None
    thread_limiter: trio.CapacityLimiter
    encode_limiter: trio.CapacityLimiter


class Session:
    """One WebSocket connection's session. ``await Session(...).run()``, once."""

    def __init__(self, ws: WebSocketConnection, resources: ServerResources) -> None:
        self._ws = ws
        self._res = resources
        self._config = resources.config
        self.request_id: str | None = None
        self.outcome: Outcome | None = None
        self._error: tuple[ErrorCode, str] | None = None
        self._send_lock = trio.Lock()
        self._active_sends: set[trio.CancelScope] = set()
        self._broken = False
        self._session_scope = trio.CancelScope()
        self._streaming = False
        self._producer_scope = trio.CancelScope()
        self._encode_wait = trio.CancelScope()
        self._progress = trio.Event()
        self._stream: EngineStream | None = None
        self._encoder: FragmentedMP4Encoder | None = None
        self._gate = _StepGate(resources.step_limiter)
        self._event_ids: set[str] = set()
        self._chunks_sent = 0
        self._frames_generated = 0
        self._started_at = time.monotonic()
        self._size = (0, 0)
        self._stream_closed_at: float | None = None

    # ----------------------------------------------------------------- entry

    async def run(self) -> SessionSummary:
        """Serve the session to its end. Raises only on outer cancellation."""
        stats = self._res.stats
        stats.sessions_active += 1
        stats.sessions_total += 1
        try:
            with self._session_scope:
                try:
                    await self._run()
                except _Failure as failure:  # a failure before streaming began
                    self._end(Outcome.FAILED, (failure.code, failure.message))
                except Exception:
                    logger.exception("session %s: internal error", self.request_id)
                    self._end(Outcome.FAILED, (ErrorCode.INTERNAL_ERROR, "Internal server error"))
            await self._close_stream()
            await self._finish()
        finally:
            with trio.CancelScope(shield=True):
                await self._close_stream()
                encoder, self._encoder = self._encoder, None
                if encoder is not None:
                    await self._in_thread(_close_quietly, encoder)
            stats.sessions_active -= 1
        return self.summary()

    def summary(self) -> SessionSummary:
        outcome = self.outcome or Outcome.FAILED
        return SessionSummary(
            request_id=self.request_id,
            outcome=outcome,
            chunks_sent=self._chunks_sent,
            frames_generated=self._frames_generated,
            error_code=self._error[0].value if self._error else None,
            started_at=self._started_at,
            stream_closed_at=self._stream_closed_at,
            ended_at=time.monotonic(),
        )

    def stop(
        self, outcome: Outcome = Outcome.STOPPED, error: tuple[ErrorCode, str] | None = None
    ) -> None:
        """End the session gracefully: the engine stops at its next checkpoint, the
        chunk being sent is finished, and the stream is closed properly."""
        if self._end(outcome, error):
            self._producer_scope.cancel()
            self._encode_wait.cancel()

    def abort(self, outcome: Outcome, error: tuple[ErrorCode, str] | None = None) -> None:
        """End the session now, interrupting even a send stuck on the socket."""
        self._end(outcome, error)
        self._producer_scope.cancel()
        self._session_scope.cancel()
        for scope in self._active_sends:
            scope.cancel()

    def shutdown(self) -> None:
        """The server is going away: streaming sessions wind down, others end at once."""
        error = (ErrorCode.SERVER_SHUTDOWN, "Server is shutting down")
        if self._streaming:
            self.stop(Outcome.SHUTDOWN, error)
        else:
            self.abort(Outcome.SHUTDOWN, error)

    def _end(self, outcome: Outcome, error: tuple[ErrorCode, str] | None = None) -> bool:
        """Record the first reason the session ends; later ones change nothing."""
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self._error = error
        return True

    # ----------------------------------------------------------- the session

    async def _run(self) -> None:
        start = await self._receive_start()
        if start is None:
            return
        self.request_id = f"video_stream-{uuid.uuid4().hex}"
        request = await self._prepare(start)
        await self._send(
            protocol.VideoStart(self.request_id, start.format, self._config_echo(start))
        )
        self._touch()
        logger.info(
            "session %s started: %dx%d, %d frames at %d fps",
            self.request_id,
            request.width,
            request.height,
            request.num_frames,
            request.fps,
        )
        self._streaming = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_loop)
            nursery.start_soon(self._stall_guard)
            await self._generate()
            nursery.cancel_scope.cancel()
        if self.outcome is None:
            self._end(Outcome.COMPLETED)

    async def _receive_start(self) -> protocol.SessionStart | None:
        with trio.move_on_after(self._config.start_timeout) as timeout:
            try:
                raw = await self._ws.get_message()
            except ConnectionClosed:
                self._end(Outcome.DISCONNECTED)
                return None
        if timeout.cancelled_caught:
            raise _Failure(ErrorCode.START_TIMEOUT, "Timeout waiting for session.start")
        try:
            start = protocol.parse_start(
                raw,
                limits=self._config.limits,
                served_model=self._config.served_model,
                defaults=self._res.engine.video_defaults,
            )
        except protocol.ProtocolError as exc:
            self._end(Outcome.REJECTED, (exc.code, exc.message))
            return None
        return start

    def _config_echo(self, start: protocol.SessionStart) -> dict[str, Any]:
        """The request as used: with the engine's seed when the client chose none."""
        seed = getattr(self._stream, "seed", None)
        if "seed" in start.config or not isinstance(seed, int) or isinstance(seed, bool):
            return start.config
        return {**start.config, "seed": seed}

    async def _prepare(self, start: protocol.SessionStart) -> GenerationRequest:
        """Decode inputs, open the encoder and the engine stream: every check before video.start."""
        request = start.request
        video = start.video
        self._size = (video.width, video.height)
        extra = dict(request.extra_params or {})
        codec_options = extra.pop("video_codec_options", None)
        image: np.ndarray | None = None
        if start.image is not None:
            try:
                image = await self._in_thread(decode_image, start.image.data)
            except EncodingError as exc:
                raise _Failure(
                    ErrorCode.INVALID_REQUEST, f"Invalid session.start: image_reference: {exc}"
                ) from exc
        options = {str(k): str(v) for k, v in (codec_options or {}).items()}
        try:
            self._encoder = await self._in_thread(
                lambda: FragmentedMP4Encoder(
                    width=video.width, height=video.height, fps=video.fps, codec_options=options
                )
            )
        except EncodingError as exc:
            raise _Failure(
                ErrorCode.INVALID_REQUEST,
                f"Invalid session.start: extra_params.video_codec_options: {exc}",
            ) from exc
        assert self.request_id is not None
        generation_request = GenerationRequest(
            request_id=self.request_id,
            prompt=request.prompt,
            width=video.width,
            height=video.height,
            fps=video.fps,
            num_frames=video.num_frames,
            negative_prompt=request.negative_prompt,
            num_inference_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale,
            guidance_scale_2=request.guidance_scale_2,
            true_cfg_scale=request.true_cfg_scale,
            boundary_ratio=request.boundary_ratio,
            flow_shift=request.flow_shift,
            seed=request.seed,
            quality=request.quality,
            image=image,
            lora=request.lora,
            extra_params=extra,
        )
        try:
            self._stream = await self._in_thread(self._res.engine.open_stream, generation_request)
        except InvalidRequestError as exc:
            raise _Failure(ErrorCode.INVALID_REQUEST, f"Invalid session.start: {exc}") from exc
        except Exception as exc:
            logger.exception("session %s: engine could not open a stream", self.request_id)
            raise _Failure(ErrorCode.GENERATION_FAILED, _describe(exc)) from exc
        self._res.stats.streams_open += 1
        return generation_request

    # --------------------------------------------------------- receive loop

    async def _receive_loop(self) -> None:
        while True:
            try:
                raw = await self._ws.get_message()
            except ConnectionClosed:
                logger.info("session %s: client disconnected", self.request_id)
                self.abort(Outcome.DISCONNECTED)
                return
            try:
                message = protocol.parse_control(raw, limits=self._config.limits)
            except protocol.ProtocolError as exc:
                await self._send_error(exc.code, exc.message, event_id=exc.event_id)
                continue
            if isinstance(message, protocol.Stop):
                logger.info("session %s: stop requested", self.request_id)
                self.stop()
                # Keep reading: a client may still ping while the stream winds down.
            elif isinstance(message, protocol.Ping):
                self._touch()
                await self._send(protocol.Pong())
            else:
                await self._interact(message)

    async def _interact(self, message: protocol.Interaction) -> None:
        assert self.request_id is not None
        event_id = message.event_id
        if event_id in self._event_ids:
            await self._send_error(
                ErrorCode.EVENT_ID_CONFLICT, "event_id_conflict", event_id=event_id
            )
            return
        if self._stream is None:  # generation is over; nothing can take the change
            await self._send_error(
                ErrorCode.INTERACTION_FAILED, "Failed to apply interaction", event_id=event_id
            )
            return
        self._event_ids.add(event_id)
        try:
            self._stream.interact(PromptChange(event_id, message.prompt, message.transition_chunks))
        except Exception:
            logger.exception("session %s: failed to apply interaction", self.request_id)
            self._event_ids.discard(event_id)
            await self._send_error(
                ErrorCode.INTERACTION_FAILED, "Failed to apply interaction", event_id=event_id
            )
            return
        await self._send(protocol.InteractionQueued(self.request_id, event_id))

    # ---------------------------------------------------------- stall guard

    def _touch(self) -> None:
        """Progress happened: restart the stall clock."""
        self._progress.set()
        self._progress = trio.Event()

    async def _stall_guard(self) -> None:
        while True:
            progress = self._progress
            with trio.move_on_after(self._config.stall_timeout):
                await progress.wait()
                continue
            logger.warning(
                "session %s: no progress for %.1f s, aborting",
                self.request_id,
                self._config.stall_timeout,
            )
            self.abort(
                Outcome.STALLED, (ErrorCode.STALL_TIMEOUT, "Stall timeout: no generation progress")
            )
            return

    # ------------------------------------------------------ generation loop

    async def _generate(self) -> None:
        send_chunks, receive_chunks = trio.open_memory_channel[Chunk](1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._produce, send_chunks)
            await self._deliver(receive_chunks)

    async def _produce(self, send_chunks: trio.MemorySendChannel[Chunk]) -> None:
        assert self._stream is not None
        stream = self._stream
        async with send_chunks:
            try:
                with self._producer_scope:
                    await self._generate_chunks(stream, send_chunks)
            finally:
                # The engine is done with this session: free the model's memory now,
                # not after the last chunk has been encoded and sent.
                await self._close_stream()

    async def _generate_chunks(
        self, stream: EngineStream, send_chunks: trio.MemorySendChannel[Chunk]
    ) -> None:
        while True:
            try:
                chunk = await self._in_thread(stream.next_chunk, self._gate)
            except trio.Cancelled:
                raise
            except Exception as exc:
                logger.exception("session %s: engine failed while generating", self.request_id)
                self.stop(Outcome.FAILED, (ErrorCode.GENERATION_FAILED, _describe(exc)))
                return
            finally:
                self._gate.release()
            if chunk is None:
                return
            self._touch()
            await send_chunks.send(chunk)

    async def _deliver(self, receive_chunks: trio.MemoryReceiveChannel[Chunk]) -> None:
        assert self.request_id is not None and self._encoder is not None
        encoder = self._encoder
        width, height = self._size
        async with receive_chunks:
            async for chunk in receive_chunks:
                if not await self._take_encode_slot():
                    logger.info(
                        "session %s: dropping generated chunk %d after %s",
                        self.request_id,
                        chunk.index,
                        self.outcome.value if self.outcome else "the end",
                    )
                    continue
                try:
                    frames, data = await self._in_thread(
                        _encode_chunk, encoder, chunk, width, height
                    )
                except Exception as exc:
                    logger.exception("session %s: chunk %d failed", self.request_id, chunk.index)
                    code = (
                        ErrorCode.ENCODING_FAILED
                        if isinstance(exc, EncodingError)
                        else ErrorCode.GENERATION_FAILED
                    )
                    self.stop(Outcome.FAILED, (code, _describe(exc)))
                    continue
                finally:
                    self._res.encode_limiter.release_on_behalf_of(self)
                self._frames_generated += frames
                await self._send_chunk("media", frames, data, chunk)
                self._touch()

    async def _take_encode_slot(self) -> bool:
        """Wait for a turn to encode; False, holding nothing, if the session ended meanwhile.

        Encoders share the CPU through a server-wide limiter: unbounded, every session's
        x264 would fight for the cores, and the event loop with them. A stop ends the
        wait, so a chunk whose encoding has not started is dropped at once.
        """
        if self.outcome is not None:
            return False
        limiter = self._res.encode_limiter
        with trio.CancelScope() as self._encode_wait:
            await limiter.acquire_on_behalf_of(self)
        if self._encode_wait.cancelled_caught:
            return False
        if self.outcome is not None:  # stopped just as the slot came
            limiter.release_on_behalf_of(self)
            return False
        return True

    async def _send_chunk(self, kind: str, frames: int, data: bytes, chunk: Chunk | None) -> None:
        assert self.request_id is not None
        metadata = protocol.ChunkMetadata(
            request_id=self.request_id,
            kind=kind,  # type: ignore[arg-type]
            num_frames=frames,
            byte_length=len(data),
            generation_chunk_index=chunk.index if chunk is not None else None,
            started_event_ids=chunk.started_event_ids if chunk is not None else (),
            active_event_ids=chunk.active_event_ids if chunk is not None else (),
            completed_event_ids=chunk.completed_event_ids if chunk is not None else (),
            transport_chunk_index=self._chunks_sent,
        )
        await self._send(metadata, data)
        self._chunks_sent += 1
        self._res.stats.chunks_sent += 1

    # --------------------------------------------------------------- ending

    async def _finish(self) -> None:
        """Send the one terminal message, then close the WebSocket normally."""
        outcome = self.outcome
        if outcome is None:  # defensive: _run returned without deciding
            outcome = Outcome.FAILED
            self._end(outcome, (ErrorCode.INTERNAL_ERROR, "session ended unexpectedly"))
        if outcome is not Outcome.DISCONNECTED and not self._broken:
            with trio.move_on_after(self._config.close_timeout) as deadline:
                with contextlib.suppress(ConnectionClosed, _SocketBroken):
                    await self._send_terminal(outcome)
            if deadline.cancelled_caught:
                logger.warning("session %s: client did not take the last message", self.request_id)
        with trio.move_on_after(self._config.close_timeout):
            await self._ws.aclose()
        logger.info(
            "session %s ended: %s, %d chunks sent%s",
            self.request_id,
            outcome.value,
            self._chunks_sent,
            f" ({self._error[0].value}: {self._error[1]})" if self._error else "",
        )

    async def _send_terminal(self, outcome: Outcome) -> None:
        # Like the reference, only a completed stream gets the encoder's trailer: after
        # a stop it would be an extra message, and it carries no frames (an index box).
        if outcome is Outcome.COMPLETED:
            trailer = await self._close_encoder()
            if trailer is None:
                outcome = Outcome.FAILED
            elif trailer:
                await self._send_chunk("trailer", 0, trailer, None)
        if outcome in (Outcome.COMPLETED, Outcome.STOPPED):
            assert self.request_id is not None
            await self._send(
                protocol.SessionDone(self.request_id, self._chunks_sent, outcome is Outcome.STOPPED)
            )
        else:
            code, message = self._error or (ErrorCode.INTERNAL_ERROR, "internal error")
            await self._send_error(code, message)

    async def _close_encoder(self) -> bytes | None:
        """The encoder's final bytes, or None (and an error recorded) if it fails."""
        encoder, self._encoder = self._encoder, None
        if encoder is None:
            return b""
        try:
            return await self._in_thread(encoder.close)
        except Exception as exc:
            logger.exception("session %s: encoder failed to finish", self.request_id)
            self._error = (ErrorCode.ENCODING_FAILED, _describe(exc))
            return None

    async def _close_stream(self) -> None:
        """Close the engine stream, whatever happened. Never abandoned."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        with trio.CancelScope(shield=True):
            try:
                await self._in_thread(stream.close)
            except Exception:
                logger.exception("session %s: engine stream close failed", self.request_id)
            finally:
                self._res.stats.streams_open -= 1
                self._stream_closed_at = time.monotonic()
        logger.info("session %s: engine stream closed", self.request_id)

    # ---------------------------------------------------------------- sends

    async def _send_error(
        self, code: ErrorCode, message: str, *, event_id: str | None = None
    ) -> None:
        await self._send(
            protocol.Error(code, message, request_id=self.request_id, event_id=event_id)
        )

    async def _send(self, *messages: Any) -> None:
        """Send messages back to back, never interleaved with another task's.

        The write is shielded so that ordinary cancellation (a stop, the end
        of the receive loop) never cuts a frame in half; only ``abort`` cancels
        it, and then the socket is marked broken. The shield's own deadline is
        the last resort against a peer that never reads.
        """
        async with self._send_lock:
            if self._broken:
                await self._unwind()
            with trio.CancelScope(
                shield=True, deadline=trio.current_time() + self._config.stall_timeout
            ) as scope:
                self._active_sends.add(scope)
                try:
                    for message in messages:
                        data = message if isinstance(message, bytes) else message.to_json()
                        await self._ws.send_message(data)
                finally:
                    self._active_sends.discard(scope)
            if scope.cancelled_caught:
                self._broken = True
                await self._unwind()

    async def _unwind(self) -> NoReturn:
        """After an interrupted send: make sure the session is aborted, and leave."""
        self.abort(
            Outcome.STALLED, (ErrorCode.STALL_TIMEOUT, "Stall timeout: no generation progress")
        )  # a no-op for the outcome when the session already ended some other way
        await trio.lowlevel.checkpoint()  # raises Cancelled inside the session scope
        raise _SocketBroken  # outside it (while finishing), the caller gives up quietly

    # -------------------------------------------------------------- threads

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work (engine, encoder, image decoding) off the event loop.

        Never abandoned: if the session is cancelled, this waits for the
        thread to return (engines see the cancellation at their checkpoint).
        """
        stats = self._res.stats
        stats.worker_threads += 1
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._res.thread_limiter)
        finally:
            stats.worker_threads -= 1


def _encode_chunk(
    encoder: FragmentedMP4Encoder, chunk: Chunk, width: int, height: int
) -> tuple[int, bytes]:
    """Worker-thread part of delivery: tensor to array, then H.264 into fMP4."""
    frames = frames_to_uint8_array(chunk.frames, width=width, height=height)
    return frames.shape[0], encoder.encode(frames)


def _close_quietly(encoder: FragmentedMP4Encoder) -> None:
    try:
        encoder.close()
    except Exception:
        logger.debug("encoder close failed", exc_info=True)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return text if text else type(exc).__name__
