"""One session's blocking calls, and the engine stream it owns until the stream is closed.

A session runs two kinds of blocking work in worker threads:

* **its own** (encoder set-up, image decoding, an encoder's close) always returns:
  `SessionCalls.in_thread` waits for it, cancelled or not, on the server's own thread
  budget (``thread_limiter``), which the engine's calls never use: a call stuck for good
  keeps its thread's token, and stuck calls must never leave a session unable to open
  or close its encoder;
* **the engine's** may never return (a hung CUDA kernel, a stuck VAE decode, a GPU
  tensor's copy to the host: see `trio_vstream.scheduling.engine_calls`). `SessionCalls.call`
  stops waiting when cancelled and leaves the call behind (detached), with what its
  return must do: close the stream it was using, give back its step slot. The session
  waits for the calls it left when it can afford to (`wait_detached`: after a stop,
  within a step; at its end, for a close timeout), and hands those still running to
  the server's `AbandonedCalls` when it ends (`abandon_detached`), counted and logged
  until they return. So a call stuck outside a checkpoint holds neither the terminal
  message nor the drain. These run on the engine's own thread budget
  (``engine_limiter``).

The engine stream is closed exactly once, whoever closes it: the session
(`close_stream`, `close_stream_soon`), or a call left running, which takes the stream
with it and closes it as it returns (`next_chunk`). The server's counters
(``worker_threads``, ``streams_open``) follow each call and each close.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar, cast

import numpy as np
import outcome
import trio

from trio_vstream.engines.contract import (
    Chunk,
    DeferredFrames,
    Engine,
    EngineStream,
    GenerationRequest,
    release_frames,
)
from trio_vstream.engines.frames import audio_to_float32_array, frames_to_uint8_array
from trio_vstream.engines.interfaces import FollowsInput
from trio_vstream.logsafe import get_logger
from trio_vstream.media.encoding import EncodingAbandoned, FragmentedMP4Encoder
from trio_vstream.scheduling.checkpoint import SessionCheckpoint
from trio_vstream.scheduling.engine_calls import EngineCall
from trio_vstream.session.resources import ServerResources

logger = get_logger(__name__)

T = TypeVar("T")


class SessionCalls:
    """The worker-thread calls of one session, and its engine stream."""

    def __init__(self, resources: ServerResources) -> None:
        self._res = resources
        self.request_id: str | None = None
        """The session's, for the log (set once it has one)."""
        self.stream: EngineStream | None = None
        """The engine stream while the session owns it (None once closed, or handed to a
        call left running, which closes it when it returns)."""
        self.stream_closed_at: float | None = None
        """``time.monotonic()`` when the stream was closed (None: not yet, or never opened)."""
        self._detached: list[EngineCall[Any]] = []
        """Blocking calls the session stopped waiting for (see `call`)."""
        self._on_abandon: dict[EngineCall[Any], Callable[[], None]] = {}
        """What to tell when a detached call is abandoned (a step's checkpoint: its batch)."""

    # ------------------------------------------------------------ the engine

    async def open_stream(self, engine: Engine, request: GenerationRequest) -> EngineStream:
        """`Engine.open_stream`, as an engine call: the session owns the stream it opens.
        Cancelled, a stream opened after all is closed as soon as it is."""
        self.stream = await self.call(EngineCall(engine.open_stream, request), _close_opened)
        self._res.stats.streams_open += 1
        return self.stream

    async def next_chunk(
        self, stream: EngineStream, checkpoint: SessionCheckpoint, feed: np.ndarray | None = None
    ) -> Chunk | None:
        """The engine's next chunk. Cancelled while the engine still runs, the call keeps
        the stream and the step slot: it closes the one and gives back the other when it
        returns (the engine's step limit holds even for a stuck step).

        ``feed``: the chunk's input frames, for a stream that follows an input video,
        handed over in the same thread just before (`interfaces.FollowsInput`)."""
        if feed is None:
            call = EngineCall(stream.next_chunk, checkpoint)
        else:
            assert isinstance(stream, FollowsInput)
            call = EngineCall(_fed_chunk, stream, feed, checkpoint)

        def closed() -> None:
            checkpoint.release()
            self._stream_closed()

        def returned(result: outcome.Outcome[Chunk | None]) -> None:
            # A chunk made after the session stopped waiting is never sent: its deferred
            # frames are released (not decoded), then the stream is closed.
            _release_result(result, self.request_id)
            self._close_in_thread(stream)

        try:
            return await self.call(call, returned, closed)
        except trio.Cancelled:
            if call.started and not call.detached:
                # It returned just as the session was cancelled, too late to be left
                # behind and too late to be used: the chunk it made is nobody's.
                call.when_returned(lambda: _release_result(call.result, self.request_id))
            raise
        finally:
            # Read after the thread returned (a detached call's cost is not counted).
            self._res.stats.engine_cpu_seconds += call.cpu_seconds
            if call.detached:
                self.stream = None  # the call's now
                checkpoint.cancel()  # its waits for a slot or a batch end now
                self._on_abandon[call] = checkpoint.abandoned
            else:
                checkpoint.release()

    async def call(
        self,
        call: EngineCall[T],
        in_thread: Callable[[outcome.Outcome[T]], None] | None = None,
        in_trio: Callable[[], None] | None = None,
    ) -> T:
        """Run a blocking call that may never return (engine work, or a copy of its
        frames from the GPU) in a worker thread; cancelled, stop waiting at once.

        The call goes on in its thread and sees the cancellation at its next
        checkpoint, if it ever reaches one: it is detached, with what needs it to have
        returned (``in_thread``: close its stream, say; then ``in_trio``).
        """
        stats = self._res.stats
        stats.worker_threads += 1
        try:
            return await call.run(self._res.engine_limiter)
        except trio.Cancelled:
            self._detach(call, in_thread, in_trio)
            raise
        finally:
            stats.worker_threads -= 1

    def _detach(
        self,
        call: EngineCall[T],
        in_thread: Callable[[outcome.Outcome[T]], None] | None = None,
        in_trio: Callable[[], None] | None = None,
    ) -> bool:
        """`EngineCall.detach`, remembering the call; False if it is not running."""
        if not call.detach(in_thread, in_trio):
            return False
        self._detached.append(call)
        logger.debug("session %s: stopped waiting for %s", self.request_id, call.name)
        return True

    async def wait_detached(self) -> None:
        """Wait for the calls the session stopped waiting for to return (an engine that
        was only between checkpoints does, within a step). Unbounded: the caller bounds
        it, or cancels the session first (the stall guard does)."""
        for call in self._detached:
            await call.returned.wait()

    def abandon_detached(self, at_stop: bool = False) -> None:
        """The session ends: the calls still running are abandoned to their threads.

        Counted, and logged, until they return (``/metrics``, and ``/health`` says
        degraded meanwhile): a thread stuck outside a checkpoint is the engine's, and
        an operator should know the GPU may be wedged. ``at_stop``: the server stops
        without waiting for them (`AbandonedCalls.add`), so they are not known to hang.
        """
        abandoned = self._res.abandoned_calls
        for call in self._detached:
            if call.returned.is_set():
                continue
            if not at_stop and (on_abandon := self._on_abandon.get(call)) is not None:
                on_abandon()  # before it is counted: the server's wedge check sees both
            abandoned.add(call, partial(self._abandoned_call_returned, call), at_stop=at_stop)
            logger.warning(
                "session %s: %s still running as the session ends; left to finish in its "
                "thread (%d engine call(s) outstanding)",
                self.request_id,
                call.name,
                len(abandoned.running),
            )
        self._detached.clear()
        self._on_abandon.clear()

    def _abandoned_call_returned(self, call: EngineCall[Any]) -> None:
        logger.info(
            "session %s: abandoned %s returned (%d engine call(s) outstanding)",
            self.request_id,
            call.name,
            len(self._res.abandoned_calls.running),
        )

    # ------------------------------------------------------------- the close

    async def close_stream(self) -> None:
        """Close the engine stream, whatever happened, and wait for the close.

        The close starts at once, cancelled or not (``close`` is called exactly once per
        stream); a cancelled wait leaves it to finish in its thread, like any engine call
        the session stops waiting for.
        """
        call = self._start_close()
        if call is None:
            return
        stats = self._res.stats
        stats.worker_threads += 1
        try:
            await call.returned.wait()
        except trio.Cancelled:
            if not self._detach(call, in_trio=self._stream_closed):
                self._stream_closed()  # it returned just now
            raise
        finally:
            stats.worker_threads -= 1
        self._stream_closed()

    def close_stream_soon(self) -> None:
        """Start closing the engine stream if the session still owns it; don't wait."""
        call = self._start_close()
        if call is not None and not self._detach(call, in_trio=self._stream_closed):
            self._stream_closed()

    def _start_close(self) -> EngineCall[None] | None:
        stream, self.stream = self.stream, None
        if stream is None:
            return None
        call = EngineCall(self._close_in_thread, stream)
        call.start()
        return call

    def _close_in_thread(self, stream: EngineStream) -> None:
        """A stream's ``close``, in a worker thread: a failure is logged, never raised."""
        try:
            stream.close()
        except Exception:
            logger.exception("session %s: engine stream close failed", self.request_id)

    def _stream_closed(self) -> None:
        """Bookkeeping of a stream's close, in the Trio thread, whichever thread closed it."""
        self._res.stats.streams_open -= 1
        self.stream_closed_at = time.monotonic()
        logger.info("session %s: engine stream closed", self.request_id)

    # ----------------------------------------------------- the server's own

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work of the server's own (encoder set-up, image decoding) off
        the event loop.

        Never abandoned: if the session is cancelled, this waits for the thread to
        return. The engine's calls, which may block for good, go through `call`.
        """
        stats = self._res.stats
        stats.worker_threads += 1
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._res.thread_limiter)
        finally:
            stats.worker_threads -= 1

    async def close_encoder(self, encoder: FragmentedMP4Encoder, timeout: float) -> bool:
        """Close an encoder whose output nobody reads any more, waiting at most
        ``timeout`` seconds, cancelled or not; False if it was left closing in its thread.

        A session's last act, shielded so that even a session the server aborts frees
        its encoder; and bounded, since a shielded wait without a deadline could hold the
        server's exit for good (an x264 close returns in milliseconds, but a thread
        budget exhausted by a bug, or a wedged machine, must not hang the process).
        """
        stats = self._res.stats
        close = _CloseOnce(encoder)
        stats.worker_threads += 1
        try:
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + timeout
                await trio.to_thread.run_sync(
                    close, limiter=self._res.thread_limiter, abandon_on_cancel=True
                )
        finally:
            stats.worker_threads -= 1
        if scope.cancelled_caught:
            # The deadline may have come before a thread was free to start the close:
            # then it starts now in a thread of its own, outside the limiter, and is
            # never skipped (an encoder left open keeps its x264 threads).
            trio.lowlevel.start_thread_soon(close, lambda _result: None, name="encoder close")
            logger.warning(
                "session %s: the encoder did not close within %.1f s; left to close in its thread",
                self.request_id,
                timeout,
            )
            return False
        return True


def _close_opened(opened: outcome.Outcome[EngineStream]) -> None:
    """After an ``open_stream`` the session stopped waiting for: close what it opened."""
    if isinstance(opened, outcome.Value):
        try:
            opened.value.close()
        except Exception:
            logger.exception("engine stream close failed (opened after its session left)")


def encode_chunk(
    encoder: FragmentedMP4Encoder,
    chunk: Chunk,
    width: int,
    height: int,
    abandon: Callable[[], bool],
) -> tuple[int, int | None, bytes]:
    """A session's encode, in a worker thread: tensor to array, then H.264 (and AAC, for
    an engine that makes sound) into fMP4: its frame count, its audio sample count (None
    without sound) and bytes. An `EngineCall`: a GPU tensor's copy to the host may block
    for good on a hung kernel, and so may the decode of `DeferredFrames`, which runs here,
    right before the encode (the engine's thread denoises the next chunk meanwhile).

    A chunk's frames are released here whatever happens: decoded and encoded, abandoned,
    or failed. A session that ended before its chunk's decode began (``abandon``) decodes
    nothing: the decode is the engine's heavy work, for frames nobody will see.
    """
    try:
        if isinstance(chunk.frames, DeferredFrames) and abandon():
            raise EncodingAbandoned("the session ended before the chunk was decoded")
        frames = frames_to_uint8_array(chunk.frames, width=width, height=height)
    finally:
        release_frames(chunk.frames)
    if encoder.audio_sample_rate is None:
        return frames.shape[0], None, encoder.encode(frames, abandon=abandon)
    samples = encoder.audio_samples_for(frames.shape[0])
    audio = audio_to_float32_array(chunk.audio, channels=encoder.audio_channels, samples=samples)
    return frames.shape[0], samples, encoder.encode(frames, audio=audio, abandon=abandon)


def _release_result(result: outcome.Outcome[Chunk | None] | None, request_id: str | None) -> None:
    if isinstance(result, outcome.Value):
        release_chunk(result.value, request_id)


def release_chunk(chunk: Chunk | None, request_id: str | None) -> None:
    """Release a chunk the session drops (`release_frames`): what its `DeferredFrames`
    hold (latents on the device) is freed now, not when the chunk object goes. A failing
    ``release`` is the engine's bug, logged; the session goes on ending."""
    if chunk is None:
        return
    try:
        release_frames(chunk.frames)
    except Exception:
        logger.exception("session %s: releasing chunk %d's frames failed", request_id, chunk.index)


class _CloseOnce:
    """`close_quietly` for an encoder, run by whichever thread calls it first; later
    calls return at once. Two threads may be given the close (see `close_encoder`), and
    an encoder must not be closed by two at the same time."""

    def __init__(self, encoder: FragmentedMP4Encoder) -> None:
        self._encoder = encoder
        self._lock = threading.Lock()
        self._claimed = False

    def __call__(self) -> None:
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        close_quietly(self._encoder)


def close_quietly(encoder: FragmentedMP4Encoder) -> None:
    """Close an encoder whose output nobody reads any more (a session that failed or was
    left behind): a failure is a debug line, not the session's error."""
    try:
        encoder.close()
    except Exception:
        logger.debug("encoder close failed", exc_info=True)


def _fed_chunk(
    stream: FollowsInput, frames: np.ndarray, checkpoint: SessionCheckpoint
) -> Chunk | None:
    """A stream's input for its next chunk, then that chunk: one engine call, one thread."""
    stream.feed_input(frames)
    return cast(EngineStream, stream).next_chunk(checkpoint)
