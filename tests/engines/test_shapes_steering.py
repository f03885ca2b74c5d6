"""Steering the shapes world with camera velocities, and shorter chunks (issue 15).

Steering goes through the model's motion slot: a camera is checked to give the very
frames a prompt naming that motion gives, and the object is checked to move that way.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.engines.test_shapes_engine import frames_of, request, run
from trio_vstream.engines.contract import EngineError, InvalidRequestError, PromptChange
from trio_vstream.engines.shapes import ShapesEngine, camera_motion, create_engine
from trio_vstream.models.shapes import evaluate
from trio_vstream.values import Camera

IDENTITY = (0.0, 0.0, 0.0, 1.0)


@pytest.fixture(scope="module")
def engine() -> ShapesEngine:
    return create_engine(device="cpu")


def velocity(x: float = 0.0, y: float = 0.0, z: float = 0.0, rotation=IDENTITY) -> Camera:
    return Camera("velocity", (x, y, z), rotation)


def turn(axis: str, degrees: float) -> tuple[float, float, float, float]:
    half = math.radians(degrees) / 2
    s = math.sin(half)
    return (s if axis == "x" else 0.0, s if axis == "y" else 0.0, 0.0, math.cos(half))


@pytest.mark.parametrize(
    ("camera", "motion"),
    [
        (velocity(x=0.05), "right"),
        (velocity(x=-0.05), "left"),
        (velocity(y=0.05), "up"),
        (velocity(z=0.05), "up"),  # W: forward
        (velocity(z=-0.05), "down"),  # S: back
        (velocity(y=-0.05, x=0.01), "down"),  # the strongest axis wins
        (velocity(rotation=turn("y", 5)), "right"),  # turn right
        (velocity(rotation=turn("y", -5)), "left"),
        (velocity(rotation=turn("x", 5)), "up"),  # vllm-omni's sense: +X pitch looks up
        (velocity(rotation=turn("x", -5)), "down"),
        (velocity(), "still"),
    ],
)
def test_camera_velocities_map_to_motions(camera: Camera, motion: str) -> None:
    assert camera_motion(camera) == motion


def test_a_target_pose_is_refused_with_the_reason() -> None:
    with pytest.raises(EngineError, match=r"velocity only.*'target'"):
        camera_motion(Camera("target", (1.0, 0.0, 0.0), IDENTITY))


@pytest.mark.slow
def test_a_camera_steers_through_the_motion_slot_like_a_prompt_naming_the_motion(
    engine: ShapesEngine,
) -> None:
    prompt = "a red square moving right on a black background"
    req = request(prompt, num_frames=32, seed=7)
    steered = run(engine, req, {1: PromptChange("cam", None, camera=velocity(x=-0.05))})
    prompted = run(
        engine, req, {1: PromptChange("cam", prompt.replace("right", "left"), transition_chunks=0)}
    )
    np.testing.assert_array_equal(frames_of(steered), frames_of(prompted))
    assert steered[1].started_event_ids == ("cam",) and steered[1].completed_event_ids == ("cam",)
    frames = frames_of(steered)
    assert evaluate.analyse_clip(frames[:8]).motion == "right"
    assert evaluate.analyse_clip(frames[8:]).motion == "left"
    assert evaluate.analyse_clip(frames[8:]).colour == "red"  # the prompt is kept


def test_steering_holds_through_prompts_until_one_names_a_motion(engine: ShapesEngine) -> None:
    prompt = "a red square moving right on a black background"
    changes = {
        1: PromptChange("up", None, camera=velocity(y=0.05)),
        2: PromptChange("blue", "a blue square on a black background", transition_chunks=0),
        3: PromptChange("left", "a blue square moving left on a black background", 0),
    }
    frames = frames_of(run(engine, request(prompt, num_frames=32, seed=7), changes))
    motions = [evaluate.analyse_clip(frames[i : i + 8]).motion for i in range(0, 32, 8)]
    assert motions == ["right", "up", "up", "left"]
    assert evaluate.analyse_clip(frames[16:24]).colour == "blue"


def test_zero_velocity_stills_the_object(engine: ShapesEngine) -> None:
    prompt = "a red square moving down on a black background"
    chunks = run(
        engine, request(prompt, num_frames=24, seed=2), {1: PromptChange("s", None, 0, velocity())}
    )
    assert evaluate.analyse_clip(frames_of(chunks)[8:]).motion == "still"


def test_shorter_chunks_keep_the_models_first_frames(engine: ShapesEngine) -> None:
    whole = frames_of(run(engine, request(num_frames=8, seed=4)))
    short = run(engine, request(num_frames=8, seed=4, extra_params={"chunk_frames": 3}))
    assert [c.frames.shape[0] for c in short] == [3, 3, 2]
    np.testing.assert_array_equal(frames_of(short[:1]), whole[:3])
    assert evaluate.analyse_clip(frames_of(short)).motion == "right"


@pytest.mark.parametrize("bad", [0, 9, 2.5, True, "4", None])
def test_bad_chunk_frames_are_refused_by_name(engine: ShapesEngine, bad: object) -> None:
    with pytest.raises(InvalidRequestError, match=r"chunk_frames must be an integer from 1 to 8"):
        engine.open_stream(request(extra_params={"chunk_frames": bad}))


def test_other_extra_params_are_refused_by_name(engine: ShapesEngine) -> None:
    with pytest.raises(InvalidRequestError, match=r"only extra_params\.chunk_frames, got knob"):
        engine.open_stream(request(extra_params={"knob": 1, "chunk_frames": 2}))
