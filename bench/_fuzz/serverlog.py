"""The server's log as the fuzz reads it: which exception a session died of, and the
lines that show where.

Two bugs that both answer ``internal_error`` are two kinds of violation, each shrunk on
its own; the exception the server logged for the session is what tells them apart. The
records themselves (what starts one) are parsed the way the soak parses them
(``bench._harness.LOG_RECORD``).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Final

from bench._fuzz.oracle import (
    shorten,
)
from bench._harness import LOG_RECORD

_EXCEPTION_NAME: Final = re.compile(
    r"[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Closed|Timeout|Warning)\b"
)


FAILURE_KEYS: Final = frozenset(
    {
        "internal-error",
        "closed-without-message",
        "closed-without-terminal",
        "abnormal-close",
        "no-terminal",
        "no-reply",
        "session-stuck",
    }
)


def is_failure(key: str) -> bool:
    """Whether a problem is the server failing (then the exception it logged tells two
    such bugs apart) rather than a wrong answer (where a logged exception is unrelated)."""
    return key in FAILURE_KEYS or key.startswith(("session-ended-", "accepted-then-"))


_SESSION_ID: Final = re.compile(r"session (video_stream-[0-9a-f]+)")


def log_causes(text: str) -> dict[str, str]:
    """Request id -> the name of the exception logged with it (the last one, for chains)."""
    causes: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        if LOG_RECORD.match(line):
            match = _SESSION_ID.search(line)
            current = match.group(1) if match else None
            continue
        stripped = line.lstrip(" |+")
        if current is not None and _EXCEPTION_NAME.match(stripped):
            name = stripped.split(":", 1)[0]
            if name not in ("ExceptionGroup", "BaseExceptionGroup"):
                causes[current] = name
    return causes


_EXCEPTION_LINE: Final = re.compile(r"[\s|+]*\w[\w.]*(Error|Exception|Group)\b")
_TRACEBACK_NOISE: Final = ("Traceback", "During handling", "The above exception", "File ", "^")


def log_excerpt(text: str, needle: str, limit: int = 30) -> list[str]:
    """The log records that mention ``needle``; of their tracebacks, the project's own
    frames and the exception: what tells where a failure came from."""
    lines: list[str] = []
    keep = False
    in_frame = False
    for line in text.splitlines():
        if LOG_RECORD.match(line):
            keep = needle in line
            if keep:
                lines.append(shorten(line, 300))
            continue
        stripped = line.lstrip(" |+")
        if not keep or not stripped:
            continue
        if stripped.startswith("File "):
            in_frame = "trio_vstream" in stripped
            if in_frame:
                lines.append(f"  {shorten(stripped, 300)}")
        elif in_frame and not stripped.startswith("^"):
            lines.append(f"      {shorten(stripped, 300)}")  # the frame's source line
            in_frame = False
        elif (
            _EXCEPTION_LINE.match(line)
            and not stripped.startswith(_TRACEBACK_NOISE)
            and not stripped.startswith(("ExceptionGroup", "BaseExceptionGroup"))
        ):
            lines.append(f"  {shorten(stripped, 300)}")
    return lines[:limit]


def log_exceptions(text: str) -> Counter[str]:
    """The exceptions in the log's tracebacks (groups' members, not the groups), counted:
    what the server logged as a failure, whether or not a client saw one."""
    found: Counter[str] = Counter()
    seen: set[str] = set()
    inside = False
    for line in text.splitlines():
        if LOG_RECORD.match(line):
            inside, seen = False, set()
            continue
        stripped = line.lstrip(" |+")
        if "Traceback (most recent call last)" in stripped:
            inside = True
        elif (
            inside
            and _EXCEPTION_NAME.match(stripped)
            and not stripped.startswith(("ExceptionGroup", "BaseExceptionGroup"))
            and stripped not in seen
        ):
            seen.add(stripped)
            found[shorten(stripped, 200)] += 1
    return found
