"""Tiny random diffusers pipelines, built in code, for the diffusers engine tests.

The text-to-video pipeline and its parts come from ``bench/diffusers_tiny.py``, which the
benchmark's ``diffusers`` scenario builds its (larger) pipelines with too: a 2-layer
``WanTransformer3DModel`` and a minimal ``AutoencoderKLWan`` as in diffusers' own fast
tests, a byte-level tokenizer (``ByT5Tokenizer`` needs no vocabulary file, so nothing is
downloaded) and a one-layer UMT5 encoder sized to it. Each ``build_*`` function writes a
pipeline directory with ``save_pretrained``, exactly what ``--engine-arg model=...`` reads.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from bench.diffusers_tiny import (
    TEXT_DIM,
    build_wan_t2v,
    scheduler,
    text_encoder_and_tokenizer,
    transformer,
    vae,
)

__all__ = ["TEXT_DIM", "build_lora", "build_wan_i2v", "build_wan_t2v"]


def build_wan_i2v(path: Path, *, seed: int = 1) -> Path:
    """A random image-to-video ``WanImageToVideoPipeline`` (Wan 2.1 layout, with a
    CLIP image encoder), saved to ``path``."""
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
    pipe.save_pretrained(path)
    return path


def build_lora(pipeline_path: Path, out: Path, *, seed: int = 2) -> Path:
    """A random LoRA for the transformer of the pipeline at ``pipeline_path``, saved with
    the pipeline class's ``save_lora_weights`` (``pytorch_lora_weights.safetensors``)."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoraConfig, get_peft_model_state_dict

    model = WanTransformer3DModel.from_pretrained(pipeline_path / "transformer")
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
