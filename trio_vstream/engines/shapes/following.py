"""How the shapes world follows an input video: where the input's coloured region is, and
how far each generated frame moves toward it.

The model has no input for a video: it draws its object where its context and motion say.
So the engine reads one thing from each input frame, where its dominant coloured region
is (`region_centres`), finds where the model drew its object in the matching generated
frame (`object_centres`), and moves that frame toward the region (`follow_offsets`,
`shift_frames`). The world is a torus seen from the front, so moving a whole frame is
moving the view: the frame stays one the model could have drawn, its colours, shape and
background the prompt's.

``VideoInput.strength`` sets how quickly the object follows: each frame closes ``1 -
strength`` of the gap between where the object would be (where it was, plus the model's
own motion) and the region. 0 puts it on the region every frame, 1 never moves it (the
frames are the model's, as without input), and the default 0.6 follows a moving region a
frame or two behind. With no region in a frame, the object keeps its own motion from
where it is. Two things hold whatever the strength below 1:

- A stream starts where its input is: the first frame with a region puts the object on
  it, rather than a random place the model chose before it saw the input.
- The gap is taken across the screen, never round the torus's edge: the region is a place
  on the screen (the view holds the object there, `trio_vstream.engines.shapes.view`), so
  an object far from it glides over to it instead of leaving at one edge and coming in at
  the other.

The work is small and fixed per frame: the input is read on a grid of at most
`REGION_GRID` samples a side (numpy, on the host), the model's frames at their native
32x32 (torch, on the model's device). `InputFollower` holds what carries from one chunk
to the next.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import torch

REGION_GRID: Final = 64
"""Samples along the input's longer side: the region is found on this grid, so its cost
does not grow with the request's size (a 1080p frame is read at 64x36 points)."""

REGION_CHROMA: Final = 80
"""Levels of chroma (the largest channel minus the smallest) below which a pixel is no
colour: greys, darks and whites of any texture, sensor noise (a pixel of a grey with noise
of 20 levels a channel passes it about once in a hundred) and the colour fringes of JPEG's
subsampled chroma. A pixel counts by how far it passes, so the strongest colour weighs most."""

HUE_BINS: Final = 12
"""Hue bins (30 degrees each) over which the dominant colour is found: the region is the
pixels within a bin of the heaviest three adjacent bins' centre, so two coloured things of
different hues are never averaged into a point between them."""

REGION_MIN_MASS: Final = 0.002 * 64
"""A frame's region must weigh at least this per sample of the grid (0.2% of the frame at
64 levels past `REGION_CHROMA`), or the frame has none: scattered coloured noise is no region."""

OBJECT_MIN_DISTANCE: Final = 0.25
"""How far (in the model's [-1, 1] units, about 32 levels) the model's object must differ
from its background to be found; the palette's closest pair differs by far more."""


def region_centres(frames: np.ndarray) -> np.ndarray:
    """Where each input frame's dominant coloured region is: (T, 2) centres ``(x, y)`` as
    fractions of the width and height, NaN for a frame without one.

    ``frames`` is (T, H, W, 3) uint8 RGB. The dominant hue is chosen over the whole chunk
    (so the region a chunk follows does not flip from frame to frame between two colours);
    each frame's centre is then the mean of that hue's pixels, each weighed by how far its
    chroma passes `REGION_CHROMA`.
    """
    count, height, width, _ = frames.shape
    step = max(1, math.ceil(max(height, width) / REGION_GRID))
    first = step // 2
    samples = frames[:, first::step, first::step].astype(np.float32)
    red, green, blue = samples[..., 0], samples[..., 1], samples[..., 2]
    weight = np.clip(samples.max(axis=-1) - samples.min(axis=-1) - REGION_CHROMA, 0.0, None)
    # The hue angle from the opponent colours (red against green and blue, green against
    # blue): what HSV's hue says, without its six cases.
    hue = np.arctan2(math.sqrt(3.0) / 2.0 * (green - blue), red - (green + blue) / 2.0)
    bins = (np.floor((hue + math.pi) / (2.0 * math.pi) * HUE_BINS).astype(np.int64)) % HUE_BINS
    centres = np.full((count, 2), np.nan)
    histogram = np.bincount(bins.ravel(), weights=weight.ravel(), minlength=HUE_BINS)
    if not histogram.any():
        return centres
    peak = int(np.argmax(histogram + np.roll(histogram, 1) + np.roll(histogram, -1)))
    weight = weight * (((bins - peak + 1) % HUE_BINS) < 3)
    rows, columns = weight.shape[1:]
    xs = (first + np.arange(columns) * step + 0.5) / width
    ys = (first + np.arange(rows) * step + 0.5) / height
    mass = weight.sum(axis=(1, 2))
    found = mass >= REGION_MIN_MASS * rows * columns
    safe = np.where(found, mass, 1.0)
    centres[found, 0] = (weight.sum(axis=1) @ xs / safe)[found]
    centres[found, 1] = (weight.sum(axis=2) @ ys / safe)[found]
    return centres


def object_centres(native: torch.Tensor) -> np.ndarray:
    """Where the model drew its object in each frame: (T, 2) ``(x, y)`` in native pixels
    (pixel i spans [i, i + 1)), NaN where no object stands out.

    ``native`` is (T, 3, S, S) in [-1, 1]. The background is each frame's median colour
    (the object covers a tenth of the frame at most); the object is what differs from it by
    more than half the most any pixel does, and its centre the circular mean of those
    pixels, weighed by their difference: the world wraps, and an object across an edge is
    one object. The centres cross to the host (16 numbers: on CUDA, a wait for the chunk's
    sampling, which its decode would wait for anyway).
    """
    size = native.shape[-1]
    background = native.flatten(2).median(dim=2).values
    distance = (native - background[..., None, None]).square().sum(dim=1).sqrt()
    peak = distance.amax(dim=(1, 2))
    weight = torch.where(distance > 0.5 * peak[:, None, None], distance, 0.0)
    angles = (torch.arange(size, device=native.device, dtype=native.dtype) + 0.5) * (
        2.0 * math.pi / size
    )
    along_x, along_y = weight.sum(dim=1), weight.sum(dim=2)
    x = torch.atan2(along_x @ angles.sin(), along_x @ angles.cos())
    y = torch.atan2(along_y @ angles.sin(), along_y @ angles.cos())
    centres = (torch.stack([x, y], dim=1) * (size / (2.0 * math.pi))).remainder(size)
    centres = torch.where((peak > OBJECT_MIN_DISTANCE)[:, None], centres, math.nan)
    return centres.double().cpu().numpy()


def follow_offsets(
    own: np.ndarray,
    targets: np.ndarray,
    gain: float,
    start: np.ndarray,
    size: int,
    placed: bool = True,
) -> tuple[np.ndarray, bool]:
    """How far to move each frame, (T, 2) native pixels: the object's path as it follows;
    and whether the object has been placed on a region yet.

    ``own`` is where the model drew its object in each frame and ``targets`` where the
    input's region is (both (T, 2) native pixels, NaN for none); ``start`` the offset the
    frame before had (the previous chunk's leftover, `InputFollower`). Frame j's object
    would be at ``own[j]`` plus the offset before it (where the object was, moved by the
    model's own motion), a place on the screen; it goes ``gain`` of the way from there to
    the target, across the screen. Until ``placed``, the first frame with a target and an
    object goes all the way. A frame without a target or an object keeps the offset before
    it: the object moves as the model moves it.
    """
    offsets = np.empty((len(own), 2))
    offset = np.asarray(start, dtype=np.float64)
    for j, (mine, target) in enumerate(zip(own, targets, strict=True)):
        if gain > 0.0 and np.isfinite(mine).all() and np.isfinite(target).all():
            gap = target - np.remainder(mine + offset, size)
            offset = offset + (gain if placed else 1.0) * gap
            placed = True
        offsets[j] = offset
    return offsets, placed


def shift_frames(native: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    """``native`` (T, 3, S, S), frame j moved by ``offsets[j]`` (x, y) native pixels round
    the torus, bilinearly between whole pixels (as the frames are later resized: no ringing
    around the object, which a Fourier shift would add)."""
    shifted = native
    size = native.shape[-1]
    index = torch.arange(size, device=native.device)
    for axis, dim in ((0, 3), (1, 2)):
        amount = torch.as_tensor(offsets[:, axis], dtype=native.dtype, device=native.device)
        whole = amount.floor()
        part = (amount - whole).view(-1, 1, 1, 1)
        # Moved by d = n + f: out[i] = (1 - f) in[i - n] + f in[i - n - 1], wrapping.
        source = (index[None] - whole.long()[:, None]).remainder(size)
        shape = [len(offsets), 1, 1, 1]
        shape[dim] = size
        near = source.view(shape).expand_as(native)
        far = (source - 1).remainder(size).view(shape).expand_as(native)
        shifted = (1.0 - part) * shifted.gather(dim, near) + part * shifted.gather(dim, far)
    return shifted


class InputFollower:
    """One stream's following of its input: the gain its strength gives, and the part of
    the last frame's offset the next chunk starts from.

    The next chunk is conditioned on the last frame moved by whole pixels only (an exact
    copy of the model's pixels, never resampled twice: a still object would blur chunk
    after chunk); the fraction left over moves that chunk's frames, so the object does not
    jump at the boundary.
    """

    def __init__(self, strength: float, size: int) -> None:
        self.gain = 1.0 - strength
        self._size = size
        self._leftover = np.zeros(2)
        self._placed = False

    def follow(
        self, native: torch.Tensor, targets: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's frames moved toward ``targets`` (T, 2 native pixels, NaN for none),
        and the context frame (1, 3, S, S) the next chunk continues from."""
        count = native.shape[0]
        if self.gain <= 0.0 or not np.isfinite(targets).any():
            offsets = np.tile(self._leftover, (count, 1))
        else:
            own = object_centres(native)
            offsets, self._placed = follow_offsets(
                own, targets, self.gain, self._leftover, self._size, self._placed
            )
        whole = np.round(offsets[-1])
        self._leftover = offsets[-1] - whole
        context = native[-1:].roll(shifts=(int(whole[1]), int(whole[0])), dims=(2, 3)).clone()
        if not offsets.any():
            return native, context
        return shift_frames(native, offsets), context
