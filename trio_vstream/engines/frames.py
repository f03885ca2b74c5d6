"""An engine's frames, brought to what the encoder takes.

Not part of the engine contract (`trio_vstream.engines.base`): the server runs this on
every chunk an engine returns, and the benchmarks and tests that drive an engine
directly run it too, so that they check frames as the server does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trio_vstream.engines.base import EngineError

__all__ = ["frames_to_uint8_array"]


def frames_to_uint8_array(frames: Any, *, width: int, height: int) -> np.ndarray:
    """Bring an engine's frames to a contiguous (T, H, W, 3) uint8 numpy array.

    Runs in a worker thread: a GPU tensor is copied to the host here, once per
    chunk, never on the event loop.
    """
    if not isinstance(frames, np.ndarray):
        to_cpu = getattr(frames, "cpu", None)  # a torch tensor, on whatever device
        frames = to_cpu().numpy() if to_cpu is not None else np.asarray(frames)
    expected = f"(T, {height}, {width}, 3) uint8"
    if (
        frames.ndim != 4
        or frames.shape[0] < 1
        or frames.shape[1:] != (height, width, 3)
        or frames.dtype != np.uint8
    ):
        raise EngineError(
            f"engine produced frames of shape {tuple(frames.shape)} {frames.dtype}, "
            f"expected {expected}"
        )
    return np.ascontiguousarray(frames)


def frame_count(frames: Any) -> int:
    """How many frames an engine's chunk holds, read without touching their data (a GPU
    tensor's shape is on the host, its copy may block); 0 when it cannot be told: the
    encode, which checks the frames, then says what is wrong with them."""
    shape = getattr(frames, "shape", None)
    try:
        return int(shape[0]) if shape is not None else len(frames)
    except (TypeError, IndexError, ValueError):
        return 0
