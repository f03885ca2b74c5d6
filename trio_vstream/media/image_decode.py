"""Image bytes to an RGB array, the size vetted before anything decodes.

Two kinds of image come from clients: a conditioning image (``image_reference``, the third
step after `trio_vstream.media.image_fetch`, bytes from a URL, and
`trio_vstream.media.image_header`, its size from its header), and the frames of an input
video (`vet_frame`, then `decode_frame`, which also scales them to the video's size).
"""

from __future__ import annotations

from typing import Final

import av
import av.error
import numpy as np

from trio_vstream.media.errors import EncodingError
from trio_vstream.media.image_header import ImageHeader, ImageHeaderError, read_image_header

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "decode_frame",
    "decode_image",
    "vet_frame",
]

# 8K UHD is the largest conditioning image worth accepting.
DEFAULT_MAX_IMAGE_PIXELS = 7680 * 4320
# And no panorama longer than this a side (WebP's own limit is 16383).
MAX_IMAGE_SIDE = 16384


def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """Decode a PNG, JPEG or WebP image to (H, W, 3) uint8 RGB via FFmpeg.

    Uses PyAV so the project needs no PIL; alpha is dropped, as conditioning images are RGB.
    The bytes come from clients, and a decoder allocates (and fills) whatever picture a
    header declares: a few hundred KB of PNG can claim 16000x16000. So the size is read
    from the header first (`trio_vstream.media.image_header`, which also refuses every format
    it cannot vet that way) and refused over ``max_pixels`` before anything decodes. Then
    exactly the vetted bytes go to that format's decoder as one packet (no demuxer, so
    nothing probes or guesses the format), and the picture that comes out must have the
    header's size: a header that lies does not get past.
    """
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) == 0:
        raise EncodingError("image data is empty or not bytes")
    try:
        header = read_image_header(bytes(data))
    except ImageHeaderError as exc:
        raise EncodingError(str(exc)) from None
    _check_image_size(header.width, header.height, max_pixels)
    return _decode(data, header, None)


FRAME_FORMATS: Final = {"jpeg": "JPEG", "png": "PNG", "webp": "WebP"}
"""An input video's ``frame_format`` to the header's name of that format."""


def vet_frame(data: bytes, frame_format: str, width: int, height: int) -> ImageHeader:
    """The header of one input video frame, which must be the session's declared format
    and size exactly; `EncodingError` says what is wrong. Only the header is read: this
    is cheap enough for the receive loop, and a frame it refuses is never decoded."""
    if len(data) == 0:
        raise EncodingError("the frame is empty")
    try:
        header = read_image_header(bytes(data))
    except ImageHeaderError as exc:
        raise EncodingError(str(exc)) from None
    expected = FRAME_FORMATS[frame_format]
    if header.format != expected:
        raise EncodingError(
            f"the frame is {header.format}, not the {expected} the session declared"
        )
    if (header.width, header.height) != (width, height):
        raise EncodingError(
            f"the frame is {header.width}x{header.height}, "
            f"not the {width}x{height} the session declared"
        )
    return header


def decode_frame(data: bytes, header: ImageHeader, width: int, height: int) -> np.ndarray:
    """A frame `vet_frame` passed, decoded and scaled to ``width`` x ``height``: (H, W, 3)
    uint8 RGB. Blocking: a worker thread's."""
    return _decode(data, header, (width, height))


def _decode(data: bytes, header: ImageHeader, size: tuple[int, int] | None) -> np.ndarray:
    """Exactly the vetted bytes, as one packet to that format's decoder (no demuxer, so
    nothing probes or guesses the format); a picture whose size is not the header's is
    refused, so a header that lies does not get past."""
    try:
        ctx = av.CodecContext.create(_IMAGE_DECODERS[header.format], "r")
        assert isinstance(ctx, av.VideoCodecContext)
        ctx.thread_count = 1  # one picture: no frame threads holding extra copies
        frames = ctx.decode(av.Packet(bytes(data[: header.length])))
        frames += ctx.decode(None)
    except (av.error.FFmpegError, ValueError, OSError, IndexError, MemoryError) as exc:
        raise EncodingError(f"could not decode the {header.format} image: {exc}") from exc
    if not frames:
        raise EncodingError(f"the {header.format} image decoded to no picture")
    frame = frames[0]
    if (frame.width, frame.height) != (header.width, header.height):
        raise EncodingError(
            f"the {header.format} image decoded to {frame.width}x{frame.height}, "
            f"not the {header.width}x{header.height} its header declares"
        )
    try:
        if size is not None and size != (frame.width, frame.height):
            frame = frame.reformat(width=size[0], height=size[1], format="rgb24")
        return frame.to_ndarray(format="rgb24")
    except (av.error.FFmpegError, ValueError, MemoryError) as exc:
        raise EncodingError(f"could not convert the {header.format} image: {exc}") from exc


_IMAGE_DECODERS: Final = {"PNG": "png", "JPEG": "mjpeg", "WebP": "webp"}
"""FFmpeg's decoder for each of `image_header.ACCEPTED_FORMATS`."""


def _check_image_size(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels or max(width, height) > MAX_IMAGE_SIDE:
        raise EncodingError(
            f"image is {width}x{height}, more than the {max_pixels} pixels (or "
            f"{MAX_IMAGE_SIDE} a side) allowed"
        )
