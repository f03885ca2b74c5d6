"""The shapes model's native frames to pixels, and a reference image to its context.

The model works at its native size (32x32, values in [-1, 1]); a client asks for any
size in uint8 RGB. The pixels are made here, on the model's device, so that a CUDA
chunk's pixels cross to the host once.

What the model draws is one object of one colour over a plain background, at 32x32: its
frames are not a photograph to be resized (resized, an edge of under two native pixels
becomes 15 soft pixels at 256x256, and the background's faint noise a pattern of blocks
the encoder keeps). So a chunk is read as that drawing (`read_drawing`: the background's
colour, the object's, and how much of each native pixel is object, with the model's
blur of about a native pixel partly undone: `BLUR_SIGMA`) and drawn again at
the requested size (`draw_frames`): the membership resampled bicubically at the output's
pixels, its edge made about 1.2 output pixels steep whatever the scale
(`EDGE_SHARPNESS`), and the two colours composed, so the background is flat and the edge
crisp, in the model's own colours, at every size. Where the screen shows the object
(`Picture`, from `trio_vstream.engines.shapes.view`) is part of the drawing: each
frame's view of the torus, cut so the object is never split across two edges.

Frames the two colours do not explain (an ``image_reference`` that is a photograph, say)
and sizes under the native one are resized as before (`to_uint8_frames`: bilinear; the
square world is stretched to other aspect ratios). `ShapesFrames` defers either to the
server's encode thread (`DeferredFrames`), and `image_to_context` makes an
``image_reference`` the frame the first chunk continues from.
"""

from __future__ import annotations

import functools
import math
from typing import Final

import attrs
import numpy as np
import torch
from torch.nn import functional as F

from trio_vstream.engines.contract import EngineError, InvalidRequestError

OBJECT_MIN_DISTANCE: Final = 0.25
"""How far (in the model's [-1, 1] units, about 32 levels) a frame's object must differ
from its background to be drawn; the palette's closest pair differs by far more."""

CORE: Final = 0.9
"""The object's colour is the median of its core: the pixels that differ from the
background by more than this share of the most any does. Its edge pixels are mixed with
the background (the more, the smaller and softer the object), and would pull it there."""

COLOUR_TOLERANCE: Final = 0.08
"""How far (about 10 levels) a frame's own colour may be from its chunk's and still be
drawn in the chunk's: the chunk's colour is steadier (a median over all its frames), and
a frame whose colour really changed (a prompt's transition) keeps its own."""

FIT_TOLERANCE: Final = 0.25
"""A native pixel the drawing explains is within this (about 32 levels) of it in every
channel: the model's faint halos are, a photograph's detail is not."""

FIT_SHARE: Final = 0.02
"""The share of a chunk's native pixels that may be unexplained before it is resized as
it is rather than drawn (`read_drawing`)."""

BLUR_SIGMA: Final = 1.0
"""The model's own blur, in native pixels (a Gaussian's standard deviation): what it
draws of a small shape is its rendered truth blurred by about this much, which rounds
the corners of a small triangle or square until it reads as a circle."""

RESTORE_ITERATIONS: Final = 10
"""Richardson-Lucy iterations that undo `BLUR_SIGMA` in a chunk's membership."""

RESTORE_SHARE: Final = 0.3
"""How much of the membership is the restored one (the rest is the model's own): fully
restored, the model's faint noise along an edge becomes a ragged edge. Chosen on the
evaluator's eval prompts in process (shape right 95.8 % at 0.3, 95.0 % at 0.2, 87.5 % with
none; continuity no worse)."""

EDGE_SHARPNESS: Final = 1.5
"""How steep the drawn edge is, per unit of scale (output pixels per native pixel): the
model's edge, about 1.7 native pixels from 10% to 90% once resampled, is made
``EDGE_SHARPNESS * scale`` times steeper, about 1.2 output pixels at any size: an
anti-aliased edge, neither soft nor jagged (measured on the frames: 1.5 pixels, the
most a pixel grid shows of a 1.2-pixel ramp; 1.7 once encoded)."""


@attrs.frozen(eq=False)
class Drawing:
    """A chunk's native frames read as the model's picture: per frame, the background's
    colour and the object's ((T, 3), in [-1, 1]), and how much of each native pixel is
    object (``membership``, (T, S, S) in [0, 1]; 0 everywhere in a frame without one)."""

    background: torch.Tensor
    colour: torch.Tensor
    membership: torch.Tensor

    def to(self, device: torch.device) -> Drawing:
        """The same drawing on ``device``."""
        return Drawing(
            background=self.background.to(device),
            colour=self.colour.to(device),
            membership=self.membership.to(device),
        )


@attrs.frozen(eq=False)
class Picture:
    """What a chunk's frames show: its drawing, and each frame's view of the torus.

    ``shifts`` (T, 2): how far (native pixels, x and y) the view moves the world, so the
    object is where the screen shows it; ``windows`` (T, 2): the object's screen centre,
    or NaN: the frame shows only the world within half a frame of it (the object, whole,
    never its other side across an edge). NaN shows the torus as it is."""

    drawing: Drawing
    shifts: np.ndarray
    windows: np.ndarray


class ShapesFrames:
    """A chunk's native frames, decoded (`decode_frames`) when the server asks:
    `DeferredFrames`. Holds only its own tensors (a view of the chunk's sample, which the
    stream no longer touches, and its picture), so it decodes the same after the stream's
    close."""

    def __init__(
        self, native: torch.Tensor, width: int, height: int, picture: Picture | None = None
    ) -> None:
        self._native: torch.Tensor | None = native
        self._picture = picture
        self._width = width
        self._height = height
        self.shape = (native.shape[0], height, width, 3)

    def decode(self) -> torch.Tensor:
        native = self._native
        if native is None:
            raise EngineError("a shapes chunk's frames were decoded after their release")
        with torch.inference_mode():
            return decode_frames(native, self._width, self._height, self._picture)

    def release(self) -> None:
        self._native = None
        self._picture = None


def decode_frames(
    native: torch.Tensor, width: int, height: int, picture: Picture | None
) -> torch.Tensor:
    """A chunk's frames at the requested size: drawn from its picture, or resized without one."""
    if picture is None:
        return to_uint8_frames(native, width, height)
    return draw_frames(picture, width, height)


def read_drawing(
    native: torch.Tensor, before: Drawing | None = None, sample: torch.Tensor | None = None
) -> Drawing | None:
    """A chunk's frames ((T, 3, S, S) in [-1, 1]) as one object over a plain background;
    None when two colours do not explain them (see `FIT_SHARE`).

    The colours are read from ``sample``, the whole chunk the model sampled, whose first
    frames ``native`` keeps (a shorter chunk's, perhaps moved by the follower, which
    moves no colour; by default ``native`` itself). A frame's background is its median
    colour (the object covers a tenth of the frame at most), its object's the median of
    the object's core (`CORE`). Each frame is drawn in the chunk's colours (the median
    over all its frames: steadier, and the same whatever the chunk's length), reached
    gradually over the chunk from where the chunk ``before`` ended when that is near them
    (`COLOUR_TOLERANCE`): the model's colours drift by a few levels from chunk to chunk,
    which on a flat background would be a step at every boundary. A frame whose own
    colour is far from the chunk's (a prompt's colour changing) keeps its own. A pixel's
    membership is where it lies on the line from the background's colour to the
    object's, clamped to [0, 1].
    """
    count = native.shape[0]
    sample = native if sample is None else sample
    backgrounds = sample.flatten(2).median(dim=2).values
    colours, in_sample = _core_colours(sample, backgrounds)
    background = _steady(
        backgrounds[:count],
        backgrounds.median(dim=0).values,
        None if before is None else before.background[-1],
    )
    colour, found = background.clone(), in_sample[:count]
    if bool(found.any()):
        chunk_colour = colours[in_sample].median(dim=0).values
        own = torch.where(found[:, None], colours[:count], chunk_colour)
        last = None if before is None else before.colour[-1]
        colour = torch.where(found[:, None], _steady(own, chunk_colour, last), background)
    direction = colour - background
    length = direction.square().sum(dim=1).clamp(min=1e-6)
    along = ((native - background[..., None, None]) * direction[..., None, None]).sum(dim=1)
    membership = (along / length[:, None, None]).clamp_(0.0, 1.0)
    membership = torch.where(found[:, None, None], membership, 0.0)
    drawn = background[..., None, None] + membership[:, None] * direction[..., None, None]
    unexplained = (native - drawn).abs().amax(dim=1) > FIT_TOLERANCE
    if float(unexplained.float().mean()) > FIT_SHARE:
        return None
    membership = torch.where(found[:, None, None], _restored(membership), 0.0)
    return Drawing(background=background, colour=colour, membership=membership)


def _restored(membership: torch.Tensor) -> torch.Tensor:
    """The membership (T, S, S) with the model's blur partly undone: Richardson-Lucy
    deconvolution by a Gaussian of `BLUR_SIGMA` round the torus (as the model pads),
    `RESTORE_ITERATIONS` times, mixed with the model's own by `RESTORE_SHARE`. Nothing
    here knows the prompt: the shapes come sharper from what the model drew.

    The blur is separable, so it is two products with a small circulant matrix
    (`_blur_matrix`). On arrays this small the cost is per call, not per number: the two
    products take half the time of a Fourier transform's three calls (about 1.1 ms a
    chunk of 8 frames on one thread, against 2.6), and this runs on the engine's step."""
    ring = _blur_matrix(membership.shape[-1], membership.device, membership.dtype)

    def blur(x: torch.Tensor) -> torch.Tensor:
        return ring @ x @ ring  # down the columns, then along the rows: the ring is symmetric

    observed = membership + 1e-3  # strictly positive, as the method needs
    estimate = observed
    for _ in range(RESTORE_ITERATIONS):
        estimate = estimate * blur(observed / blur(estimate).clamp(min=1e-6))
    restored = estimate.clamp(0.0, 1.0)
    return RESTORE_SHARE * restored + (1.0 - RESTORE_SHARE) * membership


@functools.cache
def _blur_matrix(size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A Gaussian blur of `BLUR_SIGMA` along a ring of ``size`` pixels, as a circulant
    (size, size) matrix: row i holds the kernel centred on pixel i, wrapping. The kernel
    is the Gaussian's transfer, exp(-2 pi^2 sigma^2 f^2), at the ring's frequencies,
    brought back to space: a Gaussian exactly periodic on the ring. It is even, so the
    matrix is symmetric."""
    frequencies = torch.fft.fftfreq(size, dtype=torch.float64)
    transfer = torch.exp(-2.0 * (math.pi * BLUR_SIGMA * frequencies).square())
    kernel = torch.fft.ifft(transfer).real
    offsets = (torch.arange(size)[:, None] - torch.arange(size)[None, :]).remainder(size)
    return kernel[offsets].to(device=device, dtype=dtype)


def _core_colours(
    frames: torch.Tensor, backgrounds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each frame's object colour, the median of its core (the pixels far from the
    frame's background, by more than `CORE` of the farthest and `OBJECT_MIN_DISTANCE` at
    least), (T, 3); and whether the frame has an object, (T,)."""
    distance = (frames - backgrounds[..., None, None]).square().sum(dim=1).sqrt()
    peak = distance.flatten(1).amax(dim=1)
    core = distance > torch.clamp(CORE * peak, min=OBJECT_MIN_DISTANCE)[:, None, None]
    colours = torch.where(core[:, None], frames, torch.nan).flatten(2).nanmedian(dim=2).values
    return colours, core.flatten(1).any(dim=1)


def _steady(own: torch.Tensor, chunk: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """Each frame's colour (T, 3): the chunk's, reached in equal steps from ``last`` (the
    colour the chunk before ended with) when that is near it; a frame's ``own`` where it
    is far from the chunk's."""
    count = own.shape[0]
    steady = chunk.expand(count, 3)
    if last is not None and float((chunk - last).square().sum().sqrt()) < COLOUR_TOLERANCE:
        share = torch.arange(1, count + 1, device=own.device, dtype=own.dtype) / count
        steady = last + share[:, None] * (chunk - last)
    near = (own - chunk).square().sum(dim=1).sqrt() < COLOUR_TOLERANCE
    return torch.where(near[:, None], steady, own)


def draw_frames(picture: Picture, width: int, height: int) -> torch.Tensor:
    """A picture drawn at (width, height): (T, height, width, 3) uint8, on its device.

    The membership is resampled at each output pixel's place in the frame's view
    (separable Keys bicubic, round the torus, within the frame's window), sharpened
    about 0.5 (`EDGE_SHARPNESS`), and the two colours composed with it.
    """
    drawing = picture.drawing
    membership = drawing.membership
    size = membership.shape[-1]
    rows = _resampling(height, size, picture.shifts[:, 1], picture.windows[:, 1], membership)
    columns = _resampling(width, size, picture.shifts[:, 0], picture.windows[:, 0], membership)
    alpha = torch.bmm(torch.bmm(rows, membership), columns.transpose(1, 2))
    steepness = EDGE_SHARPNESS * max(width, height) / size
    alpha = alpha.sub_(0.5).mul_(steepness).add_(0.5).clamp_(0.0, 1.0)
    low = (drawing.background + 1.0) * 127.5
    span = (drawing.colour - drawing.background) * 127.5
    pixels = low[:, None, None, :] + alpha[..., None] * span[:, None, None, :]
    return pixels.round_().clamp_(0.0, 255.0).to(torch.uint8)


def _resampling(
    out: int, size: int, shifts: np.ndarray, windows: np.ndarray, like: torch.Tensor
) -> torch.Tensor:
    """(T, out, size): each frame's weights of the native samples at each output pixel
    along one axis. Output pixel j is at ``(j + 0.5) * size / out`` on screen, which is
    ``shift`` less on the torus (wrapping); outside the frame's window it weighs nothing."""
    device, dtype = like.device, like.dtype
    screen = (torch.arange(out, device=device, dtype=dtype) + 0.5) * (size / out)
    shift = torch.as_tensor(shifts, device=device, dtype=dtype)
    window = torch.as_tensor(windows, device=device, dtype=dtype)
    world = screen[None] - shift[:, None]
    taps = torch.floor(world - 0.5)[..., None] + torch.arange(-1, 3, device=device, dtype=dtype)
    weights = _keys(world[..., None] - (taps + 0.5))
    inside = ~((screen[None] - window[:, None]).abs() >= size / 2)  # NaN: no window
    weights = weights * inside[..., None]
    matrix = torch.zeros(len(shifts), out, size, device=device, dtype=dtype)
    return matrix.scatter_add_(2, taps.long().remainder(size), weights)


def _keys(distance: torch.Tensor) -> torch.Tensor:
    """The Keys cubic convolution kernel (a = -0.5), what "bicubic" usually means."""
    x = distance.abs()
    near = (1.5 * x - 2.5) * x * x + 1.0
    far = ((-0.5 * x + 2.5) * x - 4.0) * x + 2.0
    return torch.where(x <= 1.0, near, torch.where(x < 2.0, far, 0.0))


def to_uint8_frames(native: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """(T, 3, S, S) in [-1, 1] -> (T, height, width, 3) uint8, on the same device: resized
    bilinearly, as they are."""
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
