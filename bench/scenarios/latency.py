"""``latency``: one session at a time: connect, ``video.start``, time to first chunk,
chunk inter-arrival, real-time factor; plus an in-process calibration of the engine's own
time to its first chunk and of one encode, so that the server's transport overhead (TTFC
minus the engine's time) is told apart from the model's."""

from __future__ import annotations

import time

import trio

from bench._client import SessionClient, report_failures, run_clients, seconds_between
from bench._context import RunContext
from bench._settings import PROMPT, Settings, Target
from bench._stats import percentile
from trio_vstream.engines.contract import Checkpoint


def calibrate_engine(target: Target, s: Settings) -> dict[str, list[float]]:
    """The engine's own time to its first chunk (here, in a worker thread), and the encode
    of a first chunk with a fresh encoder: TTFC as it would be with a free transport."""
    from trio_vstream.engines import GenerationRequest, load_engine
    from trio_vstream.engines.frames import frames_to_uint8_array
    from trio_vstream.media.encoding import FragmentedMP4Encoder

    assert target.engine is not None
    engine = load_engine(target.engine, dict(target.engine_args), device="auto")
    result: dict[str, list[float]] = {"engine": [], "encode": [], "open": []}
    try:
        for i in range(s.calibration_reps):
            request = GenerationRequest(
                request_id=f"calibration-{i}",
                prompt=PROMPT,
                width=s.width,
                height=s.height,
                fps=s.fps,
                num_frames=s.latency_frames,
            )
            t0 = time.perf_counter()
            stream = engine.open_stream(request)
            try:
                chunk = stream.next_chunk(Checkpoint())
            finally:
                stream.close()
            t1 = time.perf_counter()
            assert chunk is not None
            encoder = FragmentedMP4Encoder(width=s.width, height=s.height, fps=s.fps)
            t2 = time.perf_counter()
            encoder.encode(frames_to_uint8_array(chunk.frames, width=s.width, height=s.height))
            t3 = time.perf_counter()
            encoder.close()
            result["engine"].append((t1 - t0) * 1000)
            result["open"].append((t2 - t1) * 1000)
            result["encode"].append((t3 - t2) * 1000)
    finally:
        engine.close()
    return result


async def scenario_latency(ctx: RunContext) -> None:
    s = ctx.settings
    if ctx.target.calibratable:
        calibration = await trio.to_thread.run_sync(calibrate_engine, ctx.target, s)
        ctx.add("calib.engine_first_chunk_ms", calibration["engine"])
        ctx.add("calib.encode_first_chunk_ms", calibration["encode"])
        ctx.add("calib.encoder_open_ms", calibration["open"])
    else:
        reason = "the engine is not loadable in the harness (only synthetic is)"
        for name in ("calib.engine_first_chunk_ms", "latency.transport_overhead_ms"):
            ctx.figures.mark_unavailable(name, reason)
    clients: list[SessionClient] = []
    for i in range(s.latency_sessions):
        client = ctx.client(s.latency_frames)
        await run_clients([client], trio.lowlevel.checkpoint, s.session_timeout_s)
        report_failures([client], f"latency session {i}")
        clients.append(client)
        await ctx.settle()
    good = [c for c in clients if c.arrivals and c.t_start_sent and not c.problem]
    ctx.add(
        "latency.connect_ms", [seconds_between(c.t_connect, c.t_connected) * 1000 for c in good]
    )
    ctx.add(
        "latency.video_start_ms",
        [seconds_between(c.t_start_sent, c.t_video_start) * 1000 for c in good if c.t_video_start],
    )
    ttfc = [seconds_between(c.t_start_sent, c.arrivals[0][0]) * 1000 for c in good]
    ctx.add("latency.ttfc_ms", ttfc)
    ctx.add(
        "latency.interarrival_ms",
        [
            (b[0] - a[0]) * 1000
            for c in good
            for a, b in zip(c.arrivals, c.arrivals[1:], strict=False)
        ],
    )
    ctx.add(
        "latency.rtf",
        [(c.frames / s.fps) / seconds_between(c.t_start_sent, c.arrivals[-1][0]) for c in good],
    )
    engine = ctx.figures.get("calib.engine_first_chunk_ms")
    if engine is not None and ttfc and len(engine.runs) > ctx.run:
        overhead = percentile(ttfc, 50) - percentile(engine.runs[ctx.run], 50)
        ctx.add("latency.transport_overhead_ms", [overhead])
