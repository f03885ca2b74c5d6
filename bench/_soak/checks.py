"""Transcripts, and the checks on them: pure functions, unit-tested with fake transcripts.

A client records everything it saw and did (``Transcript``); whether that is right is
decided afterwards, from the transcript alone (and the server's own record of the
session), so that every rule can be shown to fail on a made-up transcript: a soak whose
checks cannot fail proves nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

import attrs

from bench._soak.plans import (
    Plan,
    ShutdownPlan,
)
from bench._soak.settings import (
    CLOSE_AFTER_EXIT_S,
    CLOSE_HANDSHAKE_WAIT_S,
    EOF_WAIT_S,
    SIGNAL_TAKEN_WAIT_S,
    STREAMING_WAIT_S,
    STUCK_ORDER_MARGIN_S,
    Timing,
)


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
    """A session judged: its outcome in a word, and every rule it broke."""

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


@attrs.frozen
class Received:
    """What a server sent in one session, read from its transcript: the JSON messages in
    order (with their times), the counts, and every rule of form they broke."""

    messages: list[tuple[float, dict[str, Any]]]
    problems: list[str]
    media_frames: int
    media_chunks: int
    chunk_count: int
    """Chunks (media and trailer) whose metadata arrived."""
    trailer_at: int | None
    """Index in ``messages`` of the trailer's metadata."""
    last_progress: float | None
    """When ``video.start`` or the last media chunk's data arrived."""


def read_messages(tr: Transcript) -> Received:
    """The server's messages and the rules of form, whatever the session's kind: JSON
    objects of known types, every ``error`` with a ``code``, each chunk's metadata
    followed by exactly its binary message, chunk indices in order, nothing but the
    trailer's data after the trailer. Shared by the sessions' checks and the shutdown
    rounds'."""
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
    return Received(
        messages, problems, media_frames, media_chunks, chunk_count, trailer_at, last_progress
    )


def check_transcript(
    plan: Plan, tr: Transcript, timing: Timing, engine_done_at: float | None = None
) -> Verdict:
    """Judge one session's transcript against what its kind must see.

    Every session: well-formed messages (JSON objects of known types, every ``error``
    with a ``code``, each chunk's metadata followed by exactly its binary message), at
    most one terminal message and nothing after ``session.done``, answers to control
    messages in order. Sessions the client did not abandon: exactly one terminal message
    as the last message, the expected one, then the expected close code.

    ``engine_done_at``: when the server's engine had made the whole video (its record's
    ``stream_closed_at``, the soak's clock), if known. The server reads control messages
    until it has delivered the last media chunk, then sends the trailer and
    ``session.done``: a control message sent after the engine was done may reach it
    after that and go unanswered, which ``session.done`` tells the client. On a loaded
    machine the delivery lags the engine enough for a ``chatty`` session's last control
    to land there (seen once in 1000 sessions at a load of 7 on 2 cores).
    """
    received = read_messages(tr)
    problems = received.problems
    messages = received.messages
    media_frames, media_chunks = received.media_frames, received.media_chunks
    chunk_count, trailer_at = received.chunk_count, received.trailer_at
    last_progress = received.last_progress

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
    sent = [e for e in tr.sent() if e.expect and e.delivered]
    wanted = [(e.label, e.expect) for e in sent]
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
    unanswered = sent[len(got) :]
    if unanswered and engine_done_at is not None and terminal == "done":
        unanswered = [e for e in unanswered if e.t < engine_done_at]  # see the docstring
    if strict and unanswered:
        missing = ", ".join(f"{e.label} ({e.expect})" for e in unanswered)
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
    elif kind in ("engine_fail", "engine_hang", "engine_stuck", "held"):
        code = "generation_failed" if kind == "engine_fail" else "stall_timeout"
        if terminal != f"error:{code}":
            problems.append(f"expected error {code} as the terminal message, got {seen_end}")
        at_chunk = plan.params.get("at_chunk")  # a held session's: wherever its rows meet
        if at_chunk is not None and media_chunks > at_chunk:
            problems.append(f"{media_chunks} media chunks, but the engine stopped at {at_chunk}")
        # A blocked engine takes no checkpoint: the stall guard must answer all the same,
        # on time (whether before the block ended: check_server_record).
        stalls = kind in ("engine_hang", "engine_stuck", "held")
        if stalls and terminal == f"error:{code}" and last_progress is not None:
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
    "engine_stuck": (frozenset({"stalled"}), "stall_timeout"),
    "held": (frozenset({"stalled"}), "stall_timeout"),
}


def check_server_record(
    plan: Plan, tr: Transcript, record: dict[str, Any] | None, timing: Timing
) -> list[str]:
    """The server's own account of a session (``recent_sessions`` in /stats), for the
    sessions whose request id the client learnt: the outcome its kind allows; for a
    stopped reader, an abort within about the stall timeout; for a stuck engine, the
    stall error before the blocked call returned (`stuck_record_problems`)."""
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
    if plan.kind == "engine_stuck":
        problems += stuck_record_problems(plan, tr, record)
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


def stuck_record_problems(plan: Plan, tr: Transcript, record: dict[str, Any]) -> list[str]:
    """An ``engine_stuck`` session, from its server record: the order of its client's
    ``stall_timeout`` and the blocked call's return.

    The engine's thread closes the stream as soon as the call returns (the session left
    it that), so ``stream_closed_at`` is when the block ended, if that was before the
    session's end. ``returns``: the block ends while the session still waits for the call
    after its close; the stall error must have reached the client at least
    ``STUCK_ORDER_MARGIN_S`` before, i.e. while the engine was still blocked (a server
    that waits for a stuck call answers only after it returned). ``abandoned``: the block
    outlasts the session's wait, so the session ends with the stream still open (the
    call's thread closes it later); a closed one means the session waited for the call.
    """
    messages = read_messages(tr).messages
    if not messages or messages[-1][1].get("code") != "stall_timeout":
        return []  # check_transcript says what ended it
    error_at = messages[-1][0]
    closed = record.get("stream_closed_at")
    block_s = plan.params["block_s"]
    if plan.params["variant"] == "returns":
        if not isinstance(closed, int | float):
            return [
                f"the server recorded no stream close: the engine's call, blocked for "
                f"{block_s:.1f} s, should have returned while the session waited for it"
            ]
        if closed - error_at < STUCK_ORDER_MARGIN_S:
            return [
                f"stall_timeout reached the client {closed - error_at:.2f} s before the "
                f"blocked call returned (its stream closed), expected while it was still "
                f"blocked, at least {STUCK_ORDER_MARGIN_S:.2f} s before: the server waited "
                f"for the stuck call"
            ]
    elif closed is not None:
        return [
            f"the session ended after its stream was closed, although its engine call was "
            f"blocked for {block_s:.1f} s: it waited for the stuck call past its close "
            f"timeout instead of leaving it to its thread"
        ]
    return []


@attrs.frozen
class HealthSample:
    """One ``GET /health`` during the run: when it went, when the answer came, the answer
    (its body stripped)."""

    sent_at: float
    received_at: float
    status: int | None
    body: str

    @property
    def ok(self) -> bool:
        """``200 ok``: no engine call stuck."""
        return self.status == 200 and self.body == "ok"

    @property
    def degraded(self) -> bool:
        """``200 degraded: N engine call(s) stuck ...``: some, fewer than the wedge bound."""
        return self.status == 200 and self.body.startswith("degraded")

    @property
    def unavailable(self) -> bool:
        """``503 engine_unavailable: ...``: the engine is wedged."""
        return self.status == 503 and self.body.startswith("engine_unavailable")

    @property
    def stuck_calls(self) -> int | None:
        """The N of a ``degraded`` answer (None for any other)."""
        match = DEGRADED.match(self.body) if self.degraded else None
        return int(match[1]) if match else None

    def __str__(self) -> str:
        return f"{self.status} {self.body[:200]}"


DEGRADED: Final = re.compile(r"degraded: (\d+) engine call")
"""``/health``'s answer while engine calls are stuck below the wedge bound (server.py)."""


def check_health(
    plan: Plan, tr: Transcript, record: dict[str, Any] | None, samples: Sequence[HealthSample]
) -> list[str]:
    """An ``abandoned`` ``engine_stuck`` session: from its end (its call left running in
    its thread) until the earliest its block can end (the block began after the client
    connected), ``/health`` must not answer ``200 ok``: the server knows a call is stuck
    and must say ``200 degraded`` (a 503 is `wedge_problems`'). Only answers wholly
    inside that window are judged."""
    if plan.kind != "engine_stuck" or plan.params.get("variant") != "abandoned":
        return []
    ended = record.get("ended_at") if record is not None else None
    if not isinstance(ended, int | float) or tr.connected_at is None:
        return []
    until = tr.connected_at + plan.params["block_s"]
    ok = [s for s in samples if s.ok and ended < s.sent_at and s.received_at < until]
    if not ok:
        return []
    return [
        f"GET /health answered 200 ok {ok[0].sent_at - ended:.2f} s after the session ended "
        f"with its engine call still blocked (for {until - ended:.2f} s more at least): "
        f"expected 200 degraded"
    ]


def wedge_problems(samples: Sequence[HealthSample], bound: int) -> list[str]:
    """The soak's own server is never to be wedged: its ``--max-stuck-calls`` is above
    what its mix leaves stuck (`settings.stuck_calls_bound`). A ``/health`` 503 while
    its sessions ran says the server counted more stuck calls than the mix can leave
    (a call it never let go of), or that the mix outgrew its bound; so does a
    ``degraded`` count at the bound. One problem for the first such answer."""
    for sample in samples:
        if sample.status == 503:
            return [
                f"GET /health answered {sample}: the engine counted as wedged, although "
                f"--max-stuck-calls ({bound}) is above what the mix leaves stuck"
            ]
        stuck = sample.stuck_calls
        if stuck is not None and stuck >= bound:
            return [f"GET /health answered {sample}: at the wedge bound {bound}"]
    return []


def sigterm_problems(status: int | None, exit_s: float, grace: float) -> list[str]:
    """A soak server's end: SIGTERM must end it with status 0 within its
    ``--shutdown-grace`` (its sessions are over by then, so the drain has nothing to wait
    for). ``status`` None: the process had to be killed."""
    if status != 0:
        return [f"after SIGTERM the server exited with status {status}"]
    if exit_s > grace:
        return [
            f"the server took {exit_s:.1f} s to exit after SIGTERM, more than its "
            f"--shutdown-grace of {grace:.0f} s"
        ]
    return []


def peak_stuck_calls(samples: Sequence[HealthSample]) -> int:
    """The most engine calls ``/health`` said were stuck at once (0: it never said)."""
    return max((s.stuck_calls or 0 for s in samples), default=0)


def check_server_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records no session may have, whoever it was: an internal error."""
    return [r for r in records if r.get("error_code") == "internal_error"]


# --------------------------------------------------------------------------------------
# Wedge rounds (the batched part)
# --------------------------------------------------------------------------------------


@attrs.define
class WedgeRecord:
    """What one wedge round saw from outside, judged afterwards (`check_wedge_round`).

    Its held sessions' transcripts are judged with the batched part's other sessions
    (kind ``held``: ``stall_timeout`` on time, then close 1000); this is the server's side
    of the round: wedged, refusing, released, recovered."""

    index: int
    token: str
    held: list[int] = attrs.Factory(list)
    """The plan numbers of its held sessions."""
    after: list[int] = attrs.Factory(list)
    """The plan numbers of the sessions after its release."""
    clients_done_at: float | None = None
    """When both held clients' part had ended (their stall error and close)."""
    health: list[HealthSample] = attrs.Factory(list)
    """Every ``/health`` answer of the round, from the clients' end on, in order."""
    wedged: HealthSample | None = None
    """The first 503 (None: none came within ``Timing.wedge_bound``)."""
    upgrade: tuple[int | None, str] | None = None
    """A new WebSocket upgrade while wedged: its HTTP status (101: accepted) and body."""
    released_at: float | None = None
    """When the soak created the token's file."""
    recovered: HealthSample | None = None
    """The first ``200 ok`` after the release (None: none within ``Timing.recover_bound``)."""


BATCH_STUCK: Final = "batched step is stuck"
"""What the server's 503 says when its batcher is stuck (server.py's
``_unavailable_message``), as opposed to too many stuck calls."""


def check_wedge_round(rec: WedgeRecord, timing: Timing) -> list[str]:
    """A wedge round: once its held clients were done, ``/health`` answered 503
    ``engine_unavailable`` naming the stuck batched step within ``Timing.wedge_bound``;
    a new upgrade then got HTTP 503 ``engine_unavailable``; every answer until the
    release stayed 503; after the release, ``200 ok`` within ``Timing.recover_bound``."""
    problems: list[str] = []
    if rec.clients_done_at is None:
        return ["the held sessions' clients did not end (the soak's deadline?)"]
    answers = ", ".join(dict.fromkeys(str(s) for s in rec.health)) or "none"
    wedged = rec.wedged
    if wedged is None:
        problems.append(
            f"GET /health did not answer 503 within {timing.wedge_bound:.1f} s of the held "
            f"sessions' end (answers: {answers[:300]})"
        )
    else:
        after = wedged.sent_at - rec.clients_done_at
        if after > timing.wedge_bound:
            problems.append(
                f"GET /health answered 503 {after:.2f} s after the held sessions' end, "
                f"expected within {timing.wedge_bound:.1f} s"
            )
        if not wedged.unavailable or BATCH_STUCK not in wedged.body:
            problems.append(
                f"GET /health answered {wedged} while wedged, expected 503 "
                f"engine_unavailable naming the stuck batched step"
            )
        if rec.upgrade is None:
            problems.append("no WebSocket upgrade was tried while wedged")
        else:
            status, body = rec.upgrade
            if status != 503 or not body.startswith("engine_unavailable"):
                problems.append(
                    f"a new WebSocket upgrade while wedged got HTTP {status} {body[:200]!r}, "
                    f"expected 503 engine_unavailable before the upgrade"
                )
        released = rec.released_at if rec.released_at is not None else float("inf")
        early = [s for s in rec.health if wedged.sent_at < s.sent_at and s.received_at < released]
        ended = [s for s in early if s.status != 503]
        if ended:
            problems.append(
                f"GET /health answered {ended[0]} {ended[0].sent_at - wedged.sent_at:.2f} s "
                f"after the wedge, before the release: the held batch still ran"
            )
    if rec.released_at is None:
        problems.append("the hold was never released")
    elif rec.recovered is None:
        last = rec.health[-1] if rec.health else None
        problems.append(
            f"GET /health did not answer 200 ok within {timing.recover_bound:.1f} s of the "
            f"release (last: {last})"
        )
    elif rec.recovered.sent_at - rec.released_at > timing.recover_bound:
        problems.append(
            f"GET /health answered 200 ok {rec.recovered.sent_at - rec.released_at:.2f} s after "
            f"the release, expected within {timing.recover_bound:.1f} s"
        )
    return problems


# --------------------------------------------------------------------------------------
# Shutdown rounds
# --------------------------------------------------------------------------------------


@attrs.define
class RoundRecord:
    """What one shutdown round saw from outside: its clients' transcripts, when each
    signal went and when the server logged it, and how the process ended. Judged
    afterwards, like a transcript, so that each rule can be shown to fail."""

    transcripts: list[Transcript] = attrs.Factory(list)
    startup_s: float | None = None
    streaming_at: float | None = None
    """When every session had had a media chunk (None: not all within the wait)."""
    sent_at: list[float] = attrs.Factory(list)
    """When each signal was sent."""
    taken_at: list[float | None] = attrs.Factory(list)
    """When the soak saw the server log each signal: only for a signal a later one waits
    for (``after="taken"``), None otherwise or when it was not seen in time."""
    exited_at: float | None = None
    exit_status: int | None = None
    killed: bool = False
    """The server was still running at its bound, and was killed."""
    error: str | None = None
    """Why the round could not run at all (its server did not start)."""


ROUND_ENDINGS: Final = frozenset({"error:server_shutdown"})
"""The only terminal message a session may get in a shutdown round: its videos outlast
the round, so nothing else can end it before the server goes (a ``generation_failed``
is a stop reported as an engine failure, issue 20 item 12)."""
STUCK_ENDINGS: Final = ROUND_ENDINGS | {"error:stall_timeout"}
"""A stuck session (``engine_stuck`` rounds) may also end by its stall timeout: in a
drain it goes on as usual until then, and its call is left to its thread."""


def exit_bound(plan: ShutdownPlan, timing: Timing) -> float:
    """Seconds from a round's last signal to its server's exit."""
    return timing.stop_bound if len(plan.signals) > 1 else timing.drain_bound


def check_round_process(plan: ShutdownPlan, rec: RoundRecord, timing: Timing) -> list[str]:
    """The round as a whole: it ran, the sessions streamed, the server took each signal
    that another waited for, and exited with status 0 within ``exit_bound`` of the last.

    Status 0: cli/serve.py's second signal cancels the server's run, which then returns as
    after a drain (docs/server.md, Draining: "The exit status is 0. A second signal stops at
    once."); a process killed by the signal's default action would show -15, an
    interrupt's traceback 1."""
    if rec.error is not None:
        return [rec.error]
    problems: list[str] = []
    if rec.streaming_at is None:
        problems.append(
            f"not every session had a media chunk (or, if stuck, was blocked) within "
            f"{STREAMING_WAIT_S:.0f} s; the signals went anyway"
        )
    for i, step in enumerate(plan.signals[1:], start=1):
        taken = rec.taken_at[i - 1] if i - 1 < len(rec.taken_at) else None
        if step.after == "taken" and taken is None:
            problems.append(
                f"the server did not log signal {i} ({plan.signals[i - 1].name}) within "
                f"{SIGNAL_TAKEN_WAIT_S:.0f} s"
            )
    if len(rec.sent_at) < len(plan.signals):
        problems.append(f"only {len(rec.sent_at)} of {len(plan.signals)} signals were sent")
        return problems
    bound = exit_bound(plan, timing)
    what = "the second signal" if len(plan.signals) > 1 else "the signal"
    if rec.killed:
        problems.append(f"the server did not exit within {bound:.1f} s of {what}: killed")
    elif rec.exited_at is None or rec.exit_status is None:
        problems.append(f"the server's exit after {what} was not seen")
    else:
        exit_s = rec.exited_at - rec.sent_at[-1]
        if rec.exit_status != 0:
            problems.append(f"after {what} the server exited with status {rec.exit_status}")
        if exit_s > bound:
            problems.append(
                f"the server took {exit_s:.1f} s to exit after {what}, more than {bound:.1f} s"
            )
    return problems


def round_ending(tr: Transcript) -> str:
    """A round's session in a word: its terminal message (if any) and how it closed."""
    messages = read_messages(tr).messages
    last = messages[-1][1] if messages else {}
    terminal = ""
    if last.get("type") == "error":
        terminal = f"error:{last.get('code')}, "
    elif last.get("type") == "session.done":
        terminal = "done, "
    closed = f"close {tr.close_code}" if tr.closed_at is not None else "still open"
    return terminal + closed


def check_round_client(tr: Transcript, rec: RoundRecord, *, stuck: bool = False) -> list[str]:
    """One session of a shutdown round: well-formed messages from ``video.start`` on; at
    most one terminal message, last, and only ``server_shutdown``; then a close 1000,
    or the connection cut (1006: the process went); never before the first signal, and
    no later than ``CLOSE_AFTER_EXIT_S`` after the server's exit. A ``stuck`` session (its
    engine blocked) may also end with ``stall_timeout``, and then at any time."""
    endings = STUCK_ENDINGS if stuck else ROUND_ENDINGS
    received = read_messages(tr)
    problems = list(received.problems)
    messages = received.messages
    if tr.client_error is not None:
        problems.append(f"client: {tr.client_error}")
    if not messages or messages[0][1].get("type") != "video.start":
        first = _describe(messages[0][1]) if messages else "no message"
        problems.append(f"first message {first}, expected video.start")
    ends = [i for i, (_, m) in enumerate(messages) if m.get("type") in ("session.done", "error")]
    terminal: str | None = None
    if ends:
        message = messages[ends[0]][1]
        if ends[0] != len(messages) - 1:
            after = ", ".join(_describe(m) for _, m in messages[ends[0] + 1 :])
            problems.append(f"messages after the terminal message {_describe(message)}: {after}")
        terminal = (
            "done" if message.get("type") == "session.done" else f"error:{message.get('code')}"
        )
        if terminal not in endings:
            also = ", stall_timeout (its engine is stuck)" if stuck else ""
            problems.append(
                f"the session ended with {_describe(message)}: in a shutdown it ends with "
                f"server_shutdown{also} or its connection closes"
            )
    if tr.connected_at is None:
        return problems  # nothing to close (the client error says why)
    if tr.closed_at is None:
        if rec.exited_at is not None:
            problems.append(
                f"the connection was still open {CLOSE_AFTER_EXIT_S:.0f} s after the server exited"
            )
        else:
            problems.append("the connection never closed")
        return problems
    stalled = stuck and terminal == "error:stall_timeout"
    if rec.sent_at and tr.closed_at < rec.sent_at[0] and not stalled:
        problems.append(f"the connection closed (code {tr.close_code}) before the first signal")
    if tr.close_code == 1000 and terminal is None:
        problems.append("close 1000 without a terminal message")
    elif tr.close_code not in (1000, 1006):
        problems.append(
            f"close code {tr.close_code} ({tr.close_reason or 'no reason'}), expected 1000 "
            "after a terminal message, or 1006 (the server's process went)"
        )
    return problems
