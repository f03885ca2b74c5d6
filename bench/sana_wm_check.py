"""SANA-WM on the diffusers engine, steered: first chunk, real-time factor, peak memory.

    python bench/sana_wm_check.py --preset gpu --device cuda --output out/sana_wm.json
    python bench/sana_wm_check.py --preset tiny --device cpu     # a smoke run, seconds

A random ``SanaWMPipeline`` is built in code (``testing.build_sana_wm``; nothing is
downloaded) at the preset's size, saved, and loaded by the engine as ``--engine
diffusers`` loads a directory. One stream then makes ``--segments`` segments with a
camera velocity (forward and turning, as a person holding W and L) handed over between
them, exactly as a session steers it. It reports, as JSON: the time to the first chunk
(from ``open_stream``), each segment's time, the real-time factor (seconds of video made
per second of generation after the first chunk: above 1 keeps up with playback), and the
peak device memory (CUDA's allocator; on a CPU, the process's peak RSS). The weights are
random, so the figures say what the engine and a model of this size cost, not what the
released checkpoint looks like. The ``gpu`` preset is half the released transformer's
width and 8 of its 20 layers with the LTX-2 VAE's real compression at 704x1280 (the real
model's token count per frame); ``bench/gpu_check.sh`` runs it.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"size": "SANA_WM_TINY", "width": 32, "height": 16, "segment_frames": 5, "steps": 2},
    "gpu": {"size": "SANA_WM_GPU", "width": 1280, "height": 704, "segment_frames": 33, "steps": 20},
}
"""Per preset: the random model (a ``testing.sana_wm`` size), the video's size, frames per segment
(8n+1 for the real VAE's 8x) and denoising steps."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--segments", type=int, default=3, help="segments to make (>= 2)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps per segment")
    parser.add_argument("--guidance-scale", type=float, default=5.0, help="the call's default")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.segments < 2:
        parser.error("--segments must be at least 2 (the first chunk, then the rate)")
    return args


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Build, load and stream; the figures as a dict."""
    import torch

    from trio_vstream.engines import Checkpoint, GenerationRequest, PromptChange, load_engine
    from trio_vstream.engines.diffusers import DiffusersEngine, testing
    from trio_vstream.protocol import key_velocity

    preset = PRESETS[args.preset]
    steps = args.steps or preset["steps"]
    began = time.perf_counter()
    path = testing.build_sana_wm(root / "SANA-WM-random", size=getattr(testing, preset["size"]))
    built = time.perf_counter() - began
    engine_args = {"model": str(path), "segment_frames": str(preset["segment_frames"])}
    engine = load_engine("diffusers", engine_args, device=args.device)
    assert isinstance(engine, DiffusersEngine)
    cuda = torch.device(args.device).type == "cuda"
    try:
        segment = preset["segment_frames"]
        fps = 16
        request = GenerationRequest(
            request_id="sana-wm-check",
            prompt="a red fox in the snow",
            width=preset["width"],
            height=preset["height"],
            fps=fps,
            num_frames=segment + (segment - 1) * (args.segments - 1),
            num_inference_steps=steps,
            guidance_scale=args.guidance_scale,
            seed=1,
        )
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        opened = time.perf_counter()
        stream = engine.open_stream(request)
        times: list[float] = []
        frames: list[int] = []
        try:
            mark = opened
            while (chunk := stream.next_chunk(Checkpoint())) is not None:
                now = time.perf_counter()
                times.append(now - mark)
                frames.append(int(chunk.frames.shape[0]))
                mark = now
                # W and L held: forward and turning right, from the next segment on.
                camera = key_velocity([{"w", "l"}])
                stream.interact(PromptChange(f"keys-{len(times)}", None, 0, camera))
        finally:
            stream.close()
        later_seconds = sum(times[1:])
        later_video = sum(frames[1:]) / fps
        peak = (
            torch.cuda.max_memory_allocated() / 2**30
            if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        )
        return {
            "preset": args.preset,
            "device": str(engine.device),
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "size": f"{request.width}x{request.height}",
            "segment_frames": segment,
            "steps": steps,
            "guidance_scale": args.guidance_scale,
            "transformer_parameters_m": round(
                sum(p.numel() for p in engine.model.pipe.transformer.parameters()) / 1e6, 1
            ),
            "build_seconds": round(built, 2),
            "first_chunk_seconds": round(times[0], 3),
            "segment_seconds": [round(t, 3) for t in times],
            "frames": frames,
            "real_time_factor": round(later_video / later_seconds, 3),
            "peak_memory_gib": round(peak, 3),
            "peak_memory_kind": "cuda max_memory_allocated" if cuda else "process max RSS",
        }
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sana-wm-check-") as tmp:
        figures = run(args, Path(tmp))
    text = json.dumps(figures, indent=2)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
