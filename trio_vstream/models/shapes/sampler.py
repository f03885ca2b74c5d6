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

One step is a `StepInput` and `denoise` evaluates any number of them in one
model call, each with its own timestep, conditioning and guidance: that is how
the engine batches the steps of several sessions (see ``trio_vstream.engines.batched``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import attrs
import torch

from trio_vstream.models.shapes.model import ShapesDenoiser


def timesteps(steps: int, shift: float = 1.0) -> list[float]:
    """``steps + 1`` times from 1 to 0, warped by ``shift``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    raw = [1.0 - i / steps for i in range(steps + 1)]
    return [shift * s / (1.0 + (shift - 1.0) * s) for s in raw]


@attrs.frozen(eq=False)
class StepInput:
    """One denoising step of one sampling call (B rows): everything the model sees."""

    x: torch.Tensor
    """The noisy chunk at time ``t``, (B, 3T, S, S)."""
    t: float
    cond: torch.Tensor
    """Prompt embeddings (B, E)."""
    uncond: torch.Tensor | None
    """The guidance branch's embeddings (B, E); None when guidance is off."""
    guidance_scale: float
    context: torch.Tensor
    context_mask: torch.Tensor
    hint: torch.Tensor


def denoise(model: ShapesDenoiser, steps: Sequence[StepInput]) -> list[torch.Tensor]:
    """Each step's guided, clipped ``x0`` prediction, from one model call for all of them.

    Rows are stacked step by step, each as its conditioned rows then (with
    guidance) its unconditioned ones: for a single step that is exactly the
    unbatched layout, so a batch of one gives the unbatched numbers.
    """
    xs, times, contexts, masks, conds, hints = [], [], [], [], [], []
    for step in steps:
        branches = [step.cond] if step.uncond is None else [step.cond, step.uncond]
        for embedding in branches:
            xs.append(step.x)
            times.append(torch.full((step.x.shape[0],), step.t, dtype=step.x.dtype))
            contexts.append(step.context)
            masks.append(step.context_mask)
            conds.append(embedding)
            hints.append(step.hint)
    device = steps[0].x.device
    x0 = model(
        torch.cat(xs),
        torch.cat(times).to(device),
        torch.cat(contexts),
        torch.cat(masks),
        torch.cat(conds),
        torch.cat(hints),
    )
    results = []
    offset = 0
    for step in steps:
        rows = step.x.shape[0]
        x0_cond = x0[offset : offset + rows]
        offset += rows
        if step.uncond is not None:
            x0_uncond = x0[offset : offset + rows]
            offset += rows
            x0_cond = x0_uncond + step.guidance_scale * (x0_cond - x0_uncond)
        results.append(x0_cond.clamp(-1.0, 1.0))
    return results


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
    step: Callable[[StepInput], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Denoise one chunk per batch row; returns x0 in [-1, 1], (B, 3T, S, S).

    ``hint`` (B, 1, S, S) marks where the object starts when there is no
    context (zeros, the default, otherwise).

    ``cond``/``uncond`` are prompt embeddings (B, E); ``uncond`` (the null
    prompt or the negative prompt) is only evaluated when guidance is on
    (``guidance_scale != 1``), in the same batch as ``cond``.

    ``step`` runs one step (``denoise`` of it, by whatever route: the engine
    passes its batched step); without it, ``checkpoint()`` then ``denoise``.
    """
    config = model.config
    batch = cond.shape[0]
    shape = (batch, 3 * config.chunk_frames, config.native_size, config.native_size)
    x = torch.randn(shape, generator=generator, device=cond.device, dtype=cond.dtype)
    if hint is None:
        hint = torch.zeros_like(x[:, :1])
    guided = uncond is not None and guidance_scale != 1.0
    if step is None:

        def step(one: StepInput) -> torch.Tensor:
            checkpoint()
            return denoise(model, [one])[0]

    for t, t_next in itertools.pairwise(timesteps(steps, shift)):
        x0 = step(
            StepInput(
                x=x,
                t=t,
                cond=cond,
                uncond=uncond if guided else None,
                guidance_scale=guidance_scale,
                context=context,
                context_mask=context_mask,
                hint=hint,
            )
        )
        # Euler on the flow's velocity v = (x_t - x0) / t, from t to t_next.
        x = x0 + (t_next / t) * (x - x0)
    return x.clamp(-1.0, 1.0)
