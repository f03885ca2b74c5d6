"""A fake camera for chromium: a Y4M file its ``--use-file-for-fake-video-capture`` plays
in a loop, a saturated blob moving on grey, whose place in each frame is known."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

SIZE = 256
FPS = 12
FRAMES = 48
"""Four seconds, looped: the blob goes once round a circle."""
BLOB = (40, 200, 60)
"""Green, as saturated as a camera's picture of a green card."""
BACKGROUND = 110
RADIUS = 28


def blob_centre(index: int, frames: int = FRAMES) -> tuple[float, float]:
    """Where the blob is (x, y, in pixels) in frame ``index`` of a loop of ``frames``."""
    angle = 2 * math.pi * (index % frames) / frames
    return SIZE / 2 + 70 * math.cos(angle), SIZE / 2 + 70 * math.sin(angle)


def frame(index: int, frames: int = FRAMES) -> np.ndarray:
    """Frame ``index`` of a loop of ``frames``: (SIZE, SIZE, 3) uint8 RGB."""
    x, y = blob_centre(index, frames)
    rows, cols = np.mgrid[0:SIZE, 0:SIZE]
    picture = np.full((SIZE, SIZE, 3), BACKGROUND, np.uint8)
    picture[(cols - x) ** 2 + (rows - y) ** 2 <= RADIUS**2] = BLOB
    return picture


def write_y4m(path: Path, fps: int = FPS) -> Path:
    """The loop as a 4:2:0 Y4M file (BT.601 limited range, as chromium reads it), played
    at ``fps``: the blob goes round in the same four seconds at any rate."""
    frames = FRAMES * fps // FPS
    with path.open("wb") as out:
        out.write(f"YUV4MPEG2 W{SIZE} H{SIZE} F{fps}:1 Ip A1:1 C420jpeg\n".encode())
        for index in range(frames):
            rgb = frame(index, frames).astype(np.float64)
            r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
            y = 16 + 0.257 * r + 0.504 * g + 0.098 * b
            u = 128 - 0.148 * r - 0.291 * g + 0.439 * b
            v = 128 + 0.439 * r - 0.368 * g - 0.071 * b

            def half(plane: np.ndarray) -> np.ndarray:
                return plane.reshape(SIZE // 2, 2, SIZE // 2, 2).mean(axis=(1, 3))

            out.write(b"FRAME\n")
            for plane in (y, half(u), half(v)):
                out.write(np.clip(plane.round(), 0, 255).astype(np.uint8).tobytes())
    return path


def green_centroid(picture: np.ndarray) -> tuple[float, float] | None:
    """The centre (x, y) of the blob's green in a decoded picture, None if none is seen."""
    rgb = picture.astype(np.int32)
    mask = (rgb[..., 1] - np.maximum(rgb[..., 0], rgb[..., 2])) > 60
    if mask.sum() < 20:
        return None
    rows, cols = np.nonzero(mask)
    return float(cols.mean()), float(rows.mean())
