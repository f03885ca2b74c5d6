"""SANA-WM (``SanaWMPipeline``): a camera-controlled world model, steered by the session's
camera interactions, segment by segment.

SANA-WM makes a video from a first frame, a prompt and a camera path: one
camera-to-world pose per frame (``c2w``, (F, 4, 4), OpenCV axes: +X right, +Y down, +Z
forward; ``cam_utils.action_string_to_c2w`` says so). Its public checkpoint
(``SANA-WM_bidirectional``) is bidirectional: a call denoises all its frames together,
so it is served as the segment path serves any image-to-video pipeline (`SegmentRun`):
one call per segment, the first from the request's ``image_reference`` (or the engine's
default first frame, `default_first_frame`), each later one from the last frame of the
one before. What this family adds is the camera: each call's ``c2w`` is the session's
camera path over the segment's frames (`CameraRig`), and ``intrinsics`` a pinhole
derived from the frame size (`default_intrinsics`). Only values the engine makes reach
those arguments: ``image`` is a PIL image built here, ``c2w`` and ``intrinsics`` arrays,
and ``action`` (a string the pipeline parses) is never passed; a request may set none of
them (``engine_set``).

The camera. A session's camera is in vllm-omni's form (`trio_vstream.values.Camera`,
Unity's axes: +X right, +Y up, +Z forward), relative to the first frame's camera (the
identity pose):

* ``velocity``: a motion per step, where a step is one latent frame of the pipeline
  (``vae_temporal_compression_ratio`` frames: 8), as vllm-omni's keys are per LingBot
  latent frame. It is spread evenly over the step's frames (``translation / n`` and the
  ``1/n`` power of the rotation each frame) and applied in the camera's own frame (W
  moves along where the camera looks, a yaw turns it about its own up axis). It lasts
  until the next camera, across segments, as in the ``shapes`` engine.
* ``target``: a pose (position and rotation in the session's frame). The camera goes
  there over the next segment, linearly in position and along the shortest rotation,
  arriving on its last frame, and stays (the velocity becomes still).

Unity's frame becomes OpenCV's by flipping Y, in the world and in the camera:
``c2w = S @ pose @ S`` with ``S = diag(1, -1, 1, 1)`` (`to_opencv`). A rotation keeps
vllm-omni's sense (`unity_turn`: +X looks up, +Y right, as vllm-omni's LingBot takes
them). So a yaw about +Y is SANA-WM's ``l``, a turn about +X (the keys' ``i``) its
``i``, +Z its ``w`` and +X its ``d`` (tested against ``action_string_to_c2w``).
In a paced session a velocity takes effect inside the segment at its ``window_offset``
(the motions from that fraction of the segment's new frames on); a target always spans
the segment from its offset to its end.

Prompts go in as embeddings (so transitions blend), encoded with the instruction prefix
the pipeline's call puts before the prompt (``DEFAULT_CHI_PROMPT``), so a segment gets
exactly what a direct call would compute. SANA-WM makes no sound.

The streaming (chunk-causal) SANA-WM checkpoint and its refiner's autoregressive KV
cache are not what diffusers' ``SanaWMPipeline`` runs: its call is bidirectional over
the whole clip, with no argument to pass a previous chunk's state in. Streaming
chunk by chunk would need a chunk-causal ``SanaWMTransformer3DModel`` forward with a
cache, which diffusers does not ship; see docs/diffusers.md.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs
import numpy as np

from trio_vstream.engines.contract import Checkpoint, Chunk, EngineError, PromptChange
from trio_vstream.engines.diffusers._extra import COMMON, ExtraParams
from trio_vstream.engines.diffusers._stream import to_pil
from trio_vstream.engines.diffusers.loops._protocol import Draft, Loop, Run
from trio_vstream.engines.diffusers.loops.segments import SegmentPlan, SegmentRun, Segments
from trio_vstream.values import Camera

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream

SANA_WM_ARGS: tuple[str, ...] = ("c2w", "action", "intrinsics", "chi_prompt")
"""What a SANA-WM pipeline's ``__call__`` takes besides the usual ones; the engine sets
the camera itself, and the instruction prefix is the pipeline's own."""

EXTRA_PARAMS = ExtraParams("SANA-WM", COMMON)
"""The common keys (those its call takes: ``max_sequence_length``)."""

UNITY_TO_OPENCV: Final = np.diag([1.0, -1.0, 1.0, 1.0])
"""``S``: flips Y, Unity's up to OpenCV's down (its own inverse)."""

DEFAULT_HORIZONTAL_FOV_DEGREES: Final = 90.0
"""The default camera's horizontal field of view: a focal length of half the frame's
width, close to the pipeline's own example (800 px for a 1690 px wide image, 93
degrees)."""

_STILL: Final = Camera("velocity", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))


class SanaWMSegments(Segments):
    """SANA-WM pipelines (`Loop`): the segment path, each call's camera path built from
    the session's camera interactions (`CameraRig`). A `WorldLoop`: the engine declares
    the ``camera`` interaction kind for it, and hands each camera to `steer`."""

    name = "SANA-WM segments"
    batches = False
    """Its calls run alone under the lock (its transformer is not one `_calls` batches)."""
    frame_continued = False
    """It continues each segment from the last frame itself (`plan`), with its own
    pipeline: another one (``i2v_model``) would take no camera path, so it is refused."""
    image_in_loop = False
    engine_set = SANA_WM_ARGS

    def recognises(self, info: PipelineInfo) -> bool:
        """A ``__call__`` that takes a camera path and intrinsics (SANA-WM's signature)."""
        return all(name in info.params for name in SANA_WM_ARGS) and info.takes_image

    def extra_params(self, model: PipelineInfo) -> ExtraParams:
        return EXTRA_PARAMS

    def plan(self, draft: Draft) -> SegmentPlan:
        return SegmentPlan(
            continues=True, segment_frames=draft.segment_frames, frame_step=draft.frame_step
        )

    def start(self, stream: DiffusersStream, plan: SegmentPlan) -> SanaWMRun:
        return SanaWMRun(stream, plan)

    def steer(self, run: Run, change: PromptChange) -> None:
        """Queue ``change``'s camera for ``run``'s next segment (from the event loop's
        thread)."""
        if not isinstance(run, SanaWMRun):  # the engine only starts SanaWMRuns for us
            raise EngineError("a SANA-WM camera reached another family's run")
        run.steer(change)


LOOP: Loop[SegmentPlan] = SanaWMSegments()


class SanaWMRun(SegmentRun):
    """One session's segments: the segment path's calls, each with the camera path the
    session's rig gives its frames, the first from a default frame when the request has
    no ``image_reference``."""

    def __init__(self, stream: DiffusersStream, plan: SegmentPlan) -> None:
        super().__init__(stream, plan)
        pipe = stream.plan.first.pipe
        self.rig = CameraRig(frames_per_step=int(pipe.vae_temporal_compression_ratio))
        """The session's camera: its pose at the last frame made and its velocity."""
        request = stream.request
        self._intrinsics = default_intrinsics(request.width, request.height)
        self._lock = threading.Lock()
        self._pending: list[PromptChange] = []  # cameras for the next segment, in order
        self._window: list[PromptChange] = []  # those the segment being made applies
        self._next_rig: CameraRig | None = None
        self.tracks: list[np.ndarray] = []
        """Each segment's ``c2w`` as handed to the pipeline (kept for tests and logs:
        the last one only, so memory stays flat)."""
        # The pipeline's call puts its instruction prefix before the prompt (not the
        # negative prompt): the stream's embeddings must be encoded the same way.
        from diffusers.pipelines.sana_wm.pipeline_sana_wm import DEFAULT_CHI_PROMPT

        stream.prompt_encode_kwargs["chi_prompt"] = list(DEFAULT_CHI_PROMPT)

    def steer(self, change: PromptChange) -> None:
        """Queue a camera change; the next segment applies it."""
        with self._lock:
            self._pending.append(change)

    def next_chunk(self, stream: DiffusersStream, checkpoint: Checkpoint, remaining: int) -> Chunk:
        """The next segment, along the camera path; the cameras it applied listed as
        started and completed with it (a camera-only change has no blend to run)."""
        with self._lock:
            self._window, self._pending = self._pending, []
        chunk = super().next_chunk(stream, checkpoint, remaining)
        assert self._next_rig is not None  # set by _seed_call, before the call
        self.rig, self._next_rig = self._next_rig, None
        ids = tuple(c.event_id for c in self._window if c.prompt is None)
        self._window = []
        if not ids:
            return chunk
        return attrs.evolve(
            chunk,
            started_event_ids=chunk.started_event_ids + ids,
            completed_event_ids=chunk.completed_event_ids + ids,
        )

    def close(self) -> None:
        super().close()
        self.tracks.clear()
        with self._lock:
            self._pending.clear()

    def _seed_call(self, kwargs: dict[str, Any], index: int, image: Any) -> None:
        """The segment path's generator and image (a default first frame if none), and
        the segment's camera: its path over the call's frames, and the intrinsics."""
        if image is None:
            height, width = kwargs["height"], kwargs["width"]
            image = to_pil(default_first_frame(width, height), width, height)
        super()._seed_call(kwargs, index, image)
        changes = [(c.camera, c.window_offset) for c in self._window if c.camera is not None]
        poses, self._next_rig = self.rig.track(kwargs["num_frames"], changes)
        c2w = to_opencv(poses)
        self.tracks[:] = [c2w]
        kwargs["c2w"] = c2w
        kwargs["intrinsics"] = self._intrinsics.copy()

    def _prompt_kwargs(
        self, stream: DiffusersStream, info: PipelineInfo, conditioning: Any
    ) -> dict[str, Any]:
        """The stream's embeddings, and an empty ``prompt`` the call requires beside them
        (it reads it only when no embeddings are given)."""
        kwargs = stream.prompt_kwargs(info, conditioning)
        kwargs.setdefault("prompt", "")
        return kwargs


# ------------------------------------------------------------------ the camera


@attrs.frozen
class CameraRig:
    """A session's camera between segments: where it is (``pose``, a 4x4 camera-to-world
    in Unity's axes, the first frame's camera the identity) and how it moves
    (``velocity``, per step of ``frames_per_step`` frames). Pure: `track` gives a
    segment's poses and the rig after it, and changes nothing."""

    frames_per_step: int
    pose: tuple[tuple[float, ...], ...] = ((1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1))
    velocity: Camera = _STILL

    def track(
        self, frames: int, changes: Sequence[tuple[Camera, float]] = ()
    ) -> tuple[np.ndarray, CameraRig]:
        """The poses of a segment's ``frames`` frames ((frames, 4, 4), Unity axes: the
        first is the current pose, the frame the segment starts from), and the rig at its
        last frame. ``changes`` are the cameras received for it, in order, each with its
        ``window_offset``: motion ``i`` (from frame ``i-1`` to ``i``, of ``n = frames-1``)
        follows the last change whose offset is at most ``(i-1)/n``, or the velocity in
        force before them. A target takes the camera from where it is when the target
        starts to the target pose, reached on the segment's last frame (unless a later
        change takes over first)."""
        motions = frames - 1
        pose = np.array(self.pose, dtype=np.float64)
        poses = [pose]
        starts: list[tuple[int, Camera]] = []
        floor = 0.0
        for camera, offset in changes:
            floor = min(max(offset if math.isfinite(offset) else 0.0, floor), 1.0)
            # The first motion at or after the offset (motions past the end: none).
            starts.append((math.ceil(floor * motions - 1e-9) + 1, camera))
        velocity = self.velocity
        target_from: tuple[int, np.ndarray, np.ndarray] | None = None
        for i in range(1, motions + 1):
            for start, camera in starts:
                if start == i:
                    if camera.mode == "target":
                        target_from = (i, pose, camera_pose(camera))
                    else:
                        velocity, target_from = camera, None
            if target_from is not None:
                first, origin, goal = target_from
                pose = interpolate(origin, goal, (i - first + 1) / (motions - first + 1))
            else:
                pose = pose @ step_motion(velocity, self.frames_per_step)
            poses.append(pose)
        if target_from is not None:
            velocity = _STILL  # arrived: the camera stays at the target
        rig = CameraRig(
            frames_per_step=self.frames_per_step,
            pose=tuple(tuple(float(v) for v in row) for row in pose),
            velocity=velocity,
        )
        return np.stack(poses), rig


def rotation_matrix(q: Sequence[float]) -> np.ndarray:
    """The 3x3 rotation of a unit quaternion ``(qx, qy, qz, qw)`` (the same algebra in
    Unity's left-handed frame as in a right-handed one)."""
    x, y, z, w = (float(v) for v in q)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )


def unity_turn(q: Sequence[float]) -> tuple[float, float, float, float]:
    """A camera's rotation as this module's Unity-axes algebra must apply it.

    The wire's rotations have vllm-omni's sense, not Unity's handedness: vllm-omni applies
    a camera's quaternion as it is to its world models' OpenCV poses (its example client's
    ``i``, +4 degrees about X, is LingBot's look-up), where +X turns the view up and +Y to
    the right (`trio_vstream.values.Camera`). Unity's axes are OpenCV's mirrored in Y, so
    the same turn here is the quaternion mirrored in Y: ``(-qx, qy, -qz, qw)``. `to_opencv`
    mirrors it back: SANA-WM gets the rotation as vllm-omni would hand LingBot.
    """
    x, y, z, w = (float(v) for v in q)
    return (-x + 0.0, y, -z + 0.0, w)


def quaternion_power(q: Sequence[float], fraction: float) -> tuple[float, float, float, float]:
    """``q`` to the power ``fraction``: the same axis, ``fraction`` of the angle (the
    shorter way round)."""
    x, y, z, w = (float(v) for v in q)
    if w < 0:
        x, y, z, w = -x, -y, -z, -w
    sine = math.sqrt(x * x + y * y + z * z)
    if sine < 1e-12:
        return (0.0, 0.0, 0.0, 1.0)
    half = math.atan2(sine, w) * fraction
    scale = math.sin(half) / sine
    return (x * scale, y * scale, z * scale, math.cos(half))


def step_motion(velocity: Camera, frames_per_step: int) -> np.ndarray:
    """One frame's share of a velocity: a 4x4 motion in the camera's own frame
    (``pose @ motion`` moves the camera by ``translation / n`` along its own axes and turns
    it by the ``1/n`` power of ``rotation``, ``n = frames_per_step``)."""
    motion = np.eye(4)
    turn = quaternion_power(unity_turn(velocity.rotation), 1 / frames_per_step)
    motion[:3, :3] = rotation_matrix(turn)
    motion[:3, 3] = np.asarray(velocity.translation, dtype=np.float64) / frames_per_step
    return motion


def camera_pose(camera: Camera) -> np.ndarray:
    """A camera's translation and rotation as a 4x4 pose."""
    pose = np.eye(4)
    pose[:3, :3] = rotation_matrix(unity_turn(camera.rotation))
    pose[:3, 3] = camera.translation
    return pose


def _quaternion_of(matrix: np.ndarray) -> np.ndarray:
    """The unit quaternion ``(qx, qy, qz, qw)`` of a rotation matrix (qw >= 0)."""
    m = matrix
    w = math.sqrt(max(0.0, 1.0 + m[0, 0] + m[1, 1] + m[2, 2])) / 2
    x = math.copysign(math.sqrt(max(0.0, 1.0 + m[0, 0] - m[1, 1] - m[2, 2])) / 2, m[2, 1] - m[1, 2])
    y = math.copysign(math.sqrt(max(0.0, 1.0 - m[0, 0] + m[1, 1] - m[2, 2])) / 2, m[0, 2] - m[2, 0])
    z = math.copysign(math.sqrt(max(0.0, 1.0 - m[0, 0] - m[1, 1] + m[2, 2])) / 2, m[1, 0] - m[0, 1])
    q = np.array([x, y, z, w])
    return q / np.linalg.norm(q)


def interpolate(origin: np.ndarray, goal: np.ndarray, fraction: float) -> np.ndarray:
    """The pose ``fraction`` of the way from ``origin`` to ``goal``: position linearly,
    rotation along the shortest arc (``origin``'s rotation times a power of the relative
    one)."""
    relative = origin[:3, :3].T @ goal[:3, :3]
    pose = np.eye(4)
    turn = quaternion_power(tuple(_quaternion_of(relative)), fraction)
    pose[:3, :3] = origin[:3, :3] @ rotation_matrix(turn)
    pose[:3, 3] = origin[:3, 3] + fraction * (goal[:3, 3] - origin[:3, 3])
    return pose


def to_opencv(poses: np.ndarray) -> np.ndarray:
    """Unity-axes camera-to-world poses as SANA-WM's (OpenCV axes), float32: Y flipped in
    the world and in the camera (``S @ pose @ S``)."""
    return (UNITY_TO_OPENCV @ poses @ UNITY_TO_OPENCV).astype(np.float32)


def default_intrinsics(width: int, height: int) -> np.ndarray:
    """``[fx, fy, cx, cy]`` for a ``width`` x ``height`` frame: square pixels, the
    principal point at the centre, a `DEFAULT_HORIZONTAL_FOV_DEGREES` field of view."""
    focal = width / 2 / math.tan(math.radians(DEFAULT_HORIZONTAL_FOV_DEGREES) / 2)
    return np.array([focal, focal, width / 2, height / 2], dtype=np.float32)


def default_first_frame(width: int, height: int) -> np.ndarray:
    """The first frame when a request has no ``image_reference``: a plain horizon (a
    pale sky over a darker ground, meeting at the middle), (H, W, 3) uint8. A world model
    needs a picture to start from; this one says nothing of what the prompt should make
    of it, and it is the same for every session."""
    rows = np.linspace(0.0, 1.0, height)[:, None]
    sky = np.array([170.0, 200.0, 230.0]) * (1 - rows) + np.array([215.0, 225.0, 235.0]) * rows
    ground = np.array([120.0, 110.0, 90.0]) * (1 - rows) + np.array([70.0, 60.0, 50.0]) * rows
    column = np.where(rows < 0.5, sky, ground)
    frame = np.broadcast_to(column[:, None, :], (height, width, 3))
    return np.ascontiguousarray(frame.round().astype(np.uint8))
