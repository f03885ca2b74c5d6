"""`DiffusersStream`: one session's video, made segment by segment on the shared pipeline.

Each ``next_chunk`` is one pipeline call of ``segment_frames`` frames under the engine's
`SegmentLock`: the prompt's embeddings (blended while a transition runs), a generator
seeded ``seed + index``, a fresh scheduler, the session's LoRA, and a per-step callback
that calls ``checkpoint()`` so a stop ends the call between steps, before the VAE
decode. The frames come back as uint8 on the device and are copied to the host once.
For a chunk-autoregressive pipeline (Helios) a segment is one chunk of the model's own
loop, and `ChunkHistory` carries the session's history latents and generator into the
next call instead of a frame. For a diffusion-forcing pipeline (SkyReels-V2 DF) a segment
is one window of its loop, which `ForcingLoop` runs from the pipeline's components; for
an AnyFlow FAR pipeline, one causal chunk of its loop, which `FarLoop` runs; for a
FramePack pipeline (vanilla sampling), one section of its loop, which `FramepackLoop` runs
(with inverted sampling a FramePack segment is one ordinary call of one section).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from trio_vstream.engines.base import (
    Checkpoint,
    Chunk,
    EngineError,
    GenerationRequest,
    PromptChange,
)
from trio_vstream.engines.diffusers._far import FarLoop, FarPlan
from trio_vstream.engines.diffusers._forcing import ForcingLoop, WindowPlan
from trio_vstream.engines.diffusers._framepack import FramepackLoop, FramepackPlan, Prompt
from trio_vstream.engines.diffusers._history import ChunkHistory
from trio_vstream.engines.diffusers._loading import PipelineInfo, valid_frames
from trio_vstream.engines.diffusers._lora import LoadedLora
from trio_vstream.engines.transitions import ChunkConditioning, PromptSchedule
from trio_vstream.logsafe import get_logger

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers import DiffusersEngine

logger = get_logger(__package__)  # the engine's one logger, whichever module logs

Mix = tuple[tuple[str, float], ...]
"""A schedule's prompt mix: (prompt, weight) pairs."""


@attrs.frozen
class DrivenPass:
    """What one pass of an engine-driven loop is run with."""

    index: int
    """The chunk's index in the stream."""
    steps: int
    guidance: float
    kwargs: dict[str, Any]
    """The request's call arguments for the pipeline."""


@attrs.frozen
class StreamPlan:
    """What ``open_stream`` validated, for ``next_chunk`` to use: every refusal happens
    before the stream exists, so a client learns of a bad request at once."""

    first: PipelineInfo
    """Runs segment 0."""
    following: PipelineInfo
    """Runs the segments after it."""
    continues: bool
    """Whether the following segments start from the previous segment's last frame."""
    chunked: bool
    """One call per chunk of a chunk-autoregressive pipeline, continued from the
    session's history latents (`ChunkHistory`), not from a frame."""
    call_kwargs: Mapping[str, Mapping[str, Any]]
    """Per pipeline role: fixed call kwargs (size, steps, guidance, extra params)."""
    scheduler_overrides: Mapping[str, Any]
    config_overrides: Mapping[str, Any]
    max_sequence_length: int | None
    guidance_scale: float | None
    seed: int
    segment_frames: int
    frame_step: int
    windows: WindowPlan | None = None
    """The diffusion-forcing window loop, one window per chunk (None: not such a pipeline)."""
    far: FarPlan | None = None
    """The AnyFlow FAR chunk loop, one causal chunk per chunk (None: not such a pipeline)."""
    framepack: FramepackPlan | None = None
    """The FramePack section loop, one section per chunk (None: not such a pipeline, or
    FramePack with inverted sampling, which takes the segment path)."""
    call_frames: int | None = None
    """The most ``num_frames`` a segment's call is asked for, whatever frames the segment
    keeps (None: the segment's own count). FramePack's inverted call runs whole sections,
    one per ``(latent_window_size-1)*4+1`` frames asked for, and one section makes
    ``4*latent_window_size+1``: asking for the segment's count would run two."""


class DiffusersStream:
    """One session: segments generated on the engine's shared pipeline."""

    def __init__(
        self,
        engine: DiffusersEngine,
        request: GenerationRequest,
        plan: StreamPlan,
        lora: tuple[LoadedLora, float] | None,
    ) -> None:
        self._engine = engine
        self._request = request
        self._plan = plan
        self.seed = plan.seed
        """The seed in use (drawn here when the request has none): echoed in video.start."""
        self._schedule = PromptSchedule(request.prompt)
        self._lora = lora
        self._embeddings: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._last_frame: Any = None
        self._frames_done = 0
        self._next_index = 0
        self._closed = False
        self._history: ChunkHistory | None = None
        if plan.chunked:
            self._history = ChunkHistory(plan.first, plan.seed)
        self._forcing: ForcingLoop | None = None
        if plan.windows is not None:
            self._forcing = ForcingLoop(plan.windows, plan.seed)
        self._far: FarLoop | None = None
        if plan.far is not None:
            self._far = FarLoop(plan.far, plan.seed)
        self._framepack: FramepackLoop | None = None
        self._prompts: dict[str, Prompt] = {}
        if plan.framepack is not None:
            self._framepack = FramepackLoop(plan.framepack, plan.seed)
        self._image = None
        if request.image is not None:
            self._image = to_pil(request.image, request.width, request.height)

    # ------------------------------------------------------------ interface

    def interact(self, change: PromptChange) -> None:
        """Queue a prompt change; it starts with the next segment (a running one is not
        touched: its embeddings went into the call already)."""
        self._schedule.push(change)

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        """The next segment's new frames (None when the video is complete); raises
        whatever ``checkpoint`` raises when the session is over."""
        request, plan = self._request, self._plan
        remaining = request.num_frames - self._frames_done
        if remaining <= 0:
            return None
        if self._forcing is not None:
            return self._next_window(checkpoint, remaining)
        if self._far is not None:
            return self._next_far_chunk(checkpoint, remaining)
        if self._framepack is not None:
            return self._next_section(checkpoint, remaining)
        index = self._next_index
        conditioning = self._schedule.next_conditioning()
        if index == 0:
            info, image, continuing = plan.first, self._image, False
        elif plan.chunked:
            info, image, continuing = plan.following, None, False
        elif plan.continues:
            info, image, continuing = plan.following, self._last_frame, True
        else:
            info, image, continuing = plan.following, None, False
        needed = remaining + (1 if continuing else 0)
        count = min(plan.segment_frames, valid_frames(needed, plan.frame_step))
        if plan.chunked:
            count = plan.segment_frames  # a whole chunk, so its noise is the single call's
        video = self._generate(checkpoint, info, conditioning, count, image, index)
        frames = frames_to_uint8(video)
        del video
        if tuple(frames.shape[1:3]) != (request.height, request.width):
            raise EngineError(
                f"{info.class_name} made {frames.shape[2]}x{frames.shape[1]} frames "
                f"for a {request.width}x{request.height} request"
            )
        # Some pipelines make more than asked for (Helios: whole 33-frame windows).
        host = frames[:count].cpu().numpy()  # the one device-to-host copy of this chunk
        del frames
        if plan.continues:
            self._last_frame = to_pil(host[-1], request.width, request.height)
        if continuing:
            host = host[1:]
        host = np.ascontiguousarray(host[:remaining])
        if host.shape[0] == 0:
            raise EngineError(f"{info.class_name} made no new frame ({count} asked for)")
        self._frames_done += host.shape[0]
        self._next_index += 1
        return conditioning.chunk(host, index)

    def close(self) -> None:
        """Drop the session's tensors and give back its LoRA; idempotent, never blocks."""
        if self._closed:
            return
        self._closed = True
        self._embeddings.clear()
        self._last_frame = None
        if self._history is not None:
            self._history.clear()
        if self._forcing is not None:
            self._forcing.clear()
        if self._far is not None:
            self._far.clear()
        if self._framepack is not None:
            self._framepack.clear()
        self._prompts.clear()
        self._image = None
        if self._lora is not None:
            entry, self._lora = self._lora[0], None
            self._engine.loras.release(entry)

    # ------------------------------------------------------------ generation

    def _generate(
        self,
        checkpoint: Checkpoint,
        info: PipelineInfo,
        conditioning: ChunkConditioning,
        count: int,
        image: Any,
        index: int,
    ) -> Any:
        """One pipeline call of ``count`` frames, holding the lock for all of it: the
        scheduler, the LoRA and the per-call attributes are the pipeline's, not ours."""
        plan, request, engine = self._plan, self._request, self._engine
        kwargs: dict[str, Any] = dict(plan.call_kwargs[info.role])
        kwargs["num_frames"] = count if plan.call_frames is None else min(count, plan.call_frames)
        history = self._history
        if history is None:
            seed = (plan.seed + index) % 2**64
            kwargs["generator"] = torch.Generator(device="cpu").manual_seed(seed)
            if image is not None:
                kwargs["image"] = image
        made: list[torch.Tensor] = []  # the chunk's latents, for the history
        if info.accepts("output_type"):
            kwargs["output_type"] = "pt"  # stays on the device; one host copy per chunk
        with engine.lock.held(checkpoint):

            def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> Any:
                checkpoint()  # raises when the session is over: no more steps, no decode
                if history is not None:
                    made[:] = [tensors["latents"]]  # after the last step: the chunk's latents
                return tensors

            kwargs["callback_on_step_end"] = on_step_end
            if history is not None:
                kwargs["callback_on_step_end_tensor_inputs"] = ["latents"]
                if index == 0 and image is not None:
                    checkpoint()  # the first frame's VAE encode
                    history.start_from_image(
                        info.pipe, image, height=request.height, width=request.width
                    )
                kwargs.update(history.call_kwargs())
            lora = self._lora
            engine.loras.activate(info, lora[0] if lora else None, lora[1] if lora else 1.0)
            kwargs.update(self._prompt_kwargs(info, conditioning))
            with _call_overrides(info, plan, offloaded=engine.settings.offload != "none"):
                checkpoint()
                logger.debug(
                    "request %s: segment %d, %d frames on %s",
                    request.request_id,
                    index,
                    count,
                    info.class_name,
                )
                output = info.pipe(**kwargs)
            if history is not None:
                if not made:
                    raise EngineError(f"{info.class_name} ran no denoising step")
                history.record(made[0])
        video = getattr(output, "frames", None)
        if video is None:
            video = output[0]
        return video

    def _next_window(self, checkpoint: Checkpoint, remaining: int) -> Chunk:
        """The next diffusion-forcing window's new frames."""
        forcing = self._forcing
        assert forcing is not None

        def window(info: PipelineInfo, mix: Mix, pass_: DrivenPass) -> torch.Tensor:
            embeds, negative = self._embeds_and_negative(info, mix, pass_.guidance)
            return forcing.run_window(
                checkpoint,
                info.pipe,
                prompt_embeds=embeds,
                negative_prompt_embeds=negative,
                guidance_scale=pass_.guidance,
                num_inference_steps=pass_.steps,
                height=self._request.height,
                width=self._request.width,
                fps=self._request.fps,
                image=self._image if pass_.index == 0 else None,
                attention_kwargs=pass_.kwargs.get("attention_kwargs"),
            )

        return self._driven_chunk(
            checkpoint, remaining, window, f"window of {forcing.plan.windows}", 1.0
        )

    def _next_far_chunk(self, checkpoint: Checkpoint, remaining: int) -> Chunk:
        """The next AnyFlow FAR chunk's frames."""
        far = self._far
        assert far is not None
        image = None
        if self._next_index == 0 and self._image is not None:
            pixels = np.asarray(self._image.convert("RGB"), dtype=np.float32) / 255.0
            image = torch.from_numpy(pixels).permute(2, 0, 1)[None, None]  # (1, 1, 3, H, W)

        def chunk(info: PipelineInfo, mix: Mix, pass_: DrivenPass) -> torch.Tensor:
            embeds, negative = self._embeds_and_negative(info, mix, pass_.guidance)
            return far.run_chunk(
                checkpoint,
                info.pipe,
                prompt_embeds=embeds,
                negative_prompt_embeds=negative,
                guidance_scale=pass_.guidance,
                num_inference_steps=pass_.steps,
                height=self._request.height,
                width=self._request.width,
                image=image,
                attention_kwargs=pass_.kwargs.get("attention_kwargs"),
            )

        return self._driven_chunk(checkpoint, remaining, chunk, f"chunk of {far.plan.chunks}", 1.0)

    def _next_section(self, checkpoint: Checkpoint, remaining: int) -> Chunk:
        """The next FramePack section's final frames; its conditioning (the LLaMA
        embeddings and mask and the CLIP pooled embedding) is blended alike."""
        loop, request = self._framepack, self._request
        assert loop is not None

        def section(info: PipelineInfo, mix: Mix, pass_: DrivenPass) -> torch.Tensor:
            prompt = Prompt.mixed([(self._section_prompt(info, text), w) for text, w in mix])
            negative = None
            if loop.plan.true_cfg_scale > 1.0 and request.negative_prompt is not None:
                negative = self._section_prompt(info, request.negative_prompt)
            return loop.run_section(
                checkpoint,
                info.pipe,
                prompt=prompt,
                negative=negative,
                guidance_scale=pass_.guidance,
                num_inference_steps=pass_.steps,
                height=request.height,
                width=request.width,
                image=self._image if pass_.index == 0 else None,
                attention_kwargs=pass_.kwargs.get("attention_kwargs"),
            )

        return self._driven_chunk(
            checkpoint, remaining, section, f"section of {loop.plan.sections}", 6.0
        )

    def _driven_chunk(
        self,
        checkpoint: Checkpoint,
        remaining: int,
        make: Callable[[PipelineInfo, Mix, DrivenPass], torch.Tensor],
        what: str,
        default_guidance: float,
    ) -> Chunk:
        """One pass of a loop the engine drives (a SkyReels DF window, an AnyFlow FAR
        chunk, a FramePack section): ``make`` runs it under the lock, with the session's
        LoRA, a fresh scheduler and the schedule's prompt mix; its frames go to the host
        once."""
        plan, request, engine = self._plan, self._request, self._engine
        info, index = plan.first, self._next_index
        conditioning = self._schedule.next_conditioning()
        kwargs = plan.call_kwargs[info.role]
        steps = kwargs.get("num_inference_steps", info.default("num_inference_steps"))
        guidance = plan.guidance_scale if plan.guidance_scale is not None else default_guidance
        pass_ = DrivenPass(index, int(steps or 50), guidance, kwargs)
        offloaded = engine.settings.offload != "none"
        with engine.lock.held(checkpoint):
            lora = self._lora
            engine.loras.activate(info, lora[0] if lora else None, lora[1] if lora else 1.0)
            with _call_overrides(info, plan, offloaded=offloaded):
                logger.debug("request %s: %d, %s", request.request_id, index, what)
                video = make(info, conditioning.mix, pass_)
                if offloaded:
                    info.pipe.maybe_free_model_hooks()
        frames = frames_to_uint8(video)
        del video
        host = np.ascontiguousarray(frames[:remaining].cpu().numpy())  # one host copy
        del frames
        self._frames_done += host.shape[0]
        self._next_index += 1
        return conditioning.chunk(host, index)

    def _embeds_and_negative(
        self, info: PipelineInfo, mix: Mix, guidance: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The blended prompt embeddings, and the negative prompt's when guidance is on."""
        mixed = self._mix(info, mix)
        if mixed is None:
            raise EngineError(f"{info.class_name}: its prompt embeddings cannot be read")
        negative = None
        if guidance > 1.0:
            negative = self._encode(info, self._request.negative_prompt or "")[0]
        return mixed[0], negative

    def _section_prompt(self, info: PipelineInfo, text: str) -> Prompt:
        """One prompt's FramePack conditioning, encoded once per stream."""
        cached = self._prompts.get(text)
        if cached is None:
            cached = Prompt.encode(info.pipe, text, self._plan.max_sequence_length)
            self._prompts[text] = cached
        return cached

    def _prompt_kwargs(self, info: PipelineInfo, conditioning: ChunkConditioning) -> dict[str, Any]:
        """The call's prompt arguments: embeddings where the pipeline takes them (so a
        transition can blend prompts), else the dominant prompt as text."""
        if info.streams_sections:
            return self._framepack_prompt_kwargs(info, conditioning)
        plan, request = self._plan, self._request
        negative_text = request.negative_prompt
        if info.encode_params is not None and info.embed_layout != "strings":
            mixed = self._mix(info, conditioning.mix)
            if mixed is not None:
                embeds, mask = mixed
                kwargs: dict[str, Any] = {"prompt_embeds": embeds}
                if mask is not None:
                    kwargs["prompt_attention_mask"] = mask
                guidance = plan.guidance_scale
                if guidance is None or guidance > 1.0:
                    negative, negative_mask = self._encode(info, negative_text or "")
                    kwargs["negative_prompt_embeds"] = negative
                    if negative_mask is not None:
                        kwargs["negative_prompt_attention_mask"] = negative_mask
                return kwargs
        kwargs = {"prompt": conditioning.prompt}
        if negative_text is not None:
            kwargs["negative_prompt"] = negative_text
        return kwargs

    def _framepack_prompt_kwargs(
        self, info: PipelineInfo, conditioning: ChunkConditioning
    ) -> dict[str, Any]:
        """A FramePack call's prompt tensors (its ``encode_prompt`` returns three, which
        the generic layouts do not read), blended as the section loop blends them; the
        negative prompt's only for true CFG (``guidance_scale`` is distilled guidance)."""
        prompt = Prompt.mixed([(self._section_prompt(info, t), w) for t, w in conditioning.mix])
        negative = None
        true_cfg = self._plan.call_kwargs[info.role].get("true_cfg_scale")
        if true_cfg is None:
            true_cfg = info.default("true_cfg_scale")
        text = self._request.negative_prompt
        if text is not None and isinstance(true_cfg, (int, float)) and true_cfg > 1.0:
            negative = self._section_prompt(info, text)
        return prompt.call_kwargs(negative)

    def _mix(
        self, info: PipelineInfo, mix: tuple[tuple[str, float], ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The weighted sum of each prompt's embedding (the schedule's blend)."""
        encoded = [(self._encode(info, prompt), weight) for prompt, weight in mix]
        if info.embed_layout == "strings":
            return None
        if len(encoded) == 1:
            return encoded[0][0]
        first = encoded[0][0][0]
        if any(e.shape != first.shape for (e, _), _ in encoded):
            # Different sequence lengths cannot be blended: use the dominant prompt.
            return encoded[0][0]
        total = torch.zeros_like(first, dtype=torch.float32)
        for (embeds, _), weight in encoded:
            total += weight * embeds.float()
        mask = None
        masks = [m for (_, m), _ in encoded if m is not None]
        if masks:
            mask = masks[0]
            for other in masks[1:]:
                mask = torch.maximum(mask, other)
        return total.to(first.dtype), mask

    def _encode(self, info: PipelineInfo, text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One prompt's embedding (and mask), encoded once per stream and pipeline."""
        key = (id(info), text)
        cached = self._embeddings.get(key)
        if cached is not None:
            return cached
        assert info.encode_params is not None
        params = info.encode_params
        kwargs: dict[str, Any] = {"prompt": text}
        if "do_classifier_free_guidance" in params:
            kwargs["do_classifier_free_guidance"] = False
        if "max_sequence_length" in params and self._plan.max_sequence_length is not None:
            kwargs["max_sequence_length"] = self._plan.max_sequence_length
        with torch.no_grad():
            result = info.pipe.encode_prompt(**kwargs)
        entry = _embedding_of(info, result)
        self._embeddings[key] = entry
        return entry


def _embedding_of(info: PipelineInfo, result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read ``encode_prompt``'s result; decide the pipeline's layout the first time."""
    parts = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    layout = info.embed_layout
    if layout is None:
        if len(parts) == 2 and isinstance(parts[0], torch.Tensor):
            layout = "pair"
        elif (
            len(parts) == 4
            and isinstance(parts[0], torch.Tensor)
            and isinstance(parts[1], torch.Tensor)
            and info.accepts("prompt_attention_mask")
            and info.accepts("negative_prompt_attention_mask")
        ):
            layout = "masked"
        else:
            layout = "strings"
            logger.info(
                "diffusers engine: %s.encode_prompt returns %d values; "
                "prompts go in as text (no blending)",
                info.class_name,
                len(parts),
            )
        info.embed_layout = layout
    if layout == "pair":
        return parts[0], None
    if layout == "masked":
        return parts[0], parts[1]
    return torch.empty(0), None


@contextlib.contextmanager
def _call_overrides(info: PipelineInfo, plan: StreamPlan, *, offloaded: bool) -> Iterator[None]:
    """A fresh scheduler (and config overrides) for one call, put back afterwards."""
    pipe = info.pipe
    scheduler = getattr(pipe, "scheduler", None)
    restore_config: dict[str, Any] = {}
    if scheduler is not None:
        pipe.scheduler = type(scheduler).from_config(scheduler.config, **plan.scheduler_overrides)
    for key, value in plan.config_overrides.items():
        restore_config[key] = pipe.config.get(key)
        pipe.register_to_config(**{key: value})
    completed = False
    try:
        yield
        completed = True
    finally:
        if offloaded and not completed:
            # A stopped call skips the pipeline's own offload at its end.
            with contextlib.suppress(Exception):
                pipe.maybe_free_model_hooks()
        if scheduler is not None:
            pipe.scheduler = scheduler
        if restore_config:
            pipe.register_to_config(**restore_config)
        if getattr(pipe, "_current_timestep", None) is not None:
            pipe._current_timestep = None  # a stopped call leaves its timestep tensor here


def frames_to_uint8(video: Any) -> torch.Tensor:
    """A pipeline's video output to (T, H, W, 3) uint8, on the device it came on."""
    if isinstance(video, list):
        first = video[0]
        if isinstance(first, list):  # lists of PIL images
            video = np.stack([np.asarray(frame.convert("RGB")) for frame in first])
        else:
            video = first
    if isinstance(video, np.ndarray):
        video = torch.from_numpy(np.asarray(video))
    if not isinstance(video, torch.Tensor):
        video = torch.from_numpy(np.asarray(video))
    if video.ndim == 5:
        video = video[0]
    if video.ndim != 4:
        raise EngineError(f"pipeline returned video of shape {tuple(video.shape)}")
    if video.shape[-1] not in (1, 3) and video.shape[1] in (1, 3):
        video = video.permute(0, 2, 3, 1)
    if video.shape[-1] == 1:
        video = video.expand(-1, -1, -1, 3)
    if video.is_floating_point():
        video = (video.float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    elif video.dtype != torch.uint8:
        video = video.clamp(0, 255).to(torch.uint8)
    return video.contiguous()


def to_pil(frame: np.ndarray, width: int, height: int) -> Any:
    """A frame as the PIL image pipelines take as ``image=``, at the video's size (an image
    reference may come in any size)."""
    from PIL import Image

    image = Image.fromarray(np.ascontiguousarray(frame, dtype=np.uint8))
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return image
