"""`Limits`: the bounds a server puts on what clients send.

A module of its own because both directions of parsing apply them: ``session.start``
(`_start`) and every later message (`_control`). Kept apart from either, it lets
`_start` build on `_control` (an interaction script entry is parsed as a live
interaction is, `_interaction_script`) without a cycle. It imports nothing from the package.
"""

from typing import Final

import attrs

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_PENDING_INTERACTIONS",
    "MAX_STREAMING_BUFFER_SECONDS",
    "Limits",
]


@attrs.frozen
class Limits:
    """Upper bounds that protect the server from requests it could not serve.

    The byte limits match the reference; the video limits bound GPU memory and time.
    """

    max_start_bytes: int = 4 * 1024 * 1024
    max_control_bytes: int = 128 * 1024
    max_width: int = 1920
    max_height: int = 1920
    max_num_frames: int = 2400
    max_total_pixels: int = 1920 * 1080 * 600
    max_input_pixels: int = 1920 * 1080
    """The largest frame of an input video (``input_video``): each is decoded, so each
    costs its pixels in memory and time."""
    max_input_frame_bytes: int = 1024 * 1024
    """The largest input frame message: a 1080p JPEG at quality 90 is a few hundred KB."""


DEFAULT_LIMITS: Final = Limits()


MAX_STREAMING_BUFFER_SECONDS: Final = 60.0
"""The most ``session.start.streaming_buffer_seconds`` may ask for. The buffer is how far
generation may run ahead of the client's playhead: a minute is far beyond any player's
buffer (vllm-omni's player uses about a second), and a larger one is no longer pacing,
only a way to make the server generate for minutes that nobody watches yet."""

MAX_PENDING_INTERACTIONS: Final = 64
"""How many of a session's interactions may be pending at once: accepted (acknowledged
with ``session.interaction.queued``) but not yet listed in a chunk's
``started_event_ids``. As in vllm-omni, the one that finds the queue full ends the video
request with ``interaction_queue_full``, rather than being dropped in silence."""
