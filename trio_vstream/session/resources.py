"""What a session borrows from the server: its settings, the server's counters, the
engine and the limiters that all sessions share.

The server builds one `ServerResources` and hands it to every `Session`
(`trio_vstream.session.session`), which adds to the counters and takes turns through the
limiters; `GET /stats` and ``/metrics`` read what the sessions wrote. Plain values and
shared objects, no behaviour: the server's command line (``--stall-timeout``,
``--max-sessions``...) ends here, and a session reads nothing else of the server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from trio_vstream import protocol
from trio_vstream.engines.contract import Engine
from trio_vstream.media.image_fetch import ImageFetchConfig
from trio_vstream.outputs.taps import TapFactory
from trio_vstream.protocol import ErrorCode
from trio_vstream.scheduling.batcher import StepBatcher
from trio_vstream.scheduling.engine_calls import AbandonedCalls
from trio_vstream.scheduling.progress import EngineProgress

ENGINE_CALLS_AT_ONCE = 64
"""Engine threads at once when a server does not size its own budget (tests, embedders):
`trio_vstream.server.app` sizes it from ``--max-sessions`` and ``--max-stuck-calls``."""

IMAGE_DECODES_AT_ONCE = 2
"""Conditioning images decoded at once, server-wide: each may take a few hundred MB
(an 8K picture, its RGB copy), so sixteen sessions starting together must not decode
sixteen at once. The header check (`trio_vstream.media.image_header`) bounds each one."""


class SessionMetrics(Protocol):
    """What a session reports as it runs, for ``/metrics``.

    The server's `ServerMetrics` (`trio_vstream.server.metrics`, Prometheus) is one; a
    Protocol here because the session sits below the server and imports nothing of it.
    Durations are seconds on Trio's clock.
    """

    def session_started(self) -> None: ...
    def session_ended(self, outcome: str) -> None: ...
    def video_started(self, seconds: float) -> None: ...
    def first_chunk_sent(self, seconds: float) -> None: ...
    def stopped(self, seconds: float) -> None: ...
    def chunk_encoded(self, seconds: float, waited: float) -> None: ...
    def chunk_generated(self, seconds: float, waited: float) -> None: ...
    def chunk_sent(self, frames: int, size: int) -> None: ...


class Uncounted:
    """`SessionMetrics` that counts nothing: a session run without a server (tests,
    embedders) reports to it."""

    def session_started(self) -> None:
        pass

    def session_ended(self, outcome: str) -> None:
        pass

    def video_started(self, seconds: float) -> None:
        pass

    def first_chunk_sent(self, seconds: float) -> None:
        pass

    def stopped(self, seconds: float) -> None:
        pass

    def chunk_encoded(self, seconds: float, waited: float) -> None:
        pass

    def chunk_generated(self, seconds: float, waited: float) -> None:
        pass

    def chunk_sent(self, frames: int, size: int) -> None:
        pass


@attrs.frozen(kw_only=True)
class SessionConfig:
    """Per-session timeouts and limits (the reference's defaults)."""

    start_timeout: float = 10.0
    stall_timeout: float = 60.0
    close_timeout: float = 5.0
    """How long to wait for a last message to go out and for the client's close reply."""
    limits: protocol.Limits = protocol.DEFAULT_LIMITS
    served_model: str | None = None
    image_urls: ImageFetchConfig = attrs.field(factory=ImageFetchConfig)
    """Whether (off by default), from where and how ``image_reference`` https URLs are fetched."""


@attrs.define
class ServerCounters:
    """The server's counters (every session adds to them), read by `GET /stats`, tests and
    benchmarks."""

    sessions_active: int = 0
    streams_open: int = 0
    worker_threads: int = 0
    sessions_total: int = 0
    chunks_sent: int = 0
    engine_cpu_seconds: float = 0.0
    """CPU time of the threads that ran the engines' ``next_chunk`` calls, while in them
    (`EngineCall.cpu_seconds`): what generating cost this process, which the benchmark
    tells apart from what serving cost. Threads the engine starts itself (a BLAS pool,
    a CUDA driver's) are not in it."""


@attrs.frozen
class ServerResources:
    """What a session borrows from the server."""

    engine: Engine
    config: SessionConfig
    stats: ServerCounters
    step_limiter: trio.CapacityLimiter | None
    thread_limiter: trio.CapacityLimiter
    """The server's own blocking work (encoder set-up and close, image decoding): work
    that always returns. Never shared with the engine's calls, which may not (below)."""
    encode_limiter: trio.CapacityLimiter
    engine_progress: EngineProgress = attrs.field(factory=EngineProgress)
    metrics: SessionMetrics = attrs.field(factory=Uncounted)
    batcher: StepBatcher | None = None
    """Runs the engine's batched steps, when it batches (its task belongs to the server)."""
    taps: TapFactory | None = None
    """Who follows each session's output (viewers, a recording); see `trio_vstream.outputs.taps`."""
    admit: Callable[[], tuple[ErrorCode, str] | None] | None = None
    """Asked when a valid ``session.start`` arrives: None gives the session a slot
    (``--max-sessions``), else the refusal it ends with (``server_busy``). Unset, every
    session is admitted."""
    image_limiter: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(IMAGE_DECODES_AT_ONCE)
    )
    """Bounds the image decodes of all sessions together (one per server)."""
    abandoned_calls: AbandonedCalls = attrs.field(factory=AbandonedCalls)
    """Engine calls still running after their sessions ended (``/health`` reads it)."""
    engine_limiter: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(ENGINE_CALLS_AT_ONCE)
    )
    """The threads of engine calls (`trio_vstream.scheduling.engine_calls`), which may never return:
    a call stuck for good keeps its token, so they have a budget of their own, and
    however many are stuck, the server's own work above still gets its threads."""
