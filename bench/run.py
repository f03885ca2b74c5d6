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
  closed (from ``GET /stats``), alone and with other sessions streaming;
* ``resources``: server RSS per idle connection and per streaming session, and whether
  threads and engine streams return to their baseline;
* ``encoder``: ``FragmentedMP4Encoder`` cost per frame, as a share of the chunk period;
* ``diffusers`` (where diffusers is installed): a random Wan pipeline, built in a temporary
  directory, served by ``--engine diffusers``: the server's time per segment (and TTFC,
  delivered fps) against the same pipeline calls made directly, in a process of their own.

It talks to a server only through the WebSocket protocol and ``GET /stats``, so it works
against any server of the protocol; figures that need ``/stats`` are reported as
unavailable where a server has none. Results go to stdout (a markdown table and PASS/FAIL
per target) and to ``bench/results/`` (JSON with the machine, the settings, and every
figure with min/median/p99 and its per-run values). See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import importlib.metadata
import itertools
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
from trio_vstream.engines.base import Checkpoint

BENCH_DIR: Final = Path(__file__).resolve().parent
REPO_DIR: Final = BENCH_DIR.parent
RESULTS_DIR: Final = BENCH_DIR / "results"

SCENARIOS: Final = ("resources", "latency", "concurrency", "abort", "encoder", "diffusers")
"""In the order they run: resources first, so that its RSS figures start from a fresh
server rather than from whatever memory the other scenarios left to the allocator.
``diffusers`` is part of ``all`` only where diffusers is installed and the harness starts
the server itself (it serves a model the harness builds, so neither --url nor --compare)."""
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
"""CLOCK_MONOTONIC, like the server's /stats timestamps: comparable on one Linux host."""

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
        "client cuts TCP -> server's engine stream closed (stream_closed_at in /stats)",
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
    "diffusers.inproc.first_segment_ms": (
        "ms",
        "pipeline called directly: prompt encoding + first call + conversion to uint8",
    ),
    "diffusers.inproc.segment_ms": (
        "ms",
        "pipeline called directly: one segment's call + conversion (segments after the first)",
    ),
    "diffusers.inproc.fps": ("fps", "pipeline called directly: frames/s after the first segment"),
    "diffusers.engine.first_segment_ms": (
        "ms",
        "engine alone (no server): open_stream + first next_chunk",
    ),
    "diffusers.engine.segment_ms": (
        "ms",
        "engine alone (no server): next_chunk (segments after the first)",
    ),
    "diffusers.server.ttfc_ms": ("ms", "server: session.start sent -> first media chunk"),
    "diffusers.server.interarrival_ms": ("ms", "server: time between consecutive media chunks"),
    "diffusers.server.fps": ("fps", "server: frames/s delivered, first chunk -> last chunk"),
    "diffusers.server.errors": ("count", "server: sessions that failed"),
    "diffusers.{D}.faults_per_segment": (
        "count",
        "minor page faults of the whole process per segment, over a session (/proc/PID/stat)",
    ),
    "diffusers.{D}.cpu_ms_per_segment": (
        "ms",
        "CPU time of the whole process per segment, over a session (/proc/PID/stat)",
    ),
    "diffusers.overhead_pct": (
        "%",
        "per run: median server inter-arrival / median direct segment time - 1",
    ),
    "diffusers.engine_overhead_pct": (
        "%",
        "per run: median engine-alone segment time / median direct segment time - 1",
    ),
    "diffusers.ttfc_overhead_ms": (
        "ms",
        "per run: median server TTFC - median direct first segment",
    ),
}


def catalogue_key(name: str) -> str:
    """``concurrency.n8.ping_rtt_ms`` -> ``concurrency.n{N}.ping_rtt_ms``, and so on."""
    name = re.sub(r"^concurrency\.n\d+\.", "concurrency.n{N}.", name)
    name = re.sub(r"^abort\.(idle|load)\.", "abort.{P}.", name)
    name = re.sub(r"^diffusers\.(inproc|engine|server)\.(faults|cpu)_", r"diffusers.{D}.\2_", name)
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
    diffusers_preset: str | None = None
    """tiny, cpu or gpu; None: tiny with --quick, else gpu where CUDA is available, else cpu."""
    diffusers_segments: int = 6
    """Segments (pipeline calls) per measured session; the first is reported apart."""
    diffusers_reps: int = 2
    """Per run: sessions through the server, and as many direct and engine-alone ones."""

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
            "diffusers_segments": 3,
            "diffusers_reps": 1,
        }
        base.update(overrides)
        return cls(**base)


@attrs.frozen
class Endpoint:
    """A WebSocket URL taken apart; ``/stats`` is plain HTTP on the same port."""

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
# The server process and its /stats
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


async def fetch_stats(endpoint: Endpoint, timeout: float = 5.0) -> dict[str, Any] | None:
    """``GET /stats`` on the WebSocket's port; None where the server has none."""
    with trio.move_on_after(timeout):
        try:
            stream = await endpoint.open_stream()
        except OSError:
            return None
        data = bytearray()
        try:
            request = (
                f"GET /stats HTTP/1.1\r\nHost: {endpoint.host_header}\r\n"
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
    which ``threading.active_count()`` in /stats does not see."""
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


def minor_faults(pid: int | str | None) -> int | None:
    """Minor page faults of a process so far, from /proc (fresh memory touched)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
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
        return await fetch_stats(self.endpoint) if self.has_metrics else None

    async def settle(self, timeout: float = 10.0) -> tuple[dict[str, Any] | None, float]:
        """Wait until the server has no session left (known only where it has /stats)."""
        started = now()
        if not self.has_metrics:
            await trio.sleep(0.2)
            return None, now() - started
        metrics = None
        with trio.move_on_after(timeout):
            while True:
                metrics = await fetch_stats(self.endpoint)
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
                chunk = stream.next_chunk(Checkpoint())
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
            reason = "needs /stats with a time.monotonic() comparable to the harness's"
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
            ctx.figures.mark_unavailable(name, "the server has no /stats")
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
        chunk = stream.next_chunk(Checkpoint())
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


# --------------------------------------------------------------------------- diffusers


def diffusers_available() -> bool:
    """Whether the ``diffusers`` scenario can run here (it needs the optional extra)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("diffusers", "transformers"))


def _diffusers_tiny() -> Any:
    """``bench/diffusers_tiny.py``, imported whether the harness runs as a script or as
    ``bench.run`` (the tests)."""
    try:
        from bench import diffusers_tiny
    except ImportError:
        import diffusers_tiny  # type: ignore[no-redef]  # python bench/run.py: bench/ is on sys.path
    return diffusers_tiny


DIFFUSERS_PRESETS: Final = ("tiny", "cpu", "gpu")
DIFFUSERS_OVERHEAD_LIMIT_PCT: Final = 5.0


@attrs.frozen(kw_only=True)
class DiffusersPreset:
    """A random Wan pipeline and the request the scenario sends it: every segment is one
    pipeline call of ``segment_frames`` frames and ``steps`` denoising steps, with
    classifier-free guidance (two transformer passes per step), as Wan is run."""

    name: str
    device: str
    model: Any
    """``bench.diffusers_tiny.WanSize``: the transformer's and the VAE's shape."""
    width: int
    height: int
    segment_frames: int
    steps: int
    guidance_scale: float = 5.0

    @classmethod
    def named(cls, name: str) -> DiffusersPreset:
        tiny = _diffusers_tiny()
        if name == "tiny":  # the tests' pipeline, milliseconds per call: for --quick
            return cls(
                name=name,
                device="cpu",
                model=tiny.TINY,
                width=48,
                height=32,
                segment_frames=5,
                steps=2,
            )
        if name == "cpu":  # a few hundred ms per segment on one core
            model = tiny.WanSize(
                layers=4,
                heads=4,
                head_dim=32,
                ffn_dim=512,
                rope_max_seq_len=1024,
                vae_base_dim=3,
                vae_dim_mult=(1, 1, 1, 1),
                vae_res_blocks=1,
            )
            return cls(
                name=name,
                device="cpu",
                model=model,
                width=128,
                height=96,
                segment_frames=17,
                steps=4,
            )
        if name == "gpu":  # Wan 2.1 1.3B's widths and VAE, 10 of its 30 blocks, at 480p
            model = tiny.WanSize(
                layers=10,
                heads=12,
                head_dim=128,
                ffn_dim=8960,
                rope_max_seq_len=1024,
                vae_base_dim=96,
                vae_dim_mult=(1, 2, 4, 4),
                vae_res_blocks=2,
            )
            return cls(
                name=name,
                device="cuda",
                model=model,
                width=832,
                height=480,
                segment_frames=17,
                steps=4,
            )
        raise ValueError(f"unknown diffusers preset {name!r}: use {', '.join(DIFFUSERS_PRESETS)}")

    @classmethod
    def default(cls, quick: bool) -> DiffusersPreset:
        """--quick: tiny; otherwise gpu where CUDA is available, else cpu."""
        if quick:
            return cls.named("tiny")
        import torch

        return cls.named("gpu" if torch.cuda.is_available() else "cpu")

    def engine_args(self, model: Path) -> dict[str, str]:
        return {"model": str(model), "threads": "1", "segment_frames": str(self.segment_frames)}

    def start_fields(self, num_frames: int, seed: int) -> dict[str, Any]:
        return {
            "size": f"{self.width}x{self.height}",
            "fps": 16,
            "num_frames": num_frames,
            "num_inference_steps": self.steps,
            "guidance_scale": self.guidance_scale,
            "seed": seed,
        }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _pipeline_sequence(
    engine: Any, preset: DiffusersPreset, segments: int, seed: int
) -> dict[str, Any]:
    """The pipeline calls the engine makes for one session, made directly and timed.

    As in ``DiffusersStream``: the prompt (and, with guidance, the empty negative prompt)
    encoded once, in the first segment; then per segment one call with those embeddings,
    ``num_frames=segment_frames``, a generator seeded ``seed + index``, ``output_type="pt"``,
    and the engine's conversion to uint8 frames copied to the host. The pipeline object is
    the one the engine loaded (so the same dtypes and device).
    """
    import numpy as np
    import torch

    from trio_vstream.engines.diffusers import _frames_to_uint8

    pipe = engine.model.pipe
    max_sequence_length = engine.model.default("max_sequence_length")
    encode_args: dict[str, Any] = {"do_classifier_free_guidance": False}
    if max_sequence_length is not None:
        encode_args["max_sequence_length"] = max_sequence_length
    threads = _torch_threads()
    times: list[float] = []
    started = time.perf_counter()
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompt=PROMPT, **encode_args)
        negative = None
        if preset.guidance_scale > 1.0:
            negative, _ = pipe.encode_prompt(prompt="", **encode_args)
    for index in range(segments):
        output = pipe(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative,
            height=preset.height,
            width=preset.width,
            num_frames=preset.segment_frames,
            num_inference_steps=preset.steps,
            guidance_scale=preset.guidance_scale,
            generator=torch.Generator(device="cpu").manual_seed(seed + index),
            output_type="pt",
        )
        frames = _frames_to_uint8(output.frames)
        host = np.ascontiguousarray(frames[: preset.segment_frames].cpu().numpy())
        assert host.shape == (preset.segment_frames, preset.height, preset.width, 3), host.shape
        ended = time.perf_counter()
        times.append((ended - started) * 1000)
        started = ended
    return {"segment_ms": times, "torch_threads": threads}


def _engine_sequence(
    engine: Any, preset: DiffusersPreset, segments: int, seed: int
) -> dict[str, Any]:
    """The same session through the engine alone (``open_stream`` + ``next_chunk``, no
    server): what the engine adds to the pipeline calls (its lock, scheduler copies)."""
    from trio_vstream.engines import GenerationRequest

    request = GenerationRequest(
        request_id="diffusers-bench",
        prompt=PROMPT,
        width=preset.width,
        height=preset.height,
        fps=16,
        num_frames=segments * preset.segment_frames,
        num_inference_steps=preset.steps,
        guidance_scale=preset.guidance_scale,
        seed=seed,
    )
    times: list[float] = []
    started = time.perf_counter()
    stream = engine.open_stream(request)
    try:
        while stream.next_chunk(Checkpoint()) is not None:
            ended = time.perf_counter()
            times.append((ended - started) * 1000)
            started = ended
    finally:
        stream.close()
    return {"segment_ms": times}


def _steady_fps(times_ms: Sequence[float], frames: int) -> float:
    """Frames per second over the segments after the first."""
    steady = times_ms[1:]
    return frames * len(steady) / (sum(steady) / 1000) if steady else math.nan


def diffusers_worker(config_json: str) -> int:
    """``run.py --diffusers-worker CONFIG``: the "direct" side of the diffusers scenario.

    A process of its own, set up like the server's (allocator settings included): it
    builds the preset's pipeline (if the directory does not exist), loads it with
    ``load_engine`` in its main thread (so ``threads=1`` is set before any other thread
    exists, as the server's command line does), then runs sequences in one worker thread,
    as the server runs its engine, one per JSON line on stdin, each answered by a JSON line
    on stdout. Measuring in a fresh process, not in the harness, keeps the comparison fair:
    the harness's heap, threads and torch settings are not the server's.
    """
    from concurrent.futures import ThreadPoolExecutor

    from trio_vstream import memory

    memory.tune_allocator()  # the same allocator settings as the server's command line
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to the log, not into the replies
    config = json.loads(config_json)
    preset = DiffusersPreset.named(config["preset"])
    model = Path(config["model"])
    started = time.perf_counter()
    if not model.exists():
        import diffusers

        diffusers.utils.logging.disable_progress_bar()
        _diffusers_tiny().build_wan_t2v(model, size=preset.model)
    build_s = time.perf_counter() - started
    from trio_vstream.engines import load_engine

    engine = load_engine("diffusers", preset.engine_args(model), device=preset.device)
    sequences = {"pipeline": _pipeline_sequence, "engine": _engine_sequence}
    with ThreadPoolExecutor(max_workers=1) as thread:
        threads = thread.submit(_torch_threads).result()
        print(
            json.dumps({"ready": True, "build_s": build_s, "torch_threads": threads}), file=replies
        )
        for line in sys.stdin:
            command = json.loads(line)
            try:
                sequence = sequences[command["what"]]
                result = thread.submit(
                    sequence, engine, preset, command["segments"], command["seed"]
                ).result()
            except Exception as exc:
                result = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(result), file=replies)
    engine.close()
    return 0


class DirectWorker:
    """The ``--diffusers-worker`` process, driven over its stdin and stdout."""

    def __init__(self, command: Sequence[str], log_path: Path) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.process: trio.Process | None = None
        self._buffer = bytearray()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def start(self, timeout: float) -> dict[str, Any]:
        with self.log_path.open("wb") as log:
            self.process = await trio.lowlevel.open_process(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        return await self._reply(timeout)

    async def call(self, timeout: float, **command: Any) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None
        await self.process.stdin.send_all((json.dumps(command) + "\n").encode())
        return await self._reply(timeout)

    async def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        with trio.move_on_after(timeout):
            while b"\n" not in self._buffer:
                data = await self.process.stdout.receive_some(65536)
                if not data:
                    await self.process.wait()
                    raise RuntimeError(
                        f"diffusers worker exited with status {self.process.returncode}:\n"
                        + self.log_tail()
                    )
                self._buffer += data
            line, _, rest = bytes(self._buffer).partition(b"\n")
            self._buffer = bytearray(rest)
            reply = json.loads(line)
            if "error" in reply:
                raise RuntimeError(f"diffusers worker: {reply['error']}")
            return reply
        raise RuntimeError(
            f"diffusers worker gave no answer in {timeout:.0f} s:\n{self.log_tail()}"
        )

    async def stop(self, grace: float = 15.0) -> int | None:
        """End of stdin ends the worker; SIGKILL after ``grace`` seconds. Shielded."""
        process = self.process
        if process is None:
            return None
        with trio.CancelScope(shield=True):
            if process.stdin is not None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await process.stdin.aclose()
            with trio.move_on_after(grace):
                await process.wait()
            if process.poll() is None:
                process.kill()
                await process.wait()
        return process.returncode


class DiffusersScenario:
    """The server's overhead over calling the same diffusers pipeline directly.

    Once: a worker process (``--diffusers-worker``) builds a random Wan pipeline of the
    preset's size into a temporary directory and loads it as the server does
    (``load_engine("diffusers", ...)``, ``threads=1``). Per run: a fresh server
    (``--engine diffusers``, the same engine args), one warm-up segment on each side, then
    ``diffusers_reps`` times, in alternating order: (a) the session's pipeline calls made
    directly in the worker, (b) the same session through the engine alone, in the worker,
    (c) the same session through the server, over a WebSocket.
    """

    def __init__(self, s: Settings, preset: DiffusersPreset, server_args: Sequence[str]) -> None:
        self.s = s
        self.preset = preset
        self.server_args = list(server_args)
        self.figures = Figures()
        self.checks: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.worker: DirectWorker | None = None
        self.target: Target | None = None
        self.inproc_torch_threads: int | None = None
        self.build_s: float | None = None
        self.worker_exit: int | None = None

    @property
    def segments(self) -> int:
        return self.s.diffusers_segments

    async def setup(self, work_dir: Path) -> None:
        preset = self.preset
        model = work_dir / f"Wan-random-{preset.name}"
        config = {"preset": preset.name, "model": str(model)}
        command = [
            sys.executable,
            str(BENCH_DIR / "run.py"),
            "--diffusers-worker",
            json.dumps(config),
        ]
        progress(f"diffusers: building and loading a random Wan pipeline ({preset.name} preset)")
        self.worker = DirectWorker(command, work_dir / "diffusers-worker.log")
        ready = await self.worker.start(timeout=600)
        self.build_s = ready["build_s"]
        self.inproc_torch_threads = ready["torch_threads"]
        spec = ["--engine", "diffusers", "--device", preset.device]
        for key, value in preset.engine_args(model).items():
            spec += ["--engine-arg", f"{key}={value}"]
        self.target = make_target(
            "diffusers", shlex.join([*spec, *self.server_args]), max_sessions_needed=1
        )

    async def close(self) -> None:
        if self.worker is not None:
            self.worker_exit = await self.worker.stop()
            self.worker = None

    async def _process_cost(
        self, run: int, side: str, pid: int | None, body: Callable[[], Awaitable[Any]]
    ) -> Any:
        """Run ``body``; record the process's page faults and CPU time per segment."""
        faults, cpu = minor_faults(pid), cpu_seconds(pid)
        result = await body()
        faults_after, cpu_after = minor_faults(pid), cpu_seconds(pid)
        if faults is not None and faults_after is not None:
            per_segment = (faults_after - faults) / self.segments
            self.figures.add(run, f"diffusers.{side}.faults_per_segment", [per_segment])
        if cpu is not None and cpu_after is not None:
            per_segment = (cpu_after - cpu) * 1000 / self.segments
            self.figures.add(run, f"diffusers.{side}.cpu_ms_per_segment", [per_segment])
        return result

    async def _direct(self, run: int, what: str, side: str, seed: int) -> list[float]:
        worker = self.worker
        assert worker is not None and worker.process is not None
        timeout = self.s.session_timeout_s

        async def call() -> dict[str, Any]:
            return await worker.call(timeout, what=what, segments=self.segments, seed=seed)

        result = await self._process_cost(run, side, worker.process.pid, call)
        return result["segment_ms"]

    async def _inproc(self, run: int, seed: int) -> None:
        times = await self._direct(run, "pipeline", "inproc", seed)
        self.figures.add(run, "diffusers.inproc.first_segment_ms", times[:1])
        self.figures.add(run, "diffusers.inproc.segment_ms", times[1:])
        self.figures.add(
            run, "diffusers.inproc.fps", [_steady_fps(times, self.preset.segment_frames)]
        )

    async def _engine(self, run: int, seed: int) -> None:
        times = await self._direct(run, "engine", "engine", seed)
        self.figures.add(run, "diffusers.engine.first_segment_ms", times[:1])
        self.figures.add(run, "diffusers.engine.segment_ms", times[1:])

    async def _server(self, ctx: RunContext, seed: int) -> None:
        frames = self.segments * self.preset.segment_frames
        client = SessionClient(
            ctx.endpoint,
            protocol.start_message(PROMPT, **self.preset.start_fields(frames, seed)),
        )
        await self._process_cost(
            ctx.run,
            "server",
            ctx.pid,
            functools.partial(
                run_clients, [client], trio.lowlevel.checkpoint, self.s.session_timeout_s
            ),
        )
        failed = report_failures([client], "diffusers: server session")
        await ctx.settle()
        if failed or not client.arrivals or client.t_start_sent is None:
            ctx.add("diffusers.server.errors", [1])
            return
        ctx.add("diffusers.server.errors", [0])
        arrivals = [t for t, _, _ in client.arrivals]
        ctx.add("diffusers.server.ttfc_ms", [(arrivals[0] - client.t_start_sent) * 1000])
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
        ctx.add("diffusers.server.interarrival_ms", gaps)
        if len(arrivals) > 1:
            steady = sum(f for _, f, _ in client.arrivals[1:])
            ctx.add("diffusers.server.fps", [steady / (arrivals[-1] - arrivals[0])])
        if len(client.arrivals) != self.segments:
            progress(f"  !! diffusers: {len(client.arrivals)} chunks for {self.segments} segments")

    async def run(self, run: int, log_dir: Path) -> None:
        assert self.target is not None and self.target.command is not None
        assert self.worker is not None
        s = self.s
        tag = f"run {run + 1}/{s.repeat} diffusers"
        server = ServerProcess(self.target.command, log_dir / f"server-diffusers-{run}.log")
        info: dict[str, Any] = {"run": run, "target": "diffusers"}
        try:
            url = await server.start(timeout=300)
            info["server_pid"] = server.pid
            progress(f"{tag}: server pid {server.pid} at {url}")
            endpoint = Endpoint.parse(url)
            ctx = RunContext(
                target=self.target,
                endpoint=endpoint,
                settings=s,
                figures=self.figures,
                run=run,
                pid=server.pid,
                rng=random.Random(s.seed * 1000 + run),
                checks=self.checks,
                has_metrics=await fetch_stats(endpoint) is not None,
            )
            progress(f"{tag}: warm-up, one segment on each side")
            warm_up = SessionClient(
                endpoint,
                protocol.start_message(
                    PROMPT, **self.preset.start_fields(self.preset.segment_frames, s.seed)
                ),
            )
            await run_clients([warm_up], trio.lowlevel.checkpoint, s.session_timeout_s)
            report_failures([warm_up], "diffusers: warm-up session")
            await ctx.settle()
            await self.worker.call(s.session_timeout_s, what="pipeline", segments=1, seed=s.seed)
            started = now()
            for rep in range(s.diffusers_reps):
                seed = s.seed + 1000 * (run * s.diffusers_reps + rep)
                steps = [
                    ("direct pipeline calls", functools.partial(self._inproc, run, seed)),
                    ("engine alone", functools.partial(self._engine, run, seed)),
                    ("server", functools.partial(self._server, ctx, seed)),
                ]
                if (run + rep) % 2:
                    steps.reverse()  # drift on the machine affects both sides alike
                for label, step in steps:
                    progress(f"{tag}: {label}, {self.segments} segments")
                    await step()
            ctx.windows.append({"scenario": "diffusers", "start": started, "end": now()})
            info["windows"] = ctx.windows
            await ctx.check_after("diffusers")
            self._add_ratios(run)
        finally:
            info["server_exit"] = await server.stop()
            if info["server_exit"] != 0:
                progress(f"server exited with {info['server_exit']}:\n{server.log_tail(10)}")
            self.runs.append(info)

    def _run_median(self, name: str, run: int) -> float | None:
        figure = self.figures.get(name)
        if figure is None or len(figure.runs) <= run or not figure.runs[run]:
            return None
        return percentile(figure.runs[run], 50)

    def _add_ratios(self, run: int) -> None:
        """One value per run: the run's medians compared."""
        inproc = self._run_median("diffusers.inproc.segment_ms", run)
        server = self._run_median("diffusers.server.interarrival_ms", run)
        engine = self._run_median("diffusers.engine.segment_ms", run)
        if inproc and server:
            self.figures.add(run, "diffusers.overhead_pct", [100 * (server / inproc - 1)])
        if inproc and engine:
            self.figures.add(run, "diffusers.engine_overhead_pct", [100 * (engine / inproc - 1)])
        first = self._run_median("diffusers.inproc.first_segment_ms", run)
        ttfc = self._run_median("diffusers.server.ttfc_ms", run)
        if first and ttfc:
            self.figures.add(run, "diffusers.ttfc_overhead_ms", [ttfc - first])

    def evaluate(self) -> list[dict[str, Any]]:
        """Pooled medians of all runs: server per-segment time over the in-process one."""
        inproc = self.figures.stat("diffusers.inproc.segment_ms", "median")
        server = self.figures.stat("diffusers.server.interarrival_ms", "median")
        measured = None if not inproc or server is None else 100 * (server / inproc - 1)
        status = "N/A" if measured is None else "PASS"
        if measured is not None and measured > DIFFUSERS_OVERHEAD_LIMIT_PCT:
            status = "FAIL"
        leftovers = [c for c in self.checks if c["ok"] is False]
        cleanup = "PASS" if not leftovers else "FAIL"
        if not self.checks or any(c["ok"] is None for c in self.checks):
            cleanup = "N/A"
        return [
            {
                "target": "diffusers: server overhead per segment",
                "rule": "median chunk inter-arrival through the server / median segment time "
                "of the same pipeline calls made directly (in a process of their own) - 1 "
                "<= 5 %",
                "measured": measured,
                "threshold": DIFFUSERS_OVERHEAD_LIMIT_PCT,
                "status": status,
                "note": f"{server:.1f} ms vs {inproc:.1f} ms" if measured is not None else "",
            },
            {
                "target": "diffusers: cleanup",
                "rule": "sessions_active = streams_open = worker_threads = 0 after each run",
                "measured": {"runs_with_leftovers": len(leftovers)},
                "threshold": None,
                "status": cleanup,
                "note": "",
            },
        ]

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.target is not None
        return {
            "preset": attrs.asdict(self.preset),
            "segments": self.segments,
            "reps_per_run": self.s.diffusers_reps,
            "build_s": self.build_s,
            "command": list(self.target.command or ()),
            "engine_args": dict(self.target.engine_args),
            "inproc_torch_threads": self.inproc_torch_threads,
            "worker_exit": self.worker_exit,
            **self.figures.to_json(),
            "checks": self.checks,
            "runs": self.runs,
            "targets": verdicts,
        }


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
        metrics = await fetch_stats(ctx.endpoint)
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
        ctx.figures.mark_unavailable("resources.threads_return_s", "the server has no /stats")
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
            "note": "needs /stats" if unknown else "",
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


def _verdict_line(v: dict[str, Any], prefix: str = "") -> str:
    measured = v["measured"]
    shown = json.dumps(measured) if isinstance(measured, dict) else _fmt(measured)
    limit = "" if v["threshold"] is None else f" (limit {_fmt(v['threshold'])})"
    note = f"; {v['note']}" if v["note"] else ""
    return f"- **{v['status']}** {prefix}{v['target']}: {shown}{limit}; {v['rule']}{note}"


def render(
    report: dict[str, Any],
    targets: Sequence[Target],
    per_target: dict[str, Figures],
    local: Figures,
    verdicts: dict[str, list[dict[str, Any]]],
    s: Settings,
    diffusers: DiffusersScenario | None = None,
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
    # With only the diffusers scenario (which starts its own server), and maybe the encoder,
    # the targets were never measured: no table and no verdicts for them.
    served = "diffusers" not in s.scenarios or any(n in s.scenarios for n in SERVER_SCENARIOS)
    header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
    if served:
        lines += [f"Target {t.label}: `{t.shown}`" for t in targets] + [""]
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
    if diffusers is not None:
        p, size = diffusers.preset, diffusers.preset.model
        lines += [
            "",
            f"Diffusers: preset {p.name} on {p.device}: random Wan, {size.layers} blocks of "
            f"width {size.heads * size.head_dim} (ffn {size.ffn_dim}), VAE base {size.vae_base_dim}"
            f"; {p.width}x{p.height}, {p.segment_frames} frames per segment, {p.steps} steps, "
            f"guidance {p.guidance_scale:g}; {s.diffusers_segments} segments per session, "
            f"{s.diffusers_reps} session(s) per side per run; threads=1 (torch threads in the "
            f"direct worker: {diffusers.inproc_torch_threads})",
            "",
        ]
        if diffusers.target is not None:
            lines += [f"Server: `{diffusers.target.shown}`", ""]
        lines.append(markdown_table(header, figure_rows(diffusers.figures)))
    if served:
        for target in targets:
            unavailable = per_target[target.label].unavailable
            if unavailable:
                shown = "; ".join(f"{name} ({why})" for name, why in unavailable.items())
                lines += ["", f"Unavailable for {target.label}: {shown}"]
    lines.append("")
    if served:
        for target in targets:
            prefix = f"{target.label}: " if len(targets) > 1 else ""
            lines += [_verdict_line(v, prefix) for v in verdicts[target.label]]
    if diffusers is not None:
        lines += [_verdict_line(v) for v in report["diffusers"]["targets"]]
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
    add(
        "--diffusers-preset",
        choices=DIFFUSERS_PRESETS,
        default=None,
        help="size of the diffusers scenario's random pipeline (default: tiny with --quick, "
        "else gpu where CUDA is available, else cpu)",
    )
    add("--diffusers-worker", default=None, help=argparse.SUPPRESS)
    add("--output", type=Path, default=None, help="JSON path (default bench/results/<time>.json)")
    add("--strict", action="store_true", help="exit with status 1 when a target is missed")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    chosen: list[str] = []
    for item in args.scenario or ["all"]:
        for name in (n.strip() for n in item.split(",")):
            if name == "all":
                chosen.extend(SCENARIOS[:-1])
                if not (args.url or args.compare) and diffusers_available():
                    chosen.append("diffusers")
            elif name == "diffusers" and not diffusers_available():
                raise SystemExit(
                    "the diffusers scenario needs diffusers and transformers: "
                    "pip install 'trio-vstream[diffusers]'"
                )
            elif name in SCENARIOS:
                chosen.append(name)
            elif name:
                raise SystemExit(f"unknown scenario {name!r}: use all, {', '.join(SCENARIOS)}")
    overrides: dict[str, Any] = {
        "width": args.size[0],
        "height": args.size[1],
        "fps": args.fps,
        "seed": args.seed,
        "diffusers_preset": args.diffusers_preset,
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
        diffusers: DiffusersScenario | None = None
        if "diffusers" in s.scenarios:
            preset = (
                DiffusersPreset.named(s.diffusers_preset)
                if s.diffusers_preset
                else DiffusersPreset.default(s.quick)
            )
            diffusers = DiffusersScenario(s, preset, args.server_arg)
            try:
                await diffusers.setup(Path(log_dir))
                for run in range(s.repeat):
                    await diffusers.run(run, Path(log_dir))
            finally:
                await diffusers.close()
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
    diffusers_verdicts: list[dict[str, Any]] = []
    if diffusers is not None:
        diffusers_verdicts = diffusers.evaluate()
        report["diffusers"] = diffusers.to_json(diffusers_verdicts)
    if len(targets) == 2:
        keys = ("A_median", "B_median", "ratio_median", "A_p99", "B_p99", "ratio_p99")
        report["compare"] = {
            row[0]: dict(zip(keys, row[2:], strict=True))
            for row in compare_rows(per_target["A"], per_target["B"])
        }
    text = render(report, targets, per_target, local, verdicts, s, diffusers)
    print(text)
    stamp = started.strftime("%Y%m%d-%H%M%S") + ("-quick" if s.quick else "")
    output = args.output or RESULTS_DIR / f"bench-{stamp}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    output.with_suffix(".md").write_text(text + "\n")
    progress(f"wrote {output} and {output.with_suffix('.md')}")
    missed = any(
        v["status"] == "FAIL" for vs in [*verdicts.values(), diffusers_verdicts] for v in vs
    )
    return 1 if missed and args.strict else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.diffusers_worker:
        return diffusers_worker(args.diffusers_worker)
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
