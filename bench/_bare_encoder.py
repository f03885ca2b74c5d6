"""The overhead scenario's yardstick: the server's encoding work and nothing else.

A bare PyAV/libx264 encoder, in a process of its own (``python -m bench._bare_encoder
JSON``, which prints its figures as JSON): one libx264 context per session, opened by
`trio_vstream.media.h264.open_h264` (the server's settings: preset, tune, threads, the
low-latency x264 parameters, a forced IDR at every chunk's first frame), each frame
converted by `trio_vstream.media.h264.to_encoder_frame` (the server's RGB -> yuv420p
conversion) and handed to ``encode``. No fMP4 boxes, no bytes, no threads of its own,
no event loop: what is left when serving is taken away. The bitstream is the server
encoder's, byte for byte (``tests/bench/test_bench_overhead.py`` checks it).

The frames are the server's: the synthetic engine's ``next_chunk`` for the same request
(prompt, size, fps, seed, frames per chunk), one stream per session, the sessions taken
in turn chunk by chunk as the server's encode slot takes them. Generating them is timed
apart and left out of the encoder's figure, as the server's own engine time is left out
of the server's (``engine_cpu_seconds`` in ``/stats``). CPU is the whole process's
(``time.process_time``: x264's and swscale's threads included) between the calls.

It runs in a process of its own, not in the harness's, so that it has the server's
allocator settings (`trio_vstream.server.memory.tune_allocator`) and nothing else's heap.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import attrs
import av
import numpy as np
from av.video.frame import PictureType
from av.video.reformatter import VideoReformatter

from trio_vstream.engines.contract import Checkpoint, GenerationRequest
from trio_vstream.engines.frames import frames_to_uint8_array
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings
from trio_vstream.media.h264 import open_h264, to_encoder_frame
from trio_vstream.server.memory import tune_allocator


@attrs.frozen(kw_only=True)
class BareJob:
    """What the bare encoder encodes: ``sessions`` streams of the same request."""

    sessions: int
    num_frames: int
    width: int
    height: int
    fps: int
    chunk_frames: int
    prompt: str
    seed: int


def encode_chunk(
    ctx: av.VideoCodecContext, reformatter: VideoReformatter, frames: np.ndarray, first: int
) -> list[av.Packet]:
    """One chunk's frames, as the server's encoder encodes them: converted, numbered from
    ``first``, the first one a forced IDR. The packets, one per frame."""
    packets: list[av.Packet] = []
    for index in range(frames.shape[0]):
        yuv = to_encoder_frame(reformatter, frames[index])
        yuv.pts = first + index
        if index == 0:
            yuv.pict_type = PictureType.I
        packets += ctx.encode(yuv)
    return packets


def encode_bare(job: BareJob) -> dict[str, Any]:
    """Generate and encode every session's frames; CPU seconds of each part, and frames."""
    engine = SyntheticEngine(SyntheticSettings(steps=0, chunk_frames=job.chunk_frames))
    request = GenerationRequest(
        request_id="bare",
        prompt=job.prompt,
        width=job.width,
        height=job.height,
        fps=job.fps,
        num_frames=job.num_frames,
        seed=job.seed,
    )
    streams = [engine.open_stream(request) for _ in range(job.sessions)]
    started = time.process_time()
    encoders = [
        (open_h264(width=job.width, height=job.height, fps=job.fps), VideoReformatter())
        for _ in streams
    ]
    encode_cpu = time.process_time() - started
    generate_cpu = 0.0
    frames_done = [0] * job.sessions
    packets = 0
    active = list(range(job.sessions))
    wall = time.perf_counter()
    while active:
        for session in list(active):
            began = time.process_time()
            chunk = streams[session].next_chunk(Checkpoint())
            generated = time.process_time()
            generate_cpu += generated - began
            if chunk is None:
                active.remove(session)
                continue
            ctx, reformatter = encoders[session]
            frames = frames_to_uint8_array(chunk.frames, width=job.width, height=job.height)
            packets += len(encode_chunk(ctx, reformatter, frames, frames_done[session]))
            frames_done[session] += frames.shape[0]
            encode_cpu += time.process_time() - generated
    began = time.process_time()
    for ctx, _ in encoders:
        packets += len(ctx.encode(None))
    encode_cpu += time.process_time() - began
    wall = time.perf_counter() - wall
    for stream in streams:
        stream.close()
    total = sum(frames_done)
    if packets != total:
        raise RuntimeError(f"the encoder returned {packets} packets for {total} frames")
    return {
        "frames": total,
        "encode_cpu_s": encode_cpu,
        "generate_cpu_s": generate_cpu,
        "wall_s": wall,
    }


def main(argv: list[str]) -> int:
    tune_allocator()
    job = BareJob(**json.loads(argv[0]))
    print(json.dumps(encode_bare(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
