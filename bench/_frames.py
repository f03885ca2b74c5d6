"""Input video frames, as a client sends them (``session.start``'s ``input_video``):
small still images encoded with PyAV, for the fuzz and the soak.

A frame is a picture numbered ``number`` (a gradient that moves with it, over noise
drawn from it), so that frames differ and the same number is always the same bytes.
Encoded once each (`encoded_frame` keeps them): a fuzz draws thousands from a handful.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Final

import av
import numpy as np

FRAME_CODECS: Final = {
    "jpeg": ("mjpeg", "yuvj420p"),
    "png": ("png", "rgb24"),
    "webp": ("libwebp", "yuv420p"),
}
"""``input_video.frame_format`` -> the PyAV encoder and pixel format that make it."""


def frame_pixels(width: int, height: int, number: int) -> np.ndarray:
    """Picture ``number`` at ``width`` x ``height``: (H, W, 3) uint8 RGB."""
    y, x = np.mgrid[0:height, 0:width]
    base = (x * 255 // max(1, width - 1) + y * 97 // max(1, height - 1) + 29 * number) % 256
    noise = np.random.default_rng(number).integers(0, 48, (height, width, 3))
    pixels = base[..., None] + noise + np.array([0, 85, 170])
    return (pixels % 256).astype(np.uint8)


def encode_frame(pixels: np.ndarray, frame_format: str) -> bytes:
    """One picture as an image file of ``frame_format`` (jpeg, png or webp)."""
    codec, pix_fmt = FRAME_CODECS[frame_format]
    ctx = av.CodecContext.create(codec, "w")
    assert isinstance(ctx, av.VideoCodecContext)
    ctx.height, ctx.width = pixels.shape[:2]
    ctx.pix_fmt = pix_fmt
    ctx.time_base = Fraction(1, 24)
    frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
    return b"".join(bytes(packet) for packet in [*ctx.encode(frame), *ctx.encode(None)])


@functools.cache
def encoded_frame(frame_format: str, width: int, height: int, number: int) -> bytes:
    """Picture ``number`` encoded (once: the bytes are kept)."""
    return encode_frame(frame_pixels(width, height, number), frame_format)
