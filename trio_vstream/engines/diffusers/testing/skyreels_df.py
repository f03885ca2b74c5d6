"""Tiny random SkyReels-V2 diffusion-forcing pipelines (text- and image-to-video), on the
Wan parts of `wan`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from trio_vstream.engines.diffusers.testing._common import saved
from trio_vstream.engines.diffusers.testing.wan import (
    TEXT_DIM,
    TINY,
    WanSize,
    text_encoder_and_tokenizer,
    vae,
)

SKYREELS_DF_VARIANTS = ("t2v", "i2v")
"""``build_skyreels_df``'s variants: ``SkyReelsV2DiffusionForcingPipeline`` and
``SkyReelsV2DiffusionForcingImageToVideoPipeline``."""


def build_skyreels_df(
    path: Path,
    *,
    variant: Literal["t2v", "i2v"] = "t2v",
    seed: int = 0,
    size: WanSize = TINY,
) -> Path:
    """A random SkyReels-V2 diffusion-forcing pipeline, saved to ``path``. The transformer
    follows diffusers' fast test for it (``test_skyreels_v2_df.py``), with the fps
    embedding on (``inject_sample_info``, as the released DF checkpoints have it); the
    scheduler is UniPC with flow sigmas, as the checkpoints ship it. Both variants built
    with the same ``seed`` share their weights, so one can be checked against the other."""
    import torch
    from diffusers import (
        SkyReelsV2DiffusionForcingImageToVideoPipeline,
        SkyReelsV2DiffusionForcingPipeline,
        SkyReelsV2Transformer3DModel,
        UniPCMultistepScheduler,
    )

    if variant not in SKYREELS_DF_VARIANTS:
        raise ValueError(f"variant must be one of {SKYREELS_DF_VARIANTS}, got {variant!r}")
    torch.manual_seed(seed)
    encoder, tokenizer = text_encoder_and_tokenizer()
    model = SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=size.heads,
        attention_head_dim=size.head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=size.ffn_dim,
        num_layers=size.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=size.rope_max_seq_len,
        inject_sample_info=True,
    )
    sched = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0
    )
    kind = (
        SkyReelsV2DiffusionForcingPipeline
        if variant == "t2v"
        else SkyReelsV2DiffusionForcingImageToVideoPipeline
    )
    pipe = kind(
        tokenizer=tokenizer, text_encoder=encoder, vae=vae(size), transformer=model, scheduler=sched
    )
    return saved(pipe, path)
