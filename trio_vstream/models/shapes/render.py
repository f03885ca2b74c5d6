"""The procedural renderer: training data for the shapes model, drawn on the fly.

The world is a torus of ``size`` x ``size`` native pixels: an object that
leaves one edge comes back at the opposite one (wrap, not bounce), so motion
is a pure translation and one context frame plus the motion word determine
the future. Objects are drawn with analytic anti-aliasing (coverage of each
pixel by the shape's signed distance), so sub-pixel positions are visible and
the model learns smooth edges. Everything is batched torch on any device.

Geometry, in native pixels for ``radius`` r: a circle of radius r, an
axis-aligned square of half-side 0.85 r, an upward triangle with its apex r
above the centre, its base 0.8 r below, and half-width r at the base (so it
fills exactly half of its bounding box, which is how the evaluator tells it
from a square, which fills all of it, and a circle, which fills pi/4).
"""

from __future__ import annotations

import torch

from trio_vstream.models.shapes.vocab import (
    BACKGROUNDS,
    MOTION_VECTORS,
    MOTIONS,
    OBJECT_COLOURS,
)

NATIVE_SIZE = 32
SIZE_RADII = (3.5, 5.5)
"""Radius in native pixels for ``small`` and ``large``."""
SQUARE_HALF_SIDE = 0.85
TRIANGLE_APEX = 1.0
TRIANGLE_BASE = 0.8


def palette_tensor(kind: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """(N, 3) float colours in 0..1 for ``"colour"`` or ``"background"``, in slot order."""
    table = OBJECT_COLOURS if kind == "colour" else BACKGROUNDS
    return torch.tensor(list(table.values()), dtype=torch.float32, device=device) / 255.0


def motion_tensor(device: torch.device | str = "cpu") -> torch.Tensor:
    """(5, 2) per-frame displacement (dx, dy) for each motion index."""
    return torch.tensor([MOTION_VECTORS[m] for m in MOTIONS], dtype=torch.float32, device=device)


def coverage(
    shape: torch.Tensor,
    radius: torch.Tensor,
    cx: torch.Tensor,
    cy: torch.Tensor,
    size: int = NATIVE_SIZE,
) -> torch.Tensor:
    """Pixel coverage in 0..1 of each object, (B, T, size, size).

    ``shape`` and ``radius`` are (B,); ``cx``/``cy`` are (B, T) centres in
    pixel units (pixel i spans [i, i+1)). Distances wrap around the torus.
    """
    device = cx.device
    grid = torch.arange(size, dtype=torch.float32, device=device) + 0.5
    half = size / 2.0
    dx = torch.remainder(grid.view(1, 1, 1, size) - cx[..., None, None] + half, size) - half
    dy = torch.remainder(grid.view(1, 1, size, 1) - cy[..., None, None] + half, size) - half
    r = radius.view(-1, 1, 1, 1)
    # Signed distances (negative inside), one per shape, then pick per sample.
    circle = torch.sqrt(dx * dx + dy * dy) - r
    h = SQUARE_HALF_SIDE * r
    square = torch.maximum(dx.abs() - h, dy.abs() - h)
    top, bottom, half_width = -TRIANGLE_APEX * r, TRIANGLE_BASE * r, r
    height = bottom - top
    # The two slanted edges: distance to the line through the apex and a base corner.
    norm = torch.sqrt(height * height + half_width * half_width)
    slant = (height * dx.abs() - half_width * (dy - top)) / norm
    triangle = torch.maximum(slant, dy - bottom)
    sdf = torch.where(
        shape.view(-1, 1, 1, 1) == 0,
        circle,
        torch.where(shape.view(-1, 1, 1, 1) == 1, square, triangle),
    )
    return torch.clamp(0.5 - sdf, 0.0, 1.0)


def render(
    colour_rgb: torch.Tensor,
    background_rgb: torch.Tensor,
    shape: torch.Tensor,
    radius: torch.Tensor,
    cx: torch.Tensor,
    cy: torch.Tensor,
    size: int = NATIVE_SIZE,
) -> torch.Tensor:
    """Frames (B, T, 3, size, size) in 0..1: each object over its background."""
    cov = coverage(shape, radius, cx, cy, size)[:, :, None]
    fg = colour_rgb.view(-1, 1, 3, 1, 1)
    bg = background_rgb.view(-1, 1, 3, 1, 1)
    return bg + (fg - bg) * cov


def render_slots(
    colour: int,
    shape: int,
    background: int,
    size_index: int,
    x: float,
    y: float,
    size: int = NATIVE_SIZE,
) -> torch.Tensor:
    """One frame (3, size, size) in 0..1, for tests and image-to-video examples."""
    frames = render(
        palette_tensor("colour")[colour][None],
        palette_tensor("background")[background][None],
        torch.tensor([shape]),
        torch.tensor([SIZE_RADII[size_index] * size / NATIVE_SIZE]),
        torch.tensor([[x]]),
        torch.tensor([[y]]),
        size,
    )
    return frames[0, 0]


HINT_SIGMA = 1.5


def position_hint(x: torch.Tensor, y: torch.Tensor, size: int = NATIVE_SIZE) -> torch.Tensor:
    """(B, 1, size, size): a Gaussian blob (peak 1) at each (x, y), wrapping round the torus.

    The model's start-position input for chunks without a context frame.
    """
    grid = torch.arange(size, dtype=torch.float32, device=x.device) + 0.5
    half = size / 2.0
    dx = torch.remainder(grid.view(1, 1, size) - x.view(-1, 1, 1) + half, size) - half
    dy = torch.remainder(grid.view(1, size, 1) - y.view(-1, 1, 1) + half, size) - half
    return torch.exp(-(dx * dx + dy * dy) / (2.0 * HINT_SIGMA**2))[:, None]
