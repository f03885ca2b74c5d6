"""``extra_params.camera_action_script`` (issue 15) and the WASD mapping behind it.

No sockets, no Trio: vllm-omni's script format in, one typed camera per chunk out, and
every malformed entry refused by its path.
"""

import json
import math
from typing import Any

import pytest

from trio_vstream.protocol import (
    CAMERA_KEYS,
    Camera,
    ErrorCode,
    ProtocolError,
    ScriptedCamera,
    interaction_message,
    key_velocity,
    parse_control,
    parse_start,
)

WHERE = "extra_params.camera_action_script"
STILL = Camera("velocity", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))
FORWARD = Camera("velocity", (0.0, 0.0, 0.05), (0.0, 0.0, 0.0, 1.0))


def start(script: Any, **fields: Any) -> str:
    extra = {"camera_action_script": script, **fields.pop("extra", {})}
    return json.dumps(
        {"type": "session.start", "prompt": "a road", **fields, "extra_params": extra}
    )


def refusal(script: Any, **fields: Any) -> str:
    with pytest.raises(ProtocolError) as info:
        parse_start(start(script, **fields))
    assert info.value.code == ErrorCode.INVALID_REQUEST
    assert info.value.message.startswith("Invalid session.start: ")
    return info.value.message.removeprefix("Invalid session.start: ")


def close(a: Camera, b: Camera) -> bool:
    pairs = [*zip(a.translation, b.translation, strict=True)]
    pairs += zip(a.rotation, b.rotation, strict=True)
    return a.mode == b.mode and all(math.isclose(x, y, abs_tol=1e-12) for x, y in pairs)


# ------------------------------------------------------------------ the key mapping


@pytest.mark.parametrize(
    ("keys", "translation"),
    [
        ({"w"}, (0.0, 0.0, 0.05)),
        ({"s"}, (0.0, 0.0, -0.05)),
        ({"d"}, (0.05, 0.0, 0.0)),
        ({"a"}, (-0.05, 0.0, 0.0)),
        ({"w", "d"}, (0.05, 0.0, 0.05)),
        ({"w", "s"}, (0.0, 0.0, 0.0)),  # opposite keys cancel
    ],
)
def test_movement_keys_are_steps_of_005(keys: set[str], translation: tuple[float, ...]) -> None:
    camera = key_velocity([keys])
    assert camera == Camera("velocity", translation, (0.0, 0.0, 0.0, 1.0))


def test_turn_keys_yaw_6_and_pitch_4_degrees() -> None:
    yaw = math.radians(6) / 2
    assert close(
        key_velocity([{"l"}]), Camera("velocity", (0, 0, 0), (0, math.sin(yaw), 0, math.cos(yaw)))
    )
    assert close(
        key_velocity([{"j"}]), Camera("velocity", (0, 0, 0), (0, -math.sin(yaw), 0, math.cos(yaw)))
    )
    pitch = math.radians(4) / 2
    assert close(
        key_velocity([{"i"}]),
        Camera("velocity", (0, 0, 0), (math.sin(pitch), 0, 0, math.cos(pitch))),
    )
    down = Camera("velocity", (0, 0, 0), (-math.sin(pitch), 0, 0, math.cos(pitch)))
    assert close(key_velocity([{"k"}]), down)


def test_yaw_and_pitch_compose_as_pitch_times_yaw_into_a_unit_quaternion() -> None:
    # vllm-omni's camera_utils: q = pitch * yaw (Hamilton product), yaw applied first.
    y, p = math.radians(6) / 2, math.radians(4) / 2
    sy, cy, sp, cp = math.sin(y), math.cos(y), math.sin(p), math.cos(p)
    expected = (sp * cy, cp * sy, sp * sy, cp * cy)
    camera = key_velocity([{"i", "l"}])
    assert close(camera, Camera("velocity", (0, 0, 0), expected))
    assert math.isclose(math.hypot(*camera.rotation), 1.0)
    # The server takes what the mapping makes.
    assert parse_control(interaction_message(None, "e", camera=camera)).camera == camera  # type: ignore[union-attr]


def test_several_frames_average_to_the_motion_per_step() -> None:
    assert close(key_velocity([{"w"}, {"w"}, {"w"}]), FORWARD)
    third = key_velocity([{"a"}, set(), set()])
    assert close(third, Camera("velocity", (-0.05 / 3, 0, 0), (0, 0, 0, 1)))
    assert key_velocity([set()]) == STILL
    with pytest.raises(ValueError, match="at least one frame"):
        key_velocity([])


# ------------------------------------------------------------------ good scripts


def test_no_script_is_an_empty_one() -> None:
    plain = json.dumps({"type": "session.start", "prompt": "a road"})
    assert parse_start(plain).camera_script == ()


def test_vllm_omnis_example_script_gives_one_camera_per_chunk() -> None:
    # The recipe's example, verbatim: forward, a left pulse, then still.
    script = [[["w"], ["w"], ["w"]], [["a"], [], []], [[], [], []]]
    parsed = parse_start(start(script)).camera_script
    assert [entry.chunk_index for entry in parsed] == [0, 1, 2]
    assert [entry.keys for entry in parsed] == [
        (("w",), ("w",), ("w",)),
        (("a",), (), ()),
        ((), (), ()),
    ]
    assert close(parsed[0].camera, FORWARD)
    assert close(parsed[1].camera, key_velocity([{"a"}, set(), set()]))
    assert parsed[2].camera == STILL


def test_keys_are_case_insensitive_deduplicated_and_ordered_like_vllm_omni() -> None:
    (entry, _still) = parse_start(start([[["L", "w", "W"], ["k"], []]])).camera_script
    assert entry.keys == (("w", "l"), ("k",), ())
    assert entry == ScriptedCamera(0, key_velocity([{"w", "l"}, {"k"}, set()]), entry.keys)


def test_a_script_that_ends_moving_gets_a_still_entry_after_it() -> None:
    # vllm-omni pads an exhausted script with neutral frames: the motion stops.
    parsed = parse_start(start([[["w"], ["w"], ["w"]]])).camera_script
    assert parsed == (
        ScriptedCamera(0, key_velocity([{"w"}] * 3), (("w",), ("w",), ("w",))),
        ScriptedCamera(1, STILL, ()),
    )
    # Opposite keys that cancel end still: nothing to pad.
    assert len(parse_start(start([[["w", "s"], [], []]])).camera_script) == 1


def test_the_script_stays_in_the_request_and_its_echo() -> None:
    script = [[["w"], [], []]]
    parsed = parse_start(start(script, extra={"knob": 1}))
    assert parsed.request.extra_params == {"camera_action_script": script, "knob": 1}
    assert parsed.config["extra_params"]["camera_action_script"] == script


def test_sampling_params_scripts_are_lifted_like_any_extra_param() -> None:
    message = {
        "type": "session.start",
        "prompt": "a road",
        "sampling_params": {"camera_action_script": [[["d"], ["d"], ["d"]]]},
    }
    assert len(parse_start(json.dumps(message)).camera_script) == 2


def test_all_keys_are_known() -> None:
    assert CAMERA_KEYS == ("w", "a", "s", "d", "i", "j", "k", "l")


# ------------------------------------------------------------------- bad scripts

KEYS = "'w', 'a', 's', 'd', 'i', 'j', 'k', 'l'"


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ([], f"{WHERE} must be a non-empty array with one entry per chunk, got an empty array"),
        (None, f"{WHERE} must be a non-empty array with one entry per chunk, got null"),
        ("wasd", f'{WHERE} must be a non-empty array with one entry per chunk, got "wasd"'),
        ({"0": []}, f"{WHERE} must be a non-empty array with one entry per chunk"),
        (
            [[["w"], ["w"]]],
            f"{WHERE}[0] must be an array of 3 per-latent-frame key lists (one LingBot block), "
            "got 2",
        ),
        ([[["w"], ["w"], ["w"], ["w"]]], f"{WHERE}[0] must be an array of 3 per-latent-frame"),
        (
            ["w"],
            f"{WHERE}[0] must be an array of 3 per-latent-frame key lists (one LingBot block), "
            'got "w"',
        ),
        ([[["w"], "w", []]], f'{WHERE}[0][1] must be an array of keys ({KEYS}), got "w"'),
        ([[["w"], [], ["x"]]], f'{WHERE}[0][2][0] must be one of {KEYS}, got "x"'),
        ([[["w"], [], ["w", 1]]], f"{WHERE}[0][2][1] must be one of {KEYS}, got 1"),
        ([[["w"], [], [None]]], f"{WHERE}[0][2][0] must be one of {KEYS}, got null"),
        ([[["up"], [], []]], f'{WHERE}[0][0][0] must be one of {KEYS}, got "up"'),
    ],
)
def test_every_malformed_script_is_refused_by_its_path(script: Any, message: str) -> None:
    assert refusal(script).startswith(message)


def test_every_bad_entry_is_named_not_only_the_first() -> None:
    script = [[[], [], []], [["x"], [], []], [[], [], []], [[], []]]
    assert refusal(script) == (
        f'{WHERE}[1][0][0] must be one of {KEYS}, got "x"; '
        f"{WHERE}[3] must be an array of 3 per-latent-frame key lists (one LingBot block), "
        "got 2"
    )


def test_a_long_list_of_bad_entries_is_cut_short() -> None:
    message = refusal([["bad"]] * 25)
    assert message.count(f"{WHERE}[") == 10
    assert message.endswith(f"{WHERE}: 15 more bad entries")


def test_a_script_longer_than_the_video_has_frames_is_refused() -> None:
    script = [[[], [], []]] * 5
    assert refusal(script, num_frames=4) == (
        f"{WHERE} has 5 entries (one per chunk) but the video has only 4 frames"
    )
    assert len(parse_start(start(script, num_frames=5)).camera_script) == 5


def test_script_problems_join_the_others() -> None:
    message = refusal([], extra={"pace_to_media_time": "yes"})
    assert "extra_params.pace_to_media_time must be a boolean" in message
    assert f"{WHERE} must be a non-empty array" in message
