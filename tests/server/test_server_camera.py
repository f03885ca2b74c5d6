"""Camera interactions end to end (issue 15): refused by engines that take none, handed
typed to engines that declare them, and listed in /v1/models."""

from __future__ import annotations

import json
from typing import Any

import attrs

from tests.conftest import Transcript, is_type, receive_into, receive_until
from tests.instrumented import InstrumentedEngine, InstrumentedStream
from trio_vstream.engines.contract import GenerationRequest, PromptChange
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings
from trio_vstream.values import Camera

START = {"type": "session.start", "prompt": "a red circle", "size": "64x48", "fps": 8}
CAMERA = {"mode": "velocity", "data": {"translation": [0, 0, 1], "rotation": [0, 0, 0, 1]}}


def interaction(event_id: str, **event: Any) -> str:
    return json.dumps(
        {"type": "session.interaction", "interaction": {"event_id": event_id, "event": event}}
    )


class CameraStream(InstrumentedStream):
    """Records every change; the synthetic colour needs a prompt, so a camera-only change
    goes on with the session's prompt (its event id still shows in chunk metadata)."""

    def interact(self, change: PromptChange) -> None:
        self.changes.append(change)
        self._inner.interact(attrs.evolve(change, prompt=change.prompt or self.request.prompt))


class CameraEngine(InstrumentedEngine):
    interaction_kinds = frozenset({"prompt", "camera"})

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = CameraStream(self, SyntheticEngine.open_stream(self, request))
        self.streams.append(stream)
        return stream


async def test_a_camera_to_a_prompt_only_engine_fails_and_keeps_the_event_id(
    start_server: Any,
) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.03, chunk_frames=2, steps=2))
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 16}))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(interaction("e1", multi_modal_data={"camera": CAMERA}))
        await receive_until(ws, transcript, is_type("error"))
        # The refused id is not used up: the same id with a prompt is queued.
        await ws.send_message(interaction("e1", prompt="a blue square"))
        await receive_until(ws, transcript, is_type("session.interaction.queued"))
        await receive_into(ws, transcript)
    (error,) = transcript.of_type("error")
    assert error == {
        "type": "error",
        "message": "this engine takes no camera interactions (it takes: prompt)",
        "code": "interaction_failed",
        "event_id": "e1",
        "request_id": transcript.messages[0]["request_id"],
    }
    assert [q["event_id"] for q in transcript.of_type("session.interaction.queued")] == ["e1"]
    assert transcript.terminal[-1]["type"] == "session.done"
    assert transcript.terminal[-1]["stopped"] is False
    assert [c.prompt for c in running.engine.streams[0].changes] == ["a blue square"]


async def test_a_prompt_with_a_camera_is_refused_whole_by_a_prompt_only_engine(
    start_server: Any,
) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.03, chunk_frames=2, steps=2))
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 8}))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(interaction("e1", prompt="blue", multi_modal_data={"camera": CAMERA}))
        await receive_into(ws, transcript)
    assert [e["code"] for e in transcript.of_type("error")] == ["interaction_failed"]
    assert transcript.of_type("session.interaction.queued") == []
    assert running.engine.streams[0].changes == []


async def test_an_engine_that_takes_cameras_gets_a_typed_camera(start_server: Any) -> None:
    running = await start_server(
        SyntheticSettings(step_delay=0.03, chunk_frames=2, steps=2), engine_class=CameraEngine
    )
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 16}))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(interaction("cam", multi_modal_data={"camera": CAMERA}))
        await receive_until(ws, transcript, is_type("session.interaction.queued"))
        await receive_into(ws, transcript)
    assert transcript.of_type("error") == []
    assert [q["event_id"] for q in transcript.of_type("session.interaction.queued")] == ["cam"]
    (change,) = running.engine.streams[0].changes
    assert change == PromptChange(
        "cam", None, None, Camera("velocity", (0.0, 0.0, 1.0), (0.0, 0.0, 0.0, 1.0))
    )
    assert change.kinds == frozenset({"camera"})
    assert transcript.terminal[-1]["type"] == "session.done"
    started = [
        m for m in transcript.of_type("video.chunk_metadata") if "cam" in m["started_event_ids"]
    ]
    assert len(started) == 1
