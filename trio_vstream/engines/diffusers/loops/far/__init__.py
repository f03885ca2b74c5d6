"""FAR chunks: AnyFlow FAR, one causal chunk per ``next_chunk``, the chunk loop (KV cache
included) driven by the engine (`FarLoop`).

``AnyFlowFARPipeline`` makes a video chunk by chunk (``chunk_partition``, in latent
frames): each chunk is denoised with flow-map steps while attending, through a KV cache,
to every chunk before it, the older ones compressed (FAR: ``compressed_patch_size``)
once ``full_chunk_limit`` chunks are in view. But its ``__call__`` runs every chunk in
one call, keeps its KV cache to itself, and decodes the whole video once at its end.
Passing the history back in (``video_latents``) makes a call treat it as context and
re-encode the cache once per context chunk, so one call per chunk would cost a number
of cache passes that grows with the chunk index, and its noise would not be the single
call's (that call draws the whole video's noise at once).

So the engine runs the call's chunk loop itself from the pipeline's public parts
(``transformer``, ``scheduler``, ``encode_kv_cache``, ``encode_video``, ``vae``):
`FarLoop.run_chunk` is one iteration of the call's ``for chunk_idx in
range(len(chunk_partition))`` loop (diffusers 0.42.1, ``pipeline_anyflow_far.py``,
steps 4 to 8: the noise drawn for the whole video, the KV cache allocated as the call
allocates it, the inner flow-map steps, then ``encode_kv_cache``), restated here, and
then decodes that chunk's latent frames with the session's own causal VAE cache (the
same ``AutoencoderKLWan`` as SkyReels-V2 DF, see ``_vae.decode_continuing``). The cache pass
that ends a chunk in the call is run at the start of the next one instead: its inputs
are the same, so the numbers are too, and the frames go out before it. So the frames,
joined, equal the single call's (tested), each chunk is handed over as soon as it is
decoded, and sessions take turns on the shared pipeline at every chunk.

What does not carry over from Helios and SkyReels-V2 DF is a bounded history: FAR keeps
every past chunk in view (compressed), and each cache pass re-encodes the whole video
so far. A session holds what the single call holds (the whole video's noise and
latents, a KV cache sized for all its chunks, allocated at its first chunk), so memory
is flat from chunk to chunk but grows with ``num_frames``, and a chunk's cache pass
costs more the later the chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trio_vstream.engines.diffusers._extra import COMMON, ExtraParams, by_plan, sigmas, timesteps
from trio_vstream.engines.diffusers._settings import config_error
from trio_vstream.engines.diffusers.loops._protocol import Draft, Loop
from trio_vstream.engines.diffusers.loops.far._groups import (
    CachePassGroup,
    CacheRow,
    ChunkGroup,
    ChunkRow,
    FarKey,
)
from trio_vstream.engines.diffusers.loops.far._loop import FarLoop
from trio_vstream.engines.diffusers.loops.far._plan import FarPlan, chunk_latent_frames, far_plan

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream


FAR_ARGS: tuple[str, ...] = ("video_latents", "use_kv_cache", "chunk_partition")
"""What a FAR pipeline's ``__call__`` takes for its causal chunk loop."""

ENGINE_SET_ARGS: tuple[str, ...] = ("video_latents", "use_kv_cache")
"""Chunk-loop arguments a request may not set: the engine keeps the history and the KV
cache itself (``chunk_partition``, ``use_mean_velocity``, ``sigmas`` or ``timesteps``
may be set, as for the call: `EXTRA_PARAMS`)."""

EXTRA_PARAMS = ExtraParams(
    "AnyFlow FAR",
    {
        **COMMON,
        "chunk_partition": by_plan,
        "sigmas": sigmas,
        "timesteps": timesteps,
        "use_mean_velocity": by_plan,
    },
)
"""The common keys, a schedule, and the chunk loop's, which `far_plan` checks."""


class FarChunks:
    """AnyFlow FAR pipelines (`Loop`): the causal chunk loop, driven by the engine."""

    name = "FAR chunks"
    batches = True
    """Its chunks' flow-map steps and cache passes run batched across sessions when the
    engine's ``max_batch`` > 1 (`ChunkGroup`, `CachePassGroup`)."""
    frame_continued = False
    image_in_loop = True
    engine_set = ENGINE_SET_ARGS

    def recognises(self, info: PipelineInfo) -> bool:
        """A ``__call__`` with the loop's arguments, and the call's cache pass as a
        public method."""
        return all(name in info.params for name in FAR_ARGS) and callable(
            getattr(info.pipe, "encode_kv_cache", None)
        )

    def segment_frames(self, model: PipelineInfo, given: int | None, frame_step: int) -> int:
        """A chunk's frames (all but the video's first chunk): ``chunk_partition``'s unit."""
        segment = given or chunk_latent_frames(model.pipe) * frame_step
        if segment % frame_step:
            raise config_error(
                f"segment_frames is {model.class_name}'s chunk: whole latent frames, a "
                f"multiple of {frame_step} (e.g. {3 * frame_step}), got {segment}"
            )
        return segment

    def extra_params(self, model: PipelineInfo) -> ExtraParams:
        return EXTRA_PARAMS

    def plan(self, draft: Draft) -> FarPlan | None:
        return far_plan(draft)

    def start(self, stream: DiffusersStream, plan: FarPlan) -> FarLoop:
        return FarLoop(stream, plan)


LOOP: Loop[FarPlan] = FarChunks()


__all__ = [
    "ENGINE_SET_ARGS",
    "EXTRA_PARAMS",
    "FAR_ARGS",
    "LOOP",
    "CachePassGroup",
    "CacheRow",
    "ChunkGroup",
    "ChunkRow",
    "FarChunks",
    "FarKey",
    "FarLoop",
    "FarPlan",
    "chunk_latent_frames",
    "far_plan",
]
