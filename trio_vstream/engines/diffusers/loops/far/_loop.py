"""One session's place in the FAR chunk loop (`FarLoop`): the call's chunk loop restated,
one chunk a pass, alone under the lock or with its cache passes and steps batched
across sessions (`batched_chunk`, the groups of `_groups`)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trio_vstream.engines.contract import Checkpoint, Chunk, batched
from trio_vstream.engines.diffusers.loops._batch import (
    BatchedPass,
    batched_chunk,
)
from trio_vstream.engines.diffusers.loops._vae import decode_continuing, onload
from trio_vstream.engines.diffusers.loops.far._groups import (
    CachePassGroup,
    CacheRow,
    ChunkGroup,
    ChunkRow,
    FarKey,
)
from trio_vstream.engines.diffusers.loops.far._plan import FarPlan

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream, DrivenPass, Mix


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
            group = CachePassGroup(engine, info, key, lora, attention_kwargs)
            with batched(pass_.checkpoint, group, ("far", key)) as step:
                step(CacheRow(latents=latents, embeds=embeds, negative=negative, cache=cache))
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
        group = ChunkGroup(engine, info, key, lora, attention_kwargs)
        with batched(pass_.checkpoint, group, ("far", key)) as step:
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
