"""An engine's frames, brought to what the encoder takes.

Not part of the engine contract (`trio_vstream.engines.contract`): the server runs this on
every chunk an engine returns, and the benchmarks and tests that drive an engine
directly run it too, so that they check frames as the server does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trio_vstream.engines.contract import DeferredFrames, EngineError

__all__ = ["audio_to_float32_array", "frame_count", "frames_to_uint8_array"]


def frames_to_uint8_array(frames: Any, *, width: int, height: int) -> np.ndarray:
    """Bring an engine's frames to a contiguous (T, H, W, 3) uint8 numpy array.

    Runs in a worker thread: a GPU tensor is copied to the host here, once per
    chunk, never on the event loop. `DeferredFrames` are decoded here (the server's
    encode thread; a test's or a benchmark's own), and must decode to the shape they
    declared.
    """
    declared: tuple[int, ...] | None = None
    if isinstance(frames, DeferredFrames):
        declared = tuple(frames.shape)
        frames = frames.decode()
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
    if declared is not None and declared != frames.shape:
        raise EngineError(
            f"engine's deferred frames declared shape {declared}, decoded to {frames.shape}"
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


def audio_to_float32_array(audio: Any, *, channels: int, samples: int) -> np.ndarray:
    """Bring a chunk's sound to a contiguous (channels, samples) float32 numpy array.

    Runs in the encode's worker thread, like `frames_to_uint8_array` (a GPU tensor is
    copied here). ``samples`` is what the chunk's frames need
    (`trio_vstream.values.audio_samples_through`): any other count is the engine's bug, and
    an error here rather than sound that slides off the picture. Mono may come as
    ``(samples,)``. Values are clipped to [-1, 1]; a NaN or an infinity is refused (the
    encoder would turn it into noise at full scale).
    """
    if audio is None:
        raise EngineError("engine makes sound but returned a chunk without audio")
    if not isinstance(audio, np.ndarray):
        to_cpu = getattr(audio, "cpu", None)
        # A torch tensor, on whatever device and in whatever float type (bf16 has no numpy).
        audio = to_cpu().float().numpy() if to_cpu is not None else np.asarray(audio)
    if audio.ndim == 1 and channels == 1:
        audio = audio[None, :]
    if audio.ndim != 2 or audio.shape[0] != channels or audio.dtype.kind != "f":
        raise EngineError(
            f"engine produced audio of shape {tuple(audio.shape)} {audio.dtype}, expected "
            f"({channels}, {samples}) float"
        )
    if audio.shape[1] != samples:
        raise EngineError(
            f"engine produced {audio.shape[1]} audio samples for a chunk whose frames need "
            f"exactly {samples}"
        )
    out = np.ascontiguousarray(audio, dtype=np.float32)
    if not np.isfinite(out).all():
        raise EngineError("engine produced audio samples that are not finite")
    return np.clip(out, -1.0, 1.0)  # a copy: the engine's own array is left alone
