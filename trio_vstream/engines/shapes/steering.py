"""How the shapes world is steered: a camera velocity becomes a motion, a window a chunk's.

The shapes model has no camera: its world is a flat picture seen from the front, and
its object moves one pixel a frame along one axis, or not at all, for a whole chunk.
These are the rules that map what a client steers with onto that (`camera_motion`),
and that integrate the steers a paced session received within a chunk's action window
into the one motion the chunk follows (`window_shares`, `integrated_motion`). Pure
arithmetic on names and numbers, apart from the stream that applies them
(`trio_vstream.engines.shapes.engine`), so that each rule is tested as a table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from trio_vstream.engines.contract import EngineError
from trio_vstream.models.shapes.vocab import MOTION_VECTORS
from trio_vstream.values import Camera


def conditioning_key(prompt: str, motion: str | None) -> str:
    """A conditioning key: the prompt, and the motion a camera steered it to, if any
    (motion names never contain ``|``, so the first one splits them)."""
    return f"{motion or ''}|{prompt}"


@attrs.frozen
class WindowChange:
    """A change queued for the next chunk, as `window_shares` sees it."""

    key: str
    """The conditioning key in force from the change on (see `conditioning_key`)."""
    offset: float
    """``PromptChange.window_offset``: where in the chunk's action window it came."""
    steer: bool
    """A camera-only change that switches at once: the only kind placed in the window."""


def window_shares(
    before: Sequence[tuple[str, float]], window: Sequence[WindowChange]
) -> dict[str, float] | None:
    """The share of a chunk's action window each conditioning key was in force, or None
    when the window's changes apply from the chunk's first frame.

    ``before`` (the mix the previous chunk ended with) is in force from 0 to the first
    change's offset, then each change's key from its offset to the next change's, the
    last one's to the end of the window. Changes count in arrival order, as the schedule
    applies them: one never takes effect before an earlier one.

    Only steers are placed (camera-only changes that switch at once: a paced session's
    key presses). A window with no change past offset 0, or with any other change (a
    prompt, a blend over chunks), gives None: every change applies from the chunk's
    first frame, exactly as in an unpaced session.
    """
    # The session sends offsets in [0, 1); anything else (not finite) counts as 0.
    offsets = [change.offset if math.isfinite(change.offset) else 0.0 for change in window]
    if not any(offset > 0.0 for offset in offsets) or not all(change.steer for change in window):
        return None
    segments = [(0.0, tuple(before))]
    for change, offset in zip(window, offsets, strict=True):
        start = min(max(offset, segments[-1][0]), 1.0)
        segments.append((start, ((change.key, 1.0),)))
    ends = [start for start, _ in segments[1:]] + [1.0]
    shares: dict[str, float] = {}
    for (start, mix), end in zip(segments, ends, strict=True):
        for key, weight in mix:
            shares[key] = shares.get(key, 0.0) + (end - start) * weight
    return {key: share for key, share in shares.items() if share > 1e-9}


def integrated_motion(shares: Mapping[str, float], last: str) -> str:
    """The motion a chunk follows, from its action window: its shapes-world steer.

    ``shares`` is the share of the window each motion was in force; ``last`` the one in
    force at its end. The model moves its object one pixel a frame or not at all, for a
    whole chunk: it cannot place a change at its frame, and a mix of motion embeddings
    is not a slower motion (measured: the heavier motion wins, at full speed). So:

    * a window that ends moving follows ``last``, the person's latest steer, wherever in
      the window it came: a key pressed late in a window turns the object in that
      window's chunk, not a chunk later (a net displacement would keep a late press's
      chunk going the old way, adding a whole chunk to its key-to-frame time);
    * a window that ends still moves by its integrated velocity, the net displacement:
      the motion whose axis and sign carry most of it, "still" when it is nil. So a short
      press (still, right for a fifth of the window, still) moves the object right in
      that chunk, and a stop late in a window lets the chunk finish the motion before it.
    """
    if last != "still":
        return last
    dx = sum(share * MOTION_VECTORS[motion][0] for motion, share in shares.items())
    dy = sum(share * MOTION_VECTORS[motion][1] for motion, share in shares.items())
    along = {
        motion: dx * vector[0] + dy * vector[1]
        for motion, vector in MOTION_VECTORS.items()
        if vector != (0, 0)
    }
    best = max(along.values())
    if best < 1e-6:
        return "still"
    if along.get(last, -1.0) >= best - 1e-9:
        return last
    return next(motion for motion, value in along.items() if value >= best - 1e-9)


#: Below this, a camera's translation or turn counts as none: the object stays still.
_STILL: Final = 1e-6


def camera_motion(camera: Camera) -> str:
    """The shapes world's motion for a camera velocity: its steering rule.

    The world is a flat picture seen from the front, so a camera velocity steers the
    object along the picture's axes: +X right, -X left; +Y up and +Z (forward, the
    W key) up, -Y and -Z down; when the translation is zero, a turn steers the same
    way (yaw right or left, pitch up or down); no translation and no turn is "still".
    The strongest axis wins, since the object moves along one axis at a time. A
    ``target`` pose is refused: the world has no camera to place.
    """
    if camera.mode != "velocity":
        raise EngineError(
            f"the shapes engine steers by camera velocity only, not a {camera.mode!r} pose: "
            "its world has no camera to place"
        )
    x, y, z = camera.translation
    across, up = x, y + z
    if max(abs(across), abs(up)) < _STILL:
        across, up = _turn(camera.rotation)
        if max(abs(across), abs(up)) < _STILL:
            return "still"
    if abs(across) >= abs(up):
        return "right" if across > 0 else "left"
    return "up" if up > 0 else "down"


def _turn(rotation: tuple[float, float, float, float]) -> tuple[float, float]:
    """(yaw, pitch) of a unit quaternion as a steer: yaw right positive, pitch up positive.

    In vllm-omni's sense (`trio_vstream.values.Camera`): a positive turn about +Y looks
    right, a positive turn about +X looks up.
    """
    qx, qy, qz, qw = rotation
    yaw = math.atan2(2.0 * (qw * qy + qx * qz), 1.0 - 2.0 * (qx * qx + qy * qy))
    pitch = math.asin(max(-1.0, min(1.0, 2.0 * (qw * qx - qy * qz))))
    return yaw, pitch
