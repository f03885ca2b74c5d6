"""Where the shapes world's object starts (issue 22): whole, away from the torus's edges.

The world wraps, so an object drawn from a start near an edge shows in pieces at opposite
edges, which a viewer reads as two objects. The start is drawn from the seed inside a
margin; checked as arithmetic over many seeds, then on the model's own first frames for
the seeds whose start is nearest an edge, with the largest object.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engines.test_shapes_engine import frames_of, request, run
from trio_vstream.engines.shapes import START_MARGIN, ShapesEngine, create_engine, start_position
from trio_vstream.models.shapes import evaluate
from trio_vstream.models.shapes.render import NATIVE_SIZE, SIZE_RADII, render_slots
from trio_vstream.models.shapes.vocab import SHAPES

SEEDS = range(2000)


@pytest.fixture(scope="module")
def engine() -> ShapesEngine:
    return create_engine(device="cpu")


def edge_distance(seed: int) -> float:
    """How near the seed's start is to the nearest edge (native pixels)."""
    x, y = start_position(seed, NATIVE_SIZE)
    return min(x, y, NATIVE_SIZE - x, NATIVE_SIZE - y)


def touches_an_edge(mask: np.ndarray) -> bool:
    return bool(mask[0].any() or mask[-1].any() or mask[:, 0].any() or mask[:, -1].any())


def test_every_start_keeps_the_margin_and_the_starts_spread() -> None:
    starts = np.array([start_position(seed, NATIVE_SIZE) for seed in SEEDS])
    assert starts.min() >= START_MARGIN and starts.max() <= NATIVE_SIZE - START_MARGIN
    # Still a spread, not one place: each axis covers most of what the margin leaves.
    room = NATIVE_SIZE - 2 * START_MARGIN
    assert np.ptp(starts, axis=0).min() > 0.9 * room
    assert start_position(5, NATIVE_SIZE) == start_position(5, NATIVE_SIZE)  # from the seed


@pytest.mark.parametrize("shape", SHAPES)
def test_the_largest_object_drawn_at_a_start_on_the_margin_is_whole(shape: str) -> None:
    """The margin's arithmetic, on the renderer: one frame of motion from the nearest start
    the margin allows, the largest object of each shape touches no edge."""
    reach = START_MARGIN - 1.0
    for x, y in ((reach, reach), (NATIVE_SIZE - reach, NATIVE_SIZE - reach)):
        frame = render_slots(0, SHAPES.index(shape), 0, len(SIZE_RADII) - 1, x, y)
        assert not touches_an_edge(frame.amax(0).numpy() > 0.02)


@pytest.mark.slow
def test_the_models_first_frame_shows_the_object_whole_for_the_seeds_nearest_an_edge(
    engine: ShapesEngine,
) -> None:
    """The model puts the object where the engine says, so its first frame is whole too:
    the six seeds (of 2000) whose start is nearest an edge, a large object of each shape
    (before the margin, every one of them showed the object cut by an edge)."""
    nearest = sorted(SEEDS, key=edge_distance)[:6]
    for i, seed in enumerate(nearest):
        shape = SHAPES[i % len(SHAPES)]
        prompt = f"a large red {shape} on a black background"
        req = request(prompt, seed=seed, num_frames=1, width=NATIVE_SIZE, height=NATIVE_SIZE)
        frame = frames_of(run(engine, req), size=NATIVE_SIZE)[0]
        mask = evaluate.object_mask(frame, evaluate.background_colour(frame[None]))
        assert mask.sum() > 20, f"seed {seed}: no object"
        assert not touches_an_edge(mask), f"seed {seed} ({shape}): the object is cut by an edge"
