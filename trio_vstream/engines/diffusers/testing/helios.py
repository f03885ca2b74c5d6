"""Tiny random Helios pipelines (chunk-autoregressive: base, pyramid, distilled), on
the Wan parts of `wan`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from trio_vstream.engines.diffusers.testing._common import saved
from trio_vstream.engines.diffusers.testing.wan import (
    TEXT_DIM,
    TINY,
    WanSize,
    text_encoder_and_tokenizer,
    vae,
)

if TYPE_CHECKING:
    from diffusers import (
        HeliosDMDScheduler,
        HeliosPipeline,
        HeliosPyramidPipeline,
        HeliosScheduler,
    )

HELIOS_VARIANTS = ("base", "pyramid", "distilled")
"""``build_helios``'s variants: ``HeliosPipeline``, ``HeliosPyramidPipeline``, and the
pyramid pipeline distilled (``is_distilled``, ``HeliosDMDScheduler``)."""

HELIOS_GAMMA = 0.01
"""The pyramid's block-noise gamma for the tiny models: with HeliosScheduler's default
(1/3) the block-noise covariance can be singular on models this small."""


def build_helios(
    path: Path,
    *,
    variant: Literal["base", "pyramid", "distilled"] = "base",
    seed: int = 0,
    size: WanSize = TINY,
) -> Path:
    """A random Helios pipeline (chunk-autoregressive: 9 latent frames, 33 frames, a
    chunk), saved to ``path``. Its transformer's history patches need latents of at
    least 8x8, so requests are 64x64 or larger (multiples of 32 for the pyramid)."""
    import torch
    from diffusers import (
        HeliosDMDScheduler,
        HeliosPipeline,
        HeliosPyramidPipeline,
        HeliosScheduler,
        HeliosTransformer3DModel,
    )

    if variant not in HELIOS_VARIANTS:
        raise ValueError(f"variant must be one of {HELIOS_VARIANTS}, got {variant!r}")
    torch.manual_seed(seed)
    encoder, tokenizer = text_encoder_and_tokenizer()
    rope = size.head_dim // 3
    model = HeliosTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=size.heads,
        attention_head_dim=size.head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=size.ffn_dim,
        num_layers=size.layers,
        rope_dim=(size.head_dim - 2 * rope, rope, rope),
    )
    components = {"tokenizer": tokenizer, "text_encoder": encoder, "vae": vae(size)}
    sched: HeliosScheduler | HeliosDMDScheduler
    pipe: HeliosPipeline | HeliosPyramidPipeline
    if variant == "base":
        sched = HeliosScheduler(stages=1, use_dynamic_shifting=True)
        pipe = HeliosPipeline(scheduler=sched, transformer=model, **components)
    else:
        distilled = variant == "distilled"
        kind = HeliosDMDScheduler if distilled else HeliosScheduler
        sched = kind(stages=3, gamma=HELIOS_GAMMA, use_dynamic_shifting=True)
        pipe = HeliosPyramidPipeline(
            scheduler=sched, transformer=model, is_distilled=distilled, **components
        )
    return saved(pipe, path)
