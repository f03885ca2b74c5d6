"""Few-step rectified-flow sampling with classifier-free guidance.

The model predicts the clean chunk ``x0`` from ``x_t = (1 - t) x0 + t noise``,
which gives the flow's velocity ``v = (x_t - x0) / t``; sampling integrates
``dx/dt = v`` from pure noise at t = 1 down to t = 0 with Euler steps
(guidance mixes the two branches' ``x0``, which is the same as mixing their
velocities, and each ``x0`` is clipped to the image range). A
``shift`` > 1 spends more of the few steps at high noise (the timestep
shift of SD3/Wan, the request's ``flow_shift``). ``checkpoint()`` is called
before every model evaluation, so a cancelled session stops within one step.
Noise comes only from the ``generator`` passed in: the same seed on the same
device gives the same frames.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from trio_vstream.models.shapes.model import ShapesDenoiser


def timesteps(steps: int, shift: float = 1.0) -> list[float]:
    """``steps + 1`` times from 1 to 0, warped by ``shift``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    raw = [1.0 - i / steps for i in range(steps + 1)]
    return [shift * s / (1.0 + (shift - 1.0) * s) for s in raw]


def sample(
    model: ShapesDenoiser,
    *,
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    context: torch.Tensor,
    context_mask: torch.Tensor,
    generator: torch.Generator,
    steps: int,
    guidance_scale: float,
    shift: float = 1.0,
    checkpoint: Callable[[], None] = lambda: None,
    hint: torch.Tensor | None = None,
) -> torch.Tensor:
    """Denoise one chunk per batch row; returns x0 in [-1, 1], (B, 3T, S, S).

    ``hint`` (B, 1, S, S) marks where the object starts when there is no
    context (zeros, the default, otherwise).

    ``cond``/``uncond`` are prompt embeddings (B, E); ``uncond`` (the null
    prompt or the negative prompt) is only evaluated when guidance is on
    (``guidance_scale != 1``), in the same batch as ``cond``.
    """
    config = model.config
    batch = cond.shape[0]
    shape = (batch, 3 * config.chunk_frames, config.native_size, config.native_size)
    x = torch.randn(shape, generator=generator, device=cond.device, dtype=cond.dtype)
    if hint is None:
        hint = torch.zeros_like(x[:, :1])
    guided = uncond is not None and guidance_scale != 1.0
    if guided:
        assert uncond is not None
        conds = torch.cat([cond, uncond])
        contexts = torch.cat([context, context])
        masks = torch.cat([context_mask, context_mask])
        hints = torch.cat([hint, hint])
    else:
        conds, contexts, masks, hints = cond, context, context_mask, hint
    times = timesteps(steps, shift)
    for t, t_next in itertools.pairwise(times):
        checkpoint()
        t_batch = torch.full((conds.shape[0],), t, device=x.device, dtype=x.dtype)
        inputs = torch.cat([x, x]) if guided else x
        x0 = model(inputs, t_batch, contexts, masks, conds, hints)
        if guided:
            x0_cond, x0_uncond = x0.chunk(2)
            x0 = x0_uncond + guidance_scale * (x0_cond - x0_uncond)
        x0 = x0.clamp(-1.0, 1.0)
        # Euler on the flow's velocity v = (x_t - x0) / t, from t to t_next.
        x = x0 + (t_next / t) * (x - x0)
    return x.clamp(-1.0, 1.0)
