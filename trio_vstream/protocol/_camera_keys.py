"""WASD/IJKL key states as velocity cameras: vllm-omni's keyboard mapping, in one place.

vllm-omni's world models are driven from a keyboard, but its wire speaks only structural
SE3 cameras: key tokens are converted before they are sent (by its example client) and,
in ``extra_params.camera_action_script``, by the server for each generated chunk. Both
sides of trio_vstream need the same conversion, so it lives here, pure, below both: the
protocol turns a script into `Camera` values, the client turns ``--keys`` into them.

The mapping follows vllm-omni's
``examples/online_serving/streaming_video_generation/camera_utils.py``
(``wasd_to_camera_payload``; commit d29f24cb2c648243496a1aad3c41af5068dec446), whose
magnitudes mirror LingBot's script integrator
(``vllm_omni/diffusion/models/lingbot_world/actions.py``): per step, ``w``/``s`` move
0.05 forward/back (+Z), ``d``/``a`` 0.05 right/left (+X), ``l``/``j`` yaw 6 degrees
right/left (about +Y), ``i``/``k`` pitch 4 degrees up/down (about +X); the rotation is
pitch composed after yaw (q = pitch * yaw). Opposite keys cancel; repeats count once.
"""

import math
from collections.abc import Collection, Sequence
from typing import Final

from trio_vstream.values import Camera

__all__ = ["CAMERA_KEYS", "KEY_PITCH_DEGREES", "KEY_STEP", "KEY_YAW_DEGREES", "key_velocity"]

#: The keys, in vllm-omni's order (``_ACTION_ORDER`` in lingbot_world/actions.py).
CAMERA_KEYS: Final = ("w", "a", "s", "d", "i", "j", "k", "l")
KEY_STEP: Final = 0.05
"""Translation per step of a held ``w``/``a``/``s``/``d`` (Unity units)."""
KEY_PITCH_DEGREES: Final = 4.0
KEY_YAW_DEGREES: Final = 6.0


def _axis_angle(axis: tuple[float, float, float], degrees: float) -> tuple[float, ...]:
    half = math.radians(degrees) / 2
    sine = math.sin(half)
    return (axis[0] * sine, axis[1] * sine, axis[2] * sine, math.cos(half))


def _held(frames: Sequence[Collection[str]], plus: str, minus: str) -> float:
    """How much a key pair pushes, averaged over the frames: -1..1."""
    return sum((plus in keys) - (minus in keys) for keys in frames) / len(frames)


def key_velocity(frames: Sequence[Collection[str]]) -> Camera:
    """The ``velocity`` camera of key states held over ``frames`` (one set per frame).

    One frame gives exactly vllm-omni's ``wasd_to_camera_payload``. Several (a script
    chunk's three latent frames) give their mean motion per step: a session hands an
    engine one camera per chunk, and the mean keeps the chunk's total travel and turn
    (``[["a"], [], []]`` moves a third of a step per frame). Keys must already be lower
    case members of `CAMERA_KEYS` (the callers validate, each naming its own input).
    """
    if not frames:
        raise ValueError("key_velocity needs at least one frame of key states")
    dx = KEY_STEP * _held(frames, "d", "a")
    dz = KEY_STEP * _held(frames, "w", "s")
    pitch = KEY_PITCH_DEGREES * _held(frames, "i", "k")
    yaw = KEY_YAW_DEGREES * _held(frames, "l", "j")
    qx, qy, qz, qw = _axis_angle((0.0, 1.0, 0.0), yaw) if yaw else (0.0, 0.0, 0.0, 1.0)
    if pitch:
        px, py, pz, pw = _axis_angle((1.0, 0.0, 0.0), pitch)
        qx, qy, qz, qw = (
            pw * qx + px * qw + py * qz - pz * qy,
            pw * qy - px * qz + py * qw + pz * qx,
            pw * qz + px * qy - py * qx + pz * qw,
            pw * qw - px * qx - py * qy - pz * qz,
        )
    # `+ 0.0` turns the -0.0 of a zero axis times a negative sine into 0.0.
    rotation = (qx + 0.0, qy + 0.0, qz + 0.0, qw + 0.0)
    return Camera("velocity", (dx + 0.0, 0.0, dz + 0.0), rotation)
