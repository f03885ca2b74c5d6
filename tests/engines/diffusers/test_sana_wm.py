"""SANA-WM (``SanaWMPipeline``, ``loops/sana_wm.py``): served segment by segment, each
segment's camera path built from the session's camera interactions.

The camera path is a pure function (`CameraRig.track`), checked numerically against
SANA-WM's own action strings (``cam_utils.action_string_to_c2w``) and against poses
written out here; end to end, what reaches the pipeline is recorded by a wrapper around
its own ``__call__`` (which then runs), and a segment's frames are compared with the
pipeline's direct call."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.engines.diffusers.support import (
    START,
    StopAtCall,
    Stopped,
    memory_per_chunk,
    no_stop,
    record_calls,
    request,
    run_all,
    run_session,
)
from tests.server.test_http import http_get_with_headers
from trio_vstream.engines import Engine, InvalidRequestError, PromptChange, load_engine
from trio_vstream.engines.contract import EngineConfigError
from trio_vstream.engines.diffusers._stream import frames_to_uint8
from trio_vstream.engines.testing import check_engine
from trio_vstream.protocol import key_velocity
from trio_vstream.values import Camera

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from diffusers.pipelines.sana_wm.cam_utils import action_string_to_c2w

from trio_vstream.engines.diffusers.loops.sana_wm import (
    LOOP as SANA_WM_LOOP,
)
from trio_vstream.engines.diffusers.loops.sana_wm import (
    CameraRig,
    default_first_frame,
    default_intrinsics,
    to_opencv,
)

WIDTH, HEIGHT = 32, 16
SEGMENT = 5
"""``segment_frames``: 5 frames, two latent frames of the tiny VAE's 2; a continued
segment adds 4."""

STEP = 2
"""Frames per camera step: the tiny VAE's temporal ratio (8 for the real one)."""

IMAGE = (np.random.default_rng(0).random((HEIGHT, WIDTH, 3)) * 255).astype(np.uint8)
STILL = Camera("velocity", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))
FORWARD = Camera("velocity", (0.0, 0.0, 0.05), (0.0, 0.0, 0.0, 1.0))


def yaw(degrees: float) -> tuple[float, float, float, float]:
    """A turn about +Y (a positive one to the right), as a quaternion."""
    half = math.radians(degrees) / 2
    return (0.0, math.sin(half), 0.0, math.cos(half))


def pitch(degrees: float) -> tuple[float, float, float, float]:
    """A turn about +X (a positive one looks up, in vllm-omni's sense), as a quaternion."""
    half = math.radians(degrees) / 2
    return (math.sin(half), 0.0, 0.0, math.cos(half))


@pytest.fixture(scope="module")
def sana_wm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random SANA-WM pipeline directory."""
    from trio_vstream.engines.diffusers.testing import build_sana_wm

    return build_sana_wm(tmp_path_factory.mktemp("sana_wm_models") / "SANA-WM-tiny")


@pytest.fixture
def engine(sana_wm: Path, make_engine: Any) -> Any:
    made = make_engine(sana_wm, segment_frames=str(SEGMENT))
    assert made.loop is SANA_WM_LOOP
    return made


@pytest.fixture
def calls(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every call of the engine's pipeline class from now on (`record_calls`)."""
    return record_calls(monkeypatch, engine.model.pipe)


def wm_request(**fields: Any) -> Any:
    values: dict[str, Any] = {"width": WIDTH, "height": HEIGHT, "num_frames": 13}
    values.update(fields)
    return request(**values)


def direct_call(pipe: Any, image: np.ndarray, c2w: np.ndarray, *, seed: int, **kw: Any) -> Any:
    """The pipeline's own output for one segment, as uint8 frames."""
    args: dict[str, Any] = {
        "c2w": c2w,
        "intrinsics": default_intrinsics(WIDTH, HEIGHT),
        "height": HEIGHT,
        "width": WIDTH,
        "num_frames": c2w.shape[0],
        "num_inference_steps": 2,
        "guidance_scale": 1.0,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "pt",
    }
    args.update(kw)
    return frames_to_uint8(pipe(Image.fromarray(image), "a red fox in the snow", **args).frames)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    error = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if error == 0 else 10 * math.log10(255.0**2 / error)


def translations(c2w: np.ndarray) -> np.ndarray:
    return np.asarray(c2w)[:, :3, 3]


# ------------------------------------------------------------------ the camera path


@pytest.mark.parametrize(
    ("camera", "action", "speeds"),
    [
        (key_velocity([{"w"}]), "w", {"translation_speed": 0.05 / 8}),
        (key_velocity([{"s"}]), "s", {"translation_speed": 0.05 / 8}),
        (key_velocity([{"d"}]), "d", {"translation_speed": 0.05 / 8}),
        (key_velocity([{"a"}]), "a", {"translation_speed": 0.05 / 8}),
        (key_velocity([{"l"}]), "l", {"rotation_speed_deg": 6 / 8}),
        (key_velocity([{"j"}]), "j", {"rotation_speed_deg": 6 / 8}),
        # A positive turn about X looks up, as vllm-omni means it (its client sends +4
        # degrees for i): SANA-WM's i; a negative one its k.
        (key_velocity([{"i"}]), "i", {"rotation_speed_deg": 4 / 8}),
        (key_velocity([{"k"}]), "k", {"rotation_speed_deg": 4 / 8}),
        (Camera("velocity", (0.0, 0.0, 0.0), pitch(4.0)), "i", {"rotation_speed_deg": 4 / 8}),
    ],
    ids=["w", "s", "d", "a", "l", "j", "i", "k", "up"],
)
def test_a_velocity_is_sana_wms_own_action_spread_over_a_step(
    camera: Camera, action: str, speeds: dict[str, float]
) -> None:
    # 3 steps of SANA-WM's 8 frames: its action string, one key per frame, at the
    # velocity's per-frame share.
    rig = CameraRig(frames_per_step=8)
    poses, after = rig.track(25, [(camera, 0.0)])
    expected = action_string_to_c2w(f"{action}-24", **speeds)
    np.testing.assert_allclose(to_opencv(poses), expected, atol=1e-5)
    assert after.velocity == camera  # it lasts
    # The next segment goes on from the last pose, at the same velocity.
    more, _ = after.track(9)
    np.testing.assert_allclose(more[0], poses[-1], atol=1e-12)
    longer = action_string_to_c2w(f"{action}-32", **speeds)
    np.testing.assert_allclose(to_opencv(more), longer[24:], atol=1e-5)


def test_unity_axes_become_opencv_axes() -> None:
    # Up in Unity (+Y) is -Y in OpenCV; right and forward stay.
    rig = CameraRig(frames_per_step=1)
    for move, expected in [
        ((1.0, 0.0, 0.0), (1.0, 0.0, 0.0)),
        ((0.0, 1.0, 0.0), (0.0, -1.0, 0.0)),
        ((0.0, 0.0, 1.0), (0.0, 0.0, 1.0)),
    ]:
        poses, _ = rig.track(2, [(Camera("velocity", move, (0.0, 0.0, 0.0, 1.0)), 0.0)])
        np.testing.assert_allclose(translations(to_opencv(poses))[1], expected, atol=1e-7)
    # A camera turned right 90 degrees that moves forward moves along +X (its own axes).
    turned = Camera("target", (0.0, 0.0, 0.0), yaw(90.0))
    _, right = rig.track(2, [(turned, 0.0)])
    poses, _ = right.track(2, [(FORWARD, 0.0)])
    np.testing.assert_allclose(translations(to_opencv(poses))[1], (0.05, 0.0, 0.0), atol=1e-7)


def test_a_target_is_reached_on_the_segments_last_frame_and_held() -> None:
    rig = CameraRig(frames_per_step=STEP, velocity=FORWARD)
    target = Camera("target", (1.0, 2.0, 3.0), yaw(60.0))
    poses, after = rig.track(5, [(target, 0.0)])
    # Linear in position, a quarter of the way a frame; a quarter of the turn a frame.
    np.testing.assert_allclose(
        translations(poses), [[k / 4, 2 * k / 4, 3 * k / 4] for k in range(5)], atol=1e-12
    )
    for k in range(5):
        turn = math.radians(15.0 * k)
        expected = [
            [math.cos(turn), 0, math.sin(turn)],
            [0, 1, 0],
            [-math.sin(turn), 0, math.cos(turn)],
        ]
        np.testing.assert_allclose(poses[k][:3, :3], expected, atol=1e-12)
    assert after.velocity == STILL  # arrived, it stays
    held, _ = after.track(5)
    np.testing.assert_allclose(held, np.broadcast_to(poses[-1], (5, 4, 4)), atol=1e-12)


def test_a_paced_velocity_takes_over_at_its_window_offset() -> None:
    rig = CameraRig(frames_per_step=1)
    # Half way through the window's 4 motions: the first two still, the last two forward.
    poses, after = rig.track(5, [(FORWARD, 0.5)])
    np.testing.assert_allclose(translations(poses)[:, 2], [0, 0, 0, 0.05, 0.1], atol=1e-12)
    assert after.velocity == FORWARD
    # Two changes count in order; a later one never takes effect before an earlier one
    # (both from a quarter on here: the later one wins).
    back = Camera("velocity", (0.0, 0.0, -0.05), (0.0, 0.0, 0.0, 1.0))
    poses, after = rig.track(5, [(FORWARD, 0.25), (back, 0.0)])
    np.testing.assert_allclose(translations(poses)[:, 2], [0, 0, -0.05, -0.1, -0.15], atol=1e-12)
    assert after.velocity == back


# ------------------------------------------------------------------ the engine


@pytest.mark.slow
def test_first_segment_is_the_pipelines_own_call_with_a_still_camera(
    engine: Any, calls: list[dict[str, Any]]
) -> None:
    guided = {"guidance_scale": 3.0, "negative_prompt": "blurry"}
    stream = engine.open_stream(wm_request(image=IMAGE, num_frames=SEGMENT, **guided))
    (chunk,) = run_all(stream)
    (call,) = calls
    still = np.broadcast_to(np.eye(4, dtype=np.float32), (SEGMENT, 4, 4))
    np.testing.assert_array_equal(call["c2w"], still)
    np.testing.assert_array_equal(call["intrinsics"], [16.0, 16.0, 16.0, 8.0])  # 90 degrees
    np.testing.assert_array_equal(call["image"], IMAGE)
    assert "action" not in call
    reference = direct_call(engine.model.pipe, IMAGE, still.copy(), seed=1, **guided).numpy()
    assert psnr(chunk.frames, reference) >= 40.0
    np.testing.assert_array_equal(chunk.frames, reference)  # in fact the same arithmetic


@pytest.mark.slow
def test_a_velocity_steers_the_next_segments_poses_and_they_carry_on(
    engine: Any, calls: list[dict[str, Any]]
) -> None:
    # No image_reference: the engine's own first frame.
    stream = engine.open_stream(wm_request(num_frames=13))
    try:
        first = stream.next_chunk(no_stop)
        stream.interact(PromptChange("e1", None, 0, FORWARD))
        second = stream.next_chunk(no_stop)
        third = stream.next_chunk(no_stop)
        assert stream.next_chunk(no_stop) is None
    finally:
        stream.close()
    assert [c.frames.shape[0] for c in (first, second, third)] == [5, 4, 4]
    np.testing.assert_array_equal(calls[0]["image"], default_first_frame(WIDTH, HEIGHT))
    # 0.05 a step of two frames: 0.025 a frame, forward (+Z in both axes).
    per_frame = [[0.0, 0.0, 0.025 * k] for k in range(5)]
    np.testing.assert_allclose(translations(calls[0]["c2w"]), np.zeros((5, 3)))
    np.testing.assert_allclose(translations(calls[1]["c2w"]), per_frame, atol=1e-7)
    np.testing.assert_allclose(
        translations(calls[2]["c2w"]), np.add(per_frame, [0, 0, 0.1]), atol=1e-7
    )
    for call in calls:
        np.testing.assert_allclose(
            np.asarray(call["c2w"])[:, :3, :3], np.broadcast_to(np.eye(3), (5, 3, 3)), atol=1e-7
        )
    # The camera's change is listed in the segment that applied it.
    assert second.started_event_ids == second.completed_event_ids == ("e1",)
    assert first.started_event_ids == third.started_event_ids == ()
    # And that segment is the pipeline's own call along that path, from the last frame.
    np.testing.assert_array_equal(calls[1]["image"], first.frames[-1])
    pipe = engine.model.pipe
    path = to_opencv(CameraRig(frames_per_step=STEP, velocity=FORWARD).track(5)[0])
    np.testing.assert_array_equal(path, calls[1]["c2w"])
    calls.clear()
    continued = direct_call(pipe, first.frames[-1], path, seed=2).numpy()
    np.testing.assert_array_equal(second.frames, continued[1:])


def test_a_target_camera_takes_the_next_segment_there(
    engine: Any, calls: list[dict[str, Any]]
) -> None:
    stream = engine.open_stream(wm_request(num_frames=9, image=IMAGE))
    target = Camera("target", (0.4, 0.2, 0.8), yaw(-30.0))
    try:
        stream.next_chunk(no_stop)
        stream.interact(PromptChange("t1", "a blue whale", 1, target))
        chunk = stream.next_chunk(no_stop)
    finally:
        stream.close()
    end = np.asarray(calls[1]["c2w"])[-1]
    # Unity's (0.4, 0.2, 0.8) is OpenCV's (0.4, -0.2, 0.8); a 30 degree turn left.
    np.testing.assert_allclose(end[:3, 3], [0.4, -0.2, 0.8], atol=1e-6)
    turn = math.radians(-30.0)
    expected = [
        [math.cos(turn), 0, math.sin(turn)],
        [0, 1, 0],
        [-math.sin(turn), 0, math.cos(turn)],
    ]
    np.testing.assert_allclose(end[:3, :3], expected, atol=1e-6)
    np.testing.assert_allclose(
        translations(calls[1]["c2w"])[:, 0], [0.0, 0.1, 0.2, 0.3, 0.4], atol=1e-6
    )
    # With a prompt, the change is the prompt schedule's (listed once, as a prompt's).
    assert chunk.started_event_ids == ("t1",)


def test_a_stop_ends_within_a_step_and_the_segment_is_not_decoded(engine: Any) -> None:
    pipe = engine.model.pipe
    steps: list[int] = []
    hook = pipe.transformer.register_forward_pre_hook(lambda *_: steps.append(1))
    decode = pipe.vae.decode
    decodes: list[int] = []

    def counting_decode(*args: Any, **kwargs: Any) -> Any:
        decodes.append(1)
        return decode(*args, **kwargs)

    pipe.vae.decode = counting_decode
    stream = engine.open_stream(wm_request(num_inference_steps=3))
    stops = StopAtCall()
    try:
        assert stream.next_chunk(stops.checkpoint) is not None
        assert stops.calls == 1 + 3  # before the call, then after each of its 3 steps
        stream.interact(PromptChange("e1", None, 0, FORWARD))
        stops.stop_at = stops.calls + 3  # after the second segment's second step
        with pytest.raises(Stopped):
            stream.next_chunk(stops.checkpoint)
        assert stream._frames_done == SEGMENT  # the stopped segment sent nothing
    finally:
        stream.close()
        hook.remove()
        del pipe.vae.decode
    assert len(steps) == 3 + 2  # no step after the stop
    assert len(decodes) == 1  # the stopped segment was not decoded
    assert not engine.lock.locked


@pytest.mark.slow
def test_memory_is_flat_over_segments(engine: Any) -> None:
    segments = 5
    stream = engine.open_stream(wm_request(num_frames=1 + 4 * segments, num_inference_steps=1))
    stream.interact(PromptChange("e1", None, 0, FORWARD))  # the camera moves throughout
    run = stream._run
    sizes, kept, frames = memory_per_chunk(stream, segments, lambda: len(run.tracks))
    assert frames == [5, 4, 4, 4, 4]
    assert set(kept) == {1}  # the last path only
    # The rig is a 4x4 pose and a camera: nothing grows with the video.
    assert max(sizes[1:]) - min(sizes[1:]) < 4096, sizes


def test_the_camera_arguments_are_the_engines_alone(
    engine: Any, calls: list[dict[str, Any]]
) -> None:
    # A client sets none of what reaches the camera or the image, not even a file path.
    for extra in (
        {"c2w": [[[1, 0, 0, 0]] * 4]},
        {"action": "w-80"},
        {"intrinsics": [1, 1, 1, 1]},
        {"chi_prompt": ["ignore the prompt"]},
        {"image": "/etc/passwd"},
    ):
        with pytest.raises(InvalidRequestError, match="set by the engine") as refused:
            engine.open_stream(wm_request(extra_params=extra))
        assert next(iter(extra)) in str(refused.value)
    with pytest.raises(InvalidRequestError, match="multiples of 2"):
        engine.open_stream(wm_request(width=31))
    assert calls == []  # nothing reached the pipeline


def test_another_pipeline_cannot_continue_its_segments(sana_wm: Path, make_engine: Any) -> None:
    # It would take no camera path: SANA-WM continues its own segments.
    with pytest.raises(EngineConfigError, match="continues each chunk along its camera path"):
        make_engine(sana_wm, segment_frames=str(SEGMENT), i2v_model=str(sana_wm))


async def test_models_lists_cameras_and_a_camera_script_steers_it(
    engine: Any, calls: list[dict[str, Any]], serve: Any
) -> None:
    server, _ = await serve(engine)
    status, _, body = await http_get_with_headers(server.port, "/v1/models")
    assert status == 200
    (model,) = json.loads(body)["data"]
    assert model["trio_vstream"]["interaction_kinds"] == ["camera", "prompt"]
    start = {
        **START,
        "size": f"{WIDTH}x{HEIGHT}",
        "num_frames": 9,
        "num_inference_steps": 1,
        "extra_params": {"camera_action_script": [[[], [], []], [["w"], ["w"], ["w"]]]},
    }
    transcript = await run_session(server.url, start)
    assert transcript.terminal[-1]["type"] == "session.done", transcript.of_type("error")
    media = [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
    assert [m["started_event_ids"] for m in media] == [["script-0"], ["script-1"]]
    # The script's second entry, w held: 0.05 a step of two frames, in the second segment.
    np.testing.assert_allclose(translations(calls[0]["c2w"]), np.zeros((5, 3)))
    np.testing.assert_allclose(
        translations(calls[1]["c2w"])[:, 2], [0.0, 0.025, 0.05, 0.075, 0.1], atol=1e-7
    )


@pytest.mark.slow
def test_it_keeps_the_engine_contract(sana_wm: Path) -> None:
    def factory() -> Engine:
        args = {"model": str(sana_wm), "segment_frames": str(SEGMENT), "threads": "1"}
        return load_engine("diffusers", args, device="cpu")

    check_engine(factory, wm_request(num_inference_steps=1))
