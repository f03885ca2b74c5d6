"""Where the screen shows the shapes world's object: whole, never split across two edges.

The model's world is a torus: an object that leaves one edge comes back at the opposite
one, so an object across an edge is drawn in two pieces at opposite edges, which a viewer
reads as two objects (issue 35). The world's background is plain, so the screen is a
view of it whose only visible place is the object's: the engine chooses, frame by frame,
where on screen the object is shown (`ObjectView`), and the frames are drawn with the
object there (`trio_vstream.engines.shapes.pixels`), cut out of the torus whole.

Moving on its own: the object moves on screen exactly as the model moves it, one for
one, the way its prompt or a steer says; when its next step would cut it at an edge, it
comes in whole at the opposite edge, touching it (the view jumps by the screen less the
object's size): it wraps whole, never in pieces. The jump is more than half the screen,
so a reading of the motion across the torus (the evaluator's, the glass benchmark's)
still sees it go the same way.

Held by an input video (a frame whose input has a region the object follows): the
region is a place on the screen, so the object is shown where the model, moved by the
follower, put it (the view does not jump), pushed inward at an edge just far enough to
be whole: a region at an edge holds the object against it. A frame without a region goes
on moving on its own from there.

The object's place and size come from its membership (`outline`): how much of each
native pixel is object, which the pixels module reads from the model's frames.
"""

from __future__ import annotations

import math
from typing import Final

import attrs
import numpy as np

INSIDE: Final = 0.5
"""The membership at which a pixel is object: the edge the frames are drawn with."""

FAINT: Final = 0.1
"""Membership under which a pixel does not count toward the object's centre: the model's
background noise is a few hundredths, its edges' partial pixels more."""

EDGE_MARGIN: Final = 0.3
"""Native pixels kept between the drawn edge and the screen's (at 256x256, 2.4 pixels):
the drawn edge is anti-aliased over about a pixel, and its bicubic resampling may reach a
little past the linear crossing `outline` measures."""


@attrs.frozen(eq=False)
class Outline:
    """Where each frame's object is on the torus and how far it reaches from there.

    ``centres`` (T, 2): x and y in native pixels, in ``[0, size)`` (pixel i spans
    ``[i, i + 1)``), NaN for a frame without an object; ``extents`` (T, 2, 2): per axis,
    how far the object reaches before and after its centre (native pixels, with
    `EDGE_MARGIN`).
    """

    centres: np.ndarray
    extents: np.ndarray


def outline(membership: np.ndarray) -> Outline:
    """The object's centre and reach in each frame of ``membership`` ((T, S, S) in [0, 1]).

    The centre is the circular mean (the world wraps) of the object's pixels, weighed by
    their membership (the edge's partial pixels too: past `FAINT`, above the background's
    faint noise). The reach is found with the frame rolled so the object is whole at its
    middle: the outermost crossings of `INSIDE` along each axis, linearly between pixel
    centres.
    """
    count, size, _ = membership.shape
    centres = np.full((count, 2), math.nan)
    extents = np.zeros((count, 2, 2))
    angles = (np.arange(size) + 0.5) * (2.0 * math.pi / size)
    for t, frame in enumerate(membership):
        if not (frame > INSIDE).any():
            continue
        weight = np.where(frame > FAINT, frame, 0.0)
        centre = []
        for along in (weight.sum(axis=0), weight.sum(axis=1)):  # x, then y
            angle = math.atan2(float(along @ np.sin(angles)), float(along @ np.cos(angles)))
            centre.append((angle * size / (2.0 * math.pi)) % size)
        centres[t] = centre
        middle = size // 2
        moved = [middle - math.floor(c) for c in centre]
        rolled = np.roll(frame, (moved[1], moved[0]), axis=(0, 1))
        for axis, profile in ((0, rolled.max(axis=0)), (1, rolled.max(axis=1))):
            inside = np.nonzero(profile > INSIDE)[0]
            first, last = int(inside[0]), int(inside[-1])
            at = centre[axis] + moved[axis]
            low_edge = first + 0.5 - _crossing(profile, first - 1, first)
            high_edge = last + 0.5 + _crossing(profile, last + 1, last)
            extents[t, axis] = (at - low_edge + EDGE_MARGIN, high_edge - at + EDGE_MARGIN)
    return Outline(centres=centres, extents=extents)


def _crossing(profile: np.ndarray, outside: int, inside: int) -> float:
    """How far (0 to 1 pixel) from ``inside``'s centre toward ``outside``'s the profile
    crosses `INSIDE`, linearly; a full pixel past the profile's ends."""
    if not 0 <= outside < len(profile):
        return 1.0
    low, high = float(profile[outside]), float(profile[inside])
    return (high - INSIDE) / (high - low) if high > low else 0.0


class ObjectView:
    """One stream's view: where on screen each frame shows its object.

    Keeps the last frame's object (on the torus and on screen) so that the next chunk
    goes on from it.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._world: np.ndarray | None = None
        self._screen: np.ndarray | None = None

    def place(self, found: Outline, held: np.ndarray | None = None) -> np.ndarray:
        """The screen centre (x, y, native pixels) of each frame's object, (T, 2); NaN
        where a frame has none. ``held`` (T,) marks the frames an input video's region
        holds (see the module's docstring)."""
        size = self._size
        shown = np.full_like(found.centres, math.nan)
        for t, (centre, extent) in enumerate(zip(found.centres, found.extents, strict=True)):
            if not np.isfinite(centre).all():
                continue
            before, after = extent[:, 0], extent[:, 1]
            if self._world is None or self._screen is None or (held is not None and held[t]):
                screen = centre.copy()
            else:
                step = np.remainder(centre - self._world + size / 2, size) - size / 2
                screen = self._screen + step
                room = size - before - after
                screen = np.where(screen - before < 0.0, screen + room, screen)
                screen = np.where(screen + after > size, screen - room, screen)
            fits = before + after < size
            screen = np.where(fits, np.clip(screen, before, size - after), centre)
            self._world, self._screen = centre, screen
            shown[t] = screen
        return shown
