"""Tests of `ClientProtocol` (protocol/_client.py): messages in, events out, no sockets.

Each test feeds the server's side of a session as text and bytes and checks the events,
the state and the counters; the last one drives the machine against the real server,
the only place where a socket appears.
"""

import json
import math
from typing import Any

import pytest
import trio

from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.protocol import (
    ChunkAnnounced,
    ChunkMetadata,
    ChunkReceived,
    ClientProtocol,
    ClientState,
    Error,
    ErrorCode,
    ErrorReceived,
    InteractionAccepted,
    InteractionQueued,
    Pong,
    PongReceived,
    ProtocolError,
    ServerProtocolError,
    SessionDone,
    SessionEnded,
    VideoStart,
    VideoStarted,
    playback_message,
)

VIDEO_START = VideoStart("r1", "m4s", {"prompt": "a cat"})


def metadata(size: int, frames: int = 2, index: int = 0, kind: str = "media") -> ChunkMetadata:
    return ChunkMetadata("r1", kind, frames, size, index, (), (), (), index)  # type: ignore[arg-type]


def streaming() -> ClientProtocol:
    """A machine that has sent session.start and received video.start."""
    machine = ClientProtocol()
    machine.start(prompt="a cat")
    assert machine.receive(VIDEO_START.to_json()) == [VideoStarted(VIDEO_START)]
    return machine


def violation(machine: ClientProtocol, message: str | bytes) -> ServerProtocolError:
    with pytest.raises(ServerProtocolError) as info:
        machine.receive(message)
    return info.value


# --------------------------------------------------------------------------------------
# Sending
# --------------------------------------------------------------------------------------


def test_start_builds_the_session_start_text() -> None:
    machine = ClientProtocol()
    assert machine.state is ClientState.IDLE
    text = machine.start(prompt="a cat", fps=8, size="64x48")
    assert text == '{"type":"session.start","prompt":"a cat","fps":8,"size":"64x48"}'
    assert machine.state is ClientState.STARTING


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({"type": "x", "prompt": "p"}, "must not contain 'type'"), ({}, "needs a 'prompt' string")],
)
def test_start_refuses_what_cannot_be_a_session_start(
    fields: dict[str, Any], expected: str
) -> None:
    machine = ClientProtocol()
    with pytest.raises(ValueError, match=expected):
        machine.start(**fields)
    assert machine.state is ClientState.IDLE


def test_control_texts() -> None:
    machine = streaming()
    assert machine.interact("a dog") == (
        '{"type":"session.interaction","interaction":{"event":{"prompt":"a dog"}}}'
    )
    assert machine.interact("a dog", event_id="e1", transition_chunks=0) == (
        '{"type":"session.interaction","interaction":'
        '{"event_id":"e1","event":{"prompt":"a dog"},"transition_chunks":0}}'
    )
    assert machine.ping() == '{"type":"session.ping"}'
    assert machine.stop() == '{"type":"session.stop"}'
    assert machine.state is ClientState.STOPPING
    assert machine.ping() == '{"type":"session.ping"}'


def test_sending_in_the_wrong_state_is_a_caller_bug() -> None:
    machine = ClientProtocol()
    for send in (machine.stop, machine.ping, lambda: machine.interact("p")):
        with pytest.raises(RuntimeError, match="in state idle"):
            send()
    machine.start(prompt="p")
    with pytest.raises(RuntimeError, match="cannot start in state starting"):
        machine.start(prompt="p")
    machine.stop()
    with pytest.raises(RuntimeError, match="cannot interact in state stopping"):
        machine.interact("p")
    machine.receive(SessionDone("r1", 0, True).to_json())
    with pytest.raises(RuntimeError, match="cannot ping in state done"):
        machine.ping()


def test_playback_reports_the_playhead_while_streaming() -> None:
    assert playback_message(1.25) == '{"type":"session.playback","position_seconds":1.25}'
    # Built as given, so that a test can send one the server refuses; JSON has no NaN.
    assert playback_message(-1) == '{"type":"session.playback","position_seconds":-1}'
    with pytest.raises(ValueError, match="not JSON compliant"):
        playback_message(math.nan)
    machine = ClientProtocol()
    with pytest.raises(RuntimeError, match="cannot report playback in state idle"):
        machine.playback(0.0)
    machine.start(prompt="a cat", streaming_buffer_seconds=1.0)
    with pytest.raises(RuntimeError, match="in state starting"):
        machine.playback(0.0)  # nothing shown before video.start
    machine.receive(VIDEO_START.to_json())
    assert machine.playback(0) == '{"type":"session.playback","position_seconds":0}'
    assert machine.playback(2.5) == playback_message(2.5)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite and >= 0"):
            machine.playback(bad)
    machine.stop()
    with pytest.raises(RuntimeError, match="in state stopping"):
        machine.playback(3.0)


# --------------------------------------------------------------------------------------
# Receiving: one event per message
# --------------------------------------------------------------------------------------


def test_a_whole_session() -> None:
    machine = ClientProtocol()
    machine.start(prompt="a cat")
    events = [VideoStarted(VIDEO_START)]
    assert machine.receive(VIDEO_START.to_json()) == events
    assert machine.state is ClientState.STREAMING and machine.video_start == VIDEO_START
    first, trailer = metadata(5, frames=3), metadata(4, frames=0, index=1, kind="trailer")
    assert machine.receive(first.to_json()) == [ChunkAnnounced(first)]
    assert machine.receive(b"12345") == [ChunkReceived(first, b"12345")]
    queued = InteractionQueued("r1", "e1")
    [accepted] = machine.receive(queued.to_json())
    assert accepted == InteractionAccepted(queued) and accepted.event_id == "e1"
    assert machine.receive(Pong().to_json()) == [PongReceived(Pong())]
    machine.receive(trailer.to_json())
    [chunk] = machine.receive(b"moov")
    assert chunk == ChunkReceived(trailer, b"moov") and chunk.num_frames == 0
    assert (machine.chunks, machine.frames, machine.media_bytes) == (2, 3, 9)
    done = SessionDone("r1", 2, False)
    assert machine.receive(done.to_json()) == [SessionEnded(done)]
    assert machine.state is ClientState.DONE and machine.ended


def test_every_text_event_carries_its_message() -> None:
    machine = streaming()
    for message in (metadata(1), Pong(), InteractionQueued("r1", "e"), SessionDone("r", 0, False)):
        if isinstance(message, Pong):
            machine.receive(b"x")  # the metadata's binary
        [event] = machine.receive(message.to_json())
        assert event.message == message  # type: ignore[union-attr]


def test_stop_before_video_start_stays_stopping() -> None:
    machine = ClientProtocol()
    machine.start(prompt="p")
    machine.stop()
    machine.receive(VIDEO_START.to_json())
    assert machine.state is ClientState.STOPPING
    machine.receive(SessionDone("r1", 0, True).to_json())
    assert machine.state is ClientState.DONE


# --------------------------------------------------------------------------------------
# Errors: which ones end the session
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [ErrorCode.INVALID_MESSAGE, ErrorCode.SERVER_BUSY, "future"])
def test_every_error_before_video_start_ends_the_session(code: ErrorCode | str) -> None:
    machine = ClientProtocol()
    machine.start(prompt="p")
    error = Error(code, "no")
    assert machine.receive(error.to_json()) == [ErrorReceived(error, ends_session=True)]
    assert machine.state is ClientState.FAILED and machine.ended


def test_the_server_may_speak_first() -> None:
    """A full server refuses before reading session.start."""
    machine = ClientProtocol()
    [event] = machine.receive(Error(ErrorCode.SERVER_BUSY, "busy").to_json())
    assert isinstance(event, ErrorReceived) and event.ends_session


@pytest.mark.parametrize(
    ("code", "ends"),
    [
        (ErrorCode.INVALID_JSON, False),
        (ErrorCode.INVALID_MESSAGE, False),
        (ErrorCode.UNKNOWN_TYPE, False),
        (ErrorCode.MESSAGE_TOO_LARGE, False),
        (ErrorCode.EVENT_ID_CONFLICT, False),
        (ErrorCode.INTERACTION_FAILED, False),
        (ErrorCode.STALL_TIMEOUT, True),
        (ErrorCode.GENERATION_FAILED, True),
        (ErrorCode.SERVER_SHUTDOWN, True),
        ("some_future_code", True),
    ],
)
def test_during_streaming_only_answers_to_control_messages_leave_it_going(
    code: ErrorCode | str, ends: bool
) -> None:
    machine = streaming()
    error = Error(code, "m", "r1", "e1")
    assert machine.receive(error.to_json()) == [ErrorReceived(error, ends_session=ends)]
    assert machine.ended is ends
    assert machine.state is (ClientState.FAILED if ends else ClientState.STREAMING)


def test_reference_error_without_code_gets_its_code_from_the_text() -> None:
    machine = streaming()
    [event] = machine.receive('{"type":"error","message":"Failed to apply interaction"}')
    assert isinstance(event, ErrorReceived) and not event.ends_session
    assert event.error.code is ErrorCode.INTERACTION_FAILED
    [event] = machine.receive('{"type":"error","message":"diffusion engine exploded"}')
    assert isinstance(event, ErrorReceived) and event.ends_session
    assert event.error.code is ErrorCode.INTERNAL_ERROR


def test_reference_chunk_metadata_without_transport_chunk_index_pairs_normally() -> None:
    machine = streaming()
    raw = json.dumps(
        {
            "type": "video.chunk_metadata",
            "request_id": "ref-1",
            "kind": "media",
            "num_frames": 2,
            "byte_length": 3,
            "generation_chunk_index": None,
        }
    )
    machine.receive(raw)
    [chunk] = machine.receive(b"abc")
    assert isinstance(chunk, ChunkReceived) and chunk.metadata.transport_chunk_index == -1
    assert (machine.chunks, machine.frames) == (1, 2)


# --------------------------------------------------------------------------------------
# Violations: raised, with the state already consistent
# --------------------------------------------------------------------------------------


def test_binary_without_metadata_is_a_violation_that_hands_back_the_data() -> None:
    machine = streaming()
    error = violation(machine, b"stray")
    assert isinstance(error, ProtocolError) and error.code is ErrorCode.INVALID_MESSAGE
    assert error.message == "binary message of 5 bytes without metadata"
    assert (error.data, error.events) == (b"stray", [])
    assert machine.chunks == 0 and machine.state is ClientState.STREAMING


def test_a_second_binary_after_one_metadata_has_none() -> None:
    machine = streaming()
    machine.receive(metadata(1).to_json())
    machine.receive(b"x")
    assert violation(machine, b"y").message == "binary message of 1 bytes without metadata"


def test_a_mismatched_byte_length_still_delivers_the_chunk() -> None:
    machine = streaming()
    announced = metadata(10, frames=4)
    machine.receive(announced.to_json())
    error = violation(machine, b"short")
    assert error.message == "chunk announced 10 bytes but carried 5"
    assert error.events == [ChunkReceived(announced, b"short")] and error.data is None
    assert (machine.chunks, machine.frames, machine.media_bytes) == (1, 4, 5)
    # The pairing is over: the next message is read afresh.
    assert machine.receive(Pong().to_json()) == [PongReceived(Pong())]


@pytest.mark.parametrize("next_message", [Pong(), metadata(2, index=1)])
def test_metadata_not_followed_by_its_binary(next_message: Any) -> None:
    machine = streaming()
    machine.receive(metadata(1).to_json())
    error = violation(machine, next_message.to_json())
    assert error.message == "chunk metadata not followed by its binary message"
    # The text message itself still counts: its event comes with the error.
    assert len(error.events) == 1 and error.events[0].message == next_message
    if isinstance(next_message, ChunkMetadata):
        assert machine.receive(b"ab") == [ChunkReceived(next_message, b"ab")]
    else:
        assert violation(machine, b"a").data == b"a"


@pytest.mark.parametrize(
    "terminal", [SessionDone("r1", 0, False), Error(ErrorCode.STALL_TIMEOUT, "Stall timeout")]
)
@pytest.mark.parametrize("after", [Pong().to_json(), b"bytes", "not json"])
def test_messages_after_the_end_are_violations(terminal: Any, after: str | bytes) -> None:
    machine = streaming()
    machine.receive(terminal.to_json())
    state = machine.state
    error = violation(machine, after)
    assert error.message == "message after the terminal message ignored"
    assert error.events == [] and error.data is None and machine.state is state


@pytest.mark.parametrize(
    ("raw", "code", "detail"),
    [
        ("nope", ErrorCode.INVALID_JSON, "Invalid JSON message"),
        ('{"type":"video.end"}', ErrorCode.UNKNOWN_TYPE, "Unknown message type: video.end"),
        (
            '{"type":"session.done"}',
            ErrorCode.INVALID_MESSAGE,
            "Invalid session.done message: request_id is required; chunks is required; "
            "stopped is required",
        ),
    ],
)
def test_unreadable_messages_are_violations_that_change_nothing(
    raw: str, code: ErrorCode, detail: str
) -> None:
    machine = streaming()
    machine.receive(metadata(1).to_json())
    error = violation(machine, raw)
    assert (error.code, error.message) == (code, f"unreadable server message ignored: {detail}")
    assert error.events == []
    assert machine.receive(b"x") == [ChunkReceived(metadata(1), b"x")]  # still paired


# --------------------------------------------------------------------------------------
# Against the real server
# --------------------------------------------------------------------------------------


async def test_the_machine_follows_a_real_session_and_the_server_mints_event_ids(
    start_server: Any,
) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4))
    machine = ClientProtocol()
    events: list[Any] = []
    async with running.connect() as ws:
        await ws.send_message(machine.start(prompt="a red circle", size="64x48", num_frames=12))
        with trio.fail_after(10):
            while not machine.ended:
                new = machine.receive(await ws.get_message())
                events.extend(new)
                if any(isinstance(event, VideoStarted) for event in new):
                    await ws.send_message(machine.interact("a blue square"))
    assert machine.state is ClientState.DONE
    assert (machine.chunks, machine.frames) == (4, 12)
    [accepted] = [event for event in events if isinstance(event, InteractionAccepted)]
    assert len(accepted.event_id) == 32 and int(accepted.event_id, 16) >= 0
    chunks = [event for event in events if isinstance(event, ChunkReceived)]
    assert machine.media_bytes == sum(len(event.data) for event in chunks)
