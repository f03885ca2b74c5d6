"""Tiny random diffusers pipelines, built in code, for the diffusers engine tests.

The components follow diffusers' own fast tests for Wan (a 2-layer
``WanTransformer3DModel``, a minimal ``AutoencoderKLWan``), with a byte-level
tokenizer (``ByT5Tokenizer`` needs no vocabulary file, so nothing is
downloaded) and a one-layer UMT5 encoder sized to it. Each ``build_*``
function writes a pipeline directory with ``save_pretrained``, exactly what
``--engine-arg model=...`` reads.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

TEXT_DIM = 32


def _text_encoder_and_tokenizer() -> tuple[object, object]:
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


def _vae() -> object:
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )


def _transformer(*, in_channels: int, image_dim: int | None) -> object:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        image_dim=image_dim,
    )


def _scheduler() -> object:
    from diffusers import UniPCMultistepScheduler

    # As Wan ships it: flow-matching sigmas with a shift.
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )


def build_wan_t2v(path: Path, *, seed: int = 0) -> Path:
    """A random text-to-video ``WanPipeline``, saved to ``path``."""
    from diffusers import WanPipeline

    torch.manual_seed(seed)
    text_encoder, tokenizer = _text_encoder_and_tokenizer()
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_vae(),
        scheduler=_scheduler(),
        transformer=_transformer(in_channels=16, image_dim=None),
    )
    pipe.save_pretrained(path)
    return path


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
    text_encoder, tokenizer = _text_encoder_and_tokenizer()
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
        vae=_vae(),
        scheduler=_scheduler(),
        transformer=_transformer(in_channels=36, image_dim=4),
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

    transformer = WanTransformer3DModel.from_pretrained(pipeline_path / "transformer")
    torch.manual_seed(seed)
    transformer.add_adapter(
        LoraConfig(
            r=4,
            lora_alpha=4,
            target_modules=["to_q", "to_k", "to_v", "to_out.0"],
            init_lora_weights=False,  # random A and B: the adapter changes the output
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layers = get_peft_model_state_dict(transformer)
    WanPipeline.save_lora_weights(out, transformer_lora_layers=layers)
    return out
