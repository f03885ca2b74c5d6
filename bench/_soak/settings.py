"""The soak's settings: the session kinds and their weights, the server's limits and
timeouts as the soak sets them, and the thresholds its checks hold the server to.

One module, so that the plans, the checks and the report all read the same numbers,
and the report can state them next to the results.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Final

import attrs

from bench._harness import synthetic_server_command
from trio_vstream.engines.synthetic import BLOCK_SECONDS_MAX
from trio_vstream.session.session import SessionConfig

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
    "engine_stuck": 3,
    "input_video": 6,
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

INPUT_FPS: Final = (12, 24, 30)
"""An ``input_video`` session's input rate, drawn (the output's is 24): each input frame
used twice, once, or some passed over."""
INPUT_FRAME_FORMAT: Final = "jpeg"
"""What an ``input_video`` client sends: JPEG, as a page makes from a canvas."""
INPUT_PICTURES: Final = 16
"""Pictures an ``input_video`` client cycles through (each encoded once)."""

PROMPTS: Final = (
    "a red circle moving left on a navy background",
    "a green square rising on black",
    "a lighthouse on a cliff at dusk",
    "a yellow triangle falling on a white background",
)


STUCK_VARIANTS: Final = ("returns", "abandoned")
"""How an ``engine_stuck`` session's block ends (``Timing.stuck_block_s``): while its
session still waits for the call it left (``returns``), or after the session has ended
without it (``abandoned``: ``/health`` says degraded until it returns)."""
STUCK_EXTRA_S: Final = (0.5, 1.5)
"""Drawn on top of the shortest block of a variant."""
CALLS_LEFT_PER_SESSION: Final = 2
"""The most engine calls one session leaves running as it ends: its engine call and its
encoder's (``encode_chunk``), both seen "left to finish in its thread" in one stop. The
server counts them as stuck (``/health`` says ``degraded``) until they return, within a
step for all but an ``engine_stuck`` block."""


def stuck_calls_bound(sessions_at_once: int, stuck_plans: int) -> int:
    """The ``--max-stuck-calls`` of a server that is not to be wedged: one more than
    its sessions can leave stuck at once, each session slot the calls it leaves as it
    ends (`CALLS_LEFT_PER_SESSION`), and every ``engine_stuck`` block of the run on top
    (each outlives its session, by seconds when ``abandoned``), as if all overlapped.

    The server counts as wedged at that many (``/health`` 503, new sessions refused),
    and the soak's mix is not there to test that (the batched part's wedge rounds are):
    below the bound ``/health`` says ``200 degraded`` while calls are stuck, and a 503
    during the sessions is a violation (`health_checks.wedge_problems`)."""
    return CALLS_LEFT_PER_SESSION * sessions_at_once + stuck_plans + 1


STUCK_ORDER_MARGIN_S: Final = 0.25
"""An ``engine_stuck`` session's ``stall_timeout`` must reach its client at least this long
before the blocked call returns (at least 0.5 s is left by the block lengths, at the
largest lateness allowed). A server that waits for the call answers after it returns."""

DEFAULT_STALL_TIMEOUT: Final = 1.5
DEFAULT_START_TIMEOUT: Final = 1.0
"""Short, so that the kinds that wait for them (hangs, stopped readers, silent clients)
cost seconds, yet far above anything a healthy session on a loaded 2-core machine waits."""
SERVER_CLOSE_TIMEOUT: Final = SessionConfig().close_timeout
"""The server's close timeout (5 s; no flag sets it): the longest it waits on a client
for a terminal message or a close handshake."""

# --------------------------------------------------------------------------------------
# Shutdown rounds: a server of their own each, stopped with two signals
# --------------------------------------------------------------------------------------

DEFAULT_SHUTDOWN_ROUNDS: Final = 8
"""After the sessions, this many rounds (``--shutdown-rounds``); each starts a server."""
ROUND_KINDS: Final[dict[str, int]] = {"double_signal": 3, "engine_stuck": 1}
"""Kinds of shutdown round and their weights (``plans.make_shutdown_plan`` says what
each does; a run of as many rounds as there are kinds has each once):
``double_signal`` sends SIGTERM or SIGINT while sessions stream, and a second one after
it, which must stop the server at once; ``engine_stuck`` does that, or sends one signal
(a drain), while sessions' engine calls are blocked outside a checkpoint for longer
than the server may take to exit."""
SIGNALS: Final = ("SIGTERM", "SIGINT")
"""The signals ``python -m trio_vstream`` takes as "shut down" (cli/serve.py)."""


@attrs.frozen(kw_only=True)
class RoundEngine:
    """An engine the shutdown rounds run: its ``--engine-arg`` options, and how long one
    of its steps takes with the rounds' sessions."""

    args: tuple[tuple[str, str], ...]
    step_s: float
    """One engine step with 8 sessions on a 2-core CPU (for shapes, one batch of their
    rows: about 0.1 s, measured). A second signal's delay is drawn over two of them, so
    that rounds land before, inside and after a step."""


ROUND_ENGINES: Final[dict[str, RoundEngine]] = {
    # Batches of up to 8 sessions' rows (its default max_batch): what reaches the
    # StepBatcher, whose rows a second signal once left unfinished (issue 20, item 11).
    "shapes": RoundEngine(args=(), step_s=0.1),
    # No batcher: each session's steps in its own thread.
    "synthetic": RoundEngine(args=ENGINE_ARGS, step_s=0.01),
}
"""The engines the rounds alternate, shapes first."""
ROUND_SESSIONS: Final = (1, 8)
"""Sessions streaming in a round: drawn from this range (the server admits 8)."""
STUCK_ENGINE: Final = "synthetic"
"""The engine of ``engine_stuck`` rounds (its ``block_at_chunk``); the other rounds
alternate the engines among themselves."""
STUCK_SESSIONS: Final = (1, 2)
"""Sessions of an ``engine_stuck`` round whose engine blocks (the rest stream)."""
STUCK_AT_CHUNK: Final = (0, 2)
"""The chunk at which a stuck session's engine blocks, drawn from this range."""
ROUND_BLOCK_S: Final = BLOCK_SECONDS_MAX
"""How long a stuck session's engine blocks (the engine's longest): beyond any bound on a
round's exit, so that a server that waited for the thread would be killed at its bound."""
STUCK_DRAIN_SHARE: Final = 0.5
"""``engine_stuck`` rounds with one signal (a drain), and stuck sessions only: healthy
ones would stream their long videos to the end of the drain's grace."""
BLOCKED_SILENCE_S: Final = 0.3
"""A stuck session counts as blocked once it has had its chunks before the block and then
nothing for this long (a chunk comes every ~10 ms), far below the stall timeout."""
ROUND_FRAME_SIZE: Final = 64
ROUND_NUM_FRAMES: Final = 2400
"""The server's largest frame count: a video of 15 s or more (minutes with shapes), so
that every session is still streaming when the signals arrive, and a server that
ignored the second signal would still be draining long after the bound."""
ROUND_SHUTDOWN_GRACE: Final = 30.0
"""The rounds' ``--shutdown-grace`` (the server's default): far beyond the bound of the
stop a second signal makes, so that a drain cannot pass for one."""
FIRST_SIGNAL_AFTER_S: Final = (0.0, 0.3)
"""The first signal: once every session has had a media chunk, after a delay drawn here."""
BACK_TO_BACK_SHARE: Final = 0.2
"""Rounds whose second signal follows the first at once, before the server can have read
it; always the other signal: Trio reports a signal that arrives again before it was read
once, so two identical signals back to back may be one, and from outside the two cases
look the same."""
ZERO_DELAY_SHARE: Final = 0.25
"""Of the other rounds (second signal once the server has logged the first): those that
send it at once, with no drawn delay."""
ROUND_START_TIMEOUT_S: Final = 60.0
"""For a round's server to print its URL (shapes imports torch: 2-3 s here)."""
STREAMING_WAIT_S: Final = 10.0
"""For every session of a round to have its first media chunk."""
SIGNAL_TAKEN_WAIT_S: Final = 5.0
"""For the server to log a signal (``SIGTERM: shutting down gracefully``)."""
CLOSE_AFTER_EXIT_S: Final = 2.0
"""After the server's exit, how long a client may still see its connection open."""
ROUND_BUDGET_S: Final = 15.0
"""What a round adds to the soak's default deadline (it takes 2-5 s)."""


# --------------------------------------------------------------------------------------
# The batched part: a server of its own with the held engine, and wedge rounds
# --------------------------------------------------------------------------------------

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
"""Where ``bench`` is importable from: the batched server imports its engine from it."""
HELD_ENGINE: Final = "bench._soak.held_engine:create_engine"
"""The batched part's engine: shapes batching 4 sessions' steps, whose batched step the
soak can hold (``held_engine.py``)."""
BATCHED_MAX_SESSIONS: Final = 4
"""The batched server's ``--max-sessions``, and its engine's ``max_batch``: every session
it admits steps in one batch with the others."""
DEFAULT_BATCHED_SESSIONS: Final = 32
"""``--batched-sessions``: normal sessions on the batched server, 4 at a time."""
DEFAULT_WEDGE_ROUNDS: Final = 4
"""``--wedge-rounds``: rounds in which two sessions sharing a hold token wedge it."""
HOLD_PARAM: Final = "hold"
"""The ``extra_params`` key of a session's hold token (``held_engine.py``)."""
HOLD_TOKEN: Final = re.compile(r"[a-z0-9-]{1,32}")
"""What a hold token may be, whole: it names a file in the hold directory, so no ``/``
and no ``.``."""
HELD_SESSIONS: Final = 2
"""Sessions of a wedge round that share its hold token: a batch of 2 rows, held."""
HELD_NUM_FRAMES: Final = 2400
"""A held session's video: far longer than the round, so that it cannot end before its
rows meet in a batch."""
AFTER_WEDGE_SESSIONS: Final = 2
"""Normal sessions after each round's release, at once (so they batch): they must
complete, the batcher taking rows again."""
HEALTH_POLL_S: Final = 0.05
"""How often a wedge round asks ``/health`` while it waits for the wedge or its end."""
BATCHED_BUDGET_S: Final = 75.0
"""What the batched part adds to the soak's default deadline beside its sessions and
rounds: its server's start (shapes imports torch), and two settles (idle trim, Trio's
idle threads, 11-20 s each)."""
BATCHED_SESSION_BUDGET_S: Final = 0.5
"""Per batched session (4 at a time, well under a second each)."""
WEDGE_ROUND_BUDGET_S: Final = 20.0
"""Per wedge round: the stall timeout, the sessions' close wait (5 s), the wedge's checks,
the release and two sessions after it (9-12 s measured)."""


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
    close_timeout: float = SERVER_CLOSE_TIMEOUT
    """The server's; a field only so that tests can shorten the bounds made of it."""

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

    @property
    def stop_bound(self) -> float:
        """Seconds from a second signal to the server's exit ("stops at once").

        The second signal cancels everything. What still runs is shielded: a send under
        way (bounded by its own deadline, the stall timeout), engine streams and encoders
        closing in their threads (after the step under way: for shapes a batch, ~0.1 s),
        then the process's own exit (freeing the engine). None of it waits on a client
        longer than the close timeout, so: that, plus 2 x slack (8 s). Measured: 0.03 s
        (synthetic) to 0.4 s (shapes)."""
        return self.close_timeout + 2 * self.slack

    def stuck_block_s(self, variant: str, extra: float) -> float:
        """How long an ``engine_stuck`` session's engine blocks: ``extra`` seconds more
        than the shortest block of ``variant`` (``STUCK_VARIANTS``).

        The stall error comes at most ``stall_timeout + slack`` after the block began; a
        ``returns`` block is longer by ``extra`` (>= 0.5 s, see
        ``STUCK_ORDER_MARGIN_S``) and shorter than the stall timeout plus the session's
        close wait (``close_timeout``), so the call returns while the session still waits
        for it. An ``abandoned`` block lasts that close wait and one slack more (for the
        close handshake), so the session has ended without the call by then."""
        shortest = self.stall_timeout + self.slack
        if variant == "abandoned":
            shortest += self.close_timeout + self.slack
        elif variant != "returns":
            raise ValueError(f"unknown engine_stuck variant {variant!r}")
        return round(shortest + extra, 3)

    @property
    def wedge_bound(self) -> float:
        """Seconds from the end of a wedge round's held clients (their ``stall_timeout``,
        the close) to ``/health`` answering 503: the sessions' wait for the calls they
        left (the close timeout), after which the batcher gives up on the held batch and
        is stuck, and 2 x slack."""
        return self.close_timeout + 2 * self.slack

    @property
    def recover_bound(self) -> float:
        """Seconds from the release of a held batch (its file created) to ``/health``
        answering ``200 ok``: the held step sees the file within 10 ms, the batch runs
        (tens of ms), and the batcher takes rows again: slack."""
        return self.slack

    @property
    def drain_bound(self) -> float:
        """Seconds from a first signal to the exit of a round's server: its grace, a close
        timeout to wind sessions down and one to abort them (server/running.py's drain), slack."""
        return ROUND_SHUTDOWN_GRACE + 2 * self.close_timeout + self.slack


@attrs.frozen(kw_only=True)
class Settings:
    """One soak run as the command line chose it."""

    sessions: int = 1000
    concurrency: int = 8
    seed: int = 1
    warmup: int | None = None
    deadline_s: float | None = None
    shutdown_rounds: int = DEFAULT_SHUTDOWN_ROUNDS
    batched_sessions: int = DEFAULT_BATCHED_SESSIONS
    wedge_rounds: int = DEFAULT_WEDGE_ROUNDS
    timing: Timing = Timing()

    @property
    def warmup_sessions(self) -> int:
        return self.warmup if self.warmup is not None else 2 * self.concurrency

    @property
    def total_deadline_s(self) -> float:
        """The soak's own bound on its run time, start to exit."""
        if self.deadline_s is not None:
            return self.deadline_s
        sessions = max(90.0, 30.0 + 0.6 * (self.sessions + self.warmup_sessions))
        return sessions + self.rounds_reserve_s + self.batched_reserve_s

    @property
    def rounds_reserve_s(self) -> float:
        """Kept back from the session phases for the shutdown rounds."""
        return ROUND_BUDGET_S * self.shutdown_rounds

    @property
    def batched(self) -> bool:
        """Whether the run has a batched part (`BATCHED_MAX_SESSIONS`)."""
        return self.batched_sessions > 0 or self.wedge_rounds > 0

    @property
    def batched_reserve_s(self) -> float:
        """Kept back from the session phases for the batched part."""
        if not self.batched:
            return 0.0
        return (
            BATCHED_BUDGET_S
            + BATCHED_SESSION_BUDGET_S * self.batched_sessions
            + WEDGE_ROUND_BUDGET_S * self.wedge_rounds
        )


def server_command(s: Settings, stuck_plans: int = 0) -> list[str]:
    """The server under test: as many session slots as the soak runs at once (so that any
    ``server_busy`` is a violation), short timeouts, small byte limits, INFO logging
    (the log check reads every session's records), and a wedge bound above what the mix
    leaves stuck (`stuck_calls_bound`; ``stuck_plans``: its ``engine_stuck`` sessions),
    never an exit when wedged (a supervisor's variable in the environment would turn it
    on)."""
    t = s.timing
    extra = ["--stall-timeout", str(t.stall_timeout), "--start-timeout", str(t.start_timeout)]
    extra += ["--shutdown-grace", str(t.shutdown_grace), "--log-level", "INFO"]
    extra += ["--max-stuck-calls", str(stuck_calls_bound(s.concurrency, stuck_plans))]
    extra += ["--no-exit-when-wedged"]
    return synthetic_server_command(
        ENGINE_ARGS,
        max_sessions=s.concurrency,
        max_start_bytes=MAX_START_BYTES,
        max_control_bytes=MAX_CONTROL_BYTES,
        extra=extra,
    )


def round_server_command(engine: str, timing: Timing) -> list[str]:
    """A shutdown round's server: ``engine`` on 127.0.0.1 with 8 session slots, the soak's
    timeouts, and the default grace (``ROUND_SHUTDOWN_GRACE``), INFO logging (the round
    reads the signals' records), and a wedge bound above what its sessions leave stuck
    (`stuck_calls_bound`: a drain's ``engine_stuck`` sessions leave their blocked calls
    for good; calls a second signal leaves mid-step are not counted as stuck)."""
    command = [sys.executable, "-m", "trio_vstream", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--engine", engine]
    for key, value in ROUND_ENGINES[engine].args:
        command += ["--engine-arg", f"{key}={value}"]
    command += ["--max-sessions", str(ROUND_SESSIONS[1])]
    command += ["--stall-timeout", str(timing.stall_timeout)]
    command += ["--start-timeout", str(timing.start_timeout)]
    command += ["--shutdown-grace", str(ROUND_SHUTDOWN_GRACE), "--log-level", "INFO"]
    command += ["--max-stuck-calls", str(stuck_calls_bound(ROUND_SESSIONS[1], 0))]
    command += ["--no-exit-when-wedged"]
    return command


def batched_server_command(timing: Timing, hold_dir: Path) -> list[str]:
    """The batched part's server: the held engine (``hold_dir``: where the soak creates
    its hold tokens' files) with 4 session slots and batches of 4, the soak's timeouts,
    INFO logging, and a wedge bound above what a wedge round leaves stuck by count (its
    held batch, and the held sessions' calls for a moment): the round wedges the server
    by its batcher, stuck on the held batch, whatever the count (server/health.py's
    ``EngineHealth.check``). Never an exit when wedged: the rounds wait for the recovery."""
    command = [sys.executable, "-m", "trio_vstream", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--engine", HELD_ENGINE, "--engine-arg", f"hold_dir={hold_dir}"]
    command += ["--engine-arg", f"max_batch={BATCHED_MAX_SESSIONS}"]
    command += ["--max-sessions", str(BATCHED_MAX_SESSIONS)]
    command += ["--max-stuck-calls", str(stuck_calls_bound(BATCHED_MAX_SESSIONS, 0))]
    command += ["--no-exit-when-wedged"]
    command += ["--stall-timeout", str(timing.stall_timeout)]
    command += ["--start-timeout", str(timing.start_timeout)]
    command += ["--shutdown-grace", str(timing.shutdown_grace), "--log-level", "INFO"]
    return command
