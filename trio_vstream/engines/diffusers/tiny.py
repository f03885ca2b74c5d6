"""Tiny random pipelines for tests and benchmarks, built in code: nothing is downloaded.

The engine's tests and the benchmark's ``diffusers`` scenario both serve pipelines made
here, so the bench measures the engine on the very pipeline the tests check it on. The
components follow diffusers' own fast tests for Wan (a small ``WanTransformer3DModel``, a
minimal ``AutoencoderKLWan``), with a byte-level tokenizer (``ByT5Tokenizer`` needs no
vocabulary file) and a one-layer UMT5 encoder sized to it. Each ``build_*`` function writes
a pipeline directory with ``save_pretrained``, exactly what ``--engine-arg model=...``
reads. ``build_wan_t2v``'s ``size`` picks how big the random transformer and VAE are:
``TINY`` (the tests' default, milliseconds per call), or the larger sizes the benchmark
uses so that a segment takes measurable time.

The functions need the ``diffusers`` extra (diffusers, transformers; peft for
``build_lora``), which they import when called. Importing this module imports the
engine's package, and with it torch.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import attrs

if TYPE_CHECKING:
    from diffusers import (
        HeliosDMDScheduler,
        HeliosPipeline,
        HeliosPyramidPipeline,
        HeliosScheduler,
    )
    from transformers import ByT5Tokenizer, PreTrainedTokenizerFast, UMT5EncoderModel
    from transformers.image_processing_utils import BaseImageProcessor

__all__ = [
    "ANYFLOW_FAR_PARTITION",
    "FRAMEPACK_WORDS",
    "HELIOS_VARIANTS",
    "LTX2_BENCH",
    "LTX2_TINY",
    "LTX2_WORDS",
    "SANA_WM_GPU",
    "SANA_WM_TINY",
    "SANA_WM_WORDS",
    "SKYREELS_DF_VARIANTS",
    "TEXT_DIM",
    "TINY",
    "LTX2Size",
    "SanaWMSize",
    "WanSize",
    "build_anyflow_far",
    "build_framepack",
    "build_helios",
    "build_lora",
    "build_ltx2",
    "build_ltx2_i2v",
    "build_sana_wm",
    "build_skyreels_df",
    "build_wan_i2v",
    "build_wan_t2v",
    "scheduler",
    "text_encoder_and_tokenizer",
    "transformer",
    "vae",
    "word_tokenizer",
]

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
    return _saved(pipe, path)


def build_wan_i2v(path: Path, *, seed: int = 1) -> Path:
    """A random image-to-video ``WanImageToVideoPipeline`` (Wan 2.1 layout, with a
    CLIP image encoder), saved to ``path``."""
    import torch
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPVisionConfig, CLIPVisionModel

    ImageProcessor: type[BaseImageProcessor]
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
    return _saved(pipe, path)


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
    return _saved(pipe, path)


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
    return _saved(pipe, path)


ANYFLOW_FAR_PARTITION = (1, 2, 2)
"""The tiny FAR transformer's own ``chunk_partition``: a first chunk of one latent frame
(the first frame), then chunks of two (8 frames each)."""


def build_anyflow_far(path: Path, *, seed: int = 0, size: WanSize = TINY, layers: int = 1) -> Path:
    """A random ``AnyFlowFARPipeline`` (causal, chunk by chunk, with a FAR KV cache),
    saved to ``path``: the Wan text encoder and VAE of the other tiny pipelines, a
    one-layer ``AnyFlowFARTransformer3DModel`` with ``full_chunk_limit`` 3 (so a fourth
    chunk already sees the first one compressed) and ``FlowMapEulerDiscreteScheduler``.
    Its attention is flex attention, slow unfused on a CPU: one layer (``layers``, the
    tests') keeps a call short; the bench asks for more. Requests must be multiples of
    16 (``check_inputs``)."""
    import torch
    from diffusers import (
        AnyFlowFARPipeline,
        AnyFlowFARTransformer3DModel,
        FlowMapEulerDiscreteScheduler,
    )

    torch.manual_seed(seed)
    encoder, tokenizer = text_encoder_and_tokenizer()
    model = AnyFlowFARTransformer3DModel(
        num_attention_heads=size.heads,
        attention_head_dim=size.head_dim,
        text_dim=TEXT_DIM,
        ffn_dim=size.ffn_dim,
        num_layers=layers,
        full_chunk_limit=3,
        rope_max_seq_len=size.rope_max_seq_len,
        chunk_partition=ANYFLOW_FAR_PARTITION,
    )
    pipe = AnyFlowFARPipeline(
        tokenizer=tokenizer,
        text_encoder=encoder,
        transformer=model,
        vae=vae(size),
        scheduler=FlowMapEulerDiscreteScheduler(shift=5.0),
    )
    return _saved(pipe, path)


def word_tokenizer(text: str, *, eos: bool) -> PreTrainedTokenizerFast:
    """A word-level ``PreTrainedTokenizerFast`` built in memory (``tokenizers``): the words
    and punctuation of ``text``, with ``<unk>`` for any other word, ``<pad>`` to pad,
    ``<s>`` first and, with ``eos``, ``</s>`` last (CLIP pools its output at the end
    token). No file to download, and it tokenizes FramePack's LLaMA prompt template
    (whose system prefix comes to 130 tokens, more than the template's ``crop_start`` of
    95, so a prompt's own words are never cropped away)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    split = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}
    for word in sorted({w for w, _ in split.pre_tokenize_str(text)}):
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = split
    special = [("<s>", 2), ("</s>", 3)]
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>" if eos else "<s> $A", special_tokens=special
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


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

    ImageProcessor: type[BaseImageProcessor]
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
    return _saved(pipe, path)


class _TokenIds(TypedDict):
    """The tiny FramePack text encoders' token ids, the same in both configs."""

    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    vocab_size: int


def _saved(pipe: object, path: Path) -> Path:
    """``pipe.save_pretrained(path)``, then ``path``.

    ``pipe`` is an ``object`` here, checked at run time: to a type checker, the names
    ``from diffusers import ...`` gives are the placeholder classes that diffusers'
    ``__init__`` imports first under ``TYPE_CHECKING`` (``utils/dummy_*_objects.py``),
    which have no ``save_pretrained``; the pipelines really are ``DiffusionPipeline``s
    (imported from where it is defined, which a type checker sees as it is).
    """
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    assert isinstance(pipe, DiffusionPipeline)
    pipe.save_pretrained(path)
    return path


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
    vae_model = _ltx2_video_vae(
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
    return _saved(pipe, path)


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
    video_vae = _ltx2_video_vae(
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
    return _saved(pipe, path)


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


def _ltx2_video_vae(
    channels: tuple[int, ...], *, latent_channels: int, patch: int, encoder_blocks: int
) -> object:
    """A small ``AutoencoderKLLTX2Video`` (LTX-2's video VAE, which SANA-WM uses too):
    one layer a block, spatio-temporal scaling at every block, a causal encoder and a
    non-causal decoder, no timestep conditioning; ``encoder_blocks`` layer counts for the
    encoder (SANA-WM's config has one per block, LTX-2's one more)."""
    from diffusers import AutoencoderKLLTX2Video

    blocks = len(channels)
    return AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=channels,
        decoder_block_out_channels=channels,
        layers_per_block=(1,) * encoder_blocks,
        decoder_layers_per_block=(1,) * (blocks + 1),
        spatio_temporal_scaling=(True,) * blocks,
        decoder_spatio_temporal_scaling=(True,) * blocks,
        decoder_inject_noise=(False,) * (blocks + 1),
        downsample_type=("spatiotemporal",) * blocks,
        upsample_type=("spatiotemporal",) * blocks,
        upsample_residual=(False,) * blocks,
        upsample_factor=(1,) * blocks,
        timestep_conditioning=False,
        patch_size=patch,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
