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

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from trio_vstream.engines.base import Checkpoint, Chunk, EngineError
from trio_vstream.engines.diffusers._extra import COMMON, MAX_STEPS, ExtraParams, by_plan
from trio_vstream.engines.diffusers._loading import default_segment_frames, valid_frames
from trio_vstream.engines.diffusers._messages import shown
from trio_vstream.engines.diffusers._settings import config_error
from trio_vstream.engines.diffusers._stream import frames_to_uint8
from trio_vstream.engines.diffusers.loops._batch import (
    BatchedPass,
    ModelGroup,
    batched_chunk,
    required_negative,
)
from trio_vstream.engines.diffusers.loops._protocol import Draft, Loop
from trio_vstream.engines.diffusers.loops._vae import decode_continuing, latent_stats

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream, DrivenPass, Mix

FORCING_ARGS: tuple[str, ...] = (
    "overlap_history",
    "base_num_frames",
    "ar_step",
    "causal_block_size",
    "addnoise_condition",
)
"""What a diffusion-forcing pipeline's ``__call__`` takes to shape its window loop; the
engine reads them (from ``extra_params``) and runs the loop itself."""

DEFAULT_OVERLAP_HISTORY = 17
"""Overlap frames when a request gives none: the call requires one for long videos and
recommends 17 or 37."""


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


@attrs.frozen(kw_only=True)
class WindowPlan:
    """The window loop's shape, as the call works it out from its arguments (in latent
    frames: the VAE makes ``temporal`` frames of each but the first)."""

    latent_frames: int
    """The whole video's."""
    base: int
    """Latent frames per window (``base_num_frames``'s)."""
    overlap: int
    """Latent frames each window after the first starts from (0: one window)."""
    causal_block_size: int | None
    """None: the transformer's own ``num_frame_per_block``."""
    ar_step: int
    addnoise_condition: float

    @classmethod
    def of(
        cls,
        *,
        num_frames: int,
        base_num_frames: int,
        overlap_history: int,
        temporal: int,
        causal_block_size: int | None,
        ar_step: int,
        addnoise_condition: float,
    ) -> WindowPlan:
        """The plan of a call with these arguments (``num_frames`` already ``temporal*n+1``)."""
        latent_frames = (num_frames - 1) // temporal + 1
        if num_frames > base_num_frames:  # the call's is_long_video
            base = (base_num_frames - 1) // temporal + 1
            overlap = (overlap_history - 1) // temporal + 1
        else:
            base, overlap = latent_frames, 0
        return cls(
            latent_frames=latent_frames,
            base=base,
            overlap=overlap,
            causal_block_size=causal_block_size,
            ar_step=ar_step,
            addnoise_condition=addnoise_condition,
        )

    @property
    def windows(self) -> int:
        """How many windows the call runs (its ``n_iter``)."""
        if self.overlap == 0:
            return 1
        return 1 + (self.latent_frames - self.base - 1) // (self.base - self.overlap) + 1

    def window_latent_frames(self, index: int) -> int:
        """Latent frames in window ``index``, its prefix included (the call's
        ``prepare_latents``: the last window is what is left)."""
        if index == 0:
            return self.base
        finished = index * (self.base - self.overlap) + self.overlap
        return min(self.latent_frames - finished + self.overlap, self.base)


def window_plan(draft: Draft) -> WindowPlan | None:
    """The window loop a request asks for: ``base_num_frames`` (the engine's
    ``segment_frames``), ``overlap_history`` (17, or about half a window for windows of 21
    frames or fewer), ``ar_step``, ``causal_block_size`` and ``addnoise_condition`` may come
    in ``extra_params``, as for the call. Appends what is wrong to ``draft.problems`` (then
    returns None), so a bad request is refused before it runs, not mid-video."""
    info, extra, problems, temporal = draft.model, draft.extra, draft.problems, draft.frame_step
    num_frames = valid_frames(draft.request.num_frames, temporal)
    base_num_frames = draft.segment_frames

    def whole(name: str, default: Any, minimum: int, maximum: int | None = None) -> Any:
        value = extra.get(name, default)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            problems.append(f"extra_params.{name} must be an integer {bound}, got {shown(value)}")
            return default
        return value

    # base_num_frames, overlap_history and causal_block_size need no upper bound of their
    # own: a window is never longer than the video (num_frames, which the server bounds),
    # the overlap is less than the window and a block divides it (both checked below).
    base = whole("base_num_frames", base_num_frames, 2 * temporal + 1)
    if (base - 1) % temporal:
        problems.append(f"extra_params.base_num_frames must be {temporal}*n+1, got {base}")
        return None
    half = ((base - 1) // temporal // 2) * temporal + 1
    overlap = whole("overlap_history", min(DEFAULT_OVERLAP_HISTORY, half), 1)
    # A lag beyond the schedule's length adds no work (a block waits at most until the
    # one before it is done), but a number beyond any schedule is a mistake.
    ar_step = whole("ar_step", 0, 0, MAX_STEPS)
    block = whole("causal_block_size", None, 1)
    noise = extra.get("addnoise_condition", 0)
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 <= noise <= 1000:
        problems.append(f"extra_params.addnoise_condition must be in 0..1000, got {shown(noise)}")
        noise = 0
    if overlap >= base:
        problems.append(
            f"extra_params.overlap_history ({overlap}) must be less than the window "
            f"(base_num_frames, {base})"
        )
        return None
    plan = WindowPlan.of(
        num_frames=num_frames,
        base_num_frames=base,
        overlap_history=overlap,
        temporal=temporal,
        causal_block_size=block,
        ar_step=ar_step,
        addnoise_condition=float(noise),
    )
    own = getattr(getattr(info.pipe, "transformer", None), "config", None)
    size = block if block is not None else int(getattr(own, "num_frame_per_block", 1) or 1)
    uneven = [
        plan.window_latent_frames(i)
        for i in range(plan.windows)
        if plan.window_latent_frames(i) % size
    ]
    if uneven:
        problems.append(
            f"every window must be a whole number of causal blocks ({size} latent frames); "
            f"this length makes windows of {uneven[0]}: change num_frames or base_num_frames"
        )
        return None
    return plan


@attrs.define(eq=False)
class _Window:
    """One window while it is denoised: the session's own tensors and schedulers, which
    each step reads (`ForcingLoop._inputs`) and updates (`ForcingLoop._update`)."""

    latents: torch.Tensor
    ready: int
    """Latent frames of the prefix (history or the image's), already clean."""
    matrix: torch.Tensor
    update: torch.Tensor
    intervals: list[tuple[int, int]]
    schedulers: list[Any]
    """One per latent frame: the call's, each stepped only for its own frame."""
    dtype: torch.dtype


@attrs.frozen(eq=False)
class _BatchedWindow:
    """A batched window as its steps begin: the window, the prompt's embeddings (the
    negative prompt's with guidance) and the causal block size its key holds."""

    window: _Window
    embeds: torch.Tensor
    negative: torch.Tensor | None
    block: int


class ForcingLoop:
    """One session's place in the window loop: what the next window starts from."""

    def __init__(self, stream: DiffusersStream, plan: WindowPlan) -> None:
        self.plan = plan
        seed = stream.plan.seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed % 2**64)
        """Draws each window's noise, in the single call's order."""
        self._condition_noise = torch.Generator(device="cpu").manual_seed((seed + 1) % 2**64)
        """For ``addnoise_condition``, which the call draws from torch's global generator
        (shared by every thread); a session's own keeps it reproducible per seed."""
        self._history: torch.Tensor | None = None
        self._decoder_cache: list[Any] | None = None
        self.windows_done = 0

    @property
    def done(self) -> bool:
        """Whether every window of the video has been made."""
        return self.windows_done >= self.plan.windows

    @property
    def held_latent_frames(self) -> int:
        """Latent frames kept for the next window's prefix; at most the overlap (tests)."""
        return 0 if self._history is None else int(self._history.shape[2])

    def next_chunk(self, stream: DiffusersStream, checkpoint: Checkpoint, remaining: int) -> Chunk:
        """The next window's new frames: batched with other sessions' windows when the
        engine batches (``max_batch`` > 1), else the whole window under the lock."""
        if stream.engine.max_batch > 1:
            return self._batched_chunk(stream, checkpoint, remaining)
        request = stream.request

        def window(info: PipelineInfo, mix: Mix, pass_: DrivenPass) -> torch.Tensor:
            embeds, negative = stream.embeds_and_negative(info, mix, pass_.guidance)
            return self.run_window(
                checkpoint,
                info.pipe,
                prompt_embeds=embeds,
                negative_prompt_embeds=negative,
                guidance_scale=pass_.guidance,
                num_inference_steps=pass_.steps,
                height=request.height,
                width=request.width,
                fps=request.fps,
                image=stream.image if pass_.index == 0 else None,
                attention_kwargs=pass_.kwargs.get("attention_kwargs"),
            )

        return stream.driven_chunk(
            checkpoint, remaining, window, f"window of {self.plan.windows}", 1.0
        )

    def close(self) -> None:
        """Drop the tensors (the stream is closing)."""
        self._history = None
        self._decoder_cache = None

    @torch.no_grad()
    def run_window(
        self,
        checkpoint: Any,
        pipe: Any,
        *,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None,
        guidance_scale: float,
        num_inference_steps: int,
        height: int,
        width: int,
        fps: int,
        image: Any = None,
        attention_kwargs: Any = None,
    ) -> torch.Tensor:
        """Denoise and decode the next window: its new frames as the pipeline's
        ``output_type="pt"`` makes them, (1, T, C, H, W) in [0, 1]. ``checkpoint()`` runs
        before every transformer step and before the decode, so a stop leaves after the
        step in progress and a stopped window is never decoded (nor kept)."""
        device = pipe._execution_device
        transformer = pipe.transformer
        dtype = transformer.dtype
        prompt_embeds = prompt_embeds.to(device, dtype)
        cfg = guidance_scale > 1.0
        if cfg:
            assert negative_prompt_embeds is not None
            negative_prompt_embeds = negative_prompt_embeds.to(device, dtype)
        with _block_size(transformer, self.plan.causal_block_size) as block:
            window = self._start(
                checkpoint,
                pipe,
                pipe.scheduler,
                steps=num_inference_steps,
                height=height,
                width=width,
                image=image,
                block=block,
            )
            fps_embeds = [_fps_flag(fps)]
            for i in range(len(window.matrix)):
                checkpoint()  # raises when the session is over: no more steps, no decode
                model_input, timestep = self._inputs(window, i)
                noise_pred = _predict(
                    transformer, model_input, timestep, prompt_embeds, fps_embeds, attention_kwargs
                )
                if cfg:
                    uncond = _predict(
                        transformer,
                        model_input,
                        timestep,
                        negative_prompt_embeds,
                        fps_embeds,
                        attention_kwargs,
                        context="uncond",
                    )
                    noise_pred = uncond + guidance_scale * (noise_pred - uncond)
                self._update(window, i, noise_pred)
        return self._finish(checkpoint, pipe, window)

    def _start(
        self,
        checkpoint: Any,
        pipe: Any,
        scheduler: Any,
        *,
        steps: int,
        height: int,
        width: int,
        image: Any,
        block: int,
    ) -> _Window:
        """The next window's noise, prefix, timestep matrix and schedulers (``scheduler``
        is a fresh one, copied per latent frame): the call's steps 5 and 6."""
        plan, index = self.plan, self.windows_done
        device = pipe._execution_device
        transformer = pipe.transformer
        scheduler.set_timesteps(steps, device=device)
        timesteps = scheduler.timesteps
        frames = plan.window_latent_frames(index)
        shape = (
            1,
            transformer.config.in_channels,
            frames,
            height // pipe.vae_scale_factor_spatial,
            width // pipe.vae_scale_factor_spatial,
        )
        # Not at the top: diffusers is an optional extra; import_diffusers() says so clearly.
        from diffusers.utils.torch_utils import randn_tensor

        latents = randn_tensor(shape, generator=self.generator, device=device)
        prefix = self._prefix(block)
        if index == 0 and image is not None:
            checkpoint()  # the first frame's VAE encode
            prefix = _image_latents(pipe, image, height=height, width=width, device=device)
        ready = 0 if prefix is None else int(prefix.shape[2])
        dtype = transformer.dtype
        if prefix is not None:
            latents[:, :, :ready] = prefix.to(dtype)
        schedulers = []
        for _ in range(frames):
            own = copy.deepcopy(scheduler)
            own.set_timesteps(steps, device=device)
            schedulers.append(own)
        matrix, _, update, intervals = pipe.generate_timestep_matrix(
            frames, timesteps, frames, plan.ar_step, ready, block
        )
        return _Window(latents, ready, matrix, update, list(intervals), schedulers, dtype)

    def _inputs(self, window: _Window, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``i``'s transformer input and timesteps (the condition noised, if asked)."""
        plan, ready = self.plan, window.ready
        start, end = window.intervals[i]
        model_input = window.latents[:, :, start:end].to(window.dtype).clone()
        timestep = window.matrix[i].expand(1, -1)[:, start:end].clone()
        if plan.addnoise_condition > 0 and start < ready:
            factor = 0.001 * plan.addnoise_condition
            clean = model_input[:, :, start:ready]
            noise = torch.randn(clean.shape, generator=self._condition_noise, dtype=clean.dtype).to(
                clean.device
            )
            model_input[:, :, start:ready] = clean * (1.0 - factor) + noise * factor
            timestep[:, start:ready] = plan.addnoise_condition
        return model_input, timestep

    def _update(self, window: _Window, i: int, noise_pred: torch.Tensor) -> None:
        """Step ``i``'s scheduler steps, each frame by its own scheduler."""
        latents, t = window.latents, window.matrix[i]
        start, end = window.intervals[i]
        for idx in range(start, end):
            if window.update[i][idx].item():
                latents[:, :, idx] = window.schedulers[idx].step(
                    noise_pred[:, :, idx - start],
                    t[idx],
                    latents[:, :, idx],
                    return_dict=False,
                )[0]

    def _finish(self, checkpoint: Any, pipe: Any, window: _Window) -> torch.Tensor:
        """Decode the window's new latent frames; only then is it the next one's history."""
        plan, latents = self.plan, window.latents
        new = latents if self.windows_done == 0 else latents[:, :, plan.overlap :]
        checkpoint()  # the decode
        video = self._decode(pipe, new)
        # The window is complete: only now does it become the next one's history.
        if plan.overlap:
            joined = new if self._history is None else torch.cat([self._history, new], dim=2)
            self._history = joined[:, :, -plan.overlap :].clone()
        self.windows_done += 1
        return video

    # ------------------------------------------------------------ batched windows

    def _batched_chunk(
        self, stream: DiffusersStream, checkpoint: Checkpoint, remaining: int
    ) -> Chunk:
        """The next window, its steps batched with other sessions' (`ForwardGroup`), in
        the order every batched family keeps (`batched_chunk`). The session's own
        scheduler, generators, history and decoder cache never leave its thread: a row
        carries only the step's inputs, and its result is the step's guided noise
        prediction, which the session's schedulers then apply."""
        return batched_chunk(
            stream,
            checkpoint,
            remaining,
            what=f"window of {self.plan.windows}",
            default_guidance=1.0,
            prepare=self._batched_start,
            steps=self._batched_steps,
            decode=lambda pass_, window: self._finish(pass_.checkpoint, pass_.pipe, window),
            defer=self._deferred,
        )

    def _batched_start(self, pass_: BatchedPass) -> _BatchedWindow:
        """Under the lock: the prompt's embeddings and the window's start (the image's
        encode among them, at the first window)."""
        stream, info, pipe = pass_.stream, pass_.info, pass_.pipe
        request, guidance = stream.request, pass_.driven.guidance
        block = self.plan.causal_block_size or int(pipe.transformer.config.num_frame_per_block)
        embeds, negative = stream.embeds_and_negative(info, pass_.conditioning.mix, guidance)
        window = self._start(
            pass_.checkpoint,
            pipe,
            pass_.scheduler,
            steps=pass_.driven.steps,
            height=request.height,
            width=request.width,
            image=stream.image if stream.index == 0 else None,
            block=block,
        )
        return _BatchedWindow(window, embeds, negative, block)

    def _batched_steps(self, pass_: BatchedPass, start: _BatchedWindow) -> _Window:
        """The window's steps, each a row of a batch of the windows sharing its
        `BatchKey`."""
        engine, info, pipe = pass_.stream.engine, pass_.info, pass_.pipe
        window, block = start.window, start.block
        device = pipe._execution_device
        dtype = pipe.transformer.dtype
        embeds = start.embeds.to(device, dtype)
        negative = None if start.negative is None else start.negative.to(device, dtype)
        lora, attention_kwargs = pass_.stream.lora, pass_.attention_kwargs
        key = BatchKey(
            input_shape=tuple(window.latents.shape),
            embeds_shape=tuple(embeds.shape),
            guided=negative is not None,
            dtype=str(dtype),
            block=block,
            fps=_fps_flag(pass_.stream.request.fps),
            lora=pass_.lora_key,
            alone=None if attention_kwargs is None else id(self),
        )
        group = pass_.group(
            ("forcing", key),
            lambda: ForwardGroup(engine, info, key, lora, attention_kwargs),
        )
        guidance = pass_.driven.guidance
        with pass_.checkpoint.batched(group) as step:
            for i in range(len(window.matrix)):
                model_input, timestep = self._inputs(window, i)
                noise_pred = step(ForwardRow(model_input, timestep, embeds, negative, guidance))
                self._update(window, i, noise_pred)
        return window

    def _deferred(self, pass_: BatchedPass, window: _Window) -> ForcingFrames:
        """`_finish` without its decode: the window becomes the next one's history now,
        and its new latents go with the session's decoder cache into `ForcingFrames`."""
        engine, pipe, request = pass_.stream.engine, pass_.pipe, pass_.stream.request
        plan, latents = self.plan, window.latents
        first = self.windows_done == 0
        new = latents if first else latents[:, :, plan.overlap :]
        if plan.overlap:
            joined = new if self._history is None else torch.cat([self._history, new], dim=2)
            self._history = joined[:, :, -plan.overlap :].clone()
        self.windows_done += 1
        if self._decoder_cache is None:
            self._decoder_cache = []
        scale = int(getattr(pipe, "vae_scale_factor_temporal", 4))
        count = (new.shape[2] - 1) * scale + 1 if first else new.shape[2] * scale
        return ForcingFrames(
            engine.decode_lock,
            pipe,
            new.clone(),
            self._decoder_cache,
            (min(count, pass_.remaining), request.height, request.width, 3),
        )

    def _prefix(self, block: int) -> torch.Tensor | None:
        """The next window's prefix: the history's last ``overlap`` latent frames, less
        the last few when that count is not a multiple of the causal block (the call's
        ``prepare_latents`` truncates the same way)."""
        if self._history is None:
            return None
        prefix = self._history[:, :, -self.plan.overlap :]
        extra = prefix.shape[2] % block
        return prefix[:, :, : prefix.shape[2] - extra] if extra else prefix

    def _decode(self, pipe: Any, latents: torch.Tensor) -> torch.Tensor:
        """Decode the window's new latent frames, continuing the session's decoder cache."""
        if self._decoder_cache is None:
            self._decoder_cache = []
        return decode_continuing(pipe, latents, self._decoder_cache)


class ForcingFrames:
    """A batched window's new frames, decoded when the server asks (`DeferredFrames`).

    It owns what the decode needs: the window's new latents and a reference to the
    session's causal decoder cache (which the stream's close drops, not this), so it
    decodes the same after the stream has gone on or closed. The server decodes a
    stream's windows one at a time in order, which keeps the cache in order; the decode
    takes the engine's ``decode_lock``, as the eager decode does (one decode at a time
    on the shared VAE). Decoded frames are kept until `release`, so a second ``decode``
    returns them rather than running the causal cache on again.
    """

    def __init__(
        self,
        lock: Any,
        pipe: Any,
        latents: torch.Tensor,
        cache: list[Any],
        shape: tuple[int, int, int, int],
    ) -> None:
        self._lock = lock
        self._pipe: Any = pipe
        self._latents: torch.Tensor | None = latents
        self._cache: list[Any] | None = cache
        self._frames: Any = None
        self.shape = shape

    def decode(self) -> Any:
        if self._frames is not None:
            return self._frames
        latents, cache = self._latents, self._cache
        if latents is None or cache is None:
            raise EngineError("a window's frames were decoded after their release")
        # The server's thread has no checkpoint: a plain one waits its turn, unstoppable
        # but bounded by one other session's decode.
        with torch.no_grad(), self._lock.held(Checkpoint()):
            video = decode_continuing(self._pipe, latents, cache)
        self._latents = None
        frames = frames_to_uint8(video)[: self.shape[0]]
        self._frames = np.ascontiguousarray(frames.cpu().numpy())
        return self._frames

    def release(self) -> None:
        self._latents = self._cache = self._frames = None
        self._pipe = None


def _fps_flag(fps: int) -> int:
    """The fps embedding's index, as the call picks it: 0 for 16 fps, else 1."""
    return 0 if fps == 16 else 1


@attrs.frozen(kw_only=True)
class BatchKey:
    """What rows must share to run in one transformer forward (one `ForwardGroup`).

    The input's shape (batch of one, channels, the window's latent frames, latent height
    and width), the prompt embeddings' (the text's padded length), guidance on or off,
    the transformer's dtype, the causal block size (the attention mask), the fps
    embedding and the LoRA (adapter and scale, or none). The history's length is not in
    it: a window's prefix is part of its latent frames, and its timesteps (zero for a
    clean prefix) go in per row. Nor are the guidance scale, the step or the timesteps:
    each row brings its own."""

    input_shape: tuple[int, ...]
    embeds_shape: tuple[int, ...]
    guided: bool
    dtype: str
    block: int
    fps: int
    lora: tuple[str, float] | None
    alone: object | None
    """Set (to an object of its own) for a row that must run alone: a request with
    ``attention_kwargs``, which apply to the whole forward."""


@attrs.frozen(eq=False)
class ForwardRow:
    """One session's denoising step: everything the forward needs, and nothing of its
    state (the scheduler step happens in the session's own thread)."""

    hidden: torch.Tensor
    timestep: torch.Tensor
    embeds: torch.Tensor
    negative: torch.Tensor | None
    guidance: float


class ForwardGroup(ModelGroup[BatchKey]):
    """The batched step (``run_batch``) of every window whose rows share a `BatchKey`.

    The server's batcher gathers rows by this object, so the engine hands the same one
    to every session of a key (`DiffusersEngine.batch_group`). Called with some rows, it
    takes the pipeline's lock, puts the key's LoRA and causal block size on the shared
    transformer, and runs one forward over every row's conditional input and, with
    guidance, every row's unconditional one (the rows' inputs twice, their prompt then
    their negative prompt embeddings): 2N rows in one forward where a lone window makes
    two of one. Each row gets its own guided prediction back, a tensor of its own."""

    def __call__(self, rows: Sequence[ForwardRow]) -> list[torch.Tensor | Exception]:
        count = len(rows)
        hidden = [row.hidden for row in rows]
        timestep = [row.timestep for row in rows]
        embeds = [row.embeds for row in rows]
        if self.key.guided:
            hidden += hidden
            timestep += timestep
            embeds += [required_negative(row.negative) for row in rows]
        with self.locked():
            transformer = self._info.pipe.transformer
            with _block_size(transformer, self.key.block):
                out = _predict(
                    transformer,
                    torch.cat(hidden),
                    torch.cat(timestep),
                    torch.cat(embeds),
                    [self.key.fps],  # one, broadcast over the batch: the key's
                    self._attention_kwargs,
                    context="batch",
                )
            results: list[torch.Tensor | Exception] = []
            for i, row in enumerate(rows):
                cond = out[i : i + 1]
                if self.key.guided:
                    uncond = out[count + i : count + i + 1]
                    results.append(uncond + row.guidance * (cond - uncond))
                else:
                    results.append(cond.clone())  # not a view keeping the batch's alive
        return results


def _predict(
    transformer: Any,
    hidden: torch.Tensor,
    timestep: torch.Tensor,
    embeds: torch.Tensor | None,
    fps: list[int],
    attention_kwargs: Any,
    context: str = "cond",
) -> torch.Tensor:
    """One transformer call, as the call makes it (diffusion forcing on)."""
    with transformer.cache_context(context):
        return transformer(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=embeds,
            enable_diffusion_forcing=True,
            fps=fps,
            attention_kwargs=attention_kwargs,
            return_dict=False,
        )[0]


@contextlib.contextmanager
def _block_size(transformer: Any, requested: int | None) -> Iterator[int]:
    """The causal block size for one window. The call sets a requested one on the shared
    transformer for good (``_set_ar_attention``); here it is put back after the window,
    so another session's windows see the transformer as loaded."""
    own = int(transformer.config.num_frame_per_block)
    if requested is None or requested == own:
        yield own
        return
    transformer.register_to_config(num_frame_per_block=requested)
    try:
        yield requested
    finally:
        transformer.register_to_config(num_frame_per_block=own)


def _image_latents(
    pipe: Any, image: Any, *, height: int, width: int, device: torch.device
) -> torch.Tensor:
    """The first frame's normalised latent (the image-to-video call's ``prepare_latents``:
    the VAE encoder's mean, no sampling)."""
    vae = pipe.vae
    pixels = pipe.video_processor.preprocess(image, height=height, width=width)
    pixels = pixels.to(device, dtype=torch.float32).unsqueeze(2).to(vae.dtype)
    with torch.no_grad():
        latent = vae.encode(pixels).latent_dist.mode().to(torch.float32)
    mean, inv_std = latent_stats(vae, device, torch.float32)
    return (latent - mean) * inv_std
