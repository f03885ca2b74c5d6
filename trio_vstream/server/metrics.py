"""Prometheus figures of one server, served as text at ``GET /metrics``.

Each server has its own registry (not the library's global one), so that
several servers in one process (tests, benchmarks) never mix their figures.
Every figure carries a ``model`` label: a scrape that federates several
servers, one per GPU, can still tell them apart. Durations are seconds on
Trio's clock, measured where the work happens (the session).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from trio_vstream.server.access import Refusal

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""From a millisecond (a free slot, a small encode) to a minute (a large model's chunk)."""

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The figures a server records; ``exposition()`` is the ``/metrics`` body."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model = model
        self._abandoned_counted = 0
        """Abandoned engine calls counted so far (see `engine_calls_abandoned`)."""
        registry = self.registry

        def histogram(name: str, documentation: str) -> Histogram:
            return Histogram(
                name,
                documentation,
                ["model"],
                registry=registry,
                buckets=LATENCY_BUCKETS,
            )

        self._sessions_active = Gauge(
            "trio_vstream_sessions_active",
            "Sessions running now (from the first message to the close).",
            ["model"],
            registry=registry,
        )
        self._sessions_ended = Counter(
            "trio_vstream_sessions_ended",
            "Sessions ended, by how they ended.",
            ["model", "outcome"],
            registry=registry,
        )
        self._video_start = histogram(
            "trio_vstream_video_start_seconds",
            "session.start received to video.start sent (validation, encoder, engine stream).",
        )
        self._first_chunk = histogram(
            "trio_vstream_first_chunk_seconds",
            "session.start received to the first media chunk sent.",
        )
        self._stop_to_done = histogram(
            "trio_vstream_stop_to_done_seconds",
            "session.stop received to session.done sent.",
        )
        self._encode = histogram(
            "trio_vstream_encode_seconds", "Encoding one chunk (array conversion and H.264)."
        )
        self._engine = histogram(
            "trio_vstream_engine_chunk_seconds",
            "The engine making one chunk, not counting its waits for engine slots.",
        )
        self._encode_wait = histogram(
            "trio_vstream_encode_queue_wait_seconds",
            "Waiting for a server-wide encode slot, per chunk.",
        )
        self._engine_wait = histogram(
            "trio_vstream_engine_queue_wait_seconds",
            "Waiting for the engine (step slots, or its own lock), per chunk.",
        )
        self._frames_sent = Counter(
            "trio_vstream_frames_sent",
            "Video frames sent to clients.",
            ["model"],
            registry=registry,
        )
        self._bytes_sent = Counter(
            "trio_vstream_bytes_sent",
            "Video bytes (fragmented MP4) sent to clients.",
            ["model"],
            registry=registry,
        )
        self._batch_rows = Histogram(
            "trio_vstream_batch_rows",
            "Rows (sessions' steps) per batched engine step, for engines that batch.",
            ["model"],
            registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self._viewers_active = Gauge(
            "trio_vstream_viewers_active",
            "Viewers connected to a session's watch link now.",
            ["model"],
            registry=registry,
        )
        self._viewers_dropped = Counter(
            "trio_vstream_viewers_dropped",
            "Viewers closed (viewer_too_slow) for falling too far behind their stream.",
            ["model"],
            registry=registry,
        )
        self._viewer_chunks_skipped = Counter(
            "trio_vstream_viewer_chunks_skipped",
            "Chunks a slow viewer missed because its queue was full (it resumes at a keyframe).",
            ["model"],
            registry=registry,
        )
        self._viewers_relayed = Counter(
            "trio_vstream_viewers_relayed",
            "Viewers whose watch link named another node of the fleet, relayed to it.",
            ["model"],
            registry=registry,
        )
        self._auth_refused = Counter(
            "trio_vstream_auth_refused",
            "Requests refused for their API key, by reason: missing, invalid, too_many (more "
            "than one key entry), not_admin (an endpoint that needs an admin key).",
            ["model", "reason"],
            registry=registry,
        )
        for reason in Refusal:
            self._auth_refused.labels(model, reason.value)
        self._sessions_refused = Counter(
            "trio_vstream_sessions_refused",
            "New sessions refused before their WebSocket upgrade (HTTP 503, so that a "
            "balancer tries another server), by reason: server_busy (no session slot free).",
            ["model", "reason"],
            registry=registry,
        )
        self._sessions_refused.labels(model, "server_busy")
        self._host_refused = Counter(
            "trio_vstream_host_refused",
            "Requests refused for a Host this server does not serve (DNS rebinding, or a "
            "name missing from --allowed-hosts).",
            ["model"],
            registry=registry,
        )
        self._engine_calls_abandoned = Counter(
            "trio_vstream_engine_calls_abandoned",
            "Engine calls still running in their threads when their sessions ended (stuck "
            "outside a checkpoint): the session ended without them.",
            ["model"],
            registry=registry,
        )
        self._engine_calls_outstanding = Gauge(
            "trio_vstream_engine_calls_outstanding",
            "Abandoned engine calls still running now; /health answers 503 while as many "
            "run as --max-stuck-calls (the engine is wedged).",
            ["model"],
            registry=registry,
        )
        self._engine_wedged = Counter(
            "trio_vstream_engine_wedged",
            "Times the engine became wedged: as many abandoned engine calls running at "
            "once as --max-stuck-calls (new sessions are refused with engine_unavailable).",
            ["model"],
            registry=registry,
        )
        # Labelled children exist from the start, so a fresh server exposes zeros
        # rather than nothing.
        for metric in (
            self._sessions_active,
            self._engine_calls_abandoned,
            self._engine_calls_outstanding,
            self._engine_wedged,
            self._frames_sent,
            self._bytes_sent,
            self._viewers_active,
            self._viewers_dropped,
            self._viewer_chunks_skipped,
            self._host_refused,
        ):
            metric.labels(model)
        for hist in (
            self._video_start,
            self._first_chunk,
            self._stop_to_done,
            self._encode,
            self._engine,
            self._encode_wait,
            self._engine_wait,
            self._batch_rows,
        ):
            hist.labels(model)

    def session_started(self) -> None:
        self._sessions_active.labels(self.model).inc()

    def session_ended(self, outcome: str) -> None:
        self._sessions_active.labels(self.model).dec()
        self._sessions_ended.labels(self.model, outcome).inc()

    def video_started(self, seconds: float) -> None:
        self._video_start.labels(self.model).observe(seconds)

    def first_chunk_sent(self, seconds: float) -> None:
        self._first_chunk.labels(self.model).observe(seconds)

    def stopped(self, seconds: float) -> None:
        self._stop_to_done.labels(self.model).observe(seconds)

    def chunk_encoded(self, seconds: float, waited: float) -> None:
        self._encode.labels(self.model).observe(seconds)
        self._encode_wait.labels(self.model).observe(waited)

    def chunk_generated(self, seconds: float, waited: float) -> None:
        self._engine.labels(self.model).observe(seconds)
        self._engine_wait.labels(self.model).observe(waited)

    def chunk_sent(self, frames: int, size: int) -> None:
        self._frames_sent.labels(self.model).inc(frames)
        self._bytes_sent.labels(self.model).inc(size)

    def viewer_joined(self) -> None:
        self._viewers_active.labels(self.model).inc()

    def viewer_left(self) -> None:
        self._viewers_active.labels(self.model).dec()

    def viewer_dropped(self) -> None:
        self._viewers_dropped.labels(self.model).inc()

    def viewer_chunk_skipped(self) -> None:
        self._viewer_chunks_skipped.labels(self.model).inc()

    def viewer_relayed(self) -> None:
        self._viewers_relayed.labels(self.model).inc()

    def engine_calls_abandoned(self, total: int, running: int) -> None:
        """The server's abandoned engine calls (`AbandonedCalls`): ``total`` ever, of
        which ``running`` still run. Told at every change, from one place, so that a
        step batcher's hung batch counts like a session's call."""
        counter = self._engine_calls_abandoned.labels(self.model)
        counter.inc(total - self._abandoned_counted)
        self._abandoned_counted = total
        self._engine_calls_outstanding.labels(self.model).set(running)

    def engine_wedged(self) -> None:
        self._engine_wedged.labels(self.model).inc()

    def batch_run(self, rows: int) -> None:
        self._batch_rows.labels(self.model).observe(rows)

    def auth_refused(self, reason: Refusal) -> None:
        self._auth_refused.labels(self.model, reason.value).inc()

    def session_refused(self, reason: str) -> None:
        """A new session's upgrade answered 503, for ``reason`` (an error code)."""
        self._sessions_refused.labels(self.model, reason).inc()

    def host_refused(self) -> None:
        self._host_refused.labels(self.model).inc()

    def follow_connections(self, connections: ConnectionCounts, per_address: RefusedCount) -> None:
        """Expose the server's connection slots and per-address cap
        (``trio_vstream.server.connections``), read at each scrape."""
        self.registry.register(_ConnectionFigures(connections, per_address, self.model))

    def follow_recordings(self, recordings: RecordingCounts) -> None:
        """Expose a recorder's counts (``--record``), read at each scrape."""
        self.registry.register(_RecordingFigures(recordings, self.model))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class ConnectionCounts(Protocol):
    """What `ServerMetrics.follow_connections` reads: a
    `trio_vstream.server.connections.ConnectionSlots`."""

    @property
    def open(self) -> int: ...
    @property
    def refused(self) -> int: ...
    @property
    def head_timeouts(self) -> int: ...


class RefusedCount(Protocol):
    """What `ServerMetrics.follow_connections` reads of a
    `trio_vstream.server.connections.PerAddress`."""

    @property
    def refused(self) -> int: ...


class _ConnectionFigures(Collector):
    """The connection slots' plain counters, read at scrape time: nothing to keep in step."""

    def __init__(
        self, connections: ConnectionCounts, per_address: RefusedCount, model: str
    ) -> None:
        self._connections = connections
        self._per_address = per_address
        self._model = model

    def collect(self) -> Iterator[Metric]:
        connections, labels = self._connections, [self._model]
        open_now = GaugeMetricFamily(
            "trio_vstream_connections_open",
            "Connections holding a connection slot now (the reserve for /health included).",
            labels=["model"],
        )
        open_now.add_metric(labels, connections.open)
        refused = CounterMetricFamily(
            "trio_vstream_connections_refused",
            "Connections turned away at the connection cap (a 503, or closed unanswered).",
            labels=["model"],
        )
        refused.add_metric(labels, connections.refused)
        head_timeouts = CounterMetricFamily(
            "trio_vstream_connections_head_timeouts",
            "Connections closed for not sending their request head within the head timeout.",
            labels=["model"],
        )
        head_timeouts.add_metric(labels, connections.head_timeouts)
        per_address = CounterMetricFamily(
            "trio_vstream_connections_refused_per_ip",
            "Connections turned away (429) for the connections their address held "
            "(--max-connections-per-ip).",
            labels=["model"],
        )
        per_address.add_metric(labels, self._per_address.refused)
        return iter((open_now, refused, head_timeouts, per_address))


class RecordingCounts(Protocol):
    """What `ServerMetrics.follow_recordings` reads: a `trio_vstream.outputs.recording.Recorder`."""

    @property
    def written(self) -> int: ...
    @property
    def dropped(self) -> int: ...
    @property
    def truncated(self) -> int: ...
    @property
    def active(self) -> int: ...


class _RecordingFigures(Collector):
    """The recorder counts its recordings in its writer threads; reading them at scrape
    time keeps those threads free of any metrics call."""

    def __init__(self, recordings: RecordingCounts, model: str) -> None:
        self._recordings = recordings
        self._model = model

    def collect(self) -> Iterator[Metric]:
        recordings, labels = self._recordings, [self._model]
        written = CounterMetricFamily(
            "trio_vstream_recordings_written",
            "Sessions recorded whole (--record): an MP4 and its JSON in place.",
            labels=["model"],
        )
        written.add_metric(labels, recordings.written)
        dropped = CounterMetricFamily(
            "trio_vstream_recordings_dropped",
            "Recordings dropped (the disk too slow or failing) or not begun (the "
            "--record-max-bytes limit reached); their sessions went on.",
            labels=["model"],
        )
        dropped.add_metric(labels, recordings.dropped)
        truncated = CounterMetricFamily(
            "trio_vstream_recordings_truncated",
            "Recordings stopped part-way at the --record-max-bytes limit (their JSON says so).",
            labels=["model"],
        )
        truncated.add_metric(labels, recordings.truncated)
        active = GaugeMetricFamily(
            "trio_vstream_recordings_active",
            "Recordings being written now.",
            labels=["model"],
        )
        active.add_metric(labels, recordings.active)
        return iter((written, dropped, truncated, active))
