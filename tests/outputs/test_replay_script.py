"""``extra_params.interaction_script`` (this project's extension, what replays use): each
entry reaches the engine right before its chunk, in order, before a camera script's;
a bad entry is named by its path; its ids are reserved like a camera script's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import Transcript, is_type, receive_into, receive_until
from tests.server.test_server_camera_script import SETTINGS, ScriptEngine
from trio_vstream import protocol
from trio_vstream.values import Camera

START = {"type": "session.start", "prompt": "a red circle", "size": "64x48", "fps": 8}
CAMERA = {"mode": "velocity", "data": {"translation": [0.05, 0, 0], "rotation": [0, 0, 0, 1]}}


def entry(chunk: Any, event_id: str | None = "e1", **event: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"event": event or {"prompt": "a blue circle"}}
    if event_id is not None:
        body["event_id"] = event_id
    return {"chunk_index": chunk, "interaction": body}


def start(script: Any, **extra: Any) -> str:
    fields = {**START, "num_frames": 10, "extra_params": {"interaction_script": script, **extra}}
    return json.dumps(fields)


def test_a_script_parses_into_entries_in_chunk_order() -> None:
    parsed = protocol.parse_start(
        start(
            [
                entry(3, "late"),
                entry(1, "cam", multi_modal_data={"camera": CAMERA}),
                {
                    "chunk_index": 1,
                    "interaction": {**entry(1, "p")["interaction"], "transition_chunks": 0},
                },
            ]
        )
    )
    assert parsed.interaction_script == (
        protocol.ScriptedInteraction(
            1, "cam", None, None, Camera("velocity", (0.05, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))
        ),
        protocol.ScriptedInteraction(1, "p", "a blue circle", 0, None),
        protocol.ScriptedInteraction(3, "late", "a blue circle", None, None),
    )


W = "extra_params.interaction_script"


@pytest.mark.parametrize(
    ("script", "problem"),
    [
        ([], f"{W} must be a non-empty array of entries, got an empty array"),
        ({}, f"{W} must be a non-empty array of entries, got an object"),
        ([entry(0), 7], f"{W}[1] must be an object with chunk_index and interaction"),
        ([{**entry(0), "at": 1}], f"{W}[0] has unknown field 'at'"),
        ([{"chunk_index": 0}], f"{W}[0] has no interaction"),
        ([entry("2")], f'{W}[0].chunk_index must be an integer >= 0, got "2"'),
        ([entry(-1)], f"{W}[0].chunk_index must be an integer >= 0, got -1"),
        ([entry(10)], f"{W}[0].chunk_index is 10, but the video has only 10 frames"),
        ([entry(0, None)], f"{W}[0].interaction must have an event_id"),
        (
            [entry(0, prompt="")],
            f"{W}[0].interaction: session.interaction requires a non-empty event.prompt",
        ),
        (
            [entry(0, "script-0")],
            f'{W}[0].interaction.event_id "script-0": ids script-<n> are reserved for '
            "extra_params.camera_action_script",
        ),
        (
            [entry(0), entry(1)],
            f'{W}[1].interaction.event_id "e1" is already used by {W}[0]',
        ),
    ],
)
def test_every_bad_entry_is_named_by_its_path(script: Any, problem: str) -> None:
    with pytest.raises(protocol.ProtocolError) as caught:
        protocol.parse_start(start(script))
    assert caught.value.code == protocol.ErrorCode.INVALID_REQUEST
    assert problem in caught.value.message


def test_all_bad_entries_are_named_at_once() -> None:
    with pytest.raises(protocol.ProtocolError) as caught:
        protocol.parse_start(start([entry(-1), entry(0, None), entry(1, "ok")]))
    message = caught.value.message
    assert "interaction_script[0].chunk_index" in message
    assert "interaction_script[1].interaction must have an event_id" in message


def test_a_camera_entry_is_refused_when_a_camera_script_owns_the_camera() -> None:
    with pytest.raises(protocol.ProtocolError) as caught:
        protocol.parse_start(
            start(
                [entry(0, "c", multi_modal_data={"camera": CAMERA})],
                camera_action_script=[[["w"], [], []]],
            )
        )
    assert (
        "extra_params.interaction_script[0].interaction has a camera, but this session's "
        "camera follows extra_params.camera_action_script"
    ) in caught.value.message


async def test_each_entry_reaches_the_engine_before_its_chunk(start_server: Any) -> None:
    running = await start_server(SETTINGS, engine_class=ScriptEngine)
    script = [
        entry(2, "blue"),
        entry(1, "yellow", prompt="a yellow circle"),
        entry(3, "green", prompt="a green circle"),
    ]
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(start(script, camera_action_script=[[[], [], []]] * 2, knob=1))
        await receive_until(ws, transcript, is_type("video.start"))
        # A live interaction may not take a scripted id.
        await ws.send_message(
            json.dumps(
                {"type": "session.interaction", "interaction": entry(0, "blue")["interaction"]}
            )
        )
        await receive_into(ws, transcript)
    assert transcript.terminal[-1]["type"] == "session.done"
    [conflict] = transcript.of_type("error")
    assert (conflict["code"], conflict["event_id"]) == ("event_id_conflict", "blue")
    stream = running.engine.streams[0]
    # A camera script's entry comes after the interactions of the same chunk.
    assert [(chunk, change.event_id) for chunk, change in stream.arrivals] == [
        (0, "script-0"),
        (1, "yellow"),
        (1, "script-1"),
        (2, "blue"),
        (3, "green"),
    ]
    started = {
        m["generation_chunk_index"]: m["started_event_ids"]
        for m in transcript.of_type("video.chunk_metadata")
        if m["kind"] == "media"
    }
    assert started[1] == ["yellow", "script-1"]
    assert started[2] == ["blue"] and started[3] == ["green"]
    assert transcript.of_type("session.interaction.queued") == []  # server-fed
    assert stream.request.extra_params == {"knob": 1}  # the engine never sees the script


async def test_an_engine_without_cameras_refuses_a_script_with_one(start_server: Any) -> None:
    running = await start_server(SETTINGS)
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(start([entry(1, "cam", multi_modal_data={"camera": CAMERA})]))
        await receive_into(ws, transcript)
    [error] = transcript.messages
    assert error["code"] == "invalid_request"
    assert error["message"] == (
        "Invalid session.start: extra_params.interaction_script: this engine takes no camera "
        "interactions (it takes: prompt)"
    )
