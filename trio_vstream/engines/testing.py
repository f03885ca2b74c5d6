"""Proving that an engine keeps the contract: `check_engine`, for an engine's own tests.

What ``trio.testing.check_two_way_stream`` is for a Trio stream, this is for an engine:
give it a factory, and it drives the engine through the rules of
`trio_vstream.engines.base` as the server would, then reports every rule broken, each by
its name in `RULES`, in one `EngineContractError`::

    from trio_vstream.engines.testing import check_engine

    def test_my_engine_keeps_the_contract():
        check_engine(lambda: create_engine(device="cpu", steps="2"))

The kit is plain synchronous Python, like an engine (the import contracts keep Trio out
of ``engines/``): it plays the server's part from threads, one per engine call as the
server's worker threads are, with a `Checkpoint` of its own that counts steps, stops a
stream at a chosen one, parks it there, and batches the rows of several streams. So it
runs under any test runner, and an engine call that never returns is reported after
``timeout`` seconds instead of hanging the test (its thread, a daemon, is left behind,
and the checks after it are skipped: the engine's state is unknown).

A stop is a ``BaseException`` (`CheckpointStopped`), as the server's is (``trio.Cancelled``),
so an engine that catches ``Exception`` around its steps still lets it through.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, TypeVar, cast

import attrs
import numpy as np

from trio_vstream.engines.base import (
    Checkpoint,
    Chunk,
    DeferredFrames,
    Engine,
    EngineError,
    EngineStream,
    GenerationRequest,
    In,
    Out,
    PromptChange,
    RunBatch,
    batch_result,
    release_frames,
)
from trio_vstream.engines.frames import audio_to_float32_array, frames_to_uint8_array
from trio_vstream.engines.interfaces import (
    INTERACTION_KINDS,
    AudioFormat,
    SupportsSeed,
    audio_format,
    interaction_kinds,
    max_batch,
    missing_members,
    supports_seed,
)
from trio_vstream.video import Camera, VideoDefaults, audio_samples_through

__all__ = [
    "RULES",
    "CheckpointStopped",
    "EngineContractError",
    "StepFailed",
    "Violation",
    "check_engine",
    "default_request",
]

T = TypeVar("T")

RULES: Final[dict[str, str]] = {
    "interface": "the engine and its streams have the contract's members, and what they "
    "declare beyond it (interaction kinds, max_batch, a seed) is well formed",
    "chunks": "a stream runs to its end, in chunks numbered 0, 1, ... that hold (T, H, W, 3) "
    "uint8 frames of the request's size, num_frames in all",
    "checkpoint": "next_chunk calls checkpoint() before the work of every chunk it returns",
    "stop": "a checkpoint that raises ends next_chunk at once, with that exception and no "
    "further step",
    "close": "close() returns after any ending: a stream finished, stopped, failed or never "
    "stepped, and the engine at the end",
    "cancellation": "after a stream is stopped at any checkpoint, or fails, the engine serves "
    "the next stream",
    "interact": "interact only queues: it returns while next_chunk waits in a checkpoint, and "
    "the change starts at the next chunk, a change received mid-window (window_offset in "
    "(0, 1)) too",
    "batching": "an engine with max_batch > 1 makes the same frames for rows stepped together "
    "as for rows stepped alone",
    "deferred": "a chunk whose frames are DeferredFrames decodes to the same frames when the "
    "server decodes it: in another thread, after the stream's next chunk and its close; and "
    "one released instead of decoded, as after a stop, leaves the engine serving",
    "audio": "an engine with sound (audio_sample_rate) declares a rate and channels the server "
    "carries, and each chunk's audio covers exactly its frames: audio_samples_through(end) - "
    "audio_samples_through(start) samples, float PCM",
}
"""Each rule `check_engine` checks, by the name it reports it under."""


class CheckpointStopped(BaseException):
    """What the kit's checkpoint raises to stop a stream: the session is over."""


class StepFailed(Exception):
    """What the kit's checkpoint raises to fail a step, as a failed batch row would."""


@attrs.frozen
class Violation:
    """One broken rule: its name (a key of `RULES`) and what the engine did."""

    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


class EngineContractError(AssertionError):
    """The engine broke the contract; ``violations`` says how, rule by rule."""

    def __init__(self, engine: str, violations: Sequence[Violation]) -> None:
        self.violations = tuple(violations)
        lines = "\n".join(f"  {violation}" for violation in self.violations)
        super().__init__(f"engine {engine!r} broke the engine contract:\n{lines}")

    @property
    def rules(self) -> frozenset[str]:
        """The names of the rules broken."""
        return frozenset(violation.rule for violation in self.violations)


def default_request(engine: Engine) -> GenerationRequest:
    """The request `check_engine` uses when given none: the engine's video defaults (or
    `VideoDefaults`' own, if it has none), seed 1."""
    defaults = getattr(engine, "video_defaults", None)
    if not isinstance(defaults, VideoDefaults):
        defaults = VideoDefaults()  # the interface check reports it
    return GenerationRequest(
        request_id="check-engine",
        prompt="a red circle moving left",
        width=defaults.width,
        height=defaults.height,
        fps=defaults.fps,
        num_frames=defaults.num_frames,
        seed=1,
    )


def check_engine(
    factory: Callable[[], Engine],
    request: GenerationRequest | None = None,
    *,
    chunks: int = 2,
    timeout: float = 60.0,
    batch_atol: int = 1,
) -> None:
    """Drive the engine ``factory()`` makes through the contract's rules; raise
    `EngineContractError` naming each rule it broke.

    ``request`` is what every stream asks for (`default_request` when None): keep it
    small, as the kit runs many streams. One stream runs to its end, to check the frames
    it makes; the others run at most ``chunks`` chunks: one stopped at each of their
    checkpoints in turn, one failed at its first, two interacted with (a change while
    chunk 0 is made, and one received halfway through a window), and for an engine
    with ``max_batch`` > 1, a few stepped alone and then together, whose frames may
    differ by ``batch_atol`` levels (batched arithmetic sums in another order). An engine
    call that takes longer than ``timeout`` seconds counts as hung. The engine is closed
    at the end, once.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    engine = factory()
    if request is None:
        request = default_request(engine)
    kit = _Kit(engine, request, chunks, timeout, batch_atol)
    kit.run()
    if kit.violations:
        raise EngineContractError(
            str(getattr(engine, "name", type(engine).__name__)), kit.violations
        )


class _Hung(Exception):
    """An engine call did not return in time; its thread is left behind."""


class _Skip(Exception):
    """The checks after this one cannot run (the engine hung, or is no engine)."""


def _in_thread(what: str, timeout: float, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread of its own, as the server calls an engine: its result, or
    its exception (a `CheckpointStopped` too) re-raised here; `_Hung` after ``timeout``."""
    done: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            done.append((True, fn(*args)))
        except BaseException as exc:  # handed to the caller, whatever it is
            done.append((False, exc))

    thread = threading.Thread(target=run, name=f"check_engine: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if not done:
        raise _Hung(f"{what} did not return within {timeout:g} s")
    ok, value = done[0]
    if not ok:
        raise value
    return cast(T, value)


class _Probe(Checkpoint):
    """The kit's checkpoint for one stream: counts its steps, and may stop it at one,
    fail it at one, park it at one (until ``unpark`` is set), or batch its rows."""

    def __init__(
        self,
        *,
        stop_at: int | None = None,
        fail_at: int | None = None,
        park_at: int | None = None,
        batcher: _Batcher | None = None,
    ) -> None:
        self.steps = 0
        """Steps begun: ``checkpoint()`` calls and batched steps."""
        self.stop_at, self.fail_at, self.park_at = stop_at, fail_at, park_at
        self.stopped = False
        """The stop was raised: from now on every call raises it again."""
        self.failed = False
        self.calls_after_stop = 0
        self.parked = threading.Event()
        self.unpark = threading.Event()
        self._batcher = batcher

    def __call__(self) -> None:
        self.check_cancelled()
        self.steps += 1
        if self.steps == self.park_at:
            self.parked.set()
            self.unpark.wait()
        if self.steps == self.stop_at:
            self.stopped = True
            raise CheckpointStopped
        if self.steps == self.fail_at:
            self.failed = True
            raise StepFailed(f"check_engine failed step {self.steps}")

    def check_cancelled(self) -> None:
        if self.stopped:
            self.calls_after_stop += 1
            raise CheckpointStopped

    @contextlib.contextmanager
    def batched(self, run_batch: RunBatch[In, Out]) -> Iterator[Callable[[In], Out]]:
        batcher = self._batcher
        if batcher is None:  # each row alone: a step, then run_batch([row])
            with super().batched(run_batch) as alone:
                yield alone
            return

        def together(row: In) -> Out:
            self()
            return cast(Out, batcher.step(run_batch, row))

        yield together


@attrs.define(eq=False)
class _Row:
    data: Any
    results: Sequence[Any] = ()
    index: int = 0
    done: bool = False


class _Batcher:
    """Runs the rows of several streams' ``checkpoint.batched`` steps as batches, as the
    server's ``StepBatcher`` does, but from the streams' own threads: the rows of one
    ``run_batch`` run as one call once every stream still running has handed over its
    row (or ``max_batch`` rows wait, or every stream waits), in the thread of the row
    that completed the batch.
    Waiting for every live stream, where the server waits only for those inside
    ``batched()``, makes each batch as large as it can be, so that rows of different
    streams surely meet."""

    def __init__(self, max_batch: int, streams: int) -> None:
        self.max_batch = max_batch
        self.live = streams
        """Streams not yet finished (`stream_done`)."""
        self.sizes: list[int] = []
        """Each batch's row count."""
        self._given_up = False
        self._queues: dict[Any, list[_Row]] = {}
        self._running = False
        self._changed = threading.Condition()

    def stream_done(self) -> None:
        with self._changed:
            self.live -= 1
            self._changed.notify_all()

    def give_up(self) -> None:
        """Fail every waiting row: the kit stopped waiting for the streams."""
        with self._changed:
            self._given_up = True
            self._changed.notify_all()

    def step(self, run_batch: RunBatch[Any, Any], data: Any) -> Any:
        row = _Row(data)
        with self._changed:
            self._queues.setdefault(run_batch, []).append(row)
            self._changed.notify_all()
            while not row.done:
                if self._given_up:
                    raise EngineError("check_engine stopped waiting for this batch")
                queue = self._queues.get(run_batch, [])
                waiting = sum(len(rows) for rows in self._queues.values())
                # Every live stream's row is in, or as many as a batch takes; or every
                # stream waits, some with another run_batch: then rows of this one go.
                full = len(queue) >= min(self.max_batch, self.live) or waiting >= self.live
                if not self._running and queue and full:
                    self._run(run_batch, queue)
                else:
                    self._changed.wait()
        return batch_result(row.results, row.index, len(row.results))

    def _run(self, run_batch: RunBatch[Any, Any], queue: list[_Row]) -> None:
        """Run the oldest rows of ``queue``: called, and returning, with the lock held,
        which is let go while ``run_batch`` runs."""
        rows = queue[: self.max_batch]
        del queue[: len(rows)]
        if not queue:
            del self._queues[run_batch]
        self._running = True
        self._changed.release()
        try:
            try:
                results: Sequence[Any] = run_batch([row.data for row in rows])
            except Exception as exc:  # the whole batch failed: every row fails with it
                results = [exc] * len(rows)
        finally:
            self._changed.acquire()
            self._running = False
        for index, row in enumerate(rows):
            row.results, row.index, row.done = results, index, True
        self.sizes.append(len(rows))
        self._changed.notify_all()


@attrs.define
class _Run:
    """What driving one stream gave: its chunks (and their frames, checked), the steps
    taken before each, and how it ended: ``finished`` (it returned None), ``error`` (it
    raised), or neither (it reached the chunk limit)."""

    chunks: list[Chunk] = attrs.Factory(list)
    frames: list[np.ndarray] = attrs.Factory(list)
    steps_per_chunk: list[int] = attrs.Factory(list)
    finished: bool = False
    error: BaseException | None = None

    def ending(self) -> str:
        if self.error is not None:
            return f"raised {self.error!r}"
        if self.finished:
            return f"ended after {len(self.chunks)} chunk(s)"
        return f"returned {len(self.chunks)} chunk(s)"


class _Kit:
    """One `check_engine` run: the engine, the request, the violations found so far."""

    def __init__(
        self,
        engine: Engine,
        request: GenerationRequest,
        chunks: int,
        timeout: float,
        batch_atol: int,
    ) -> None:
        self.engine = engine
        self.request = request
        self.chunks = chunks
        self.timeout = timeout
        self.batch_atol = batch_atol
        self.violations: list[Violation] = []
        self._kinds_seen: set[tuple[str, str]] = set()
        self.sound: AudioFormat | None = None
        """The engine's sound, once `check_interface` has read it."""

    def fail(self, rule: str, message: str, *, once: str | None = None) -> None:
        """Record a violation; with ``once``, only the first of that kind (a stop ignored
        at every checkpoint is one broken rule, not twenty)."""
        if once is not None:
            if (rule, once) in self._kinds_seen:
                return
            self._kinds_seen.add((rule, once))
        self.violations.append(Violation(rule, message))

    def run(self) -> None:
        try:
            self.check_interface()
            full = self.check_full_run()
            self.check_close_unstepped()
            self.check_stops(full)
            self.check_interact(full)
            self.check_window_offset(full)
            self.check_deferred(full)
            self.check_batching()
        except _Skip:
            pass
        finally:
            self.close_engine()

    def close_engine(self) -> None:
        close = getattr(self.engine, "close", None)
        if not callable(close):
            return  # no engine (check_interface said so)
        try:
            _in_thread("engine.close()", self.timeout, close)
        except _Hung as exc:
            self.fail("close", str(exc))
        except Exception as exc:
            self.fail("close", f"engine.close() raised {exc!r}")

    # -- the engine's calls, as the server makes them

    def open(self, request: GenerationRequest, after: str | None = None) -> EngineStream:
        """Open a stream (``after`` what, if the engine served another stream before that
        ended in a way worth naming); `_Skip`, after saying why, when that fails."""
        rule, context = ("interface", "") if after is None else ("cancellation", f" after {after}")
        try:
            stream = _in_thread("open_stream", self.timeout, self.engine.open_stream, request)
        except _Hung as exc:
            self.fail(rule, f"{exc}{context}")
            raise _Skip from exc
        except Exception as exc:
            self.fail(rule, f"open_stream raised {exc!r}{context}")
            raise _Skip from exc
        if not isinstance(stream, EngineStream):
            missing = ", ".join(missing_members(stream, EngineStream))
            self.fail("interface", f"open_stream returned {stream!r}, which lacks {missing}")
            raise _Skip
        if isinstance(stream, SupportsSeed) and not supports_seed(stream):
            self.fail(
                "interface", f"a stream's seed must be an int, got {stream.seed!r}", once="seed"
            )
        return stream

    def close(self, stream: EngineStream, after: str) -> None:
        try:
            _in_thread("close()", self.timeout, stream.close)
        except _Hung as exc:
            self.fail("close", f"{exc} {after}")
            raise _Skip from exc
        except Exception as exc:
            self.fail("close", f"close() raised {exc!r} {after}", once="raised")

    def drive(
        self,
        stream: EngineStream,
        probe: _Probe,
        limit: int | None,
        request: GenerationRequest | None = None,
        *,
        here: bool = False,
        made: int = 0,
    ) -> _Run:
        """Call ``next_chunk`` until the stream ends, ``limit`` chunks are made, or it
        raises; check each chunk on the way (``made``: chunks the stream made before).
        Each call runs in a thread of its own (`_Hung` propagates), or with ``here`` in
        this one, for a thread the caller watches."""
        request = request or self.request
        run = _Run()
        # Every chunk has a frame at least: a stream that goes on for more than num_frames
        # chunks makes too many frames, which check_full_run reports.
        cap = request.num_frames + 1 if limit is None else limit
        while len(run.chunks) < cap:
            before = probe.steps
            try:
                if here:
                    chunk = stream.next_chunk(probe)
                else:
                    chunk = _in_thread("next_chunk", self.timeout, stream.next_chunk, probe)
            except _Hung:
                raise
            except BaseException as exc:  # a stop, a failed step, the engine's own error
                run.error = exc
                return run
            if chunk is None:
                run.finished = True
                return run
            run.steps_per_chunk.append(probe.steps - before)
            run.chunks.append(chunk)
            run.frames.append(self.check_chunk(chunk, made + len(run.chunks) - 1, request))
        return run

    def check_chunk(self, chunk: object, index: int, request: GenerationRequest) -> np.ndarray:
        """The chunk's frames as the server takes them, or none (after saying why)."""
        empty = np.zeros((0, request.height, request.width, 3), np.uint8)
        if not isinstance(chunk, Chunk):
            self.fail("chunks", f"next_chunk returned {chunk!r}, not a Chunk or None", once="type")
            return empty
        if chunk.index != index:
            self.fail("chunks", f"chunk {index} has index {chunk.index}", once="index")
        try:
            return frames_to_uint8_array(chunk.frames, width=request.width, height=request.height)
        except EngineError as exc:
            self.fail("chunks", f"chunk {index}: {exc}", once="frames")
            return empty

    # -- the rules, in the order they run

    def check_interface(self) -> None:
        engine = self.engine
        if not isinstance(engine, Engine):
            missing = ", ".join(missing_members(engine, Engine))
            self.fail("interface", f"the factory made {engine!r}, which lacks {missing}")
            raise _Skip
        if not isinstance(engine.video_defaults, VideoDefaults):
            self.fail(
                "interface", f"video_defaults is {engine.video_defaults!r}, not VideoDefaults"
            )
        steps = engine.max_concurrent_steps
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            self.fail(
                "interface", f"max_concurrent_steps must be None or an int >= 1, got {steps!r}"
            )
        kinds = interaction_kinds(engine)
        if not kinds <= INTERACTION_KINDS:
            unknown = ", ".join(sorted(kinds - INTERACTION_KINDS))
            self.fail("interface", f"unknown interaction kind(s): {unknown}")
        try:
            max_batch(engine)
        except EngineError as exc:
            self.fail("interface", str(exc))
        try:
            self.sound = audio_format(engine)
        except EngineError as exc:
            self.fail("audio", str(exc))

    def check_full_run(self) -> _Run:
        """One stream to its end: the chunks and checkpoint rules, and how many steps each
        chunk takes, where the other checks stop or park a stream."""
        stream = self.open(self.request)
        try:
            run = self.drive(stream, _Probe(), None)
        except _Hung as exc:
            self.fail("chunks", f"{exc} (a stream run to its end)")
            raise _Skip from exc
        self.close(stream, "after the stream ended")
        if run.error is not None:
            self.fail("chunks", f"next_chunk raised {run.error!r} (a stream run to its end)")
            raise _Skip
        for index, steps in enumerate(run.steps_per_chunk):
            if not steps:
                self.fail(
                    "checkpoint",
                    f"chunk {index} was made without calling checkpoint(): call it before "
                    "each step and the decode, or a stop cannot reach the stream",
                )
                break
        if self.sound is not None:
            self.check_audio(run, self.sound)
        total = sum(len(frames) for frames in run.frames)
        asked = self.request.num_frames
        if total != asked and ("chunks", "frames") not in self._kinds_seen:
            self.fail(
                "chunks",
                f"the stream {run.ending()}, {total} frames; the request asked for {asked}",
            )
        return run

    def check_audio(self, run: _Run, sound: AudioFormat) -> None:
        """Each chunk's sound is exactly as long as its frames (cumulative rounding)."""
        done = 0
        fps = self.request.fps
        for index, (chunk, frames) in enumerate(zip(run.chunks, run.frames, strict=True)):
            begin = audio_samples_through(done, sound.sample_rate, fps)
            done += len(frames)
            samples = audio_samples_through(done, sound.sample_rate, fps) - begin
            try:
                audio_to_float32_array(chunk.audio, channels=sound.channels, samples=samples)
            except EngineError as exc:
                self.fail("audio", f"chunk {index}: {exc}", once="audio")

    def check_close_unstepped(self) -> None:
        """A session may end between ``open_stream`` and its first step (its client left)."""
        stream = self.open(self.request)
        self.close(stream, "before the stream's first step")

    def check_stops(self, full: _Run) -> None:
        """Stop a stream at each checkpoint of its first chunks in turn, then fail one at
        its first step: each must end at once, close, and leave the engine serving."""
        steps = sum(full.steps_per_chunk[: self.chunks])
        endings = [(f"a stop at checkpoint {k}", _Probe(stop_at=k)) for k in range(1, steps + 1)]
        if steps:
            endings.append(("a failed first step", _Probe(fail_at=1)))
        previous: str | None = None
        for what, probe in endings:
            stream = self.open(self.request, previous)
            try:
                run = self.drive(stream, probe, self.chunks)
            except _Hung as exc:
                if probe.stopped:
                    self.fail("stop", f"{what}: {exc}: let the checkpoint's exception propagate")
                else:
                    self.fail("cancellation", f"{exc} (after {previous or 'a full stream'})")
                raise _Skip from exc
            self.close(stream, f"after {what}")
            if probe.stopped:
                self.check_stopped(what, probe, run)
            elif not probe.failed and run.error is not None:
                self.fail(
                    "cancellation", f"after {previous}, next_chunk {run.ending()}", once="raised"
                )
            previous = what
        stream = self.open(self.request, previous)
        try:
            run = self.drive(stream, _Probe(), self.chunks)
        except _Hung as exc:
            self.fail("cancellation", f"{exc} (after {previous})")
            raise _Skip from exc
        self.close(stream, "after the stream ended")
        if run.error is not None or len(run.chunks) < min(self.chunks, len(full.chunks)):
            self.fail("cancellation", f"after {previous}, the next stream {run.ending()}")

    def check_deferred(self, full: _Run) -> None:
        """`DeferredFrames` decoded as the server decodes them: not at once (as in the full
        run), but in another thread once the stream has made its next chunks and been
        closed, in chunk order; they must give the full run's frames. Then a stream whose
        chunk is released, never decoded (a stop while it waits to be sent), must close,
        and the engine serve the next stream."""
        if not any(isinstance(chunk.frames, DeferredFrames) for chunk in full.chunks):
            return
        request = self.request
        stream = self.open(request)
        chunks: list[Chunk] = []
        try:
            while len(chunks) <= request.num_frames:
                chunk = _in_thread("next_chunk", self.timeout, stream.next_chunk, _Probe())
                if chunk is None:
                    break
                chunks.append(chunk)
        except _Hung as exc:
            self.fail("deferred", f"{exc} (a stream whose chunks were not decoded yet)")
            raise _Skip from exc
        except BaseException as exc:  # the engine's own error, reported under this rule
            self.fail("deferred", f"next_chunk raised {exc!r} before its chunks were decoded")
            return
        finally:
            self.close(stream, "with its chunks not decoded yet")

        def decode_all() -> list[np.ndarray]:
            return [
                frames_to_uint8_array(chunk.frames, width=request.width, height=request.height)
                for chunk in chunks
            ]

        try:
            later = _in_thread("DeferredFrames.decode()", self.timeout, decode_all)
        except _Hung as exc:
            self.fail("deferred", str(exc))
            raise _Skip from exc
        except Exception as exc:
            self.fail("deferred", f"decoding after the stream's close raised {exc!r}")
            return
        finally:
            for chunk in chunks:
                release_frames(chunk.frames)
        if len(later) != len(full.frames):
            self.fail(
                "deferred", f"{len(later)} chunks, where the full run made {len(full.frames)}"
            )
            return
        for index, (a, b) in enumerate(zip(later, full.frames, strict=True)):
            if _max_difference(a, b) > self.batch_atol:
                self.fail(
                    "deferred",
                    f"chunk {index} decoded after the stream's next chunk and close differs "
                    "from the same chunk decoded at once: what a decode needs (the latents, a "
                    "decoder cache) must be the frames' own, not the stream's",
                )
                return
        stream = self.open(request, "a stream whose chunks were decoded after its close")
        try:
            chunk = _in_thread("next_chunk", self.timeout, stream.next_chunk, _Probe())
            if chunk is not None:
                release_frames(chunk.frames)
                release_frames(chunk.frames)  # the server may release twice
        except _Hung as exc:
            self.fail("deferred", f"{exc} (a chunk released, not decoded)")
            raise _Skip from exc
        except BaseException as exc:
            self.fail("deferred", f"releasing a chunk's frames raised {exc!r}")
        finally:
            self.close(stream, "after a chunk was released, not decoded")

    def check_stopped(self, what: str, probe: _Probe, run: _Run) -> None:
        if probe.calls_after_stop:
            self.fail(
                "stop",
                f"{what}: the engine called the checkpoint {probe.calls_after_stop} more "
                "time(s) after it raised: let its exception propagate (never catch "
                "BaseException around a checkpoint)",
                once="again",
            )
        elif not isinstance(run.error, CheckpointStopped):
            self.fail(
                "stop",
                f"{what}: next_chunk {run.ending()} instead of raising the checkpoint's "
                "exception: let it propagate",
                once="propagate",
            )

    def interaction(self, event_id: str, window_offset: float = 0.0) -> PromptChange | None:
        """A change of a kind the engine takes (a prompt, else a camera); None if none."""
        kinds = interaction_kinds(self.engine)
        if "prompt" in kinds:
            return PromptChange(event_id, "a blue square moving up", 0, window_offset=window_offset)
        if "camera" in kinds:
            camera = Camera("velocity", (0.0, 0.0, 1.0), (0.0, 0.0, 0.0, 1.0))
            return PromptChange(event_id, None, 0, camera, window_offset=window_offset)
        return None

    def check_interact(self, full: _Run) -> None:
        """A change arrives while ``next_chunk`` waits in the last checkpoint of chunk 0,
        as one from a client arrives while the engine works: ``interact`` must return
        then, and the change start at chunk 1.

        Listing it in chunk 1's ``started_event_ids`` is what the server counts on: an
        interaction is pending until a chunk lists it there, and a session may have at
        most `protocol.MAX_PENDING_INTERACTIONS` pending (`trio_vstream.interaction_queue`),
        so an engine that never lists them ends its sessions' video requests after 64."""
        change = self.interaction("check-engine-1")
        if change is None:
            return
        if not full.steps_per_chunk or not full.steps_per_chunk[0]:
            return  # no checkpoint to wait in (the checkpoint rule said so)
        stream = self.open(self.request)
        probe = _Probe(park_at=full.steps_per_chunk[0])
        queued = False
        first: list[_Run] = []
        making = threading.Thread(
            target=lambda: first.append(self.drive(stream, probe, 1, here=True)),
            name="check_engine: next_chunk",
            daemon=True,
        )
        making.start()
        try:
            if not probe.parked.wait(self.timeout):
                self.fail(
                    "interact",
                    f"next_chunk did not reach checkpoint {probe.park_at} "
                    f"within {self.timeout:g} s",
                )
                raise _Skip
            try:
                _in_thread("interact", self.timeout, stream.interact, change)
                queued = True
            except _Hung:
                self.fail(
                    "interact",
                    "interact did not return while next_chunk waited in a checkpoint: it "
                    "must only queue the change (PromptSchedule does), never wait for the chunk",
                )
            except Exception as exc:
                self.fail("interact", f"interact raised {exc!r}")
        finally:
            probe.unpark.set()
        making.join(self.timeout)
        if not first:
            self.fail("interact", f"next_chunk did not return within {self.timeout:g} s")
            raise _Skip
        if queued and first[0].error is None and len(full.chunks) > 1:
            try:
                following = self.drive(stream, probe, 1, made=len(first[0].chunks))
            except _Hung as exc:
                self.fail("interact", f"{exc} (the chunk after an interaction)")
                raise _Skip from exc
            self.check_started(change.event_id, first[0], following)
        elif first[0].error is not None:
            self.fail("interact", f"next_chunk {first[0].ending()} after an interaction")
        self.close(stream, "after an interaction")

    def check_window_offset(self, full: _Run) -> None:
        """A change received halfway through chunk 1's action window (a paced session's,
        ``window_offset`` 0.5) starts at chunk 1 like any other: an engine may place it
        inside the chunk or apply it from the chunk's start, but never drop or defer it."""
        change = self.interaction("check-engine-offset", window_offset=0.5)
        if change is None or len(full.chunks) < 2:
            return
        stream = self.open(self.request)
        try:
            first = self.drive(stream, _Probe(), 1)
            if first.error is not None or not first.chunks:
                self.fail("interact", f"next_chunk {first.ending()} before a mid-window change")
                self.close(stream, "after a failed chunk")
                return
            try:
                _in_thread("interact", self.timeout, stream.interact, change)
            except Exception as exc:  # _Hung too: interact must only queue
                self.fail("interact", f"interact({change!r}) raised {exc!r}")
                raise _Skip from exc
            following = self.drive(stream, _Probe(), 1, made=1)
        except _Hung as exc:
            self.fail("interact", f"{exc} (a change with window_offset 0.5)")
            raise _Skip from exc
        self.close(stream, "after a mid-window change")
        if following.error is not None:
            self.fail(
                "interact", f"a change with window_offset 0.5: next_chunk {following.ending()}"
            )
        elif not any(change.event_id in chunk.started_event_ids for chunk in following.chunks):
            self.fail(
                "interact",
                "a change with window_offset 0.5 is not in the next chunk's "
                "started_event_ids: place it in the chunk or apply it from the chunk's "
                "start, but start it there",
            )

    def check_started(self, event_id: str, first: _Run, following: _Run) -> None:
        if following.error is not None:
            self.fail(
                "interact", f"the chunk after an interaction: next_chunk {following.ending()}"
            )
        elif any(event_id in chunk.started_event_ids for chunk in first.chunks):
            self.fail(
                "interact",
                "a change that arrived while chunk 0 was being made started in chunk 0: "
                "queue it for the next chunk boundary",
            )
        elif not any(event_id in chunk.started_event_ids for chunk in following.chunks):
            self.fail(
                "interact",
                "the chunk after an interaction does not list it in started_event_ids: "
                "a change starts at the next chunk",
            )

    def check_batching(self) -> None:
        """Streams stepped together make the frames they make stepped alone."""
        rows = min(max_batch(self.engine), 3)
        if rows < 2:
            return
        seed = self.request.seed or 0
        requests = [
            attrs.evolve(self.request, request_id=f"{self.request.request_id}-{i}", seed=seed + i)
            for i in range(rows)
        ]
        alone = []
        for request in requests:
            stream = self.open(request)
            try:
                alone.append(self.drive(stream, _Probe(), self.chunks, request))
            except _Hung as exc:
                self.fail("batching", f"{exc} (a stream stepped alone)")
                raise _Skip from exc
            self.close(stream, "after the stream ended")
        batcher = _Batcher(max_batch(self.engine), len(requests))
        streams = [self.open(request) for request in requests]
        together: dict[int, _Run] = {}

        def step_together(i: int) -> None:
            try:
                probe = _Probe(batcher=batcher)
                together[i] = self.drive(streams[i], probe, self.chunks, requests[i], here=True)
            finally:
                batcher.stream_done()

        threads = [
            threading.Thread(
                target=step_together, args=(i,), name="check_engine: batched", daemon=True
            )
            for i in range(len(requests))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.timeout)
        if len(together) < len(requests):
            batcher.give_up()
            self.fail("batching", f"streams stepped together did not end within {self.timeout:g} s")
            raise _Skip
        for stream in streams:
            self.close(stream, "after the stream ended")
        for i, (request, single) in enumerate(zip(requests, alone, strict=True)):
            self.compare(request.request_id, together[i], single, max(batcher.sizes, default=0))

    def compare(self, request_id: str, together: _Run, alone: _Run, largest: int) -> None:
        for run, how in ((together, "together"), (alone, "alone")):
            if run.error is not None:
                self.fail("batching", f"{request_id}, stepped {how}: next_chunk {run.ending()}")
                return
        if len(together.frames) != len(alone.frames):
            self.fail(
                "batching",
                f"{request_id}: {len(together.frames)} chunks stepped "
                f"together, {len(alone.frames)} alone",
            )
            return
        for index, (a, b) in enumerate(zip(together.frames, alone.frames, strict=True)):
            difference = _max_difference(a, b)
            if difference > self.batch_atol:
                self.fail(
                    "batching",
                    f"{request_id}, chunk {index}: the frames stepped together (batches of "
                    f"up to {largest} rows) differ from those stepped alone by up to "
                    f"{difference} levels (allowed: {self.batch_atol})",
                    once="differ",
                )
                return


def _max_difference(a: np.ndarray, b: np.ndarray) -> int:
    """The largest difference between two chunks' frames, in levels (255 if their shapes
    differ)."""
    if a.shape != b.shape:
        return 255
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max(initial=0))
