#!/usr/bin/env python3
"""LTX-2 with its soundtrack through the diffusers engine: the first chunk's time, the
real-time factor, peak memory, and the audio's sample count (exact, or the step fails).

No LTX-2 weights can be downloaded here, so the pipeline is random, built in code by
``trio_vstream.engines.diffusers.testing.build_ltx2`` (text-to-video, and the image-to-video
one with the same weights, which continues each segment from the last frame): the
``gpu`` size (``LTX2_BENCH``: the released VAE's compression, an 8-layer transformer of
width 512) measures how the engine streams LTX-2's shapes at 768x512, not the released
model's speed; ``--tiny`` (the tests' pipeline, 32x32) runs in seconds on a CPU. The
engine is called in this process (no server): one segment to warm up, then one session
of ``--segments`` segments, timed.

    python bench/ltx2_check.py                      # on CUDA: the gpu size
    python bench/ltx2_check.py --tiny --device cpu  # a smoke test anywhere
    python bench/ltx2_check.py --json out.json      # the figures, for a record
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_DIR = Path(__file__).resolve().parent.parent
if str(REPO_DIR) not in sys.path:
    sys.path.insert(0, str(REPO_DIR))

from trio_vstream.engines import GenerationRequest, load_engine  # noqa: E402
from trio_vstream.engines.contract import Checkpoint  # noqa: E402
from trio_vstream.values import audio_samples_through  # noqa: E402

PROMPT = "a red fox in the snow"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' pipeline, 32x32")
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    parser.add_argument("--segments", type=int, default=3, help="segments in the session")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps a segment")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    figures = run(tiny=args.tiny, device=args.device, segments=args.segments, steps=args.steps)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0 if figures["audio_exact"] else 1


def run(*, tiny: bool, device: str, segments: int, steps: int | None) -> dict[str, Any]:
    """Build the pipelines, serve one session through the engine, and measure it."""
    import torch

    from trio_vstream.engines.diffusers.testing import LTX2_BENCH, LTX2_TINY, build_ltx2

    size = LTX2_TINY if tiny else LTX2_BENCH
    width, height, segment = (32, 32, 9) if tiny else (768, 512, 33)
    steps = steps if steps is not None else (2 if tiny else 8)
    fps = 24
    num_frames = segment + (segments - 1) * (segment - 1)
    with tempfile.TemporaryDirectory(prefix="ltx2-check-") as root:
        began = time.perf_counter()
        t2v = build_ltx2(Path(root) / "t2v", size=size)
        i2v = build_ltx2(Path(root) / "i2v", size=size, image_to_video=True)
        built_s = time.perf_counter() - began
        engine_args = {"model": str(t2v), "i2v_model": str(i2v), "segment_frames": str(segment)}
        engine: Any = load_engine("diffusers", engine_args, device=device)
        try:
            cuda = engine.device.type == "cuda"

            def session(frames: int, request_id: str) -> tuple[list[float], list[Any]]:
                request = GenerationRequest(
                    request_id=request_id,
                    prompt=PROMPT,
                    width=width,
                    height=height,
                    fps=fps,
                    num_frames=frames,
                    num_inference_steps=steps,
                    seed=1,
                )
                stream = engine.open_stream(request)
                times: list[float] = []
                chunks: list[Any] = []
                start = time.perf_counter()
                try:
                    while (chunk := stream.next_chunk(Checkpoint())) is not None:
                        if cuda:
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - start)
                        chunks.append((chunk.frames.shape[0], chunk.audio.shape))
                finally:
                    stream.close()
                return times, chunks

            session(segment, "warm-up")
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times, chunks = session(num_frames, "measured")
            peak = (
                torch.cuda.max_memory_allocated() / 2**20
                if cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            )
            rate = engine.audio_sample_rate
            sent = 0
            exact = True
            for frames, shape in chunks:
                count = audio_samples_through(sent + frames, rate, fps) - audio_samples_through(
                    sent, rate, fps
                )
                exact = exact and tuple(shape) == (engine.audio_channels, count)
                sent += frames
            seconds = num_frames / fps
            return {
                "pipeline": "tiny" if tiny else "gpu",
                "device": str(engine.device),
                "size": f"{width}x{height}",
                "fps": fps,
                "segment_frames": segment,
                "steps": steps,
                "num_frames": num_frames,
                "chunks": [frames for frames, _ in chunks],
                "audio": {"sample_rate": rate, "channels": engine.audio_channels},
                "audio_exact": exact and sent == num_frames,
                "build_s": round(built_s, 3),
                "first_chunk_s": round(times[0], 3),
                "total_s": round(times[-1], 3),
                "real_time_factor": round(seconds / times[-1], 3),
                "peak_memory_mib": round(peak, 1),
                "peak_memory_of": "cuda allocated" if cuda else "process max RSS",
            }
        finally:
            engine.close()


if __name__ == "__main__":
    sys.exit(main())
