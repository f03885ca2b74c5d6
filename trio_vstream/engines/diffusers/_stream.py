"""`DiffusersStream`: one session's video on the shared pipeline, whatever its family.

The stream does what every family shares (`loops`): it takes the pipeline under the
engine's `SegmentLock` for one chunk at a time, activates the session's LoRA, gives each
call a fresh scheduler (``call_overrides``), blends the prompt embeddings while a
transition runs, copies each chunk's frames to the host once and counts what was sent.
How a chunk is made is its family's `Run` (``plan.loop.start``): one pipeline call a
segment (the segment path, and Helios' chunks), or one pass of a loop the engine drives
from the pipeline's parts (SkyReels-V2 DF windows, AnyFlow FAR chunks, FramePack
sections; `driven_chunk`). A session of a family that follows an input video (Wan's
video-to-video) is a `FollowingStream`, which takes each chunk's input frames first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from trio_vstream.engines.contract import (
    Checkpoint,
    Chunk,
    DeferredFrames,
    EngineError,
    GenerationRequest,
    PromptChange,
)
from trio_vstream.engines.diffusers._loading import PipelineInfo
from trio_vstream.engines.diffusers._lora import LoadedLora
from trio_vstream.engines.transitions import ChunkConditioning, PromptSchedule
from trio_vstream.logsafe import get_logger

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers import DiffusersEngine

    # Annotations only: the families import this module (its helpers) at run time, and
    # it imports nothing of theirs, so there is no import circle.
    from trio_vstream.engines.diffusers.loops import InputLoop, Loop, WorldLoop

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
    kwargs: Mapping[str, Any]
    """The request's call arguments for the pipeline."""


@attrs.frozen(kw_only=True)
class StreamPlan:
    """What ``open_stream`` validated, for ``next_chunk`` to use: every refusal happens
    before the stream exists, so a client learns of a bad request at once."""

    first: PipelineInfo
    """Runs the first chunk."""
    following: PipelineInfo
    """Runs the chunks after it."""
    loop: Loop[Any]
    """The family that makes each chunk (the engine's)."""
    world: WorldLoop | None
    """The same family when it is a world model steered by cameras (`loops.WorldLoop`),
    else None: the engine's to tell (this module imports no family's module)."""
    follows: InputLoop | None
    """The same family when it follows an input video (`loops.InputLoop`), else None: the
    stream is then a `FollowingStream`."""
    loop_plan: Any
    """What the family planned for this request (``loop.plan``), for ``loop.start``."""
    call_kwargs: Mapping[str, Mapping[str, Any]]
    """Per pipeline role: fixed call kwargs (size, steps, guidance, extra params)."""
    scheduler_overrides: Mapping[str, Any]
    config_overrides: Mapping[str, Any]
    max_sequence_length: int | None
    guidance_scale: float | None
    seed: int


class DiffusersStream:
    """One session: chunks generated on the engine's shared pipeline by its family's run.

    ``engine``, ``request``, ``plan`` and ``image`` (the request's image reference as the
    pipelines take it, at the video's size) are for the family's run to read; the
    methods after the engine interface are what it makes each chunk with."""

    def __init__(
        self,
        engine: DiffusersEngine,
        request: GenerationRequest,
        plan: StreamPlan,
        lora: tuple[LoadedLora, float] | None,
    ) -> None:
        self.engine = engine
        self.request = request
        self.plan = plan
        self.seed = plan.seed
        """The seed in use (drawn here when the request has none): echoed in video.start."""
        self._schedule = PromptSchedule(request.prompt)
        self._lora = lora
        self._embeddings: dict[tuple[int, str, bool], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._frames_done = 0
        self._next_index = 0
        self._closed = False
        self.image: Any = None
        if request.image is not None:
            self.image = to_pil(request.image, request.width, request.height)
        self.prompt_encode_kwargs: dict[str, Any] = {}
        """What the family's run adds to ``encode_prompt`` for prompts (not the negative
        prompt): SANA-WM's instruction prefix, which its call puts before the prompt only."""
        self._run = plan.loop.start(self, plan.loop_plan)

    # ------------------------------------------------------------ interface

    def interact(self, change: PromptChange) -> None:
        """Queue a prompt change; it starts with the next chunk (a running one is not
        touched: its embeddings went into the call already). A camera goes to a world
        model's run (`loops.WorldLoop`), which applies it from the next chunk too."""
        world = self.plan.world
        if change.camera is not None and world is not None:
            world.steer(self._run, change)
            if change.prompt is None:
                return
        self._schedule.push(change)

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        """The next chunk's new frames (None when the video is complete); raises
        whatever ``checkpoint`` raises when the session is over."""
        remaining = self.request.num_frames - self._frames_done
        if remaining <= 0:
            return None
        return self._run.next_chunk(self, checkpoint, remaining)

    def close(self) -> None:
        """Drop the session's tensors and give back its LoRA; idempotent, never blocks."""
        if self._closed:
            return
        self._closed = True
        self._embeddings.clear()
        self._run.close()
        self.image = None
        if self._lora is not None:
            entry, self._lora = self._lora[0], None
            self.engine.loras.release(entry)

    # ------------------------------------------------------------ for the family's run

    @property
    def index(self) -> int:
        """The next chunk's index in the stream."""
        return self._next_index

    def next_conditioning(self) -> ChunkConditioning:
        """What the next chunk is generated from: the prompt schedule, advanced one chunk."""
        return self._schedule.next_conditioning()

    def chunk(self, host: np.ndarray, conditioning: ChunkConditioning, index: int) -> Chunk:
        """Chunk ``index``, made of ``host`` frames from ``conditioning``: counted as sent."""
        self._frames_done += host.shape[0]
        self._next_index += 1
        return conditioning.chunk(host, index)

    def activate_lora(self, info: PipelineInfo) -> None:
        """The session's LoRA (or none) on ``info``'s pipeline, for the call about to run
        under the lock."""
        lora = self._lora
        self.engine.loras.activate(info, lora[0] if lora else None, lora[1] if lora else 1.0)

    def call_overrides(self, info: PipelineInfo) -> contextlib.AbstractContextManager[None]:
        """A fresh scheduler (and the request's config overrides) for one call on
        ``info``'s pipeline, put back afterwards."""
        offloaded = self.engine.settings.offload != "none"
        return _call_overrides(info, self.plan, offloaded=offloaded)

    def driven_chunk(
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
        plan, request, engine = self.plan, self.request, self.engine
        info, index = plan.first, self._next_index
        conditioning = self._schedule.next_conditioning()
        pass_ = self.driven_pass(info, default_guidance)
        offloaded = engine.settings.offload != "none"
        with engine.lock.held(checkpoint):
            self.activate_lora(info)
            with _call_overrides(info, plan, offloaded=offloaded):
                logger.debug("request %s: %d, %s", request.request_id, index, what)
                video = make(info, conditioning.mix, pass_)
                if offloaded:
                    info.pipe.maybe_free_model_hooks()
        frames = frames_to_uint8(video)
        del video
        host = np.ascontiguousarray(frames[:remaining].cpu().numpy())  # one host copy
        del frames
        return self.chunk(host, conditioning, index)

    def driven_pass(self, info: PipelineInfo, default_guidance: float) -> DrivenPass:
        """What the next pass of an engine-driven loop on ``info`` is run with."""
        plan = self.plan
        kwargs = plan.call_kwargs[info.role]
        steps = kwargs.get("num_inference_steps", info.default("num_inference_steps"))
        guidance = plan.guidance_scale if plan.guidance_scale is not None else default_guidance
        return DrivenPass(self._next_index, int(steps or 50), guidance, kwargs)

    @property
    def lora(self) -> tuple[LoadedLora, float] | None:
        """The session's LoRA and its scale, or None (what a batch of it must share)."""
        return self._lora

    def fresh_scheduler(self, info: PipelineInfo) -> Any:
        """A scheduler of the session's own, as ``call_overrides`` would put on ``info``'s
        pipeline (the request's overrides applied), left off the shared pipeline: for a
        loop whose steps are batched with other sessions'."""
        scheduler = info.pipe.scheduler
        return type(scheduler).from_config(scheduler.config, **self.plan.scheduler_overrides)

    def finish_driven(
        self, video: Any, remaining: int, conditioning: ChunkConditioning, index: int
    ) -> Chunk:
        """Chunk ``index`` from a driven pass's decoded ``video``: its frames go to the host
        once (at most ``remaining`` of them), counted as sent."""
        frames = frames_to_uint8(video)
        del video
        host = np.ascontiguousarray(frames[:remaining].cpu().numpy())  # one host copy
        del frames
        return self.chunk(host, conditioning, index)

    def deferred_chunk(
        self, frames: DeferredFrames, conditioning: ChunkConditioning, index: int
    ) -> Chunk:
        """Chunk ``index`` whose ``frames`` the server decodes later: counted as sent."""
        self._frames_done += frames.shape[0]
        self._next_index += 1
        return conditioning.chunk(frames, index)

    def embeds_and_negative(
        self, info: PipelineInfo, mix: Mix, guidance: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The blended prompt embeddings, and the negative prompt's when guidance is on."""
        mixed = self._mix(info, mix)
        if mixed is None:
            raise EngineError(f"{info.class_name}: its prompt embeddings cannot be read")
        negative = None
        if guidance > 1.0:
            negative = self._encode(info, self.request.negative_prompt or "", negative=True)[0]
        return mixed[0], negative

    def prompt_kwargs(self, info: PipelineInfo, conditioning: ChunkConditioning) -> dict[str, Any]:
        """The call's prompt arguments: embeddings where the pipeline takes them (so a
        transition can blend prompts), else the dominant prompt as text."""
        plan, request = self.plan, self.request
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
                    negative, negative_mask = self._encode(info, negative_text or "", negative=True)
                    kwargs["negative_prompt_embeds"] = negative
                    if negative_mask is not None:
                        kwargs["negative_prompt_attention_mask"] = negative_mask
                return kwargs
        kwargs = {"prompt": conditioning.prompt}
        if negative_text is not None:
            kwargs["negative_prompt"] = negative_text
        return kwargs

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

    def _encode(
        self, info: PipelineInfo, text: str, *, negative: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One prompt's embedding (and mask), encoded once per stream and pipeline; a
        negative prompt without `prompt_encode_kwargs`."""
        extra = {} if negative else self.prompt_encode_kwargs
        key = (id(info), text, bool(extra))
        cached = self._embeddings.get(key)
        if cached is not None:
            return cached
        assert info.encode_params is not None
        params = info.encode_params
        kwargs: dict[str, Any] = {"prompt": text}
        if "do_classifier_free_guidance" in params:
            kwargs["do_classifier_free_guidance"] = False
        if "max_sequence_length" in params and self.plan.max_sequence_length is not None:
            kwargs["max_sequence_length"] = self.plan.max_sequence_length
        kwargs.update(extra)
        with torch.no_grad():
            result = info.pipe.encode_prompt(**kwargs)
        entry = _embedding_of(info, result)
        self._embeddings[key] = entry
        return entry


class FollowingStream(DiffusersStream):
    """A session that follows an input video (`interfaces.FollowsInput`), for a family
    that does (`loops.InputLoop`): before each chunk the server feeds it that chunk's
    input frames, which its family's run makes the chunk from."""

    @property
    def next_chunk_frames(self) -> int:
        """The next chunk's frames (0 once the video is complete): what to feed it."""
        remaining = self.request.num_frames - self._frames_done
        if remaining <= 0:
            return 0
        return self._follows.chunk_frames(self._run, remaining)

    def feed_input(self, frames: np.ndarray) -> None:
        """Keep ``frames`` for the next chunk; an `EngineError` for frames of another
        count, size or type than it takes (the server's gathering went wrong)."""
        request = self.request
        expected = (self.next_chunk_frames, request.height, request.width, 3)
        shape = getattr(frames, "shape", None)
        if (
            not isinstance(frames, np.ndarray)
            or frames.shape != expected
            or frames.dtype != np.uint8
        ):
            dtype = getattr(frames, "dtype", type(frames).__name__)
            raise EngineError(
                f"feed_input takes the next chunk's {expected} uint8 RGB frames, "
                f"got {shape} {dtype}"
            )
        if expected[0]:
            self._follows.feed(self._run, frames)

    @property
    def _follows(self) -> InputLoop:
        follows = self.plan.follows
        if follows is None:  # the engine opens a FollowingStream only for such a family
            raise EngineError("this stream's family follows no input video")
        return follows


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
