"""`Ending` and `engine_failure`, without a session: which reason ends a session, and what
the client is told at the end."""

from __future__ import annotations

import pytest

from trio_vstream import protocol
from trio_vstream.engines.contract import EngineError
from trio_vstream.protocol import ErrorCode
from trio_vstream.session.endings import Ending, Outcome, describe, engine_failure

STALL = (ErrorCode.STALL_TIMEOUT, "Stall timeout: no generation progress")
SHUTDOWN = (ErrorCode.SERVER_SHUTDOWN, "Server is shutting down")


def test_the_first_reason_wins_and_later_ones_change_nothing() -> None:
    ending = Ending()
    assert ending.outcome is None
    assert ending.end(Outcome.STALLED, STALL)
    assert not ending.end(Outcome.DISCONNECTED)
    assert not ending.stop(Outcome.STOPPED)
    assert not ending.stop(Outcome.FAILED, (ErrorCode.GENERATION_FAILED, "boom"))
    assert (ending.outcome, ending.error) == (Outcome.STALLED, STALL)


@pytest.mark.parametrize(
    ("outcome", "error"), [(Outcome.STOPPED, None), (Outcome.SHUTDOWN, SHUTDOWN)]
)
def test_a_stop_or_a_shutdown_after_the_last_chunk_leaves_the_video_complete(
    outcome: Outcome, error: tuple[ErrorCode, str] | None
) -> None:
    ending = Ending()
    ending.generated_all = True
    assert not ending.stop(outcome, error)
    assert ending.outcome is None  # the session goes on to deliver what is left
    assert ending.end(Outcome.COMPLETED)
    assert ending.terminal("r1", 3) == protocol.SessionDone("r1", 3, stopped=False)


def test_before_the_last_chunk_a_stop_ends_the_session() -> None:
    ending = Ending()
    assert ending.stop(Outcome.STOPPED)
    assert ending.terminal("r1", 2) == protocol.SessionDone("r1", 2, stopped=True)


@pytest.mark.parametrize("outcome", [Outcome.FAILED, Outcome.DISCONNECTED, Outcome.STALLED])
def test_other_ends_still_end_a_complete_video(outcome: Outcome) -> None:
    """The video is complete once made, but not yet delivered: a failure to deliver it,
    a client that goes, a send stuck on the socket still end the session."""
    ending = Ending()
    ending.generated_all = True
    assert ending.stop(outcome) if outcome is Outcome.FAILED else ending.end(outcome)
    assert ending.outcome is outcome


def test_an_encoder_that_cannot_finish_a_complete_video_makes_it_a_failure() -> None:
    ending = Ending()
    ending.end(Outcome.COMPLETED)
    ending.fail_after_all((ErrorCode.ENCODING_FAILED, "disk full"))
    assert ending.settle() is Outcome.FAILED
    assert ending.terminal("r1", 4) == protocol.Error(
        ErrorCode.ENCODING_FAILED, "disk full", request_id="r1"
    )


def test_a_session_that_ends_without_a_reason_is_an_internal_failure() -> None:
    ending = Ending()
    assert ending.settle() is Outcome.FAILED
    assert ending.terminal(None, 0) == protocol.Error(
        ErrorCode.INTERNAL_ERROR, "session ended unexpectedly"
    )
    # Settled once, it stays as it is.
    assert ending.settle() is Outcome.FAILED and ending.error is not None
    assert ending.error[1] == "session ended unexpectedly"


@pytest.mark.parametrize(
    ("outcome", "error", "terminal"),
    [
        (Outcome.COMPLETED, None, protocol.SessionDone("r1", 5, stopped=False)),
        (Outcome.STOPPED, None, protocol.SessionDone("r1", 5, stopped=True)),
        (
            Outcome.SHUTDOWN,
            SHUTDOWN,
            protocol.Error(ErrorCode.SERVER_SHUTDOWN, SHUTDOWN[1], request_id="r1"),
        ),
        (
            Outcome.STALLED,
            STALL,
            protocol.Error(ErrorCode.STALL_TIMEOUT, STALL[1], request_id="r1"),
        ),
        # An error-ending outcome with no error recorded still gets an error, never a done.
        (
            Outcome.FAILED,
            None,
            protocol.Error(ErrorCode.INTERNAL_ERROR, "internal error", request_id="r1"),
        ),
    ],
)
def test_each_outcome_gets_its_terminal_message(
    outcome: Outcome,
    error: tuple[ErrorCode, str] | None,
    terminal: protocol.SessionDone | protocol.Error,
) -> None:
    ending = Ending()
    ending.end(outcome, error)
    assert ending.terminal("r1", 5) == terminal
    assert ending.says_goodbye


def test_a_client_that_went_away_is_not_said_goodbye_to() -> None:
    ending = Ending()
    assert ending.says_goodbye  # not decided yet
    ending.end(Outcome.DISCONNECTED)
    assert not ending.says_goodbye


def test_an_engine_error_is_shown_and_any_other_exception_is_not() -> None:
    shown = engine_failure(EngineError("prompt too long for this model"), "generating", "r1")
    assert shown == (ErrorCode.GENERATION_FAILED, "prompt too long for this model")
    hidden = engine_failure(OSError("/srv/models/secret/unet.bin missing"), "generating", "r7")
    assert hidden[0] is ErrorCode.GENERATION_FAILED
    assert "/srv" not in hidden[1] and "r7" in hidden[1] and "generating" in hidden[1]


def test_an_exception_without_words_is_named_by_its_type() -> None:
    assert describe(RuntimeError("out of memory")) == "out of memory"
    assert describe(EngineError()) == "EngineError"


def test_an_engine_failure_keeps_what_the_engine_made() -> None:
    """The engine failed while generating: the session failed, and the chunks it made
    before are still sent; any other end drops the chunks not yet being encoded."""
    failed = Ending()
    assert not failed.drops_chunks  # the session goes on
    assert failed.engine_failed((ErrorCode.GENERATION_FAILED, "boom"))
    assert (failed.outcome, failed.drops_chunks) == (Outcome.FAILED, False)
    assert not failed.stop(Outcome.STOPPED)  # the failure came first
    assert failed.outcome is Outcome.FAILED
    for end in (Outcome.STOPPED, Outcome.SHUTDOWN, Outcome.STALLED, Outcome.DISCONNECTED):
        ended = Ending()
        ended.end(end)
        assert ended.drops_chunks
        assert not ended.engine_failed((ErrorCode.GENERATION_FAILED, "late"))
        assert (ended.outcome, ended.drops_chunks) == (end, True)
