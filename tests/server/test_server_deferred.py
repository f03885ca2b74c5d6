"""Deferred decode end to end (`DeferredFrames`): the server decodes a chunk in its encode
thread after ``next_chunk`` returned, while the engine makes the next chunk, one chunk at
a time in chunk order; the video is the eager one's; and a chunk that will not be sent
(a stop, a disconnect, a call left behind) is released, never decoded.

The engine here records what the server did to each chunk's frames. No sleeps: the
engine's threads wait on events the server's own actions set, each with a timeout that
only a broken server reaches (the test then fails on what the engine recorded)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from tests.conftest import Transcript, decode_video, is_type, receive_into, receive_until
from tests.instrumented import InstrumentedEngine, InstrumentedStream
from trio_vstream.client._mp4 import decode_audio
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest
from trio_vstream.engines.synthetic import SyntheticSettings

START = {"type": "session.start", "prompt": "a red circle moving left", "size": "64x48", "fps": 8}
WAIT = 10.0
"""How long an engine thread waits for the server's next move before recording that it
never came (a broken server; the test then fails on the record, not on a hang)."""


class RecordedFrames:
    """A chunk's frames, held back for the server to decode, recording what it did."""

    def __init__(self, engine: DeferringEngine, stream: DeferringStream, chunk: Chunk) -> None:
        self._engine = engine
        self._stream = stream
        self.index = chunk.index
        self._frames: np.ndarray | None = chunk.frames
        self.shape = chunk.frames.shape

    def decode(self) -> np.ndarray:
        engine = self._engine
        engine.record("decode", self.index)
        with engine.lock:
            engine.decoding += 1
            engine.most_decoding = max(engine.most_decoding, engine.decoding)
            engine.decode_threads[self.index] = threading.get_ident()
        try:
            engine.before_decode(self._stream, self.index)
            assert self._frames is not None, "decoded after release"
            return self._frames
        finally:
            with engine.lock:
                engine.decoding -= 1
            self._stream.decoded[self.index].set()

    def release(self) -> None:
        self._engine.record("release", self.index)
        self._frames = None


class DeferringStream(InstrumentedStream):
    def __init__(self, engine: DeferringEngine, inner: Any) -> None:
        super().__init__(engine, inner)
        self.deferring = engine
        self.decoded: dict[int, threading.Event] = {}
        self.closed_event = threading.Event()
        self.next_chunk_threads: dict[int, int] = {}
        self.overlapped: dict[int, bool] = {}
        """Chunk k >= 1: whether chunk k-1 was decoded while ``next_chunk`` made chunk k."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        made = len(self.decoded)
        if made >= 1 and self.deferring.wait_for_previous_decode:
            # Chunk k's call waits for chunk k-1's decode: only a server that decodes
            # off the step path, while this call runs, lets it go on in time.
            self.overlapped[made] = self.decoded[made - 1].wait(WAIT)
        chunk = super().next_chunk(checkpoint)
        if chunk is None:
            return None
        self.decoded[chunk.index] = threading.Event()
        self.next_chunk_threads[chunk.index] = threading.get_ident()
        self.deferring.record("made", chunk.index)
        self.deferring.after_chunk(self, chunk.index)
        return Chunk(
            frames=RecordedFrames(self.deferring, self, chunk),
            index=chunk.index,
            started_event_ids=chunk.started_event_ids,
            active_event_ids=chunk.active_event_ids,
            completed_event_ids=chunk.completed_event_ids,
            audio=chunk.audio,
        )

    def close(self) -> None:
        super().close()
        self.closed_event.set()


class DeferringEngine(InstrumentedEngine):
    wait_for_previous_decode = False
    hold_first_decode = False
    """Chunk 0's decode waits for its stream's close (a session ending meanwhile)."""
    hold_chunk: int | None = None
    """This chunk's ``next_chunk`` blocks after its last checkpoint until ``unhold``."""

    def __init__(self, settings: SyntheticSettings) -> None:
        super().__init__(settings)
        self.events: list[tuple[str, int]] = []
        self.decoding = 0
        self.most_decoding = 0
        self.decode_threads: dict[int, int] = {}
        self.unhold = threading.Event()
        self.held = threading.Event()

    def open_stream(self, request: GenerationRequest) -> DeferringStream:  # type: ignore[override]
        stream = DeferringStream(self, super(InstrumentedEngine, self).open_stream(request))
        self.streams.append(stream)
        return stream

    def record(self, what: str, index: int) -> None:
        with self.lock:
            self.events.append((what, index))

    def indices(self, what: str) -> list[int]:
        with self.lock:
            return [index for kind, index in self.events if kind == what]

    def before_decode(self, stream: DeferringStream, index: int) -> None:
        if self.hold_first_decode and index == 0:
            stream.closed_event.wait(WAIT)

    def after_chunk(self, stream: DeferringStream, index: int) -> None:
        if index == self.hold_chunk:
            self.held.set()
            self.unhold.wait(WAIT)  # outside any checkpoint: the session stops waiting


def engine_class(**attributes: object) -> type[DeferringEngine]:
    return type("Deferring", (DeferringEngine,), attributes)


def frames_of(transcript: Transcript) -> np.ndarray:
    return decode_video(transcript.video_bytes)


async def test_decode_runs_after_next_chunk_overlapping_the_next_chunk_in_order(
    start_server: Callable[..., Any],
) -> None:
    settings = SyntheticSettings(chunk_frames=4)
    running = await start_server(settings, engine_class=engine_class(wait_for_previous_decode=True))
    transcript = await running.run_session({**START, "num_frames": 18})
    assert transcript.terminal[0]["type"] == "session.done", transcript.terminal
    engine = running.engine
    stream = engine.streams[0]
    # Chunk k's next_chunk went on only once chunk k-1 was decoded, in another thread.
    assert stream.overlapped == {1: True, 2: True, 3: True, 4: True, 5: True}
    assert all(engine.decode_threads[k] != stream.next_chunk_threads[k + 1] for k in range(4))
    # Decoded one at a time, in chunk order, each once, each after it was made; released.
    assert engine.indices("decode") == [0, 1, 2, 3, 4]
    assert engine.most_decoding == 1
    events = engine.events
    assert all(events.index(("made", k)) < events.index(("decode", k)) for k in range(5))
    assert sorted(set(engine.indices("release"))) == [0, 1, 2, 3, 4]

    # The same video as the engine's frames sent eagerly.
    eager = await start_server(settings)
    plain = await eager.run_session({**START, "num_frames": 18})
    np.testing.assert_array_equal(frames_of(transcript), frames_of(plain))
    assert frames_of(transcript).shape[0] == 18


async def stream_until_a_decode_is_pending(running: Any, ws: Any) -> None:
    """Start a long session whose chunk 0 decode waits for its stream's close, and wait
    until the engine has made three chunks: 0 being decoded, 1 waiting to be encoded,
    2 waiting to be handed over (the producer is blocked on the full channel)."""
    transcript = Transcript()
    await ws.send_message(json.dumps({**START, "num_frames": 800}))
    await receive_until(ws, transcript, is_type("video.start"))
    assert await trio.to_thread.run_sync(running.engine.wait_for_chunks, 3, WAIT)


async def test_a_stop_decodes_no_pending_chunk_and_releases_every_one(
    start_server: Callable[..., Any],
) -> None:
    running = await start_server(
        SyntheticSettings(chunk_frames=4), engine_class=engine_class(hold_first_decode=True)
    )
    transcript = Transcript()
    async with running.connect() as ws:
        await stream_until_a_decode_is_pending(running, ws)
        await ws.send_message(json.dumps({"type": "session.stop"}))
        await receive_into(ws, transcript)
    await running.wait_sessions_ended(1)
    assert running.summaries[0].outcome.value == "stopped"
    assert transcript.terminal[0]["type"] == "session.done"
    engine = running.engine
    made = engine.indices("made")
    assert made[:3] == [0, 1, 2]
    # Only the decode under way when the stop came ran; the chunks behind it never did.
    assert engine.indices("decode") == [0]
    assert set(engine.indices("release")) == set(made)
    assert running.summaries[0].chunks_sent == 0


async def test_a_disconnect_decodes_no_pending_chunk_and_releases_every_one(
    start_server: Callable[..., Any],
) -> None:
    running = await start_server(
        SyntheticSettings(chunk_frames=4), engine_class=engine_class(hold_first_decode=True)
    )
    async with running.connect() as ws:
        await stream_until_a_decode_is_pending(running, ws)
    await running.wait_sessions_ended(1)
    assert running.summaries[0].outcome.value == "disconnected"
    engine = running.engine
    made = engine.indices("made")
    assert made[:3] == [0, 1, 2]
    assert engine.indices("decode") == [0]
    # Chunk 0 is released by its encode call once its decode returns (the session waits
    # for that call within its close timeout); chunks 1 and 2 as the session ends.
    assert set(engine.indices("release")) == set(made)
    assert running.server.stats.worker_threads == 0


async def test_a_chunk_made_after_the_session_stopped_waiting_is_released(
    start_server: Callable[..., Any],
) -> None:
    running = await start_server(
        SyntheticSettings(chunk_frames=4),
        engine_class=engine_class(hold_chunk=0),
        close_timeout=0.2,  # how long the session waits for the stuck call before ending
    )
    engine = running.engine
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 40}))
        await receive_until(ws, Transcript(), is_type("video.start"))
        assert await trio.to_thread.run_sync(engine.held.wait, WAIT)
    # Disconnected while next_chunk is stuck outside a checkpoint: the session stops
    # waiting for it, and the chunk it returns later is nobody's.
    await running.wait_sessions_ended(1)
    assert engine.indices("release") == []  # the call is still under way
    engine.unhold.set()
    # The call returns: what it made is released, then its stream closed, in its thread.
    assert await trio.to_thread.run_sync(engine.streams[0].closed_event.wait, WAIT)
    assert engine.indices("made") == [0]
    assert engine.indices("decode") == []
    assert engine.indices("release") == [0]


async def test_sound_stays_with_its_deferred_frames(start_server: Callable[..., Any]) -> None:
    """The chunk's audio is made in next_chunk, its frames decoded later: the stream's
    sound and pictures line up exactly as with eager frames."""
    sound = SyntheticSettings(chunk_frames=3, audio_tone=440.0, audio_sample_rate=44100)
    start = {**START, "size": "32x32", "fps": 7, "num_frames": 17}
    deferred = await (await start_server(sound, engine_class=engine_class())).run_session(start)
    eager = await (await start_server(sound)).run_session(start)
    for transcript in (deferred, eager):
        assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal

    def counts(transcript: Transcript) -> list[tuple[int, int]]:
        return [
            (m["num_frames"], m["num_audio_samples"])
            for m in transcript.of_type("video.chunk_metadata")
        ]

    assert counts(deferred) == counts(eager)
    deferred_sound, eager_sound = (
        decode_audio(deferred.video_bytes),
        decode_audio(eager.video_bytes),
    )
    assert deferred_sound is not None and eager_sound is not None
    np.testing.assert_array_equal(deferred_sound[1], eager_sound[1])
    np.testing.assert_array_equal(frames_of(deferred), frames_of(eager))
