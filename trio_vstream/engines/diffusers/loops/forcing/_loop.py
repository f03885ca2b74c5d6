"""One session's place in the window loop (`ForcingLoop`): the call's window loop
restated, one window a pass, alone under the lock or with its steps batched across
sessions (`batched_chunk`, `ForwardGroup`), and a batched window's frames decoded when
the server asks (`ForcingFrames`)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from trio_vstream.engines.contract import Checkpoint, Chunk, EngineError, batched
from trio_vstream.engines.diffusers._stream import frames_to_uint8
from trio_vstream.engines.diffusers.loops._batch import (
    BatchedPass,
    batched_chunk,
)
from trio_vstream.engines.diffusers.loops._vae import decode_continuing, latent_stats
from trio_vstream.engines.diffusers.loops.forcing._groups import (
    BatchKey,
    ForwardGroup,
    ForwardRow,
    block_size,
    fps_flag,
    predict,
)
from trio_vstream.engines.diffusers.loops.forcing._plan import WindowPlan

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream, DrivenPass, Mix


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
        with block_size(transformer, self.plan.causal_block_size) as block:
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
            fps_embeds = [fps_flag(fps)]
            for i in range(len(window.matrix)):
                checkpoint()  # raises when the session is over: no more steps, no decode
                model_input, timestep = self._inputs(window, i)
                noise_pred = predict(
                    transformer, model_input, timestep, prompt_embeds, fps_embeds, attention_kwargs
                )
                if cfg:
                    uncond = predict(
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
            fps=fps_flag(pass_.stream.request.fps),
            lora=pass_.lora_key,
            alone=None if attention_kwargs is None else id(self),
        )
        group = ForwardGroup(engine, info, key, lora, attention_kwargs)
        guidance = pass_.driven.guidance
        with batched(pass_.checkpoint, group, ("forcing", key)) as step:
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
