"""FramePack's prompt conditioning (`Prompt`: the LLaMA embeddings and mask and the CLIP
pooled embedding, blended while a transition runs), encoded once per stream (`Prompts`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import Mix


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
