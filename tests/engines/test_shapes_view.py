"""The shapes world as a person sees it (issue 35), without the model: where the screen
shows the object (whole, never split across two edges: `ObjectView`), and frames drawn
from a drawing (a crisp edge and a flat background at any size: `draw_frames`).

The frames here are the renderer's (analytic shapes, anti-aliased, on the torus), with the
model's blur and noise added where it matters; `test_shapes_look.py` measures the model's
own frames through the encoder.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from trio_vstream.engines.shapes import pixels
from trio_vstream.engines.shapes.pixels import (
    Picture,
    draw_frames,
    read_drawing,
    to_uint8_frames,
)
from trio_vstream.engines.shapes.view import EDGE_MARGIN, ObjectView, Outline, outline
from trio_vstream.models.shapes import evaluate
from trio_vstream.models.shapes.render import NATIVE_SIZE, SIZE_RADII, coverage, palette_tensor
from trio_vstream.models.shapes.vocab import BACKGROUND_NAMES, COLOUR_NAMES, SHAPES

S = NATIVE_SIZE
LARGE = SIZE_RADII[-1]


def membership(shape: str, xs: list[float], ys: list[float], radius: float = LARGE) -> np.ndarray:
    """(T, S, S): the renderer's coverage of one object along a track, wrapping."""
    return (
        coverage(
            torch.tensor([SHAPES.index(shape)]),
            torch.tensor([radius]),
            torch.tensor([xs], dtype=torch.float32),
            torch.tensor([ys], dtype=torch.float32),
        )[0]
        .double()
        .numpy()
    )


def soften(cover: np.ndarray) -> torch.Tensor:
    """(T, S, S): the coverage softened as the model draws (a blur of about half a pixel)."""
    soft = torch.as_tensor(cover, dtype=torch.float32)[:, None]
    kernel = torch.tensor([0.2, 0.6, 0.2])
    padded = F.pad(soft, (1, 1, 1, 1), mode="circular")
    return F.conv2d(padded, (kernel[:, None] * kernel)[None, None])[:, 0]


def native_frames(
    cover: np.ndarray, colour: str = "red", background: str = "navy", noise: float = 0.0
) -> torch.Tensor:
    """(T, 3, S, S) in [-1, 1]: the coverage in two palette colours, `soften`-ed, with the
    model's faint noise (levels)."""
    fg = palette_tensor("colour")[COLOUR_NAMES.index(colour)].view(1, 3, 1, 1)
    bg = palette_tensor("background")[BACKGROUND_NAMES.index(background)].view(1, 3, 1, 1)
    frames = (bg + (fg - bg) * soften(cover)[:, None]) * 2.0 - 1.0
    generator = torch.Generator().manual_seed(0)
    return frames + torch.randn(frames.shape, generator=generator) * (noise / 127.5)


def whole(shown: np.ndarray, found: Outline) -> bool:
    """Every frame's object lies inside the screen, margins and all."""
    before, after = found.extents[..., 0], found.extents[..., 1]
    return bool(((shown - before) >= -1e-9).all() and ((shown + after) <= S + 1e-9).all())


# ------------------------------------------------------------------ where it is shown


@pytest.mark.parametrize("shape", SHAPES)
def test_the_outline_finds_the_object_whole_even_across_an_edge(shape: str) -> None:
    """The same object found at the same place relative to where it was drawn, with the
    same reach, in the middle and across an edge or a corner of the torus."""
    xs, ys = [16.0, 0.5, 31.2], [12.0, 31.0, 0.3]
    found = outline(membership(shape, xs, ys))
    offsets = np.remainder(found.centres - np.array([xs, ys]).T + S / 2, S) - S / 2
    assert np.abs(offsets - offsets[0]).max() < 0.1
    assert np.abs(offsets[0, 0]) < 0.1  # (a triangle's centre is its centroid, lower down)
    # Its reach: the shape's, and the margin, within the half pixel a sampled edge may
    # take (a triangle's apex more: its tip is the thinnest part).
    half_width = {"circle": LARGE, "square": 0.85 * LARGE, "triangle": LARGE}[shape]
    assert np.allclose(found.extents[:, 0], half_width + EDGE_MARGIN, atol=0.5)
    up, down = {"circle": (LARGE, LARGE), "square": (0.85 * LARGE,) * 2}.get(
        shape,
        (1.2 * LARGE, 0.6 * LARGE),  # from the triangle's centroid
    )
    assert np.allclose(found.extents[:, 1, 0], up + EDGE_MARGIN, atol=1.0 if up > LARGE else 0.5)
    assert np.allclose(found.extents[:, 1, 1], down + EDGE_MARGIN, atol=0.5)


def test_an_object_moving_on_its_own_wraps_whole_and_keeps_its_way() -> None:
    """A large circle moving left for 48 frames crosses the left edge twice: the screen
    shows it moving left a pixel a frame, and jumping, whole, to the right edge when its
    next step would cut it; read round the torus (as the evaluator reads motion), the jump
    is a move left too. Chunk by chunk, the view goes on where it was."""
    xs = [16.0 - t for t in range(48)]
    found = outline(membership("circle", xs, [16.0] * 48))
    shown = ObjectView(S).place(found)
    assert whole(shown, found)
    steps = np.diff(shown[:, 0])
    jumps = np.abs(steps + 1.0) > 1e-6
    assert 2 <= jumps.sum() <= 3
    assert np.allclose(steps[~jumps], -1.0)
    assert (steps[jumps] > S / 2).all()  # in from the right edge, more than half a screen on
    assert (np.remainder(steps + S / 2, S) - S / 2 < 0).all()  # read round the torus: left
    assert np.allclose(shown[:, 1], 16.0, atol=0.01)
    # The moment it jumps, it touches the opposite edge: it wraps as late as it can.
    after = found.extents[1:, 0, 1][jumps]
    assert np.allclose(shown[1:, 0][jumps] + after, S, atol=1.01)

    view = ObjectView(S)
    chunked = [
        view.place(Outline(found.centres[i : i + 8], found.extents[i : i + 8]))
        for i in range(0, 48, 8)
    ]
    np.testing.assert_array_equal(np.concatenate(chunked), shown)


def test_the_first_frame_is_pushed_in_whole_and_a_still_object_stays_put() -> None:
    found = outline(membership("square", [2.0] * 4, [30.5] * 4))
    shown = ObjectView(S).place(found)
    assert whole(shown, found)
    assert np.allclose(shown, shown[0])  # pushed in once, then where the model keeps it
    assert shown[0, 0] == pytest.approx(found.extents[0, 0, 0])  # just far enough
    assert shown[0, 1] == pytest.approx(S - found.extents[0, 1, 1])


def test_a_held_object_is_shown_where_the_world_has_it_pushed_in_at_an_edge() -> None:
    """An input's region holds the object: no jump, the view is the world's, and an
    object at an edge is held against it, whole; let go, it moves on from there."""
    xs = [20.0, 26.0, 29.0, 31.5, 1.0, 1.0, 0.0]
    found = outline(membership("circle", xs, [10.0] * 7))
    held = np.array([True] * 5 + [False] * 2)
    shown = ObjectView(S).place(found, held)
    assert whole(shown, found)
    assert np.allclose(shown[:2, 0], xs[:2], atol=0.05)
    edge = S - found.extents[2:4, 0, 1]
    assert np.allclose(shown[2:4, 0], np.minimum(xs[2:4], edge), atol=0.05)
    assert shown[4, 0] == pytest.approx(found.extents[4, 0, 0])  # across the edge: held at the left
    assert shown[5, 0] == pytest.approx(shown[4, 0])  # let go: the model kept it still
    assert shown[6, 0] > S / 2  # moving left from the left edge, it wraps whole


def test_a_frame_without_an_object_has_no_place() -> None:
    cover = membership("circle", [10.0, 11.0], [10.0, 10.0])
    cover[1] = 0.0
    shown = ObjectView(S).place(outline(cover))
    assert np.isfinite(shown[0]).all() and np.isnan(shown[1]).all()


# ------------------------------------------------------------------ drawn


def test_the_drawing_is_read_in_the_models_colours() -> None:
    cover = membership("triangle", [10.0, 11.0, 12.0], [20.0] * 3)
    drawing = read_drawing(native_frames(cover, "yellow", "white", noise=4.0))
    assert drawing is not None
    levels = lambda colour: (colour + 1.0) * 127.5  # noqa: E731
    white = palette_tensor("background")[BACKGROUND_NAMES.index("white")] * 255
    yellow = palette_tensor("colour")[COLOUR_NAMES.index("yellow")] * 255
    assert (levels(drawing.background) - white).abs().max() < 1.5
    assert (levels(drawing.colour) - yellow).abs().max() < 3.0
    # The membership: what the model drew (the noise: 4 of 210 levels), with the model's
    # blur partly undone (`test_the_models_blur_is_partly_undone_whatever_the_shape`).
    assert (drawing.membership - soften(cover)).abs().max() < 0.25


@pytest.mark.parametrize("shape", ["circle", "square", "triangle"])
def test_the_models_blur_is_partly_undone_whatever_the_shape(shape: str) -> None:
    truth = torch.as_tensor(membership(shape, [10.0, 11.5], [20.0, 20.5]), dtype=torch.float32)
    taps = torch.arange(-3, 4, dtype=torch.float32)
    gauss = torch.exp(-taps.square() / (2 * pixels.BLUR_SIGMA**2))
    kernel = torch.outer(gauss, gauss) / gauss.sum() ** 2
    drawn = F.conv2d(F.pad(truth[:, None], (3,) * 4, mode="circular"), kernel[None, None])[:, 0]
    restored = pixels._restored(drawn)
    assert float(restored.min()) >= 0.0 and float(restored.max()) <= 1.0
    assert (restored - truth).abs().sum() < 0.9 * (drawn - truth).abs().sum()


def test_the_blur_the_restoration_undoes_is_a_gaussian_round_the_torus() -> None:
    """`_blur_matrix` as the restoration applies it (``ring @ x @ ring``): a point at a
    corner spreads as a Gaussian of `BLUR_SIGMA` across the edges it touches, and the
    blur keeps the total."""
    ring = pixels._blur_matrix(S, torch.device("cpu"), torch.float32)
    point = torch.zeros(S, S)
    point[0, 0] = 1.0
    blurred = ring @ point @ ring
    assert float(blurred.sum()) == pytest.approx(1.0, abs=1e-5)
    offsets = torch.arange(-4, 5)
    gauss = torch.exp(-offsets.float().square() / (2 * pixels.BLUR_SIGMA**2))
    expected = torch.outer(gauss, gauss) / gauss.sum() ** 2
    rows = offsets.remainder(S)
    assert (blurred[rows][:, rows] - expected).abs().max() < 1e-3
    assert float(blurred[6:-6, 6:-6].abs().max()) < 1e-6  # nothing far from the point


def test_frames_two_colours_do_not_explain_are_not_a_drawing() -> None:
    """A photograph as ``image_reference`` stays a photograph: resized, not redrawn."""
    generator = torch.Generator().manual_seed(1)
    texture = torch.rand(2, 3, S, S, generator=generator) * 2.0 - 1.0
    assert read_drawing(texture) is None
    cover = membership("circle", [10.0, 11.0], [10.0, 10.0])
    assert read_drawing(native_frames(cover, noise=4.0)) is not None


def test_the_colours_drift_gradually_from_chunk_to_chunk_and_change_at_once() -> None:
    cover = membership("circle", [10.0 + t for t in range(16)], [10.0] * 16)
    frames = native_frames(cover, "red", "gray")
    first = read_drawing(frames[:8])
    assert first is not None
    drifted = frames[8:] + 3.0 / 127.5  # the model's background a few levels lighter
    second = read_drawing(drifted, first)
    assert second is not None
    steps = torch.diff(torch.cat([first.background[-1:], second.background]), dim=0) * 127.5
    assert steps.abs().max() < 0.5  # eight steps of 3/8 of a level, no jump
    assert torch.allclose(
        second.background[-1] * 127.5, first.background[-1] * 127.5 + 3.0, atol=0.1
    )
    changed = read_drawing(native_frames(cover[8:], "red", "white"), first)
    assert changed is not None  # a prompt changed the background: taken at once
    assert (changed.background[0] - changed.background[-1]).abs().max() < 1e-6


@pytest.mark.parametrize(("width", "height"), [(256, 256), (512, 512), (832, 480), (64, 64)])
def test_drawn_frames_are_crisp_flat_and_whole_at_any_size(width: int, height: int) -> None:
    """The model's soft 32x32 frames, with an object across the edge: drawn, the edge goes
    from 10% to 90% in at most 3 pixels and the background is one colour; resized as they
    were, the same frames show a soft edge, a noisy background and the object in two."""
    xs, ys = [0.4, 31.6, 30.6], [16.0, 16.5, 17.0]
    cover = membership("circle", xs, ys)
    native = native_frames(cover, "red", "navy", noise=4.0)
    drawing = read_drawing(native)
    assert drawing is not None
    found = outline(drawing.membership.double().numpy())
    shown = ObjectView(S).place(found)
    picture = Picture(drawing=drawing, shifts=shown - found.centres, windows=shown)
    frames = draw_frames(picture, width, height).numpy()
    assert frames.shape == (3, height, width, 3) and frames.dtype == np.uint8
    seen = evaluate.look(frames)
    assert not seen.split.any() and not seen.cut.any()
    assert len(seen.edge_widths) >= 4 * 3 and np.median(seen.edge_widths) <= 3.0
    assert seen.edge_widths.max() <= 3.5
    assert np.nanmax(seen.noise) == 0.0

    resized = evaluate.look(to_uint8_frames(native, width, height).numpy())
    assert resized.split.all()
    if width >= 256:
        assert np.median(resized.edge_widths) > 3.0 * width / 256
        assert np.nanmin(resized.noise) > 2.0


def test_a_drawn_edge_is_as_steep_at_every_scale() -> None:
    """No upscaled blur: the edge's width in output pixels does not grow with the size."""
    cover = membership("square", [16.0], [16.0])
    drawing = read_drawing(native_frames(cover))
    assert drawing is not None
    centre = np.array([[16.0, 16.0]])
    widths = []
    for size in (64, 128, 256, 512, 1024):
        frames = draw_frames(Picture(drawing, np.zeros((1, 2)), centre), size, size).numpy()
        widths.append(float(np.median(evaluate.look(frames).edge_widths)))
    assert max(widths) - min(widths) < 0.6 and max(widths) <= 2.0, widths
    assert not math.isnan(sum(widths))
