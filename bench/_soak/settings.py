"""The soak's settings: the session kinds and their weights, the server's limits and
timeouts as the soak sets them, and the thresholds its checks hold the server to.

One module, so that the plans, the checks and the report all read the same numbers,
and the report can state them next to the results.
"""

from __future__ import annotations

from typing import Final

import attrs

from bench._harness import synthetic_server_command

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
    """One soak run as the command line chose it."""

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
    """The server under test: as many session slots as the soak runs at once (so that any
    ``server_busy`` is a violation), short timeouts, small byte limits, INFO logging
    (the log check reads every session's records)."""
    t = s.timing
    extra = ["--stall-timeout", str(t.stall_timeout), "--start-timeout", str(t.start_timeout)]
    extra += ["--shutdown-grace", str(t.shutdown_grace), "--log-level", "INFO"]
    return synthetic_server_command(
        ENGINE_ARGS,
        max_sessions=s.concurrency,
        max_start_bytes=MAX_START_BYTES,
        max_control_bytes=MAX_CONTROL_BYTES,
        extra=extra,
    )
