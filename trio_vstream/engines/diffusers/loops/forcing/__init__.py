"""Forcing windows: diffusion-forcing pipelines (SkyReels-V2 DF), one window per chunk,
the window loop driven by the engine (`ForcingLoop`).

``SkyReelsV2DiffusionForcingPipeline`` (and its image-to-video sibling) makes a long video
in overlapping windows of ``base_num_frames``: each window after the first starts from
the last ``overlap_history`` frames' latents of the video so far, denoises the rest under
a per-frame ("diffusion forcing") timestep matrix, and adds its new latents to the
video. But its ``__call__`` runs every window in one call, keeps the overlap latents to
itself, and decodes the whole video once at its end; the text-to-video call takes no
prefix latents and the video-to-video call re-encodes pixels, so no sequence of calls
continues the loop exactly.

So the engine drives the window loop itself, from the pipeline's public components
(``transformer``, ``scheduler``, ``vae``, ``video_processor``, ``generate_timestep_matrix``):
`ForcingLoop.run_window` is one iteration of the call's ``for iter_idx in range(n_iter)``
loop (diffusers 0.42.1, ``pipeline_skyreels_v2_diffusion_forcing.py``, steps 5 to 7 and
the accumulation after them), restated here, followed by decoding that window's new
latent frames with the session's own causal VAE cache. Wan's VAE decodes a video one
latent frame at a time, each frame seeing the cache the frames before it left
(``AutoencoderKLWan._decode``); carrying that cache from window to window makes the
per-window decodes those of the call's single decode. One generator per session draws
each window's noise in the call's order. So the frames, joined, equal the single call's
(tested), each window is handed over as soon as it is decoded, and sessions take turns
on the shared pipeline at every window.

What is kept between windows is bounded, whatever the video's length: the last
``overlap_history`` latent frames (the next window's prefix), the decoder's cache (two
frames per causal convolution) and the generator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trio_vstream.engines.diffusers._extra import COMMON, ExtraParams, by_plan
from trio_vstream.engines.diffusers._loading import default_segment_frames, valid_frames
from trio_vstream.engines.diffusers._settings import config_error
from trio_vstream.engines.diffusers.loops._protocol import Draft, Loop
from trio_vstream.engines.diffusers.loops.forcing._groups import BatchKey, ForwardGroup, ForwardRow
from trio_vstream.engines.diffusers.loops.forcing._loop import ForcingFrames, ForcingLoop
from trio_vstream.engines.diffusers.loops.forcing._plan import (
    DEFAULT_OVERLAP_HISTORY,
    WindowPlan,
    window_plan,
)

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream


FORCING_ARGS: tuple[str, ...] = (
    "overlap_history",
    "base_num_frames",
    "ar_step",
    "causal_block_size",
    "addnoise_condition",
)
"""What a diffusion-forcing pipeline's ``__call__`` takes to shape its window loop; the
engine reads them (from ``extra_params``) and runs the loop itself."""


EXTRA_PARAMS = ExtraParams(
    "SkyReels-V2 diffusion forcing", {**COMMON, **dict.fromkeys(FORCING_ARGS, by_plan)}
)
"""The common keys, and the window loop's, which `window_plan` checks against the video."""


class ForcingWindows:
    """Diffusion-forcing pipelines (`Loop`): the window loop, driven by the engine."""

    name = "forcing windows"
    batches = True
    """Its windows' steps run batched across sessions when the engine's ``max_batch`` > 1
    (`ForwardGroup`)."""
    defers_decode = True
    """With ``defer_decode`` and ``max_batch`` > 1, its batched windows leave their decode
    to the server (`ForcingFrames`)."""
    frame_continued = False
    image_in_loop = True
    engine_set: tuple[str, ...] = ()

    def recognises(self, info: PipelineInfo) -> bool:
        """A ``__call__`` with the window loop's arguments, and the loop's public helper."""
        return all(name in info.params for name in FORCING_ARGS) and callable(
            getattr(info.pipe, "generate_timestep_matrix", None)
        )

    def segment_frames(self, model: PipelineInfo, given: int | None, frame_step: int) -> int:
        """The window's frames (``base_num_frames``): its call's default, 97."""
        if given is None:
            return default_segment_frames(model, frame_step, window_arg="base_num_frames")
        if (given - 1) % frame_step or given <= frame_step:
            raise config_error(
                f"segment_frames is {model.class_name}'s window (base_num_frames): "
                f"{frame_step}*n+1 with n >= 2 (e.g. "
                f"{valid_frames(max(given, 2 * frame_step + 1), frame_step)}), got {given}"
            )
        return given

    def extra_params(self, model: PipelineInfo) -> ExtraParams:
        return EXTRA_PARAMS

    def plan(self, draft: Draft) -> WindowPlan | None:
        return window_plan(draft)

    def start(self, stream: DiffusersStream, plan: WindowPlan) -> ForcingLoop:
        return ForcingLoop(stream, plan)


LOOP: Loop[WindowPlan] = ForcingWindows()


__all__ = [
    "DEFAULT_OVERLAP_HISTORY",
    "EXTRA_PARAMS",
    "FORCING_ARGS",
    "LOOP",
    "BatchKey",
    "ForcingFrames",
    "ForcingLoop",
    "ForcingWindows",
    "ForwardGroup",
    "ForwardRow",
    "WindowPlan",
    "window_plan",
]
