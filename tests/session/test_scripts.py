"""`Scripts`, without a server: which change goes before which chunk, in what order, under
which ids, and what an engine that cannot take them says."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trio_vstream import protocol
from trio_vstream.session.scripts import ScriptRefused, Scripts, kinds_refusal

CAMERA = {"mode": "velocity", "data": {"translation": [0.05, 0, 0], "rotation": [0, 0, 0, 1]}}
BOTH = frozenset({"prompt", "camera"})


def start(**extra: Any) -> protocol.SessionStart:
    message = {"type": "session.start", "prompt": "a red circle", "num_frames": 64}
    return protocol.parse_start(json.dumps({**message, "extra_params": extra}))


def test_each_change_goes_before_its_chunk_once_interactions_before_cameras() -> None:
    scripts = Scripts.from_start(
        start(
            interaction_script=[
                {"chunk_index": 1, "interaction": {"event_id": "blue", "event": {"prompt": "b"}}}
            ],
            camera_action_script=[[["w"], ["w"], ["w"]], [["d"], [], []]],
        ),
        BOTH,
    )
    assert scripts.before_chunk(0)[0].event_id == "script-0"
    assert [c.event_id for c in scripts.before_chunk(1)] == ["blue", "script-1"]
    assert scripts.before_chunk(1) == []  # handed over once
    assert scripts.event_ids == {"blue", "script-0", "script-1", "script-2"}  # 2: still
    assert scripts.owns_camera


def test_no_scripts_reserve_nothing_and_own_no_camera() -> None:
    scripts = Scripts.from_start(start(), frozenset({"prompt"}))
    assert scripts.event_ids == set() and not scripts.owns_camera
    assert Scripts().before_chunk(0) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"camera_action_script": [[["w"], [], []]]},
            "extra_params.camera_action_script: this engine takes no camera interactions "
            "(it takes: prompt)",
        ),
        (
            {
                "interaction_script": [
                    {
                        "chunk_index": 2,
                        "interaction": {
                            "event_id": "c",
                            "event": {"multi_modal_data": {"camera": CAMERA}},
                        },
                    }
                ]
            },
            "extra_params.interaction_script: this engine takes no camera interactions "
            "(it takes: prompt)",
        ),
    ],
)
def test_an_engine_that_cannot_take_a_script_refuses_it_by_name(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ScriptRefused) as refused:
        Scripts.from_start(start(**extra), frozenset({"prompt"}))
    assert str(refused.value) == message


def test_kinds_refusal_names_what_is_missing_and_what_is_taken() -> None:
    assert kinds_refusal({"prompt"}, BOTH) is None
    assert kinds_refusal({"camera", "prompt"}, frozenset()) == (
        "this engine takes no camera or prompt interactions (it takes: none)"
    )
