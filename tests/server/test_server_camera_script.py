"""``extra_params.camera_action_script`` end to end (issue 15): each scripted camera reaches
the engine at its chunk's boundary, under a server id; an engine without cameras refuses
the start; the engine never sees the script itself."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import Transcript, is_type, receive_into, receive_until
from tests.instrumented import InstrumentedStream
from tests.server.test_server_camera import CameraEngine, CameraStream, interaction
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest, PromptChange
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings
from trio_vstream.protocol import key_velocity
from trio_vstream.values import Camera

START = {"type": "session.start", "prompt": "a red circle", "size": "64x48", "fps": 8}
#: vllm-omni's recipe example: forward for a chunk, a left pulse, then still.
SCRIPT = [[["w"], ["w"], ["w"]], [["a"], [], []], [[], [], []]]
STILL = Camera("velocity", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))
SETTINGS = SyntheticSettings(step_delay=0.01, chunk_frames=2, steps=2)


class ChunkCountingStream(CameraStream):
    """Notes, for every change, how many chunks the engine had made when it arrived: the
    chunk it applies to (changes are taken at the next chunk's start)."""

    def __init__(self, engine: Any, inner: Any) -> None:
        super().__init__(engine, inner)
        self.made = 0
        self.arrivals: list[tuple[int, PromptChange]] = []

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        chunk = super().next_chunk(checkpoint)
        if chunk is not None:
            self.made += 1
        return chunk

    def interact(self, change: PromptChange) -> None:
        self.arrivals.append((self.made, change))
        super().interact(change)


class ScriptEngine(CameraEngine):
    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = ChunkCountingStream(self, SyntheticEngine.open_stream(self, request))
        self.streams.append(stream)
        return stream


def start_with(script: Any, **fields: Any) -> str:
    extra = {"camera_action_script": script, "knob": 1}
    return json.dumps({**START, **fields, "extra_params": extra})


async def test_each_scripted_camera_reaches_the_engine_before_its_chunk(
    start_server: Any,
) -> None:
    running = await start_server(SETTINGS, engine_class=ScriptEngine)
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(start_with(SCRIPT, num_frames=10))  # five chunks
        await receive_into(ws, transcript)
    assert transcript.of_type("error") == []
    assert transcript.terminal[-1]["type"] == "session.done"
    stream = running.engine.streams[0]
    assert [(chunk, change.event_id) for chunk, change in stream.arrivals] == [
        (0, "script-0"),
        (1, "script-1"),
        (2, "script-2"),
    ]
    changes = [change for _, change in stream.arrivals]
    assert changes == [
        PromptChange("script-0", None, 0, key_velocity([{"w"}] * 3)),
        PromptChange("script-1", None, 0, key_velocity([{"a"}, set(), set()])),
        PromptChange("script-2", None, 0, STILL),
    ]
    # The chunk metadata says so too: each id starts in its own chunk.
    started = {
        m["generation_chunk_index"]: m["started_event_ids"]
        for m in transcript.of_type("video.chunk_metadata")
        if m["kind"] == "media"
    }
    assert started == {0: ["script-0"], 1: ["script-1"], 2: ["script-2"], 3: [], 4: []}
    # Server-fed: no acknowledgement is sent for them.
    assert transcript.of_type("session.interaction.queued") == []
    # The engine never sees the script; its other extra params it does.
    assert stream.request.extra_params == {"knob": 1}
    # video.start echoes the request as sent.
    config = transcript.of_type("video.start")[0]["config"]
    assert config["extra_params"]["camera_action_script"] == SCRIPT


async def test_a_script_that_ends_moving_is_followed_by_a_still_camera(
    start_server: Any,
) -> None:
    running = await start_server(SETTINGS, engine_class=ScriptEngine)
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(start_with([[["d"], ["d"], ["d"]]], num_frames=6))
        await receive_into(ws, transcript)
    assert transcript.terminal[-1]["type"] == "session.done"
    arrivals = running.engine.streams[0].arrivals
    assert [(chunk, change.event_id, change.camera) for chunk, change in arrivals] == [
        (0, "script-0", key_velocity([{"d"}] * 3)),
        (1, "script-1", STILL),
    ]


async def test_entries_after_the_last_chunk_are_never_applied(start_server: Any) -> None:
    running = await start_server(SETTINGS, engine_class=ScriptEngine)
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(start_with([[["w"], [], []]] * 4, num_frames=4))  # two chunks
        await receive_into(ws, transcript)
    assert transcript.terminal[-1]["type"] == "session.done"
    started = [
        m["started_event_ids"]
        for m in transcript.of_type("video.chunk_metadata")
        if m["kind"] == "media"
    ]
    assert started == [["script-0"], ["script-1"]]
    # The session cannot know a chunk is the last before the engine says so: the next
    # entry may be queued, but it starts no chunk, and none after it is even offered.
    arrivals = running.engine.streams[0].arrivals
    assert [(chunk, change.event_id) for chunk, change in arrivals] == [
        (0, "script-0"),
        (1, "script-1"),
        (2, "script-2"),
    ]


async def test_a_prompt_only_engine_refuses_a_start_with_a_script(start_server: Any) -> None:
    running = await start_server(SETTINGS)
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(start_with(SCRIPT))
        await receive_into(ws, transcript)
    assert transcript.messages == [
        {
            "type": "error",
            "message": "Invalid session.start: extra_params.camera_action_script: this engine "
            "takes no camera interactions (it takes: prompt)",
            "code": "invalid_request",
            "request_id": transcript.messages[0]["request_id"],
        }
    ]
    assert running.engine.streams == []  # refused before the engine was asked


async def test_script_event_ids_are_reserved_for_the_server(start_server: Any) -> None:
    running = await start_server(
        SyntheticSettings(step_delay=0.03, chunk_frames=2, steps=2), engine_class=ScriptEngine
    )
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(start_with([[[], [], []]] * 8, num_frames=16))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(interaction("script-7", prompt="a blue square"))
        await receive_until(ws, transcript, is_type("error"))
        await ws.send_message(interaction("mine", prompt="a blue square"))
        await receive_until(ws, transcript, is_type("session.interaction.queued"))
        await receive_into(ws, transcript)
    (error,) = transcript.of_type("error")
    assert (error["code"], error["event_id"]) == ("event_id_conflict", "script-7")
    assert transcript.terminal[-1]["type"] == "session.done"
    ids = [change.event_id for _, change in running.engine.streams[0].arrivals]
    assert ids.count("script-7") == 1  # the server's own, at chunk 7
    assert "mine" in ids


async def test_a_scripted_session_refuses_live_cameras_but_takes_prompts(
    start_server: Any,
) -> None:
    """As in vllm-omni, the script owns the camera: a live one would be overridden at the
    next scripted chunk, so it is refused by name; a prompt still goes through."""
    running = await start_server(
        SyntheticSettings(step_delay=0.03, chunk_frames=2, steps=2), engine_class=ScriptEngine
    )
    transcript = Transcript()
    camera = {"mode": "velocity", "data": {"translation": [1, 0, 0], "rotation": [0, 0, 0, 1]}}
    async with running.connect() as ws:
        await ws.send_message(start_with([[[], [], []]] * 8, num_frames=16))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(interaction("cam", multi_modal_data={"camera": camera}))
        await receive_until(ws, transcript, is_type("error"))
        await ws.send_message(interaction("text", prompt="a blue square"))
        await receive_until(ws, transcript, is_type("session.interaction.queued"))
        await receive_into(ws, transcript)
    (error,) = transcript.of_type("error")
    assert (error["code"], error["event_id"]) == ("interaction_failed", "cam")
    assert error["message"] == "this session's camera follows its extra_params.camera_action_script"
    ids = [change.event_id for _, change in running.engine.streams[0].arrivals]
    assert "cam" not in ids and "text" in ids
