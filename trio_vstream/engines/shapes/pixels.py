"""The shapes model's native frames to pixels, and a reference image to its context.

The model works at its native size (32x32, values in [-1, 1]); a client asks for any
size in uint8 RGB. The conversion both ways lives here, on the model's device, so that
a CUDA chunk crosses to the host once: `to_uint8_frames` (bilinear; the square world
is stretched to other aspect ratios), `ShapesFrames` (the same decode, deferred to the
server's encode thread: `DeferredFrames`) and `image_to_context` (an ``image_reference``
as the frame the first chunk continues from).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from trio_vstream.engines.contract import EngineError, InvalidRequestError


class ShapesFrames:
    """A chunk's native frames, decoded (`to_uint8_frames`) when the server asks:
    `DeferredFrames`. Holds only its own tensor (a view of the chunk's sample, which the
    stream no longer touches), so it decodes the same after the stream's close."""

    def __init__(self, native: torch.Tensor, width: int, height: int) -> None:
        self._native: torch.Tensor | None = native
        self._width = width
        self._height = height
        self.shape = (native.shape[0], height, width, 3)

    def decode(self) -> torch.Tensor:
        native = self._native
        if native is None:
            raise EngineError("a shapes chunk's frames were decoded after their release")
        with torch.inference_mode():
            return to_uint8_frames(native, self._width, self._height)

    def release(self) -> None:
        self._native = None


def to_uint8_frames(native: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """(T, 3, S, S) in [-1, 1] -> (T, height, width, 3) uint8, on the same device."""
    if native.shape[-2:] != (height, width):
        shrinking = height < native.shape[-2] or width < native.shape[-1]
        native = F.interpolate(
            native, size=(height, width), mode="bilinear", align_corners=False, antialias=shrinking
        )
    pixels = ((native + 1.0) * 127.5).round_().clamp_(0.0, 255.0).to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).contiguous()


def image_to_context(image: object, size: int, device: torch.device) -> torch.Tensor:
    """An (H, W, 3) uint8 reference image -> a (1, 3, size, size) context frame in [-1, 1]."""
    tensor = torch.as_tensor(image)
    if tensor.ndim != 3 or tensor.shape[-1] != 3:
        raise InvalidRequestError(
            f"image_reference must be an RGB image, got shape {tuple(tensor.shape)}"
        )
    pixels = tensor.to(device=device, dtype=torch.float32).permute(2, 0, 1)[None] / 127.5 - 1.0
    return F.interpolate(pixels, size=(size, size), mode="bilinear", antialias=True)
