"""Random Wan pipelines built in code: the diffusers engine's tests and the bench's
``diffusers`` scenario both use them.

The components follow diffusers' own fast tests for Wan (a small
``WanTransformer3DModel``, a minimal ``AutoencoderKLWan``), with a byte-level tokenizer
(``ByT5Tokenizer`` needs no vocabulary file, so nothing is downloaded) and a one-layer
UMT5 encoder sized to it. ``build_wan_t2v`` writes a pipeline directory with
``save_pretrained``, exactly what ``--engine-arg model=...`` reads. Its ``size`` picks how
big the random transformer and VAE are: ``TINY`` (the tests' default, milliseconds per
call), or the larger sizes the benchmark uses so that a segment takes measurable time.

Everything imports torch, diffusers and transformers lazily: importing this module is free.
"""

from __future__ import annotations

from pathlib import Path

import attrs

TEXT_DIM = 32


@attrs.frozen(kw_only=True)
class WanSize:
    """The shape of a random Wan transformer and VAE."""

    layers: int = 2
    heads: int = 2
    head_dim: int = 12
    ffn_dim: int = 32
    rope_max_seq_len: int = 32
    vae_base_dim: int = 3
    vae_dim_mult: tuple[int, ...] = (1, 1, 1, 1)
    vae_res_blocks: int = 1


TINY = WanSize()
"""The tests' pipeline: a 2-layer transformer of width 24, a 3-channel VAE."""


def text_encoder_and_tokenizer() -> tuple[object, object]:
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    tokenizer = ByT5Tokenizer()
    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=TEXT_DIM,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
    )
    return UMT5EncoderModel(config).eval(), tokenizer


def vae(size: WanSize = TINY) -> object:
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=size.vae_base_dim,
        z_dim=16,
        dim_mult=list(size.vae_dim_mult),
        num_res_blocks=size.vae_res_blocks,
        temperal_downsample=[False, True, True],
    )


def transformer(*, in_channels: int, image_dim: int | None, size: WanSize = TINY) -> object:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=size.heads,
        attention_head_dim=size.head_dim,
        in_channels=in_channels,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=size.ffn_dim,
        num_layers=size.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=size.rope_max_seq_len,
        image_dim=image_dim,
    )


def scheduler() -> object:
    from diffusers import UniPCMultistepScheduler

    # As Wan ships it: flow-matching sigmas with a shift.
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )


def build_wan_t2v(path: Path, *, seed: int = 0, size: WanSize = TINY) -> Path:
    """A random text-to-video ``WanPipeline``, saved to ``path``."""
    import torch
    from diffusers import WanPipeline

    torch.manual_seed(seed)
    encoder, tokenizer = text_encoder_and_tokenizer()
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=encoder,
        vae=vae(size),
        scheduler=scheduler(),
        transformer=transformer(in_channels=16, image_dim=None, size=size),
    )
    pipe.save_pretrained(path)
    return path
