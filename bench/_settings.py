"""What one benchmark does (``Settings``) and against what (``Target``): the inputs of a
run, written to its JSON so that a result can be reproduced."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs

BENCH_DIR: Final = Path(__file__).resolve().parent
REPO_DIR: Final = BENCH_DIR.parent
RESULTS_DIR: Final = BENCH_DIR / "results"

SCENARIOS: Final = (
    "resources",
    "latency",
    "concurrency",
    "abort",
    "encoder",
    "diffusers",
    "batching",
    "decode",
    "effect",
    "streaming",
    "glass",
    "camera_in",
    "overhead",
    "fleet",
    "hls",
    "hls_latency",
)
"""In the order they run: resources first, so that its RSS figures start from a fresh
server rather than from whatever memory the other scenarios left to the allocator.
``diffusers`` is part of ``all`` only where diffusers is installed and the harness starts
the server itself (it serves a model the harness builds, so neither --url nor --compare).
"""
SERVER_SCENARIOS: Final = SCENARIOS[:4]
OWN_SERVER_SCENARIOS: Final = (
    "diffusers",
    "batching",
    "decode",
    "effect",
    "streaming",
    "glass",
    "camera_in",
    "overhead",
    "fleet",
    "hls",
    "hls_latency",
)
"""Scenarios that start servers of their own (so neither --url nor --compare applies)."""
ALL_SCENARIOS: Final = SCENARIOS[:5]
"""What ``all`` runs, besides ``diffusers`` where it can run. ``batching`` (~3 min) and
``effect`` (~3 min) are asked for by name: together they would more than double the
default run, and they measure the shapes engine rather than the transport; so does
``streaming`` (~5 min). ``glass`` (the player page in chromium, ~45 s a run) is asked
for by name too, and so are ``camera_in`` (the same page following a fake camera,
~35 s a run), ``overhead`` (the server's CPU per frame against a bare
encoder's, ~1.5 min a run), ``fleet`` (one server and three behind nginx, ~8 s a
run), ``hls`` (one session with 500 LL-HLS viewers through nginx's cache and with
none, ~30 s a run), and ``hls_latency`` (hls.js in chromium through nginx, ~30 s a
run)."""
PROMPT: Final = "a lighthouse on a cliff at dusk, waves rolling in"

DEFAULT_ENGINE: Final = "synthetic"
DEFAULT_SYNTHETIC_ARGS: Final = (("chunk_frames", "16"), ("steps", "4"), ("step_delay", "0.01"))
"""The engine the targets are stated for: 16-frame chunks, 4 denoising steps of 10 ms each
(a GPU step modelled as a sleep, which releases the GIL like a CUDA synchronise)."""


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
    --max-sessions: an idle connection claims a session slot for its first 2 s, and one
    beyond the free slots is refused with a 503; the scenario counts those it held)."""
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
    batching_preset: str | None = None
    """quick, cpu or gpu; None: quick with --quick, else gpu where CUDA is available, else
    cpu (see `bench.scenarios.batching.BatchingPreset`). The ``decode`` scenario's preset
    of the same name too (`bench.scenarios.decode.DecodePreset`)."""
    effect_chunk_frames: tuple[int, ...] = (8, 4, 2)
    """``extra_params.chunk_frames`` of the effect scenario's sessions: its trade-off."""
    effect_levels: tuple[int, ...] = (1, 8)
    """Sessions streaming at once in the effect scenario."""
    effect_interactions: int = 8
    """Camera interactions per session, one at a time."""
    effect_gap_s: float = 0.5
    """An interaction waits a random pause up to this long after the previous took effect."""
    effect_width: int = 64
    effect_height: int = 64
    """Small frames, so that the model, not the encoder, sets the pace."""
    effect_frames: int = 2400
    """Longer than any part of the scenario lasts: sessions stream until stopped."""
    streaming_levels: tuple[int, ...] = (1, 4, 8)
    """Sessions streaming at once in the streaming scenario, paced and unpaced."""
    streaming_seconds: float = 8.0
    """Length of each streaming session's video (it runs to its end)."""
    streaming_buffer_s: float = 1.0
    """``streaming_buffer_seconds`` of the paced sessions (and of the paused ones)."""
    streaming_startup_s: float = 0.0
    """The simulated viewers' startup threshold: media buffered before the playhead
    starts (0: at the first frame; below ``streaming_buffer_s``)."""
    streaming_width: int = 64
    streaming_height: int = 64
    paused_active: int = 4
    paused_idle: int = 4
    """"Paused sessions cost nothing": this many unpaced sessions measured, alone and
    beside this many paced ones that never report a position (so they fill their window
    and wait)."""
    paused_reps: int = 3
    """Measurements of each configuration per run, alternated; the verdict takes medians."""
    paused_window_s: float = 3.0
    """Seconds the active sessions' fps is measured, once the paused ones are waiting."""
    glass_seconds: float = 30.0
    """How long the glass scenario presses keys (its play ratio's span)."""
    glass_press_every_s: float = 3.0
    """D and A in turn, one press this often."""
    glass_warmup_s: float = 3.0
    """Seconds of video played before the first press: steady state."""
    glass_buffer_s: float | None = None
    glass_start_s: float | None = None
    glass_chunk_frames: int | None = None
    """The page's Live knobs (``LIVE.bufferSeconds``, ``LIVE.startSeconds``,
    ``LIVE.chunkFrames`` in player.js) for trying others; None: the page's own."""
    overhead_sessions: int = 8
    overhead_frames: int = 480
    """The overhead scenario's load: this many sessions of this many frames, together."""
    glass_engine_args: tuple[tuple[str, str], ...] = (("threads", "1"),)
    """The glass server's shapes engine: one torch thread, so chromium has the other
    core of a 2-core machine to decode and show the video."""
    camera_in_seconds: float = 20.0
    """How long the camera_in scenario reads the page's camera-to-frame figures."""
    camera_in_warmup_s: float = 3.0
    """Seconds of video played before they are read: steady state."""
    camera_in_chunk_frames: int | None = None
    """The page's ``LIVE.chunkFrames`` for the camera_in session, for trying others; None:
    the page's own."""
    camera_in_engine_args: tuple[tuple[str, str], ...] = (("threads", "1"),)
    """The camera_in server's shapes engine: one torch thread, as ``glass``'s."""
    fleet_sessions: int = 8
    """The fleet scenario's wave: this many sessions at once through nginx, more than one
    server's slots and more than the three servers' (``fleet_max_sessions`` each)."""
    fleet_max_sessions: int = 2
    """Each fleet server's ``--max-sessions``."""
    fleet_viewers: int = 3
    """Viewers of each session's watch link, through nginx, once its video.start is in."""
    fleet_frames: int = 96
    """Frames of each fleet session: 12 chunks of 8, about 2.4 s at 0.2 s a chunk."""
    fleet_step_delay: float = 0.05
    """The fleet servers' synthetic engine: 4 steps of 50 ms per 8-frame chunk (0.2 s for
    333 ms of media at 24 fps: faster than real time, as a GPU server is meant to be)."""
    fleet_size: int = 64
    """Width and height of the fleet sessions' video: small, so that the servers' event
    loops and the relay, not the encoder, are what two cores spend on."""
    hls_viewers: int = 500
    """The hls scenario's crowd: LL-HLS viewers of one session through nginx's cache."""
    hls_frames: int = 240
    """Frames of the hls scenario's session: 10 s at 24 fps, 20 parts."""
    hls_chunk_frames: int = 12
    """Frames per chunk, so per part: 0.5 s at 24 fps."""
    hls_step_delay: float = 0.1
    """The synthetic engine's step (4 a chunk): 0.4 s for 0.5 s of media, a little faster
    than real time, as a live session is: viewers wait at the live edge, together."""
    hls_width: int = 832
    hls_height: int = 480
    """The session's size: the harness's default, the size its CPU targets are stated
    for (a session's own CPU is what the crowd's is compared with)."""
    hls_seconds: float = 20.0
    """The hls_latency session's length, paced to media time (so as long in wall time):
    hls.js joins a couple of seconds in and is measured on the rest."""
    hls_join_s: float = 6.0
    """When the hls_latency scenario's second viewer is given the playlist: once this much
    of the stream has been sent (the first is given it at video.start)."""
    hls_engine_args: tuple[tuple[str, str], ...] = (("threads", "1"),)
    """The hls_latency server's shapes engine: one torch thread, as ``glass``'s, so that
    chromium has the other core of a 2-core machine."""

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
            "effect_chunk_frames": (8, 2),
            "effect_interactions": 2,
            "effect_gap_s": 0.3,
            "streaming_seconds": 2.0,
            "paused_reps": 1,
            "paused_window_s": 1.0,
            "glass_seconds": 6.0,
            "glass_press_every_s": 2.0,
            "glass_warmup_s": 1.5,
            "camera_in_seconds": 4.0,
            "camera_in_warmup_s": 1.0,
            "overhead_sessions": 2,
            "overhead_frames": 48,
            "fleet_sessions": 4,
            "fleet_max_sessions": 1,
            "fleet_viewers": 2,
            "fleet_frames": 48,
            "hls_viewers": 40,
            "hls_frames": 24,
            "hls_step_delay": 0.05,
            "hls_width": 64,
            "hls_height": 48,
            "hls_seconds": 8.0,
            # Well after the first viewer has started (hls.js waits for a whole 2 s
            # segment, then starts a second behind the edge): the two see clearly
            # different shares of the stream.
            "hls_join_s": 5.5,
        }
        base.update(overrides)
        return cls(**base)


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

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "command": list(self.command) if self.command else None,
            "url": self.url,
            "engine": self.engine,
            "engine_args": dict(self.engine_args),
            "engine_step_s": self.step_s,
        }


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
