"""A tiny random SANA-WM pipeline (a camera-steered world model on LTX-2's video VAE),
and the larger size the GPU check uses."""

from __future__ import annotations

from pathlib import Path

import attrs

from trio_vstream.engines.diffusers.testing._common import ltx2_video_vae, saved, word_tokenizer


@attrs.frozen(kw_only=True)
class SanaWMSize:
    """The shape of a random SANA-WM transformer and LTX-2 VAE (`build_sana_wm`)."""

    layers: int = 2
    heads: int = 2
    head_dim: int = 16
    softmax_every_n: int = 2
    """Every n-th block uses softmax attention, the others linear (GDN) attention."""
    text_dim: int = 16
    vae_channels: tuple[int, ...] = (8,)
    """One VAE block per entry; each halves the frame's sides and its frame count
    (``spatiotemporal``): one block is 2x compression, frame counts 2n+1."""
    vae_patch: int = 1
    """The VAE's spatial patch: the spatial ratio is ``vae_patch * 2**blocks``."""
    latent_channels: int = 4


SANA_WM_TINY = SanaWMSize()
"""The tests' SANA-WM: a 2-layer transformer of width 32, one VAE block (frames 2n+1,
sizes multiples of 2)."""

SANA_WM_GPU = SanaWMSize(
    layers=8,
    heads=10,
    head_dim=112,
    softmax_every_n=4,
    text_dim=256,
    vae_channels=(32, 64, 128),
    vae_patch=4,
    latent_channels=128,
)
"""The GPU check's SANA-WM (``bench/sana_wm_check.py``): half the released
model's width (10 heads of 112, of its 2240) and 8 of its 20 layers, 273 M
parameters; a small VAE with the LTX-2 VAE's real compression (32x spatial, 8x temporal,
128 latent channels), so a 704x1280 segment has the real model's token count."""

SANA_WM_WORDS = "a red fox in the snow blue whale blurry"
"""The tiny SANA-WM tokenizer's words besides its instruction prefix's (others are
``<unk>``)."""


def build_sana_wm(path: Path, *, seed: int = 0, size: SanaWMSize = SANA_WM_TINY) -> Path:
    """A random ``SanaWMPipeline``, saved to ``path``: a small ``SanaWMTransformer3DModel``
    (its config is made to be scaled down), an ``AutoencoderKLLTX2Video`` sized as in
    diffusers' LTX-2 fast tests but compressing in time too (SANA-WM's camera branch
    packs ``6 * temporal ratio`` Plücker channels), a one-layer Gemma-2 encoder and a
    `word_tokenizer` over the pipeline's instruction prefix. Its ``__call__`` defaults to
    704x1280; any size that is a multiple of the VAE's ratio works (the tests use 16x32)."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SanaWMPipeline,
        SanaWMTransformer3DModel,
    )
    from diffusers.pipelines.sana_wm.pipeline_sana_wm import DEFAULT_CHI_PROMPT
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    tokenizer = word_tokenizer("\n".join(DEFAULT_CHI_PROMPT) + " " + SANA_WM_WORDS, eos=False)
    text_encoder = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=len(tokenizer),
            hidden_size=size.text_dim,
            intermediate_size=2 * size.text_dim,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=size.text_dim // 2,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=3,
        )
    ).eval()
    blocks = len(size.vae_channels)
    vae_model = ltx2_video_vae(
        size.vae_channels,
        latent_channels=size.latent_channels,
        patch=size.vae_patch,
        encoder_blocks=blocks,
    )
    model = SanaWMTransformer3DModel(
        in_channels=size.latent_channels,
        num_layers=size.layers,
        hidden_size=size.heads * size.head_dim,
        num_attention_heads=size.heads,
        linear_head_dim=size.head_dim,
        softmax_every_n=size.softmax_every_n,
        chunk_plucker_channels=6 * 2**blocks,  # 6 per frame of a latent frame's 2**blocks
        chunk_plucker_post_attn_blocks=size.layers,
        caption_channels=size.text_dim,
        mixed_precision="fp32",
    )
    pipe = SanaWMPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae_model,
        transformer=model,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    return saved(pipe, path)
