"""The deliverer: each generated chunk encoded in a worker thread, then sent with its metadata.

The generation loop of a session (`trio_vstream.session.session`) is a producer and a
deliverer joined by a one-slot channel. This is the deliverer's half, and what it owns:
the session's encoder, its turn on the CPU, the ``video.chunk_metadata`` that goes with
every binary message (its counts of chunks and frames), and the encoder's trailer at the
end. None of it needs the session's nursery or its stall guard: it hears of progress and
of a failure through two callbacks, and of the session's ending through its `Ending`.

A chunk waits for its turn to encode (a server-wide limiter: unbounded, every session's
x264 would fight for the cores, and the event loop with them), and a paced session first
for its media time; a stop ends either wait (`Delivery.stop_waiting`), so a chunk whose
encoding has not started is dropped at once, while one being encoded or sent is finished.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import trio

from trio_vstream import protocol
from trio_vstream.engines.contract import Chunk
from trio_vstream.logsafe import get_logger
from trio_vstream.media.encoding import EncodingAbandoned, EncodingError, FragmentedMP4Encoder
from trio_vstream.outputs.taps import TapSet
from trio_vstream.protocol import ErrorCode
from trio_vstream.scheduling.engine_calls import EngineCall
from trio_vstream.session.calls import SessionCalls, close_quietly, encode_chunk, release_chunk
from trio_vstream.session.endings import (
    Ending,
    Outcome,
    SessionError,
    describe,
    engine_failure,
)
from trio_vstream.session.pacing import Pacer
from trio_vstream.session.resources import ServerResources
from trio_vstream.session.sending import Sender

# The session's logger: these are its lines, under the name they had in `session`.
logger = get_logger("trio_vstream.session.session")


class Delivery:
    """A session's chunks on their way out, and the encoder that makes their bytes.

    ``progress`` is the stall guard's clock (called at each chunk sent, and during a
    paced wait); ``fail`` ends the session gracefully with an error (`Session.stop`);
    ``stopping`` is read by the encoder's thread between frames.
    """

    def __init__(
        self,
        resources: ServerResources,
        calls: SessionCalls,
        sender: Sender,
        ending: Ending,
        *,
        progress: Callable[[], None],
        fail: Callable[[Outcome, SessionError], None],
        stopping: Callable[[], bool],
    ) -> None:
        self._res = resources
        self._config = resources.config
        self._metrics = resources.metrics
        self._calls = calls
        self._sender = sender
        self._ending = ending
        self._progress = progress
        self._fail = fail
        self._stopping = stopping
        self.request_id: str | None = None
        self.encoder: FragmentedMP4Encoder | None = None
        self.audio: tuple[int, int] | None = None
        """The stream's sound: (sample rate, channels); None for a stream without it."""
        self.input_frames: dict[int, protocol.InputFrameCounts] = {}
        """A session that follows an input video: each chunk's input counts, by its
        generation index, for its ``video.chunk_metadata`` (the generation loop fills it)."""
        self.taps = TapSet("", ())
        self.chunks_sent = 0
        self.frames_generated = 0
        self._size = (0, 0)
        self._fps = 1
        self._pacer: Pacer | None = None
        self._start_received_at = 0.0
        self._encode_wait = trio.CancelScope()
        self._init_segment = b""
        """The encoder's init segment, kept for taps (the encoder is gone by the trailer)."""

    def keep_encoder(self, encoder: FragmentedMP4Encoder) -> None:
        """The encoder the session's preparation opened: this delivery's from now on."""
        self.encoder = encoder
        rate = encoder.audio_sample_rate
        self.audio = (rate, encoder.audio_channels) if rate else None

    def started(
        self,
        request_id: str,
        taps: TapSet,
        size: tuple[int, int],
        fps: int,
        pacer: Pacer | None,
        start_received_at: float,
    ) -> None:
        """``video.start`` was sent: what every chunk from here is sent with."""
        self.request_id, self.taps = request_id, taps
        self._size, self._fps, self._pacer = size, fps, pacer
        self._start_received_at = start_received_at

    def stop_waiting(self) -> None:
        """The session stops: a chunk waiting for its turn to encode is dropped."""
        self._encode_wait.cancel()

    async def deliver(self, receive_chunks: trio.MemoryReceiveChannel[Chunk]) -> None:
        """Encode and send every chunk the producer makes, until its channel closes."""
        assert self.request_id is not None and self.encoder is not None
        encoder = self.encoder
        width, height = self._size
        async with receive_chunks:
            try:
                async for chunk in receive_chunks:
                    await self._deliver_chunk(chunk, encoder, width, height)
            finally:
                # The session ended with a chunk still waiting (a disconnect, a stall): it
                # is dropped, and what its deferred decode holds is freed now.
                while True:
                    try:
                        release_chunk(receive_chunks.receive_nowait(), self.request_id)
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break

    async def _deliver_chunk(
        self, chunk: Chunk, encoder: FragmentedMP4Encoder, width: int, height: int
    ) -> None:
        """Encode one chunk and send it, or drop it if the session ended.

        Its `DeferredFrames` are decoded in the encode's thread, just before the encode
        (`encode_chunk`, which releases them whatever happens); a chunk dropped before
        its encode call started is released here, and never decoded.
        """
        encoding: EngineCall[tuple[int, int | None, bytes]] | None = None
        try:
            waiting_since = trio.current_time()
            if not await self._take_encode_slot(self.frames_generated):
                logger.info(
                    "session %s: dropping generated chunk %d after %s",
                    self.request_id,
                    chunk.index,
                    self._ending.outcome.value if self._ending.outcome else "the end",
                )
                return
            encoding_since = trio.current_time()
            # A GPU tensor is copied to the host here, which a hung kernel blocks for good:
            # left behind, the call keeps the encoder and closes it when it returns.
            encoding = EngineCall(encode_chunk, encoder, chunk, width, height, self._stopping)
            try:
                frames, audio_samples, data = await self._calls.call(
                    encoding, lambda _result: close_quietly(encoder)
                )
            except EncodingAbandoned:
                logger.info(
                    "session %s: dropped chunk %d mid-encode after %s",
                    self.request_id,
                    chunk.index,
                    self._ending.outcome.value if self._ending.outcome else "the end",
                )
                return
            except Exception as exc:
                logger.exception("session %s: chunk %d failed", self.request_id, chunk.index)
                if isinstance(exc, EncodingError):
                    error = (ErrorCode.ENCODING_FAILED, describe(exc))
                else:
                    error = engine_failure(exc, "converting its frames", self.request_id)
                self._fail(Outcome.FAILED, error)
                return
            finally:
                if encoding.detached:
                    self.encoder = None  # the call's now
                # Even for a call left behind: blocked on a device, it uses no CPU.
                self._res.encode_limiter.release_on_behalf_of(self)
        finally:
            if encoding is None or not encoding.started:
                release_chunk(chunk, self.request_id)
        now = trio.current_time()
        self._metrics.chunk_encoded(now - encoding_since, encoding_since - waiting_since)
        self.frames_generated += frames
        await self._send_chunk("media", frames, data, chunk, audio_samples=audio_samples)
        self._progress()

    async def _take_encode_slot(self, first_frame: int) -> bool:
        """Wait for a turn to encode; False, holding nothing, if the session ended meanwhile.

        Encoders share the CPU through a server-wide limiter: unbounded, every session's
        x264 would fight for the cores, and the event loop with them. A paced session
        first waits for its chunk's media time. A stop ends either wait, so a chunk
        whose encoding has not started is dropped at once.
        """
        if self._ending.drops_chunks:
            return False
        limiter = self._res.encode_limiter
        with trio.CancelScope() as self._encode_wait:
            if self._pacer is not None:  # its wait is progress for the stall guard
                await self._pacer.wait(
                    first_frame / self._fps, self._progress, self._config.stall_timeout / 2
                )
            await limiter.acquire_on_behalf_of(self)
        if self._encode_wait.cancelled_caught:
            return False
        if self._ending.drops_chunks:  # stopped just as the slot came
            limiter.release_on_behalf_of(self)
            return False
        return True

    async def send_trailer(self, trailer: bytes, deadline: float) -> None:
        """The encoder's last bytes (an index box, no frames), after a completed video."""
        await self._send_chunk("trailer", 0, trailer, None, deadline=deadline)

    async def _send_chunk(
        self,
        kind: Literal["media", "trailer"],
        frames: int,
        data: bytes,
        chunk: Chunk | None,
        *,
        deadline: float | None = None,
        audio_samples: int | None = None,
    ) -> None:
        assert self.request_id is not None
        metadata = protocol.ChunkMetadata(
            request_id=self.request_id,
            kind=kind,
            num_frames=frames,
            byte_length=len(data),
            generation_chunk_index=chunk.index if chunk is not None else None,
            started_event_ids=chunk.started_event_ids if chunk is not None else (),
            active_event_ids=chunk.active_event_ids if chunk is not None else (),
            completed_event_ids=chunk.completed_event_ids if chunk is not None else (),
            transport_chunk_index=self.chunks_sent,
            # With sound: the samples of this chunk's frames (the container may carry some
            # in the next chunk; a trailer covers none, though it carries the last ones).
            num_audio_samples=(audio_samples or 0) if self.audio else None,
            audio_sample_rate=self.audio[0] if self.audio else None,
            input_frames=self.input_frames.pop(chunk.index, None) if chunk is not None else None,
        )
        await self._sender.send(metadata, data, deadline=deadline)
        if self.taps:
            if not self._init_segment and self.encoder is not None:
                self._init_segment = self.encoder.init_segment or b""
            self.taps.call("chunk", metadata, data, self._init_segment)
        if kind == "media" and self.chunks_sent == 0:
            self._metrics.first_chunk_sent(trio.current_time() - self._start_received_at)
        self._metrics.chunk_sent(frames, len(data))
        self.chunks_sent += 1
        self._res.stats.chunks_sent += 1

    async def finish_encoder(self) -> bytes | None:
        """The encoder's final bytes, or None if it fails: the session then failed."""
        encoder, self.encoder = self.encoder, None
        if encoder is None:
            return b""
        try:
            return await self._calls.in_thread(encoder.close)
        except Exception as exc:
            logger.exception("session %s: encoder failed to finish", self.request_id)
            self._ending.fail_after_all((ErrorCode.ENCODING_FAILED, describe(exc)))
            return None

    async def close_encoder(self) -> None:
        """The session is over: an encoder still open is closed, within a close timeout."""
        encoder, self.encoder = self.encoder, None
        if encoder is not None:  # shielded, within a close timeout
            await self._calls.close_encoder(encoder, self._config.close_timeout)
