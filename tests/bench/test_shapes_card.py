"""``bench/shapes_card.py``, the picture in docs/shapes.md: it lays the two sessions' decoded
frames out as it says, so that the picture can be made again on any commit."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from bench import shapes_card

pytestmark = [pytest.mark.bench, pytest.mark.slow]


def test_the_card_shows_both_sessions_a_frame_every_half_second(tmp_path: Path) -> None:
    out = tmp_path / "card.png"
    assert shapes_card.main(["--frames", "24", "--output", str(out)]) == 0
    with av.open(str(out)) as container:
        picture = next(container.decode(video=0)).to_ndarray(format="rgb24")
    size, gap = shapes_card.SIZE, shapes_card.GAP
    assert picture.shape == (2 * size + gap, 2 * size + gap, 3)  # frames 0 and 12, two rows
    assert (picture[size : size + gap] == 255).all()  # white between the rows
    for top in (0, size + gap):
        frame = picture[top : top + size, :size]
        assert len(np.unique(frame.reshape(-1, 3), axis=0)) > 2  # a frame, not a blank
