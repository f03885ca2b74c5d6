"""FramePack sections (``HunyuanVideoFramepackPipeline``): `FramepackLoop` streams one
session's FramePack-F1 (vanilla) sections, one per ``next_chunk``; inverted sampling goes
the segment path, one call of one section per segment (`FramepackPlan.inverted`,
`InvertedRun`).

``HunyuanVideoFramepackPipeline`` with ``sampling_type="vanilla"`` (FramePack-F1) makes a
video forwards in sections of ``latent_window_size`` latent frames: each section is
denoised from fresh noise while attending to the first frame's latent and to the last
16+2+1 latent frames made before it (``history_sizes``, packed at 4x, 2x and 1x). Its
``__call__`` runs every section in one call and takes no history back in, so no sequence
of calls continues it. And each section is decoded on its own, together with the section
before it, and cross-faded into the video over ``(latent_window_size-1)*4+1`` frames
(``_soft_append``): a section's last frames are not final until the next section has
blended them.

So the engine runs the call's section loop itself from the pipeline's public parts
(``encode_image``, ``prepare_image_latents``, ``prepare_latents``, ``transformer``,
``scheduler``, ``vae``, ``video_processor``, and the pipeline module's ``calculate_shift``
and ``retrieve_timesteps``): `FramepackLoop.run_section` is one iteration of the call's
``for k in range(num_latent_sections)`` loop for ``FramepackSamplingType.VANILLA``
(diffusers 0.42.1, ``pipeline_hunyuan_video_framepack.py``, steps 4 to 7 and the
decode-and-blend after them), restated here. It hands over the frames that are final:
the blend is computed on the held-back overlap frames exactly as ``_soft_append``
computes it on the video's tail (element by element, so the same numbers), and those
overlap frames are held back until the next section, or sent with the last one. So the
frames, joined, equal the single call's (tested), the first section's first 4 frames go
out as soon as it is decoded, and sessions take turns on the shared pipeline at every
section.

What a session keeps is bounded whatever the video's length: the first frame's latent
and image embedding, the last ``max(19, 2*latent_window_size)`` latent frames (the next
section's history and the next decode's input), the held-back overlap frames, and its
generator.

``sampling_type="inverted_anti_drifting"`` (the call's default, and the released
FramePackI2V_HY checkpoint's) makes the sections from the video's end backwards, each
prepended to the history: the first frames come last, so nothing of a multi-section call
can be sent in time order before the whole call ends, and no loop of the engine's could
continue it forwards. So it is served as fixed-length image-to-video pipelines (Wan) are,
segment by segment (``segments.SegmentRun``): each segment is one whole call of one
section (``num_frames`` at most ``(latent_window_size-1)*4+1``, which the call rounds up to
one section; `FramepackPlan.call_frames`), which makes ``4*latent_window_size+1`` frames,
the conditioning image's own first (`FramepackPlan.segment_frames`). The first segment is
conditioned on the session's ``image_reference`` and is exactly that call's output; each
later one is a new call from the previous segment's last frame (``image=``, its copy
dropped) with the generator seeded ``seed + index``. So the first chunk comes after one
whole section's call, and the video is not the single call's: a one-section call has no
later section to make first, so the anti-drifting order (the video's end made first,
anchored on its first frame) plays no part across segments, and nothing but the last frame
carries over (no latent history, no motion), so long videos drift as any frame-continued
video does. The prompts go in as the call's three tensors (`Prompt.call_kwargs`), blended
while a transition runs. Any other ``sampling_type`` is refused (`framepack_plan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from trio_vstream.engines.base import Checkpoint, Chunk, EngineError
from trio_vstream.engines.diffusers._extra import COMMON, ExtraParams, by_plan, sigmas
from trio_vstream.engines.diffusers._messages import quoted, shown
from trio_vstream.engines.diffusers._settings import config_error
from trio_vstream.engines.diffusers.loops._batch import BatchedPass, ModelGroup, batched_chunk
from trio_vstream.engines.diffusers.loops._protocol import Draft, Loop
from trio_vstream.engines.diffusers.loops._vae import onload
from trio_vstream.engines.diffusers.loops.segments import SegmentPlan, SegmentRun

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream, DrivenPass, Mix
    from trio_vstream.engines.transitions import ChunkConditioning

FRAMEPACK_ARGS: tuple[str, ...] = ("latent_window_size", "sampling_type", "image_latents")
"""What a FramePack pipeline's ``__call__`` takes for its section loop."""

ENGINE_SET_ARGS: tuple[str, ...] = (
    "image_latents",
    "last_image_latents",
    "pooled_prompt_embeds",
    "negative_pooled_prompt_embeds",
    "prompt_2",
    "negative_prompt_2",
    "prompt_template",
)
"""Call arguments a request may not set for a section-streamed pipeline: the engine
encodes the image and the prompts itself, with the call's default template
(``sampling_type``, ``latent_window_size``, ``sigmas``, ``max_sequence_length`` and
``attention_kwargs`` may be set, as for the call)."""

HISTORY_SIZES: tuple[int, int, int] = (16, 2, 1)
"""The vanilla history's 4x, 2x and 1x latent frames (the call's, fixed for F1)."""

VANILLA = "vanilla"
"""FramePack-F1's sampling: streamed section by section (`FramepackLoop`)."""
INVERTED = "inverted_anti_drifting"
"""The call's default sampling (FramePackI2V_HY's): served segment by segment."""
SAMPLING_TYPES: tuple[str, ...] = (INVERTED, VANILLA)
"""The ``sampling_type`` values a request may ask for."""


EXTRA_PARAMS = ExtraParams(
    "FramePack",
    {**COMMON, "latent_window_size": by_plan, "sampling_type": by_plan, "sigmas": sigmas},
)
"""The common keys, a schedule, and the section loop's, which `framepack_plan` checks."""


class FramepackSections:
    """FramePack pipelines (`Loop`): vanilla sampling's section loop, driven by the
    engine; inverted sampling, the segment path (decided per request, in `plan`)."""

    name = "FramePack sections"
    batches = True
    """Vanilla sections' steps run batched across sessions when the engine's
    ``max_batch`` > 1 (`SectionGroup`); inverted sampling's segments do not."""
    frame_continued = False
    image_in_loop = True
    engine_set = ENGINE_SET_ARGS

    def recognises(self, info: PipelineInfo) -> bool:
        """A ``__call__`` with the section loop's arguments, and the parts the loop is
        made of."""
        return all(name in info.params for name in FRAMEPACK_ARGS) and all(
            callable(getattr(info.pipe, name, None))
            for name in ("encode_image", "prepare_image_latents", "prepare_latents")
        )

    def segment_frames(self, model: PipelineInfo, given: int | None, frame_step: int) -> int:
        """A section's new frames: ``latent_window_size`` latent frames of ``frame_step``."""
        segment = given or default_window(model) * frame_step
        if segment % frame_step:
            raise config_error(
                f"segment_frames is {model.class_name}'s section (latent_window_size "
                f"latent frames): a multiple of {frame_step} (e.g. "
                f"{default_window(model) * frame_step}), got {segment}"
            )
        return segment

    def extra_params(self, model: PipelineInfo) -> ExtraParams:
        return EXTRA_PARAMS

    def plan(self, draft: Draft) -> FramepackPlan | SegmentPlan | None:
        """Vanilla: the sections. Inverted: the segment path, one call of one section a
        segment (the image's frame and ``window*frame_step`` new ones), each later one
        continued from the last frame."""
        model, step = draft.model, draft.frame_step
        sections = framepack_plan(
            model,
            draft.extra,
            num_frames=draft.request.num_frames,
            window=draft.segment_frames // step,
            true_cfg_scale=draft.request.sampling.true_cfg_scale,
            problems=draft.problems,
        )
        if sections is None or not sections.inverted:
            return sections
        draft.call_kwargs[model.role].update(sections.call_kwargs())
        return SegmentPlan(
            continues=True,
            segment_frames=sections.segment_frames(step),
            frame_step=step,
            call_frames=sections.call_frames(step),
        )

    def start(
        self, stream: DiffusersStream, plan: FramepackPlan | SegmentPlan
    ) -> FramepackLoop | InvertedRun:
        if isinstance(plan, SegmentPlan):
            return InvertedRun(stream, plan)
        return FramepackLoop(stream, plan)


LOOP: Loop[FramepackPlan | SegmentPlan] = FramepackSections()


def default_window(info: PipelineInfo) -> int:
    """Latent frames per section when nothing says otherwise: the call's (9)."""
    value = info.default("latent_window_size")
    return int(value) if isinstance(value, int) and value > 0 else 9


@attrs.frozen(kw_only=True)
class FramepackPlan:
    """The section loop's shape, as the call works it out from its arguments."""

    window: int
    """``latent_window_size``: latent frames per section (4 frames each)."""
    sections: int
    """The call's ``num_latent_sections`` for the whole video (the vanilla loop's count)."""
    sigmas: tuple[float, ...] | None = None
    true_cfg_scale: float = 1.0
    sampling: str = VANILLA
    """``sampling_type``: `VANILLA` (`FramepackLoop`) or `INVERTED` (the segment path)."""

    @property
    def inverted(self) -> bool:
        """Whether the video is served segment by segment, one inverted call a segment."""
        return self.sampling == INVERTED

    def segment_frames(self, temporal: int) -> int:
        """Frames one inverted call of one section makes: the conditioning image's frame
        (the prepended image latent, decoded), then ``temporal`` per latent frame."""
        return self.window * temporal + 1

    def call_frames(self, temporal: int) -> int:
        """The most ``num_frames`` an inverted call is asked for: the call runs
        ``ceil(num_frames / ((window-1)*temporal+1))`` sections, so this is one section."""
        return (self.window - 1) * temporal + 1

    def call_kwargs(self) -> dict[str, Any]:
        """What every inverted segment's call is given besides the request's arguments:
        the sampling (explicitly, not left to the call's default) and the window the
        segment's frames were counted with."""
        return {"sampling_type": self.sampling, "latent_window_size": self.window}

    @property
    def overlap(self) -> int:
        """Frames each section is cross-faded over (the call's ``overlapped_frames``)."""
        return (self.window - 1) * 4 + 1

    @property
    def kept_latents(self) -> int:
        """Latent frames of history a session keeps: the next section's context and the
        next decode's two sections."""
        return max(sum(HISTORY_SIZES), 2 * self.window)


def framepack_plan(
    info: PipelineInfo,
    extra: Mapping[str, Any],
    *,
    num_frames: int,
    window: int,
    true_cfg_scale: float | None,
    problems: list[str],
) -> FramepackPlan | None:
    """The sections a request asks for. ``sampling_type`` (else the call's default,
    ``"inverted_anti_drifting"``) must be one of `SAMPLING_TYPES`: ``"vanilla"`` is
    streamed section by section, ``"inverted_anti_drifting"`` segment by segment.
    ``latent_window_size`` (else ``window``, the engine's) and ``sigmas`` may come in
    ``extra_params``. Appends what is wrong to ``problems`` (then returns None), so a bad
    request is refused before it runs."""
    sampling = extra.get("sampling_type", info.default("sampling_type") or INVERTED)
    sampling = getattr(sampling, "value", sampling)  # the call's default is an enum
    known = isinstance(sampling, str) and sampling in SAMPLING_TYPES
    if not known:
        accepted = " or ".join(repr(v) for v in SAMPLING_TYPES)
        problems.append(
            f"extra_params.sampling_type must be {accepted} for {info.class_name} "
            f"(inverted_anti_drifting, the call's default, is served segment by segment; "
            f"vanilla, FramePack-F1, section by section), got {quoted(sampling)}"
        )
    size = extra.get("latent_window_size", window)
    # A section is latent_window_size latent frames, made in one go whatever num_frames:
    # up to the engine's own window, or to the video's length if that is longer.
    largest = max(window, (num_frames + 3) // 4)
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= largest:
        problems.append(
            f"extra_params.latent_window_size must be an integer from 1 to {largest} (the "
            f"engine's window, or the video's latent frames), got {shown(size)}"
        )
        return None
    # sigmas comes checked (`check_extra_params`): bounded, one per step.
    schedule = extra.get("sigmas")
    if schedule is not None:
        schedule = tuple(schedule)
    if not known:
        return None
    window_frames = (size - 1) * 4 + 1
    return FramepackPlan(
        window=size,
        sections=max(1, (num_frames + window_frames - 1) // window_frames),
        sigmas=schedule,
        true_cfg_scale=1.0 if true_cfg_scale is None else float(true_cfg_scale),
        sampling=sampling,
    )


@attrs.frozen
class Prompt:
    """One prompt's conditioning, as the call's ``encode_prompt`` returns it."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def encode(cls, pipe: Any, text: str, max_sequence_length: int | None) -> Prompt:
        """``encode_prompt`` as the call runs it (its default template)."""
        kwargs: dict[str, Any] = {"prompt": text, "device": pipe._execution_device}
        if max_sequence_length is not None:
            kwargs["max_sequence_length"] = max_sequence_length
        with torch.no_grad():
            embeds, pooled, mask = pipe.encode_prompt(**kwargs)
        return cls(embeds, pooled, mask)

    @classmethod
    def mixed(cls, parts: Sequence[tuple[Prompt, float]]) -> Prompt:
        """The weighted sum of the prompts (a transition's blend); the masks joined. One
        prompt is returned as it is, so an unblended section gets the call's tensors."""
        if len(parts) == 1:
            return parts[0][0]
        first = parts[0][0]

        def blend(name: str) -> torch.Tensor:
            total = torch.zeros_like(getattr(first, name), dtype=torch.float32)
            for prompt, weight in parts:
                total += weight * getattr(prompt, name).float()
            return total.to(getattr(first, name).dtype)

        mask = first.mask
        for prompt, _ in parts[1:]:
            mask = torch.maximum(mask, prompt.mask)
        return cls(blend("embeds"), blend("pooled"), mask)

    def on(self, device: torch.device, dtype: torch.dtype) -> Prompt:
        """These tensors as the transformer takes them (the mask too: as the loop passes it)."""
        return Prompt(
            self.embeds.to(device, dtype),
            self.pooled.to(device, dtype),
            self.mask.to(device, dtype),
        )

    def call_kwargs(self, negative: Prompt | None) -> dict[str, Any]:
        """The call's prompt arguments for these tensors (which its ``encode_prompt``
        passes through as they are), and the negative prompt's for true CFG."""
        kwargs = {
            "prompt_embeds": self.embeds,
            "pooled_prompt_embeds": self.pooled,
            "prompt_attention_mask": self.mask,
        }
        if negative is not None:
            kwargs["negative_prompt_embeds"] = negative.embeds
            kwargs["negative_pooled_prompt_embeds"] = negative.pooled
            kwargs["negative_prompt_attention_mask"] = negative.mask
        return kwargs


class Prompts:
    """One session's `Prompt` per prompt text, encoded once per stream."""

    def __init__(self, max_sequence_length: int | None) -> None:
        self._max_sequence_length = max_sequence_length
        self._encoded: dict[str, Prompt] = {}

    def get(self, info: PipelineInfo, text: str) -> Prompt:
        """``text``'s conditioning on ``info``'s pipeline."""
        cached = self._encoded.get(text)
        if cached is None:
            cached = Prompt.encode(info.pipe, text, self._max_sequence_length)
            self._encoded[text] = cached
        return cached

    def mixed(self, info: PipelineInfo, mix: Mix) -> Prompt:
        """A schedule's mix of prompts, blended (`Prompt.mixed`)."""
        return Prompt.mixed([(self.get(info, text), weight) for text, weight in mix])

    def clear(self) -> None:
        self._encoded.clear()


class InvertedRun(SegmentRun):
    """One session's inverted segments: the segment path, its prompts as FramePack's
    three tensors (which its ``encode_prompt`` returns and the generic layouts do not
    read), blended as the section loop blends them."""

    def __init__(self, stream: DiffusersStream, plan: SegmentPlan) -> None:
        super().__init__(stream, plan)
        self._prompts = Prompts(stream.plan.max_sequence_length)

    def close(self) -> None:
        super().close()
        self._prompts.clear()

    def _prompt_kwargs(
        self, stream: DiffusersStream, info: PipelineInfo, conditioning: ChunkConditioning
    ) -> dict[str, Any]:
        """The negative prompt's tensors only for true CFG (``guidance_scale`` is distilled
        guidance)."""
        prompt = self._prompts.mixed(info, conditioning.mix)
        negative = None
        true_cfg = stream.plan.call_kwargs[info.role].get("true_cfg_scale")
        if true_cfg is None:
            true_cfg = info.default("true_cfg_scale")
        text = stream.request.negative_prompt
        if text is not None and isinstance(true_cfg, (int, float)) and true_cfg > 1.0:
            negative = self._prompts.get(info, text)
        return prompt.call_kwargs(negative)


_PER_ROW: tuple[str, ...] = (
    "image_embeds",
    "guidance",
    "latents_clean",
    "latents_history_2x",
    "latents_history_4x",
)
"""The conditions each row brings of its own, joined along the batch."""

_POSITIONS: tuple[str, ...] = (
    "indices_latents",
    "indices_latents_clean",
    "indices_latents_history_2x",
    "indices_latents_history_4x",
)
"""The conditions every row of a key shares: the latents' positions, which follow from
the window (in the key's input shape). A row brings them too; the batch takes its first
row's."""


@attrs.frozen
class _Section:
    """One section as its steps begin: the noise, the schedule, the transformer's
    conditions (the first frame's embedding and latent, the packed history)."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    conditions: dict[str, Any]


@attrs.frozen(kw_only=True)
class SectionKey:
    """What rows must share to run in one forward (one `SectionGroup`): the section's
    latent shape (window, resolution), the prompt's and the image embedding's shapes,
    true CFG on or off, the dtype and the LoRA. The history is not in it: its packed
    shape is the same at every section. The distilled guidance, the true CFG scale and
    the step are each row's."""

    input_shape: tuple[int, ...]
    embeds_shape: tuple[int, ...]
    image_shape: tuple[int, ...]
    guided: bool
    dtype: str
    lora: tuple[str, float] | None
    alone: object | None
    """An object of its own for a request with ``attention_kwargs``: it runs alone."""


@attrs.frozen(eq=False, kw_only=True)
class SectionRow:
    """One session's section step: its inputs and conditions, none of its state."""

    hidden: torch.Tensor
    timestep: torch.Tensor
    prompt: Prompt
    negative: Prompt | None
    true_cfg_scale: float
    conditions: Mapping[str, torch.Tensor]


class SectionGroup(ModelGroup[SectionKey]):
    """The batched step (``run_batch``) of the sections sharing a `SectionKey`: one
    forward over every row's prompt and, with true CFG, every row's negative prompt
    (2N rows where a lone section makes two forwards of one). A batch of more than one
    row masks each row's padded text where a lone row's forward cuts it off (the
    transformer's own two ways): the same attention, summed in another order."""

    def __call__(self, rows: Sequence[SectionRow]) -> list[torch.Tensor | Exception]:
        count = len(rows)
        texts = [row.prompt for row in rows]
        inputs = list(rows)
        if self.key.guided:
            texts += [_negative(row) for row in rows]
            inputs += inputs
        own = {name: torch.cat([row.conditions[name] for row in inputs]) for name in _PER_ROW}
        positions = {name: rows[0].conditions[name] for name in _POSITIONS}
        with self.locked():
            out = self._info.pipe.transformer(
                hidden_states=torch.cat([row.hidden for row in inputs]),
                timestep=torch.cat([row.timestep for row in inputs]),
                encoder_hidden_states=torch.cat([text.embeds for text in texts]),
                encoder_attention_mask=torch.cat([text.mask for text in texts]),
                pooled_projections=torch.cat([text.pooled for text in texts]),
                **own,
                **positions,
                attention_kwargs=self._attention_kwargs,
                return_dict=False,
            )[0]
        results: list[torch.Tensor | Exception] = []
        for i, row in enumerate(rows):
            cond = out[i : i + 1]
            if self.key.guided:
                negative = out[count + i : count + i + 1]
                results.append(negative + row.true_cfg_scale * (cond - negative))
            else:
                results.append(cond.clone())  # not a view keeping the batch's alive
        return results


def _negative(row: SectionRow) -> Prompt:
    if row.negative is None:  # a guided key is made only from rows with a negative prompt
        raise EngineError("a guided row without a negative prompt")
    return row.negative


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
        group = pass_.group(
            ("framepack", key),
            lambda: SectionGroup(engine, info, key, lora, attention_kwargs),
        )
        latents = section.latents
        own = {name: conditions[name] for name in (*_PER_ROW, *_POSITIONS)}
        scheduler = pass_.scheduler
        with pass_.checkpoint.batched(group) as step:
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
            # The ndarray that diffusers' FramePack pipeline passes too; its hint says list.
            sigmas=sigmas,  # type: ignore[arg-type]
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
