"""The session at its edges: disconnects, queues, last messages, late stops, odd text.

Most tests drive one `Session` through `ScriptedSocket`, a stand-in for the
WebSocket whose incoming messages, peer close and held sends the test decides,
so each race is played out in the order that used to go wrong, every time.
Where the queue or the admission matters, a real server runs on loopback or on
in-memory streams.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import (
    CloseReason,
    ConnectionClosed,
    wrap_client_stream,
    wrap_server_stream,
)

from tests.conftest import Transcript, is_type, receive_into, receive_until
from tests.instrumented import TakingTurnsEngine
from trio_vstream import protocol
from trio_vstream.engines.contract import GenerationRequest
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings, SyntheticStream
from trio_vstream.media.encoding import EncodingError, FragmentedMP4Encoder
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.session.session import (
    Outcome,
    ServerCounters,
    ServerResources,
    Session,
    SessionConfig,
    SessionSummary,
)

START = {"type": "session.start", "prompt": "a red circle", "size": "32x32", "fps": 8}


class ScriptedSocket:
    """What a `Session` needs of a WebSocket, with the peer's side in the test's hands.

    Like trio-websocket: after the peer's close, ``get_message`` and
    ``send_message`` raise ``ConnectionClosed``. A send for which ``hold``
    returns True waits until ``release()`` (or until it is cancelled): a
    client that is not reading.
    """

    def __init__(self) -> None:
        self._incoming_send, self._incoming = trio.open_memory_channel[str | None](math.inf)
        self.sent: list[Any] = []
        self.hold: Callable[[Any], bool] = lambda message: False
        self.held = trio.Event()
        self._released = trio.Event()
        self._changed = trio.Event()
        self.peer_closed = False
        self.close_calls = 0

    # ---- the test's side

    def feed(self, message: dict[str, Any] | str) -> None:
        self._incoming_send.send_nowait(
            message if isinstance(message, str) else json.dumps(message)
        )

    def close_from_peer(self) -> None:
        self.peer_closed = True
        self._incoming_send.send_nowait(None)
        self._notify()

    def release(self) -> None:
        self._released.set()

    async def wait_until(self, predicate: Callable[[list[Any]], bool]) -> None:
        while not predicate(self.sent):
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @property
    def types(self) -> list[str]:
        return [m["type"] if isinstance(m, dict) else "<binary>" for m in self.sent]

    # ---- the session's side

    async def get_message(self) -> str:
        message = await self._incoming.receive()
        if message is None:
            raise ConnectionClosed(CloseReason(1000, None))
        return message

    async def send_message(self, data: str | bytes) -> None:
        message = json.loads(data) if isinstance(data, str) else data
        if self.peer_closed:
            raise ConnectionClosed(CloseReason(1000, None))
        if self.hold(message):
            self.held.set()
            self._notify()
            while not self._released.is_set():
                with trio.CancelScope() as wake:
                    self._wake_held = wake
                    await self._released.wait()
                if self.peer_closed:
                    raise ConnectionClosed(CloseReason(1000, None))
        self.sent.append(message)
        self._notify()

    def fail_held_sends(self, *, tell_receiver: bool = True) -> None:
        """The peer closes while a send is held: it fails as trio-websocket's would.
        Without ``tell_receiver`` only the send finds out (the close frame is still
        on its way to the reader)."""
        if tell_receiver:
            self.close_from_peer()
        else:
            self.peer_closed = True
        self._wake_held.cancel()

    async def aclose(self) -> None:
        self.close_calls += 1


def make_session(
    ws: ScriptedSocket, engine: Any | None = None, **config: Any
) -> tuple[Session, ServerResources]:
    engine = engine or SyntheticEngine(SyntheticSettings(chunk_frames=4))
    resources = ServerResources(
        engine=engine,
        config=SessionConfig(**config),
        stats=ServerCounters(),
        step_limiter=None,
        thread_limiter=trio.CapacityLimiter(8),
        encode_limiter=trio.CapacityLimiter(1),
    )
    return Session(ws, resources), resources  # type: ignore[arg-type]


def is_terminal(message: Any) -> bool:
    return isinstance(message, dict) and message["type"] in ("session.done", "error")


class GatedEngine(SyntheticEngine):
    """Opens its streams only when the test says so, from the worker thread."""

    def __init__(self) -> None:
        super().__init__(SyntheticSettings(chunk_frames=4))
        self.go = threading.Event()

    def open_stream(self, request: GenerationRequest) -> SyntheticStream:
        self.go.wait(timeout=30)
        return super().open_stream(request)


class RecordingEngine(SyntheticEngine):
    """Tells the test when a stream has made its last chunk."""

    def __init__(self, settings: SyntheticSettings) -> None:
        super().__init__(settings)
        self.finished = threading.Event()

    def open_stream(self, request: GenerationRequest) -> SyntheticStream:
        stream = super().open_stream(request)
        next_chunk = stream.next_chunk

        def recording_next_chunk(checkpoint: Any) -> Any:
            chunk = next_chunk(checkpoint)
            if chunk is None:
                self.finished.set()
            return chunk

        stream.next_chunk = recording_next_chunk  # type: ignore[method-assign]
        return stream


@contextlib.asynccontextmanager
async def session_in_background(session: Session) -> AsyncIterator[list[SessionSummary]]:
    """Run ``session`` while the body plays the peer; once the block is left, the session
    has ended and its summary is the list's one item."""
    summaries: list[SessionSummary] = []

    async def run() -> None:
        summaries.append(await session.run())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        yield summaries


async def sessions_at_once(running: Any, start: dict[str, Any], count: int) -> list[Transcript]:
    """``count`` clients send the same ``session.start`` together and read to the end."""
    transcripts = [Transcript() for _ in range(count)]

    async def one(transcript: Transcript) -> None:
        async with running.connect() as ws:
            await ws.send_message(json.dumps(start))
            await receive_into(ws, transcript)

    async with trio.open_nursery() as nursery:
        for transcript in transcripts:
            nursery.start_soon(one, transcript)
    return transcripts


def assert_quiet_disconnect(
    summary: SessionSummary, caplog: pytest.LogCaptureFixture, *, disconnect_lines: int = 1
) -> None:
    assert summary.outcome is Outcome.DISCONNECTED
    assert summary.error_code is None
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
    lines = [r for r in caplog.records if "client disconnected" in r.getMessage()]
    assert len(lines) == disconnect_lines


# ------------------------------------------------------------------ 1. disconnects


async def test_close_right_after_start_is_a_disconnect(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    ws = ScriptedSocket()
    engine = GatedEngine()
    session, resources = make_session(ws, engine)
    ws.feed({**START, "num_frames": 8})
    ws.close_from_peer()  # before the session can answer: its video.start finds it closed
    engine.go.set()
    summary = await session.run()
    assert_quiet_disconnect(summary, caplog)
    assert ws.sent == []
    assert resources.stats.streams_open == 0 and resources.stats.sessions_active == 0


async def test_close_right_after_a_ping_is_a_disconnect(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    ws = ScriptedSocket()
    session, _ = make_session(ws, SyntheticEngine(SyntheticSettings(step_delay=0.05)))
    async with session_in_background(session) as summaries:
        ws.feed({**START, "num_frames": 400})
        await ws.wait_until(lambda sent: bool(sent))
        ws.hold = lambda m: isinstance(m, dict) and m["type"] == "session.pong"
        ws.feed({"type": "session.ping"})
        await ws.held.wait()
        ws.fail_held_sends()  # the pong meets the closed socket
    assert_quiet_disconnect(summaries[0], caplog)


@pytest.mark.parametrize("receiver_knows", [False, True])
async def test_a_send_that_finds_the_socket_closed_is_a_disconnect(
    caplog: pytest.LogCaptureFixture, receiver_knows: bool
) -> None:
    """A chunk's send fails on the closed socket, alone or while the receive loop also
    sees the close and cancels the rest (the failure and the cancellation then meet in
    one exception group): the session ends as a disconnect, through its normal ending."""
    caplog.set_level(logging.INFO)
    for _ in range(10):  # both orders of the two wake-ups
        caplog.clear()
        ws = ScriptedSocket()
        session, resources = make_session(ws)
        ws.hold = lambda m: isinstance(m, bytes)
        ws.feed({**START, "num_frames": 40})
        async with session_in_background(session) as summaries:
            await ws.held.wait()
            ws.fail_held_sends(tell_receiver=receiver_knows)
        assert_quiet_disconnect(summaries[0], caplog)
        assert resources.stats.streams_open == 0


async def test_clients_that_close_at_once_are_all_disconnects(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Over real sockets, whichever task notices the close first."""
    caplog.set_level(logging.INFO)
    running = await start_server(SyntheticSettings(chunk_frames=4))
    for _ in range(20):
        async with running.connect() as ws:
            await ws.send_message(json.dumps({**START, "num_frames": 8}))
    await running.wait_sessions_ended(20)
    assert {s.outcome for s in running.summaries} == {Outcome.DISCONNECTED}
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []


# ---------------------------------------------------------- 2. queued is not stalled


@pytest.mark.slow
async def test_sessions_queued_behind_a_busy_engine_are_not_stalled(start_server: Any) -> None:
    """Three sessions take turns on one lock, a chunk (1 s, in steps of 0.1 s) at a
    time: the last in line waits about 2 s for its turn, longer than the 1.5 s stall
    timeout, yet none is stalled. The timeout stays well above a step, so that a
    pause of the whole test process (a full garbage collection in a suite that has
    loaded torch and diffusers) cannot pass for a stall."""
    stall_timeout = 1.5
    running = await start_server(
        SyntheticSettings(chunk_frames=4, steps=10, step_delay=0.1),
        stall_timeout=stall_timeout,
        engine_class=TakingTurnsEngine,
    )
    # The first to get a turn keeps it (stepping) until the other two queue behind it:
    # else, under load, it can be done before they have connected, and none queues.
    running.engine.queue_to_meet = 2
    transcripts = await sessions_at_once(running, {**START, "num_frames": 4}, 3)
    for transcript in transcripts:
        assert transcript.terminal == [transcript.json[-1]]
        assert transcript.terminal[0]["type"] == "session.done", transcript.terminal
    assert running.engine.max_waiting >= 2  # they really did queue
    assert running.engine.longest_wait > stall_timeout  # and one queued past the timeout


async def test_an_engine_that_hangs_under_its_lock_stalls_every_queued_session(
    start_server: Any,
) -> None:
    running = await start_server(
        SyntheticSettings(chunk_frames=4, hang_at_chunk=0),
        stall_timeout=0.5,
        engine_class=TakingTurnsEngine,
    )
    with trio.fail_after(20):
        transcripts = await sessions_at_once(running, {**START, "num_frames": 8}, 3)
    for transcript in transcripts:
        assert transcript.terminal == [
            {
                "type": "error",
                "code": "stall_timeout",
                "message": "Stall timeout: no generation progress",
                "request_id": transcript.json[0]["request_id"],
            }
        ]
    await running.wait_sessions_ended(3)
    assert running.checks_at_end == [{"threads_inside": 0, "unclosed_streams": 0}] * 3


# ------------------------------------------------------- 3. the last message's time


async def test_the_last_message_waits_only_the_close_timeout() -> None:
    ws = ScriptedSocket()
    session, _ = make_session(ws, stall_timeout=60.0, close_timeout=0.2)
    ws.hold = is_terminal  # the client stops reading at the end
    ws.feed({**START, "num_frames": 8})
    with trio.fail_after(10):  # 60 s when the stall timeout governed the last send
        summary = await session.run()
    assert summary.outcome is Outcome.COMPLETED
    assert ws.held.is_set() and not any(is_terminal(m) for m in ws.sent)
    assert ws.close_calls == 0  # a half-written frame is not followed by a close frame


# ------------------------------------------------- 4. the outcome when it happens


async def test_shutdown_while_video_start_is_sent_still_says_goodbye() -> None:
    ws = ScriptedSocket()
    session, _ = make_session(ws)
    ws.hold = lambda m: isinstance(m, dict) and m["type"] == "video.start"
    ws.feed({**START, "num_frames": 8})
    async with session_in_background(session) as summaries:
        await ws.held.wait()
        session.shutdown()
        ws.release()
    assert ws.types == ["video.start", "error"]
    assert ws.sent[-1]["code"] == "server_shutdown"
    assert summaries[0].outcome is Outcome.SHUTDOWN
    assert ws.close_calls == 1


@pytest.mark.parametrize("ending", ["stop", "shutdown"])
async def test_a_stop_after_the_last_chunk_was_generated_keeps_the_video_complete(
    ending: str,
) -> None:
    ws = ScriptedSocket()
    engine = RecordingEngine(SyntheticSettings(chunk_frames=4))
    session, _ = make_session(ws, engine)
    ws.feed({**START, "num_frames": 8})
    async with session_in_background(session) as summaries:
        await ws.wait_until(lambda sent: bool(sent))  # video.start
        ws.hold = lambda m: isinstance(m, dict) and m["type"] == "session.pong"
        ws.feed({"type": "session.ping"})
        await ws.held.wait()  # the pong holds the socket; the engine goes on
        await trio.to_thread.run_sync(engine.finished.wait, 30)
        with trio.fail_after(10):
            while not session._ending.generated_all:  # the engine's answer is on its way back
                await trio.testing.wait_all_tasks_blocked()
        session.stop() if ending == "stop" else session.shutdown()
        ws.release()
    assert summaries[0].outcome is Outcome.COMPLETED
    kinds = [m["kind"] for m in ws.sent if isinstance(m, dict) and "kind" in m]
    assert kinds == ["media", "media", "trailer"]
    assert ws.sent[-1] == {
        "type": "session.done",
        "request_id": summaries[0].request_id,
        "chunks": 3,
        "stopped": False,
    }


# ---------------------------------------------------------------- 5. odd text


@pytest.mark.parametrize(
    "message",
    [
        '{"type":"session.interaction","interaction":{"event_id":"e1",'
        '"event":{"prompt":"\\udc80"}}}',
        '{"type":"session.start","prompt":"\\udc80"}',
        '{"type":"\\ud800"}',
        '{"type":"session.interaction","interaction":{"event_id":"\\udfff",'
        '"event":{"prompt":"x"}}}',
    ],
)
async def test_a_lone_surrogate_gets_a_coded_error_and_the_session_goes_on(
    start_server: Any, message: str
) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4, step_delay=0.01))
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 16}))
        await receive_until(ws, transcript, is_type("video.start"))
        await ws.send_message(message)
        error = await receive_until(ws, transcript, is_type("error"))
        await receive_into(ws, transcript)
    assert error["code"] == "invalid_message"
    assert "not valid Unicode" in error["message"]
    error["message"].encode("utf-8")  # what goes back is valid text
    assert transcript.terminal[-1]["type"] == "session.done"
    assert transcript.terminal[-1]["stopped"] is False


def test_protocol_names_where_the_lone_surrogate_is() -> None:
    with pytest.raises(protocol.ProtocolError) as caught:
        protocol.parse_control(
            '{"type":"session.interaction","interaction":{"event":{"prompt":"a\\udc80"}}}'
        )
    assert caught.value.code is protocol.ErrorCode.INVALID_MESSAGE
    assert "interaction.event.prompt" in caught.value.message
    with pytest.raises(protocol.ProtocolError) as caught:
        protocol.parse_start('{"type":"session.start","prompt":"x","\\udc80":[1]}')
    assert "\\udc80" in caught.value.message  # the key, written out safely
    caught.value.message.encode("utf-8")
    # A surrogate *pair* is an ordinary character.
    parsed = protocol.parse_control(
        '{"type":"session.interaction","interaction":{"event":{"prompt":"\\ud83d\\ude00"}}}'
    )
    assert isinstance(parsed, protocol.Interaction) and parsed.prompt == "\U0001f600"


# ------------------------------------------------------------------ 6. admission


async def test_a_closing_connection_does_not_hold_a_session_slot() -> None:
    """max_sessions=1: the next session starts while the last one's close handshake
    waits for a client that no longer answers."""
    server = VideoServer(
        SyntheticEngine(SyntheticSettings(chunk_frames=4)),
        ServerConfig(max_sessions=1, session=SessionConfig(close_timeout=30.0)),
    )

    async def serve(stream: trio.abc.Stream, nursery: trio.Nursery) -> None:
        request = await wrap_server_stream(nursery, stream)
        await server.serve_websocket(request)

    async with trio.open_nursery() as nursery:
        # First client: its bytes stop reaching the server right after session.start.
        client_send, server_receive = trio.testing.memory_stream_one_way_pair()
        server_send, client_receive = trio.testing.memory_stream_one_way_pair()
        pump = client_send.send_all_hook
        forwarding = True

        async def pump_while_forwarding() -> None:
            if forwarding and pump is not None:
                await pump()

        client_send.send_all_hook = pump_while_forwarding
        nursery.start_soon(serve, trio.StapledStream(server_send, server_receive), nursery)
        first = await wrap_client_stream(
            nursery, trio.StapledStream(client_send, client_receive), "test", "/v1/realtime/video"
        )
        await first.send_message(json.dumps({**START, "num_frames": 4}))
        forwarding = False
        transcript = Transcript()
        await receive_until(first, transcript, is_type("session.done"))

        second_client, second_server = trio.testing.memory_stream_pair()
        nursery.start_soon(serve, second_server, nursery)
        second = await wrap_client_stream(nursery, second_client, "test", "/v1/realtime/video")
        await second.send_message(json.dumps({**START, "num_frames": 4}))
        reply = json.loads(await second.get_message())
        assert reply["type"] == "video.start", reply
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------- 8. smaller fixes


async def test_a_client_that_stops_reading_is_named_for_it() -> None:
    ws = ScriptedSocket()
    session, _ = make_session(ws, stall_timeout=0.3)
    ws.hold = lambda m: isinstance(m, bytes)
    ws.feed({**START, "num_frames": 40})
    with trio.fail_after(10):
        summary = await session.run()
    assert summary.outcome is Outcome.STALLED
    assert summary.error_code == "stall_timeout"
    assert summary.error_message == "Stall timeout: the client stopped reading"
    assert ws.close_calls == 0  # a half-written frame is not followed by a close frame


async def test_an_encoder_that_fails_to_finish_fails_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_close(self: FragmentedMP4Encoder) -> bytes:
        raise EncodingError("muxer lost its trailer")

    monkeypatch.setattr(FragmentedMP4Encoder, "close", broken_close)
    ws = ScriptedSocket()
    session, _ = make_session(ws)
    ws.feed({**START, "num_frames": 8})
    summary = await session.run()
    assert summary.outcome is Outcome.FAILED
    assert summary.error_code == "encoding_failed"
    assert ws.sent[-1]["type"] == "error" and ws.sent[-1]["code"] == "encoding_failed"
    assert "session.done" not in ws.types


async def test_a_stop_drops_the_chunk_being_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop does not wait for a whole chunk's encode whose bytes it will not send: the
    encoder gives up between frames (the published stop -> done bound needs it on a
    small CPU, where a 832x480 chunk takes tens of milliseconds to encode)."""
    real_encode = FragmentedMP4Encoder.encode
    encodes = 0
    in_second_encode = threading.Event()
    go_on = threading.Event()

    def gated_encode(
        self: FragmentedMP4Encoder, frames: Any, *, abandon: Callable[[], bool] | None = None
    ) -> bytes:
        nonlocal encodes
        encodes += 1
        if encodes != 2 or abandon is None:
            return real_encode(self, frames, abandon=abandon)
        asked = False

        def ask() -> bool:
            nonlocal asked
            if not asked:  # hold the first frame until the test has stopped the session
                asked = True
                in_second_encode.set()
                go_on.wait(10)
            return abandon()

        return real_encode(self, frames, abandon=ask)

    monkeypatch.setattr(FragmentedMP4Encoder, "encode", gated_encode)
    ws = ScriptedSocket()
    session, _ = make_session(ws)
    ws.feed({**START, "num_frames": 40})
    async with session_in_background(session) as summaries:
        await trio.to_thread.run_sync(in_second_encode.wait, 10)
        session.stop()
        go_on.set()
    assert summaries[0].outcome is Outcome.STOPPED
    kinds = [m["kind"] for m in ws.sent if isinstance(m, dict) and "kind" in m]
    assert kinds == ["media"]  # the chunk whose encode was under way never went out
    assert ws.sent[-1]["type"] == "session.done" and ws.sent[-1]["stopped"] is True
    assert ws.sent[-1]["chunks"] == 1
