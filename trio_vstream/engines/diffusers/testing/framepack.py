"""A tiny random FramePack pipeline (``HunyuanVideoFramepackPipeline``), its tokenizers
built in memory."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from trio_vstream.engines.diffusers.testing._common import saved, word_tokenizer

FRAMEPACK_WORDS = "a red fox in the snow blue whale blurry cat dog"
"""The tiny FramePack tokenizer's words besides its template's (others are ``<unk>``)."""


def build_framepack(path: Path, *, seed: int = 0, layers: int = 1, heads: int = 2) -> Path:
    """A random ``HunyuanVideoFramepackPipeline``, saved to ``path``. The transformer and
    VAE follow diffusers' fast test for it (``test_hunyuan_video_framepack.py``); the
    tokenizers, which that test downloads, are `word_tokenizer`s built here over the
    pipeline's own prompt template, and the SigLIP image encoder and its processor are
    built from tiny configs. Requests are multiples of 16 (``check_inputs``) and need an
    ``image_reference`` (the pipeline is image-to-video).

    ``layers`` (double- and single-stream blocks, each) and ``heads`` (of ten channels)
    make a forward cost measurable time, for the batching benchmark; the defaults are
    the fast test's."""
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoFramepackPipeline,
        HunyuanVideoFramepackTransformer3DModel,
    )
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video_framepack import (
        DEFAULT_PROMPT_TEMPLATE,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        LlamaConfig,
        LlamaModel,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    try:  # without torchvision, transformers picks this class anyway, with a warning
        from transformers import SiglipImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import SiglipImageProcessor as ImageProcessor

    torch.manual_seed(seed)
    template = DEFAULT_PROMPT_TEMPLATE["template"]
    assert isinstance(template, str)  # diffusers' dict also holds an int (crop_start)
    words = template.format(FRAMEPACK_WORDS)
    tokenizer = word_tokenizer(words, eos=False)
    vocab = len(tokenizer)
    model = HunyuanVideoFramepackTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=heads,
        attention_head_dim=10,
        num_layers=layers,
        num_single_layers=layers,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
        image_condition_type=None,
        has_image_proj=True,
        image_proj_dim=32,
        has_clean_x_embedder=True,
    )
    blocks = 4
    autoencoder = AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * blocks,
        up_block_types=("HunyuanVideoUpBlock3D",) * blocks,
        block_out_channels=(8,) * blocks,
        layers_per_block=1,
        act_fn="silu",
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )
    ids: _TokenIds = {"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0, "vocab_size": vocab}
    text_encoder = LlamaModel(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            hidden_act="gelu",
            **ids,
        )
    )
    text_encoder_2 = CLIPTextModel(
        CLIPTextConfig(
            hidden_size=8,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            projection_dim=8,
            max_position_embeddings=77,
            **ids,
        )
    )
    image_encoder = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=32,  # the transformer's image_proj_dim
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        )
    )
    pipe = HunyuanVideoFramepackPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=model,
        vae=autoencoder,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=text_encoder_2,
        tokenizer_2=word_tokenizer(words, eos=True),
        image_encoder=image_encoder,
        feature_extractor=ImageProcessor(size={"height": 32, "width": 32}),
    )
    return saved(pipe, path)


class _TokenIds(TypedDict):
    """The tiny FramePack text encoders' token ids, the same in both configs."""

    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    vocab_size: int
