"""A synthetic engine that records what the server did to it, for the guarantee tests."""

from __future__ import annotations

import threading
import time
from typing import Any

from trio_vstream.engines.base import Checkpoint, Chunk, GenerationRequest, PromptChange
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings, SyntheticStream


class InstrumentedStream:
    def __init__(self, engine: InstrumentedEngine, inner: SyntheticStream) -> None:
        self._engine = engine
        self._inner = inner
        self.request = inner._request
        self.closed = 0
        self.step_times: list[float] = []
        self.changes: list[PromptChange] = []
        self.threads_inside = 0

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        engine = self._engine

        def counting_checkpoint() -> None:
            checkpoint()
            # Only checkpoints that let the engine go on count as steps started.
            self.step_times.append(time.monotonic())

        with engine.lock:
            self.threads_inside += 1
        try:
            return self._inner.next_chunk(counting_checkpoint)
        finally:
            with engine.lock:
                self.threads_inside -= 1

    def interact(self, change: PromptChange) -> None:
        self.changes.append(change)
        self._inner.interact(change)

    def close(self) -> None:
        self.closed += 1
        self._inner.close()

    def steps_after(self, moment: float) -> int:
        return sum(1 for t in self.step_times if t > moment)


class InstrumentedEngine(SyntheticEngine):
    def __init__(self, settings: SyntheticSettings) -> None:
        super().__init__(settings)
        self.lock = threading.Lock()
        self.streams: list[InstrumentedStream] = []

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
