"""What clients and viewers are told of an engine's exception (issue 20, item 8).

An exception a library raises inside the engine may name server paths and internals:
the client and the session's viewers get a coded ``generation_failed`` naming the
request instead, and the text and its traceback go to the server log. Messages engines
write for clients (``EngineError``) are still shown as they are.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import trio

from tests.conftest import Transcript, is_type, receive_into, receive_until
from tests.instrumented import InstrumentedEngine, InstrumentedStream
from tests.outputs.test_watch import watch
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest
from trio_vstream.engines.synthetic import SyntheticSettings

SECRET = "/secret/path/model.bin missing"
START = {"type": "session.start", "prompt": "p", "size": "32x32", "num_frames": 16}
SETTINGS = SyntheticSettings(chunk_frames=4)


class LeakyEngine(InstrumentedEngine):
    """Fails its second chunk with a library's exception naming a server path, once
    ``go`` is set (when a viewer is watching)."""

    def __init__(self, settings: SyntheticSettings) -> None:
        super().__init__(settings)
        self.go = threading.Event()

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        if request.prompt == "fail to open":
            raise RuntimeError(SECRET)
        stream = super().open_stream(request)
        next_chunk = stream.next_chunk
        made: list[Chunk | None] = []

        def leaky(checkpoint: Checkpoint) -> Chunk | None:
            if made:
                self.go.wait()
                raise RuntimeError(SECRET)
            made.append(next_chunk(checkpoint))
            return made[-1]

        stream.next_chunk = leaky  # type: ignore[method-assign]
        return stream


def everything(transcript: Transcript) -> str:
    return json.dumps(transcript.json)


@pytest.mark.slow
async def test_an_engine_exception_naming_a_path_reaches_no_client_and_no_viewer(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    running = await start_server(SETTINGS, engine_class=LeakyEngine)
    engine = running.engine
    owner, viewer = Transcript(), Transcript()
    try:
        async with running.connect() as ws:
            await ws.send_message(json.dumps(START))
            video_start = await receive_until(ws, owner, is_type("video.start"))
            async with watch(running, video_start["watch_path"]) as watching:
                await receive_until(watching, viewer, is_type("watch.start"))
                engine.go.set()
                await receive_into(ws, owner)
                await receive_into(watching, viewer)
    finally:
        engine.go.set()
    request_id = video_start["request_id"]
    expected = {
        "type": "error",
        "code": "generation_failed",
        "message": f"engine failed while generating (see the server log, request {request_id})",
        "request_id": request_id,
    }
    assert owner.terminal == [expected]
    assert viewer.terminal == [expected]
    for transcript in (owner, viewer):
        assert "/secret" not in everything(transcript)
    await running.wait_sessions_ended(1)
    assert "/secret" not in (running.summaries[0].error_message or "")
    assert SECRET in caplog.text  # the operator still has the whole story, traceback and all
    assert "RuntimeError" in caplog.text


async def test_an_engine_that_cannot_open_a_stream_says_nothing_of_its_paths(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    running = await start_server(SETTINGS, engine_class=LeakyEngine)
    transcript = await running.run_session({**START, "prompt": "fail to open"})
    (error,) = transcript.terminal
    assert error["code"] == "generation_failed"
    assert error["message"] == (
        f"engine failed while opening the stream (see the server log, request "
        f"{error['request_id']})"
    )
    assert "/secret" not in everything(transcript)
    assert SECRET in caplog.text


async def test_messages_engines_write_for_clients_are_still_shown(start_server: Any) -> None:
    running = await start_server(SETTINGS)
    with trio.fail_after(20):
        transcript = await running.run_session({**START, "extra_params": {"fail_at_chunk": 0}})
    assert [(m["code"], m["message"]) for m in transcript.terminal] == [
        ("generation_failed", "synthetic engine failure at chunk 0 (fail_at_chunk)")
    ]
    refused = await running.run_session({**START, "extra_params": {"fail_at_chunk": -1}})
    assert [(m["code"], m["message"]) for m in refused.terminal] == [
        (
            "invalid_request",
            "Invalid session.start: extra_params.fail_at_chunk must be an integer >= 0, got -1",
        )
    ]
