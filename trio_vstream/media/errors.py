"""The one error of the media floor, raised by every codec adapter and the encoder alike.

Its own module, at the bottom of the floor, so that `trio_vstream.media.h264`,
`trio_vstream.media.aac` and `trio_vstream.media.image_decode` raise the same type that
`trio_vstream.media.encoding` (which re-exports it) reports, without importing the
encoder built on them.
"""

from __future__ import annotations

__all__ = ["EncodingError"]


class EncodingError(Exception):
    """Bad input, bad codec options, or a codec failure; the message says which."""
