#!/usr/bin/env python3
"""The shapes model's quick quality check: its engine called in this process.

No server and no codec: each prompt of a split goes straight through
``trio_vstream.engines.shapes``, and the frames it returns are judged by
``trio_vstream.models.shapes.evaluate``. Quick enough for training and tuning (the
engine's default guidance was chosen with it); the published numbers come from
``bench/evaluate_shapes.py``, which judges video streamed through a real server.

    python bench/shapes_in_process.py --weights run.safetensors --split tune --record

``--record`` adds the metrics to the checkpoint's JSON record (``run.json``) as
``quick_eval_<split>_split``, which is where the shipped ``weights.json`` keeps them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

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
from trio_vstream.engines.shapes import create_engine  # noqa: E402
from trio_vstream.models.shapes import evaluate  # noqa: E402


def generate_clip(
    engine: Engine,
    prompt: str,
    *,
    seed: int,
    num_frames: int,
    width: int = 256,
    height: int = 256,
    on_chunk: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Run one request through an engine directly: the (T, H, W, 3) uint8 frames."""
    request = GenerationRequest(
        request_id=f"eval-{seed}",
        prompt=prompt,
        width=width,
        height=height,
        fps=24,
        num_frames=num_frames,
        seed=seed,
    )
    stream = engine.open_stream(request)
    chunks = []
    try:
        while (chunk := stream.next_chunk(Checkpoint())) is not None:
            chunks.append(frames_to_uint8_array(chunk.frames, width=width, height=height))
            if on_chunk is not None:
                on_chunk(chunk.index)
    finally:
        stream.close()
    return np.concatenate(chunks)


def judge(
    engine: Engine, cases: list[evaluate.EvalCase], num_frames: int
) -> list[evaluate.ClipAnalysis]:
    """One analysis per case, in order."""
    return [
        evaluate.analyse_clip(generate_clip(engine, c.prompt, seed=c.seed, num_frames=num_frames))
        for c in cases
    ]


def evaluate_in_process(
    weights: Path | None,
    *,
    count: int = 48,
    split: str = "tune",
    num_frames: int = 16,
    device: str = "cpu",
    engine_args: dict[str, str] | None = None,
) -> dict[str, object]:
    """Quality metrics straight from the engine (no H.264); for training and tuning."""
    args = dict(engine_args or {})
    if weights is not None:
        args["weights"] = str(weights)
    engine = create_engine(device=device, **args)
    try:
        cases = evaluate.prompt_set(split, count)
        return evaluate.score(cases, judge(engine, cases, num_frames))
    finally:
        engine.close()


def record(weights: Path, split: str, metrics: dict[str, object]) -> Path:
    """Add the metrics to the checkpoint's JSON record (made by the training run)."""
    path = weights.with_suffix(".json")
    report = json.loads(path.read_text()) if path.exists() else {}
    report[f"quick_eval_{split}_split"] = metrics
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/shapes_in_process.py",
        description="Quick in-process quality check of a shapes checkpoint (no server, no codec).",
    )
    parser.add_argument("--weights", type=Path, default=None, help="default: the shipped ones")
    parser.add_argument("--split", default="tune", choices=evaluate.SPLITS)
    parser.add_argument("--count", type=int, default=48)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--show-failures", action="store_true")
    parser.add_argument(
        "--record", action="store_true", help="add the metrics to the --weights file's JSON"
    )
    args = parser.parse_args(argv)
    if args.record and args.weights is None:
        parser.error("--record needs --weights")
    engine_args = dict(item.split("=", 1) for item in args.engine_arg)
    if args.weights is not None:
        engine_args["weights"] = str(args.weights)
    engine = create_engine(device=args.device, **engine_args)
    try:
        cases = evaluate.prompt_set(args.split, args.count)
        analyses = judge(engine, cases, args.frames)
    finally:
        engine.close()
    metrics = evaluate.score(cases, analyses)
    print(evaluate.table(metrics))
    print(json.dumps(metrics, indent=2))
    if args.show_failures:
        print("\n".join(evaluate.failures(cases, analyses)))
    if args.record:
        print(f"recorded in {record(args.weights, args.split, metrics)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
