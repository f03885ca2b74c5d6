"""A synthetic engine that records what the server did to it, for the guarantee tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import attrs
import trio

from trio_vstream.engines.contract import (
    Checkpoint,
    Chunk,
    EngineError,
    GenerationRequest,
    PromptChange,
    batched,
    checkpoint_calling,
)
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings, SyntheticStream
from trio_vstream.scheduling.batcher import StepBatcher
from trio_vstream.scheduling.checkpoint import SessionCheckpoint
from trio_vstream.scheduling.progress import EngineProgress

MEET_TIMEOUT_S = 30.0
"""How long sessions started together wait for each other (`FirstStepMeeting`): far
longer than a tiny pipeline's encodes under load, so only a session that never comes
(a bug, a hang) runs it out, and then the test fails saying so."""


class FirstStepMeeting:
    """Sessions started together meet here before their first step, whatever the
    machine's load: none steps before every other is ready to step too (in the batch
    already, or asking for a step slot). Without it, one session can make its whole
    video while another is still connecting or encoding its prompt, and a test that
    needs their steps together (a shared batch, turns taken) fails only under load.

    Called from the sessions' worker threads. A session that ends without a first step
    (stopped, failed) `leave`s, so the others do not wait for it; a meeting that does
    not happen within ``timeout`` fails the steps that waited, saying how many came."""

    def __init__(self, parties: int, timeout: float = MEET_TIMEOUT_S) -> None:
        self.parties = parties
        self.timeout = timeout
        self._condition = threading.Condition()
        self._expected = parties
        self._arrived = 0

    def arrive(self) -> None:
        """One session's first step: wait until every session expected has arrived."""
        with self._condition:
            self._arrived += 1
            self._condition.notify_all()
            met = self._condition.wait_for(
                lambda: self._arrived >= self._expected, timeout=self.timeout
            )
            if not met:
                raise AssertionError(
                    f"FirstStepMeeting: {self._arrived} of {self._expected} sessions "
                    f"reached their first step within {self.timeout} s"
                )

    def leave(self) -> None:
        """A session that will never arrive (it ended before its first step)."""
        with self._condition:
            self._expected -= 1
            self._condition.notify_all()


class MeetingCheckpoint(Checkpoint):
    """A server's checkpoint, passed through, but for a `FirstStepMeeting` before the
    stream's first step of a batch (``batched``; it is a `BatchRunner` that forwards to
    the inner checkpoint): what a test wraps a real batching engine's streams in
    (`MeetingStream`) to have the sessions it starts together share their first batch.
    The session is in the batch by then."""

    def __init__(self, inner: Checkpoint, stream: MeetingStream) -> None:
        self._inner = inner
        self._stream = stream

    def __call__(self) -> None:
        self._inner()

    def check_cancelled(self) -> None:
        self._inner.check_cancelled()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        with self._inner.waiting():
            yield

    @contextlib.contextmanager
    def batched_steps(self, run_batch: Any, key: Hashable) -> Iterator[Callable[[Any], Any]]:
        with batched(self._inner, run_batch, key) as step:

            def meeting_first(row: Any) -> Any:
                self._stream.arrive()
                return step(row)

            yield meeting_first


class MeetingStream:
    """An engine's stream whose session meets the others at its first batched step
    (`MeetingCheckpoint`); leaves the meeting if it closes before. `meeting_streams`
    makes an engine open these."""

    def __init__(self, inner: Any, meet: FirstStepMeeting) -> None:
        self._inner = inner
        self._meet = meet
        self._arrived = False
        self._lock = threading.Lock()

    def arrive(self) -> None:
        with self._lock:
            first, self._arrived = not self._arrived, True
        if first:
            self._meet.arrive()

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        return self._inner.next_chunk(MeetingCheckpoint(checkpoint, self))

    def interact(self, change: PromptChange) -> None:
        self._inner.interact(change)

    def close(self) -> None:
        with self._lock:
            first, self._arrived = not self._arrived, True
        if first:
            self._meet.leave()
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def meeting_streams(engine: Any, monkeypatch: Any, parties: int) -> FirstStepMeeting:
    """Make ``engine`` (a real one, say the shapes engine behind a server) open
    `MeetingStream`s: the first ``parties`` sessions meet at their first batched step."""
    meet = FirstStepMeeting(parties)
    open_stream = engine.open_stream
    monkeypatch.setattr(
        engine, "open_stream", lambda request: MeetingStream(open_stream(request), meet)
    )
    return meet


class InstrumentedStream:
    def __init__(self, engine: InstrumentedEngine, inner: SyntheticStream) -> None:
        self._engine = engine
        self._inner = inner
        self.request = inner._request
        self.closed = 0
        self.step_times: list[float] = []
        self.chunk_times: list[float] = []
        """When each chunk was returned (``time.monotonic()``)."""
        self.changes: list[PromptChange] = []
        self.threads_inside = 0
        self.arrived = False
        """It came to the engine's `FirstStepMeeting` (or left it), if there is one."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        engine = self._engine

        def counting_step() -> None:
            if engine.meet is not None and not self.arrived:
                # Before the step, so holding no step slot that the others wait for.
                self.arrived = True
                engine.meet.arrive()
            checkpoint()
            # Only checkpoints that let the engine go on count as steps started.
            self.step_times.append(time.monotonic())

        with engine.lock:
            self.threads_inside += 1
        try:
            chunk = self._inner.next_chunk(
                checkpoint_calling(counting_step, checkpoint.check_cancelled)
            )
        finally:
            with engine.lock:
                self.threads_inside -= 1
        if chunk is not None:
            self.chunk_times.append(time.monotonic())
            with engine.chunk_made:
                engine.chunks_made += 1
                engine.chunk_made.notify_all()
        return chunk

    @property
    def next_chunk_frames(self) -> int:
        return self._inner.next_chunk_frames

    def feed_input(self, frames: Any) -> None:
        self._inner.feed_input(frames)

    def interact(self, change: PromptChange) -> None:
        if change.event_id in self._engine.refuse:
            raise EngineError(f"refused {change.event_id} (InstrumentedEngine.refuse)")
        self.changes.append(change)
        # The synthetic engine draws prompts only: a camera-only change (a CameraEngine's)
        # keeps the prompt, and is still listed in the next chunk's started_event_ids.
        if change.prompt is None:
            change = attrs.evolve(change, prompt=self.request.prompt)
        self._inner.interact(change)

    def close(self) -> None:
        self.closed += 1
        if self._engine.meet is not None and not self.arrived:
            self.arrived = True
            self._engine.meet.leave()
        self._inner.close()

    def steps_after(self, moment: float) -> int:
        return sum(1 for t in self.step_times if t > moment)


class InstrumentedEngine(SyntheticEngine):
    def __init__(self, settings: SyntheticSettings) -> None:
        super().__init__(settings)
        self.lock = threading.Lock()
        self.streams: list[InstrumentedStream] = []
        self.chunk_made = threading.Condition()
        self.chunks_made = 0
        self.refuse: set[str] = set()
        """Event ids whose changes ``interact`` refuses (an `EngineError`)."""
        self.meet: FirstStepMeeting | None = None
        """Set (before the sessions start) to make their streams meet before their first
        step: so their steps overlap whatever the machine's load."""

    def wait_for_chunks(self, count: int, timeout: float = 30.0) -> bool:
        """Block (in a worker thread) until the engine has made ``count`` chunks in all."""
        with self.chunk_made:
            return self.chunk_made.wait_for(lambda: self.chunks_made >= count, timeout)

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = InstrumentedStream(self, super().open_stream(request))
        self.streams.append(stream)
        return stream

    def snapshot(self, request_id: str | None) -> dict[str, Any]:
        """The state of one session's stream (if it got one)."""
        with self.lock:
            mine = [s for s in self.streams if s.request.request_id == request_id]
            return {
                "threads_inside": sum(s.threads_inside for s in mine),
                "unclosed_streams": sum(1 for s in mine if s.closed != 1),
            }


class TakingTurnsEngine(InstrumentedEngine):
    """Whole chunks take turns on one lock, as sessions do on the diffusers engine's
    shared pipeline: a session waits for its turn inside ``checkpoint.waiting()``."""

    def __init__(self, settings: SyntheticSettings) -> None:
        super().__init__(settings)
        self._turn = threading.Condition()
        self._busy = False
        self._waiting = 0
        self.max_waiting = 0
        """The most sessions seen waiting for their turn at once."""
        self.longest_wait = 0.0
        """The longest any session waited for its turn, in seconds."""
        self.queue_to_meet: int | None = None
        """Set (before the sessions start) to have the first session to get a turn keep
        it, stepping, until this many others wait for theirs: so they really queue
        behind it, whatever the machine's load (else it can make its whole video before
        the others have connected)."""
        self._queue_met = False

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = super().open_stream(request)
        next_chunk = stream.next_chunk

        def next_chunk_in_turn(checkpoint: Checkpoint) -> Chunk | None:
            self._take_turn(checkpoint)
            try:
                self._hold_first_turn(checkpoint)
                return next_chunk(checkpoint)
            finally:
                with self._turn:
                    self._busy = False
                    self._turn.notify_all()

        stream.next_chunk = next_chunk_in_turn  # type: ignore[method-assign]
        return stream

    def _take_turn(self, checkpoint: Checkpoint) -> None:
        with checkpoint.waiting():
            with self._turn:
                self._waiting += 1
                self._turn.notify_all()
            began = time.monotonic()
            try:
                while True:
                    checkpoint.check_cancelled()
                    with self._turn:
                        if not self._busy:
                            self._busy = True
                            return
                        self.max_waiting = max(self.max_waiting, self._waiting)
                        self._turn.wait(timeout=0.01)
            finally:
                with self._turn:
                    self._waiting -= 1
                    self.longest_wait = max(self.longest_wait, time.monotonic() - began)

    def _hold_first_turn(self, checkpoint: Checkpoint) -> None:
        """With ``queue_to_meet``: keep the first turn until that many others wait. Each
        round is a step (``checkpoint()``), progress for this session and for those
        queued behind it, so no stall guard mistakes the meeting for a hung engine."""
        if self.queue_to_meet is None or self._queue_met:
            return
        deadline = time.monotonic() + MEET_TIMEOUT_S
        while True:
            checkpoint()
            with self._turn:
                if self._waiting >= self.queue_to_meet:
                    self._queue_met = True
                    self.max_waiting = max(self.max_waiting, self._waiting)
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"TakingTurnsEngine: {self._waiting} of {self.queue_to_meet} "
                        f"sessions queued within {MEET_TIMEOUT_S} s"
                    )
                self._turn.wait(timeout=0.01)


class CameraEngine(InstrumentedEngine):
    """Takes cameras as well as prompts, as the shapes engine does: what a paced camera
    session needs (its interactions wait for their action windows)."""

    interaction_kinds: frozenset[str] = frozenset({"prompt", "camera"})


class StoppingCheckpoint(SessionCheckpoint):
    """A session's checkpoint as the server makes it, which cancels the session as its
    ``stop_at``-th batched step is handed over: a stop arriving mid-chunk, while the other
    sessions' rows are in the same batches."""

    def __init__(
        self,
        batcher: StepBatcher,
        scope: trio.CancelScope,
        stop_at: int | None,
        meet: FirstStepMeeting | None = None,
    ) -> None:
        super().__init__(None, EngineProgress(), lambda: None, batcher)
        self.scope, self.stop_at, self.steps = scope, stop_at, 0
        self.meet = meet
        """Sessions started together meet here, each in the batch already, before their
        first step: so their first steps share a batch whatever the machine's load (else
        one can finish its steps alone while another still encodes its prompt)."""

    def left(self) -> None:
        """The session is over: if it never stepped, the others stop waiting for it."""
        if self.steps == 0 and self.meet is not None:
            self.meet.leave()

    @contextlib.contextmanager
    def batched_steps(self, run_batch: Any, key: Hashable) -> Iterator[Callable[[Any], Any]]:
        with super().batched_steps(run_batch, key) as step:

            def counted(row: Any) -> Any:
                self.steps += 1
                if self.steps == 1 and self.meet is not None:
                    self.meet.arrive()
                if self.steps == self.stop_at:
                    trio.from_thread.run_sync(self.scope.cancel)
                return step(row)

            yield counted


class EchoInputStream(InstrumentedStream):
    """A stream that follows its input video by showing it: each chunk's frames are the
    input frames it was fed, exactly, so what the server fed is what a client decodes."""

    def __init__(self, engine: InstrumentedEngine, inner: SyntheticStream) -> None:
        super().__init__(engine, inner)
        self._done = 0
        self._fed: Any = None
        self.fed: list[Any] = []
        """Every input the server fed, in order."""

    @property
    def next_chunk_frames(self) -> int:
        chunk_frames = self._engine.settings.chunk_frames
        return min(chunk_frames, self.request.num_frames - self._done)

    def feed_input(self, frames: Any) -> None:
        super().feed_input(frames)  # the synthetic stream's checks, and its blend
        self._fed = frames
        self.fed.append(frames)

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        chunk = super().next_chunk(checkpoint)
        if chunk is None:
            return None
        frames, self._fed = self._fed, None
        if frames is None or len(frames) != len(chunk.frames):
            raise EngineError("EchoInputStream: no input, or not the chunk's length")
        self._done += len(frames)
        return attrs.evolve(chunk, frames=frames)


class NoVideoInputEngine(InstrumentedEngine):
    """The synthetic engine, less its video input: for what an engine without it does."""

    video_input = False


class EchoInputEngine(InstrumentedEngine):
    """Takes input video, and shows it (`EchoInputStream`)."""

    video_input = True

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = EchoInputStream(self, SyntheticEngine.open_stream(self, request))
        self.streams.append(stream)
        return stream


def create_echo_engine(*, device: str = "auto", **engine_args: str) -> EchoInputEngine:
    """``--engine tests.instrumented:create_echo_engine``: `EchoInputEngine` for a server
    process (the page's tests), with the synthetic engine's ``--engine-arg`` settings."""
    from trio_vstream.engines.synthetic import parse_settings

    del device
    return EchoInputEngine(parse_settings(engine_args))
