"""`engines.frames.frame_count`: a chunk's frame count, read without touching its data."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from trio_vstream.engines.frames import frame_count


class NoCopy:
    """Frames whose data must not be touched: only their shape may be read."""

    shape = (5, 8, 8, 3)

    def cpu(self) -> Any:
        raise AssertionError("the count copied the frames")

    def __len__(self) -> int:
        raise AssertionError("the count iterated the frames")


@pytest.mark.parametrize(
    ("frames", "count"),
    [
        (np.zeros((7, 4, 4, 3), np.uint8), 7),
        (torch.zeros((3, 4, 4, 3), dtype=torch.uint8), 3),
        ([np.zeros((4, 4, 3), np.uint8)] * 2, 2),
        (NoCopy(), 5),
        (object(), 0),  # neither shape nor length: the encode says what is wrong
        (np.float32(1.0), 0),  # a shape of ()
    ],
)
def test_frame_count(frames: Any, count: int) -> None:
    assert frame_count(frames) == count
