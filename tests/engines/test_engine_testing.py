"""The conformance kit (trio_vstream.engines.testing.check_engine) can fail: a toy engine
passes it, and each deliberately broken copy of it is reported under the rule it breaks,
by name, and under no other."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import pytest

from trio_vstream.engines.contract import (
    Checkpoint,
    Chunk,
    EngineError,
    GenerationRequest,
    PromptChange,
    batched,
)
from trio_vstream.engines.testing import RULES, EngineContractError, check_engine
from trio_vstream.engines.transitions import PromptSchedule
from trio_vstream.values import VideoDefaults, audio_samples_through

REQUEST = GenerationRequest(request_id="toy", prompt="red", width=8, height=4, fps=8, num_frames=6)
"""Three chunks of two frames."""

HANG = 2.0
"""The kit's timeout in the tests of engines that hang: how long it waits before it
reports a call that never returns (every other call of a toy engine takes microseconds)."""


class ToyStream:
    """Chunks of two frames, two steps each, every step behind a checkpoint; prompt changes
    through a PromptSchedule. The frames' level is the seed plus the steps taken, so a
    batched step that mixes rows shows."""

    def __init__(self, engine: ToyEngine, request: GenerationRequest) -> None:
        self.engine = engine
        self.request = request
        self.schedule = PromptSchedule(request.prompt)
        self.seed = request.seed or 0
        self.level = float(self.seed)
        self.index = 0
        engine.streams.acquire()  # released at close

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        if 2 * self.index >= self.request.num_frames:
            return None
        conditioning = self.schedule.next_conditioning()
        for _ in range(2):
            self.step(checkpoint)
        frames = np.full((2, self.request.height, self.request.width, 3), self.level % 256)
        self.index += 1
        return conditioning.chunk(frames.astype(np.uint8), self.index - 1)

    def step(self, checkpoint: Checkpoint) -> None:
        if self.engine.max_batch > 1:
            with batched(checkpoint, self.engine.run_batch) as step:
                self.level = step(self.level)
        else:
            checkpoint()
            self.level += 1

    def interact(self, change: PromptChange) -> None:
        self.schedule.push(change)

    def close(self) -> None:
        self.engine.streams.release()


class ToyEngine:
    name = "toy"
    max_concurrent_steps: int | None = 1
    video_defaults = VideoDefaults(width=8, height=4, fps=8, num_frames=6)
    max_batch = 1
    stream_class: type[ToyStream] = ToyStream

    def __init__(self) -> None:
        self.streams = threading.BoundedSemaphore(16)
        """One unit per open stream: released more often than acquired, it raises."""

    def open_stream(self, request: GenerationRequest) -> ToyStream:
        return self.stream_class(self, request)

    def run_batch(self, rows: Sequence[float]) -> list[float]:
        return [row + 1 for row in rows]

    def close(self) -> None:
        pass


def engine_with(stream_class: type[ToyStream], **attributes: object) -> Callable[[], ToyEngine]:
    """A factory of toy engines whose streams are ``stream_class``."""
    return type("Broken", (ToyEngine,), {"stream_class": stream_class, **attributes})


class NoCheckpoint(ToyStream):
    def step(self, checkpoint: Checkpoint) -> None:
        self.level += 1  # a step no stop can reach


class StopIgnored(ToyStream):
    def step(self, checkpoint: Checkpoint) -> None:
        with contextlib.suppress(BaseException):  # the bug the contract warns of
            checkpoint()
        self.level += 1


class ClosedTwice(ToyStream):
    """Gives its stream slot back when stopped, and again at close."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        try:
            return super().next_chunk(checkpoint)
        except BaseException:
            self.engine.streams.release()
            raise


class LeaksWhenStopped(ToyStream):
    """Takes the engine's one slot for a chunk's steps and gives it back only when the
    chunk is done: a stopped stream keeps it, and the next stream waits for ever (until
    the engine is closed)."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        slot: Slot = self.engine.slot  # type: ignore[attr-defined]
        slot.take()
        chunk = super().next_chunk(checkpoint)
        slot.give()
        return chunk


@attrs.define(eq=False)
class Slot:
    busy: bool = False
    closed: bool = False
    changed: threading.Condition = attrs.Factory(threading.Condition)

    def take(self) -> None:
        with self.changed:
            self.changed.wait_for(lambda: not self.busy or self.closed)
            self.busy = True

    def give(self) -> None:
        with self.changed:
            self.busy = False
            self.changed.notify_all()

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()


class LeakingEngine(ToyEngine):
    stream_class = LeaksWhenStopped

    def __init__(self) -> None:
        super().__init__()
        self.slot = Slot()

    def close(self) -> None:
        self.slot.close()


class InteractWaits(ToyStream):
    """Holds a lock for a whole chunk, and takes it to queue a change."""

    def __init__(self, engine: ToyEngine, request: GenerationRequest) -> None:
        super().__init__(engine, request)
        self.lock = threading.Lock()

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        with self.lock:
            return super().next_chunk(checkpoint)

    def interact(self, change: PromptChange) -> None:
        with self.lock:
            super().interact(change)


class InteractAtOnce(ToyStream):
    """Reads its changes after a chunk's steps: one that arrives mid-chunk is applied to
    that chunk."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        if 2 * self.index >= self.request.num_frames:
            return None
        for _ in range(2):
            self.step(checkpoint)
        frames = np.full((2, self.request.height, self.request.width, 3), 0, np.uint8)
        self.index += 1
        return self.schedule.next_conditioning().chunk(frames, self.index - 1)


class DropsMidWindow(ToyStream):
    """Drops a change received inside a chunk's action window (``window_offset`` > 0),
    as an engine that misread the offset as "not for this chunk" would."""

    def interact(self, change: PromptChange) -> None:
        if change.window_offset == 0.0:
            super().interact(change)


class WrongFrames(ToyStream):
    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        chunk = super().next_chunk(checkpoint)
        return None if chunk is None else attrs.evolve(chunk, frames=chunk.frames / 255.0)


class Sounds(ToyStream):
    """Silence, each chunk exactly as long as its frames (cumulative rounding: at 11025 Hz
    and 8 fps the three chunks carry 2756, 2757 and 2756 samples)."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        chunk = super().next_chunk(checkpoint)
        if chunk is None:
            return None
        rate, fps = 11025, self.request.fps
        first = 2 * chunk.index
        samples = audio_samples_through(first + 2, rate, fps) - audio_samples_through(
            first, rate, fps
        )
        return attrs.evolve(chunk, audio=np.zeros(self.samples(chunk.index, samples), np.float32))

    def samples(self, index: int, exact: int) -> int:
        return exact


class RoundsEachChunk(Sounds):
    """Rounds each chunk's length on its own (2756 every time): one sample short at the
    second chunk, and the sound drifts off the picture over a long stream."""

    def samples(self, index: int, exact: int) -> int:
        return round(2 * 11025 / self.request.fps)


def sounding(stream_class: type[ToyStream], rate: int = 11025) -> Callable[[], ToyEngine]:
    return engine_with(stream_class, audio_sample_rate=rate, audio_channels=1)


class ToyFrames:
    """`DeferredFrames` that own their level: decoded later, they make the same frames."""

    def __init__(self, level: float, request: GenerationRequest) -> None:
        self.level: float | None = level
        self.shape = (2, request.height, request.width, 3)

    def decode(self) -> np.ndarray:
        assert self.level is not None, "decoded after release"
        return np.full(self.shape, self.level % 256).astype(np.uint8)

    def release(self) -> None:
        self.level = None


class Defers(ToyStream):
    """Returns each chunk with its frames still to decode (`ToyFrames`)."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        chunk = super().next_chunk(checkpoint)
        if chunk is None:
            return None
        return attrs.evolve(chunk, frames=self.frames(chunk))

    def frames(self, chunk: Chunk) -> object:
        return ToyFrames(self.level, self.request)


class StreamFrames(ToyFrames):
    """Reads the level from its stream when decoded, not at the chunk's end."""

    def __init__(self, stream: ToyStream) -> None:
        super().__init__(stream.level, stream.request)
        self.stream = stream

    def decode(self) -> np.ndarray:
        return np.full(self.shape, self.stream.level % 256).astype(np.uint8)


class DecodesFromTheStream(Defers):
    """Its deferred decode uses the stream's state: decoded after the stream has made its
    next chunk (as the server decodes), a chunk shows the next one's level."""

    def frames(self, chunk: Chunk) -> object:
        return StreamFrames(self)


class MixesRows(ToyEngine):
    """Batches, and gives every row of a batch the first row's result."""

    max_batch = 4

    def run_batch(self, rows: Sequence[float]) -> list[float]:
        return [rows[0] + 1 for _ in rows]


class OwnRunBatch(ToyStream):
    """Steps with a ``run_batch`` of its own (a closure made per step), under ``key``:
    rows of equal keys batch together whichever stream's closure they came with."""

    key: object = "toy step"

    def step(self, checkpoint: Checkpoint) -> None:
        engine = self.engine

        def run_batch(rows: Sequence[float]) -> list[float]:
            return engine.run_batch(rows)

        with batched(checkpoint, run_batch, self.key) as step:
            self.level = step(self.level)


class OwnRunBatchNoKey(OwnRunBatch):
    key = None  # the closure itself: no two streams' rows share a key


class FollowsToy(ToyStream):
    """Follows an input video (`FollowsInput`): each chunk's frames are its input's, so a
    chunk made without its input, or from input of the wrong shape, fails."""

    def __init__(self, engine: ToyEngine, request: GenerationRequest) -> None:
        super().__init__(engine, request)
        self.fed: np.ndarray | None = None

    @property
    def next_chunk_frames(self) -> int:
        return max(0, min(2, self.request.num_frames - 2 * self.index))

    def feed_input(self, frames: np.ndarray) -> None:
        shape = (self.next_chunk_frames, self.request.height, self.request.width, 3)
        if frames.shape != shape or frames.dtype != np.uint8:
            raise EngineError(f"input of shape {frames.shape}, expected {shape}")
        self.fed = frames

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        chunk = super().next_chunk(checkpoint)
        if chunk is None or self.request.input_video is None:
            return chunk
        fed, self.fed = self.fed, None
        if fed is None:
            raise EngineError("a chunk without its input")
        return attrs.evolve(chunk, frames=self.shown(fed))

    def shown(self, fed: np.ndarray) -> np.ndarray:
        return fed.copy()


class DropsAFrame(FollowsToy):
    """Returns one frame fewer than it was fed: the input's frames slip off the output's."""

    def shown(self, fed: np.ndarray) -> np.ndarray:
        return fed[1:].copy()


class CountsNothing(FollowsToy):
    """Says its next chunk has no frames while it has some to make."""

    next_chunk_frames = 0  # type: ignore[assignment]


class Incomplete:
    name = "incomplete"
    max_concurrent_steps = 1
    video_defaults = VideoDefaults()

    def close(self) -> None:
        pass


def test_a_toy_engine_that_keeps_the_rules_passes() -> None:
    check_engine(ToyEngine, REQUEST)


def test_a_toy_engine_with_sound_of_exactly_its_frames_length_passes() -> None:
    check_engine(sounding(Sounds), REQUEST)


def test_a_toy_engine_that_defers_its_decode_correctly_passes() -> None:
    check_engine(engine_with(Defers), REQUEST)


def test_a_toy_engine_that_follows_its_input_passes() -> None:
    check_engine(engine_with(FollowsToy, video_input=True), REQUEST)


def test_a_stream_that_cannot_be_fed_is_reported_by_member() -> None:
    with pytest.raises(EngineContractError) as caught:
        check_engine(engine_with(ToyStream, video_input=True), REQUEST)
    assert caught.value.rules == {"video_input"}, str(caught.value)
    assert "lacks next_chunk_frames, feed_input" in str(caught.value)


def test_the_input_rule_is_only_for_engines_that_take_input() -> None:
    # The same streams, from an engine that does not declare video_input: never fed.
    check_engine(engine_with(DropsAFrame), REQUEST)
    check_engine(engine_with(DropsAFrame, video_input=False), REQUEST)


def test_a_toy_engine_that_batches_rows_correctly_passes() -> None:
    check_engine(engine_with(ToyStream, max_batch=4), REQUEST, batch_atol=0)


def test_the_kit_batches_rows_by_key_not_by_run_batch() -> None:
    # MixesRows shows when rows of different streams share a batch. Under one key, with
    # a run_batch of each stream's own, they do, and the batching rule catches the mix;
    # with no key (each closure its own), they never meet, and nothing is mixed.
    mixing = type("Mixing", (MixesRows,), {"stream_class": OwnRunBatch})
    with pytest.raises(EngineContractError) as caught:
        check_engine(mixing, REQUEST)
    assert caught.value.rules == {"batching"}, str(caught.value)
    check_engine(type("Apart", (MixesRows,), {"stream_class": OwnRunBatchNoKey}), REQUEST)


BROKEN = {
    "no checkpoint": (engine_with(NoCheckpoint), {}, "checkpoint"),
    "a stop caught and ignored": (engine_with(StopIgnored), {}, "stop"),
    "closed twice": (engine_with(ClosedTwice), {}, "close"),
    "a stopped stream keeps the engine's slot": (LeakingEngine, {"timeout": HANG}, "cancellation"),
    "interact waits for the chunk": (engine_with(InteractWaits), {"timeout": HANG}, "interact"),
    "a change applied mid-chunk": (engine_with(InteractAtOnce), {}, "interact"),
    "a mid-window change dropped": (engine_with(DropsMidWindow), {}, "interact"),
    "float frames": (engine_with(WrongFrames), {}, "chunks"),
    "batched rows differ": (MixesRows, {}, "batching"),
    "a deferred decode that reads the stream": (engine_with(DecodesFromTheStream), {}, "deferred"),
    "no open_stream": (Incomplete, {}, "interface"),
    "audio rounded chunk by chunk": (sounding(RoundsEachChunk), {}, "audio"),
    "audio at a rate AAC lacks": (sounding(Sounds, rate=96000), {}, "audio"),
    "video input but no feed_input": (engine_with(ToyStream, video_input=True), {}, "video_input"),
    "a chunk shorter than its input": (
        engine_with(DropsAFrame, video_input=True),
        {},
        "video_input",
    ),
    "next_chunk_frames 0 mid-video": (
        engine_with(CountsNothing, video_input=True),
        {},
        "video_input",
    ),
}


@pytest.mark.parametrize(
    ("factory", "options", "rule"),
    [
        # A hang is caught only by waiting HANG out: those cases are slow.
        pytest.param(*case, id=name, marks=[pytest.mark.slow] if "timeout" in case[1] else [])
        for name, case in BROKEN.items()
    ],
)
def test_a_broken_engine_is_reported_under_the_rule_it_breaks(
    factory: Callable[[], object], options: dict[str, float], rule: str
) -> None:
    with pytest.raises(EngineContractError) as caught:
        check_engine(factory, REQUEST, **options)  # type: ignore[arg-type]
    assert caught.value.rules == {rule}, str(caught.value)
    assert f"[{rule}] " in str(caught.value)


def test_every_rule_is_broken_by_some_engine() -> None:
    assert {rule for _, _, rule in BROKEN.values()} == set(RULES)
