#!/usr/bin/env python3
"""How the ``shapes`` model looks, as a person sees it (issue 35): on the decoded stream.

``python bench/shapes_look.py`` runs the engine in this process on five plain prompts
(one per background colour, the player page's default first), 96 frames each, encodes
every chunk with the server's own encoder (`FragmentedMP4Encoder`, its defaults: what a
browser gets), decodes the H.264 with PyAV and measures what
`trio_vstream.models.shapes.evaluate.look` measures:

* frames whose object is split across two opposite edges (target: none), and those
  whose object touches an edge at all;
* edge width: the object's 10% to 90% contrast transition along the row and the column
  through its centre (target: median at most 3 pixels at 256x256);
* background noise: the spatial standard deviation of the background away from the
  object, the largest channel's (target: at most 2 levels, median over each background
  colour's frames).

``--size`` repeats it at other sizes (e.g. ``--size 256x256 --size 512x512 --size
832x480``); the targets are judged at 256x256. Results go to
``bench/results/shapes-look-<time>.json`` (or ``--output``); ``--strict`` makes a missed
target exit with status 1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import av
import numpy as np

REPO_DIR = Path(__file__).resolve().parent.parent
if str(REPO_DIR) not in sys.path:
    sys.path.insert(0, str(REPO_DIR))

from trio_vstream.engines.contract import (  # noqa: E402
    Checkpoint,
    Engine,
    GenerationRequest,
    PromptChange,
)
from trio_vstream.engines.frames import frames_to_uint8_array  # noqa: E402
from trio_vstream.media.encoding import FragmentedMP4Encoder  # noqa: E402
from trio_vstream.models.shapes import evaluate  # noqa: E402
from trio_vstream.models.shapes.vocab import parse_prompt  # noqa: E402

RESULTS_DIR = REPO_DIR / "bench" / "results"
PROMPTS = (
    ("a red circle moving left on a navy background", 1),
    ("a large yellow square moving right on a black background", 2),
    ("a small blue triangle moving up on a white background", 3),
    ("a green circle moving down on a gray background", 4),
    ("a large purple triangle moving left on a dark green background", 5),
)
"""The player page's default prompt, then one per other background colour."""
FRAMES = 96
TARGETS = {"split_frames": 0, "edge_width_median": 3.0, "background_noise": 2.0}
"""At 256x256: no frame split; the median edge 3 pixels at most; each background colour's
median noise 2 levels at most."""


def stream_clip(
    engine: Engine,
    prompt: str,
    *,
    seed: int,
    num_frames: int,
    width: int,
    height: int,
    changes: dict[int, PromptChange] | None = None,
    **fields: Any,
) -> np.ndarray:
    """One request through the engine, each chunk encoded as the server encodes it and
    the stream decoded: the (T, H, W, 3) uint8 frames a browser shows. ``changes`` are
    interactions, keyed by the chunk they come before; ``fields``, other fields of the
    request (``num_inference_steps``, ``guidance_scale``)."""
    request = GenerationRequest(
        request_id=f"look-{seed}",
        prompt=prompt,
        width=width,
        height=height,
        fps=24,
        num_frames=num_frames,
        seed=seed,
        **fields,
    )
    encoder = FragmentedMP4Encoder(width=width, height=height, fps=24)
    data = bytearray()
    stream = engine.open_stream(request)
    try:
        index = 0
        while True:
            if changes and index in changes:
                stream.interact(changes[index])
            chunk = stream.next_chunk(Checkpoint())
            if chunk is None:
                break
            data += encoder.encode(frames_to_uint8_array(chunk.frames, width=width, height=height))
            index += 1
    finally:
        stream.close()
        data += encoder.close()
    with av.open(io.BytesIO(bytes(data)), mode="r") as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def measure(engine: Engine, width: int, height: int, frames: int = FRAMES) -> dict[str, Any]:
    """The look of the five prompts at one size."""
    split = cut = total = 0
    widths: list[float] = []
    noise: dict[str, dict[str, float]] = {}
    for prompt, seed in PROMPTS:
        clip = stream_clip(engine, prompt, seed=seed, num_frames=frames, width=width, height=height)
        seen = evaluate.look(clip)
        split += int(seen.split.sum())
        cut += int(seen.cut.sum())
        total += len(clip)
        widths.extend(seen.edge_widths.tolist())
        background = parse_prompt(prompt).slots.background
        assert background is not None
        levels = seen.noise[np.isfinite(seen.noise)]
        noise[background] = {
            "median": round(float(np.median(levels)), 2),
            "max": round(float(levels.max()), 2),
        }
    return {
        "size": f"{width}x{height}",
        "frames": total,
        "split_frames": split,
        "cut_frames": cut,
        "edge_width_median": round(statistics.median(widths), 2),
        "edge_width_p90": round(float(np.percentile(widths, 90)), 2),
        "edges": len(widths),
        "background_noise": noise,
    }


def verdicts(figures: dict[str, Any]) -> dict[str, bool]:
    """The targets, judged on the 256x256 figures."""
    worst = max(v["median"] for v in figures["background_noise"].values())
    return {
        "split_frames": figures["split_frames"] <= TARGETS["split_frames"],
        "edge_width_median": figures["edge_width_median"] <= TARGETS["edge_width_median"],
        "background_noise": worst <= TARGETS["background_noise"],
    }


def main(argv: list[str] | None = None) -> int:
    from trio_vstream.engines.shapes import create_engine

    parser = argparse.ArgumentParser(
        prog="python bench/shapes_look.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--size", action="append", default=[], metavar="WxH")
    parser.add_argument("--frames", type=int, default=FRAMES)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--strict", action="store_true")
    args = parser.parse_args(argv)
    engine = create_engine(device="cpu", **dict(item.split("=", 1) for item in args.engine_arg))
    results: dict[str, Any] = {"sizes": []}
    passed = True
    for size in args.size or ["256x256"]:
        width, height = (int(v) for v in size.split("x"))
        figures = measure(engine, width, height, args.frames)
        results["sizes"].append(figures)
        noise = ", ".join(
            f"{name} {v['median']} (max {v['max']})"
            for name, v in figures["background_noise"].items()
        )
        print(
            f"{figures['size']}: split {figures['split_frames']} of {figures['frames']} frames "
            f"(touching an edge {figures['cut_frames']}); edge width median "
            f"{figures['edge_width_median']} px (p90 {figures['edge_width_p90']}, "
            f"{figures['edges']} edges); background noise, levels: {noise}"
        )
        if (width, height) == (256, 256):
            results["verdicts"] = verdicts(figures)
            passed = all(results["verdicts"].values())
            print("targets at 256x256:", results["verdicts"])
    results["targets"] = TARGETS
    results["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    results["settings"] = {k: str(v) for k, v in vars(args).items()}
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.output or RESULTS_DIR / f"shapes-look-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written {out}")
    return 0 if passed or not args.strict else 1


if __name__ == "__main__":
    sys.exit(main())
