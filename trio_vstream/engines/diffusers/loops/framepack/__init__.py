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

from typing import TYPE_CHECKING

from trio_vstream.engines.diffusers._extra import COMMON, ExtraParams, by_plan, sigmas
from trio_vstream.engines.diffusers._settings import config_error
from trio_vstream.engines.diffusers.loops._protocol import Draft, Loop
from trio_vstream.engines.diffusers.loops.framepack._groups import (
    SectionGroup,
    SectionKey,
    SectionRow,
)
from trio_vstream.engines.diffusers.loops.framepack._inverted import InvertedRun
from trio_vstream.engines.diffusers.loops.framepack._loop import FramepackLoop
from trio_vstream.engines.diffusers.loops.framepack._plan import (
    HISTORY_SIZES,
    INVERTED,
    SAMPLING_TYPES,
    VANILLA,
    FramepackPlan,
    framepack_plan,
)
from trio_vstream.engines.diffusers.loops.framepack._prompts import Prompt, Prompts
from trio_vstream.engines.diffusers.loops.segments import SegmentPlan

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream


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


__all__ = [
    "ENGINE_SET_ARGS",
    "EXTRA_PARAMS",
    "FRAMEPACK_ARGS",
    "HISTORY_SIZES",
    "INVERTED",
    "LOOP",
    "SAMPLING_TYPES",
    "VANILLA",
    "FramepackLoop",
    "FramepackPlan",
    "FramepackSections",
    "InvertedRun",
    "Prompt",
    "Prompts",
    "SectionGroup",
    "SectionKey",
    "SectionRow",
    "default_window",
    "framepack_plan",
]
