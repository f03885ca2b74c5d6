#!/usr/bin/env python3
"""End-to-end quality and speed of the ``shapes`` engine, through a real server.

``python bench/evaluate_shapes.py`` starts ``python -m trio_vstream --engine shapes
--port 0`` (or targets ``--url``), streams every prompt of the evaluator's held-out
``eval`` split over WebSockets, decodes the H.264 it receives, and judges the decoded
frames with ``trio_vstream.models.shapes.evaluate`` (simple image analysis, no access to
the renderer). It prints the quality table against the bars, then the speed:

* quality: background, object colour, motion direction, shape, continuity across chunk
  boundaries, and interactions (only the colour changes, ``transition_chunks`` N in
  0..3: every chunk from boundary N+1 after the event on must show the new colour);
* speed, at default settings (a request with only a prompt: 256x256, 24 fps, 48
  frames): generated frames per wall second through the server (from session.start to
  the last media chunk), and time from session.start to the first chunk's bytes.

Sessions run one at a time, so speed is that of one stream. Results also go to
``bench/results/shapes-<time>.json``. The server is the harnesses' ``ServerProcess``
(``bench/_server.py``); each session is a ``trio_vstream.protocol.ClientProtocol`` over
a WebSocket. ``bench/shapes_in_process.py`` is the quick check without a server.
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
import tempfile
import time
from pathlib import Path
from typing import Any

import av
import numpy as np
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

REPO_DIR = Path(__file__).resolve().parent.parent
if str(REPO_DIR) not in sys.path:
    sys.path.insert(0, str(REPO_DIR))

from bench._server import ServerProcess  # noqa: E402
from trio_vstream.models.shapes import evaluate  # noqa: E402
from trio_vstream.models.shapes.vocab import COLOUR_NAMES, parse_prompt  # noqa: E402
from trio_vstream.protocol import (  # noqa: E402
    ChunkMetadata,
    ChunkReceived,
    ClientProtocol,
    ClientState,
    ErrorReceived,
)

RESULTS_DIR = REPO_DIR / "bench" / "results"
MAX_MESSAGE = 64 * 1024 * 1024
SERVER_START_TIMEOUT = 120.0
"""Seconds for the server to print its URL (it loads the model and warms it up first)."""


def decode(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data), mode="r") as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


class Session:
    """What one streamed session produced, with timings."""

    def __init__(self) -> None:
        self.video = bytearray()
        self.media: list[ChunkMetadata] = []
        """The media chunks' metadata, in order."""
        self.frames = 0
        self.first_chunk_s: float | None = None
        self.last_chunk_s: float | None = None


async def run_session(
    url: str, start: dict[str, Any], *, interaction: dict[str, Any] | None = None
) -> Session:
    """Stream one session (``start``: the ``session.start`` fields); send ``interaction``
    (`ClientProtocol.interact`'s arguments) once the first media chunk arrived."""
    protocol = ClientProtocol()
    result = Session()
    errors: list[str] = []
    async with open_websocket_url(url, max_message_size=MAX_MESSAGE) as ws:
        began = time.perf_counter()
        await ws.send_message(protocol.start(**start))
        while not protocol.ended:
            try:
                message = await ws.get_message()
            except ConnectionClosed:
                break
            now = time.perf_counter() - began
            for event in protocol.receive(message):
                if isinstance(event, ErrorReceived):
                    errors.append(f"{event.error.code}: {event.error.message}")
                if not isinstance(event, ChunkReceived):
                    continue
                result.video += event.data
                if event.metadata.kind != "media":
                    continue
                result.media.append(event.metadata)
                if result.first_chunk_s is None:
                    result.first_chunk_s = now
                    if interaction is not None:
                        await ws.send_message(protocol.interact(**interaction))
                result.last_chunk_s = now
    result.frames = protocol.frames
    if protocol.state is not ClientState.DONE or errors:
        raise RuntimeError(f"session did not complete ({protocol.state.value}): {errors}")
    return result


async def quality(url: str, split: str, count: int, frames: int) -> dict[str, Any]:
    cases = evaluate.prompt_set(split, count)
    analyses = []
    for case in cases:
        session = await run_session(
            url,
            {
                "prompt": case.prompt,
                "seed": case.seed,
                "num_frames": frames,
                "size": "256x256",
                "fps": 24,
            },
        )
        analyses.append(evaluate.analyse_clip(decode(bytes(session.video))))
    return evaluate.score(cases, analyses)


async def interactions(url: str, split: str, trials: int) -> dict[str, Any]:
    cases = evaluate.prompt_set(split, trials)
    passed = 0
    per_n: dict[int, list[bool]] = {}
    for i, case in enumerate(cases):
        chunks = i % 4
        old = case.slots.colour
        assert old is not None
        options = [c for c in COLOUR_NAMES if c not in (old, case.slots.background)]
        new = options[i % len(options)]
        new_prompt = case.prompt.replace(old, new, 1)
        assert parse_prompt(new_prompt).slots.colour == new, new_prompt
        event_id = f"colour-{i}"
        session = await run_session(
            url,
            {
                "prompt": case.prompt,
                "seed": case.seed,
                "num_frames": 96,
                "size": "256x256",
            },
            interaction={
                "prompt": new_prompt,
                "event_id": event_id,
                "transition_chunks": chunks,
            },
        )
        start = next(
            m.generation_chunk_index for m in session.media if event_id in m.started_event_ids
        )
        assert start is not None  # a media message's index, never a trailer's None
        colours = evaluate.chunk_colours(decode(bytes(session.video)))
        ok = evaluate.interaction_passed(colours, start, chunks, new)
        per_n.setdefault(chunks, []).append(ok)
        passed += ok
    return {
        "interaction": round(passed / trials, 4),
        "interaction_by_transition_chunks": {
            n: round(sum(v) / len(v), 3) for n, v in sorted(per_n.items())
        },
    }


async def speed(url: str, sessions: int) -> dict[str, Any]:
    fps, first = [], []
    for i in range(sessions):
        session = await run_session(url, {"prompt": "a red circle moving left", "seed": i})
        assert session.first_chunk_s is not None and session.last_chunk_s is not None
        fps.append(session.frames / session.last_chunk_s)
        first.append(session.first_chunk_s)
    return {
        "frames_per_second_median": round(statistics.median(fps), 2),
        "frames_per_second_min": round(min(fps), 2),
        "first_chunk_s_median": round(statistics.median(first), 3),
        "first_chunk_s_max": round(max(first), 3),
        "sessions": sessions,
    }


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    started = time.perf_counter()
    results["speed"] = await speed(url, args.speed_sessions)
    print(f"speed: {results['speed']}", flush=True)
    results["quality"] = await quality(url, args.split, args.count, args.frames)
    results["quality"].update(await interactions(url, args.split, args.interaction_trials))
    results["seconds"] = round(time.perf_counter() - started, 1)
    return results


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """Measure ``--url``, or a server of our own, started here and stopped at the end."""
    if args.url is not None:
        return await measure(args, args.url)
    command = [sys.executable, "-m", "trio_vstream", "--engine", "shapes", "--port", "0"]
    command += ["--log-level", "WARNING", *args.server_arg]
    with tempfile.TemporaryDirectory(prefix="evaluate_shapes-") as scratch:
        server = ServerProcess(command, Path(scratch) / "server.log")
        try:
            url = await server.start(SERVER_START_TIMEOUT)
            return await measure(args, url)
        finally:
            await server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--split", default="eval", choices=("eval", "tune"))
    parser.add_argument("--count", type=int, default=120, help="prompts for quality")
    parser.add_argument("--frames", type=int, default=16, help="frames per quality clip")
    parser.add_argument("--interaction-trials", type=int, default=40)
    parser.add_argument("--speed-sessions", type=int, default=10)
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra server flag (repeatable)"
    )
    args = parser.parse_args()
    results = trio.run(main_async, args)
    quality_metrics = results["quality"]
    print(evaluate.table(quality_metrics))
    print(
        f"interaction by transition_chunks: {quality_metrics['interaction_by_transition_chunks']}"
    )
    print(f"continuity: {quality_metrics['continuity_clips_ok']:.1%} of clips under the bar")
    print(f"breakdown: {json.dumps(quality_metrics['breakdown'])}")
    sp = results["speed"]
    print(
        f"speed (default request, 256x256, 48 frames): "
        f"{sp['frames_per_second_median']} frames/s median (min {sp['frames_per_second_min']}), "
        f"first chunk {sp['first_chunk_s_median']} s median (max {sp['first_chunk_s_max']})"
    )
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS_DIR / f"shapes-{stamp}.json"
    results["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    results["settings"] = vars(args)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written {out.relative_to(REPO_DIR)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
