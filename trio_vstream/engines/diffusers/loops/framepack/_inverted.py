"""Inverted sampling, served segment by segment (`InvertedRun`): the segment path with
FramePack's prompt tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trio_vstream.engines.diffusers.loops.framepack._prompts import Prompts
from trio_vstream.engines.diffusers.loops.segments import SegmentPlan, SegmentRun

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream
    from trio_vstream.engines.transitions import ChunkConditioning


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
