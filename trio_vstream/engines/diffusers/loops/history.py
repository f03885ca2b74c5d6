"""History chunks: chunk-autoregressive pipelines (Helios, its pyramid and distilled
variants), one call a chunk with the session's history latents passed back in.

Helios makes a video in chunks of ``num_latent_frames_per_chunk`` latent frames, each
conditioned on the last ``sum(history_sizes)`` latent frames made before it and on the
first frame's latent, and each decoded on its own. Its ``__call__`` runs every chunk of
a video in one call, which would hold the shared pipeline for a whole video and hand
the frames over only at its end. So the engine calls it once per chunk instead, with the
history passed back in through the call's own continuation arguments (``video_latents``
for the history, ``image_latents`` for the first frame's latent, their noising turned
off: they are the model's own clean latents, as inside one call). One generator per
session carries on from call to call, drawing what one long call would draw, in the same
order; so the frames are exactly those of the single call (tested).

The history kept is the pipeline's fixed window, whatever the video's length: memory
stays flat over any number of chunks. A chunk is the segment path's call (`SegmentRun`)
with `ChunkHistory`'s continuation arguments and one generator for the whole session in
place of a frame and a generator per segment; so it batches as a segment does
(``max_batch`` > 1, `_calls.BatchedCall`): the history latents and frame indices are
arguments of each forward, per row, of one fixed shape for every session at a
resolution.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from trio_vstream.engines.contract import Checkpoint, EngineError
from trio_vstream.engines.diffusers._extra import (
    COMMON,
    MAX_STEPS,
    ExtraParams,
    Refused,
    flag,
    sigmas,
    whole,
)
from trio_vstream.engines.diffusers._loading import config_value
from trio_vstream.engines.diffusers._messages import shown
from trio_vstream.engines.diffusers._settings import config_error
from trio_vstream.engines.diffusers.loops._calls import batchable
from trio_vstream.engines.diffusers.loops._protocol import Draft, Loop
from trio_vstream.engines.diffusers.loops._vae import latent_stats
from trio_vstream.engines.diffusers.loops.segments import SegmentPlan, SegmentRun

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream

HISTORY_ARGS: tuple[str, ...] = (
    "video_latents",
    "image_latents",
    "add_noise_to_video_latents",
    "add_noise_to_image_latents",
    "history_sizes",
    "num_latent_frames_per_chunk",
)
"""What a pipeline's ``__call__`` must take for the engine to stream it chunk by chunk."""

ENGINE_SET_ARGS: tuple[str, ...] = (
    *HISTORY_ARGS,
    "fake_image_latents",
    "keep_first_frame",
    "is_skip_first_chunk",
    "image_noise_sigma_min",
    "image_noise_sigma_max",
    "video_noise_sigma_min",
    "video_noise_sigma_max",
)
"""Chunk-loop arguments a request may not set: the engine sets them, or relies on their
defaults, to carry one chunk's state into the next call."""


def pyramid_stages(info: PipelineInfo) -> int:
    """The resolution stages of a pyramid pipeline: its scheduler's ``stages``, else the
    length of its call's default ``pyramid_num_inference_steps_list``."""
    stages = config_value(getattr(info.pipe, "scheduler", None), "stages")
    if isinstance(stages, int) and not isinstance(stages, bool) and stages > 0:
        return stages
    return info.pyramid_stages or 3


def _stages(used: Sequence[PipelineInfo]) -> int:
    return pyramid_stages(used[0])


def stage2_on(key: str, value: Any, used: Sequence[PipelineInfo]) -> bool:
    """vllm-omni's ``is_enable_stage2`` on a pyramid pipeline: true (what it does)."""
    if not flag(key, value, used):
        raise Refused(
            f"extra_params.{key}: false needs a Helios pipeline without the pyramid "
            f"(HeliosPipeline); {used[0].class_name} always samples in pyramid stages"
        )
    return True


def stage2_off(key: str, value: Any, used: Sequence[PipelineInfo]) -> bool:
    """vllm-omni's ``is_enable_stage2`` on a stage-1 pipeline: false (what it does)."""
    if flag(key, value, used):
        raise Refused(
            f"extra_params.{key}: true needs a Helios pyramid pipeline "
            f"(HeliosPyramidPipeline); {used[0].class_name} samples at full resolution only"
        )
    return False


def cfg_zero_star(key: str, value: Any, used: Sequence[PipelineInfo]) -> bool:
    """vllm-omni's ``use_cfg_zero_star``: diffusers' pipeline fixes it in its config
    (``is_cfg_zero_star``, shared by every session), so only that value is taken."""
    wanted = flag(key, value, used)
    own = bool(config_value(used[0].pipe, "is_cfg_zero_star"))
    if wanted != own:
        raise Refused(
            f"extra_params.{key}: {used[0].class_name} is loaded with is_cfg_zero_star="
            f"{str(own).lower()} (its model_index.json), so {key} can only be "
            f"{str(own).lower()}, got {shown(value)}"
        )
    return wanted


def stage_count(key: str, value: Any, used: Sequence[PipelineInfo]) -> int:
    """vllm-omni's ``pyramid_num_stages``: the pipeline's own number of stages (its
    scheduler's ``stages``), no other."""
    stages = _stages(used)
    if isinstance(value, bool) or not isinstance(value, int) or value != stages:
        raise Refused(
            f"extra_params.{key} must be {stages} (the stages of {used[0].class_name}'s "
            f"scheduler), got {shown(value)}"
        )
    return value


def stage_steps(key: str, value: Any, used: Sequence[PipelineInfo]) -> list[int]:
    """``pyramid_num_inference_steps_list``: one step count per stage, each 1 to
    `MAX_STEPS`, as many as the pipeline has stages."""
    stages = _stages(used)
    if (
        not isinstance(value, list)
        or len(value) != stages
        or any(
            isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_STEPS for v in value
        )
    ):
        raise Refused(
            f"extra_params.{key} must be a list of {stages} integers from 1 to {MAX_STEPS}, "
            f"one per stage of {used[0].class_name}, got {shown(value)}"
        )
    return list(value)


_NOT_STREAMED = (
    "the engine streams one chunk a call from the session's own history, so it sets {what} itself"
)
_CHUNK_LOOP_REFUSED = {
    "is_skip_first_chunk": _NOT_STREAMED.format(what="which chunk comes first"),
    "image": "use image_reference",
    "video": "a video to continue is not supported; use image_reference for a first frame",
    **{
        key: _NOT_STREAMED.format(what="the noising of its history latents")
        + " (the pipeline's defaults)"
        for key in (
            "add_noise_to_image_latents",
            "image_noise_sigma_min",
            "image_noise_sigma_max",
            "add_noise_to_video_latents",
            "video_noise_sigma_min",
            "video_noise_sigma_max",
        )
    },
}
"""vllm-omni's Helios keys that the chunk loop sets itself: refused by name, with why."""

_STAGE_1_ONLY = "it samples at full resolution, with no pyramid stages; use num_inference_steps"

HELIOS = ExtraParams(
    "Helios",
    {
        **COMMON,
        "sigmas": sigmas,
        "is_enable_stage2": stage2_off,
        "use_cfg_zero_star": cfg_zero_star,
    },
    array_sigmas=True,
    consumed=frozenset({"is_enable_stage2", "use_cfg_zero_star"}),
    refused={
        **_CHUNK_LOOP_REFUSED,
        "pyramid_num_stages": _STAGE_1_ONLY,
        "pyramid_num_inference_steps_list": _STAGE_1_ONLY,
        "is_amplify_first_chunk": "it is not distilled (a HeliosPyramidPipeline option)",
        "use_zero_init": "it has no CFG-Zero* (a HeliosPyramidPipeline option)",
        "zero_steps": "it has no CFG-Zero* (a HeliosPyramidPipeline option)",
    },
)
"""HeliosPipeline (stage 1): vllm-omni's ``is_enable_stage2`` and ``use_cfg_zero_star``
are taken as false, what it does; its pyramid keys are refused with a reason."""
HELIOS_PYRAMID = ExtraParams(
    "Helios pyramid",
    {
        **COMMON,
        "is_amplify_first_chunk": flag,
        "use_zero_init": flag,
        "zero_steps": whole(0, MAX_STEPS),
        "pyramid_num_inference_steps_list": stage_steps,
        "is_enable_stage2": stage2_on,
        "pyramid_num_stages": stage_count,
        "use_cfg_zero_star": cfg_zero_star,
    },
    consumed=frozenset({"is_enable_stage2", "pyramid_num_stages", "use_cfg_zero_star"}),
    refused=_CHUNK_LOOP_REFUSED,
)
"""HeliosPyramidPipeline (stage 2), the distilled one included: vllm-omni's Helios keys,
``pyramid_num_inference_steps_list`` to the call (over ``num_inference_steps``, which
vllm-omni counts for stage 1 only). (Its call takes ``sigmas`` but ignores it: each
stage's schedule is the scheduler's.)"""


class HistoryChunks:
    """Chunk-autoregressive pipelines (`Loop`): one call a chunk, continued from the
    session's history latents."""

    name = "history chunks"
    batches = True
    """Its chunks' forwards run batched across sessions when the engine's ``max_batch`` > 1
    (`_calls.BatchedCall`)."""
    frame_continued = False
    image_in_loop = False
    engine_set = ENGINE_SET_ARGS

    def recognises(self, info: PipelineInfo) -> bool:
        """A ``__call__`` that takes its history back in (Helios's signature)."""
        return all(name in info.params for name in HISTORY_ARGS)

    def batches_for(self, model: PipelineInfo, i2v: PipelineInfo | None) -> bool:
        """Whether ``model``'s transformer takes rows of several calls (Helios' does)."""
        return batchable(model)

    def segment_frames(self, model: PipelineInfo, given: int | None, frame_step: int) -> int:
        segment = (chunk_latent_frames(model) - 1) * frame_step + 1
        if given not in (None, segment):
            raise config_error(
                f"segment_frames: {model.class_name} makes {segment}-frame chunks, one per "
                f"call; leave segment_frames out or set it to {segment}"
            )
        return segment

    def extra_params(self, model: PipelineInfo) -> ExtraParams:
        return HELIOS_PYRAMID if model.pyramid_stages is not None else HELIOS

    def plan(self, draft: Draft) -> SegmentPlan:
        return SegmentPlan(
            continues=False, segment_frames=draft.segment_frames, frame_step=draft.frame_step
        )

    def start(self, stream: DiffusersStream, plan: SegmentPlan) -> HistoryRun:
        return HistoryRun(stream, plan)


LOOP: Loop[SegmentPlan] = HistoryChunks()


def chunk_latent_frames(info: PipelineInfo) -> int:
    """Latent frames per chunk: the pipeline's own default (9 for Helios)."""
    value = info.default("num_latent_frames_per_chunk")
    return int(value) if isinstance(value, int) and value > 0 else 9


def history_latent_frames(info: PipelineInfo) -> int:
    """How many latent frames of history a chunk sees: ``sum(history_sizes)`` (19)."""
    sizes = info.default("history_sizes")
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) for s in sizes):
        return int(sum(sizes))
    return 19


class ChunkHistory:
    """The latents one session's next chunk is conditioned on, and its generator."""

    def __init__(self, info: PipelineInfo, seed: int) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(seed % 2**64)
        """One for the whole session: the next chunk draws what the single call would."""
        self._window = history_latent_frames(info)
        self._chunk_latents = chunk_latent_frames(info)
        self._amplified_first = info.accepts("is_amplify_first_chunk")
        self._history: torch.Tensor | None = None
        self._first: torch.Tensor | None = None
        self._image_noised: tuple[torch.Tensor, torch.Tensor] | None = None
        self.chunks = 0

    def call_kwargs(self) -> dict[str, Any]:
        """The continuation arguments of the next chunk's call."""
        kwargs: dict[str, Any] = {"generator": self.generator}
        if self.chunks == 0:
            if self._image_noised is not None:
                image_latents, fake = self._image_noised
                kwargs["image_latents"] = image_latents
                kwargs["fake_image_latents"] = fake
                kwargs["add_noise_to_image_latents"] = False
            return kwargs
        kwargs["video_latents"] = self._history
        kwargs["image_latents"] = self._first
        kwargs["add_noise_to_video_latents"] = False
        kwargs["add_noise_to_image_latents"] = False
        if self._amplified_first:
            kwargs["is_amplify_first_chunk"] = False  # only the video's first chunk is
        return kwargs

    def record(self, latents: torch.Tensor) -> None:
        """Take in the chunk just made: the history keeps its last window, no more."""
        if self._first is None:
            self._first = latents[:, :, 0:1].clone()  # keep_first_frame, as the call does
        joined = latents if self._history is None else torch.cat([self._history, latents], dim=2)
        self._history = joined[:, :, -self._window :].clone()
        self._image_noised = None
        self.chunks += 1

    def start_from_image(self, pipe: Any, image: Any, *, height: int, width: int) -> None:
        """Encode and noise a first frame (``image_reference``) as the call would, so the
        noised latents can be passed in and kept for the following chunks.

        The call noises them itself but keeps them to itself; done here, with the same
        generator in the same order, the first chunk sees what it would have seen.
        """
        pixels = pipe.video_processor.preprocess(image, height=height, width=width)
        vae = pipe.vae
        device = pipe._execution_device
        mean, inv_std = latent_stats(vae, device, vae.dtype)
        with torch.no_grad():
            image_latents, fake = pipe.prepare_image_latents(
                pixels,
                latents_mean=mean,
                latents_std=inv_std,
                num_latent_frames_per_chunk=self._chunk_latents,
                dtype=torch.float32,
                device=device,
                generator=self.generator,
            )
        image_latents = _noised(image_latents, self.generator, device, (0.111, 0.135))
        fake = _noised(fake, self.generator, device, (0.111, 0.135))
        self._image_noised = (image_latents, fake)
        self._first = image_latents
        # The call puts the fake latent at the end of its zero history.
        self._history = fake

    def clear(self) -> None:
        """Drop the tensors (the stream is closing)."""
        self._history = None
        self._first = None
        self._image_noised = None

    @property
    def held_latent_frames(self) -> int:
        """Latent frames of history held now; bounded by the window (for tests)."""
        return 0 if self._history is None else int(self._history.shape[2])


class HistoryRun(SegmentRun):
    """One session's chunks: the segment path's calls, each a whole chunk continued from
    the session's `ChunkHistory` (so its frames are the single call's)."""

    def __init__(self, stream: DiffusersStream, plan: SegmentPlan) -> None:
        super().__init__(stream, plan)
        self.history = ChunkHistory(stream.plan.first, stream.plan.seed)
        self._made: list[torch.Tensor] = []  # the chunk's latents, for the history

    def close(self) -> None:
        super().close()
        self.history.clear()
        self._made.clear()

    def _frames(self, remaining: int, continuing: bool) -> int:
        return self.plan.segment_frames  # a whole chunk, so its noise is the single call's

    def _seed_call(self, kwargs: dict[str, Any], index: int, image: Any) -> None:
        """Nothing: the history's generator and first frame go in under the lock."""

    def _before_call(
        self,
        stream: DiffusersStream,
        checkpoint: Checkpoint,
        info: PipelineInfo,
        pipe: Any,
        kwargs: dict[str, Any],
        index: int,
        image: Any,
    ) -> None:
        self._made.clear()
        kwargs["callback_on_step_end_tensor_inputs"] = ["latents"]
        if index == 0 and image is not None:
            request = stream.request
            checkpoint()  # the first frame's VAE encode
            self.history.start_from_image(pipe, image, height=request.height, width=request.width)
        kwargs.update(self.history.call_kwargs())

    def _on_step(self, tensors: dict[str, Any]) -> None:
        self._made[:] = [tensors["latents"]]  # after the last step: the chunk's latents

    def _after_call(self, info: PipelineInfo) -> None:
        if not self._made:
            raise EngineError(f"{info.class_name} ran no denoising step")
        self.history.record(self._made[0])
        self._made.clear()


def _noised(
    latents: torch.Tensor,
    generator: torch.Generator,
    device: torch.device,
    sigma_range: tuple[float, float],
) -> torch.Tensor:
    """``sigma * noise + (1 - sigma) * latents``, sigma drawn in ``sigma_range``: the
    call's own image noising (``image_noise_sigma_*`` and ``video_noise_sigma_*`` keep
    their defaults; a request may not set them for a chunk-streamed pipeline)."""
    # Not at the top: diffusers is an optional extra; import_diffusers() says so clearly.
    from diffusers.utils.torch_utils import randn_tensor

    low, high = sigma_range
    sigma = torch.rand(1, device=device, generator=generator) * (high - low) + low
    noise = randn_tensor(latents.shape, generator=generator, device=device)
    return sigma * noise + (1 - sigma) * latents
