"""``decode`` (issue 24): the shapes engine decoding each chunk off its step path
(``defer_decode``, its default: the server decodes in the chunk's encode thread while the
next chunk is denoised) against the same engine decoding in ``next_chunk`` (``defer_decode=0``,
before), in the same run.

It is the ``batching`` scenario with other modes (`BatchingScenario`): per run one
server of each mode, measured one after the other in alternating order; single sessions
for the time to first chunk, then N sessions at once for the aggregate delivered fps;
per run the deferred/eager ratios of both. The shapes engine's decode is a bilinear
resize of its 32x32 frames to the requested size and a conversion to uint8, so the
preset asks for its default 256x256, where that is a measurable part of a chunk.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import attrs

from bench._report import cleanup_verdict, make_verdict
from bench.scenarios.batching import BatchingPreset, BatchingScenario

DECODE_PRESETS: Final = ("quick", "cpu", "gpu")
DECODE_MODES: Final = ("deferred", "eager")
"""``deferred``: ``defer_decode=1`` (the default); ``eager``: ``defer_decode=0`` (before)."""
TTFC_RATIO_MAX: Final = 1.15
FPS_RATIO_MIN: Final = 1.0


@attrs.frozen(kw_only=True)
class DecodePreset(BatchingPreset):
    """The batching preset's fields, at the engine's default size; both modes batch as
    the default server does (``max_batch`` 8)."""

    width: int = 256
    height: int = 256

    @classmethod
    def named(cls, name: str) -> DecodePreset:
        if name == "quick":  # for CI: seconds
            return cls(
                name=name,
                device="cpu",
                levels=(1, 2),
                max_batch=8,
                window_s=1.0,
                window_chunks=2,
                ttfc_sessions=2,
            )
        if name == "cpu":
            return cls(name=name, device="cpu", levels=(1, 4), max_batch=8)
        if name == "gpu":
            return cls(
                name=name,
                device="cuda",
                levels=(1, 8),
                max_batch=32,
                width=832,
                height=480,
                num_frames=24000,
            )
        raise ValueError(f"unknown decode preset {name!r}: use {', '.join(DECODE_PRESETS)}")

    @classmethod
    def default(cls, quick: bool) -> DecodePreset:
        """--quick: quick; otherwise gpu where CUDA is available, else cpu."""
        if quick:
            return cls.named("quick")
        import torch

        return cls.named("gpu" if torch.cuda.is_available() else "cpu")

    def engine_args(self, mode: str) -> tuple[tuple[str, str], ...]:
        return (
            ("max_batch", str(self.max_batch)),
            ("defer_decode", "1" if mode == "deferred" else "0"),
        )


class DecodeScenario(BatchingScenario):
    """Deferred decode against eager decode: TTFC and aggregate fps, side by side."""

    name: ClassVar[str] = "decode"
    modes: ClassVar[tuple[str, str]] = DECODE_MODES

    def evaluate(self) -> list[dict[str, Any]]:
        """No speed-up is promised on a CPU (the decode and the steps share its cores);
        what is checked is that deferring costs neither the first chunk nor throughput."""
        p = self.preset
        level = max(p.levels)
        return [
            make_verdict(
                f"decode: aggregate fps at {level} sessions, deferred / eager",
                self.figures.stat(f"decode.n{level}.fps_ratio", "median"),
                FPS_RATIO_MIN,
                f">= {FPS_RATIO_MIN}x (median over runs of each run's ratio)",
                at_least=True,
            ),
            make_verdict(
                "decode: aggregate fps, one session, deferred / eager",
                self.figures.stat("decode.n1.fps_ratio", "median"),
                FPS_RATIO_MIN,
                f">= {FPS_RATIO_MIN}x (median over runs of each run's ratio)",
                at_least=True,
            ),
            make_verdict(
                "decode: time to first chunk, one session, deferred / eager",
                self.figures.stat("decode.n1.ttfc_ratio", "median"),
                TTFC_RATIO_MAX,
                f"<= {TTFC_RATIO_MAX}x (median over runs of each run's ratio of median TTFCs)",
            ),
            cleanup_verdict("decode", self.checks),
        ]

    def describe(self) -> list[str]:
        p = self.preset
        return [
            f"Decode: preset {p.name}: the shapes engine on {p.device}, its decode deferred "
            f"to the encode thread (defer_decode=1) against in next_chunk (defer_decode=0), "
            f"max_batch {p.max_batch}; {p.width}x{p.height} at {p.fps} fps, {p.num_frames} "
            f"frames per session (unpaced); levels {','.join(map(str, p.levels))}; a window "
            f"of at least {p.window_s:g} s and {p.window_chunks} chunks per session; "
            f"{p.ttfc_sessions} single-session TTFC sample(s) per run",
            "",
            *(f"Server {mode}: `{self.targets[mode].shown}`" for mode in self.modes),
        ]
