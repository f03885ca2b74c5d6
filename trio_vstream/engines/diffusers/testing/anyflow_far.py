"""A tiny random AnyFlow FAR pipeline (causal chunks with a FAR KV cache), on the Wan
text encoder and VAE of `wan`."""

from __future__ import annotations

from pathlib import Path

from trio_vstream.engines.diffusers.testing._common import saved
from trio_vstream.engines.diffusers.testing.wan import (
    TEXT_DIM,
    TINY,
    WanSize,
    text_encoder_and_tokenizer,
    vae,
)

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
    return saved(pipe, path)
