#!/usr/bin/env python3
"""Soak test: many randomized sessions against a real server process, checked one by one.

``python bench/soak.py --sessions 200 --concurrency 8 --seed 1`` starts ``python -m
trio_vstream --engine synthetic`` (small frames, short timeouts) as a subprocess, runs a
seeded random mix of session kinds against it over real loopback sockets, and checks
every session's transcript, the server's own record of it (``GET /stats``, the JSON
figures), its log, and at the end whether the process is back where it started (threads,
file descriptors, memory) and stops cleanly on SIGTERM. Exit status 1 if anything was
violated.

Why a soak, next to the unit and server tests: each guarantee (G1-G5 in the README) has
its own test, but the bugs that matter in production live where they meet: a client
that goes away while its session is being admitted, a ping that arrives while the close
handshake runs, a stall guard racing a stop. Those show up only with many sessions of
different kinds overlapping at random points in time, which is what this does. The seed
fixes the mix and every random choice; the interleavings are whatever the machine makes
of them, so a run is a sample, and the long form (1000 sessions) samples more.

Session kinds (weights in ``KINDS``; each kind runs at least once when --sessions is at
least the number of kinds):

* ``normal``, ``slow_reader`` (delays between reads, far under the stall timeout):
  ``video.start``, media chunks (metadata + one binary message each), the trailer, one
  ``session.done`` with ``stopped: false``, close 1000, every requested frame;
* ``stop``: ``session.stop`` after a random delay; one ``session.done`` (``stopped``
  either way: false when the video was complete first), close 1000;
* ``chatty``: pings, interactions and a reused event id early in the session; each gets
  its answer (``session.pong``, ``session.interaction.queued``, ``event_id_conflict``)
  and the video still completes; ``pings_to_close``: a ping every few ms until the
  connection closes; the terminal message and close 1000 must survive them;
* ``fin`` (``shutdown(SHUT_WR)``: end of stream, no close frame), ``rst``
  (``SO_LINGER`` 0, then close), ``close`` (the client's close frame): before
  ``session.start``, right after it, or mid-stream; abandoned: the server must close its
  side within 2 x slack (3 s, ``Timing.release_bound``), record the session as
  ``disconnected`` (or ``completed``), and log no error;
* ``garbage_start`` / ``garbage_mid``: non-JSON text, binary junk, JSON that is not an
  object, unknown or missing types, a bad interaction (and a bad request instead of
  ``session.start``); each gets an ``error`` with the expected ``code``; in place of the
  start it is the one terminal message (then close 1000), mid-session the session goes
  on and completes;
* ``oversized_start`` / ``oversized_control``: just over the server's byte limits:
  ``message_too_large`` (terminal instead of a start, answered mid-session);
  ``oversized_frame``: beyond the WebSocket message limit (server.py allows twice the
  larger byte limit, so that it can still answer ``message_too_large`` below that): the
  server closes with 1009;
* ``stopped_reader``: a small receive buffer, a long video, and the client stops reading
  after a few messages: the server must abort it (``stalled`` / ``stall_timeout`` in
  /stats) within the stall timeout plus slack of its sends no longer getting through
  (the client's receive queue no longer growing), and close the socket; the client then
  abandons it;
* ``no_start``: nothing sent: ``error`` ``start_timeout`` after ``--start-timeout``, then
  close 1000;
* ``engine_fail`` / ``engine_hang``: ``extra_params.fail_at_chunk`` /
  ``hang_at_chunk`` of the synthetic engine: ``generation_failed``, or ``stall_timeout``
  about ``--stall-timeout`` after the last chunk, then close 1000.

Admission: the server runs with ``--max-sessions`` equal to ``--concurrency``, and the
soak counts a connection against that from connect until the server has closed its
socket (seen as end-of-stream, or, for abandoned connections, as the server process no
longer holding the socket: ``/proc/net/tcp`` and ``/proc/PID/fd``). So ``server_busy`` is
always a violation: it means the server refused a client that had, by its own count of
open connections, room.

Every session the client did not abandon: exactly one terminal message (``session.done``
or an ``error`` that is the last message; an ``error`` answering a bad control message is
not one), then close 1000 and the server's TCP close. Every ``error`` has a ``code``.
Where the client learnt the request id, the server's record of the session
(``recent_sessions`` in /stats, polled every 0.5 s) must show the outcome the kind
allows; no record may say ``internal_error``.

Timing checks allow ``Timing.slack`` (1.5 s) of lateness and 0.2 s of earliness: a
start timeout must fire after 1.0 s (0.8-2.5 s), a hang's stall after 1.5 s (1.3-3.0 s).
The report lists the measured reaction times (``timings_s``), so the margins can be judged.

At the end, with no sessions running: ``/stats`` must show ``sessions_active``,
``streams_open`` and ``worker_threads`` at 0; the process's threads and open file
descriptors must be back to the baseline taken after the warm-up (waiting out the server's
10 s idle trim and Trio's 10 s idle-thread timeout, bounded), and its RSS within
``RSS_GROWTH_LIMIT_MIB`` of it; SIGTERM must end it with status 0 within
``--shutdown-grace``. The server's log must hold no ERROR record or traceback other than
the injected engine failures'.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import json
import math
import os
import random
import re
import shlex
import shutil
import socket
import struct
import sys
import tempfile
import termios
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    wrap_client_stream,
)

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import run as bench
from trio_vstream.server import IDLE_BEFORE_TRIM

# --------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------

KINDS: Final[dict[str, int]] = {
    "normal": 16,
    "stop": 12,
    "chatty": 9,
    "pings_to_close": 4,
    "slow_reader": 5,
    "stopped_reader": 3,
    "fin": 5,
    "rst": 5,
    "close": 3,
    "garbage_start": 5,
    "garbage_mid": 6,
    "oversized_start": 2,
    "oversized_control": 3,
    "oversized_frame": 2,
    "no_start": 3,
    "engine_fail": 5,
    "engine_hang": 3,
}
"""Session kinds and their weights in the random mix."""

ABANDONING_KINDS: Final = frozenset({"fin", "rst", "close", "stopped_reader"})
"""Kinds whose client gives up on the session: no transcript expectation beyond well-formed
messages; the server must clean up (and say so in /stats) on its own."""

DISCONNECT_PHASES: Final = ("before_start", "after_start", "mid_stream")

ENGINE_ARGS: Final = (("chunk_frames", "4"), ("steps", "2"), ("step_delay", "0.005"))
"""4-frame chunks of 2 steps of 5 ms: a chunk every ~10 ms, many chunks per session, and
an engine that leaves the two cores of a small machine to the transport."""

MAX_START_BYTES: Final = 32 * 1024
MAX_CONTROL_BYTES: Final = 8 * 1024
"""Smaller than the defaults (4 MiB, 128 KiB) so that oversized frames are cheap to send;
the server's WebSocket limit follows them (server.py: twice the larger, 64 KiB here)."""
OVERSIZED_FRAME_FACTOR: Final = 4
"""An ``oversized_frame`` is this many times the larger byte limit: far beyond the
WebSocket message limit, whatever margin the server keeps for answering below it."""

CLIENT_RCVBUF_STOPPED: Final = 4096
"""SO_RCVBUF of a stopped reader: with the default (autotuned up to 32 MiB on loopback)
a small video fits in the socket buffers and nothing ever stalls."""

RSS_GROWTH_LIMIT_MIB: Final = 16.0
"""Largest allowed growth of the server's RSS from the post-warm-up baseline to the end,
both read after the server's idle trim. A per-session leak of 16 KiB exceeds it within
the long form's 1000 sessions; what a healthy server keeps (allocator fragmentation,
bounded caches) measured 2-4 MiB, short form and long form alike."""
FD_GROWTH_LIMIT: Final = 0
THREAD_GROWTH_LIMIT: Final = 0
"""Open file descriptors and OS threads must be back to the baseline exactly."""
SETTLE_EXTRA_S: Final = 8.0
"""After the last session ended, the server gets IDLE_BEFORE_TRIM plus this long to be
back at its baseline (Trio's idle worker threads exit after 10 s)."""

EOF_WAIT_S: Final = 5.0
"""After the close handshake, how long the client waits for the server's TCP close."""
CLOSE_HANDSHAKE_WAIT_S: Final = 5.0
"""How long a client that sends a close frame waits for the server's answer."""
METRICS_PERIOD_S: Final = 0.5
"""/stats keeps the last 256 sessions; polled this often, none is missed."""
PROGRESS_PERIOD_S: Final = 5.0

PROMPTS: Final = (
    "a red circle moving left on a navy background",
    "a green square rising on black",
    "a lighthouse on a cliff at dusk",
    "a yellow triangle falling on a white background",
)

now = time.monotonic
"""CLOCK_MONOTONIC, like the server's /stats timestamps: comparable on one host."""


DEFAULT_STALL_TIMEOUT: Final = 1.5
DEFAULT_START_TIMEOUT: Final = 1.0
"""Short, so that the kinds that wait for them (hangs, stopped readers, silent clients)
cost seconds, yet far above anything a healthy session on a loaded 2-core machine waits."""


@attrs.frozen(kw_only=True)
class Timing:
    """The server's timeouts as the soak sets them, and how much lateness it tolerates."""

    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    start_timeout: float = DEFAULT_START_TIMEOUT
    shutdown_grace: float = 5.0
    slack: float = 1.5
    """Allowed lateness of a server timeout or reaction, on a loaded 2-core machine."""
    early: float = 0.2
    """Allowed earliness of a timeout (clock granularity, scheduling)."""

    @property
    def reply_wait(self) -> float:
        """How long a client waits for an answer to one control message."""
        return self.stall_timeout + self.slack

    def release_bound(self, how: str) -> float:
        """Seconds the server may keep an abandoned connection's socket open."""
        if how == "stop_reading":
            # The server's buffers fill, then the stall guard runs, then it closes.
            return self.stall_timeout + 2 * self.slack
        return 2 * self.slack

    def session_timeout(self) -> float:
        """The client's watchdog for one whole session."""
        return 20.0 + self.stall_timeout + self.start_timeout


@attrs.frozen(kw_only=True)
class Settings:
    sessions: int = 1000
    concurrency: int = 8
    seed: int = 1
    warmup: int | None = None
    deadline_s: float | None = None
    timing: Timing = Timing()

    @property
    def warmup_sessions(self) -> int:
        return self.warmup if self.warmup is not None else 2 * self.concurrency

    @property
    def total_deadline_s(self) -> float:
        """The soak's own bound on its run time, start to exit."""
        if self.deadline_s is not None:
            return self.deadline_s
        return max(90.0, 30.0 + 0.6 * (self.sessions + self.warmup_sessions))


def server_command(s: Settings) -> list[str]:
    t = s.timing
    command = [sys.executable, "-m", "trio_vstream", "--host", "127.0.0.1", "--port", "0"]
    command += ["--engine", "synthetic"]
    for key, value in ENGINE_ARGS:
        command += ["--engine-arg", f"{key}={value}"]
    command += [
        "--max-sessions",
        str(s.concurrency),
        "--stall-timeout",
        str(t.stall_timeout),
        "--start-timeout",
        str(t.start_timeout),
        "--shutdown-grace",
        str(t.shutdown_grace),
        "--max-start-bytes",
        str(MAX_START_BYTES),
        "--max-control-bytes",
        str(MAX_CONTROL_BYTES),
        "--log-level",
        "INFO",
    ]
    return command


def progress(message: str) -> None:
    bench.progress(message)


# --------------------------------------------------------------------------------------
# Plans: what each session does, drawn from the seed
# --------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Plan:
    """One session, decided up front: the kind, its request, and its random choices."""

    index: int
    kind: str
    warmup: bool
    start: dict[str, Any] | None
    """The ``session.start`` fields sent (None: the kind sends none, or something else)."""
    params: dict[str, Any]
    """Kind-specific choices (delays, garbage, phases), JSON-able for the report."""

    @property
    def num_frames(self) -> int:
        return int(self.start["num_frames"]) if self.start else 0

    @property
    def label(self) -> str:
        variant = self.params.get("phase") or self.params.get("where")
        return f"{self.kind}({variant})" if variant else self.kind

    def start_text(self) -> str:
        assert self.start is not None
        return json.dumps({"type": "session.start", **self.start})


GARBAGE: Final[dict[str, tuple[str, str, str]]] = {
    # name: (payload, expected code instead of session.start, expected code mid-session)
    "non_json": ("this is not JSON {", "invalid_json", "invalid_json"),
    "binary_junk": ("<binary>", "invalid_json", "invalid_json"),
    "json_array": ("[1, 2, 3]", "invalid_message", "invalid_message"),
    "json_string": ('"session.start"', "invalid_message", "invalid_message"),
    "json_number": ("42", "invalid_message", "invalid_message"),
    "json_null": ("null", "invalid_message", "invalid_message"),
    "unknown_type": ('{"type": "session.dance"}', "invalid_message", "unknown_type"),
    "missing_type": ('{"prompt": "a cat"}', "invalid_message", "unknown_type"),
    "bad_interaction": (
        '{"type": "session.interaction", "interaction": {"event": {}}}',
        "invalid_message",
        "invalid_message",
    ),
}
BAD_START: Final = ('{"type": "session.start", "promt": "a cat"}', "invalid_request")
"""A misspelt field: only meaningful in place of session.start."""


def _garbage(rng: random.Random, where: str) -> dict[str, Any]:
    """One bad message: its payload (text or hex of binary) and the expected error code."""
    names = list(GARBAGE) + (["bad_start"] if where == "start" else [])
    name = rng.choice(names)
    if name == "bad_start":
        return {"label": name, "text": BAD_START[0], "expect": f"error:{BAD_START[1]}"}
    payload, at_start, mid = GARBAGE[name]
    code = at_start if where == "start" else mid
    step: dict[str, Any] = {"label": f"garbage:{name}", "expect": f"error:{code}"}
    if name == "binary_junk":
        # 0xff never occurs in UTF-8, so this can never be read as JSON by chance.
        junk = bytes([0xFF, 0xFE]) + rng.randbytes(rng.randint(1, 200))
        step["hex"] = junk.hex()
    else:
        step["text"] = payload
    return step


def _padded_start(base: dict[str, Any], size: int) -> str:
    """A session.start of exactly ``size`` bytes (UTF-8), padded in the prompt."""
    text = json.dumps({"type": "session.start", **base, "prompt": ""})
    return json.dumps({"type": "session.start", **base, "prompt": "x" * (size - len(text))})


def _padded_interaction(size: int, event_id: str) -> str:
    stub = {"type": "session.interaction", "interaction": {"event_id": event_id}}
    empty = json.dumps({**stub, "interaction": {"event_id": event_id, "event": {"prompt": ""}}})
    prompt = "y" * (size - len(empty))
    return json.dumps({**stub, "interaction": {"event_id": event_id, "event": {"prompt": prompt}}})


def make_plan(rng: random.Random, index: int, kind: str, *, warmup: bool = False) -> Plan:
    """Draw one session's request and random choices for ``kind``."""
    size = rng.choice((64, 64, 64, 128))
    start: dict[str, Any] | None = {
        "prompt": rng.choice(PROMPTS),
        "width": size,
        "height": size,
        "fps": 24,
        "num_frames": rng.randint(8, 64),
        "seed": rng.randint(0, 2**31),
    }
    params: dict[str, Any] = {}
    assert start is not None
    if kind == "stop":
        start["num_frames"] = rng.randint(32, 96)
        params["stop_after_s"] = round(rng.uniform(0.0, 0.4), 4)
    elif kind == "chatty":
        start["num_frames"] = rng.randint(96, 160)
        controls: list[dict[str, Any]] = []
        ids: list[str] = []
        for i in range(rng.randint(1, 5)):
            choice = rng.random()
            if choice < 0.45:
                controls.append({"label": "ping", "text": '{"type": "session.ping"}'})
                controls[-1]["expect"] = "pong"
            elif choice < 0.85 or not ids:
                event_id = f"ev-{i}"
                ids.append(event_id)
                text = json.dumps(
                    {
                        "type": "session.interaction",
                        "interaction": {
                            "event_id": event_id,
                            "event": {"prompt": rng.choice(PROMPTS)},
                            "transition_chunks": rng.randint(0, 3),
                        },
                    }
                )
                controls.append(
                    {
                        "label": f"interaction:{event_id}",
                        "text": text,
                        "expect": f"queued:{event_id}",
                    }
                )
            else:  # an event id already used: a bad control message, the session goes on
                event_id = rng.choice(ids)
                text = json.dumps(
                    {
                        "type": "session.interaction",
                        "interaction": {"event_id": event_id, "event": {"prompt": "again"}},
                    }
                )
                controls.append(
                    {
                        "label": f"interaction:{event_id}(reused)",
                        "text": text,
                        "expect": "error:event_id_conflict",
                    }
                )
            controls[-1]["delay"] = round(rng.uniform(0.0, 0.03), 4)
        params["controls"] = controls
    elif kind == "pings_to_close":
        start["num_frames"] = rng.randint(16, 64)
        params["ping_every_s"] = round(rng.uniform(0.003, 0.015), 4)
    elif kind == "slow_reader":
        start["num_frames"] = rng.randint(16, 64)
        count = 2 * math.ceil(start["num_frames"] / 4) + 4
        params["read_delays"] = [round(rng.uniform(0.0, 0.05), 4) for _ in range(count)]
    elif kind == "stopped_reader":
        start["width"] = start["height"] = 64
        start["num_frames"] = 480  # 120 chunks: far more than the socket buffers hold
        params["read_messages"] = rng.randint(1, 12)
    elif kind in ("fin", "rst", "close"):
        start["num_frames"] = rng.randint(64, 160)
        params["phase"] = rng.choice(DISCONNECT_PHASES)
        params["delay_s"] = round(rng.uniform(0.0, 0.3), 4)
    elif kind == "garbage_start":
        params["garbage"] = _garbage(rng, "start")
        start = None
    elif kind == "garbage_mid":
        start["num_frames"] = rng.randint(96, 160)
        steps = [_garbage(rng, "mid") for _ in range(rng.randint(1, 4))]
        steps.append({"label": "ping", "text": '{"type": "session.ping"}', "expect": "pong"})
        for step in steps:
            step["delay"] = round(rng.uniform(0.0, 0.02), 4)
        params["controls"] = steps
    elif kind == "oversized_start":
        params["bytes"] = MAX_START_BYTES + rng.randint(1, 2048)
        params["text"] = _padded_start(start, params["bytes"])
        start = None
    elif kind == "oversized_control":
        start["num_frames"] = rng.randint(96, 160)
        oversized = MAX_CONTROL_BYTES + rng.randint(1, 2048)
        params["controls"] = [
            {
                "label": f"oversized:{oversized}",
                "text": _padded_interaction(oversized, "big"),
                "expect": "error:message_too_large",
                "delay": 0.0,
            },
            {"label": "ping", "text": '{"type": "session.ping"}', "expect": "pong", "delay": 0.0},
        ]
    elif kind == "oversized_frame":
        params["where"] = rng.choice(("start", "mid"))
        start["num_frames"] = rng.randint(96, 160)
        params["bytes"] = OVERSIZED_FRAME_FACTOR * max(MAX_START_BYTES, MAX_CONTROL_BYTES) + (
            rng.randint(1, 4096)
        )
    elif kind == "no_start":
        start = None
    elif kind == "engine_fail":
        start["num_frames"] = rng.randint(16, 64)
        params["at_chunk"] = rng.randint(0, start["num_frames"] // 4 - 1)
        start["extra_params"] = {"fail_at_chunk": params["at_chunk"]}
    elif kind == "engine_hang":
        start["num_frames"] = rng.randint(16, 64)
        params["at_chunk"] = rng.randint(0, start["num_frames"] // 4 - 1)
        start["extra_params"] = {"hang_at_chunk": params["at_chunk"]}
    elif kind != "normal":
        raise ValueError(f"unknown session kind {kind!r}")
    return Plan(index=index, kind=kind, warmup=warmup, start=start, params=params)


def make_plans(seed: int, sessions: int, warmup: int) -> list[Plan]:
    """The warm-up sessions, then the measured ones: the same seed gives the same plans.

    Each kind comes at least once among the measured sessions when there are enough of
    them, so a short run still covers every kind; the rest are drawn by weight.
    """
    rng = random.Random(seed)
    names = list(KINDS)
    weights = [KINDS[name] for name in names]
    warm = [rng.choices(names, weights)[0] for _ in range(warmup)]
    kinds = list(names) if sessions >= len(names) else []
    kinds += rng.choices(names, weights, k=sessions - len(kinds))
    rng.shuffle(kinds)
    plans = [make_plan(rng, i, kind, warmup=True) for i, kind in enumerate(warm)]
    plans += [make_plan(rng, warmup + i, kind) for i, kind in enumerate(kinds)]
    return plans


# --------------------------------------------------------------------------------------
# Transcripts and the checks on them (pure: unit-tested with fake transcripts)
# --------------------------------------------------------------------------------------


@attrs.define
class Event:
    """One message in or out, in order, with its monotonic time."""

    t: float
    direction: str
    """``in`` (from the server) or ``out`` (from the client)."""
    text: str | None = None
    size: int = 0
    label: str = ""
    expect: str | None = None
    """For ``out``: the answer it must get (``pong``, ``queued:ID``, ``error:CODE``)."""
    delivered: bool = True
    """For ``out``: False when the send failed because the connection was closed."""


@attrs.define
class Transcript:
    """Everything one client saw and did; the checks judge it afterwards."""

    t0: float
    wall0: float
    connected_at: float | None = None
    events: list[Event] = attrs.Factory(list)
    close_code: int | None = None
    close_reason: str | None = None
    closed_at: float | None = None
    eof: bool | None = None
    """Whether the server closed TCP after the close handshake (non-abandoned sessions)."""
    abandoned: str | None = None
    """How the client gave up on the session: fin, rst, close, stop_reading, watchdog."""
    abandoned_at: float | None = None
    close_answered: bool | None = None
    """For a client close frame: whether the server answered it in time."""
    released_after: float | None = None
    """Seconds from abandoning until the server no longer held the connection."""
    release_problem: str | None = None
    server_inode: int | None = None
    queue_full_at: float | None = None
    """For a stopped reader: when its receive queue stopped growing."""
    slots_held: int | None = None
    """Connections the soak counted open on the server when this one connected (itself
    included): never more than --max-sessions."""
    client_error: str | None = None
    timed_out: bool = False
    cut_by_deadline: bool = False
    ended_at: float | None = None

    def received(self) -> list[Event]:
        return [e for e in self.events if e.direction == "in"]

    def sent(self) -> list[Event]:
        return [e for e in self.events if e.direction == "out"]

    def request_id(self) -> str | None:
        for event in self.received():
            if event.text is not None and '"video.start"' in event.text:
                try:
                    message = json.loads(event.text)
                except ValueError:
                    return None
                value = message.get("request_id") if isinstance(message, dict) else None
                return value if isinstance(value, str) else None
        return None


@attrs.frozen
class Verdict:
    outcome: str
    """In a word: done, done(stopped), error:CODE, close:CODE, abandoned:HOW, refused."""
    problems: list[str]


def _describe(message: dict[str, Any]) -> str:
    kind = message.get("type")
    if kind == "error":
        return f"error {message.get('code')!s} ({message.get('message')!s})"
    if kind == "session.done":
        return f"session.done stopped={json.dumps(message.get('stopped'))}"
    return str(kind)


def _reply_key(message: dict[str, Any]) -> str:
    kind = message.get("type")
    if kind == "session.pong":
        return "pong"
    if kind == "session.interaction.queued":
        return f"queued:{message.get('event_id')}"
    return f"error:{message.get('code')}"


REPLY_TYPES: Final = frozenset({"session.pong", "session.interaction.queued", "error"})
KNOWN_TYPES: Final = frozenset(
    {
        "video.start",
        "video.chunk_metadata",
        "session.interaction.queued",
        "session.pong",
        "session.done",
        "error",
    }
)


def check_transcript(plan: Plan, tr: Transcript, timing: Timing) -> Verdict:
    """Judge one session's transcript against what its kind must see.

    Every session: well-formed messages (JSON objects of known types, every ``error``
    with a ``code``, each chunk's metadata followed by exactly its binary message), at
    most one terminal message and nothing after ``session.done``, answers to control
    messages in order. Sessions the client did not abandon: exactly one terminal message
    as the last message, the expected one, then the expected close code.
    """
    problems: list[str] = []
    messages: list[tuple[float, dict[str, Any]]] = []
    media_frames = 0
    media_chunks = 0
    chunk_count = 0
    trailer_at: int | None = None
    last_progress: float | None = None
    pending: dict[str, Any] | None = None
    for event in tr.received():
        if event.text is None:  # binary
            if pending is None:
                problems.append(f"binary message of {event.size} bytes without chunk metadata")
            else:
                if event.size != pending.get("byte_length"):
                    problems.append(
                        f"chunk {pending.get('transport_chunk_index')}: byte_length "
                        f"{pending.get('byte_length')} but {event.size} bytes arrived"
                    )
                if pending.get("kind") == "media":
                    media_chunks += 1
                    frames = pending.get("num_frames")
                    media_frames += frames if isinstance(frames, int) else 0
                    last_progress = event.t
                pending = None
            continue
        try:
            message = json.loads(event.text)
        except ValueError:
            problems.append(f"server sent text that is not JSON: {event.text[:120]!r}")
            continue
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            problems.append(f"server message is not an object with a type: {event.text[:120]!r}")
            continue
        if pending is not None:
            problems.append("chunk metadata not followed by its binary message")
            pending = None
        kind = message["type"]
        if kind not in KNOWN_TYPES:
            problems.append(f"unknown server message type {kind!r}")
        if kind == "error":
            code = message.get("code")
            if not isinstance(code, str) or not code:
                problems.append(f"error message without a code: {event.text[:200]}")
        elif kind == "video.chunk_metadata":
            if message.get("transport_chunk_index") != chunk_count:
                problems.append(
                    f"chunk {chunk_count} has transport_chunk_index "
                    f"{message.get('transport_chunk_index')}"
                )
            if message.get("kind") == "trailer":
                trailer_at = len(messages)
            elif trailer_at is not None:
                problems.append("media chunk after the trailer")
            chunk_count += 1
            pending = message
        elif kind == "video.start":
            last_progress = event.t
        messages.append((event.t, message))
    if pending is not None and tr.abandoned is None and not tr.cut_by_deadline:
        problems.append("the last chunk metadata has no binary message")

    types = [m.get("type") for _, m in messages]
    if messages and _is_busy(messages[0][1]):
        problems.append(
            "admission: server_busy although the soak had fewer connections open than "
            "--max-sessions (each one counted until the server closed it)"
        )
        return Verdict("refused", problems)

    # One terminal message at most, and nothing after session.done.
    dones = [i for i, kind in enumerate(types) if kind == "session.done"]
    if len(dones) > 1:
        problems.append(f"{len(dones)} session.done messages (expected exactly one)")
    if dones and dones[0] != len(messages) - 1:
        after = ", ".join(_describe(m) for _, m in messages[dones[0] + 1 :])
        problems.append(f"messages after session.done (two terminal messages?): {after}")
    last = messages[-1][1] if messages else None
    terminal: str | None = None
    if last is not None and last.get("type") == "session.done":
        terminal = "done(stopped)" if last.get("stopped") else "done"
    elif last is not None and last.get("type") == "error":
        terminal = f"error:{last.get('code')}"

    # Answers to control messages, in the order they were sent.
    body = messages[:-1] if terminal is not None and terminal.startswith("error") else messages
    if plan.kind in ("garbage_start", "oversized_start"):
        body = messages[:-1] if terminal else messages
    got = [_reply_key(m) for _, m in body if m.get("type") in REPLY_TYPES]
    wanted = [(e.label, e.expect) for e in tr.sent() if e.expect and e.delivered]
    for i, (key, (label, expect)) in enumerate(zip(got, wanted, strict=False)):
        if key != expect:
            problems.append(f"answer {i + 1} (to {label}): expected {expect}, got {key}")
    if len(got) > len(wanted):
        extra = ", ".join(got[len(wanted) :])
        problems.append(
            f"unexpected message(s) mid-session, answering nothing the client sent "
            f"(a terminal error before the end?): {extra}"
        )
    finished = tr.abandoned is None and not tr.cut_by_deadline
    strict = plan.kind not in ("pings_to_close", "stop") and finished
    if strict and len(got) < len(wanted):
        missing = ", ".join(f"{label} ({expect})" for label, expect in wanted[len(got) :])
        problems.append(f"no answer before the session ended to: {missing}")

    if trailer_at is not None and terminal != "done" and finished:
        problems.append(f"trailer sent, but the session ended with {terminal}")
    done_chunks = messages[dones[0]][1].get("chunks") if dones else chunk_count
    if done_chunks != chunk_count:
        problems.append(f"session.done says {done_chunks} chunks, {chunk_count} arrived")

    if tr.client_error is not None:
        problems.append(f"client: {tr.client_error}")
    if tr.timed_out:
        problems.append(f"session did not end within the {timing.session_timeout():.0f} s watchdog")
    if tr.release_problem is not None:
        problems.append(tr.release_problem)

    if tr.abandoned is not None:
        if tr.abandoned == "close" and tr.close_answered is False:
            problems.append(
                f"the server did not answer the client's close frame within "
                f"{CLOSE_HANDSHAKE_WAIT_S:.0f} s"
            )
        return Verdict(f"abandoned:{tr.abandoned}", problems)
    if tr.cut_by_deadline or tr.client_error is not None or tr.timed_out:
        return Verdict("incomplete", problems)

    # What the kind expects at the end.
    seen_end = terminal or "no terminal message"
    outcome = terminal or (f"close:{tr.close_code}" if tr.close_code else "no close")
    expected_close = 1009 if plan.kind == "oversized_frame" else 1000
    if tr.close_code != expected_close:
        got_close = tr.close_code if tr.close_code is not None else "none"
        problems.append(
            f"close code {got_close} ({tr.close_reason or 'no reason'}), expected {expected_close}"
        )
    if tr.eof is False:
        problems.append(
            f"the server did not close TCP within {EOF_WAIT_S:.0f} s after the close handshake"
        )
    kind = plan.kind
    if kind in ("normal", "slow_reader", "chatty", "garbage_mid", "oversized_control"):
        _expect_done(problems, terminal, seen_end, stopped_ok=False)
    elif kind in ("stop", "pings_to_close"):
        _expect_done(problems, terminal, seen_end, stopped_ok=kind == "stop")
    elif kind == "garbage_start":
        _expect_only_error(problems, messages, plan.params["garbage"]["expect"], seen_end)
    elif kind == "oversized_start":
        _expect_only_error(problems, messages, "error:message_too_large", seen_end)
    elif kind == "no_start":
        _expect_only_error(problems, messages, "error:start_timeout", seen_end)
        if terminal == "error:start_timeout" and tr.connected_at is not None:
            _expect_delay(
                problems,
                "start_timeout",
                messages[-1][0] - tr.connected_at,
                timing.start_timeout,
                timing,
            )
    elif kind in ("engine_fail", "engine_hang"):
        code = "generation_failed" if kind == "engine_fail" else "stall_timeout"
        if terminal != f"error:{code}":
            problems.append(f"expected error {code} as the terminal message, got {seen_end}")
        at_chunk = plan.params["at_chunk"]
        if media_chunks > at_chunk:
            problems.append(f"{media_chunks} media chunks, but the engine stopped at {at_chunk}")
        if kind == "engine_hang" and terminal == f"error:{code}" and last_progress is not None:
            _expect_delay(
                problems,
                "stall_timeout",
                messages[-1][0] - last_progress,
                timing.stall_timeout,
                timing,
            )
    elif kind == "oversized_frame" and terminal is not None and plan.params["where"] == "start":
        problems.append(f"expected a close 1009 without messages, got {seen_end}")
    if terminal == "done" and kind != "oversized_frame" and media_frames != plan.num_frames:
        problems.append(f"{media_frames} frames arrived, {plan.num_frames} requested")
    if types and plan.start is not None and kind != "oversized_frame" and types[0] != "video.start":
        problems.append(f"first message {_describe(messages[0][1])}, expected video.start")
    return Verdict(outcome, problems)


def _is_busy(message: dict[str, Any]) -> bool:
    return message.get("type") == "error" and message.get("code") == "server_busy"


def _expect_done(problems: list[str], terminal: str | None, seen: str, *, stopped_ok: bool) -> None:
    allowed = ("done", "done(stopped)") if stopped_ok else ("done",)
    if terminal not in allowed:
        want = "session.done" if stopped_ok else "session.done with stopped=false"
        problems.append(f"expected {want} as the terminal message, got {seen}")


def _expect_only_error(
    problems: list[str], messages: list[tuple[float, dict[str, Any]]], expect: str, seen: str
) -> None:
    keys = [_reply_key(m) if m.get("type") == "error" else _describe(m) for _, m in messages]
    if keys != [expect]:
        problems.append(
            f"expected exactly one message, {expect}, then close 1000; got "
            f"{', '.join(keys) or 'no message'} (terminal: {seen})"
        )


def _expect_delay(
    problems: list[str], what: str, delay: float, timeout: float, timing: Timing
) -> None:
    if not timeout - timing.early <= delay <= timeout + timing.slack:
        problems.append(
            f"{what} after {delay:.2f} s, expected {timeout:.2f} s "
            f"(-{timing.early:.1f} / +{timing.slack:.1f} s)"
        )


SERVER_OUTCOMES: Final[dict[str, tuple[frozenset[str], str | None]]] = {
    # kind: (outcomes allowed in /stats' recent_sessions, required error_code or None)
    "normal": (frozenset({"completed"}), None),
    "slow_reader": (frozenset({"completed"}), None),
    "chatty": (frozenset({"completed"}), None),
    "garbage_mid": (frozenset({"completed"}), None),
    "oversized_control": (frozenset({"completed"}), None),
    "pings_to_close": (frozenset({"completed"}), None),
    "stop": (frozenset({"completed", "stopped"}), None),
    "fin": (frozenset({"disconnected", "completed"}), None),
    "rst": (frozenset({"disconnected", "completed"}), None),
    "close": (frozenset({"disconnected", "completed"}), None),
    "oversized_frame": (frozenset({"disconnected"}), None),
    "stopped_reader": (frozenset({"stalled"}), "stall_timeout"),
    "engine_fail": (frozenset({"failed"}), "generation_failed"),
    "engine_hang": (frozenset({"stalled"}), "stall_timeout"),
}


def check_server_record(
    plan: Plan, tr: Transcript, record: dict[str, Any] | None, timing: Timing
) -> list[str]:
    """The server's own account of a session (``recent_sessions`` in /stats), for the
    sessions whose request id the client learnt: the outcome its kind allows, and for a
    stopped reader, an abort within about the stall timeout."""
    if record is None:
        return ["the server's /stats has no record of this session"]
    problems: list[str] = []
    outcome, code = record.get("outcome"), record.get("error_code")
    allowed, required_code = SERVER_OUTCOMES.get(plan.kind, (frozenset(), None))
    if allowed and outcome not in allowed:
        problems.append(
            f"server recorded outcome {outcome!r} ({code}: {record.get('error_message')}), "
            f"expected {' or '.join(sorted(allowed))}"
        )
    elif required_code is not None and code != required_code:
        problems.append(f"server recorded error_code {code!r}, expected {required_code!r}")
    closed = record.get("stream_closed_at")
    if plan.kind == "stopped_reader" and isinstance(closed, int | float):
        # The stall clock starts when the server's sends stop getting through, which is
        # after the client stopped reading by however long the buffers took to fill.
        if tr.queue_full_at is not None:
            since, what, bound = tr.queue_full_at, "its receive queue was full", 0.0
        elif tr.abandoned_at is not None:
            since, what, bound = tr.abandoned_at, "the client stopped reading", timing.slack
        else:
            return problems
        bound += timing.stall_timeout + timing.slack
        if closed - since > bound:
            problems.append(
                f"engine stream closed {closed - since:.2f} s after {what}, expected within "
                f"{bound:.1f} s (stall timeout + slack)"
            )
    return problems


def check_server_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records no session may have, whoever it was: an internal error."""
    return [r for r in records if r.get("error_code") == "internal_error"]


# --------------------------------------------------------------------------------------
# The server's log
# --------------------------------------------------------------------------------------

_RECORD = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?P<level>[A-Z]+) (?P<name>\S+): "
    r"(?P<message>.*)$"
)
_REQUEST_ID = re.compile(r"video_stream-[0-9a-f]{32}")


@attrs.frozen
class LogRecord:
    wall: float | None
    level: str
    name: str
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def parse_log(text: str) -> list[LogRecord]:
    """The server's log as records: a line in the logging format starts one, anything
    else (tracebacks, prints) belongs to the record before it."""
    records: list[LogRecord] = []
    wall: float | None = None
    level, name = "OTHER", ""
    lines: list[str] = []
    for line in text.splitlines():
        match = _RECORD.match(line)
        if match:
            if lines:
                records.append(LogRecord(wall, level, name, tuple(lines)))
            stamp = dt.datetime.strptime(match["time"], "%Y-%m-%d %H:%M:%S,%f")
            wall, level, name, lines = stamp.timestamp(), match["level"], match["name"], [line]
        else:
            lines.append(line)
    if lines:
        records.append(LogRecord(wall, level, name, tuple(lines)))
    return records


def log_problems(records: Sequence[LogRecord], expected_ids: set[str]) -> list[LogRecord]:
    """ERROR records and tracebacks, except those of sessions whose failure was injected
    (``expected_ids``: their request ids)."""
    bad: list[LogRecord] = []
    for record in records:
        serious = record.level in ("ERROR", "CRITICAL") or any(
            line.startswith("Traceback (most recent call last)") for line in record.lines
        )
        if not serious:
            continue
        ids = set(_REQUEST_ID.findall(record.text))
        if ids and ids <= expected_ids:
            continue
        bad.append(record)
    return bad


def log_summary(records: Sequence[LogRecord]) -> dict[str, int]:
    """WARNING and ERROR records by message, with ids and numbers blanked: what kinds of
    trouble the server reported, and how often."""
    counts: Counter[str] = Counter()
    for record in records:
        if record.level in ("WARNING", "ERROR", "CRITICAL"):
            message = record.lines[0].split(": ", 1)[-1]
            message = _REQUEST_ID.sub("<id>", message)
            message = re.sub(r"\d+(\.\d+)?", "N", message)
            counts[f"{record.level} {message}"] += 1
    return dict(counts.most_common())


def log_excerpt(
    records: Sequence[LogRecord], tr: Transcript, request_id: str | None, limit: int = 20
) -> list[str]:
    """The server's lines about one session: by request id, else by time."""
    if request_id is not None:
        chosen = [r for r in records if request_id in r.text]
    else:
        start = tr.wall0 - 0.05
        end = tr.wall0 + ((tr.ended_at or tr.t0) - tr.t0) + 0.5
        chosen = [r for r in records if r.wall is not None and start <= r.wall <= end]
    lines = [line for record in chosen for line in record.lines[:40]]
    return lines[:limit] if len(lines) <= limit else [*lines[: limit - 1], "..."]


# --------------------------------------------------------------------------------------
# The server process, seen from /proc
# --------------------------------------------------------------------------------------


def _proc_status(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def socket_inodes(pid: int) -> set[int] | None:
    """Inodes of the sockets the process holds open (None if it is gone)."""
    inodes: set[int] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def server_side_inode(server_port: int, client_port: int) -> int | None:
    """The inode of the server's socket for the connection from ``client_port``, from
    /proc/net/tcp (0 there means no process holds it, or it is not accepted yet)."""
    try:
        with open("/proc/net/tcp") as table:
            next(table)
            for line in table:
                fields = line.split()
                local, remote = fields[1].split(":"), fields[2].split(":")
                if int(local[1], 16) != server_port or int(remote[1], 16) != client_port:
                    continue
                if socket.inet_ntoa(struct.pack("=I", int(local[0], 16))) != "127.0.0.1":
                    continue
                if int(fields[9]):  # not an earlier connection's TIME_WAIT on the same ports
                    return int(fields[9])
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return None


@attrs.frozen
class Snapshot:
    """The server process's resources at one moment."""

    at: float
    threads: int | None
    fds: int | None
    rss_kib: int | None
    metrics: dict[str, Any] | None

    @classmethod
    def take(cls, pid: int, metrics: dict[str, Any] | None) -> Snapshot:
        try:
            fds: int | None = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            fds = None
        keys = ("sessions_active", "streams_open", "worker_threads", "threads_alive", "rss_bytes")
        subset = {k: metrics.get(k) for k in keys} if metrics else None
        return cls(now(), _proc_status(pid, "Threads"), fds, _proc_status(pid, "VmRSS"), subset)

    def to_json(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "fds": self.fds,
            "rss_mib": round(self.rss_kib / 1024, 1) if self.rss_kib is not None else None,
            "metrics": self.metrics,
        }


def idle_problems(metrics: dict[str, Any] | None) -> list[str]:
    if metrics is None:
        return ["GET /stats failed"]
    return [
        f"/stats {key} is {metrics.get(key)}, expected 0"
        for key in ("sessions_active", "streams_open", "worker_threads")
        if metrics.get(key) != 0
    ]


def resource_problems(baseline: Snapshot, final: Snapshot) -> list[str]:
    """Leaks: the final snapshot against the baseline, with the thresholds above."""
    problems = idle_problems(final.metrics)
    if None in (baseline.fds, final.fds, baseline.threads, final.threads):
        problems.append("could not read the server's /proc entries")
        return problems
    assert baseline.fds is not None and final.fds is not None
    assert baseline.threads is not None and final.threads is not None
    if final.fds - baseline.fds > FD_GROWTH_LIMIT:
        problems.append(f"open file descriptors {baseline.fds} -> {final.fds}")
    if final.threads - baseline.threads > THREAD_GROWTH_LIMIT:
        problems.append(f"OS threads {baseline.threads} -> {final.threads}")
    if baseline.rss_kib is not None and final.rss_kib is not None:
        growth = (final.rss_kib - baseline.rss_kib) / 1024
        if growth > RSS_GROWTH_LIMIT_MIB:
            problems.append(
                f"RSS grew {growth:.1f} MiB ({baseline.rss_kib / 1024:.1f} -> "
                f"{final.rss_kib / 1024:.1f} MiB), limit {RSS_GROWTH_LIMIT_MIB:.0f} MiB"
            )
    return problems


class SocketWatch:
    """Tells when the server has closed its socket of a connection: one scan of
    /proc/PID/fd every 50 ms serves every waiter."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._waiters: dict[int, trio.Event] = {}
        self._wake = trio.Event()

    async def run(self) -> None:
        while True:
            if not self._waiters:
                await self._wake.wait()
                self._wake = trio.Event()
            held = socket_inodes(self.pid)
            for inode, event in list(self._waiters.items()):
                if held is None or inode not in held:
                    event.set()
                    del self._waiters[inode]
            await trio.sleep(0.05)

    async def wait_closed(self, inode: int) -> None:
        event = self._waiters.setdefault(inode, trio.Event())
        self._wake.set()
        await event.wait()


# --------------------------------------------------------------------------------------
# One client connection
# --------------------------------------------------------------------------------------


@attrs.frozen
class Abandon:
    """What a driver decided: give the session up, this way."""

    how: str
    """fin, rst, close or stop_reading."""


class Conn:
    """One WebSocket client: records every message into the transcript, and lets the
    kind's driver wait for what it needs (video.start, an answer, the close)."""

    def __init__(self, ws: WebSocketConnection, tr: Transcript) -> None:
        self.ws = ws
        self.tr = tr
        self.closed = trio.Event()
        self.stopped_reading = trio.Event()
        self.read_delays: list[float] = []
        self.read_limit: int | None = None
        self.video_started = False
        self.answers = 0
        self.terminal_seen = False
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def read_loop(self) -> None:
        delays = iter(self.read_delays)
        while True:
            if self.read_limit is not None and len(self.tr.received()) >= self.read_limit:
                self.stopped_reading.set()
                self._notify()
                return
            delay = next(delays, 0.0)
            if delay:
                await trio.sleep(delay)
            try:
                raw = await self.ws.get_message()
            except ConnectionClosed as exc:
                reason = exc.reason
                self.tr.close_code = getattr(reason, "code", None)
                self.tr.close_reason = getattr(reason, "reason", None)
                self.tr.closed_at = now()
                self.closed.set()
                self._notify()
                return
            if isinstance(raw, bytes):
                self.tr.events.append(Event(now(), "in", size=len(raw)))
            else:
                self.tr.events.append(Event(now(), "in", text=raw, size=len(raw)))
                self._note(raw)
            self._notify()

    def _note(self, raw: str) -> None:
        try:
            message = json.loads(raw)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        kind = message.get("type")
        if kind == "video.start":
            self.video_started = True
        elif kind in REPLY_TYPES:
            self.answers += 1
        if kind == "session.done":
            self.terminal_seen = True

    async def send(self, data: str | bytes, label: str, expect: str | None = None) -> bool:
        """Send one message; False (and recorded as undelivered) once the connection is
        closed, which drivers treat as the end of what they had to say."""
        event = Event(now(), "out", size=len(data), label=label, expect=expect)
        self.tr.events.append(event)
        try:
            await self.ws.send_message(data)
        except ConnectionClosed:
            event.delivered = False
            return False
        return True

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds; False on timeout or once the connection closed."""
        with trio.move_on_after(timeout):
            while not predicate():
                if self.closed.is_set() or self.stopped_reading.is_set():
                    return predicate()
                await self._changed.wait()
            return True
        return False


Driver = Callable[[Conn, Plan, Timing], Awaitable[Abandon | None]]


async def _send_start(c: Conn, plan: Plan) -> bool:
    return await c.send(plan.start_text(), "session.start")


async def _send_controls(c: Conn, steps: Sequence[dict[str, Any]], timing: Timing) -> None:
    """Each control message after its delay, waiting for its answer before the next, so
    that all of them reach the server while the session is surely still streaming."""
    for step in steps:
        if step.get("delay"):
            await trio.sleep(step["delay"])
        before = c.answers
        data: str | bytes = bytes.fromhex(step["hex"]) if "hex" in step else step["text"]
        if not await c.send(data, step["label"], step.get("expect")):
            return
        if step.get("expect") and not await c.wait_for(
            lambda before=before: c.answers > before, timing.reply_wait
        ):
            return


async def drive_normal(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    await _send_start(c, plan)
    return None


async def drive_stop(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    if not await _send_start(c, plan):
        return None
    with trio.move_on_after(plan.params["stop_after_s"]):
        await c.closed.wait()
    if not c.closed.is_set() and not c.terminal_seen:
        await c.send('{"type": "session.stop"}', "session.stop")
    return None


async def drive_controls(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    """chatty, garbage_mid, oversized_control: controls once video.start has come."""
    if not await _send_start(c, plan):
        return None
    if await c.wait_for(lambda: c.video_started, timing.reply_wait):
        await _send_controls(c, plan.params["controls"], timing)
    return None


async def drive_pings_to_close(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    if not await _send_start(c, plan):
        return None
    while not c.closed.is_set():
        if not await c.send('{"type": "session.ping"}', "ping", "pong"):
            break
        with trio.move_on_after(plan.params["ping_every_s"]):
            await c.closed.wait()
    return None


async def drive_garbage_start(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    step = plan.params["garbage"]
    data: str | bytes = bytes.fromhex(step["hex"]) if "hex" in step else step["text"]
    await c.send(data, step["label"])
    return None


async def drive_oversized_start(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    await c.send(plan.params["text"], f"oversized start:{plan.params['bytes']}")
    return None


async def drive_oversized_frame(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    if plan.params["where"] == "mid":
        if not await _send_start(c, plan):
            return None
        if not await c.wait_for(lambda: c.video_started, timing.reply_wait):
            return None
    size = plan.params["bytes"]
    await c.send(_padded_start(plan.start or {}, size), f"oversized frame:{size}")
    return None


async def drive_no_start(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    return None


async def drive_disconnect(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    how = plan.kind
    phase = plan.params["phase"]
    if phase != "before_start" and not await _send_start(c, plan):
        return Abandon(how)
    if phase == "after_start":
        await trio.sleep(plan.params["delay_s"] / 100)  # 0-3 ms: usually before video.start
    elif phase == "mid_stream":
        await c.wait_for(lambda: c.video_started, timing.reply_wait)
        with trio.move_on_after(plan.params["delay_s"]):
            await c.closed.wait()
    return Abandon(how)


async def drive_stopped_reader(c: Conn, plan: Plan, timing: Timing) -> Abandon | None:
    c.read_limit = plan.params["read_messages"]
    if not await _send_start(c, plan):
        return None
    await c.wait_for(lambda: False, timing.reply_wait)  # until it stopped reading
    if c.closed.is_set():
        return None  # the server ended it before the client stopped reading
    return Abandon("stop_reading")


DRIVERS: Final[dict[str, Driver]] = {
    "normal": drive_normal,
    "stop": drive_stop,
    "chatty": drive_controls,
    "pings_to_close": drive_pings_to_close,
    "slow_reader": drive_normal,  # the reading is slow: see Conn.read_delays
    "stopped_reader": drive_stopped_reader,
    "fin": drive_disconnect,
    "rst": drive_disconnect,
    "close": drive_disconnect,
    "garbage_start": drive_garbage_start,
    "garbage_mid": drive_controls,
    "oversized_start": drive_oversized_start,
    "oversized_control": drive_controls,
    "oversized_frame": drive_oversized_frame,
    "no_start": drive_no_start,
    "engine_fail": drive_normal,
    "engine_hang": drive_normal,
}


# --------------------------------------------------------------------------------------
# The soak
# --------------------------------------------------------------------------------------


@attrs.define
class SessionResult:
    plan: Plan
    tr: Transcript
    verdict: Verdict | None = None
    request_id: str | None = None


@attrs.frozen
class Violation:
    """One broken rule, with what a person needs to find it in the server."""

    what: str
    session: int | None = None
    kind: str = "server"
    request_id: str | None = None
    details: dict[str, Any] = attrs.Factory(dict)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def transcript_summary(tr: Transcript, limit: int = 24) -> list[str]:
    """The transcript in a few lines, runs of chunks folded."""
    lines: list[str] = []
    chunks = 0
    first_chunk = 0.0

    def flush() -> None:
        nonlocal chunks
        if chunks:
            lines.append(f"+{first_chunk:.3f} {chunks} x (chunk metadata + binary)")
            chunks = 0

    for event in tr.events:
        t = event.t - tr.t0
        if event.direction == "in" and event.text is None:
            continue
        text = event.text or ""
        if event.direction == "in" and '"video.chunk_metadata"' in text and '"trailer"' not in text:
            if not chunks:
                first_chunk = t
            chunks += 1
            continue
        flush()
        if event.direction == "out":
            note = "" if event.delivered else " (not delivered: closed)"
            lines.append(f"+{t:.3f} sent {event.label} ({event.size} B){note}")
        else:
            text = event.text or ""
            lines.append(f"+{t:.3f} got {text[:160]}")
    flush()
    if tr.abandoned:
        lines.append(f"+{(tr.abandoned_at or tr.t0) - tr.t0:.3f} client abandoned: {tr.abandoned}")
    if tr.closed_at is not None:
        lines.append(f"+{tr.closed_at - tr.t0:.3f} close {tr.close_code} {tr.close_reason or ''}")
    if len(lines) > limit:
        lines = [*lines[: limit // 2], "...", *lines[-limit // 2 :]]
    return lines


class Soak:
    """Runs the plans against one server and collects what the checks need."""

    def __init__(
        self,
        settings: Settings,
        server: bench.ServerProcess,
        endpoint: bench.Endpoint,
    ) -> None:
        self.s = settings
        self.server = server
        self.endpoint = endpoint
        assert server.pid is not None
        self.pid: int = server.pid
        self.watch = SocketWatch(self.pid)
        self.slots = trio.Semaphore(settings.concurrency)
        self.results: list[SessionResult] = []
        self.records: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.by_id: dict[str, dict[str, Any]] = {}
        self.metrics_failures = 0
        self.metrics_lock = trio.Lock()
        """Held while a /stats connection is open: a snapshot of the server's open file
        descriptors must not count it."""
        self.running = 0
        self.lingering = 0
        self.releases: list[tuple[float, int, str, str]] = []
        self.done = 0
        self.phase = "starting"

    # ------------------------------------------------------------------ metrics

    async def poll_metrics(self) -> None:
        """Collect ``recent_sessions`` before the server's ring of 256 forgets them."""
        while True:
            await self.fetch_stats()
            await trio.sleep(METRICS_PERIOD_S)

    async def fetch_stats(self) -> dict[str, Any] | None:
        async with self.metrics_lock:
            return await self._fetch_stats()

    async def _fetch_stats(self) -> dict[str, Any] | None:
        metrics = await bench.fetch_stats(self.endpoint)
        if metrics is None:
            self.metrics_failures += 1
            return None
        for record in metrics.get("recent_sessions") or []:
            key = (record.get("request_id"), record.get("started_at"), record.get("ended_at"))
            self.records[key] = record
            if isinstance(record.get("request_id"), str):
                self.by_id[record["request_id"]] = record
        return metrics

    def record_of(self, request_id: str) -> dict[str, Any] | None:
        return self.by_id.get(request_id)

    async def report_progress(self) -> None:
        while True:
            await trio.sleep(PROGRESS_PERIOD_S)
            problems = sum(1 for r in self.results if r.verdict and r.verdict.problems)
            progress(
                f"{self.phase}: {self.done} sessions done, {self.running} running, "
                f"{self.lingering} abandoned not yet released, {problems} with problems"
            )

    # ----------------------------------------------------------------- sessions

    async def run_phase(self, plans: Sequence[Plan], name: str, deadline: float) -> bool:
        """Run ``plans`` with ``concurrency`` workers; False if the deadline cut it short."""
        self.phase = name
        queue: Iterator[Plan] = iter(plans)
        with trio.move_on_at(deadline) as scope:
            async with trio.open_nursery() as lingering, trio.open_nursery() as workers:
                for _ in range(self.s.concurrency):
                    workers.start_soon(self._worker, queue, lingering)
        return not scope.cancelled_caught

    async def _worker(self, queue: Iterator[Plan], lingering: trio.Nursery) -> None:
        for plan in queue:
            await self.slots.acquire()
            await self._session(plan, lingering)

    async def _session(self, plan: Plan, lingering: trio.Nursery) -> None:
        """One session, from connect to the end of the client's part. The admission slot
        is released once the server has closed the connection: here for sessions that
        ended with an end-of-stream from the server, in a lingering task otherwise."""
        tr = Transcript(t0=now(), wall0=time.time())
        tr.slots_held = self.s.concurrency - self.slots.value
        result = SessionResult(plan, tr)
        self.results.append(result)
        self.running += 1
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stream: trio.SocketStream | None = None
        abandon: Abandon | None = None
        handed_over = False
        try:
            if plan.kind == "stopped_reader":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF_STOPPED)
            with trio.move_on_after(self.s.timing.session_timeout()) as watchdog:
                await sock.connect((self.endpoint.host, self.endpoint.port))
                stream = trio.SocketStream(sock)
                abandon = await self._converse(plan, tr, stream)
            if watchdog.cancelled_caught:
                tr.timed_out = True
                abandon = Abandon("watchdog")
            if abandon is not None and stream is not None:
                await self._abandon(tr, stream, abandon)
                lingering.start_soon(self._linger, result, stream, abandon.how)
                handed_over = True
            elif tr.eof is False and stream is not None:
                lingering.start_soon(self._linger, result, stream, "eof")
                handed_over = True
        except Exception as exc:  # a soak bug or a transport surprise: report, go on
            tr.client_error = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:
            # The watchdog catches its own cancellation: this is the soak's deadline.
            tr.cut_by_deadline = _is_cancellation(exc)
            raise
        finally:
            tr.ended_at = now()
            result.request_id = tr.request_id()
            # Judged again at the end, with the server's records; this is for progress.
            result.verdict = check_transcript(plan, tr, self.s.timing)
            self.running -= 1
            self.done += 1
            if not handed_over:
                with trio.CancelScope(shield=True):
                    if stream is not None:
                        await stream.aclose()
                    else:
                        sock.close()
                self._release(result, "client saw the server close")

    async def _converse(
        self, plan: Plan, tr: Transcript, stream: trio.SocketStream
    ) -> Abandon | None:
        client_port = stream.socket.getsockname()[1]
        abandon: Abandon | None = None
        async with trio.open_nursery() as nursery:
            try:
                ws = await wrap_client_stream(
                    nursery,
                    stream,
                    self.endpoint.host_header,
                    self.endpoint.resource,
                    max_message_size=bench.CLIENT_MAX_MESSAGE,
                    receive_buffer_size=bench.RECEIVE_BUFFER,
                )
            except (ConnectionRejected, HandshakeError) as exc:
                tr.client_error = f"WebSocket handshake failed: {type(exc).__name__}: {exc}"
                nursery.cancel_scope.cancel()
                return None
            tr.connected_at = now()
            tr.server_inode = server_side_inode(self.endpoint.port, client_port)
            conn = Conn(ws, tr)
            if plan.kind == "slow_reader":
                conn.read_delays = list(plan.params["read_delays"])
            nursery.start_soon(conn.read_loop)
            abandon = await DRIVERS[plan.kind](conn, plan, self.s.timing)
            if abandon is None:
                # Until the server's close, then (bounded) until its TCP close, which
                # trio-websocket's reader sees as end-of-stream.
                await conn.closed.wait()
                nursery.cancel_scope.deadline = trio.current_time() + EOF_WAIT_S
            elif abandon.how == "close":
                tr.abandoned, tr.abandoned_at = "close", now()
                with trio.move_on_after(CLOSE_HANDSHAKE_WAIT_S) as waited:
                    await ws.aclose()
                tr.close_answered = not waited.cancelled_caught
                nursery.cancel_scope.cancel()
            else:
                nursery.cancel_scope.cancel()  # trio-websocket stops reading the socket
        if abandon is None:
            tr.eof = not nursery.cancel_scope.cancelled_caught
        return abandon

    async def _abandon(self, tr: Transcript, stream: trio.SocketStream, abandon: Abandon) -> None:
        if tr.abandoned is None:
            tr.abandoned, tr.abandoned_at = abandon.how, now()
        if abandon.how in ("rst", "watchdog"):
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await stream.aclose()
        elif abandon.how == "fin":
            # shutdown(SHUT_WR): end of stream without a close frame. A close() with unread
            # data would make the kernel send RST instead: that is the rst kind.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_eof()

    def _release(self, result: SessionResult, how: str) -> None:
        """Give the admission slot back, and remember when: a ``server_busy`` is reported
        with the releases just before it."""
        self.releases.append((now(), result.plan.index, result.plan.label, how))
        self.slots.release()

    def releases_before(self, t: float, window: float = 0.25) -> list[str]:
        return [
            f"-{t - at:.3f} s: session {index} {label}: {how}"
            for at, index, label, how in self.releases
            if t - window <= at <= t
        ]

    async def _linger(self, result: SessionResult, stream: trio.SocketStream, how: str) -> None:
        """Hold the admission slot until the server has closed its socket (bounded)."""
        tr = result.tr
        self.lingering += 1
        started = now()
        bound = self.s.timing.release_bound(how)
        try:
            with trio.move_on_after(bound) as waited:
                if how == "fin":
                    await _drain(stream)  # the server's close arrives as end-of-stream
                elif tr.server_inode is not None:
                    async with trio.open_nursery() as nursery:
                        if how == "stop_reading":
                            nursery.start_soon(_watch_receive_queue, tr, stream)
                        await self.watch.wait_closed(tr.server_inode)
                        nursery.cancel_scope.cancel()
                else:
                    await trio.sleep(bound)  # no inode (not found): hold it the full bound
            if tr.server_inode is None and how != "fin":
                tr.released_after = None
            elif waited.cancelled_caught:
                what = {
                    "eof": "after the close handshake",
                    "stop_reading": "after the client stopped reading",
                    "watchdog": "after the client gave up",
                }.get(how, f"after the client's {how}")
                tr.release_problem = f"the server still held the connection {bound:.1f} s {what}"
            else:
                tr.released_after = now() - started
        except BaseException as exc:
            tr.cut_by_deadline = _is_cancellation(exc)
            raise
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            self.lingering -= 1
            released = "the server closed its socket" if tr.released_after is not None else "bound"
            self._release(result, f"{how}, then {released}")

    # ---------------------------------------------------------------- resources

    def last_session_end(self) -> float:
        ends = [r.get("ended_at") for r in self.records.values()]
        server_end = max((e for e in ends if isinstance(e, int | float)), default=0.0)
        client_end = max((r.tr.ended_at or 0.0 for r in self.results), default=0.0)
        return max(server_end, client_end)

    async def settle(self, baseline: Snapshot | None) -> tuple[Snapshot, list[str], float]:
        """Wait until the server is idle and past its idle trim (and, with a baseline,
        back to it), bounded; returns the snapshot, what never settled, and the wait."""
        started = now()
        deadline = self.last_session_end() + IDLE_BEFORE_TRIM + SETTLE_EXTRA_S
        deadline = max(deadline, started + 2.0)
        while True:
            async with self.metrics_lock:
                metrics = await self._fetch_stats()
                snapshot = Snapshot.take(self.pid, metrics)
            pending = idle_problems(metrics)
            idle_for = now() - self.last_session_end()
            if idle_for < IDLE_BEFORE_TRIM + 0.5:
                pending.append(f"idle for {idle_for:.1f} s only (trim after {IDLE_BEFORE_TRIM} s)")
            if baseline is not None:
                pending += [
                    p for p in resource_problems(baseline, snapshot) if not p.startswith("RSS")
                ]
            if not pending or now() >= deadline:
                return snapshot, pending, now() - started
            await trio.sleep(0.25)


def _is_cancellation(exc: BaseException) -> bool:
    """Trio's cancellation, bare or in the exception groups nurseries wrap it in."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(trio.Cancelled) is not None
    return isinstance(exc, trio.Cancelled)


async def _watch_receive_queue(tr: Transcript, stream: trio.SocketStream) -> None:
    """For a stopped reader: when the bytes waiting in the client's receive queue last
    grew, i.e. when the server's sends stopped arriving. The stall clock runs from about
    then, not from when the client stopped reading."""
    last = -1
    tr.queue_full_at = now()
    while True:
        try:
            raw = fcntl.ioctl(stream.socket.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return
        queued = struct.unpack("i", raw)[0]
        if queued != last:
            last, tr.queue_full_at = queued, now()
        await trio.sleep(0.01)


async def _drain(stream: trio.SocketStream) -> None:
    """Read and drop until end-of-stream (or a reset)."""
    try:
        while await stream.receive_some(65536):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


# --------------------------------------------------------------------------------------
# Judging and reporting
# --------------------------------------------------------------------------------------


def session_details(
    soak: Soak, result: SessionResult, log_records: Sequence[LogRecord]
) -> dict[str, Any]:
    """What a person needs to look into one session: its plan, transcript, the server's
    record and log lines, and for a refused one, what the soak had open at the time."""
    plan, tr = result.plan, result.tr
    details: dict[str, Any] = {
        "outcome": result.verdict.outcome if result.verdict else None,
        "plan": {"start": _short_start(plan.start), "params": _short(plan.params)},
        "transcript": transcript_summary(tr),
        "server_record": soak.record_of(result.request_id) if result.request_id else None,
        "server_log": log_excerpt(log_records, tr, result.request_id),
    }
    if result.verdict is not None and result.verdict.outcome == "refused":
        details["soak_connections_open"] = f"{tr.slots_held} of {soak.s.concurrency}"
        details["slots_released_just_before"] = soak.releases_before(tr.t0)
    return details


def attribute(
    soak: Soak, request_id: str | None, started_at: Any = None
) -> tuple[SessionResult | None, str]:
    """The soak session a server record or log line is about: by request id, else (for
    sessions whose client never learnt the id) by the connection's time, since the server
    records ``started_at`` right after the handshake, on the same clock."""
    if request_id is not None:
        for result in soak.results:
            if result.request_id == request_id:
                return result, "by request id"
        record = soak.record_of(request_id)
        started_at = record.get("started_at") if record else started_at
    if not isinstance(started_at, int | float):
        return None, ""
    candidates = [
        r
        for r in soak.results
        if r.request_id is None and r.tr.connected_at is not None and r.tr.t0 <= started_at
    ]
    best = min(candidates, key=lambda r: abs((r.tr.connected_at or 0.0) - started_at), default=None)
    if best is None or abs((best.tr.connected_at or 0.0) - started_at) > 0.5:
        return None, ""
    return best, "by connection time (the client never learnt the request id)"


def sessions_at(soak: Soak, wall: float, margin: float = 0.05, limit: int = 8) -> list[str]:
    """The soak's sessions whose connection was open at a wall-clock time (for a log
    record that names no session), those that ended nearest to it first."""
    found: list[tuple[float, str]] = []
    for result in soak.results:
        tr = result.tr
        end = tr.wall0 + ((tr.ended_at or now()) - tr.t0)
        if tr.wall0 - margin <= wall <= end + margin:
            text = f"session {result.plan.index} {result.plan.label}: "
            text += " | ".join(transcript_summary(tr, limit=6))
            found.append((abs(end - wall), text))
    return [text for _, text in sorted(found)[:limit]]


def judge_sessions(
    soak: Soak, log_records: Sequence[LogRecord], timing: Timing
) -> tuple[list[Violation], dict[str, Any]]:
    """Every session's checks, the server's records and log: violations and per-kind counts."""
    violations: list[Violation] = []
    kinds: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}
    warmup: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}
    server_side: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}
    timings: dict[str, list[float]] = {}
    for result in soak.results:
        plan, tr = result.plan, result.tr
        verdict = check_transcript(plan, tr, timing)
        problems = list(verdict.problems)
        record = soak.record_of(result.request_id) if result.request_id else None
        known = record is not None or soak.metrics_failures == 0
        judged = verdict.outcome not in ("refused", "incomplete") and not tr.cut_by_deadline
        if result.request_id is not None and judged and known:
            problems += check_server_record(plan, tr, record, timing)
        result.verdict = Verdict(verdict.outcome, problems)
        (warmup if plan.warmup else kinds)[plan.kind][verdict.outcome] += 1
        if record is not None and not plan.warmup:
            code = record.get("error_code")
            server_side[plan.kind][f"{record.get('outcome')}" + (f":{code}" if code else "")] += 1
        for name, value in session_timings(result, record).items():
            timings.setdefault(name, []).append(value)
        for problem in problems:
            violations.append(_session_violation(soak, result, problem, log_records))

    # What the server says went wrong inside, whichever session it was.
    covered: set[str] = set()
    for record in check_server_records(soak.records.values()):
        request_id = record.get("request_id")
        result, how = attribute(soak, request_id, record.get("started_at"))
        what = f"server recorded an internal_error: {record.get('error_message')}"
        if request_id:
            covered.add(request_id)
        violations.append(_server_violation(soak, result, how, what, record, log_records))
    expected_ids = {
        r.request_id for r in soak.results if r.plan.kind == "engine_fail" and r.request_id
    }
    for log_record in log_problems(log_records, expected_ids):
        request_ids = _REQUEST_ID.findall(log_record.text)
        if request_ids and set(request_ids) <= covered:
            continue
        result, how = attribute(soak, request_ids[0] if request_ids else None)
        what = f"server log: {log_record.level} {log_record.lines[0].split(': ', 1)[-1][:200]}"
        violation = _server_violation(soak, result, how, what, None, log_records)
        violation.details["server_log"] = list(log_record.lines[:40])
        if result is None and log_record.wall is not None:
            violation.details["sessions_open_at_the_time"] = sessions_at(soak, log_record.wall)
        violations.append(violation)

    def table(counts: dict[str, Counter[str]]) -> dict[str, Any]:
        return {
            kind: {"count": sum(outcomes.values()), "outcomes": dict(outcomes.most_common())}
            for kind, outcomes in counts.items()
            if outcomes
        }

    per_kind = table(kinds)
    for kind, outcomes in server_side.items():
        if kind in per_kind and outcomes:
            per_kind[kind]["server_outcomes"] = dict(outcomes.most_common())
    return violations, {
        "kinds": per_kind,
        "warmup_kinds": table(warmup),
        "timings_s": {name: bench.summarize(values) for name, values in sorted(timings.items())},
    }


def session_timings(result: SessionResult, record: dict[str, Any] | None) -> dict[str, float]:
    """How long the server took to react, per kind (seconds): reported, so that the
    margins of the timing checks can be judged from a run."""
    plan, tr = result.plan, result.tr
    received = tr.received()
    out: dict[str, float] = {}
    if tr.released_after is not None:
        out[f"release_after_{tr.abandoned or 'eof'}"] = tr.released_after
    last = received[-1].t if received else None
    if plan.kind == "no_start" and last is not None and tr.connected_at is not None:
        out["start_timeout_error"] = last - tr.connected_at
    if plan.kind == "engine_hang" and last is not None and len(received) > 1:
        progress = [e.t for e in received[:-1] if e.text is None or '"video.start"' in e.text]
        if progress:
            out["hang_stall_error"] = last - progress[-1]
    if plan.kind == "stop" and last is not None:
        stops = [e.t for e in tr.sent() if e.label == "session.stop" and e.delivered]
        if stops and last >= stops[0]:
            out["stop_to_terminal"] = last - stops[0]
    if plan.kind == "stopped_reader" and record is not None and tr.abandoned_at is not None:
        closed = record.get("stream_closed_at")
        if isinstance(closed, int | float):
            out["stopped_reader_abort"] = closed - tr.abandoned_at
            if tr.queue_full_at is not None:
                out["stopped_reader_abort_after_queue_full"] = closed - tr.queue_full_at
    if plan.kind in ("fin", "rst", "close") and record is not None and tr.abandoned_at:
        closed = record.get("stream_closed_at")
        if isinstance(closed, int | float):
            out[f"{plan.kind}_to_stream_closed"] = closed - tr.abandoned_at
    return out


def _session_violation(
    soak: Soak, result: SessionResult, what: str, log_records: Sequence[LogRecord]
) -> Violation:
    plan = result.plan
    return Violation(
        what=what,
        session=plan.index,
        kind=plan.label + (" (warm-up)" if plan.warmup else ""),
        request_id=result.request_id,
        details=session_details(soak, result, log_records),
    )


def _server_violation(
    soak: Soak,
    result: SessionResult | None,
    how: str,
    what: str,
    record: dict[str, Any] | None,
    log_records: Sequence[LogRecord],
) -> Violation:
    request_id = record.get("request_id") if record else None
    if result is None:
        lines = [
            line for r in log_records if request_id and request_id in r.text for line in r.lines
        ]
        return Violation(
            what, request_id=request_id, details={"server_record": record, "server_log": lines}
        )
    violation = _session_violation(soak, result, what, log_records)
    violation.details["attributed"] = how
    if record is not None:
        violation.details["server_record"] = record
        if request_id:
            lines = [line for r in log_records if request_id in r.text for line in r.lines[:40]]
            violation.details["server_log"] = lines[:40]
    return attrs.evolve(violation, request_id=request_id or violation.request_id)


def _short(params: dict[str, Any]) -> dict[str, Any]:
    """Plan parameters for the report, long payloads cut."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, str) and len(value) > 200:
            out[key] = value[:60] + f"... ({len(value)} chars)"
        elif isinstance(value, list):
            out[key] = [_short(v) if isinstance(v, dict) else v for v in value][:20]
        elif isinstance(value, dict):
            out[key] = _short(value)
        else:
            out[key] = value
    return out


def _short_start(start: dict[str, Any] | None) -> dict[str, Any] | None:
    return _short(start) if start is not None else None


async def run_soak(s: Settings, log_path: Path) -> dict[str, Any]:
    """Start the server, run warm-up and measured sessions, check, stop; the report."""
    started_wall = dt.datetime.now(dt.UTC)
    t_start = now()
    deadline = trio.current_time() + s.total_deadline_s  # Trio's clock, for move_on_at
    timing = s.timing
    # Kept back from the session phases for settling, the final checks and SIGTERM.
    reserve = IDLE_BEFORE_TRIM + SETTLE_EXTRA_S + timing.shutdown_grace + 10.0
    plans = make_plans(s.seed, s.sessions, s.warmup_sessions)
    warm, measured = plans[: s.warmup_sessions], plans[s.warmup_sessions :]
    violations: list[Violation] = []
    command = server_command(s)
    server = bench.ServerProcess(command, log_path)
    report: dict[str, Any] = {
        "schema": 1,
        "created": started_wall.isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
        "settings": {
            **attrs.asdict(s),
            "warmup_sessions": s.warmup_sessions,
            "total_deadline_s": s.total_deadline_s,
            "engine_args": dict(ENGINE_ARGS),
            "max_start_bytes": MAX_START_BYTES,
            "max_control_bytes": MAX_CONTROL_BYTES,
            "weights": KINDS,
        },
        "thresholds": {
            "fd_growth": FD_GROWTH_LIMIT,
            "thread_growth": THREAD_GROWTH_LIMIT,
            "rss_growth_mib": RSS_GROWTH_LIMIT_MIB,
            "settle_s": IDLE_BEFORE_TRIM + SETTLE_EXTRA_S,
            "release_s": {
                "disconnect": timing.release_bound("fin"),
                "stopped_reader": timing.release_bound("stop_reading"),
            },
            "timeout_slack_s": timing.slack,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "loadavg_at_start": bench._read("/proc/loadavg").split()[:3],
            "python": sys.version.split()[0],
        },
        "server": {"command": command},
    }
    try:
        url = await server.start(timeout=30)
        endpoint = bench.Endpoint.parse(url)
        if endpoint.host != "127.0.0.1":
            raise RuntimeError(f"the server serves {url}; the soak only talks to 127.0.0.1")
        soak = Soak(s, server, endpoint)
        report["server"].update({"url": url, "pid": server.pid})
        progress(
            f"server {server.pid} at {url}; {len(warm)} warm-up + {len(measured)} sessions, "
            f"concurrency {s.concurrency}, seed {s.seed}, deadline {s.total_deadline_s:.0f} s"
        )
        fresh = Snapshot.take(soak.pid, await soak.fetch_stats())  # nothing else runs yet
        async with trio.open_nursery() as background:
            background.start_soon(soak.poll_metrics)
            background.start_soon(soak.watch.run)
            background.start_soon(soak.report_progress)
            complete = await soak.run_phase(warm, "warm-up", deadline - reserve)
            baseline: Snapshot | None = None
            if complete:
                progress("warm-up done; waiting for the server's idle trim for the baseline")
                baseline, unsettled, waited = await soak.settle(None)
                report["baseline_wait_s"] = round(waited, 1)
                for problem in unsettled:
                    violations.append(Violation(f"after the warm-up: {problem}"))
                phase_start = now()
                complete = await soak.run_phase(measured, "sessions", deadline - reserve)
                report["sessions_s"] = round(now() - phase_start, 1)
            if not complete:
                ran = sum(1 for r in soak.results if not r.tr.cut_by_deadline)
                violations.append(
                    Violation(
                        f"the soak's deadline ({s.total_deadline_s:.0f} s) cut the run short: "
                        f"{ran} of {len(plans)} sessions ran"
                    )
                )
            progress("sessions done; waiting for the server to settle")
            final, unsettled, waited = await soak.settle(baseline)
            report["final_wait_s"] = round(waited, 1)
            background.cancel_scope.cancel()
        if baseline is not None:
            for problem in resource_problems(baseline, final):
                violations.append(Violation(f"at the end: {problem}"))
        else:
            violations += [Violation(f"at the end: {p}") for p in idle_problems(final.metrics)]
        report["resources"] = {
            "fresh": fresh.to_json(),
            "baseline": baseline.to_json() if baseline else None,
            "final": final.to_json(),
        }
        report["metrics_poll_failures"] = soak.metrics_failures
    finally:
        sigterm_at = now()
        status = await server.stop(grace=timing.shutdown_grace + 10.0)
        exit_s = now() - sigterm_at
        report["server"].update({"exit_status": status, "exit_s": round(exit_s, 2)})
    if status != 0:
        violations.append(Violation(f"after SIGTERM the server exited with status {status}"))
    elif exit_s > timing.shutdown_grace:
        violations.append(
            Violation(
                f"the server took {exit_s:.1f} s to exit after SIGTERM, more than its "
                f"--shutdown-grace of {timing.shutdown_grace:.0f} s"
            )
        )

    records = parse_log(log_path.read_text(errors="replace"))
    session_violations, stats = judge_sessions(soak, records, timing)
    violations = session_violations + violations
    report.update(stats)
    report["server_socket_not_found"] = sum(
        1 for r in soak.results if r.tr.connected_at is not None and r.tr.server_inode is None
    )
    report["server_log"] = {"records": len(records), "warnings_and_errors": log_summary(records)}
    report["sessions"] = {"warmup": len(warm), "measured": len(measured)}
    report["duration_s"] = round(now() - t_start, 1)
    report["violations"] = [v.to_json() for v in violations]
    report["violation_count"] = len(violations)
    report["passed"] = not violations
    return report


def render_summary(report: dict[str, Any]) -> str:
    """The human-readable end of a run: per-kind counts, resources, violations."""
    lines = []
    kinds = report.get("kinds") or {}
    for kind, info in kinds.items():
        outcomes = ", ".join(f"{k} {v}" for k, v in info["outcomes"].items())
        lines.append(f"  {kind:18} {info['count']:5}  {outcomes}")
    resources = report.get("resources") or {}
    base, final = resources.get("baseline"), resources.get("final")
    if base and final:
        lines.append(
            f"  server: threads {base['threads']} -> {final['threads']}, fds {base['fds']} -> "
            f"{final['fds']}, RSS {base['rss_mib']} -> {final['rss_mib']} MiB"
        )
    server = report.get("server") or {}
    lines.append(
        f"  SIGTERM: exit status {server.get('exit_status')} after {server.get('exit_s')} s"
    )
    for violation in report.get("violations", [])[:50]:
        where = f"session {violation['session']} {violation['kind']}"
        if violation["session"] is None:
            where = "server"
        lines.append(f"  VIOLATION [{where}] {violation['what']}")
    if len(report.get("violations", [])) > 50:
        lines.append(f"  ... {len(report['violations']) - 50} more in the JSON report")
    sessions = report.get("sessions") or {}
    verdict = "PASS" if report.get("passed") else "FAIL"
    lines.append(
        f"soak {verdict}: {sessions.get('measured', 0)} sessions (+{sessions.get('warmup', 0)} "
        f"warm-up), seed {report['settings']['seed']}, concurrency "
        f"{report['settings']['concurrency']}, {report.get('duration_s')} s: "
        f"{report.get('violation_count')} violation(s)"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python bench/soak.py",
        description="Soak test: randomized sessions against a server subprocess, checked.",
    )
    add = parser.add_argument
    add("--sessions", type=int, default=1000, help="measured sessions (default 1000)")
    add("--concurrency", type=int, default=8, help="sessions at once = --max-sessions (8)")
    add("--seed", type=int, default=1, help="seed of the mix and every random choice (1)")
    add("--warmup", type=int, default=None, help="warm-up sessions (default 2 x concurrency)")
    add(
        "--deadline",
        type=float,
        default=None,
        help="bound on the whole run in seconds (default 30 + 0.6 per session, >= 90)",
    )
    add("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT, help="(default 1.5)")
    add("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT, help="(default 1.0)")
    add("--json", type=Path, default=None, help="write the report here (and the server log)")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    if args.sessions < 1 or args.concurrency < 1:
        raise SystemExit("--sessions and --concurrency must be >= 1")
    timing = Timing(stall_timeout=args.stall_timeout, start_timeout=args.start_timeout)
    return Settings(
        sessions=args.sessions,
        concurrency=args.concurrency,
        seed=args.seed,
        warmup=args.warmup,
        deadline_s=args.deadline,
        timing=timing,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from(args)
    with tempfile.TemporaryDirectory(prefix="trio_vstream-soak-") as tmp:
        log_path = Path(tmp) / "server.log"
        try:
            report = trio.run(run_soak, settings, log_path)
        except (KeyboardInterrupt, BaseExceptionGroup) as exc:
            # Inside nurseries, Ctrl-C arrives wrapped in exception groups.
            if isinstance(exc, BaseExceptionGroup):
                interrupts, others = exc.split(KeyboardInterrupt)
                if interrupts is None or others is not None:
                    raise
            progress("interrupted; the server was stopped")
            return 130
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")
            kept = args.json.with_suffix(".server.log")
            shutil.copyfile(log_path, kept)
            progress(f"wrote {args.json} and {kept}")
    print(render_summary(report), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
