"""A pipeline's VAE used piecemeal, as the loops the engine drives need it.

The engine-driven loops (SkyReels-V2 DF windows, AnyFlow FAR chunks, FramePack
sections) call a pipeline's parts rather than its ``__call__``, so what the call does
around its VAE is done here: bringing an offloaded VAE to its device (`onload`), and
decoding a video a piece at a time as one decode of the whole would (`decode_continuing`),
and Wan's latent normalisation (`latent_stats`), which the loops and the Helios history
apply where the call would.
"""

from __future__ import annotations

from typing import Any

import torch


def onload(module: Any) -> None:
    """Bring an offloaded module to its device, as its ``decode`` would (accelerate's
    hook only runs on ``forward``/``decode``, and the loops call ``module.decoder``,
    ``vae._encode`` and the like)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is not None and hasattr(hook, "pre_forward"):
        hook.pre_forward(module)


def latent_stats(vae: Any, device: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A Wan VAE's per-channel latent mean and inverse standard deviation, shaped
    (1, z_dim, 1, 1, 1), on ``device`` in ``dtype``: a latent is normalised as
    ``(x - mean) * inv_std`` and back as ``x / inv_std + mean``.

    Written once because the engine applies them where the pipelines' calls would (the
    first frame's encode, a chunk's decode, Helios' image latents), and its frames must
    be the call's: so they are made as diffusers' Wan-family calls make them, cast to
    ``dtype`` first and then inverted (in half precision that order gives other numbers
    than inverting first)."""
    z_dim = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(device, dtype)
    std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(device, dtype)
    return mean, 1.0 / std


def decode_continuing(pipe: Any, latents: torch.Tensor, cache: list[Any]) -> torch.Tensor:
    """Decode ``latents`` (B, C, T, H, W, normalised) with a Wan VAE as one decode of the
    whole video would decode them: frame by frame through ``vae.decoder``, continuing the
    causal ``cache`` (``AutoencoderKLWan._decode``, without its cache reset between calls).
    ``cache`` is the session's: empty before its first frame, filled here, and kept by the
    caller for the next call. Returns the frames as ``output_type="pt"`` makes them."""
    vae = pipe.vae
    onload(vae)
    latents = latents.to(vae.dtype)
    mean, inv_std = latent_stats(vae, latents.device, latents.dtype)
    latents = latents / inv_std + mean
    first = not cache
    if first:
        cache.extend([None] * _causal_convs(vae.decoder))
    x = vae.post_quant_conv(latents)
    parts = []
    for i in range(x.shape[2]):
        parts.append(
            vae.decoder(
                x[:, :, i : i + 1],
                feat_cache=cache,
                feat_idx=[0],
                first_chunk=first and i == 0,
            )
        )
    out = torch.cat(parts, dim=2)
    if vae.config.get("patch_size") is not None:
        # Not at the top: diffusers is an optional extra; import_diffusers() says so clearly.
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        out = unpatchify(out, patch_size=vae.config.patch_size)
    out = torch.clamp(out, min=-1.0, max=1.0)
    return pipe.video_processor.postprocess_video(out, output_type="pt")


def _causal_convs(decoder: Any) -> int:
    """How many cache slots a Wan decoder needs: one per causal convolution."""
    # Not at the top: diffusers is an optional extra; import_diffusers() says so clearly.
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(m, WanCausalConv3d) for m in decoder.modules())
