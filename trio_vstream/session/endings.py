"""How a session ends, as rules: which reason wins, and what the client is told.

A session can end for many reasons at once: a stop arrives while the engine fails, a
client goes away while a stall is noticed, a shutdown comes just after the engine made
the last chunk. Which one counts, and which terminal message (``session.done`` or
``error``) it gets, is decided here, by `Ending`, from what the session tells it:

* the **first reason wins**, decided when it happens: later ones change nothing, so a
  client that goes away is a disconnect whichever task noticed it first;
* once the engine has made the last chunk the **video is complete**: a stop or a
  shutdown after that changes nothing (a failure still does: the rest of the video may
  not reach the client);
* a complete video whose encoder cannot finish it is a **failure after all**;
* an engine's exception reaches the client as a coded error that names the request,
  never as its text (`engine_failure`), unless it is an `EngineError`, written for
  clients.

Pure: no Trio, no socket. What ending a session cancels (the producer, a send stuck on
the socket) is the session's business (`trio_vstream.session.session`), which acts on what
these rules answer.
"""

from __future__ import annotations

import enum

import attrs

from trio_vstream import protocol
from trio_vstream.engines.contract import EngineError
from trio_vstream.protocol import ErrorCode


class Outcome(enum.Enum):
    """How a session ended; decides its terminal message."""

    COMPLETED = "completed"
    STOPPED = "stopped"
    SHUTDOWN = "shutdown"
    STALLED = "stalled"
    FAILED = "failed"
    DISCONNECTED = "disconnected"
    REJECTED = "rejected"
    """Never started streaming: bad or missing session.start, or no session slot free
    for it (``server_busy``)."""


GRACEFUL: frozenset[Outcome] = frozenset({Outcome.STOPPED, Outcome.SHUTDOWN})
"""The ends that a complete video no longer takes: a stop or a shutdown after the last
chunk was made lets the chunks on their way be sent and the video finish."""

SessionError = tuple[ErrorCode, str]
"""What went wrong, for the client: a protocol code and words."""


@attrs.frozen(kw_only=True)
class SessionSummary:
    """What one finished session did; handed to the server's ``on_session_end`` hook."""

    request_id: str | None
    outcome: Outcome
    chunks_sent: int
    frames_generated: int
    error_code: str | None
    error_message: str | None = None
    """What went wrong, in words (also when no message could reach the client)."""
    started_at: float
    """``time.monotonic()`` when the connection's session began."""
    stream_closed_at: float | None
    """When the engine stream was closed (None: the session never opened one)."""
    ended_at: float


@attrs.define
class Ending:
    """How one session ends: its outcome and error, decided by the rules above.

    ``outcome`` is None while the session goes on. The session reports what happens
    (`end`, `stop`, `generated_all`, `fail_after_all`) and asks for the terminal
    message at the end (`terminal`).
    """

    outcome: Outcome | None = None
    error: SessionError | None = None
    """The error the client is told of (None for a session that ends well)."""
    generated_all: bool = False
    """The engine made the last chunk: a stop or a shutdown no longer ends the video."""
    delivers_generated: bool = False
    """The engine failed while generating: the chunks it made before are still sent."""

    def end(self, outcome: Outcome, error: SessionError | None = None) -> bool:
        """Record the first reason the session ends; later ones change nothing.

        True if this one was recorded: the caller then does what this end calls for.
        """
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self.error = error
        return True

    def stop(self, outcome: Outcome, error: SessionError | None = None) -> bool:
        """A graceful end (a stop, a shutdown, a failure while streaming): as `end`, but
        a stop or a shutdown once the video is complete changes nothing."""
        if self.generated_all and outcome in GRACEFUL:
            return False
        return self.end(outcome, error)

    def engine_failed(self, error: SessionError) -> bool:
        """The engine failed while generating: the session failed, as `end` records it,
        and the chunks the engine made before are the user's video so far, still sent
        (then the error). True if this was the first reason."""
        if self.end(Outcome.FAILED, error):
            self.delivers_generated = True
            return True
        return False

    @property
    def drops_chunks(self) -> bool:
        """Whether a generated chunk whose encoding has not begun is dropped: once the
        session has ended, unless the engine's failure ended it (see `engine_failed`)."""
        return self.outcome is not None and not self.delivers_generated

    def fail_after_all(self, error: SessionError) -> None:
        """The encoder could not finish a complete video (its last bytes are lost): the
        session failed, whatever was decided before."""
        self.outcome = Outcome.FAILED
        self.error = error

    def settle(self) -> Outcome:
        """The outcome, at the end of the session. None decided is a failure (defensive:
        every way out of a session decides one)."""
        if self.outcome is None:
            self.end(Outcome.FAILED, (ErrorCode.INTERNAL_ERROR, "session ended unexpectedly"))
        assert self.outcome is not None
        return self.outcome

    @property
    def says_goodbye(self) -> bool:
        """Whether the client is sent a terminal message: not after it went away."""
        return self.outcome is not Outcome.DISCONNECTED

    def terminal(
        self, request_id: str | None, chunks_sent: int
    ) -> protocol.SessionDone | protocol.Error:
        """The one terminal message for the outcome: ``session.done`` for a video that
        completed or was stopped, else the recorded ``error``."""
        if self.outcome in (Outcome.COMPLETED, Outcome.STOPPED):
            assert request_id is not None
            return protocol.SessionDone(request_id, chunks_sent, self.outcome is Outcome.STOPPED)
        code, message = self.error or (ErrorCode.INTERNAL_ERROR, "internal error")
        return protocol.Error(code, message, request_id=request_id)


def engine_failure(exc: Exception, doing: str, request_id: str | None) -> SessionError:
    """What a client (and its viewers) are told of an engine's exception.

    An `EngineError`'s message is written for clients (see its docstring), so it is
    shown. Anything else (a ``RuntimeError`` of a library, an ``OSError`` naming a model
    file) may carry paths and internals: the client gets a coded error naming the
    request, and the text and traceback go to the server log (the caller logs them).
    """
    if isinstance(exc, EngineError):
        return ErrorCode.GENERATION_FAILED, describe(exc)
    return ErrorCode.GENERATION_FAILED, (
        f"engine failed while {doing} (see the server log, request {request_id})"
    )


def describe(exc: BaseException) -> str:
    """An exception in words: its message, or its type's name when it has none."""
    text = str(exc)
    return text if text else type(exc).__name__
