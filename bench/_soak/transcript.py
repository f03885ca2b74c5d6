"""Transcripts: what one client of the soak saw and did, and the server's messages read
from them by the rules of form every session keeps.

A client records everything (``Transcript``); whether that is right is decided
afterwards, from the transcript alone, by pure checks (``checks`` for the sessions,
``shutdown_checks`` for the shutdown rounds' clients). This module is what they read: the
record itself and ``read_messages``, the one reading of a server's messages (JSON objects
of known types, each chunk's metadata followed by its binary message) that they share.
"""

from __future__ import annotations

import json
from typing import Any, Final

import attrs


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
    upgrade_refusal: dict[str, Any] | None = None
    """The ``error`` message of a refused upgrade's body (a full server's HTTP 503 carries
    ``server_busy``), which ``client_error`` describes too."""
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


def describe(message: dict[str, Any]) -> str:
    """A server message in a few words, for a problem's text."""
    kind = message.get("type")
    if kind == "error":
        return f"error {message.get('code')!s} ({message.get('message')!s})"
    if kind == "session.done":
        return f"session.done stopped={json.dumps(message.get('stopped'))}"
    return str(kind)


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
