"""What the ``diffusers`` scenario measures: the random Wan pipelines of its presets
(their size, and the request each segment is), and the families the engine streams
exactly (`STREAMED`), each with the request whose first chunk is measured against the
pipeline's single call for the whole video, and its figures.

Shared by the two sides of the measurement: the worker process that makes the calls
directly (``_diffusers_worker``) and the scenario that drives it and the server
(``diffusers``), so that both build and ask for the same thing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import attrs

from bench import diffusers_tiny
from bench._settings import PROMPT
from bench._stats import CATALOGUE

DIFFUSERS_PRESETS: Final = ("tiny", "cpu", "gpu")


@attrs.frozen(kw_only=True)
class DiffusersPreset:
    """A random Wan pipeline and the request the scenario sends it: every segment is one
    pipeline call of ``segment_frames`` frames and ``steps`` denoising steps, with
    classifier-free guidance (two transformer passes per step), as Wan is run."""

    name: str
    device: str
    model: diffusers_tiny.WanSize
    """The transformer's and the VAE's shape."""
    width: int
    height: int
    segment_frames: int
    steps: int
    guidance_scale: float = 5.0

    @classmethod
    def named(cls, name: str) -> DiffusersPreset:
        if name == "tiny":  # the tests' pipeline, milliseconds per call: for --quick
            return cls(
                name=name,
                device="cpu",
                model=diffusers_tiny.TINY,
                width=48,
                height=32,
                segment_frames=5,
                steps=2,
            )
        if name == "cpu":  # a few hundred ms per segment on one core
            model = diffusers_tiny.WanSize(
                layers=4,
                heads=4,
                head_dim=32,
                ffn_dim=512,
                rope_max_seq_len=1024,
                vae_base_dim=3,
                vae_dim_mult=(1, 1, 1, 1),
                vae_res_blocks=1,
            )
            return cls(
                name=name,
                device="cpu",
                model=model,
                width=128,
                height=96,
                segment_frames=17,
                steps=4,
            )
        if name == "gpu":  # Wan 2.1 1.3B's widths and VAE, 10 of its 30 blocks, at 480p
            model = diffusers_tiny.WanSize(
                layers=10,
                heads=12,
                head_dim=128,
                ffn_dim=8960,
                rope_max_seq_len=1024,
                vae_base_dim=96,
                vae_dim_mult=(1, 2, 4, 4),
                vae_res_blocks=2,
            )
            return cls(
                name=name,
                device="cuda",
                model=model,
                width=832,
                height=480,
                segment_frames=17,
                steps=4,
            )
        raise ValueError(f"unknown diffusers preset {name!r}: use {', '.join(DIFFUSERS_PRESETS)}")

    @classmethod
    def default(cls, quick: bool) -> DiffusersPreset:
        """--quick: tiny; otherwise gpu where CUDA is available, else cpu."""
        if quick:
            return cls.named("tiny")
        import torch

        return cls.named("gpu" if torch.cuda.is_available() else "cpu")

    def engine_args(self, model: Path) -> dict[str, str]:
        return {"model": str(model), "threads": "1", "segment_frames": str(self.segment_frames)}

    def start_fields(self, num_frames: int, seed: int) -> dict[str, Any]:
        return {
            "size": f"{self.width}x{self.height}",
            "fps": 16,
            "num_frames": num_frames,
            "num_inference_steps": self.steps,
            "guidance_scale": self.guidance_scale,
            "seed": seed,
        }


@attrs.frozen(kw_only=True)
class StreamedFamily:
    """A family the engine streams exactly (its frames are the pipeline's single call's),
    measured against that single call: the first chunk should come after about 1/k of
    the call's time for a k-chunk video. A random pipeline of the family is built in the
    worker's directory; the request makes k chunks of even work."""

    key: str
    """The figures' prefix (``diffusers.<key>.*``) and the worker's command."""
    label: str
    """The pipeline, as the figures' descriptions name it."""
    unit: str
    """What the family calls a chunk: ``chunk``, ``window``."""
    target: str
    """The verdict's name."""
    build: str
    """The ``diffusers_tiny`` builder of its random pipeline."""
    directory: str
    size: int
    """The frames' width and height."""
    first_frames: int
    """The first chunk's frames."""
    later_frames: int
    """Each later chunk's new frames."""
    engine_args: dict[str, str] = attrs.field(factory=dict)
    extra_params: dict[str, Any] = attrs.field(factory=dict)

    def request(self, preset: DiffusersPreset, chunks: int, seed: int) -> Any:
        """The request for a ``chunks``-chunk video."""
        from trio_vstream.engines import GenerationRequest

        return GenerationRequest(
            request_id=f"diffusers-bench-{self.key}",
            extra_params=dict(self.extra_params),
            prompt=PROMPT,
            width=self.size,
            height=self.size,
            fps=16,
            num_frames=self.first_frames + self.later_frames * (chunks - 1),
            num_inference_steps=preset.steps,
            guidance_scale=1.0,
            seed=seed,
        )


FORCING_WINDOW_FRAMES: Final = 17
"""SkyReels-V2 DF's window (``segment_frames``, the call's ``base_num_frames``): 5 latent
frames. With one latent frame of overlap, each later window adds 4 latent frames (16
frames), about as much as the first (17): then the windows are even work and 1/k is the
ideal."""

STREAMED: Final = (
    StreamedFamily(
        key="chunked",
        label="random Helios",
        unit="chunk",
        target="diffusers: chunked first chunk",
        build="build_helios",
        directory="Helios-random-tiny",
        size=64,  # the smallest the tiny Helios takes
        first_frames=33,  # its chunk: 9 latent frames, the engine's segment_frames
        later_frames=33,
    ),
    StreamedFamily(
        key="forcing",
        label="random SkyReels-V2 DF",
        unit="window",
        target="diffusers: diffusion-forcing first window",
        build="build_skyreels_df",
        directory="SkyReels-DF-random-tiny",
        size=32,
        first_frames=FORCING_WINDOW_FRAMES,
        later_frames=FORCING_WINDOW_FRAMES - 1,
        engine_args={"segment_frames": str(FORCING_WINDOW_FRAMES)},
        # The window is given too, so the engine's plan holds the single call's arguments.
        extra_params={"overlap_history": 1, "base_num_frames": FORCING_WINDOW_FRAMES},
    ),
)
"""The families measured streamed against their single call."""

for _family in STREAMED:  # their figures, declared beside them (bench/_stats.py is shared)
    CATALOGUE.update(
        {
            f"diffusers.{_family.key}.whole_call_ms": (
                "ms",
                f"{_family.label}: the pipeline's single call for the whole k-{_family.unit} video",
            ),
            f"diffusers.{_family.key}.first_chunk_ms": (
                "ms",
                f"{_family.label} streamed by the engine: open_stream -> first {_family.unit}",
            ),
            f"diffusers.{_family.key}.streamed_total_ms": (
                "ms",
                f"{_family.label} streamed by the engine: open_stream -> last {_family.unit}",
            ),
            f"diffusers.{_family.key}.first_chunk_fraction": (
                "ratio",
                f"{_family.label}: first streamed {_family.unit} / single call for the whole "
                "video (ideal 1/k)",
            ),
        }
    )
