"""`generation_request` and `config_echo`, without a session: what the engine is asked
for a valid ``session.start``, and what ``video.start`` echoes back."""

from __future__ import annotations

import json
from typing import Any

import attrs
import numpy as np
import pytest

from trio_vstream import protocol
from trio_vstream.engines.contract import GenerationRequest, SamplingSettings, VideoInput
from trio_vstream.session.request import (
    SERVER_PARAMS,
    config_echo,
    engine_extra_params,
    generation_request,
)
from trio_vstream.values import VideoDefaults

# Every setting a client may give the engine, none at its default.
EVERYTHING = {
    "type": "session.start",
    "prompt": "a red circle",
    "negative_prompt": "blur",
    "size": "64x48",
    "fps": 12,
    "num_frames": 36,
    "num_inference_steps": 7,
    "guidance_scale": 4.5,
    "guidance_scale_2": 3.0,
    "true_cfg_scale": 2.0,
    "boundary_ratio": 0.875,
    "flow_shift": 5.0,
    "seed": 1234,
    "quality": "high",
    "lora": {"name": "style", "path": "style"},
    "extra_params": {"strength": 0.5},
    "input_video": {"fps": 6, "v2v_strength": 0.25},
}


def start(message: dict[str, Any], **parse: Any) -> protocol.SessionStart:
    return protocol.parse_start(json.dumps(message), **parse)


def test_every_field_of_the_engines_request_comes_from_the_start() -> None:
    """A field added to `GenerationRequest` and forgotten here fails this test: no field
    is left at its default when the client gave everything."""
    image = np.zeros((48, 64, 3), np.uint8)
    request = generation_request(start(EVERYTHING), "video_stream-1", image)
    required = {
        field.name: getattr(request, field.name)
        for field in attrs.fields(GenerationRequest)
        if field.default is attrs.NOTHING
    }
    bare = GenerationRequest(**required)
    left_at_default = [
        field.name
        for field in attrs.fields(GenerationRequest)
        if field.name not in required
        and field.name != "image"  # compared by identity below
        and getattr(request, field.name) == getattr(bare, field.name)
    ]
    assert left_at_default == []
    assert request == GenerationRequest(
        request_id="video_stream-1",
        prompt="a red circle",
        width=64,
        height=48,
        fps=12,
        num_frames=36,
        negative_prompt="blur",
        num_inference_steps=7,
        guidance_scale=4.5,
        sampling=SamplingSettings(
            guidance_scale_2=3.0, true_cfg_scale=2.0, boundary_ratio=0.875, flow_shift=5.0
        ),
        seed=1234,
        quality="high",
        lora={"name": "style", "path": "style"},
        extra_params={"strength": 0.5},
        input_video=VideoInput(fps=6, strength=0.25),
    )
    assert request.image is image


def test_what_the_client_left_out_is_left_to_the_engine() -> None:
    defaults = VideoDefaults(width=80, height=40, fps=10, num_frames=20)
    request = generation_request(
        start({"type": "session.start", "prompt": "p"}, defaults=defaults), "r"
    )
    assert (request.width, request.height, request.fps, request.num_frames) == (80, 40, 10, 20)
    assert request.seed is None and request.num_inference_steps is None
    assert request.image is None and request.lora is None and request.extra_params == {}
    assert request.input_video is None


def test_the_engine_never_sees_the_parameters_the_server_applies() -> None:
    extra = {
        "video_codec_options": {"crf": "23"},
        "pace_to_media_time": True,
        "pacing_lead_seconds": 0.2,
        "pacing_max_lag_seconds": 1.0,
        "camera_action_script": [[["w"], ["w"], []]],
        "interaction_script": [
            {"chunk_index": 1, "interaction": {"event_id": "b", "event": {"prompt": "b"}}}
        ],
        "strength": 0.5,
    }
    valid = start({**EVERYTHING, "extra_params": extra})
    assert set(extra) - {"strength"} == SERVER_PARAMS
    assert engine_extra_params(valid) == {"strength": 0.5}
    assert generation_request(valid, "r").extra_params == {"strength": 0.5}
    assert valid.request.extra_params == extra  # the start itself is left as it was


@pytest.mark.parametrize(
    ("message", "engine_seed", "echoed"),
    [
        ({"type": "session.start", "prompt": "p"}, 77, 77),  # the engine's draw
        ({"type": "session.start", "prompt": "p", "seed": 5}, 77, 5),  # the client's
        ({"type": "session.start", "prompt": "p"}, None, None),  # no seed to tell
        ({"type": "session.start", "prompt": "p"}, True, None),  # a bool is no seed
        ({"type": "session.start", "prompt": "p"}, "77", None),  # nor is text
    ],
)
def test_video_start_echoes_the_seed_used(
    message: dict[str, Any], engine_seed: object, echoed: int | None
) -> None:
    valid = start(message)
    config = config_echo(valid, engine_seed)
    assert config.get("seed") == echoed
    assert {k: v for k, v in config.items() if k != "seed"} == {
        k: v for k, v in valid.config.items() if k != "seed"
    }
