"""The oracle: pure functions over what the server sent back.

What any correct server must do whatever it is sent: a known ``code`` on every error,
never ``internal_error``, valid UTF-8, one terminal message, the session alive after a
bad control message. Pure, so that the tests can feed it the failures it exists to
catch and prove that it fires.
"""

from __future__ import annotations

import json
from typing import Any, Final

import attrs

from bench._fuzz.settings import (
    FAULT_KEYS,
    REPLY_TIMEOUT,
    START_TIMEOUT,
)
from bench._fuzz.wire import (
    Wire,
)
from trio_vstream import protocol

KNOWN_CODES: Final = frozenset(code.value for code in protocol.ErrorCode)
PER_MESSAGE_CODES: Final = frozenset(
    {
        protocol.ErrorCode.INVALID_JSON.value,
        protocol.ErrorCode.INVALID_MESSAGE.value,
        protocol.ErrorCode.UNKNOWN_TYPE.value,
        protocol.ErrorCode.MESSAGE_TOO_LARGE.value,
        protocol.ErrorCode.EVENT_ID_CONFLICT.value,
        protocol.ErrorCode.INTERACTION_FAILED.value,
    }
)
"""Codes that answer one control message and leave the session running; any other known
code ends the session."""
ENGINE_FAILURE_CODES: Final = frozenset({"generation_failed", "encoding_failed"})


@attrs.frozen
class Problem:
    """One way a server's answer broke the oracle; ``key`` names the kind."""

    key: str
    detail: str


def shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit] + f"...(+{len(text) - limit} chars)"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def lone_surrogates(value: Any, path: str = "$") -> list[str]:
    """JSON paths of the strings (keys included) that are not valid UTF-8."""
    found: list[str] = []
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            found.append(path)
    elif isinstance(value, dict):
        for key, item in value.items():
            found += lone_surrogates(key, f"{path}.<key {key!a}>")
            found += lone_surrogates(item, f"{path}.{key}" if isinstance(key, str) else path)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += lone_surrogates(item, f"{path}[{index}]")
    return found


def check_reply(raw: str) -> tuple[dict[str, Any] | None, list[Problem]]:
    """Parse one text message from the server and check it on its own."""
    try:
        message = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return None, [Problem("reply-not-json", shorten(repr(raw)))]
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        return None, [Problem("reply-without-type", shorten(repr(raw)))]
    problems = []
    bad = lone_surrogates(message)
    if bad:
        problems.append(Problem("reply-lone-surrogate", f"{message['type']}: {', '.join(bad[:5])}"))
    if message["type"] == "error":
        code = message.get("code")
        text = message.get("message")
        if not isinstance(code, str) or not code:
            problems.append(Problem("error-without-code", shorten(repr(message))))
        elif code == protocol.ErrorCode.INTERNAL_ERROR:
            problems.append(Problem("internal-error", shorten(repr(text))))
        elif code not in KNOWN_CODES:
            problems.append(Problem("unknown-code", shorten(repr(code))))
        if not isinstance(text, str) or not text.strip():
            problems.append(Problem("error-without-message", shorten(repr(message))))
    return message, problems


def _size_problems(outcome: str, sent: int, limit: int) -> list[Problem]:
    too_large = f"error:{protocol.ErrorCode.MESSAGE_TOO_LARGE.value}"
    if sent > limit and outcome not in (too_large, "closed-1009"):
        return [Problem("oversize-not-refused", f"{sent} bytes > {limit}: {outcome}")]
    if sent <= limit and outcome == too_large:
        return [Problem("refused-within-limit", f"{sent} bytes <= {limit}")]
    return []


@attrs.define
class StartTranscript:
    """Everything one ``session.start`` connection saw."""

    sent_bytes: int
    fault_injected: bool = False
    messages: list[Wire] = attrs.field(factory=list)
    close_code: int | None = None
    """None: the connection was still open when the input's time ran out."""
    timed_out: bool = False
    connect_error: str | None = None


def judge_start(transcript: StartTranscript, limit: int) -> tuple[str, list[Problem]]:
    """The outcome (``accepted``, ``error:<code>``, ``closed-1009`` or ``violation``)
    and the problems of one ``session.start`` input."""
    if transcript.connect_error is not None:
        return "violation", [Problem("connect-failed", transcript.connect_error)]
    problems: list[Problem] = []
    parsed: list[dict[str, Any] | bytes | None] = []
    for raw in transcript.messages:
        if isinstance(raw, bytes):
            parsed.append(raw)
            continue
        message, found = check_reply(raw)
        problems += found
        parsed.append(message)
    sent = transcript.sent_bytes
    if not parsed:
        if transcript.timed_out:
            problems.append(Problem("no-reply", f"nothing in {START_TIMEOUT:.0f} s"))
        elif transcript.close_code == 1009 and sent > 2 * limit:
            return "closed-1009", problems
        else:
            problems.append(
                Problem(
                    "closed-without-message", f"close {transcript.close_code}, {sent} bytes sent"
                )
            )
        return "violation", problems
    first = parsed[0]
    if not isinstance(first, dict):
        problems.append(Problem("unexpected-first-reply", "binary" if first else "unparsable"))
        return "violation", problems
    kind = first["type"]
    rest = parsed[1:]
    if kind == "video.start":
        outcome = "accepted"
        terminal = next(
            (
                i
                for i, m in enumerate(rest)
                if isinstance(m, dict) and m["type"] in ("session.done", "error")
            ),
            None,
        )
        expected = ("video.chunk_metadata", "session.pong")
        for reply in rest[: terminal if terminal is not None else len(rest)]:
            if isinstance(reply, dict) and reply["type"] not in expected:
                problems.append(Problem("unexpected-reply", reply["type"]))
        if terminal is None:
            how = "timed out" if transcript.timed_out else f"closed {transcript.close_code}"
            problems.append(Problem("no-terminal", f"accepted session ended without one: {how}"))
        else:
            end = rest[terminal]
            assert isinstance(end, dict)
            if rest[terminal + 1 :]:
                problems.append(Problem("message-after-terminal", f"{len(rest) - terminal - 1}"))
            code = end.get("code")
            if (
                end["type"] == "error"
                and code in ENGINE_FAILURE_CODES
                and not transcript.fault_injected
            ):
                problems.append(Problem(f"accepted-then-{code}", shorten(repr(end.get("message")))))
    elif kind == "error":
        outcome = f"error:{first.get('code')}"
        if rest:
            problems.append(Problem("message-after-terminal", f"{len(rest)} after the error"))
    else:
        problems.append(Problem("unexpected-first-reply", kind))
        outcome = "violation"
    problems += _size_problems(outcome, sent, limit)
    if transcript.timed_out:
        if not any(p.key == "no-terminal" for p in problems):
            problems.append(Problem("no-close", f"still open after {START_TIMEOUT:.0f} s"))
    elif transcript.close_code != 1000:
        problems.append(Problem("abnormal-close", f"close code {transcript.close_code}"))
    return ("violation" if problems else outcome), problems


@attrs.define
class Exchange:
    """What one control message (and the ping after it) got back."""

    sent_bytes: int
    replies: list[dict[str, Any]] = attrs.field(factory=list)
    """Answers other than chunks, in order, before any terminal message."""
    terminal: dict[str, Any] | None = None
    close_code: int | None = None
    timed_out: bool = False
    problems: list[Problem] = attrs.field(factory=list)
    """Problems found in single messages (`check_reply`)."""
    messages: list[str] = attrs.field(factory=list)
    """The raw text messages other than chunk metadata, for the report."""


def is_terminal(message: dict[str, Any]) -> bool:
    """``session.done``, or an error whose code ends a session (not a per-message one)."""
    if message["type"] == "session.done":
        return True
    code = message.get("code")
    return message["type"] == "error" and code in KNOWN_CODES and code not in PER_MESSAGE_CODES


def judge_control(exchange: Exchange, limit: int, *, answers: int = 2) -> tuple[str, list[Problem]]:
    """The outcome (``pong``, ``queued``, ``error:<code>``, ``stopped``, ``completed``,
    ``closed-1009`` or ``violation``) and the problems of one control input.

    ``answers``: 2 for an input and its ping; 0 for a wait in which nothing was sent
    (outcome ``running`` while the session lives on).
    """
    problems = list(exchange.problems)
    sent = exchange.sent_bytes
    if exchange.terminal is not None:
        end = exchange.terminal
        if end["type"] == "session.done":
            outcome = "stopped" if end.get("stopped") is True else "completed"
        else:
            code = end.get("code")
            problems.append(Problem(f"session-ended-{code}", shorten(repr(end.get("message")))))
            outcome = "violation"
        if exchange.close_code is None:
            problems.append(Problem("no-close", "no close after the terminal message"))
        elif exchange.close_code != 1000:
            problems.append(Problem("abnormal-close", f"close code {exchange.close_code}"))
        return ("violation" if problems else outcome), problems
    if exchange.close_code is not None:
        if exchange.close_code == 1009 and sent > 2 * limit:
            return ("violation" if problems else "closed-1009"), problems
        problems.append(
            Problem("closed-without-terminal", f"close {exchange.close_code}, {sent} bytes sent")
        )
        return "violation", problems
    if answers == 0:
        if exchange.replies:
            kinds = [reply["type"] for reply in exchange.replies]
            problems.append(Problem("unexpected-reply", f"unasked: {kinds}"))
        return ("violation" if problems else "running"), problems
    if len(exchange.replies) < 2:
        kinds = [reply["type"] for reply in exchange.replies]
        problems.append(
            Problem("no-reply", f"{len(kinds)} of 2 answers in {REPLY_TIMEOUT:.0f} s: {kinds}")
        )
        return "violation", problems
    first, second = exchange.replies[:2]
    if second["type"] != "session.pong":
        problems.append(Problem("reply-order", f"{first['type']} then {second['type']}"))
    kind = first["type"]
    if kind == "session.pong":
        outcome = "pong"
    elif kind == "session.interaction.queued":
        outcome = "queued"
    elif kind == "error":
        code = first.get("code")
        outcome = f"error:{code}"
        if code in KNOWN_CODES and code not in PER_MESSAGE_CODES:
            problems.append(Problem("unexpected-code", repr(code)))
    else:
        outcome = "violation"
        problems.append(Problem("unexpected-reply", kind))
    problems += _size_problems(outcome, sent, limit)
    return ("violation" if problems else outcome), problems


def fault_injected(wire: Wire) -> bool:
    """Whether a start asks the synthetic engine to fail or hang (then it may)."""
    try:
        message = json.loads(wire)
    except (ValueError, RecursionError):
        return False
    if not isinstance(message, dict):
        return False
    for block in (message.get("extra_params"), message.get("sampling_params")):
        if isinstance(block, dict) and any(key in block for key in FAULT_KEYS):
            return True
    return False
