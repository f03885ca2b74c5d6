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

import copy
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from trio_vstream.engines.base import Checkpoint, Chunk
from trio_vstream.engines.diffusers._extra import COMMON, ExtraParams, by_plan, sigmas, timesteps
from trio_vstream.engines.diffusers._loading import valid_frames
from trio_vstream.engines.diffusers._messages import shown
from trio_vstream.engines.diffusers._settings import config_error
from trio_vstream.engines.diffusers.loops._batch import (
    BatchedPass,
    ModelGroup,
    batched_chunk,
    required_negative,
)
from trio_vstream.engines.diffusers.loops._protocol import Draft, Loop
from trio_vstream.engines.diffusers.loops._vae import decode_continuing, onload

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream, DrivenPass, Mix

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


def chunk_latent_frames(pipe: Any) -> int:
    """Latent frames per chunk when a request gives no ``chunk_partition``: the most
    common chunk after the first in the transformer's own partition (3 for the released
    checkpoints' ``(1, 3, 3, 3, 3, 3, 3, 2)``)."""
    own = list(getattr(pipe.transformer.config, "chunk_partition", None) or (1, 3))
    rest = own[1:] or own
    return max(set(rest), key=rest.count)


@attrs.frozen(kw_only=True)
class FarPlan:
    """The chunk loop's shape, in latent frames (the VAE makes 4 frames of each but the
    video's first)."""

    partition: tuple[int, ...]
    """Latent frames per chunk; sums to the video's latent frames."""
    use_mean_velocity: bool = True
    sigmas: tuple[float, ...] | None = None
    timesteps: tuple[float, ...] | None = None

    @property
    def chunks(self) -> int:
        return len(self.partition)

    def bounds(self, index: int) -> tuple[int, int]:
        """Latent frames ``[start, end)`` of chunk ``index``."""
        start = sum(self.partition[:index])
        return start, start + self.partition[index]


def far_plan(draft: Draft) -> FarPlan | None:
    """The chunk loop a request asks for: ``chunk_partition`` from ``extra_params`` (it
    must sum to the video's latent frames, as for the call), else the first chunk of the
    transformer's own partition followed by chunks of ``segment_frames`` (in latent
    frames), the last one what is left. Appends what is wrong to ``draft.problems`` (then
    returns None), so a bad request is refused before it runs."""
    info, extra, problems, temporal = draft.model, draft.extra, draft.problems, draft.frame_step
    num_frames = valid_frames(draft.request.num_frames, temporal)
    chunk = draft.segment_frames // temporal
    image = draft.request.image is not None
    latent_frames = (num_frames - 1) // temporal + 1
    given = extra.get("chunk_partition")
    if given is not None:
        if (
            not isinstance(given, (list, tuple))
            or not given
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in given)
        ):
            problems.append(
                "extra_params.chunk_partition must be a list of positive integers, got "
                f"{shown(given)}"
            )
            return None
        partition = tuple(int(n) for n in given)
        if sum(partition) != latent_frames:
            problems.append(
                f"extra_params.chunk_partition sums to {sum(partition)}, but {num_frames} frames "
                f"are {latent_frames} latent frames"
            )
            return None
    else:
        own = list(getattr(info.pipe.transformer.config, "chunk_partition", None) or (1,))
        first = min(int(own[0]), latent_frames)
        left = latent_frames - first
        partition = (first, *([chunk] * (left // chunk)), *([left % chunk] if left % chunk else []))
    if image and partition[0] != 1:
        problems.append(
            "image_reference is the first latent frame: chunk_partition must start with 1, "
            f"got {list(partition)}"
        )
    mean_velocity = extra.get("use_mean_velocity", True)
    if not isinstance(mean_velocity, bool):
        problems.append(
            f"extra_params.use_mean_velocity must be true or false, got {shown(mean_velocity)}"
        )
        mean_velocity = True
    # sigmas and timesteps come checked (`check_extra_params`): bounded, one per step.
    schedules = {name: extra.get(name) for name in ("sigmas", "timesteps")}
    return FarPlan(
        partition=partition,
        use_mean_velocity=mean_velocity,
        sigmas=tuple(schedules["sigmas"]) if schedules["sigmas"] is not None else None,
        timesteps=tuple(schedules["timesteps"]) if schedules["timesteps"] is not None else None,
    )


class FarLoop:
    """One session's place in the FAR chunk loop: the video's noise and latents so far,
    its KV cache, its decoder cache, and its generator."""

    def __init__(self, stream: DiffusersStream, plan: FarPlan) -> None:
        self.plan = plan
        self.generator = torch.Generator(device="cpu").manual_seed(stream.plan.seed % 2**64)
        """Draws the whole video's noise at the first chunk, as the single call does."""
        self._noise: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._kv_cache: dict[int, dict[str, torch.Tensor]] | None = None
        self._kv_flag: dict[str, Any] | None = None
        self._decoder_cache: list[Any] = []
        self._context_chunks = 0
        self._cached_chunks = 0
        self.chunks_done = 0

    @property
    def done(self) -> bool:
        """Whether every chunk of the video has been made."""
        return self.chunks_done >= self.plan.chunks

    def next_chunk(self, stream: DiffusersStream, checkpoint: Checkpoint, remaining: int) -> Chunk:
        """The next chunk's frames: its steps batched with other sessions' when the
        engine batches (``max_batch`` > 1), else the whole chunk under the lock."""
        if stream.engine.max_batch > 1:
            return self._batched_chunk(stream, checkpoint, remaining)
        request = stream.request
        image = _first_frame(stream)

        def chunk(info: PipelineInfo, mix: Mix, pass_: DrivenPass) -> torch.Tensor:
            embeds, negative = stream.embeds_and_negative(info, mix, pass_.guidance)
            return self.run_chunk(
                checkpoint,
                info.pipe,
                prompt_embeds=embeds,
                negative_prompt_embeds=negative,
                guidance_scale=pass_.guidance,
                num_inference_steps=pass_.steps,
                height=request.height,
                width=request.width,
                image=image,
                attention_kwargs=pass_.kwargs.get("attention_kwargs"),
            )

        return stream.driven_chunk(
            checkpoint, remaining, chunk, f"chunk of {self.plan.chunks}", 1.0
        )

    def close(self) -> None:
        """Drop the tensors (the stream is closing)."""
        self._noise = None
        self._output = None
        self._kv_cache = None
        self._decoder_cache = []

    @torch.no_grad()
    def run_chunk(
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
        image: torch.Tensor | None = None,
        attention_kwargs: Any = None,
    ) -> torch.Tensor:
        """Denoise and decode the next chunk: its frames as the pipeline's
        ``output_type="pt"`` makes them, (1, T, C, H, W) in [0, 1]. ``checkpoint()`` runs
        before the cache pass, before every transformer step and before the decode, so a
        stop leaves after the step in progress and a stopped chunk is never decoded (nor
        kept). ``image`` (1, 1, 3, H, W) in [0, 1] is the first frame (``video=`` of the
        call), read at the first chunk only."""
        plan, index = self.plan, self.chunks_done
        device = pipe._execution_device
        prompt_embeds, negative_prompt_embeds = self._catch_up(
            checkpoint,
            pipe,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            guidance_scale=guidance_scale,
            height=height,
            width=width,
            image=image,
            attention_kwargs=attention_kwargs,
        )
        noise, output = self._noise, self._output
        assert noise is not None and output is not None
        start, end = plan.bounds(index)
        if index >= self._context_chunks:
            latents = self._denoise(
                checkpoint,
                pipe,
                noise[:, start:end],
                prompt_embeds=prompt_embeds,
                negative_prompt_embeds=negative_prompt_embeds,
                guidance_scale=guidance_scale,
                num_inference_steps=num_inference_steps,
                attention_kwargs=attention_kwargs,
                device=device,
            )
        else:
            latents = output[:, start:end]  # the image's chunk: context, not denoised
        return self._finish(checkpoint, pipe, latents)

    def _catch_up(
        self,
        checkpoint: Any,
        pipe: Any,
        *,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None,
        guidance_scale: float,
        height: int,
        width: int,
        image: torch.Tensor | None,
        attention_kwargs: Any,
        cache_passes: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What comes before the chunk's steps, all of it on the shared pipeline (so
        under the lock): the first chunk's preparation (`_start`), then the cache passes
        of the chunks made since the last call. Returns the prompt embeddings on the
        device in the transformer's dtype, the negative ones None without guidance."""
        plan, index = self.plan, self.chunks_done
        device = pipe._execution_device
        dtype = pipe.transformer.dtype
        cfg = guidance_scale > 1.0
        prompt_embeds = prompt_embeds.to(device, dtype)
        if cfg:
            assert negative_prompt_embeds is not None
            negative_prompt_embeds = negative_prompt_embeds.to(device, dtype)
        else:
            negative_prompt_embeds = None
        # encode_kv_cache reads these two from the pipeline, as the call sets them.
        pipe._guidance_scale = guidance_scale
        pipe._attention_kwargs = attention_kwargs
        if self._noise is None:
            self._start(pipe, height=height, width=width, batch=2 if cfg else 1, image=image)
        output = self._output
        assert output is not None
        # The call's cache pass after each chunk but the last, run here for the chunks
        # the last call made (one, or the image's context chunk); when batching, the
        # caller runs them batched instead (`_batched_cache_passes`).
        while cache_passes and self._cached_chunks < index:
            checkpoint()
            done = self._cached_chunks
            self._kv_cache = pipe.encode_kv_cache(
                self._kv_cache,
                self._kv_flag,
                chunk_partition=list(plan.partition[: done + 1]),
                chunk_idx=done,
                output=output,
                prompt_embeds=prompt_embeds,
                negative_prompt_embeds=negative_prompt_embeds,
            )
            self._cached_chunks += 1
        return prompt_embeds, negative_prompt_embeds

    def _finish(self, checkpoint: Any, pipe: Any, latents: torch.Tensor) -> torch.Tensor:
        """Decode the chunk's latent frames; only then is it the next one's context."""
        output = self._output
        assert output is not None
        start, end = self.plan.bounds(self.chunks_done)
        checkpoint()  # the decode
        video = decode_continuing(pipe, latents.permute(0, 2, 1, 3, 4), self._decoder_cache)
        # The chunk is complete: only now does it become the next one's context.
        output[:, start:end] = latents
        self.chunks_done += 1
        return video

    def _start(
        self, pipe: Any, *, height: int, width: int, batch: int, image: torch.Tensor | None
    ) -> None:
        """What the call prepares before its loop (steps 4 to 7): the whole video's noise
        (one draw, so every chunk's noise is the single call's), the output latents, the
        KV cache sized for the whole partition, and the image's latent as the prefix."""
        plan = self.plan
        transformer = pipe.transformer
        config = transformer.config
        dtype = transformer.dtype
        device = pipe._execution_device
        # Not at the top: diffusers is an optional extra; import_diffusers() says so clearly.
        from diffusers.utils.torch_utils import randn_tensor

        latent_frames = sum(plan.partition)
        shape = (
            1,
            config.in_channels,
            latent_frames,
            height // pipe.vae_scale_factor_spatial,
            width // pipe.vae_scale_factor_spatial,
        )
        noise = randn_tensor(shape, generator=self.generator, device=device, dtype=torch.float32)
        noise = noise.to(dtype).permute(0, 2, 1, 3, 4)
        self._noise = noise
        output = torch.zeros_like(noise)
        full_tokens = (shape[3] // config.patch_size[1]) * (shape[4] // config.patch_size[2])
        compressed_tokens = (shape[3] // config.compressed_patch_size[1]) * (
            shape[4] // config.compressed_patch_size[2]
        )
        largest = max(plan.partition)
        slots = {
            "full_cache": config.full_chunk_limit * largest * full_tokens,
            "compressed_cache": (plan.chunks - config.full_chunk_limit + 1)
            * largest
            * compressed_tokens,
        }
        self._kv_cache = {
            layer: {
                name: torch.zeros(
                    (2, batch, config.num_attention_heads, size, config.attention_head_dim),
                    device=noise.device,
                    dtype=noise.dtype,
                )
                for name, size in slots.items()
            }
            for layer in range(config.num_layers)
        }
        self._kv_flag = {"num_cached_chunks": 0, "is_cache_step": False}
        if image is not None:
            onload(pipe.vae)  # encode_video calls vae._encode, which no offload hook sees
            prefix = pipe.encode_video(image, height=height, width=width)
            output[:, : prefix.shape[1]] = prefix
            self._context_chunks = next(
                i + 1 for i in range(plan.chunks) if sum(plan.partition[: i + 1]) >= prefix.shape[1]
            )
        self._output = output

    def _denoise(
        self,
        checkpoint: Any,
        pipe: Any,
        latents: torch.Tensor,
        *,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None,
        guidance_scale: float,
        num_inference_steps: int,
        attention_kwargs: Any,
        device: torch.device,
    ) -> torch.Tensor:
        """The call's inner loop over timesteps for one chunk (flow-map Euler steps from
        ``t`` to the next sigma's ``r``), with a ``checkpoint()`` before every step."""
        plan, index = self.plan, self.chunks_done
        scheduler = pipe.scheduler
        scheduler.set_timesteps(
            num_inference_steps,
            device=device,
            sigmas=list(plan.sigmas) if plan.sigmas is not None else None,
            timesteps=list(plan.timesteps) if plan.timesteps is not None else None,
        )
        cfg = negative_prompt_embeds is not None
        embeds = (
            torch.cat([negative_prompt_embeds, prompt_embeds])
            if negative_prompt_embeds is not None
            else prompt_embeds
        )
        partition = list(plan.partition[: index + 1])
        for i, t in enumerate(scheduler.timesteps):
            r = scheduler.sigmas[i + 1] * scheduler.config.num_train_timesteps
            if t == r:
                continue
            checkpoint()  # raises when the session is over: no more steps, no decode
            model_input = torch.cat([latents] * 2) if cfg else latents
            timestep = t.expand(model_input.shape[0]).unsqueeze(-1)
            timestep = timestep.repeat((1, model_input.shape[1]))
            if plan.use_mean_velocity:
                r_timestep = r.expand(model_input.shape[0]).unsqueeze(-1)
                r_timestep = r_timestep.repeat((1, model_input.shape[1]))
            else:
                r_timestep = timestep
            noise_pred, _ = pipe.transformer(
                hidden_states=model_input,
                timestep=timestep,
                r_timestep=r_timestep,
                encoder_hidden_states=embeds,
                attention_kwargs=attention_kwargs,
                return_dict=False,
                chunk_partition=partition,
                kv_cache=self._kv_cache,
                kv_cache_flag=copy.deepcopy(self._kv_flag),
            )
            if cfg:
                uncond, cond = noise_pred.chunk(2)
                noise_pred = uncond + guidance_scale * (cond - uncond)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        return latents

    # ------------------------------------------------------------ batched chunks

    def _batched_chunk(
        self, stream: DiffusersStream, checkpoint: Checkpoint, remaining: int
    ) -> Chunk:
        """The next chunk, its cache pass and flow-map steps batched with other sessions'
        (`CachePassGroup`, `ChunkGroup`), in the order every batched family keeps
        (`batched_chunk`). Under the lock: the prompt's encoding and the first chunk's
        preparation (the noise, the cache's allocation, the image's encoding). The
        session's scheduler, generator, latents and decoder cache never leave its thread;
        a row carries the forward's inputs and a reference to the session's KV cache,
        which a step only reads and a cache pass writes, both while the session's thread
        waits for its row's result."""
        return batched_chunk(
            stream,
            checkpoint,
            remaining,
            what=f"chunk of {self.plan.chunks}",
            default_guidance=1.0,
            prepare=self._batched_start,
            steps=self._batched_chunk_steps,
            decode=lambda pass_, latents: self._finish(pass_.checkpoint, pass_.pipe, latents),
        )

    def _batched_start(self, pass_: BatchedPass) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Under the lock: the prompt's embeddings, and `_catch_up` without its cache
        passes (which `_batched_chunk_steps` runs batched)."""
        stream, info = pass_.stream, pass_.info
        request, guidance = stream.request, pass_.driven.guidance
        embeds, negative = stream.embeds_and_negative(info, pass_.conditioning.mix, guidance)
        return self._catch_up(
            pass_.checkpoint,
            pass_.pipe,
            prompt_embeds=embeds,
            negative_prompt_embeds=negative,
            guidance_scale=guidance,
            height=request.height,
            width=request.width,
            image=_first_frame(stream),
            attention_kwargs=pass_.attention_kwargs,
            cache_passes=False,
        )

    def _batched_chunk_steps(
        self, pass_: BatchedPass, prompts: tuple[torch.Tensor, torch.Tensor | None]
    ) -> torch.Tensor:
        """The cache passes of the chunks made since the last one, then the chunk's steps
        (or, for the image's chunk, its latents: context, not denoised)."""
        embeds, negative = prompts
        attention_kwargs = pass_.attention_kwargs
        self._batched_cache_passes(
            pass_, embeds=embeds, negative=negative, attention_kwargs=attention_kwargs
        )
        noise, output, cache = self._noise, self._output, self._kv_cache
        assert noise is not None and output is not None and cache is not None
        chunk = self.chunks_done
        start, end = self.plan.bounds(chunk)
        if chunk < self._context_chunks:
            return output[:, start:end]  # the image's chunk: context, not denoised
        pipe = pass_.pipe
        return self._batched_steps(
            pass_,
            noise[:, start:end],
            embeds=embeds,
            negative=negative,
            attention_kwargs=attention_kwargs,
            cache=cache,
            device=pipe._execution_device,
            dtype=pipe.transformer.dtype,
        )

    def _batched_cache_passes(
        self,
        pass_: BatchedPass,
        *,
        embeds: torch.Tensor,
        negative: torch.Tensor | None,
        attention_kwargs: Any,
    ) -> None:
        """The cache passes `_catch_up` leaves to the caller when batching, each one a
        row of a batch (`CachePassGroup`): the same forward as ``encode_kv_cache``'s over
        the video so far, whose keys and values then go into the session's own cache."""
        engine, info, plan = pass_.stream.engine, pass_.info, self.plan
        output, cache, flag = self._output, self._kv_cache, self._kv_flag
        assert output is not None and cache is not None and flag is not None
        lora = pass_.stream.lora
        while self._cached_chunks < self.chunks_done:
            done = self._cached_chunks
            assert flag["num_cached_chunks"] == done
            partition = plan.partition[: done + 1]
            latents = output[:, : sum(partition)]
            key = FarKey(
                partition=partition,
                input_shape=tuple(latents.shape),
                embeds_shape=tuple(embeds.shape),
                guided=negative is not None,
                dtype=str(latents.dtype),
                lora=pass_.lora_key,
                alone=None if attention_kwargs is None else object(),
                cache_pass=True,
            )
            group = pass_.group(
                ("far", key),
                functools.partial(CachePassGroup, engine, info, key, lora, attention_kwargs),
            )
            with pass_.checkpoint.batched(group) as step:
                step(CacheRow(latents=latents, embeds=embeds, negative=negative, cache=cache))
            del group
            flag["num_cached_chunks"] += 1  # as encode_kv_cache counts it
            self._cached_chunks += 1

    def _batched_steps(
        self,
        pass_: BatchedPass,
        latents: torch.Tensor,
        *,
        embeds: torch.Tensor,
        negative: torch.Tensor | None,
        attention_kwargs: Any,
        cache: dict[int, dict[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """`_denoise`'s steps, each one a row of a batch (`ChunkGroup`), the session's own
        scheduler stepping its latents in its own thread."""
        engine, info, plan, chunk = pass_.stream.engine, pass_.info, self.plan, self.chunks_done
        assert self._kv_flag is not None and self._kv_flag["num_cached_chunks"] == chunk
        scheduler, guidance = pass_.scheduler, pass_.driven.guidance
        scheduler.set_timesteps(
            pass_.driven.steps,
            device=device,
            sigmas=list(plan.sigmas) if plan.sigmas is not None else None,
            timesteps=list(plan.timesteps) if plan.timesteps is not None else None,
        )
        lora = pass_.stream.lora
        key = FarKey(
            partition=plan.partition[: chunk + 1],
            input_shape=tuple(latents.shape),
            embeds_shape=tuple(embeds.shape),
            guided=negative is not None,
            dtype=str(dtype),
            lora=pass_.lora_key,
            alone=None if attention_kwargs is None else object(),
        )
        group = pass_.group(
            ("far", key), lambda: ChunkGroup(engine, info, key, lora, attention_kwargs)
        )
        with pass_.checkpoint.batched(group) as step:
            for i, t in enumerate(scheduler.timesteps):
                r = scheduler.sigmas[i + 1] * scheduler.config.num_train_timesteps
                if t == r:
                    continue
                row = ChunkRow(
                    latents=latents,
                    timestep=t,
                    r_timestep=r if plan.use_mean_velocity else t,
                    embeds=embeds,
                    negative=negative,
                    guidance=guidance,
                    cache=cache,
                )
                noise_pred = step(row)
                latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        del group
        return latents

    @property
    def held_bytes(self) -> int:
        """Bytes of tensors the session holds now (for tests)."""
        tensors: list[torch.Tensor] = [t for t in (self._noise, self._output) if t is not None]
        for layer in (self._kv_cache or {}).values():
            tensors.extend(layer.values())
        tensors.extend(t for t in self._decoder_cache if isinstance(t, torch.Tensor))
        return sum(t.untyped_storage().nbytes() for t in tensors)


def _first_frame(stream: DiffusersStream) -> torch.Tensor | None:
    """The request's image as the call's ``video=`` takes it, (1, 1, 3, H, W) in [0, 1],
    for the video's first chunk; None for any other, or without an image."""
    if stream.index != 0 or stream.image is None:
        return None
    pixels = np.asarray(stream.image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(pixels).permute(2, 0, 1)[None, None]


@attrs.frozen(kw_only=True)
class FarKey:
    """What rows must share to run in one transformer forward (one `ChunkGroup`).

    The chunk partition up to the row's chunk, because the forward takes one
    ``chunk_partition`` and one ``num_cached_chunks`` for the whole batch: they fix the
    rotary positions (the video's frames so far), which chunks are compressed, and how
    much of every row's KV cache is read. So only chunks at the same index of videos
    partitioned alike up to it share a forward: sessions that started together, or
    whose chunk boundaries line up; a session at another chunk runs in another group.
    Then the chunk's latent shape (frames, channels, latent height and width), the
    prompt embeddings' (the text's padded length), guidance on or off (a guided row's
    cache holds two rows, the negative prompt's and the prompt's), the transformer's
    dtype and the LoRA (adapter and scale, or none). Not the guidance scale, the step,
    the timesteps nor the schedule: each row brings its own."""

    partition: tuple[int, ...]
    input_shape: tuple[int, ...]
    embeds_shape: tuple[int, ...]
    guided: bool
    dtype: str
    lora: tuple[str, float] | None
    alone: object | None
    """Set (to an object of its own) for a row that must run alone: a request with
    ``attention_kwargs``, which apply to the whole forward."""
    cache_pass: bool = False
    """A cache pass (`CachePassGroup`: ``input_shape`` is then the video's so far, up
    to the end of ``partition``), not a flow-map step."""


@attrs.frozen(kw_only=True, eq=False)
class CacheRow:
    """One session's cache pass: the video's latents so far, its prompt embeddings, and
    the KV cache the pass writes (its own)."""

    latents: torch.Tensor
    embeds: torch.Tensor
    negative: torch.Tensor | None
    cache: dict[int, dict[str, torch.Tensor]]


@attrs.frozen(kw_only=True, eq=False)
class ChunkRow:
    """One session's flow-map step: its inputs and the KV cache it reads (its own; the
    step does not write it)."""

    latents: torch.Tensor
    """(1, frames, channels, height, width): the chunk's, in the call's layout."""
    timestep: torch.Tensor
    r_timestep: torch.Tensor
    """Where the flow-map step lands (``t`` itself without ``use_mean_velocity``)."""
    embeds: torch.Tensor
    negative: torch.Tensor | None
    guidance: float
    cache: dict[int, dict[str, torch.Tensor]]


class ChunkGroup(ModelGroup[FarKey]):
    """The batched step (``run_batch``) of every chunk whose rows share a `FarKey`.

    Called with some rows, it takes the pipeline's lock, puts the key's LoRA on the
    shared transformer and runs one forward over every row, each row laid out as a lone
    chunk's is (with guidance, its input twice, its negative prompt's embeddings then
    its prompt's: the layout of its KV cache), the rows one after another; their KV
    caches are joined along the batch dimension for that forward (`_joined_cache`), the
    part the forward reads only. A lone row reads its own cache in place. Each row gets
    its own guided prediction back, a tensor of its own."""

    def __call__(self, rows: Sequence[ChunkRow]) -> list[torch.Tensor | Exception]:
        key, per = self.key, 2 if self.key.guided else 1
        frames = key.input_shape[1]
        hidden, timestep, r_timestep, embeds = [], [], [], []
        for row in rows:
            hidden += [row.latents] * per
            timestep.append(row.timestep.expand(per).unsqueeze(-1).repeat((1, frames)))
            r_timestep.append(row.r_timestep.expand(per).unsqueeze(-1).repeat((1, frames)))
            embeds += [required_negative(row.negative), row.embeds] if key.guided else [row.embeds]
        partition = list(key.partition)
        with self.locked():
            transformer = self._info.pipe.transformer
            cache = rows[0].cache if len(rows) == 1 else _joined_cache(transformer, key, rows)
            out, _ = transformer(
                hidden_states=torch.cat(hidden),
                timestep=torch.cat(timestep),
                r_timestep=torch.cat(r_timestep),
                encoder_hidden_states=torch.cat(embeds),
                attention_kwargs=self._attention_kwargs,
                return_dict=False,
                chunk_partition=partition,
                kv_cache=cache,
                kv_cache_flag={"num_cached_chunks": len(partition) - 1, "is_cache_step": False},
            )
            del cache
            results: list[torch.Tensor | Exception] = []
            for i, row in enumerate(rows):
                if key.guided:
                    uncond, cond = out[2 * i : 2 * i + 2].chunk(2)
                    results.append(uncond + row.guidance * (cond - uncond))
                else:
                    results.append(out[i : i + 1].clone())  # not a view keeping the batch's
        return results


class CachePassGroup(ModelGroup[FarKey]):
    """The batched cache pass (``run_batch``) of every session whose video so far shares
    a `FarKey` (``cache_pass``): ``encode_kv_cache``'s forward (timesteps zero, the
    cache mode's attention mask) over every row at once, laid out as `ChunkGroup` lays
    out its rows. The forward writes the keys and values of all its rows into one cache
    made for it, of the tokens it writes (`_cache_tokens`); each row's part is then
    copied into the row's own cache, where a lone pass would have written it. A lone row
    writes its own cache in place. The result of a row is None: the pass is its
    writes."""

    def __call__(self, rows: Sequence[CacheRow]) -> list[Exception | None]:
        key, per = self.key, 2 if self.key.guided else 1
        hidden: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        for row in rows:
            hidden += [row.latents] * per
            embeds += [required_negative(row.negative), row.embeds] if key.guided else [row.embeds]
        partition = list(key.partition)
        frames, height, width = key.input_shape[1], key.input_shape[3], key.input_shape[4]
        with self.locked():
            transformer = self._info.pipe.transformer
            model_input = torch.cat(hidden).to(transformer.dtype)
            zeros = torch.zeros((model_input.shape[0], frames), device=model_input.device)
            zeros = zeros.to(torch.long)  # encode_kv_cache's torch.tensor([0]), repeated
            mask = transformer.build_attention_mask(
                chunk_partition=partition,
                height=height,
                width=width,
                device=model_input.device,
                mode="cache",
            )
            if len(rows) == 1:
                cache = rows[0].cache
            else:
                cache = _empty_cache(transformer, key, rows[0].cache, model_input.shape[0])
            transformer(
                hidden_states=model_input,
                chunk_partition=partition,
                timestep=zeros,
                r_timestep=zeros,
                encoder_hidden_states=torch.cat(embeds),
                attention_mask=mask,
                attention_kwargs=self._attention_kwargs,
                return_dict=False,
                kv_cache=cache,
                kv_cache_flag={"num_cached_chunks": len(partition) - 1, "is_cache_step": True},
            )
            if len(rows) > 1:
                for i, row in enumerate(rows):
                    for layer, names in cache.items():
                        for name, joined in names.items():
                            tokens = joined.shape[3]
                            row.cache[layer][name][:, :, :, :tokens] = joined[
                                :, i * per : (i + 1) * per
                            ]
            del cache
        return [None] * len(rows)


def _cache_tokens(transformer: Any, key: FarKey) -> dict[str, int]:
    """Tokens of each part of the KV cache that the key's forward touches: a step's
    reads (``_forward_inference``'s ``num_cached_full_tokens`` and
    ``num_cached_compressed_tokens``) or a cache pass's writes (``_forward_cache``'s
    ``num_full_tokens`` and ``num_compressed_tokens``), worked out from the chunk
    partition as the transformer works them out."""
    config = transformer.config
    partition = key.partition
    height, width = key.input_shape[3], key.input_shape[4]
    full_per_frame = (height // config.patch_size[1]) * (width // config.patch_size[2])
    compressed_per_frame = (height // config.compressed_patch_size[1]) * (
        width // config.compressed_patch_size[2]
    )
    chunks = len(partition)
    if key.cache_pass:  # the pass is over the chunks so far; one fewer stays full
        limit = config.full_chunk_limit - 1
        full, compressed = (limit, chunks - limit) if chunks > limit else (chunks, 0)
        full_frames = sum(partition[compressed:])
    else:  # the step's chunk is the last full one, and is not in the cache
        limit = config.full_chunk_limit
        full, compressed = (limit, chunks - limit) if chunks >= limit else (chunks, 0)
        full_frames = sum(partition[compressed : compressed + full - 1])
    return {
        "full_cache": full_frames * full_per_frame,
        "compressed_cache": sum(partition[:compressed]) * compressed_per_frame,
    }


def _empty_cache(
    transformer: Any, key: FarKey, like: dict[int, dict[str, torch.Tensor]], batch: int
) -> dict[int, dict[str, torch.Tensor]]:
    """A KV cache for a batched cache pass of ``batch`` rows, of just the tokens the pass
    writes (it reads none of them), shaped and typed as ``like`` (a row's)."""
    tokens = _cache_tokens(transformer, key)
    return {
        layer: {
            name: t.new_empty((t.shape[0], batch, t.shape[2], tokens[name], t.shape[4]))
            for name, t in names.items()
        }
        for layer, names in like.items()
    }


def _joined_cache(
    transformer: Any, key: FarKey, rows: Sequence[ChunkRow]
) -> dict[int, dict[str, torch.Tensor]]:
    """The rows' KV caches, one after another along the batch dimension, for one step's
    forward: per layer, the compressed and the full cache up to the tokens a step of the
    key's chunk reads (`_cache_tokens`: the forward reads nothing beyond them), so the
    copy is what the step reads anyway, and a session's unused slots stay out of it."""
    tokens = _cache_tokens(transformer, key)
    return {
        layer: {
            name: torch.cat(
                [row.cache[layer][name][:, :, :, : tokens[name]] for row in rows], dim=1
            )
            for name in names
        }
        for layer, names in rows[0].cache.items()
    }
