"""Tiny random Wan pipelines (text-, image- and video-to-video), their LoRA, and the Wan parts
the other Wan-based families (Helios, SkyReels-V2 DF, AnyFlow FAR) are built from.

The components follow diffusers' own fast tests for Wan (a small
``WanTransformer3DModel``, a minimal ``AutoencoderKLWan``), with a byte-level tokenizer
(``ByT5Tokenizer`` needs no vocabulary file) and a one-layer UMT5 encoder sized to it.
``build_wan_t2v``'s ``size`` picks how big the random transformer and VAE are: `TINY`
(the tests' default, milliseconds per call), or the larger sizes the benchmark uses so
that a segment takes measurable time.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from trio_vstream.engines.diffusers.testing._common import saved

if TYPE_CHECKING:
    from transformers import ByT5Tokenizer, UMT5EncoderModel

TEXT_DIM = 32
"""The text encoder's width, which the transformer's ``text_dim`` must match."""


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


def text_encoder_and_tokenizer() -> tuple[UMT5EncoderModel, ByT5Tokenizer]:
    """A one-layer UMT5 encoder and a byte-level tokenizer: real classes, so prompts are
    encoded as Wan encodes them, and no vocabulary to download."""
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
    """A random ``AutoencoderKLWan`` with Wan's real compression (8x spatial, 4x temporal),
    so frame counts and sizes are checked as for the real model."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=size.vae_base_dim,
        z_dim=16,
        dim_mult=list(size.vae_dim_mult),
        num_res_blocks=size.vae_res_blocks,
        temperal_downsample=[False, True, True],
    )


def transformer(*, in_channels: int, image_dim: int | None, size: WanSize = TINY) -> object:
    """A random ``WanTransformer3DModel``: 16 latent channels in for text-to-video, 36
    (latents, mask, image latents) with an image embedding for image-to-video."""
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
    """The scheduler Wan ships with, so ``flow_shift`` requests reach a real config."""
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
    return saved(pipe, path)


def build_wan_v2v(path: Path, *, seed: int = 0, size: WanSize = TINY) -> Path:
    """A random video-to-video ``WanVideoToVideoPipeline``, saved to ``path``: the parts
    `build_wan_t2v` makes (the same weights for the same ``seed`` and ``size``), under the
    class that takes an input video and a ``strength``."""
    import torch
    from diffusers import WanVideoToVideoPipeline

    torch.manual_seed(seed)
    encoder, tokenizer = text_encoder_and_tokenizer()
    pipe = WanVideoToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=encoder,
        vae=vae(size),
        scheduler=scheduler(),
        transformer=transformer(in_channels=16, image_dim=None, size=size),
    )
    return saved(pipe, path)


def build_wan_i2v(path: Path, *, seed: int = 1) -> Path:
    """A random image-to-video ``WanImageToVideoPipeline`` (Wan 2.1 layout, with a
    CLIP image encoder), saved to ``path``."""
    import torch
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPVisionConfig, CLIPVisionModel

    try:  # without torchvision, transformers picks this class anyway, with a warning
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor

    torch.manual_seed(seed)
    text_encoder, tokenizer = text_encoder_and_tokenizer()
    image_encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=4,
            projection_dim=4,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            intermediate_size=16,
            patch_size=1,
        )
    )
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae(),
        scheduler=scheduler(),
        transformer=transformer(in_channels=36, image_dim=4),
        image_encoder=image_encoder,
        image_processor=ImageProcessor(crop_size=32, size=32),
    )
    return saved(pipe, path)


def build_lora(
    pipeline_path: Path, out: Path, *, seed: int = 2, model_class: str = "WanTransformer3DModel"
) -> Path:
    """A random LoRA for the transformer of the pipeline at ``pipeline_path``, saved with
    the pipeline class's ``save_lora_weights`` (``pytorch_lora_weights.safetensors``).
    ``model_class`` names the diffusers class the transformer loads as (Wan's attention
    names, which SkyReels-V2 and AnyFlow FAR share; FAR's needs its own class)."""
    import diffusers
    import torch
    from diffusers import WanPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    model = getattr(diffusers, model_class).from_pretrained(pipeline_path / "transformer")
    torch.manual_seed(seed)
    model.add_adapter(
        LoraConfig(
            r=4,
            lora_alpha=4,
            target_modules=["to_q", "to_k", "to_v", "to_out.0"],
            init_lora_weights=False,  # random A and B: the adapter changes the output
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layers = get_peft_model_state_dict(model)
    WanPipeline.save_lora_weights(out, transformer_lora_layers=layers)
    return out
