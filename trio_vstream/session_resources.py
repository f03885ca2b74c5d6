"""What a session borrows from the server: its settings, the server's counters, the
engine and the limiters that all sessions share.

The server builds one `ServerResources` and hands it to every `Session`
(`trio_vstream.session`), which adds to the counters and takes turns through the
limiters; `GET /stats` and ``/metrics`` read what the sessions wrote. Plain values and
shared objects, no behaviour: the server's command line (``--stall-timeout``,
``--max-sessions``...) ends here, and a session reads nothing else of the server.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from trio_vstream import protocol
from trio_vstream.engine_calls import AbandonedCalls
from trio_vstream.engines.base import Engine
from trio_vstream.image_fetch import ImageFetchConfig
from trio_vstream.metrics import ServerMetrics
from trio_vstream.protocol import ErrorCode
from trio_vstream.steps import EngineProgress, StepBatcher
from trio_vstream.taps import TapFactory

ENGINE_CALLS_AT_ONCE = 64
"""Engine threads at once when a server does not size its own budget (tests, embedders):
`trio_vstream.server` sizes it from ``--max-sessions`` and ``--max-stuck-calls``."""

IMAGE_DECODES_AT_ONCE = 2
"""Conditioning images decoded at once, server-wide: each may take a few hundred MB
(an 8K picture, its RGB copy), so sixteen sessions starting together must not decode
sixteen at once. The header check (`trio_vstream.image_header`) bounds each one."""


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
    metrics: ServerMetrics = attrs.field(factory=lambda: ServerMetrics("unnamed"))
    batcher: StepBatcher | None = None
    """Runs the engine's batched steps, when it batches (its task belongs to the server)."""
    taps: TapFactory | None = None
    """Who follows each session's output (viewers, a recording); see `trio_vstream.taps`."""
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
    """The threads of engine calls (`trio_vstream.engine_calls`), which may never return:
    a call stuck for good keeps its token, so they have a budget of their own, and
    however many are stuck, the server's own work above still gets its threads."""
