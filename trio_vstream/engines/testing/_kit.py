"""What every rule's check shares: `Kit` (one `check_engine` run, and the engine's
calls made as the server makes them), `Run` (one stream driven), and `in_thread`.

The kit plays the server's part from threads, one per engine call as the server's worker
threads are, so an engine call that never returns is reported after ``timeout`` seconds
instead of hanging the test (`Hung`; its thread, a daemon, is left behind), and the checks
after it are skipped (`Skip`: the engine's state is unknown). The rules themselves are
one module each, functions of a `Kit`, which keeps this module to the calls they share.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import attrs
import numpy as np

from trio_vstream.engines.contract import (
    Chunk,
    Engine,
    EngineError,
    EngineStream,
    GenerationRequest,
)
from trio_vstream.engines.frames import frames_to_uint8_array
from trio_vstream.engines.interfaces import (
    AudioFormat,
    SupportsSeed,
    missing_members,
    supports_seed,
)
from trio_vstream.engines.testing._probe import Probe
from trio_vstream.engines.testing._report import Violation

T = TypeVar("T")


class Hung(Exception):
    """An engine call did not return in time; its thread is left behind."""


class Skip(Exception):
    """The checks after this one cannot run (the engine hung, or is no engine)."""


def in_thread(what: str, timeout: float, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread of its own, as the server calls an engine: its result, or
    its exception (a `CheckpointStopped` too) re-raised here; `Hung` after ``timeout``."""
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
        raise Hung(f"{what} did not return within {timeout:g} s")
    ok, value = done[0]
    if not ok:
        raise value
    return cast(T, value)


@attrs.define
class Run:
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


class Kit:
    """One `check_engine` run: the engine, the request, the violations found so far, and
    the engine's calls as the server makes them; each rule's module drives it."""

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

    def reported(self, rule: str, once: str) -> bool:
        """Whether a violation of ``rule`` recorded ``once`` that kind already."""
        return (rule, once) in self._kinds_seen

    def close_engine(self) -> None:
        close = getattr(self.engine, "close", None)
        if not callable(close):
            return  # no engine (check_interface said so)
        try:
            in_thread("engine.close()", self.timeout, close)
        except Hung as exc:
            self.fail("close", str(exc))
        except Exception as exc:
            self.fail("close", f"engine.close() raised {exc!r}")

    # -- the engine's calls, as the server makes them

    def open(self, request: GenerationRequest, after: str | None = None) -> EngineStream:
        """Open a stream (``after`` what, if the engine served another stream before that
        ended in a way worth naming); `Skip`, after saying why, when that fails."""
        rule, context = ("interface", "") if after is None else ("cancellation", f" after {after}")
        try:
            stream = in_thread("open_stream", self.timeout, self.engine.open_stream, request)
        except Hung as exc:
            self.fail(rule, f"{exc}{context}")
            raise Skip from exc
        except Exception as exc:
            self.fail(rule, f"open_stream raised {exc!r}{context}")
            raise Skip from exc
        if not isinstance(stream, EngineStream):
            missing = ", ".join(missing_members(stream, EngineStream))
            self.fail("interface", f"open_stream returned {stream!r}, which lacks {missing}")
            raise Skip
        if isinstance(stream, SupportsSeed) and not supports_seed(stream):
            self.fail(
                "interface", f"a stream's seed must be an int, got {stream.seed!r}", once="seed"
            )
        return stream

    def close(self, stream: EngineStream, after: str) -> None:
        try:
            in_thread("close()", self.timeout, stream.close)
        except Hung as exc:
            self.fail("close", f"{exc} {after}")
            raise Skip from exc
        except Exception as exc:
            self.fail("close", f"close() raised {exc!r} {after}", once="raised")

    def drive(
        self,
        stream: EngineStream,
        probe: Probe,
        limit: int | None,
        request: GenerationRequest | None = None,
        *,
        here: bool = False,
        made: int = 0,
    ) -> Run:
        """Call ``next_chunk`` until the stream ends, ``limit`` chunks are made, or it
        raises; check each chunk on the way (``made``: chunks the stream made before).
        Each call runs in a thread of its own (`Hung` propagates), or with ``here`` in
        this one, for a thread the caller watches."""
        request = request or self.request
        run = Run()
        # Every chunk has a frame at least: a stream that goes on for more than num_frames
        # chunks makes too many frames, which check_full_run reports.
        cap = request.num_frames + 1 if limit is None else limit
        while len(run.chunks) < cap:
            before = probe.steps
            try:
                if here:
                    chunk = stream.next_chunk(probe)
                else:
                    chunk = in_thread("next_chunk", self.timeout, stream.next_chunk, probe)
            except Hung:
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


def max_difference(a: np.ndarray, b: np.ndarray) -> int:
    """The largest difference between two chunks' frames, in levels (255 if their shapes
    differ)."""
    if a.shape != b.shape:
        return 255
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max(initial=0))
