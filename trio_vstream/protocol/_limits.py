"""`Limits`: the bounds a server puts on what clients send.

A module of its own because both directions of parsing apply them: ``session.start``
(`_start`) and every later message (`_messages`). Kept apart from either, it lets
`_start` build on `_messages` (an interaction script entry is parsed as a live
interaction is) without a cycle. It imports nothing from the package.
"""

from typing import Final

import attrs

__all__ = ["DEFAULT_LIMITS", "Limits"]


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


DEFAULT_LIMITS: Final = Limits()
