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
