#!/usr/bin/env python3
"""What a keyframe at chunk starts costs: the bitrate of an IDR every chunk (so that a
viewer can join, or resume after falling behind, at any chunk) against every k-th chunk
and against x264's own placement (every 250 frames, and at scene cuts).

The frames come from the engines themselves, called in this process (no server), so
every variant encodes exactly the same pictures; only the encoder's keyframe placement
differs. Media bytes only: the init segment and the trailer are the same for all.

    python bench/keyframe_cost.py                    # the published table (a minute or two)
    python bench/keyframe_cost.py --quick            # small sizes, for a smoke test
    python bench/keyframe_cost.py --json out.json    # every figure, for a record
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict

import attrs
import numpy as np

REPO_DIR = Path(__file__).resolve().parent.parent
if str(REPO_DIR) not in sys.path:
    sys.path.insert(0, str(REPO_DIR))

from trio_vstream.engines.contract import (  # noqa: E402
    Checkpoint,
    Engine,
    GenerationRequest,
)
from trio_vstream.engines.frames import frames_to_uint8_array  # noqa: E402
from trio_vstream.media.encoding import FragmentedMP4Encoder  # noqa: E402

INTERVALS = (0, 1, 2, 4)
"""Chunks from one forced IDR to the next; 0: x264 decides."""


@attrs.frozen
class Case:
    engine: str
    width: int
    height: int
    chunk_frames: int
    num_frames: int
    fps: int = 24
    prompt: str = "a red circle moving left on a navy background"


PUBLISHED = (
    Case("synthetic", 832, 480, 16, 192),
    Case("synthetic", 832, 480, 8, 192),
    Case("synthetic", 256, 256, 8, 192),
    Case("shapes", 256, 256, 0, 96, prompt="a red circle moving left on a navy background"),
)
QUICK = (Case("synthetic", 128, 96, 8, 48), Case("shapes", 128, 128, 0, 24))


def make_engine(case: Case) -> Engine:
    if case.engine == "synthetic":
        from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings

        return SyntheticEngine(SyntheticSettings(chunk_frames=case.chunk_frames))
    from trio_vstream.engines.shapes import create_engine

    return create_engine(device="cpu")


def generate(case: Case) -> list[np.ndarray]:
    """The engine's chunks for one request, as (T, H, W, 3) uint8 arrays."""
    engine = make_engine(case)
    request = GenerationRequest(
        request_id="keyframe-cost",
        prompt=case.prompt,
        width=case.width,
        height=case.height,
        fps=case.fps,
        num_frames=case.num_frames,
        seed=0,
    )
    stream = engine.open_stream(request)
    chunks = []
    try:
        while (chunk := stream.next_chunk(Checkpoint())) is not None:
            chunks.append(frames_to_uint8_array(chunk.frames, width=case.width, height=case.height))
    finally:
        stream.close()
        engine.close()
    return chunks


def media_bytes(case: Case, chunks: list[np.ndarray], interval: int) -> list[int]:
    """Bytes of each chunk's fragment (the first one's init segment left out)."""
    encoder = FragmentedMP4Encoder(
        width=case.width, height=case.height, fps=case.fps, keyframe_interval=interval
    )
    sizes = []
    try:
        for frames in chunks:
            sizes.append(len(encoder.encode(frames)))
        init = encoder.init_segment or b""
        sizes[0] -= len(init)
    finally:
        encoder.close()
    return sizes


class Measured(TypedDict):
    """One case's figures (`measure`), as ``--json`` writes them."""

    engine: str
    size: str
    chunk_frames: int
    chunks: int
    fps: int
    bytes_per_chunk: dict[str, float]
    """Media bytes per chunk, by IDR interval (0: x264's own choice)."""
    kbit_per_s: dict[str, float]
    cost_percent: dict[str, float]
    """What forced IDR frames cost, by interval, relative to interval 0."""
    seconds: float


def measure(case: Case) -> Measured:
    began = time.monotonic()
    chunks = generate(case)
    frames_per_chunk = chunks[0].shape[0]
    totals = {interval: sum(media_bytes(case, chunks, interval)) for interval in INTERVALS}
    base = totals[0]
    return {
        "engine": case.engine,
        "size": f"{case.width}x{case.height}",
        "chunk_frames": frames_per_chunk,
        "chunks": len(chunks),
        "fps": case.fps,
        "bytes_per_chunk": {str(k): v / len(chunks) for k, v in totals.items()},
        "kbit_per_s": {
            str(k): v * 8 / 1000 / (len(chunks) * frames_per_chunk / case.fps)
            for k, v in totals.items()
        },
        "cost_percent": {str(k): 100 * (v - base) / base for k, v in totals.items() if k},
        "seconds": time.monotonic() - began,
    }


def table(results: Sequence[Measured]) -> str:
    head = (
        "| content | frames/chunk | x264 alone: kB/chunk (kbit/s) | IDR every chunk | "
        "every 2nd | every 4th |\n|---|---|---|---|---|---|"
    )
    rows = [head]
    for r in results:
        per_chunk, rate, cost = r["bytes_per_chunk"], r["kbit_per_s"], r["cost_percent"]
        cells = [f"{per_chunk['0'] / 1000:.1f} ({rate['0']:.0f})"]
        for k in ("1", "2", "4"):
            cells.append(f"{per_chunk[k] / 1000:.1f} (+{cost[k]:.1f}%)")
        rows.append(
            f"| {r['engine']} {r['size']} | {r['chunk_frames']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
    results = [measure(case) for case in (QUICK if args.quick else PUBLISHED)]
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
