"""``encoder``: ``FragmentedMP4Encoder`` cost per frame, as a share of the chunk period,
measured in the harness's process (no server): the part of TTFC and of a chunk's period
that is encoding, whatever the transport."""

from __future__ import annotations

import time
from typing import Final

import trio

from bench._settings import PROMPT, Settings
from bench._stats import Figures
from trio_vstream.engines.contract import Checkpoint

ENCODER_SIZES: Final = ((256, 256), (832, 480))


def measure_encoder(
    width: int, height: int, fps: int, chunk_frames: int, chunks: int
) -> dict[str, list[float]]:
    """FragmentedMP4Encoder on the synthetic engine's frames (moving bands: motion for
    x264 to code, unlike a flat colour), timed per ``encode()`` call."""
    from trio_vstream.engines import GenerationRequest
    from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings
    from trio_vstream.media.encoding import FragmentedMP4Encoder

    engine = SyntheticEngine(SyntheticSettings(steps=0, chunk_frames=chunk_frames))
    request = GenerationRequest(
        request_id="encoder",
        prompt=PROMPT,
        width=width,
        height=height,
        fps=fps,
        num_frames=chunk_frames * (chunks + 1),
    )
    stream = engine.open_stream(request)
    encoder = FragmentedMP4Encoder(width=width, height=height, fps=fps)
    times = []
    for _ in range(chunks + 1):
        chunk = stream.next_chunk(Checkpoint())
        assert chunk is not None
        started = time.perf_counter()
        encoder.encode(chunk.frames)
        times.append((time.perf_counter() - started) * 1000)
    encoder.close()
    stream.close()
    return {"first": times[:1], "steady": times[1:]}


async def scenario_encoder(figures: Figures, run: int, s: Settings, chunk_frames: int) -> None:
    period_ms = chunk_frames / s.fps * 1000
    for width, height in dict.fromkeys([*ENCODER_SIZES, (s.width, s.height)]):
        result = await trio.to_thread.run_sync(
            measure_encoder, width, height, s.fps, chunk_frames, s.encoder_chunks
        )
        key = f"encoder.{width}x{height}"
        figures.add(run, f"{key}.ms_per_frame", [t / chunk_frames for t in result["steady"]])
        figures.add(run, f"{key}.chunk_ms", result["steady"])
        figures.add(run, f"{key}.first_chunk_ms", result["first"])
        figures.add(
            run, f"{key}.chunk_period_share_pct", [100 * t / period_ms for t in result["steady"]]
        )
