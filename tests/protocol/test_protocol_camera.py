"""Camera interactions (issue 15): ``event.multi_modal_data.camera`` in ``session.interaction``.

No sockets, no Trio: every validation rule, each named in its error, and the wire text.
"""

import json
import math
from typing import Any

import pytest

from trio_vstream.protocol import (
    Camera,
    ErrorCode,
    Interaction,
    ProtocolError,
    interaction_message,
    parse_control,
)

STILL = {"mode": "velocity", "data": {"translation": [0, 0, 1], "rotation": [0, 0, 0, 1]}}
PATH = "session.interaction event.multi_modal_data"


def interaction(event: Any, event_id: str = "e1") -> str:
    return json.dumps(
        {"type": "session.interaction", "interaction": {"event_id": event_id, "event": event}}
    )


def with_camera(camera: Any, **event: Any) -> str:
    return interaction({**event, "multi_modal_data": {"camera": camera}})


def camera_error(raw: str) -> str:
    with pytest.raises(ProtocolError) as info:
        parse_control(raw)
    assert info.value.code == ErrorCode.INVALID_MESSAGE
    assert info.value.event_id == "e1"
    return info.value.message


def test_a_camera_only_interaction_parses_to_a_typed_camera() -> None:
    message = parse_control(with_camera(STILL))
    assert message == Interaction(
        "e1", None, None, Camera("velocity", (0.0, 0.0, 1.0), (0.0, 0.0, 0.0, 1.0))
    )
    assert isinstance(message, Interaction)
    assert all(isinstance(x, float) for x in message.camera.translation)  # type: ignore[union-attr]


def test_prompt_and_camera_together_and_the_target_mode() -> None:
    camera = {"mode": "target", "data": {"translation": [1.5, -2, 0], "rotation": [0, 1, 0, 0]}}
    message = parse_control(with_camera(camera, prompt="a forest"))
    assert message == Interaction(
        "e1", "a forest", None, Camera("target", (1.5, -2.0, 0.0), (0.0, 1.0, 0.0, 0.0))
    )


def test_a_rotation_within_the_tolerance_passes() -> None:
    half = math.sqrt(0.5)
    data = {"translation": [0, 0, 0], "rotation": [0, round(half, 4), 0, round(half, 4)]}
    assert isinstance(parse_control(with_camera({"mode": "velocity", "data": data})), Interaction)


@pytest.mark.parametrize(
    "event",
    [
        {},
        {"multi_modal_data": None},
        {"multi_modal_data": {}},
        {"multi_modal_data": {"camera": None}},
    ],
)
def test_neither_prompt_nor_camera_keeps_the_old_error(event: dict[str, Any]) -> None:
    assert camera_error(interaction(event)) == (
        "session.interaction requires a non-empty event.prompt"
    )


def test_an_empty_prompt_is_refused_even_with_a_camera() -> None:
    assert camera_error(with_camera(STILL, prompt="  ")) == (
        "session.interaction requires a non-empty event.prompt"
    )


@pytest.mark.parametrize(
    ("mmd", "message"),
    [
        ([], f"{PATH} must be an object, got an array"),
        ({"camera": STILL, "audio": 1}, f"{PATH}: unknown key 'audio'"),
        ({"camera": 3}, f"{PATH}.camera must be an object, got 3"),
        ({"camera": {**STILL, "fov": 60}}, f"{PATH}.camera: unknown key 'fov'"),
        (
            {"camera": {**STILL, "data": {**STILL["data"], "scale": 1}}},  # type: ignore[dict-item]
            f"{PATH}.camera.data: unknown key 'scale'",
        ),
        ({"camera": {"mode": "velocity"}}, f"{PATH}.camera.data must be an object, got null"),
    ],
)
def test_multi_modal_data_shape_is_strict(mmd: Any, message: str) -> None:
    assert camera_error(interaction({"prompt": "p", "multi_modal_data": mmd})) == message


@pytest.mark.parametrize("mode", ["fly", "", None, 1, "Velocity"])
def test_mode_must_be_a_known_one(mode: Any) -> None:
    message = camera_error(with_camera({**STILL, "mode": mode}))
    assert message.startswith(f"{PATH}.camera.mode must be one of 'target', 'velocity', got ")


@pytest.mark.parametrize(
    "translation", [None, [0, 0], [0, 0, 0, 0], [0, 0, True], [0, "1", 0], [0, 0, 10**400], {}]
)
def test_translation_is_three_finite_numbers(translation: Any) -> None:
    camera = {"mode": "velocity", "data": {"translation": translation, "rotation": [0, 0, 0, 1]}}
    message = camera_error(with_camera(camera))
    assert message.startswith(f"{PATH}.camera.data.translation must be an array of 3 finite")


@pytest.mark.parametrize(
    "rotation", [None, [0, 0, 1], [0, 0, 0, 1, 0], [0, 0, 0, False], [0, 0, 0, [1]]]
)
def test_rotation_is_four_finite_numbers(rotation: Any) -> None:
    camera = {"mode": "velocity", "data": {"translation": [0, 0, 0], "rotation": rotation}}
    message = camera_error(with_camera(camera))
    assert message.startswith(f"{PATH}.camera.data.rotation must be an array of 4 finite")


@pytest.mark.parametrize(
    ("rotation", "norm"), [([0, 0, 0, 0], "0"), ([0, 0, 0, 2], "2"), ([0, 0, 0, 1.002], "1.002")]
)
def test_rotation_is_a_unit_quaternion(rotation: list[float], norm: str) -> None:
    camera = {"mode": "velocity", "data": {"translation": [0, 0, 0], "rotation": rotation}}
    assert camera_error(with_camera(camera)) == (
        f"{PATH}.camera.data.rotation must be a unit quaternion (norm 1 within 0.001), "
        f"got norm {norm}"
    )


def test_camera_wire_text_is_exact_and_round_trips() -> None:
    camera = Camera("velocity", (0.0, 0.0, 1.0), (0.0, 0.0, 0.0, 1.0))
    raw = interaction_message(None, event_id="e1", transition_chunks=0, camera=camera)
    assert raw == (
        '{"type":"session.interaction","interaction":{"event_id":"e1","event":'
        '{"multi_modal_data":{"camera":{"mode":"velocity","data":{"translation":[0.0,0.0,1.0],'
        '"rotation":[0.0,0.0,0.0,1.0]}}}},"transition_chunks":0}}'
    )
    assert parse_control(raw) == Interaction("e1", None, 0, camera)
    both = Interaction("e2", "a dog", None, camera)
    assert both.to_json() == (
        '{"type":"session.interaction","interaction":{"event_id":"e2","event":'
        '{"prompt":"a dog","multi_modal_data":{"camera":{"mode":"velocity","data":'
        '{"translation":[0.0,0.0,1.0],"rotation":[0.0,0.0,0.0,1.0]}}}}}}'
    )
    assert parse_control(both.to_json()) == both


def test_prompt_only_wire_text_is_unchanged() -> None:
    assert interaction_message("a dog", event_id="e1") == (
        '{"type":"session.interaction","interaction":{"event_id":"e1","event":{"prompt":"a dog"}}}'
    )


# ------------------------------------------------------ the client's side: ClientProtocol


def streaming_client() -> Any:
    from trio_vstream.protocol import ClientProtocol

    machine = ClientProtocol()
    machine.start(prompt="a road")
    machine.receive('{"type":"video.start","request_id":"r","format":"m4s","config":{}}')
    return machine


def test_client_protocol_sends_a_camera_with_or_without_a_prompt() -> None:
    machine = streaming_client()
    camera = Camera("velocity", (0.0, 0.0, 0.05), (0.0, 0.0, 0.0, 1.0))
    alone = machine.interact(camera=camera, event_id="c1")
    data = {"translation": [0.0, 0.0, 0.05], "rotation": [0.0, 0.0, 0.0, 1.0]}
    event = {"multi_modal_data": {"camera": {"mode": "velocity", "data": data}}}
    assert json.loads(alone) == {
        "type": "session.interaction",
        "interaction": {"event_id": "c1", "event": event},
    }
    assert parse_control(alone) == Interaction("c1", None, None, camera)
    both = machine.interact("a forest", transition_chunks=2, camera=camera)
    assert parse_control(both) == Interaction(None, "a forest", 2, camera)
    # Prompt-only interactions are byte for byte what they were.
    assert machine.interact("a dog", event_id="e1") == interaction_message("a dog", "e1")


def test_client_protocol_refuses_an_interaction_with_neither() -> None:
    machine = streaming_client()
    with pytest.raises(ValueError, match="a prompt, a camera, or both"):
        machine.interact()
    with pytest.raises(ValueError, match="a prompt, a camera, or both"):
        machine.interact(None, event_id="e1", transition_chunks=1)
