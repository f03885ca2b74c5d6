#!/usr/bin/env python3
"""The picture in docs/shapes.md: frames of the ``shapes`` model as a browser shows them.

``python bench/shapes_card.py`` runs the engine in this process, encodes each chunk with
the server's encoder and decodes the H.264 (`bench.shapes_look.stream_clip`), and lays
frames side by side in ``docs/shapes-frames.png`` (or ``--output``):

* top row: the player page's default prompt, "a red circle moving left on a navy
  background", at 256x256 with the page's Live settings (3 steps, no guidance), a frame
  every half second for four seconds (the circle crosses the left edge, and comes in
  whole at the right);
* bottom row: a steered session, "a red circle staying still on a navy background", as
  the page's keys steer it (a camera velocity each: right, up, left, down, two chunks
  apart from the second chunk on), a frame every half second.

Frames are 256x256, 8 pixels apart on white.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO_DIR = Path(__file__).resolve().parent.parent
if str(REPO_DIR) not in sys.path:
    sys.path.insert(0, str(REPO_DIR))

from bench._frames import encode_frame  # noqa: E402
from bench.shapes_look import PROMPTS, stream_clip  # noqa: E402
from trio_vstream.engines.contract import Engine, PromptChange  # noqa: E402
from trio_vstream.values import Camera  # noqa: E402

SIZE = 256
GAP = 8
EVERY = 12
"""Frames between two shown: half a second at 24 fps."""
LIVE_STEPS, LIVE_GUIDANCE = 3, 1.0
"""The page's Live settings (the engine's ``live_settings``)."""
STEERED = "a red circle staying still on a navy background"
KEYS = {
    "right": (0.1, 0.0, 0.0),
    "up": (0.0, 0.1, 0.0),
    "left": (-0.1, 0.0, 0.0),
    "down": (0.0, -0.1, 0.0),
}
"""The camera velocity each key sends (+Y is up), as the page steers."""


def rows(engine: Engine, frames: int) -> list[np.ndarray]:
    """The two rows' frames, each (N, SIZE, SIZE, 3)."""
    prompt, seed = PROMPTS[0]
    default = stream_clip(
        engine,
        prompt,
        seed=seed,
        num_frames=frames,
        width=SIZE,
        height=SIZE,
        num_inference_steps=LIVE_STEPS,
        guidance_scale=LIVE_GUIDANCE,
    )
    changes = {
        1 + 2 * i: PromptChange(key, None, 0, Camera("velocity", velocity, (0.0, 0.0, 0.0, 1.0)))
        for i, (key, velocity) in enumerate(KEYS.items())
    }
    steered = stream_clip(
        engine,
        STEERED,
        seed=seed,
        num_frames=frames,
        width=SIZE,
        height=SIZE,
        changes=changes,
        num_inference_steps=LIVE_STEPS,
        guidance_scale=LIVE_GUIDANCE,
    )
    return [clip[::EVERY] for clip in (default, steered)]


def card(clips: list[np.ndarray]) -> np.ndarray:
    """The rows laid out on white, GAP pixels apart: (H, W, 3) uint8."""
    columns = max(len(clip) for clip in clips)
    height = len(clips) * SIZE + (len(clips) - 1) * GAP
    width = columns * SIZE + (columns - 1) * GAP
    picture = np.full((height, width, 3), 255, dtype=np.uint8)
    for row, clip in enumerate(clips):
        for column, frame in enumerate(clip):
            top, left = row * (SIZE + GAP), column * (SIZE + GAP)
            picture[top : top + SIZE, left : left + SIZE] = frame
    return picture


def main(argv: list[str] | None = None) -> int:
    from trio_vstream.engines.shapes import create_engine

    parser = argparse.ArgumentParser(
        prog="python bench/shapes_card.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--output", type=Path, default=REPO_DIR / "docs" / "shapes-frames.png")
    parser.add_argument("--frames", type=int, default=96, help="frames per session")
    args = parser.parse_args(argv)
    engine = create_engine(device="cpu")
    args.output.write_bytes(encode_frame(card(rows(engine, args.frames)), "png"))
    print(f"written {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
