#!/usr/bin/env python3
"""Benchmark harness for trio_vstream, or any server of the realtime video protocol.

``python bench/run.py --scenario all`` starts a server itself (``python -m trio_vstream
--port 0 ...``), or targets ``--url``, and measures over real sockets:

* ``latency``: one session at a time: connect, ``video.start``, time to first chunk (TTFC),
  chunk inter-arrival times, real-time factor; plus an in-process calibration of the
  engine's own time to its first chunk and of one chunk's encode, so that the server's
  transport overhead (TTFC minus the engine's time) is told apart from the model's;
* ``concurrency``: N sessions at once: aggregate and per-session delivered fps, fairness,
  and ``session.ping`` round trips sampled every 50 ms while the sessions stream;
* ``abort``: ``session.stop`` -> ``session.done``, and client disconnect -> engine stream
  closed (from ``GET /metrics``), alone and with other sessions streaming;
* ``resources``: server RSS per idle connection and per streaming session, and whether
  threads and engine streams return to their baseline;
* ``encoder``: ``FragmentedMP4Encoder`` cost per frame, as a share of the chunk period.

It talks to a server only through the WebSocket protocol and ``GET /metrics``, so it works
against any server of the protocol; figures that need ``/metrics`` are reported as
unavailable where a server has none. Results go to stdout (a markdown table and PASS/FAIL
per target) and to ``bench/results/`` (JSON with the machine, the settings, and every
figure with min/median/p99 and its per-run values). See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_client_stream

from trio_vstream import protocol

BENCH_DIR: Final = Path(__file__).resolve().parent
REPO_DIR: Final = BENCH_DIR.parent
RESULTS_DIR: Final = BENCH_DIR / "results"

SCENARIOS: Final = ("resources", "latency", "concurrency", "abort", "encoder")
"""In the order they run: resources first, so that its RSS figures start from a fresh
server rather than from whatever memory the other scenarios left to the allocator."""
SERVER_SCENARIOS: Final = SCENARIOS[:4]
CLIENT_MAX_MESSAGE: Final = 256 * 1024 * 1024
"""Chunks of large videos are big; the client must never be the one to refuse them."""
RECEIVE_BUFFER: Final = 256 * 1024
"""trio-websocket reads 4 KiB at a time by default, which at hundreds of frames per second
would make the client, not the server, the bottleneck."""
PROMPT: Final = "a lighthouse on a cliff at dusk, waves rolling in"
ENCODER_SIZES: Final = ((256, 256), (832, 480))

DEFAULT_ENGINE: Final = "synthetic"
DEFAULT_SYNTHETIC_ARGS: Final = (("chunk_frames", "16"), ("steps", "4"), ("step_delay", "0.01"))
"""The engine the targets are stated for: 16-frame chunks, 4 denoising steps of 10 ms each
(a GPU step modelled as a sleep, which releases the GIL like a CUDA synchronise)."""

now = time.monotonic
"""CLOCK_MONOTONIC, like the server's /metrics timestamps: comparable on one Linux host."""

_START_TIME = now()


def progress(message: str) -> None:
    """Long runs report on stderr, so that stdout stays the table."""
    print(f"[{now() - _START_TIME:7.1f}s] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Statistics and figures
# --------------------------------------------------------------------------------------

CATALOGUE: Final[dict[str, tuple[str, str]]] = {
    "calib.engine_first_chunk_ms": (
        "ms",
        "engine alone (in the harness process): open_stream + first next_chunk",
    ),
    "calib.encode_first_chunk_ms": (
        "ms",
        "encoder alone: the first chunk (init segment + IDR) with a fresh encoder",
    ),
    "calib.encoder_open_ms": ("ms", "encoder alone: opening libx264"),
    "latency.connect_ms": ("ms", "TCP connect + WebSocket handshake"),
    "latency.video_start_ms": ("ms", "session.start sent -> video.start received"),
    "latency.ttfc_ms": ("ms", "session.start sent -> first media chunk received (TTFC)"),
    "latency.interarrival_ms": ("ms", "time between consecutive media chunks"),
    "latency.rtf": ("x", "real-time factor: media seconds per wall second, start -> last chunk"),
    "latency.transport_overhead_ms": (
        "ms",
        "median TTFC minus the engine's median time to its first chunk (one value per run)",
    ),
    "concurrency.n{N}.aggregate_fps": ("fps", "N sessions: frames/s delivered, all together"),
    "concurrency.n{N}.session_fps": ("fps", "N sessions: frames/s delivered to each session"),
    "concurrency.n{N}.fairness": ("ratio", "N sessions: slowest / fastest session's fps"),
    "concurrency.n{N}.ping_rtt_ms": ("ms", "N sessions: session.ping -> session.pong"),
    "concurrency.n{N}.pings_unanswered": ("count", "N sessions: pings without a pong"),
    "concurrency.n{N}.errors": ("count", "N sessions: sessions that failed"),
    "concurrency.n{N}.client_lag_ms": (
        "ms",
        "N sessions: the harness's own event loop waking late (10 ms sleeps)",
    ),
    "concurrency.n{N}.server_cpu_cores": ("cores", "N sessions: server process CPU use"),
    "concurrency.n{N}.client_cpu_cores": ("cores", "N sessions: harness process CPU use"),
    "abort.{P}.stop_done_ms": ("ms", "session.stop sent -> session.done received"),
    "abort.{P}.stop_not_done": ("count", "stops not answered by session.done (stopped)"),
    "abort.{P}.disconnect_closed_ms": (
        "ms",
        "client cuts TCP -> server's engine stream closed (stream_closed_at in /metrics)",
    ),
    "abort.{P}.disconnect_ended_ms": ("ms", "client cuts TCP -> server's session handler ended"),
    "resources.rss_idle_connection_kib": ("KiB", "server RSS per idle WebSocket connection"),
    "resources.rss_streaming_session_mib": ("MiB", "server RSS per streaming session"),
    "resources.threads_alive_streaming": ("threads", "server threads_alive while streaming"),
    "resources.rss_retained_mib": (
        "MiB",
        "server RSS after the run (no session, threads back) minus RSS before it",
    ),
    "resources.threads_return_s": (
        "s",
        "after the last session: until threads_alive is back at its baseline",
    ),
    "encoder.{S}.ms_per_frame": ("ms", "FragmentedMP4Encoder.encode per frame"),
    "encoder.{S}.chunk_ms": ("ms", "encode of one chunk"),
    "encoder.{S}.first_chunk_ms": ("ms", "encode of the first chunk (init segment + IDR)"),
    "encoder.{S}.chunk_period_share_pct": ("%", "encode time / chunk period"),
}


def catalogue_key(name: str) -> str:
    """``concurrency.n8.ping_rtt_ms`` -> ``concurrency.n{N}.ping_rtt_ms``, and so on."""
    name = re.sub(r"^concurrency\.n\d+\.", "concurrency.n{N}.", name)
    name = re.sub(r"^abort\.(idle|load)\.", "abort.{P}.", name)
    return re.sub(r"^encoder\.\d+x\d+\.", "encoder.{S}.", name)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, Any]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"n": 0, "min": None, "median": None, "p99": None, "max": None}
    return {
        "n": len(finite),
        "min": min(finite),
        "median": percentile(finite, 50),
        "p99": percentile(finite, 99),
        "max": max(finite),
    }


@attrs.define
class Figure:
    """One measured quantity: its samples, kept per run so that the spread can be shown."""

    name: str
    runs: list[list[float]] = attrs.field(factory=list)

    @property
    def unit(self) -> str:
        return CATALOGUE[catalogue_key(self.name)][0]

    @property
    def description(self) -> str:
        return CATALOGUE[catalogue_key(self.name)][1]

    @property
    def pooled(self) -> list[float]:
        return [v for run in self.runs for v in run]

    def to_json(self) -> dict[str, Any]:
        runs = [{**summarize(vs), "values": [round(v, 4) for v in vs]} for vs in self.runs]
        return {
            "unit": self.unit,
            "description": self.description,
            **summarize(self.pooled),
            "run_medians": [r["median"] for r in runs],
            "runs": runs,
        }


class Figures:
    """Every figure of one target (or of the local, server-less measurements)."""

    def __init__(self) -> None:
        self._figures: dict[str, Figure] = {}
        self._unavailable: dict[str, str] = {}

    def add(self, run: int, name: str, values: Iterable[float]) -> None:
        if catalogue_key(name) not in CATALOGUE:
            raise KeyError(f"figure {name!r} is not in the catalogue")
        figure = self._figures.setdefault(name, Figure(name))
        while len(figure.runs) <= run:
            figure.runs.append([])
        figure.runs[run].extend(float(v) for v in values)

    def mark_unavailable(self, name: str, reason: str) -> None:
        self._unavailable.setdefault(name, reason)

    @property
    def unavailable(self) -> dict[str, str]:
        return {k: v for k, v in self._unavailable.items() if k not in self._figures}

    def get(self, name: str) -> Figure | None:
        return self._figures.get(name)

    def stat(self, name: str, key: str) -> float | None:
        figure = self._figures.get(name)
        return None if figure is None else summarize(figure.pooled)[key]

    def __iter__(self) -> Iterator[Figure]:
        return iter(self._figures.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "figures": {name: fig.to_json() for name, fig in self._figures.items()},
            "unavailable": self.unavailable,
        }


# --------------------------------------------------------------------------------------
# Settings and targets
# --------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Settings:
    """What one benchmark does; written to the JSON so that a result can be reproduced."""

    scenarios: tuple[str, ...]
    repeat: int = 3
    quick: bool = False
    width: int = 832
    height: int = 480
    fps: int = 24
    levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    latency_sessions: int = 5
    latency_frames: int = 192
    window_s: float = 4.0
    """Measured seconds per concurrency level, once every session has its first chunk."""
    stream_frames: int = 2400
    """num_frames of sessions meant to stream until stopped (the server's default maximum)."""
    ping_interval_s: float = 0.05
    abort_samples: int = 20
    """Per phase and run: with 3 runs, the p99 of 60 stops."""
    disconnect_samples: int = 8
    abort_load: int = 7
    """Other sessions streaming during the 'load' abort samples (7 + the one = 8)."""
    abort_jitter_s: float = 0.25
    """A stop lands at a random point of the engine's cycle, uniformly in this range."""
    idle_connections: int = 64
    """Many, because one costs little next to RSS noise (a started server gets a matching
    --max-sessions: an idle connection counts as a session)."""
    resource_sessions: int = 8
    encoder_chunks: int = 20
    calibration_reps: int = 10
    thread_wait_s: float = 15.0
    """How long to wait for threads to return to baseline; Trio's idle workers linger 10 s."""
    session_timeout_s: float = 60.0
    seed: int = 1

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @classmethod
    def quick_settings(cls, scenarios: tuple[str, ...], **overrides: Any) -> Settings:
        """Seconds, not minutes: every scenario runs, with few samples (for CI)."""
        base: dict[str, Any] = {
            "scenarios": scenarios,
            "repeat": 1,
            "quick": True,
            "levels": (1, 8),
            "latency_sessions": 2,
            "latency_frames": 64,
            "window_s": 0.6,
            "abort_samples": 2,
            "disconnect_samples": 1,
            "abort_load": 3,
            "abort_jitter_s": 0.1,
            "idle_connections": 4,
            "resource_sessions": 2,
            "encoder_chunks": 3,
            "calibration_reps": 2,
            "thread_wait_s": 12.0,
            "session_timeout_s": 20.0,
        }
        base.update(overrides)
        return cls(**base)


@attrs.frozen
class Endpoint:
    """A WebSocket URL taken apart; ``/metrics`` is plain HTTP on the same port."""

    url: str
    secure: bool
    host: str
    port: int
    resource: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError(f"not a ws:// or wss:// URL: {url!r}")
        secure = parts.scheme == "wss"
        resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(url, secure, parts.hostname, parts.port or (443 if secure else 80), resource)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port in (80, 443) else f"{host}:{self.port}"

    @property
    def is_local(self) -> bool:
        return self.host in ("localhost", "::1") or self.host.startswith("127.")

    async def open_stream(self) -> trio.SocketStream | trio.SSLStream[trio.SocketStream]:
        if self.secure:
            context = ssl.create_default_context()
            return await trio.open_ssl_over_tcp_stream(
                self.host, self.port, ssl_context=context, https_compatible=True
            )
        return await trio.open_tcp_stream(self.host, self.port)


@attrs.frozen
class Target:
    """A server to measure: a command that the harness starts, or a URL already serving."""

    label: str
    spec: str
    command: tuple[str, ...] | None
    url: str | None
    engine: str | None
    engine_args: tuple[tuple[str, str], ...]
    step_s: float | None
    """One engine step, for the abort target; None where unknown."""

    @property
    def calibratable(self) -> bool:
        """The synthetic engine is cheap to load in the harness; a model would load twice."""
        return self.engine == "synthetic"

    @property
    def shown(self) -> str:
        return self.url or shlex.join(self.command or ())


def _scan_engine(tokens: Sequence[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """``--engine`` and ``--engine-arg`` out of a server command line."""
    engine: str | None = None
    args: list[tuple[str, str]] = []
    i = 0
    while i < len(tokens):
        name, eq, value = tokens[i].partition("=")
        if name in ("--engine", "--engine-arg"):
            if not eq:
                if i + 1 >= len(tokens):
                    break
                i += 1
                value = tokens[i]
            if name == "--engine":
                engine = value
            else:
                key, _, arg = value.partition("=")
                args.append((key.strip(), arg))
        i += 1
    return engine, args


def make_target(
    label: str, spec: str, *, max_sessions_needed: int, declared_step: float | None = None
) -> Target:
    """A target from a spec: a ws:// URL, flags for ``python -m trio_vstream``, or a whole
    server command. ``--port 0`` is added where no port is given."""
    if re.match(r"^wss?://", spec):
        return Target(label, spec, None, spec, None, (), declared_step)
    tokens = shlex.split(spec)
    if not tokens or tokens[0].startswith("-"):
        command = [sys.executable, "-m", "trio_vstream", *tokens]
        engine, args = _scan_engine(tokens)
        engine = engine or DEFAULT_ENGINE
    else:
        command = list(tokens)
        engine, args = _scan_engine(tokens)
    flags = {token.split("=", 1)[0] for token in command}
    if "--port" not in flags:
        command += ["--port", "0"]
    if "--max-sessions" not in flags and max_sessions_needed > 16:
        command += ["--max-sessions", str(max_sessions_needed)]
    step = declared_step
    if step is None and engine == "synthetic":
        step = float(dict(args).get("step_delay", "0"))
    return Target(label, spec, tuple(command), None, engine, tuple(args), step)


# --------------------------------------------------------------------------------------
# The server process and its /metrics
# --------------------------------------------------------------------------------------

_URL_PATTERN: Final = re.compile(r"(wss?://[^\s'\"]+)")


class ServerProcess:
    """A server the harness started: its URL, its pid, and a guaranteed end.

    Its stdout and stderr go to a log file, not a pipe, so that a chatty server can never
    block on a full pipe; the URL line is found by reading the file.
    """

    def __init__(self, command: Sequence[str], log_path: Path) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.process: trio.Process | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def start(self, timeout: float) -> str:
        with self.log_path.open("wb") as log:
            self.process = await trio.lowlevel.open_process(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        with trio.move_on_after(timeout):
            while True:
                match = _URL_PATTERN.search(self.log_tail(lines=200))
                if match:
                    return match.group(1)
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"server exited with status {self.process.returncode} before serving:\n"
                        + self.log_tail()
                    )
                await trio.sleep(0.05)
        raise RuntimeError(f"server printed no ws:// URL in {timeout:.0f} s:\n{self.log_tail()}")

    async def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM (the server's graceful shutdown), then SIGKILL after ``grace`` seconds.
        Shielded, so that it also runs while the harness is being cancelled (Ctrl-C)."""
        process = self.process
        if process is None:
            return None
        with trio.CancelScope(shield=True):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(grace):
                    await process.wait()
            if process.poll() is None:
                progress(f"server {process.pid} ignored SIGTERM for {grace:.0f} s: killing it")
                process.kill()
                await process.wait()
        return process.returncode


async def fetch_metrics(endpoint: Endpoint, timeout: float = 5.0) -> dict[str, Any] | None:
    """``GET /metrics`` on the WebSocket's port; None where the server has none."""
    with trio.move_on_after(timeout):
        try:
            stream = await endpoint.open_stream()
        except OSError:
            return None
        data = bytearray()
        try:
            request = (
                f"GET /metrics HTTP/1.1\r\nHost: {endpoint.host_header}\r\n"
                "Accept: application/json\r\nConnection: close\r\n\r\n"
            )
            await stream.send_all(request.encode())
            while chunk := await stream.receive_some(65536):
                data += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return None
        finally:
            await stream.aclose()
        head, _, body = bytes(data).partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].split()
        if len(status) < 2 or status[1] != b"200":
            return None
        try:
            metrics = json.loads(body)
        except ValueError:
            return None
        return metrics if isinstance(metrics, dict) else None
    return None


def os_threads(pid: int | None) -> int | None:
    """Native threads of a server the harness started: x264's and OpenBLAS's included,
    which ``threading.active_count()`` in /metrics does not see."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def cpu_seconds(pid: int | str | None) -> float | None:
    """User + system CPU seconds of a process ("self": the harness), from /proc."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# --------------------------------------------------------------------------------------
# The client side of one session
# --------------------------------------------------------------------------------------


class SessionClient:
    """One WebSocket session, recorded message by message with monotonic timestamps.

    The harness owns the TCP stream (``wrap_client_stream``), so that it can cut it
    without a closing handshake, to measure what a vanished client costs the server.
    """

    def __init__(self, endpoint: Endpoint, start: str | None) -> None:
        self.endpoint = endpoint
        self.start = start
        self.t_connect: float | None = None
        self.t_connected: float | None = None
        self.t_start_sent: float | None = None
        self.t_video_start: float | None = None
        self.t_stop_sent: float | None = None
        self.t_disconnect: float | None = None
        self.t_terminal: float | None = None
        self.request_id: str | None = None
        self.arrivals: list[tuple[float, int, int]] = []
        """(time, frames, bytes) per media chunk."""
        self.terminal: str | None = None
        self.stopped: bool | None = None
        self.error: str | None = None
        self.failure: str | None = None
        self.protocol_problems: list[str] = []
        self.pings: list[tuple[float, float]] = []
        """(sent at, round trip) per answered ping."""
        self.pings_sent = 0
        self._ping_sent: deque[float] = deque()
        self.connected = trio.Event()
        self.first_chunk = trio.Event()
        self.finished = trio.Event()
        self._ws: WebSocketConnection | None = None
        self._stream: trio.abc.Stream | None = None
        self._send_lock = trio.Lock()

    @property
    def frames(self) -> int:
        return sum(frames for _, frames, _ in self.arrivals)

    @property
    def problem(self) -> str | None:
        """What went wrong, if anything, in one line."""
        problems = [p for p in (self.failure, self.error) if p] + self.protocol_problems[:3]
        return "; ".join(problems) or None

    async def run(self) -> None:
        """Connect, send the start, and read until the server closes. A server or network
        problem does not raise: it is recorded in ``failure`` for the scenario to report."""
        try:
            async with trio.open_nursery() as nursery:
                self.t_connect = now()
                self._stream = await self.endpoint.open_stream()
                self._ws = await wrap_client_stream(
                    nursery,
                    self._stream,  # type: ignore[arg-type]
                    self.endpoint.host_header,
                    self.endpoint.resource,
                    max_message_size=CLIENT_MAX_MESSAGE,
                    receive_buffer_size=RECEIVE_BUFFER,
                )
                self.t_connected = now()
                self.connected.set()
                if self.start is not None:
                    self.t_start_sent = now()
                    await self._send(self.start)
                await self._read(self._ws)
                # Let trio-websocket's reader finish the closing handshake, bounded.
                nursery.cancel_scope.deadline = trio.current_time() + 5
        except ConnectionClosed:
            pass
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if self.t_disconnect is None:
                self.failure = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a refused handshake, a protocol violation, ...
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            if self._stream is not None:
                with trio.CancelScope(shield=True):
                    await self._stream.aclose()
            for event in (self.connected, self.first_chunk, self.finished):
                event.set()

    async def _read(self, ws: WebSocketConnection) -> None:
        pending: protocol.ChunkMetadata | None = None
        while True:
            try:
                raw = await ws.get_message()
            except ConnectionClosed:
                return
            t = now()
            if isinstance(raw, bytes):
                if pending is None:
                    self.protocol_problems.append("binary message without chunk metadata")
                elif len(raw) != pending.byte_length:
                    self.protocol_problems.append(
                        f"byte_length {pending.byte_length} but {len(raw)} bytes arrived"
                    )
                elif pending.kind == "media":
                    self.arrivals.append((t, pending.num_frames, len(raw)))
                    self.first_chunk.set()
                pending = None
                continue
            try:
                message = protocol.parse_server_message(raw)
            except protocol.ProtocolError as exc:
                self.protocol_problems.append(exc.message)
                continue
            if isinstance(message, protocol.ChunkMetadata):
                pending = message
            elif isinstance(message, protocol.Pong):
                if self._ping_sent:
                    sent = self._ping_sent.popleft()
                    self.pings.append((sent, t - sent))
            elif isinstance(message, protocol.VideoStart):
                self.t_video_start = t
                self.request_id = message.request_id
            elif isinstance(message, protocol.SessionDone):
                self._terminal(t, "session.done")
                self.stopped = message.stopped
            elif isinstance(message, protocol.Error):
                self.error = f"error {message.code}: {message.message}"
                self.request_id = self.request_id or message.request_id
                # The harness sends no malformed control message, so any error it gets is
                # its session's terminal message.
                self._terminal(t, "error")

    def _terminal(self, t: float, kind: str) -> None:
        if self.terminal is None:
            self.terminal = kind
            self.t_terminal = t

    async def _send(self, message: str) -> None:
        async with self._send_lock:
            if self._ws is None:
                raise ConnectionClosed(None)  # type: ignore[arg-type]
            await self._ws.send_message(message)

    async def stop(self) -> None:
        self.t_stop_sent = now()
        try:
            await self._send(protocol.STOP_MESSAGE)
        except ConnectionClosed:
            self.failure = self.failure or "connection closed before session.stop"

    async def disconnect(self) -> None:
        """Cut the TCP connection without a WebSocket close, as a vanished client does."""
        self.t_disconnect = now()
        if self._stream is not None:
            await self._stream.aclose()

    async def close(self) -> None:
        """Hang up politely, with a close frame."""
        if self._ws is not None:
            with trio.move_on_after(5):
                await self._ws.aclose()

    async def ping_every(self, interval: float, until: trio.Event) -> None:
        """session.ping at a fixed cadence; pongs are matched to pings in FIFO order."""
        deadline = trio.current_time()
        while not until.is_set() and self.terminal is None and not self.finished.is_set():
            self._ping_sent.append(now())
            self.pings_sent += 1
            try:
                await self._send(protocol.PING_MESSAGE)
            except ConnectionClosed:
                return
            deadline = max(deadline + interval, trio.current_time())
            with trio.move_on_at(deadline):
                await until.wait()


async def wait_for(event: trio.Event, timeout: float) -> bool:
    with trio.move_on_after(timeout):
        await event.wait()
        return True
    return False


async def lag_monitor(samples: list[float], until: trio.Event, period: float = 0.01) -> None:
    """How late the harness's own event loop wakes up: when this is large, the round trips
    the harness measures include its own delay (on a small machine, CPU contention)."""
    while not until.is_set():
        before = trio.current_time()
        await trio.sleep(period)
        samples.append(max(0.0, trio.current_time() - before - period) * 1000)


# --------------------------------------------------------------------------------------
# One run against one target
# --------------------------------------------------------------------------------------


@attrs.define
class RunContext:
    target: Target
    endpoint: Endpoint
    settings: Settings
    figures: Figures
    run: int
    pid: int | None
    rng: random.Random
    checks: list[dict[str, Any]]
    has_metrics: bool = False
    clock_comparable: bool = False
    windows: list[dict[str, Any]] = attrs.field(factory=list)
    """Measurement windows (monotonic), to line results up with server-side logs."""

    def start_json(self, num_frames: int) -> str:
        s = self.settings
        return protocol.start_message(PROMPT, size=s.size, fps=s.fps, num_frames=num_frames)

    def client(self, num_frames: int | None = None) -> SessionClient:
        frames = self.settings.stream_frames if num_frames is None else num_frames
        return SessionClient(self.endpoint, self.start_json(frames))

    def add(self, name: str, values: Iterable[float]) -> None:
        self.figures.add(self.run, name, values)

    async def metrics(self) -> dict[str, Any] | None:
        return await fetch_metrics(self.endpoint) if self.has_metrics else None

    async def settle(self, timeout: float = 10.0) -> tuple[dict[str, Any] | None, float]:
        """Wait until the server has no session left (known only where it has /metrics)."""
        started = now()
        if not self.has_metrics:
            await trio.sleep(0.2)
            return None, now() - started
        metrics = None
        with trio.move_on_after(timeout):
            while True:
                metrics = await fetch_metrics(self.endpoint)
                if metrics is not None and metrics.get("sessions_active") == 0:
                    break
                await trio.sleep(0.02)
        return metrics, now() - started

    async def check_after(self, scenario: str) -> None:
        """After every scenario: no session, no engine stream, no running worker thread."""
        metrics, waited = await self.settle()
        check: dict[str, Any] = {"run": self.run, "scenario": scenario, "settle_s": waited}
        for key in ("sessions_active", "streams_open", "worker_threads", "threads_alive"):
            check[key] = metrics.get(key) if metrics else None
        check["rss_bytes"] = metrics.get("rss_bytes") if metrics else None
        check["os_threads"] = os_threads(self.pid)
        check["ok"] = None
        if metrics is not None:
            keys = ("sessions_active", "streams_open", "worker_threads")
            check["ok"] = all(check[key] == 0 for key in keys)
        self.checks.append(check)
        if check["ok"] is False:
            progress(f"  !! left over after {scenario}: {check}")


async def run_clients(
    clients: Sequence[SessionClient], body: Callable[[], Awaitable[None]], timeout: float
) -> None:
    """Run sessions concurrently while ``body`` drives them; then wait for all to end."""
    async with trio.open_nursery() as nursery:
        for client in clients:
            nursery.start_soon(client.run)
        await body()
        with trio.move_on_after(timeout):
            for client in clients:
                await client.finished.wait()
        nursery.cancel_scope.cancel()


async def run_one(
    client: SessionClient, timeout: float, act: Callable[[], Awaitable[None]]
) -> None:
    """Run one session; ``act`` drives it once its first chunk is in."""

    async def body() -> None:
        if await wait_for(client.first_chunk, timeout) and client.terminal is None:
            await act()

    await run_clients([client], body, timeout)
    if not client.finished.is_set():
        client.failure = client.failure or "timed out"


def report_failures(clients: Iterable[SessionClient], context: str) -> int:
    count = 0
    for client in clients:
        if client.problem:
            count += 1
            progress(f"  !! {context}: {client.problem}")
    return count


# ----------------------------------------------------------------------------- latency


def calibrate_engine(target: Target, s: Settings) -> dict[str, list[float]]:
    """The engine's own time to its first chunk (here, in a worker thread), and the encode
    of a first chunk with a fresh encoder: TTFC as it would be with a free transport."""
    from trio_vstream.encoding import FragmentedMP4Encoder
    from trio_vstream.engines import GenerationRequest, load_engine
    from trio_vstream.engines.base import frames_to_uint8_array

    assert target.engine is not None
    engine = load_engine(target.engine, dict(target.engine_args), device="auto")
    result: dict[str, list[float]] = {"engine": [], "encode": [], "open": []}
    try:
        for i in range(s.calibration_reps):
            request = GenerationRequest(
                request_id=f"calibration-{i}",
                prompt=PROMPT,
                width=s.width,
                height=s.height,
                fps=s.fps,
                num_frames=s.latency_frames,
            )
            t0 = time.perf_counter()
            stream = engine.open_stream(request)
            try:
                chunk = stream.next_chunk(lambda: None)
            finally:
                stream.close()
            t1 = time.perf_counter()
            assert chunk is not None
            encoder = FragmentedMP4Encoder(width=s.width, height=s.height, fps=s.fps)
            t2 = time.perf_counter()
            encoder.encode(frames_to_uint8_array(chunk.frames, width=s.width, height=s.height))
            t3 = time.perf_counter()
            encoder.close()
            result["engine"].append((t1 - t0) * 1000)
            result["open"].append((t2 - t1) * 1000)
            result["encode"].append((t3 - t2) * 1000)
    finally:
        engine.close()
    return result


async def scenario_latency(ctx: RunContext) -> None:
    s = ctx.settings
    if ctx.target.calibratable:
        calibration = await trio.to_thread.run_sync(calibrate_engine, ctx.target, s)
        ctx.add("calib.engine_first_chunk_ms", calibration["engine"])
        ctx.add("calib.encode_first_chunk_ms", calibration["encode"])
        ctx.add("calib.encoder_open_ms", calibration["open"])
    else:
        reason = "the engine is not loadable in the harness (only synthetic is)"
        for name in ("calib.engine_first_chunk_ms", "latency.transport_overhead_ms"):
            ctx.figures.mark_unavailable(name, reason)
    clients: list[SessionClient] = []
    for i in range(s.latency_sessions):
        client = ctx.client(s.latency_frames)
        await run_clients([client], trio.lowlevel.checkpoint, s.session_timeout_s)
        report_failures([client], f"latency session {i}")
        clients.append(client)
        await ctx.settle()
    good = [c for c in clients if c.arrivals and c.t_start_sent and not c.problem]
    ctx.add("latency.connect_ms", [(c.t_connected - c.t_connect) * 1000 for c in good])  # type: ignore[operator]
    ctx.add(
        "latency.video_start_ms",
        [(c.t_video_start - c.t_start_sent) * 1000 for c in good if c.t_video_start],  # type: ignore[operator]
    )
    ttfc = [(c.arrivals[0][0] - c.t_start_sent) * 1000 for c in good]  # type: ignore[operator]
    ctx.add("latency.ttfc_ms", ttfc)
    ctx.add(
        "latency.interarrival_ms",
        [
            (b[0] - a[0]) * 1000
            for c in good
            for a, b in zip(c.arrivals, c.arrivals[1:], strict=False)
        ],
    )
    ctx.add(
        "latency.rtf",
        [(c.frames / s.fps) / (c.arrivals[-1][0] - c.t_start_sent) for c in good],  # type: ignore[operator]
    )
    engine = ctx.figures.get("calib.engine_first_chunk_ms")
    if engine is not None and ttfc and len(engine.runs) > ctx.run:
        overhead = percentile(ttfc, 50) - percentile(engine.runs[ctx.run], 50)
        ctx.add("latency.transport_overhead_ms", [overhead])


# ------------------------------------------------------------------------- concurrency


def session_fps(client: SessionClient, start: float, end: float) -> float:
    """Frames per second one session received in the window ``[start, end]``.

    Chunks come whole (16 frames, maybe a second apart under load), so counting the frames
    that land in a short window is off by up to a chunk. With two or more chunks in the
    window, the rate from the first of them to the last has no such error.
    """
    inside = [(t, f) for t, f, _ in client.arrivals if start <= t <= end]
    if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
        return sum(f for _, f in inside[1:]) / (inside[-1][0] - inside[0][0])
    return sum(f for _, f in inside) / (end - start)


@attrs.define
class Window:
    """What one concurrency level saw while all its sessions streamed."""

    start: float = math.nan
    end: float = math.nan
    client_lag_ms: list[float] = attrs.field(factory=list)
    server_cpu: float | None = None
    client_cpu: float | None = None


async def _stream_and_ping(
    ctx: RunContext, clients: Sequence[SessionClient], window: Window
) -> None:
    s = ctx.settings
    with trio.move_on_after(s.session_timeout_s):
        for client in clients:
            await client.first_chunk.wait()
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        window.start = now()
        server0, client0 = cpu_seconds(ctx.pid), cpu_seconds("self")
        for client in clients:
            nursery.start_soon(client.ping_every, s.ping_interval_s, done)
        nursery.start_soon(lag_monitor, window.client_lag_ms, done)
        await trio.sleep(s.window_s)
        window.end = now()
        server1, client1 = cpu_seconds(ctx.pid), cpu_seconds("self")
        done.set()
    span = window.end - window.start
    if server0 is not None and server1 is not None:
        window.server_cpu = (server1 - server0) / span
    if client0 is not None and client1 is not None:
        window.client_cpu = (client1 - client0) / span
    for client in clients:
        await client.stop()


async def scenario_concurrency(ctx: RunContext) -> None:
    s = ctx.settings
    for level in s.levels:
        progress(f"  concurrency N={level}")
        clients = [ctx.client() for _ in range(level)]
        window = Window()
        body = functools.partial(_stream_and_ping, ctx, clients, window)
        await run_clients(clients, body, s.session_timeout_s)
        failures = report_failures(clients, f"concurrency N={level}")
        await ctx.settle()
        start, end = window.start, window.end
        if math.isnan(end):
            continue
        ctx.windows.append({"scenario": "concurrency", "level": level, "start": start, "end": end})
        prefix = f"concurrency.n{level}"
        frames = sum(f for c in clients for t, f, _ in c.arrivals if start <= t <= end)
        ctx.add(f"{prefix}.aggregate_fps", [frames / (end - start)])
        fps = [session_fps(client, start, end) for client in clients]
        ctx.add(f"{prefix}.session_fps", fps)
        if max(fps) > 0:
            ctx.add(f"{prefix}.fairness", [min(fps) / max(fps)])
        rtts = [rtt * 1000 for c in clients for sent, rtt in c.pings if start <= sent <= end]
        ctx.add(f"{prefix}.ping_rtt_ms", rtts)
        ctx.add(f"{prefix}.pings_unanswered", [sum(c.pings_sent - len(c.pings) for c in clients)])
        ctx.add(f"{prefix}.errors", [failures])
        ctx.add(f"{prefix}.client_lag_ms", window.client_lag_ms)
        if window.server_cpu is not None:
            ctx.add(f"{prefix}.server_cpu_cores", [window.server_cpu])
        if window.client_cpu is not None:
            ctx.add(f"{prefix}.client_cpu_cores", [window.client_cpu])


# ------------------------------------------------------------------------------- abort


async def _background(ctx: RunContext, count: int, ready: trio.Event, done: trio.Event) -> None:
    """``count`` sessions streaming until ``done``; a session that completes is replaced."""
    timeout = ctx.settings.session_timeout_s
    streaming = 0

    async def worker() -> None:
        nonlocal streaming
        counted = False
        while not done.is_set():
            client = ctx.client()

            async def body(client: SessionClient = client) -> None:
                nonlocal streaming, counted
                await wait_for(client.first_chunk, timeout)
                if not counted:
                    counted = True
                    streaming += 1
                    if streaming == count:
                        ready.set()
                async with trio.open_nursery() as race:
                    for event in (done, client.finished):
                        race.start_soon(_cancel_when, event, race.cancel_scope)
                if client.terminal is None:
                    await client.stop()

            await run_clients([client], body, timeout)
            report_failures([client], "abort: background session")

    if count == 0:
        ready.set()
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(worker)


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def scenario_abort(ctx: RunContext) -> None:
    s = ctx.settings
    for phase, load in (("idle", 0), ("load", s.abort_load)):
        progress(f"  abort, {phase}: {load} other sessions streaming")
        ready, done = trio.Event(), trio.Event()
        stops: list[SessionClient] = []
        cuts: list[SessionClient] = []
        modes = ["stop"] * s.abort_samples + ["disconnect"] * s.disconnect_samples
        ctx.rng.shuffle(modes)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_background, ctx, load, ready, done)
            await wait_for(ready, s.session_timeout_s)
            for mode in modes:
                client = ctx.client()

                async def act(client: SessionClient = client, mode: str = mode) -> None:
                    # A random point of the engine's cycle: mid-step, mid-encode, mid-send.
                    await trio.sleep(ctx.rng.uniform(0.0, s.abort_jitter_s))
                    await (client.stop() if mode == "stop" else client.disconnect())

                await run_one(client, s.session_timeout_s, act)
                report_failures([client], f"abort, {phase}: {mode}")
                (stops if mode == "stop" else cuts).append(client)
            done.set()
        stopped = [c for c in stops if c.terminal == "session.done" and c.stopped]
        ctx.add(
            f"abort.{phase}.stop_done_ms",
            [(c.t_terminal - c.t_stop_sent) * 1000 for c in stopped],  # type: ignore[operator]
        )
        ctx.add(f"abort.{phase}.stop_not_done", [len(stops) - len(stopped)])
        await ctx.settle()
        if not ctx.clock_comparable:
            reason = "needs /metrics with a time.monotonic() comparable to the harness's"
            ctx.figures.mark_unavailable(f"abort.{phase}.disconnect_closed_ms", reason)
            continue
        metrics = await ctx.metrics()
        recent = {r.get("request_id"): r for r in (metrics or {}).get("recent_sessions", [])}
        closed, ended = [], []
        for client in cuts:
            record = recent.get(client.request_id)
            if record is None or client.t_disconnect is None:
                continue
            if record.get("stream_closed_at") is not None:
                closed.append((record["stream_closed_at"] - client.t_disconnect) * 1000)
            if record.get("ended_at") is not None:
                ended.append((record["ended_at"] - client.t_disconnect) * 1000)
        ctx.add(f"abort.{phase}.disconnect_closed_ms", closed)
        ctx.add(f"abort.{phase}.disconnect_ended_ms", ended)


# --------------------------------------------------------------------------- resources


async def _sample_metrics(ctx: RunContext, count: int, interval: float) -> list[dict[str, Any]]:
    samples = []
    for _ in range(count):
        metrics = await ctx.metrics()
        if metrics and metrics.get("rss_bytes"):
            samples.append(metrics)
        await trio.sleep(interval)
    return samples


def _median_rss(samples: Sequence[dict[str, Any]]) -> float:
    return percentile([float(m["rss_bytes"]) for m in samples], 50)


async def scenario_resources(ctx: RunContext) -> None:
    s = ctx.settings
    if not ctx.has_metrics:
        for name in ("resources.rss_idle_connection_kib", "resources.rss_streaming_session_mib"):
            ctx.figures.mark_unavailable(name, "the server has no /metrics")
        return
    base = await _sample_metrics(ctx, 3, 0.05)
    idle = [SessionClient(ctx.endpoint, None) for _ in range(s.idle_connections)]
    with_idle: list[dict[str, Any]] = []

    held: list[SessionClient] = []

    async def hold_idle() -> None:
        for client in idle:
            await wait_for(client.connected, s.session_timeout_s)
        await trio.sleep(0.3)
        # A server with fewer session slots refuses the rest (server_busy): count only
        # the connections it holds.
        held.extend(c for c in idle if c.terminal is None and not c.finished.is_set())
        with_idle.extend(await _sample_metrics(ctx, 3, 0.1))
        for client in idle:
            await client.close()

    await run_clients(idle, hold_idle, s.session_timeout_s)
    report_failures(held, "resources: idle connection")
    if len(held) < len(idle):
        progress(f"  the server held {len(held)} of {len(idle)} idle connections")
    if base and with_idle and held:
        grown = _median_rss(with_idle) - _median_rss(base)
        ctx.add("resources.rss_idle_connection_kib", [grown / len(held) / 1024])
    await ctx.settle()
    base = await _sample_metrics(ctx, 3, 0.05)
    streams = [ctx.client() for _ in range(s.resource_sessions)]
    streaming: list[dict[str, Any]] = []

    async def hold_streams() -> None:
        for client in streams:
            await wait_for(client.first_chunk, s.session_timeout_s)
        streaming.extend(await _sample_metrics(ctx, 5, 0.05 if s.quick else 0.2))
        for client in streams:
            await client.stop()

    await run_clients(streams, hold_streams, s.session_timeout_s)
    report_failures(streams, "resources: streaming session")
    if base and streaming:
        grown = _median_rss(streaming) - _median_rss(base)
        ctx.add("resources.rss_streaming_session_mib", [grown / len(streams) / 2**20])
        ctx.add("resources.threads_alive_streaming", [m["threads_alive"] for m in streaming])


# ----------------------------------------------------------------------------- encoder


def measure_encoder(
    width: int, height: int, fps: int, chunk_frames: int, chunks: int
) -> dict[str, list[float]]:
    """FragmentedMP4Encoder on the synthetic engine's frames (moving bands: motion for
    x264 to code, unlike a flat colour), timed per ``encode()`` call."""
    from trio_vstream.encoding import FragmentedMP4Encoder
    from trio_vstream.engines import GenerationRequest
    from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings

    engine = SyntheticEngine(SyntheticSettings(steps=0, chunk_frames=chunk_frames))
    request = GenerationRequest(
        request_id="encoder",
        prompt=PROMPT,
        width=width,
        height=height,
        fps=fps,
        num_frames=chunk_frames * (chunks + 1),
    )
    stream = engine.open_stream(request)
    encoder = FragmentedMP4Encoder(width=width, height=height, fps=fps)
    times = []
    for _ in range(chunks + 1):
        chunk = stream.next_chunk(lambda: None)
        assert chunk is not None
        started = time.perf_counter()
        encoder.encode(chunk.frames)
        times.append((time.perf_counter() - started) * 1000)
    encoder.close()
    stream.close()
    return {"first": times[:1], "steady": times[1:]}


async def scenario_encoder(figures: Figures, run: int, s: Settings, chunk_frames: int) -> None:
    period_ms = chunk_frames / s.fps * 1000
    for width, height in dict.fromkeys([*ENCODER_SIZES, (s.width, s.height)]):
        result = await trio.to_thread.run_sync(
            measure_encoder, width, height, s.fps, chunk_frames, s.encoder_chunks
        )
        key = f"encoder.{width}x{height}"
        figures.add(run, f"{key}.ms_per_frame", [t / chunk_frames for t in result["steady"]])
        figures.add(run, f"{key}.chunk_ms", result["steady"])
        figures.add(run, f"{key}.first_chunk_ms", result["first"])
        figures.add(
            run, f"{key}.chunk_period_share_pct", [100 * t / period_ms for t in result["steady"]]
        )


# ----------------------------------------------------------------------------- a run

SCENARIO_FUNCTIONS: Final[dict[str, Callable[[RunContext], Awaitable[None]]]] = {
    "latency": scenario_latency,
    "concurrency": scenario_concurrency,
    "abort": scenario_abort,
    "resources": scenario_resources,
}


async def run_target(
    target: Target,
    s: Settings,
    figures: Figures,
    checks: list[dict[str, Any]],
    run: int,
    log_dir: Path,
) -> dict[str, Any]:
    """Start the server (for a command target), run the scenarios, stop the server."""
    server: ServerProcess | None = None
    info: dict[str, Any] = {"run": run, "target": target.label}
    tag = f"run {run + 1}/{s.repeat} {target.label}"
    try:
        if target.command is not None:
            server = ServerProcess(target.command, log_dir / f"server-{target.label}-{run}.log")
            url = await server.start(timeout=120)
            info["server_pid"] = server.pid
            progress(f"{tag}: server pid {server.pid} at {url}")
        else:
            assert target.url is not None
            url = target.url
            progress(f"{tag}: {url}")
        ctx = RunContext(
            target=target,
            endpoint=Endpoint.parse(url),
            settings=s,
            figures=figures,
            run=run,
            pid=server.pid if server else None,
            rng=random.Random(s.seed * 1000 + run),
            checks=checks,
        )
        before = now()
        metrics = await fetch_metrics(ctx.endpoint)
        after = now()
        ctx.has_metrics = metrics is not None
        # Monotonic clocks compare only on one host; the server's reading must fall
        # between two of ours.
        server_clock = (metrics or {}).get("monotonic")
        ctx.clock_comparable = isinstance(server_clock, int | float) and (
            before <= server_clock <= after
        )
        if metrics is not None:
            metrics, _ = await ctx.settle()
        info["has_metrics"] = ctx.has_metrics
        info["clock_comparable"] = ctx.clock_comparable
        info["baseline"] = {
            "threads_alive": (metrics or {}).get("threads_alive"),
            "rss_bytes": (metrics or {}).get("rss_bytes"),
            "os_threads": os_threads(ctx.pid),
        }
        for name in s.scenarios:
            if name in SCENARIO_FUNCTIONS:
                progress(f"{tag}: {name}")
                await SCENARIO_FUNCTIONS[name](ctx)
                await ctx.check_after(name)
        info["windows"] = ctx.windows
        info["threads"] = await _wait_threads(ctx, info["baseline"])
        if info["threads"]["returned_s"] is not None:
            ctx.add("resources.threads_return_s", [info["threads"]["returned_s"]])
    finally:
        if server is not None:
            info["server_exit"] = await server.stop()
            if info["server_exit"] != 0:
                progress(f"server exited with {info['server_exit']}:\n{server.log_tail(10)}")
    return info


async def _wait_threads(ctx: RunContext, baseline: dict[str, Any]) -> dict[str, Any]:
    """Threads back to the run's baseline? Trio keeps an idle worker thread for 10 s
    before it exits, so this waits, bounded by ``thread_wait_s``."""
    result: dict[str, Any] = {
        "baseline": baseline.get("threads_alive"),
        "baseline_os": baseline.get("os_threads"),
        "immediately_after": None,
        "after": None,
        "after_os": None,
        "returned_s": None,
        "waited_s": 0.0,
    }
    if not ctx.has_metrics or baseline.get("threads_alive") is None:
        ctx.figures.mark_unavailable("resources.threads_return_s", "the server has no /metrics")
        return result
    started = now()
    metrics, _ = await ctx.settle()
    result["immediately_after"] = (metrics or {}).get("threads_alive")
    progress(f"  waiting up to {ctx.settings.thread_wait_s:.0f} s for threads to be back")
    with trio.move_on_after(ctx.settings.thread_wait_s):
        while True:
            metrics = await ctx.metrics()
            if metrics and metrics.get("threads_alive", math.inf) <= baseline["threads_alive"]:
                result["returned_s"] = now() - started
                break
            await trio.sleep(0.25)
    result["waited_s"] = now() - started
    result["after"] = (metrics or {}).get("threads_alive")
    result["after_os"] = os_threads(ctx.pid)
    if metrics and metrics.get("rss_bytes") and baseline.get("rss_bytes"):
        retained = (metrics["rss_bytes"] - baseline["rss_bytes"]) / 2**20
        ctx.add("resources.rss_retained_mib", [retained])
    return result


# --------------------------------------------------------------------------------------
# Targets (PASS/FAIL), tables, machine description
# --------------------------------------------------------------------------------------


def evaluate(
    figures: Figures,
    target: Target,
    s: Settings,
    checks: Sequence[dict[str, Any]],
    runs: Sequence[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The targets the harness exists to show. Never loosened to fit a result."""
    results: list[dict[str, Any]] = []

    def verdict(
        name: str, measured: float | None, limit: float | None, rule: str, note: str = ""
    ) -> None:
        status = "N/A" if measured is None or limit is None else "PASS"
        if status == "PASS" and measured > limit:  # type: ignore[operator]
            status = "FAIL"
        results.append(
            {
                "target": name,
                "rule": rule,
                "measured": measured,
                "threshold": limit,
                "status": status,
                "note": note,
            }
        )

    verdict(
        "control plane: ping RTT p99, 8 sessions streaming",
        figures.stat("concurrency.n8.ping_rtt_ms", "p99"),
        50.0,
        "p99 <= 50 ms",
    )
    step_ms = None if target.step_s is None else target.step_s * 1000
    for phase, label in (("idle", "alone"), ("load", f"{s.abort_load} others streaming")):
        verdict(
            f"abort: stop -> done p99, {label}",
            figures.stat(f"abort.{phase}.stop_done_ms", "p99"),
            None if step_ms is None else step_ms + 50,
            "p99 <= one engine step + 50 ms",
            "" if step_ms is not None else "engine step unknown: pass --engine-step",
        )
    ttfc = figures.stat("latency.ttfc_ms", "median")
    engine = figures.stat("calib.engine_first_chunk_ms", "median")
    encode = figures.stat("calib.encode_first_chunk_ms", "median")
    verdict(
        "transport overhead: median TTFC - engine's median first chunk",
        None if ttfc is None or engine is None else ttfc - engine,
        None if encode is None else encode + 20,
        "<= median encode of one (first) chunk + 20 ms",
        "" if engine is not None else "engine time unknown (engine not synthetic)",
    )
    leftovers = [c for c in checks if c["ok"] is False]
    unknown = not checks or any(c["ok"] is None for c in checks)
    returned = [r.get("threads", {}).get("returned_s") is not None for r in runs]
    status = "N/A" if unknown else "PASS" if not leftovers and all(returned) else "FAIL"
    results.append(
        {
            "target": "cleanup: nothing left after any scenario, threads back after every run",
            "rule": "sessions_active = streams_open = worker_threads = 0 after each scenario; "
            "threads_alive back at its baseline",
            "measured": {
                "scenarios_with_leftovers": len(leftovers),
                "runs_with_threads_back": f"{sum(returned)}/{len(returned)}",
            },
            "threshold": None,
            "status": status,
            "note": "needs /metrics" if unknown else "",
        }
    )
    return results


def _fmt(value: Any) -> str:
    if not isinstance(value, int | float) or not math.isfinite(value):
        return "n/a"
    magnitude = abs(value)
    digits = 3 if magnitude < 1 else 2 if magnitude < 10 else 1 if magnitude < 1000 else 0
    return f"{value:.{digits}f}"


def figure_rows(figures: Figures) -> list[tuple[str, ...]]:
    rows = []
    for fig in figures:
        stats = summarize(fig.pooled)
        medians = [summarize(r)["median"] for r in fig.runs if r]
        spread = f"{_fmt(min(medians))} - {_fmt(max(medians))}" if len(medians) > 1 else ""
        rows.append(
            (fig.name, fig.unit, _fmt(stats["median"]), _fmt(stats["p99"]), spread, str(stats["n"]))
        )
    return rows


def compare_rows(a: Figures, b: Figures) -> list[tuple[str, ...]]:
    def ratio(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None or x == 0 else y / x

    rows = []
    for fig in a:
        other = b.get(fig.name)
        if other is None:
            continue
        sa, sb = summarize(fig.pooled), summarize(other.pooled)
        rows.append(
            (
                fig.name,
                fig.unit,
                _fmt(sa["median"]),
                _fmt(sb["median"]),
                _fmt(ratio(sa["median"], sb["median"])),
                _fmt(sa["p99"]),
                _fmt(sb["p99"]),
                _fmt(ratio(sa["p99"], sb["p99"])),
            )
        )
    return rows


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render(
    report: dict[str, Any],
    targets: Sequence[Target],
    per_target: dict[str, Figures],
    local: Figures,
    verdicts: dict[str, list[dict[str, Any]]],
    s: Settings,
) -> str:
    m = report["machine"]
    git = m["git"]
    dirty = " (with uncommitted changes)" if git.get("dirty_files") else ""
    lines = [
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['cpu_model']}, {m['cpu_count']} cores, {m['ram_gib']} GiB RAM, {m['os']}, "
        f"Python {m['python']}, trio {m['versions']['trio']}, av {m['versions']['av']}, "
        f"torch {m['versions']['torch']}, commit {git.get('commit', '?')[:10]}{dirty}",
        f"Settings: {s.size} at {s.fps} fps, {s.repeat} run(s) per target, concurrency levels "
        f"{','.join(map(str, s.levels))} for {s.window_s:g} s each, a ping every "
        f"{s.ping_interval_s * 1000:.0f} ms per session"
        + (" (quick mode: indicative only)" if s.quick else ""),
        "",
    ]
    lines += [f"Target {t.label}: `{t.shown}`" for t in targets] + [""]
    header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
    if len(targets) == 2:
        compare_header = ("metric", "unit", "A median", "B median", "B/A", "A p99", "B p99")
        lines.append(
            markdown_table(
                (*compare_header, "B/A p99"), compare_rows(per_target["A"], per_target["B"])
            )
        )
    else:
        lines.append(markdown_table(header, figure_rows(per_target[targets[0].label])))
    if any(True for _ in local):
        lines += ["", markdown_table(header, figure_rows(local))]
    for target in targets:
        unavailable = per_target[target.label].unavailable
        if unavailable:
            shown = "; ".join(f"{name} ({why})" for name, why in unavailable.items())
            lines += ["", f"Unavailable for {target.label}: {shown}"]
    lines.append("")
    for target in targets:
        prefix = f"{target.label}: " if len(targets) > 1 else ""
        for v in verdicts[target.label]:
            measured = v["measured"]
            shown = json.dumps(measured) if isinstance(measured, dict) else _fmt(measured)
            limit = "" if v["threshold"] is None else f" (limit {_fmt(v['threshold'])})"
            note = f"; {v['note']}" if v["note"] else ""
            lines.append(
                f"- **{v['status']}** {prefix}{v['target']}: {shown}{limit}; {v['rule']}{note}"
            )
    return "\n".join(lines)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


async def _git(*args: str) -> str:
    done = await trio.run_process(
        ["git", "-C", str(REPO_DIR), *args], capture_stdout=True, capture_stderr=True
    )
    return done.stdout.decode()


async def machine_description() -> dict[str, Any]:
    cpuinfo = _read("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    memory = re.search(r"^MemTotal:\s*(\d+)\s*kB", _read("/proc/meminfo"), re.M)
    os_release = re.search(r'^PRETTY_NAME="?([^"\n]+)"?', _read("/etc/os-release"), re.M)
    try:
        dirty = await _git("status", "--porcelain", "--untracked-files=no")
        git: dict[str, Any] = {
            "commit": (await _git("rev-parse", "HEAD")).strip(),
            "dirty_files": [line[3:] for line in dirty.splitlines()],
        }
    except (OSError, subprocess.CalledProcessError) as exc:
        git = {"error": str(exc)}
    try:
        import av

        libav = {k: ".".join(map(str, v)) for k, v in av.library_versions.items()}
    except ImportError:  # the harness can still measure a remote server
        libav = {}
    return {
        "cpu_model": model.group(1).strip() if model else platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gib": round(int(memory.group(1)) / 2**20, 1) if memory else None,
        "os": os_release.group(1) if os_release else platform.system(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "switch_interval_s": sys.getswitchinterval(),
        "loadavg_at_start": _read("/proc/loadavg").split()[:3],
        "versions": {
            name: _version(name)
            for name in (
                "trio-vstream",
                "trio",
                "trio-websocket",
                "wsproto",
                "av",
                "numpy",
                "torch",
            )
        },
        "libav": libav,
        "git": git,
    }


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels must be >= 1")
    return levels


def _size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def build_parser() -> argparse.ArgumentParser:
    defaults = " ".join(f"{k}={v}" for k, v in DEFAULT_SYNTHETIC_ARGS)
    parser = argparse.ArgumentParser(
        prog="python bench/run.py",
        description="Benchmark a realtime video server (/v1/realtime/video) over real sockets.",
        epilog="A target spec is a ws:// URL, the flags of 'python -m trio_vstream' in one "
        'quoted argument ("--engine synthetic --engine-arg step_delay=0.01"), or a whole '
        "server command. Servers the harness starts get --port 0 unless a port is given, and "
        "are always stopped, Ctrl-C included.",
    )
    add = parser.add_argument
    add(
        "--scenario",
        action="append",
        default=None,
        help=f"all (default) or any of {', '.join(SCENARIOS)}; repeatable or comma-separated",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help="measure a server that is already running")
    where.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="two target specs, alternated run by run; prints B/A for every metric",
    )
    add("--engine", default=None, help=f"engine of the started server (default {DEFAULT_ENGINE})")
    add(
        "--engine-arg",
        action="append",
        default=[],
        metavar="K=V",
        help=f"engine option, repeatable (synthetic without any: {defaults})",
    )
    add(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="another flag for the started server, repeatable: --server-arg=--max-sessions=32",
    )
    add(
        "--engine-step",
        type=float,
        default=None,
        metavar="SECONDS",
        help="one engine step, for the abort target (synthetic: its step_delay)",
    )
    add("--repeat", type=int, default=None, help="runs per target (default 3; --quick: 1)")
    add("--quick", action="store_true", help="smoke mode, for CI: seconds, not minutes")
    add("--size", type=_size, default=(832, 480), help="video size (default 832x480)")
    add("--fps", type=int, default=24, help="frames per second (default 24)")
    add("--levels", type=_levels, default=None, help="concurrency levels (default 1,2,4,8,16)")
    add("--window", type=float, default=None, help="seconds measured per level (default 4)")
    add(
        "--thread-wait",
        type=float,
        default=None,
        help="seconds to wait for threads to be back at baseline (default 15; --quick: 12)",
    )
    add("--abort-samples", type=int, default=None, help="stops per abort phase (default 20)")
    add("--seed", type=int, default=1, help="for the random points at which aborts happen")
    add("--output", type=Path, default=None, help="JSON path (default bench/results/<time>.json)")
    add("--strict", action="store_true", help="exit with status 1 when a target is missed")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    chosen: list[str] = []
    for item in args.scenario or ["all"]:
        for name in (n.strip() for n in item.split(",")):
            if name == "all":
                chosen.extend(SCENARIOS)
            elif name in SCENARIOS:
                chosen.append(name)
            elif name:
                raise SystemExit(f"unknown scenario {name!r}: use all, {', '.join(SCENARIOS)}")
    overrides: dict[str, Any] = {
        "width": args.size[0],
        "height": args.size[1],
        "fps": args.fps,
        "seed": args.seed,
    }
    for option, field in (
        ("repeat", "repeat"),
        ("levels", "levels"),
        ("window", "window_s"),
        ("thread_wait", "thread_wait_s"),
        ("abort_samples", "abort_samples"),
    ):
        if getattr(args, option) is not None:
            overrides[field] = getattr(args, option)
    overrides["repeat"] = max(1, overrides.get("repeat", 1 if args.quick else 3))
    scenarios = tuple(name for name in SCENARIOS if name in chosen)
    if args.quick:
        return Settings.quick_settings(scenarios, **overrides)
    return Settings(scenarios=scenarios, **overrides)


def targets_from(args: argparse.Namespace, s: Settings) -> list[Target]:
    needed = max([*s.levels, s.abort_load + 1, s.idle_connections, s.resource_sessions])
    step = args.engine_step
    if args.compare:
        return [
            make_target(label, spec, max_sessions_needed=needed, declared_step=step)
            for label, spec in zip(("A", "B"), args.compare, strict=True)
        ]
    if args.url:
        return [make_target("A", args.url, max_sessions_needed=needed, declared_step=step)]
    engine = args.engine or DEFAULT_ENGINE
    engine_args = list(args.engine_arg)
    if engine == "synthetic" and not engine_args:
        engine_args = [f"{k}={v}" for k, v in DEFAULT_SYNTHETIC_ARGS]
    tokens = ["--engine", engine]
    for item in engine_args:
        tokens += ["--engine-arg", item]
    spec = shlex.join([*tokens, *args.server_arg])
    return [make_target("A", spec, max_sessions_needed=needed, declared_step=step)]


def chunk_frames_of(targets: Sequence[Target]) -> int:
    """Frames per chunk for the encoder scenario: the synthetic engine's, else 16."""
    for target in targets:
        if target.engine == "synthetic":
            return int(dict(target.engine_args).get("chunk_frames", "8"))
    return int(dict(DEFAULT_SYNTHETIC_ARGS)["chunk_frames"])


async def main_async(args: argparse.Namespace) -> int:
    s = settings_from(args)
    targets = targets_from(args, s)
    machine = await machine_description()
    progress(
        f"{machine['cpu_model']}, {machine['cpu_count']} cores, {machine['ram_gib']} GiB; "
        f"scenarios {', '.join(s.scenarios)}; {s.repeat} run(s) per target"
    )
    for target in targets:
        progress(f"target {target.label}: {target.shown}")
    load = machine["loadavg_at_start"]
    if load and float(load[0]) > 0.5:
        progress(f"warning: load average {load[0]} at start: something else is using the CPU")
    per_target = {t.label: Figures() for t in targets}
    checks: dict[str, list[dict[str, Any]]] = {t.label: [] for t in targets}
    runs: dict[str, list[dict[str, Any]]] = {t.label: [] for t in targets}
    local = Figures()
    chunk_frames = chunk_frames_of(targets)
    started = dt.datetime.now(dt.UTC)
    with tempfile.TemporaryDirectory(prefix="trio_vstream-bench-") as log_dir:
        for run in range(s.repeat):
            if "encoder" in s.scenarios:
                progress(f"run {run + 1}/{s.repeat}: encoder")
                await scenario_encoder(local, run, s, chunk_frames)
            if not any(name in s.scenarios for name in SERVER_SCENARIOS):
                continue
            # A, B in odd runs and B, A in even ones: drift (thermal, other load) evens out.
            for target in targets if run % 2 == 0 else targets[::-1]:
                info = await run_target(
                    target, s, per_target[target.label], checks[target.label], run, Path(log_dir)
                )
                runs[target.label].append(info)
    verdicts = {
        t.label: evaluate(per_target[t.label], t, s, checks[t.label], runs[t.label])
        for t in targets
    }
    report: dict[str, Any] = {
        "schema": 1,
        "created": started.isoformat(timespec="seconds"),
        "duration_s": round(now() - _START_TIME, 1),
        "command": shlex.join(["python", *sys.argv]),
        "loadavg_at_end": _read("/proc/loadavg").split()[:3],
        "machine": machine,
        "settings": {
            **attrs.asdict(s),
            "chunk_frames": chunk_frames,
            "prompt": PROMPT,
            "client_max_message_size": CLIENT_MAX_MESSAGE,
        },
        "targets": {
            t.label: {
                "spec": t.spec,
                "command": list(t.command) if t.command else None,
                "url": t.url,
                "engine": t.engine,
                "engine_args": dict(t.engine_args),
                "engine_step_s": t.step_s,
            }
            for t in targets
        },
        "local": local.to_json(),
        "results": {
            t.label: {
                **per_target[t.label].to_json(),
                "checks": checks[t.label],
                "runs": runs[t.label],
                "targets": verdicts[t.label],
            }
            for t in targets
        },
    }
    if len(targets) == 2:
        keys = ("A_median", "B_median", "ratio_median", "A_p99", "B_p99", "ratio_p99")
        report["compare"] = {
            row[0]: dict(zip(keys, row[2:], strict=True))
            for row in compare_rows(per_target["A"], per_target["B"])
        }
    text = render(report, targets, per_target, local, verdicts, s)
    print(text)
    stamp = started.strftime("%Y%m%d-%H%M%S") + ("-quick" if s.quick else "")
    output = args.output or RESULTS_DIR / f"bench-{stamp}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    output.with_suffix(".md").write_text(text + "\n")
    progress(f"wrote {output} and {output.with_suffix('.md')}")
    missed = any(v["status"] == "FAIL" for vs in verdicts.values() for v in vs)
    return 1 if missed and args.strict else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return trio.run(main_async, args)
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        # Inside nurseries, Ctrl-C arrives wrapped in exception groups.
        if isinstance(exc, BaseExceptionGroup):
            interrupts, others = exc.split(KeyboardInterrupt)
            if interrupts is None or others is not None:
                raise
        progress("interrupted; the servers the harness started are stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
