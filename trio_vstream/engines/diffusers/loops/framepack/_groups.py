"""The vanilla sections' batched step across sessions: what rows must share
(`SectionKey`), a row (`SectionRow`), and the group that runs them (`SectionGroup`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from trio_vstream.engines.contract import EngineError
from trio_vstream.engines.diffusers.loops._batch import ModelGroup
from trio_vstream.engines.diffusers.loops.framepack._prompts import Prompt

if TYPE_CHECKING:
    pass


PER_ROW: tuple[str, ...] = (
    "image_embeds",
    "guidance",
    "latents_clean",
    "latents_history_2x",
    "latents_history_4x",
)
"""The conditions each row brings of its own, joined along the batch."""

POSITIONS: tuple[str, ...] = (
    "indices_latents",
    "indices_latents_clean",
    "indices_latents_history_2x",
    "indices_latents_history_4x",
)
"""The conditions every row of a key shares: the latents' positions, which follow from
the window (in the key's input shape). A row brings them too; the batch takes its first
row's."""


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
        own = {name: torch.cat([row.conditions[name] for row in inputs]) for name in PER_ROW}
        positions = {name: rows[0].conditions[name] for name in POSITIONS}
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
