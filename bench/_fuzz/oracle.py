"""The oracle: pure functions over what the server sent back.

What any correct server must do whatever it is sent: a known ``code`` on every error,
never ``internal_error``, valid UTF-8, one terminal message, the session alive after a
bad control message. Input video frames (binary messages in a session that asked for
``input_video``) are judged by what they are (`frame_expectation`): a valid one is never
refused, one refused from its header is refused before the ping behind it is answered,
one over the byte cap gets ``message_too_large``, no frame is refused twice or used once
refused, and the chunks never count more frames than were sent. Pure, so that the tests
can feed it the failures it exists to catch and prove that it fires.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
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
        protocol.ErrorCode.INVALID_INPUT_FRAME.value,
    }
)
"""Codes that answer one control message and leave the session running; any other known
code ends the session. (``invalid_input_frame`` ends one that asked for
``input_video.strict``; the fuzz's sessions never do.)"""
FRAME_CODES: Final = frozenset(
    {protocol.ErrorCode.INVALID_INPUT_FRAME.value, protocol.ErrorCode.MESSAGE_TOO_LARGE.value}
)
"""The codes that refuse an input frame; the message names the frame (``input frame N``)."""
_FRAME_NUMBER: Final = re.compile(r"\binput frame (\d+)\b")
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


FRAME_EXPECTATIONS: Final = {
    "valid": "taken",
    "padded": "taken",
    "wrong-size": "refused",
    "truncated": "refused",
    "garbage": "refused",
}
"""What a frame of each variant (``strategies.frame_inputs``) must get in a session that
declared its format: ``taken`` (never refused: a frame over the decode rate or the
buffer is dropped, only counted), ``refused`` (from its header, before the next
message is read); a variant not listed may get either."""


def frame_expectation(kind: str, session_format: str) -> str:
    """``taken``, ``refused`` or ``any``: what a binary control input of ``kind`` must get
    as a frame of a session whose input video is ``session_format``. A frame of another
    format is refused from its header; one over the byte cap, whatever it is, gets
    ``message_too_large`` (checked on its size, `judge_control`)."""
    if not kind.startswith("control.frame-"):
        return "any"  # JSON as bytes, noise: rarely, by chance, an image's first bytes
    variant, _, frame_format = kind.removeprefix("control.frame-").partition(".")
    if frame_format and frame_format != session_format:
        return "refused"
    return FRAME_EXPECTATIONS.get(variant, "any")


@attrs.frozen
class SentFrame:
    """One binary message sent into a session that follows an input video: a frame."""

    number: int
    """Its number in the session (the server counts every binary message from 0)."""
    input_index: int
    """The control input it is."""
    size: int
    expect: str
    """`frame_expectation`'s answer."""


def frame_number(message: dict[str, Any]) -> int | None:
    """The input frame an error refuses (its message names it), or None."""
    if message.get("type") != "error" or message.get("code") not in FRAME_CODES:
        return None
    match = _FRAME_NUMBER.search(str(message.get("message")))
    return int(match.group(1)) if match else None


def frame_error_problems(
    number: int,
    code: str,
    frames: Mapping[int, SentFrame],
    *,
    earlier: int,
    current: int | None,
    shown: Collection[int],
) -> list[Problem]:
    """An error that refuses input frame ``number`` (of ``frames``, the session's frames
    so far), whenever it comes: the frame was sent, is refused once (``earlier``: its
    refusals before this one), was never shown (``shown``: the frames chunks were made
    from), is not one that must be taken; and ``message_too_large`` comes only at once,
    for the frame just sent (``current``)."""
    frame = frames.get(number)
    if frame is None:
        return [Problem("frame-error-unknown-frame", f"{code} for frame {number}, not sent")]
    problems = []
    where = f"frame {number} (input #{frame.input_index}, {frame.size} bytes)"
    if earlier:
        problems.append(Problem("frame-refused-twice", f"{where}: {code} after {earlier}"))
    if frame.expect == "taken":
        problems.append(Problem("valid-frame-refused", f"{where}: {code}"))
    if code == protocol.ErrorCode.MESSAGE_TOO_LARGE and number != current:
        problems.append(Problem("frame-too-large-late", f"{where}: after later messages"))
    if number in shown:
        problems.append(Problem("refused-frame-shown", f"{where}: {code} after a chunk used it"))
    return problems


def input_count_problems(
    counts: Any, used_and_dropped: int, frames_sent: int, refused: Collection[int]
) -> list[Problem]:
    """A chunk's ``input_frames``: well formed, and with the chunks before, never more
    frames used or dropped than were sent (``used_and_dropped``: this chunk's included);
    its ``last`` a frame sent and never refused."""
    if not isinstance(counts, dict):
        return [Problem("input-frames-missing", shorten(repr(counts)))]
    fields = ("used", "dropped", "reused")
    if not all(isinstance(counts.get(f), int) and counts[f] >= 0 for f in fields):
        return [Problem("input-frames-malformed", shorten(repr(counts)))]
    problems = []
    if used_and_dropped > frames_sent:
        problems.append(
            Problem(
                "input-frames-overcounted",
                f"{used_and_dropped} used or dropped, {frames_sent} frames sent",
            )
        )
    last = counts.get("last")
    if last is not None and (not isinstance(last, int) or not 0 <= last < frames_sent):
        problems.append(Problem("input-frames-bad-last", f"last {last!r} of {frames_sent} sent"))
    elif last is not None and last in refused:
        problems.append(Problem("refused-frame-shown", f"frame {last} was refused"))
    return problems


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
    frame_errors: list[tuple[int, str]] = attrs.field(factory=list)
    """Errors that refuse an input frame (its number, the code), in a session that follows
    an input video: not answers to this input, but to the frame they name."""
    frame_problems: list[tuple[int, Problem]] = attrs.field(factory=list)
    """Problems of frames (with their input's index: maybe one sent earlier) and of the
    chunks' input counts, found during this exchange."""
    answers: int = 2
    """The answers to wait for: 2 (the input's, then the pong of the ping behind it), or
    1 (only the pong: the input was a frame, or ``input_video.end``)."""
    frame: SentFrame | None = None
    """The input, when it was a frame of a session that follows an input video."""
    binary: bool = False
    """The input was a binary message in a session without input video."""


def is_terminal(message: dict[str, Any]) -> bool:
    """``session.done``, or an error whose code ends a session (not a per-message one)."""
    if message["type"] == "session.done":
        return True
    code = message.get("code")
    return message["type"] == "error" and code in KNOWN_CODES and code not in PER_MESSAGE_CODES


def message_limit(limits: protocol.Limits) -> int:
    """The server's WebSocket message limit: twice the larger byte limit (server/routing.py),
    so that it can still answer ``message_too_large`` below it; beyond, trio-websocket
    closes with 1009."""
    return 2 * max(limits.max_start_bytes, limits.max_control_bytes)


def judge_control(
    exchange: Exchange,
    limit: int,
    *,
    answers: int | None = None,
    limits: protocol.Limits = protocol.DEFAULT_LIMITS,
) -> tuple[str, list[Problem]]:
    """The outcome (``pong``, ``queued``, ``error:<code>``, ``stopped``, ``completed``,
    ``closed-1009``, for a frame ``taken``, for ``input_video.end`` ``input-end``, or
    ``violation``) and the problems of one control input.

    ``answers`` (``Exchange.answers`` unless given): 2 for an input and its ping; 1 for
    an input that gets no answer of its own (a frame, or ``input_video.end``), only its
    ping's pong; 0 for a wait in which nothing was sent (outcome ``running`` while the
    session lives on). A frame (``Exchange.frame``) is judged by what it must get and by
    its size against ``limits`` (the byte cap and, for a 1009 close, `message_limit`);
    the errors refusing it come beside the answers (``Exchange.frame_errors``). A binary
    message in a session without input video (``Exchange.binary``) is answered only
    with ``invalid_message`` (or ``message_too_large``, over ``limit``).
    """
    problems = list(exchange.problems)
    sent = exchange.sent_bytes
    answers = exchange.answers if answers is None else answers
    frame, binary = exchange.frame, exchange.binary
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
        closes_at = message_limit(limits) if frame is not None else 2 * limit
        if exchange.close_code == 1009 and sent > closes_at:
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
    if len(exchange.replies) < answers:
        kinds = [reply["type"] for reply in exchange.replies]
        problems.append(
            Problem(
                "no-reply", f"{len(kinds)} of {answers} answers in {REPLY_TIMEOUT:.0f} s: {kinds}"
            )
        )
        return "violation", problems
    if answers == 1:
        first = exchange.replies[0]
        if first["type"] != "session.pong":
            problems.append(Problem("unexpected-reply", f"{first['type']} before the pong"))
        if frame is None:
            return ("violation" if problems else "input-end"), problems
        outcome, found = _frame_outcome(exchange, frame, limits.max_input_frame_bytes)
        problems += found
        return ("violation" if problems else outcome), problems
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
    if binary:
        refused = f"error:{protocol.ErrorCode.INVALID_MESSAGE.value}"
        too_large = f"error:{protocol.ErrorCode.MESSAGE_TOO_LARGE.value}"
        if outcome == too_large and sent <= limit:
            problems.append(Problem("refused-within-limit", f"{sent} bytes <= {limit}"))
        elif outcome not in (refused, too_large):
            problems.append(
                Problem("binary-not-refused", f"{outcome} in a session without input video")
            )
    else:
        problems += _size_problems(outcome, sent, limit)
    return ("violation" if problems else outcome), problems


def _frame_outcome(exchange: Exchange, frame: SentFrame, cap: int) -> tuple[str, list[Problem]]:
    """A frame's outcome by the ping's pong: ``taken`` (no refusal so far) or the code of
    its refusal; and what it should have got then (a refusal from its header, or over
    the byte cap, comes before the next message is read). What comes later, and twice,
    is `frame_error_problems`'."""
    own = [code for number, code in exchange.frame_errors if number == frame.number]
    outcome = f"error:{own[0]}" if own else "taken"
    too_large = protocol.ErrorCode.MESSAGE_TOO_LARGE.value
    where = f"frame {frame.number}, {frame.size} bytes"
    if frame.size > cap:
        if own[:1] != [too_large]:
            return outcome, [Problem("oversize-frame-not-refused", f"{where} > {cap}: {outcome}")]
    elif too_large in own:
        return outcome, [Problem("refused-within-limit", f"{where} <= {cap}")]
    elif frame.expect == "refused" and not own:
        return outcome, [Problem("bad-frame-taken", f"{where}: not refused before the ping's pong")]
    return outcome, []


def asks_input_video(wire: Wire) -> bool:
    """Whether a start asks for an input video (an object: then, accepted, it waits for
    frames, or for ``input_video.end``), at the top level or lifted from
    ``sampling_params`` (where the top level has none)."""
    try:
        message = json.loads(wire)
    except (ValueError, RecursionError):
        return False
    if not isinstance(message, dict):
        return False
    if "input_video" not in message:
        message = message.get("sampling_params")
    return isinstance(message, dict) and isinstance(message.get("input_video"), dict)


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
