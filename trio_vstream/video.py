"""Plain values about a video that both the wire protocol and the engines speak of.

A module of its own so that each depends on it and neither on the other: the
protocol resolves a request against an engine's defaults without knowing
engines, and an engine states its defaults without knowing the wire.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class VideoDefaults:
    """An engine's defaults, used where a request leaves a video setting out."""

    width: int = 256
    height: int = 256
    fps: int = 24
    num_frames: int = 48


#: The camera modes of vllm-omni's interactive world models: ``velocity`` is a motion
#: per generation step, ``target`` a pose to move to.
CAMERA_MODES: frozenset[str] = frozenset({"velocity", "target"})


@attrs.frozen
class Camera:
    """A camera in a ``session.interaction``, in Unity's frame (+X right, +Y up, +Z forward).

    Here, not in the protocol, because the protocol parses it and an engine acts on it:
    one type both speak, already validated (finite numbers, a unit quaternion, a known
    mode), so an engine never has to re-check the client's numbers.
    """

    mode: str
    """One of `CAMERA_MODES`."""
    translation: tuple[float, float, float]
    """(x, y, z): a per-step motion (``velocity``) or a position (``target``)."""
    rotation: tuple[float, float, float, float]
    """(qx, qy, qz, qw): a unit quaternion, the same two readings as ``translation``."""
