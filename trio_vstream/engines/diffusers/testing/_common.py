"""What the tiny pipelines of several families share: saving a built pipeline, a
word-level tokenizer built in memory, and LTX-2's small video VAE (SANA-WM uses it too).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


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


def saved(pipe: object, path: Path) -> Path:
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


def ltx2_video_vae(
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
