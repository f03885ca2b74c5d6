"""The checks on a soak session: its transcript against what its kind must see, and the
server's own record of it. Pure functions, unit-tested with fake transcripts.

A client records everything it saw and did (``transcript.Transcript``); whether that is
right is decided afterwards, from the transcript alone (and the server's own record of the
session), so that every rule can be shown to fail on a made-up transcript: a soak whose
checks cannot fail proves nothing. The checks of the server as a whole are in
``health_checks`` (``/health``, the wedge rounds) and ``shutdown_checks`` (a server's end).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import attrs

from bench._soak.plans import Plan
from bench._soak.settings import (
    CLOSE_HANDSHAKE_WAIT_S,
    EOF_WAIT_S,
    STUCK_ORDER_MARGIN_S,
    Timing,
)
from bench._soak.transcript import REPLY_TYPES, Transcript, describe, read_messages


@attrs.frozen
class Verdict:
    """A session judged: its outcome in a word, and every rule it broke."""

    outcome: str
    """In a word: done, done(stopped), error:CODE, close:CODE, abandoned:HOW, refused."""
    problems: list[str]


def _reply_key(message: dict[str, Any]) -> str:
    kind = message.get("type")
    if kind == "session.pong":
        return "pong"
    if kind == "session.interaction.queued":
        return f"queued:{message.get('event_id')}"
    return f"error:{message.get('code')}"


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
    # server_busy in the session, or in the body of the 503 that refused the upgrade.
    refusal = tr.upgrade_refusal or (messages[0][1] if messages else None)
    if refusal is not None and _is_busy(refusal):
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
        after = ", ".join(describe(m) for _, m in messages[dones[0] + 1 :])
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
    elif kind == "input_video":
        _expect_done(problems, terminal, seen_end, stopped_ok=False)
        problems += input_video_problems(plan, tr, messages, media_frames, terminal)
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
    # A video that ends with its input (on_end "end") may be shorter: input_video_problems.
    shorter = kind == "input_video" and plan.on_end == "end" and media_frames > 0
    wrong = media_frames != plan.num_frames and not (shorter and media_frames < plan.num_frames)
    if terminal == "done" and kind != "oversized_frame" and wrong:
        problems.append(f"{media_frames} frames arrived, {plan.num_frames} requested")
    if types and plan.start is not None and kind != "oversized_frame" and types[0] != "video.start":
        problems.append(f"first message {describe(messages[0][1])}, expected video.start")
    return Verdict(outcome, problems)


def input_video_problems(
    plan: Plan,
    tr: Transcript,
    messages: list[tuple[float, dict[str, Any]]],
    media_frames: int,
    terminal: str | None,
) -> list[str]:
    """An ``input_video`` session: its frames (all valid) never refused; every media
    chunk says what became of the input (``input_frames``), never counting more frames
    used or dropped than were sent, its ``last`` a frame sent, never going back; some
    used; and a video that ended with its input (``on_end: "end"``, before its
    ``num_frames``) accounted for every frame sent, exactly once."""
    problems: list[str] = []
    sent = sum(1 for e in tr.sent() if e.label.startswith("frame ") and e.delivered)
    refused = [m for _, m in messages if m.get("code") == "invalid_input_frame"]
    if refused:
        problems.append(
            f"{len(refused)} valid input frame(s) refused, first: {describe(refused[0])}"
        )
    used = dropped = 0
    last_seen = -1
    for _, message in messages:
        if message.get("type") != "video.chunk_metadata" or message.get("kind") != "media":
            continue
        counts = message.get("input_frames")
        fields = ("used", "dropped", "reused")
        if not isinstance(counts, dict) or not all(
            isinstance(counts.get(f), int) and counts[f] >= 0 for f in fields
        ):
            problems.append(f"media chunk without input_frames counts: {counts!r}")
            return problems
        used, dropped = used + counts["used"], dropped + counts["dropped"]
        last = counts.get("last")
        if last is not None:
            if not isinstance(last, int) or not last_seen <= last < sent:
                problems.append(f"input_frames.last {last!r} after {last_seen}, {sent} sent")
            else:
                last_seen = last
    if used + dropped > sent:
        problems.append(f"input frames: {used} used + {dropped} dropped, only {sent} sent")
    if terminal == "done" and sent and not used:
        problems.append(f"none of the {sent} input frames was used")
    ended_with_input = plan.on_end == "end" and 0 < media_frames < plan.num_frames
    if terminal == "done" and ended_with_input and used + dropped != sent:
        problems.append(
            f"the video ended with its input, but {used} used + {dropped} dropped of "
            f"{sent} frames sent: every frame counts exactly once"
        )
    return problems


def input_totals(tr: Transcript) -> dict[str, int]:
    """An ``input_video`` session's frames sent, and its chunks' ``input_frames`` summed
    (what they could read of them), for the report."""
    totals = {"sent": sum(1 for e in tr.sent() if e.label.startswith("frame ") and e.delivered)}
    for _, message in read_messages(tr).messages:
        counts = message.get("input_frames") if message.get("kind") == "media" else None
        for key in ("used", "dropped", "reused"):
            value = counts.get(key) if isinstance(counts, dict) else None
            totals[key] = totals.get(key, 0) + (value if isinstance(value, int) else 0)
    return totals


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
    keys = [_reply_key(m) if m.get("type") == "error" else describe(m) for _, m in messages]
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
    "input_video": (frozenset({"completed"}), None),
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


def check_server_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records no session may have, whoever it was: an internal error."""
    return [r for r in records if r.get("error_code") == "internal_error"]
