"""Tiny random LTX-2 pipelines (text- and image-to-video, with their soundtrack), and
the larger size the GPU benchmark uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from trio_vstream.engines.diffusers.testing._common import ltx2_video_vae, saved, word_tokenizer

LTX2_WORDS = "a red fox in the snow blue whale blurry cat dog robot dancing rain city night"
"""The tiny LTX-2 tokenizer's words (others are ``<unk>``)."""


@attrs.frozen(kw_only=True)
class LTX2Size:
    """The shape of a random LTX-2: its transformer, text encoder and video VAE."""

    layers: int = 2
    heads: int = 2
    head_dim: int = 8
    audio_heads: int = 2
    audio_head_dim: int = 4
    text_dim: int = 16
    """The Gemma 3 encoder's width (``caption_channels``), also the connectors'."""
    text_layers: int = 2
    vae_channels: tuple[int, ...] = (8,)
    """One VAE block per entry, each halving the size and the frame rate."""
    vae_patch: int = 4
    """The VAE's spatial patch (pixel unshuffle): with one block, 8x spatial compression."""


LTX2_TINY = LTX2Size()
"""The tests' LTX-2: 8x spatial and 2x temporal compression (frame counts ``2n+1``), a
2-layer transformer of width 16, milliseconds of work per step at 32x32."""

LTX2_BENCH = LTX2Size(
    layers=8,
    heads=8,
    head_dim=64,
    audio_heads=8,
    audio_head_dim=32,
    text_dim=64,
    vae_channels=(64, 128, 256),
    vae_patch=4,
)
"""The GPU benchmark's LTX-2: the real model's compression (32x spatial, 8x temporal,
frame counts ``8n+1``) with an 8-layer transformer of width 512: random weights, so it
measures the engine's streaming of LTX-2's shapes, not the real model's speed."""


def build_ltx2(
    path: Path, *, seed: int = 0, image_to_video: bool = False, size: LTX2Size = LTX2_TINY
) -> Path:
    """A random ``LTX2Pipeline`` (``image_to_video``: ``LTX2ImageToVideoPipeline``) with its
    audio branch, saved to ``path``. Built with the same ``seed`` and ``size``, the two
    share every weight, so one can continue the other's video. The parts follow
    diffusers' fast tests for LTX-2 (``tests/pipelines/ltx2``), except the text encoder
    and tokenizer, which those tests download: a `word_tokenizer` over `LTX2_WORDS` and a
    ``Gemma3ForConditionalGeneration`` from a tiny config (a one-layer SigLIP tower it
    never uses, as LTX-2 encodes text only). The audio VAE is LTX-2's (16 kHz mel, hop
    160, 4x latent compression); the vocoder upsamples each mel frame 240 times, so its
    waveform is 24 kHz stereo, as the released ``LTX2Vocoder``'s. Requests are multiples
    of 32 (``check_inputs``)."""
    import torch
    from diffusers import (
        AutoencoderKLLTX2Audio,
        FlowMatchEulerDiscreteScheduler,
        LTX2ImageToVideoPipeline,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    torch.manual_seed(seed)
    tokenizer = word_tokenizer(LTX2_WORDS, eos=False)
    vocab = len(tokenizer)
    text_config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=size.text_dim,
        intermediate_size=2 * size.text_dim,
        num_hidden_layers=size.text_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=size.text_dim // 2,
        max_position_embeddings=1024,  # the pipeline's max_sequence_length
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    vision_config = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    text_encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=text_config,
            vision_config=vision_config,
            mm_tokens_per_image=4,  # (16 / 8) ** 2 patches
            boi_token_index=vocab,
            eoi_token_index=vocab + 1,
            image_token_index=vocab + 2,
        )
    ).eval()
    model = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=size.heads,
        attention_head_dim=size.head_dim,
        cross_attention_dim=size.heads * size.head_dim,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=size.audio_heads,
        audio_attention_head_dim=size.audio_head_dim,
        audio_cross_attention_dim=size.audio_heads * size.audio_head_dim,
        num_layers=size.layers,
        qk_norm="rms_norm_across_heads",
        caption_channels=size.text_dim,
        rope_double_precision=False,
        rope_type="split",
    )
    connector = {"num_attention_heads": 2, "attention_head_dim": size.text_dim // 2}
    connectors = LTX2TextConnectors(
        caption_channels=size.text_dim,
        text_proj_in_factor=size.text_layers + 1,  # every hidden state, the embeddings' too
        **{f"{kind}_connector_{k}": v for kind in ("video", "audio") for k, v in connector.items()},
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_theta=10000.0,
        rope_double_precision=False,
        causal_temporal_positioning=False,
        rope_type="split",
    )
    video_vae = ltx2_video_vae(
        size.vae_channels,
        latent_channels=4,
        patch=size.vae_patch,
        encoder_blocks=len(size.vae_channels) + 1,
    )
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    )
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,  # the audio VAE's output channels times its mel bins
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[12, 10, 16],
        upsample_factors=[6, 5, 8],  # 240 samples a mel frame: 100 frames/s to 24 kHz
        resnet_kernel_sizes=[1],
        resnet_dilations=[[1]],
        leaky_relu_negative_slope=1.0,
        output_sampling_rate=24000,
    )
    _audible(vocoder, audio_vae)
    kind = LTX2ImageToVideoPipeline if image_to_video else LTX2Pipeline
    pipe = kind(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=video_vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=model,
        vocoder=vocoder,
    )
    return saved(pipe, path)


def build_ltx2_i2v(path: Path, *, seed: int = 0, size: LTX2Size = LTX2_TINY) -> Path:
    """`build_ltx2`'s ``LTX2ImageToVideoPipeline``, the same weights as its text-to-video
    one for the same ``seed`` and ``size``."""
    return build_ltx2(path, seed=seed, image_to_video=True, size=size)


def _audible(vocoder: object, audio_vae: object) -> None:
    """Make a random ``LTX2Vocoder``'s waveform a sound AAC carries faithfully.

    With random weights throughout, the vocoder's output is hiss (most of its energy
    above 8 kHz) on a DC offset: AAC at the stream's 64 kb/s a channel drops most of
    that, so a test of the engine's audio through the stream would measure the codec.
    Here its upsampling kernels are Hann windows (each channel pair's random weight
    times the window: smooth interpolation, few images), its residual blocks are
    pointwise and, with ``leaky_relu_negative_slope`` 1, linear, and its output
    convolution is a zero-sum ramp (no DC), scaled so that what ``audio_vae`` decodes
    from random latents comes out at about -20 dBFS on each channel: the waveform, still random and
    still following the generated mel frames, is a band of a few kHz that AAC codes
    with a correlation above 0.99 (about 0.6 to 0.9 before)."""
    import torch

    assert isinstance(vocoder, torch.nn.Module) and isinstance(audio_vae, torch.nn.Module)
    with torch.no_grad():
        upsamplers = vocoder.get_submodule("upsamplers")
        assert isinstance(upsamplers, torch.nn.ModuleList)
        for up in upsamplers:
            assert isinstance(up, torch.nn.ConvTranspose1d)
            size, stride = up.kernel_size[0], up.stride[0]
            window = torch.hann_window(size + 2, periodic=False)[1:-1]
            window *= stride / window.sum()  # unit gain through the interpolation
            mix = torch.randn(up.weight.shape[:2]) / up.weight.shape[0] ** 0.5
            up.weight.copy_(mix[..., None] * window)
        out = vocoder.get_submodule("conv_out")
        assert isinstance(out, torch.nn.Conv1d)
        ramp = torch.linspace(-1.0, 1.0, out.kernel_size[0])
        out.weight.copy_(torch.randn(out.weight.shape[:2])[..., None] * ramp)
        if out.bias is not None:
            out.bias.zero_()
        config: Any = audio_vae.config
        bins = config.mel_bins // 4  # the audio VAE's mel compression
        latents = torch.randn(1, config.latent_channels, 16, bins)
        mel = audio_vae.decode(latents, return_dict=False)[0]  # type: ignore[operator]
        level = vocoder(mel)[0].std(dim=-1).clamp(min=1e-6)  # each channel's
        out.weight.mul_((0.1 / level)[:, None, None])
