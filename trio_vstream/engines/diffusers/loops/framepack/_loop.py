"""One session's place in the vanilla section loop (`FramepackLoop`): the call's
section loop restated, one section a pass, alone under the lock or with its steps
batched across sessions (`batched_chunk`, `SectionGroup`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from trio_vstream.engines.contract import Checkpoint, Chunk, batched
from trio_vstream.engines.diffusers.loops._batch import BatchedPass, batched_chunk
from trio_vstream.engines.diffusers.loops._vae import onload
from trio_vstream.engines.diffusers.loops.framepack._groups import (
    PER_ROW,
    POSITIONS,
    SectionGroup,
    SectionKey,
    SectionRow,
)
from trio_vstream.engines.diffusers.loops.framepack._plan import HISTORY_SIZES, FramepackPlan
from trio_vstream.engines.diffusers.loops.framepack._prompts import Prompt, Prompts

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream, DrivenPass, Mix


@attrs.frozen
class _Section:
    """One section as its steps begin: the noise, the schedule, the transformer's
    conditions (the first frame's embedding and latent, the packed history)."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    conditions: dict[str, Any]


class FramepackLoop:
    """One session's place in the vanilla section loop: the first frame's latent and
    embedding, the latest latent frames, the held-back overlap frames, the generator."""

    def __init__(self, stream: DiffusersStream, plan: FramepackPlan) -> None:
        self.plan = plan
        self._prompts = Prompts(stream.plan.max_sequence_length)
        self.generator = torch.Generator(device="cpu").manual_seed(stream.plan.seed % 2**64)
        """Draws the image latent's sample, then each section's noise: the call's order."""
        self._image_latents: torch.Tensor | None = None
        self._image_embeds: torch.Tensor | None = None
        self._history: torch.Tensor | None = None
        self._tail: torch.Tensor | None = None
        self.sections_done = 0

    @property
    def done(self) -> bool:
        """Whether every section of the video has been made."""
        return self.sections_done >= self.plan.sections

    def next_chunk(self, stream: DiffusersStream, checkpoint: Checkpoint, remaining: int) -> Chunk:
        """The next section's final frames; its conditioning (the LLaMA embeddings and
        mask and the CLIP pooled embedding) is blended alike."""
        if stream.engine.max_batch > 1:
            return self._batched_chunk(stream, checkpoint, remaining)
        plan = self.plan
        request = stream.request

        def section(info: PipelineInfo, mix: Mix, pass_: DrivenPass) -> torch.Tensor:
            prompt = self._prompts.mixed(info, mix)
            negative = None
            if plan.true_cfg_scale > 1.0 and request.negative_prompt is not None:
                negative = self._prompts.get(info, request.negative_prompt)
            return self.run_section(
                checkpoint,
                info.pipe,
                prompt=prompt,
                negative=negative,
                guidance_scale=pass_.guidance,
                num_inference_steps=pass_.steps,
                height=request.height,
                width=request.width,
                image=stream.image if pass_.index == 0 else None,
                attention_kwargs=pass_.kwargs.get("attention_kwargs"),
            )

        return stream.driven_chunk(
            checkpoint, remaining, section, f"section of {plan.sections}", 6.0
        )

    def close(self) -> None:
        """Drop the tensors (the stream is closing)."""
        self._prompts.clear()
        self._image_latents = None
        self._image_embeds = None
        self._history = None
        self._tail = None

    @torch.no_grad()
    def run_section(
        self,
        checkpoint: Callable[[], None],
        pipe: Any,
        *,
        prompt: Prompt,
        negative: Prompt | None,
        guidance_scale: float,
        num_inference_steps: int,
        height: int,
        width: int,
        image: Any = None,
        attention_kwargs: Any = None,
    ) -> torch.Tensor:
        """Denoise, decode and blend the next section; return the frames now final, as
        the pipeline's ``output_type="pt"`` makes them, (1, T, C, H, W) in [0, 1]: the
        first section's first 4, then 4 per latent frame, and the held-back overlap with
        the last. ``checkpoint()`` runs before the image encode, before every transformer
        step and before the decode, so a stop leaves after the step in progress and a
        stopped section is never decoded (nor kept). ``image`` (the call's ``image=``) is
        read at the first section only; ``negative`` turns true CFG on (the call's
        ``true_cfg_scale > 1`` with a negative prompt)."""
        device = pipe._execution_device
        dtype = pipe.transformer.dtype
        section = self._begin(
            checkpoint,
            pipe,
            pipe.scheduler,
            guidance_scale=guidance_scale,
            num_inference_steps=num_inference_steps,
            height=height,
            width=width,
            image=image,
            attention_kwargs=attention_kwargs,
        )
        transformer = pipe.transformer
        conditions = section.conditions
        latents = section.latents

        def predict(hidden: torch.Tensor, timestep: torch.Tensor, text: Prompt) -> torch.Tensor:
            return transformer(
                hidden_states=hidden,
                timestep=timestep,
                encoder_hidden_states=text.embeds.to(device, dtype),
                encoder_attention_mask=text.mask.to(device, dtype),
                pooled_projections=text.pooled.to(device, dtype),
                **conditions,
            )[0]

        for t in section.timesteps:
            checkpoint()  # raises when the session is over: no more steps, no decode
            timestep = t.expand(latents.shape[0])
            hidden = latents.to(dtype)
            noise_pred = predict(hidden, timestep, prompt)
            if negative is not None:
                negative_pred = predict(hidden, timestep, negative)
                noise_pred = negative_pred + self.plan.true_cfg_scale * (noise_pred - negative_pred)
            latents = pipe.scheduler.step(noise_pred.float(), t, latents, return_dict=False)[0]
        return self._finish(checkpoint, pipe, latents)

    def _begin(
        self,
        checkpoint: Callable[[], None],
        pipe: Any,
        scheduler: Any,
        *,
        guidance_scale: float,
        num_inference_steps: int,
        height: int,
        width: int,
        image: Any,
        attention_kwargs: Any,
    ) -> _Section:
        """The next section's noise, schedule (on ``scheduler``, a fresh one) and the
        transformer's conditions: the call's steps 6 and 7, vanilla."""
        plan = self.plan
        device = pipe._execution_device
        transformer = pipe.transformer
        dtype = transformer.dtype
        if self._image_latents is None:
            checkpoint()  # the image encodes
            self._start(pipe, image, height=height, width=width, dtype=dtype)
        assert self._history is not None and self._image_latents is not None
        sizes = list(HISTORY_SIZES)
        # The call's step 7, vanilla: the clean latents' positions and the packed history.
        indices = torch.arange(0, sum([1, *sizes, plan.window]))
        prefix_at, history_4x_at, history_2x_at, history_1x_at, latents_at = indices.split(
            [1, *sizes, plan.window], dim=0
        )
        clean_at = torch.cat([prefix_at, history_1x_at], dim=0)
        history_4x, history_2x, history_1x = self._history[:, :, -sum(sizes) :].split(sizes, dim=2)
        clean = torch.cat([self._image_latents, history_1x], dim=2)
        latents = pipe.prepare_latents(
            1,
            transformer.config.in_channels,
            height,
            width,
            (plan.window - 1) * pipe.vae_scale_factor_temporal + 1,
            dtype=torch.float32,
            device=device,
            generator=self.generator,
        )
        timesteps = self._timesteps(pipe, scheduler, latents, num_inference_steps, device)
        guidance = torch.tensor([guidance_scale], dtype=dtype, device=device) * 1000.0
        conditions = {
            "image_embeds": self._image_embeds,
            "indices_latents": latents_at,
            "guidance": guidance,
            "latents_clean": clean.to(dtype),
            "indices_latents_clean": clean_at,
            "latents_history_2x": history_2x.to(dtype),
            "indices_latents_history_2x": history_2x_at,
            "latents_history_4x": history_4x.to(dtype),
            "indices_latents_history_4x": history_4x_at,
            "attention_kwargs": attention_kwargs,
            "return_dict": False,
        }
        return _Section(latents, timesteps, conditions)

    def _finish(
        self, checkpoint: Callable[[], None], pipe: Any, latents: torch.Tensor
    ) -> torch.Tensor:
        """Decode and blend the denoised section; only then is it the next one's history."""
        plan = self.plan
        checkpoint()  # the decode
        assert self._history is not None
        history = torch.cat([self._history, latents], dim=2)
        # The call decodes the image latent and the first section, then each section with
        # the one before it.
        first = self.sections_done == 0
        span = plan.window + 1 if first else 2 * plan.window
        decoded = self._decode(pipe, history[:, :, -span:])
        last = self.sections_done + 1 == plan.sections
        frames = self._final_frames(decoded, first=first, last=last)
        # The section is complete: only now does it become the next one's history.
        self._history = history[:, :, -plan.kept_latents :].clone()
        self.sections_done += 1
        return pipe.video_processor.postprocess_video(frames, output_type="pt")

    # ------------------------------------------------------------ batched sections

    def _batched_chunk(
        self, stream: DiffusersStream, checkpoint: Checkpoint, remaining: int
    ) -> Chunk:
        """The next section, its steps batched with other sessions' (`SectionGroup`), in
        the order every batched family keeps (`batched_chunk`): the pipeline's lock for
        the prompt and image encodes and each batched forward, the engine's decode lock
        for the decode, the session's own scheduler in its own thread."""
        return batched_chunk(
            stream,
            checkpoint,
            remaining,
            what=f"section of {self.plan.sections}",
            default_guidance=6.0,
            prepare=self._batched_start,
            steps=self._batched_steps,
            decode=lambda pass_, latents: self._finish(pass_.checkpoint, pass_.pipe, latents),
        )

    def _batched_start(self, pass_: BatchedPass) -> tuple[Prompt, Prompt | None, _Section]:
        """Under the lock: the prompts' encodes (blended, and the negative one for true
        CFG) and the section's start (the image's encodes among them, at the first)."""
        stream, info = pass_.stream, pass_.info
        request = stream.request
        prompt = self._prompts.mixed(info, pass_.conditioning.mix)
        negative = None
        if self.plan.true_cfg_scale > 1.0 and request.negative_prompt is not None:
            negative = self._prompts.get(info, request.negative_prompt)
        section = self._begin(
            pass_.checkpoint,
            pass_.pipe,
            pass_.scheduler,
            guidance_scale=pass_.driven.guidance,
            num_inference_steps=pass_.driven.steps,
            height=request.height,
            width=request.width,
            image=stream.image if stream.index == 0 else None,
            attention_kwargs=pass_.attention_kwargs,
        )
        return prompt, negative, section

    def _batched_steps(
        self, pass_: BatchedPass, start: tuple[Prompt, Prompt | None, _Section]
    ) -> torch.Tensor:
        """The section's steps, each a row of a batch of the sections sharing its
        `SectionKey`; returns the denoised latents."""
        engine, info, pipe = pass_.stream.engine, pass_.info, pass_.pipe
        device = pipe._execution_device
        dtype = pipe.transformer.dtype
        prompt, negative, section = start
        prompt = prompt.on(device, dtype)
        negative = None if negative is None else negative.on(device, dtype)
        lora, attention_kwargs = pass_.stream.lora, pass_.attention_kwargs
        conditions = section.conditions
        key = SectionKey(
            input_shape=tuple(section.latents.shape),
            embeds_shape=tuple(prompt.embeds.shape),
            image_shape=tuple(conditions["image_embeds"].shape),
            guided=negative is not None,
            dtype=str(dtype),
            lora=pass_.lora_key,
            alone=None if attention_kwargs is None else object(),
        )
        group = SectionGroup(engine, info, key, lora, attention_kwargs)
        latents = section.latents
        own = {name: conditions[name] for name in (*PER_ROW, *POSITIONS)}
        scheduler = pass_.scheduler
        with batched(pass_.checkpoint, group, ("framepack", key)) as step:
            for t in section.timesteps:
                row = SectionRow(
                    hidden=latents.to(dtype),
                    timestep=t.expand(latents.shape[0]),
                    prompt=prompt,
                    negative=negative,
                    true_cfg_scale=self.plan.true_cfg_scale,
                    conditions=own,
                )
                noise_pred = step(row)
                latents = scheduler.step(noise_pred.float(), t, latents, return_dict=False)[0]
        return latents

    def _start(self, pipe: Any, image: Any, *, height: int, width: int, dtype: torch.dtype) -> None:
        """What the call prepares before its loop (steps 4 and 5, vanilla): the image's
        SigLIP embedding, its latent (the generator's first draw), and the zero history
        with the image latent at its end."""
        if image is None:
            raise ValueError("the first section needs the first frame (image=)")
        device = pipe._execution_device
        pixels = pipe.video_processor.preprocess(image, height, width)
        self._image_embeds = pipe.encode_image(pixels, device=device).to(dtype)
        onload(pipe.vae)  # prepare_image_latents calls vae.encode, which no offload hook sees
        image_latents = pipe.prepare_image_latents(
            pixels, dtype=torch.float32, device=device, generator=self.generator
        )
        zeros = torch.zeros(
            (1, pipe.transformer.config.in_channels, sum(HISTORY_SIZES), *image_latents.shape[3:]),
            device=device,
            dtype=torch.float32,
        )
        self._image_latents = image_latents
        self._history = torch.cat([zeros, image_latents], dim=2)

    def _timesteps(
        self, pipe: Any, scheduler: Any, latents: torch.Tensor, steps: int, device: torch.device
    ) -> torch.Tensor:
        """The call's per-section schedule: linear sigmas (or the request's), shifted by
        ``mu`` from the section's token count, capped at log(7)."""
        # Not at the top: diffusers is an optional extra; import_diffusers() says so clearly.
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video_framepack import (
            calculate_shift,
            retrieve_timesteps,
        )

        sigmas = (
            np.linspace(1.0, 0.0, steps + 1)[:-1]
            if self.plan.sigmas is None
            else list(self.plan.sigmas)
        )
        seq_len = (
            latents.shape[2]
            * latents.shape[3]
            * latents.shape[4]
            / pipe.transformer.config.patch_size**2
        )
        mu = calculate_shift(
            seq_len,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        mu = min(mu, math.log(7.0))
        timesteps, _ = retrieve_timesteps(
            scheduler,
            steps,
            device,
            # The ndarray that diffusers' FramePack pipeline passes too.
            sigmas=sigmas,
            mu=mu,
        )
        return timesteps

    def _decode(self, pipe: Any, latents: torch.Tensor) -> torch.Tensor:
        """One section's decode, as the call makes it (with the section before it)."""
        vae = pipe.vae
        onload(vae)
        return vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]

    def _final_frames(self, decoded: torch.Tensor, *, first: bool, last: bool) -> torch.Tensor:
        """The frames of ``decoded`` that no later section changes, after blending its
        start into the held-back tail as ``_soft_append(history, current, overlap)`` does
        (the same element-wise arithmetic on the same frames); its last ``overlap``
        frames are held back, unless it is the last section."""
        overlap = self.plan.overlap
        if first:
            video = decoded
        else:
            tail = self._tail
            assert tail is not None
            weights = torch.linspace(1, 0, overlap, dtype=tail.dtype, device=tail.device)
            weights = weights.view(1, 1, -1, 1, 1)
            blended = weights * tail + (1 - weights) * decoded[:, :, :overlap]
            video = torch.cat([blended, decoded[:, :, overlap:]], dim=2).to(tail)
        if last:
            self._tail = None
            return video
        self._tail = video[:, :, -overlap:].clone()
        return video[:, :, :-overlap]

    @property
    def held_bytes(self) -> int:
        """Bytes of tensors the session holds now (for tests)."""
        tensors = (self._image_latents, self._image_embeds, self._history, self._tail)
        return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)

    @property
    def held_latent_frames(self) -> int:
        """Latent frames of history held now; bounded by `FramepackPlan.kept_latents`."""
        return 0 if self._history is None else int(self._history.shape[2])
