#!/usr/bin/env python3
"""What batching sessions' steps buys the diffusers engine (issue 24), measured in one run.

Random pipelines built in code at a preset's size (no downloads), served by the engine as
``--engine diffusers`` loads them; sessions run as the server runs them, each one's
``next_chunk`` in a worker thread with the server's own `SessionCheckpoint`, through its
`StepBatcher` (``max_batch`` N, "on") or its step limiter (``max_batch=1``, "off", today's
path: each window whole under the lock). No encoder and no WebSocket: what is measured is
the engine, so the ratio is batching's alone (the server's own costs are the ``diffusers``
scenario's). Per repeat the modes alternate (on, off; then off, on), so drift on a shared
machine lands on both.

Per preset, mode and level N (sessions started together, each a video of ``num_frames``):
aggregate fps (every session's frames over the level's wall time), per-session real-time
factor (a session's fps over the video's fps: >= 1 keeps up), a lone session's time to
first chunk (level 1), and on CUDA the peak memory allocated. Then per level the on/off
ratio of aggregate fps, and the on/off ratio of the lone TTFC.

    python bench/diffusers_batching.py --preset cpu --repeat 3
    python bench/diffusers_batching.py --preset gpu-skyreels --preset gpu-wan   # gpu_check.sh

Presets: ``tiny`` (seconds on any CPU: the tests'), ``cpu`` (a SkyReels-V2 DF pipeline
sized so a step takes measurable time on a 2-core CPU), ``cpu-framepack`` (a FramePack
pipeline of the tests' widths, six blocks of each kind and four heads, 32x32, vanilla
sections of ten steps, distilled guidance, the text padded to 64 tokens),
``cpu-wan`` (the ``cpu`` preset's transformer as a Wan text-to-video pipeline: segments
of 17 frames, each call's forwards batched), ``gpu-skyreels`` (SkyReels-V2 DF 1.3B's
transformer and Wan's VAE, at 480p) and ``gpu-wan`` (Wan 2.1 1.3B at 480p: the segment
path, whose calls' transformer forwards batch across sessions).

``cpu-far``: AnyFlow FAR chunks (which batch, cache passes included), the tests' widths
four blocks deep, 32x32, chunks of four guided steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

REPO_DIR = Path(__file__).resolve().parent.parent
if str(REPO_DIR) not in sys.path:
    sys.path.insert(0, str(REPO_DIR))

import trio  # noqa: E402

from bench import diffusers_tiny  # noqa: E402
from trio_vstream.engines import load_engine  # noqa: E402
from trio_vstream.engines.contract import GenerationRequest  # noqa: E402
from trio_vstream.engines.interfaces import max_batch  # noqa: E402
from trio_vstream.scheduling.batcher import StepBatcher  # noqa: E402
from trio_vstream.scheduling.checkpoint import SessionCheckpoint  # noqa: E402
from trio_vstream.scheduling.progress import EngineProgress  # noqa: E402

FPS_RATIO_LEVEL = 4
FPS_RATIO_MIN = 1.3
TTFC_RATIO_MAX = 1.15
"""The targets (issue 24): at 4 sessions at least 1.3x the aggregate fps of ``max_batch=1``,
and a lone session's first chunk within 1.15x of its time there."""

WAN_1_3B = {
    "layers": 30,
    "heads": 12,
    "head_dim": 128,
    "ffn_dim": 8960,
    "rope_max_seq_len": 1024,
    "vae_base_dim": 96,
    "vae_dim_mult": (1, 2, 4, 4),
    "vae_res_blocks": 2,
}
"""Wan 2.1 1.3B's transformer (SkyReels-V2 DF 1.3B has the same) and Wan's VAE; the text
encoder stays tiny (prompts are encoded once a session)."""


@attrs.frozen(kw_only=True)
class Preset:
    name: str
    family: str
    """``skyreels`` (diffusion-forcing windows, which batch), ``far`` (AnyFlow FAR chunks,
    which batch), ``framepack`` (vanilla sections, which batch) or ``wan`` (segments)."""
    size: dict[str, Any]
    width: int
    height: int
    fps: int
    window: int
    """The engine's ``segment_frames`` (a DF window, a Wan segment)."""
    num_frames: int
    steps: int
    guidance: float
    device: str
    levels: tuple[int, ...]
    max_batch: int
    threads: int | None = 1

    def build(self, root: Path) -> Path:
        size = diffusers_tiny.WanSize(**self.size)
        if self.family == "far":  # the tests' widths, ``size``'s depth
            far = diffusers_tiny.build_anyflow_far(
                root / "anyflow-far", size=size, layers=size.layers
            )
            return Path(far)
        if self.family == "skyreels":
            return Path(diffusers_tiny.build_skyreels_df(root / "skyreels-df", size=size))
        if self.family == "framepack":
            from trio_vstream.engines.diffusers.testing import build_framepack

            return Path(build_framepack(root / "framepack", **self.size))
        return Path(diffusers_tiny.build_wan_t2v(root / "wan", size=size))


_CPU_SIZE = {"layers": 8}
"""The tests' widths, eight blocks deep, at 32x32: a forward costs what its operations'
launch costs more than their arithmetic, as a 1.3B transformer's does on a GPU at a batch
of one (a forward of 8 rows took 1.5x one of 2 on the development machine), and a
window's ten steps outweigh its decode."""

PRESETS = {
    "tiny": Preset(
        name="tiny",
        family="skyreels",
        size={},
        width=32,
        height=32,
        fps=24,
        window=17,
        num_frames=25,
        steps=2,
        guidance=5.0,
        device="cpu",
        levels=(1, 2),
        max_batch=8,
    ),
    "cpu": Preset(
        name="cpu",
        family="skyreels",
        size=_CPU_SIZE,
        width=32,
        height=32,
        fps=24,
        window=17,
        num_frames=33,
        steps=10,
        guidance=5.0,
        device="cpu",
        levels=(1, 4, 8),
        max_batch=8,
    ),
    "cpu-wan": Preset(
        name="cpu-wan",
        family="wan",
        size=_CPU_SIZE,
        width=32,
        height=32,
        fps=16,
        window=17,
        num_frames=33,
        steps=10,
        guidance=5.0,
        device="cpu",
        levels=(1, 4, 8),
        max_batch=8,
    ),
    "cpu-framepack": Preset(
        name="cpu-framepack",
        family="framepack",
        size={"layers": 6, "heads": 4},
        width=32,
        height=32,
        fps=24,
        window=12,
        num_frames=27,
        steps=10,
        guidance=6.0,
        device="cpu",
        levels=(1, 4, 8),
        max_batch=8,
    ),
    "cpu-far": Preset(
        name="cpu-far",
        family="far",
        size={"layers": 4},
        width=32,
        height=32,
        fps=16,
        window=8,
        num_frames=25,
        steps=4,
        guidance=3.0,
        device="cpu",
        levels=(1, 4, 8),
        max_batch=8,
    ),
    "gpu-skyreels": Preset(
        name="gpu-skyreels",
        family="skyreels",
        size=WAN_1_3B,
        width=832,
        height=480,
        fps=24,
        window=17,
        num_frames=17,
        steps=4,
        guidance=5.0,
        device="cuda",
        levels=(1, 4, 8, 16),
        max_batch=16,
        threads=None,
    ),
    "gpu-wan": Preset(
        name="gpu-wan",
        family="wan",
        size=WAN_1_3B,
        width=832,
        height=480,
        fps=16,
        window=17,
        num_frames=17,
        steps=4,
        guidance=5.0,
        device="cuda",
        levels=(1, 4, 8, 16),
        max_batch=16,
        threads=None,
    ),
}


@attrs.define
class Level:
    """One level of one mode, as measured."""

    sessions: int
    frames: int = 0
    wall_s: float = math.nan
    ttfc_s: list[float] = attrs.Factory(list)
    session_fps: list[float] = attrs.Factory(list)
    peak_bytes: int | None = None
    rows: int = 0
    batches: int = 0


async def run_level(engine: Any, preset: Preset, mode: str, sessions: int, declared: int) -> Level:
    """``sessions`` sessions started together, each to its video's end; ``declared`` is
    the engine's ``max_batch`` as loaded (1 for a family that does not batch)."""
    import torch

    batch = declared if mode == "on" else 1
    engine.max_batch = batch
    progress = EngineProgress()
    batcher = StepBatcher(batch, progress) if batch > 1 else None
    limiter = trio.CapacityLimiter(1) if batcher is None else None  # as the server does
    level = Level(sessions)
    cuda = preset.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    async def session(seed: int, began: float) -> None:
        checkpoint = SessionCheckpoint(limiter, progress, lambda: None, batcher)
        stream = engine.open_stream(request(preset, seed))
        frames = 0
        try:
            while True:
                try:
                    chunk = await trio.to_thread.run_sync(stream.next_chunk, checkpoint)
                finally:
                    checkpoint.release()
                if chunk is None:
                    break
                if frames == 0:
                    level.ttfc_s.append(time.perf_counter() - began)
                frames += int(chunk.frames.shape[0])
        finally:
            stream.close()
        level.frames += frames
        level.session_fps.append(frames / (time.perf_counter() - began))

    async with trio.open_nursery() as nursery:
        if batcher is not None:
            nursery.start_soon(batcher.run)
        began = time.perf_counter()
        async with trio.open_nursery() as running:
            for seed in range(sessions):
                running.start_soon(session, seed + 1, began)
        level.wall_s = time.perf_counter() - began
        nursery.cancel_scope.cancel()
    if batcher is not None:
        level.rows, level.batches = batcher.rows, batcher.batches
    if cuda:
        level.peak_bytes = int(torch.cuda.max_memory_allocated())
    return level


def request(preset: Preset, seed: int) -> GenerationRequest:
    if preset.family == "framepack":  # image-to-video, vanilla sections, distilled guidance
        import numpy as np

        image = np.random.default_rng(seed).integers(0, 256, (preset.height, preset.width, 3))
        return GenerationRequest(
            request_id=f"bench-{seed}",
            prompt="a red fox running through fresh snow, cinematic",
            width=preset.width,
            height=preset.height,
            fps=preset.fps,
            num_frames=preset.num_frames,
            num_inference_steps=preset.steps,
            guidance_scale=preset.guidance,
            seed=seed,
            image=image.astype(np.uint8),
            # The text padded to 64 tokens, not the call's 256: a batch of more than one
            # row attends over the padding (masked) where a lone row cuts it, and at
            # 32x32 the text is most of the sequence (at 480p it is a few per cent).
            extra_params={"sampling_type": "vanilla", "max_sequence_length": 64},
        )
    return GenerationRequest(
        request_id=f"bench-{seed}",
        prompt="a red fox running through fresh snow, cinematic",
        negative_prompt="blurry" if preset.guidance > 1 else None,
        width=preset.width,
        height=preset.height,
        fps=preset.fps,
        num_frames=preset.num_frames,
        num_inference_steps=preset.steps,
        guidance_scale=preset.guidance,
        seed=seed,
    )


@contextlib.contextmanager
def eager_flex_attention(preset: Preset) -> Iterator[None]:
    """AnyFlow FAR on a CPU: flex attention's eager path (the same math; the tests' too)
    rather than its dynamo wrapper, which costs about 0.1 s a call there, a cost per
    forward that batching would save and a compiled GPU run would not have."""
    if preset.family != "far" or preset.device != "cpu":
        yield
        return
    import warnings

    from torch.nn.attention import flex_attention

    before = getattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False)
    flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def measure(preset: Preset, repeat: int, levels: tuple[int, ...]) -> dict[str, Any]:
    """Every level in both modes, ``repeat`` times; medians and ratios per level."""
    with (
        tempfile.TemporaryDirectory(prefix="diffusers-batching-") as root,
        eager_flex_attention(preset),
    ):
        model = preset.build(Path(root))
        args = {"model": str(model), "segment_frames": str(preset.window)}
        args["max_batch"] = str(preset.max_batch)
        if preset.threads is not None:
            args["threads"] = str(preset.threads)
        engine = load_engine("diffusers", args, device=preset.device)
        declared = max_batch(engine)
        batches = declared > 1
        runs: dict[str, dict[int, list[Level]]] = {"on": {}, "off": {}}
        try:
            # A family that does not batch runs "on" exactly as "off": measured once.
            modes = ("on", "off") if batches else ("off",)
            for mode in modes:  # warm up (allocator, kernels, each batch shape)
                trio.run(run_level, engine, preset, mode, min(2, max(levels)), declared)
            for r in range(repeat):
                for n in levels:
                    for mode in modes if r % 2 == 0 else modes[::-1]:
                        level = trio.run(run_level, engine, preset, mode, n, declared)
                        runs[mode].setdefault(n, []).append(level)
                        if not batches:
                            runs["on"].setdefault(n, []).append(level)
                        print(
                            f"  {preset.name} run {r + 1} {mode:>3} x{n}: "
                            f"{level.frames / level.wall_s:.2f} fps, "
                            f"first chunk {min(level.ttfc_s):.3f} s",
                            flush=True,
                        )
        finally:
            engine.close()
    table: list[dict[str, Any]] = []
    for n in levels:
        row: dict[str, Any] = {"sessions": n}
        for mode in ("on", "off"):
            got = runs[mode][n]
            row[f"{mode}_fps"] = median([lv.frames / lv.wall_s for lv in got])
            row[f"{mode}_rtf"] = median([median(lv.session_fps) / preset.fps for lv in got])
            row[f"{mode}_ttfc_s"] = median([median(lv.ttfc_s) for lv in got])
            peaks = [lv.peak_bytes for lv in got if lv.peak_bytes is not None]
            row[f"{mode}_peak_gib"] = max(peaks) / 2**30 if peaks else None
            row[f"{mode}_rows_per_batch"] = median(
                [lv.rows / lv.batches for lv in got if lv.batches]
            )
        row["fps_ratio"] = row["on_fps"] / row["off_fps"]
        row["ttfc_ratio"] = row["on_ttfc_s"] / row["off_ttfc_s"]
        table.append(row)
    return {"preset": attrs.asdict(preset), "batches": batches, "repeat": repeat, "levels": table}


def verdicts(result: dict[str, Any]) -> list[str]:
    lines = []
    rows = {row["sessions"]: row for row in result["levels"]}
    if FPS_RATIO_LEVEL in rows:
        ratio = rows[FPS_RATIO_LEVEL]["fps_ratio"]
        ok = "PASS" if ratio >= FPS_RATIO_MIN else "MISS"
        lines.append(
            f"{ok}: aggregate fps at {FPS_RATIO_LEVEL} sessions {ratio:.2f}x max_batch=1's "
            f"(target >= {FPS_RATIO_MIN}x)"
        )
    if 1 in rows:
        ratio = rows[1]["ttfc_ratio"]
        ok = "PASS" if ratio <= TTFC_RATIO_MAX else "MISS"
        lines.append(f"{ok}: lone TTFC {ratio:.2f}x max_batch=1's (target <= {TTFC_RATIO_MAX}x)")
    return lines


def markdown(result: dict[str, Any]) -> str:
    preset = result["preset"]
    lines = [
        f"### {preset['name']}: {preset['family']} {preset['width']}x{preset['height']}, "
        f"window {preset['window']} frames, {preset['steps']} steps, guidance "
        f"{preset['guidance']:g}, {preset['device']}, max_batch {preset['max_batch']} vs 1, "
        f"medians of {result['repeat']} run(s)"
        + ("" if result["batches"] else " (this family does not batch: measured once, as off)"),
        "",
        "| sessions | fps on | fps off | ratio | RTF on | RTF off | TTFC on s | TTFC off s "
        "| rows/batch | peak GiB on | peak GiB off |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def gib(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for row in result["levels"]:
        lines.append(
            f"| {row['sessions']} | {row['on_fps']:.2f} | {row['off_fps']:.2f} "
            f"| {row['fps_ratio']:.2f}x | {row['on_rtf']:.3f} | {row['off_rtf']:.3f} "
            f"| {row['on_ttfc_s']:.3f} | {row['off_ttfc_s']:.3f} "
            f"| {row['on_rows_per_batch']:.1f} | {gib(row['on_peak_gib'])} "
            f"| {gib(row['off_peak_gib'])} |"
        )
    return "\n".join([*lines, "", *verdicts(result)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), default=None)
    parser.add_argument("--repeat", type=int, default=1, help="runs per mode and level")
    parser.add_argument("--levels", default=None, help="sessions per level, e.g. 1,4 (preset's)")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    results = []
    for name in args.preset or ["cpu"]:
        preset = PRESETS[name]
        levels = preset.levels
        if args.levels:
            levels = tuple(int(n) for n in args.levels.split(","))
        result = measure(preset, max(1, args.repeat), levels)
        print(markdown(result), flush=True)
        results.append(result)
        if args.output is not None:  # after each preset: a run cut short keeps the first
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
