"""The windows' batched step across sessions: what rows must share (`BatchKey`), a row
(`ForwardRow`), the group that runs them (`ForwardGroup`), and the one transformer call
the lone and the batched step both make (`predict`, under `block_size`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from trio_vstream.engines.diffusers.loops._batch import (
    ModelGroup,
    required_negative,
)

if TYPE_CHECKING:
    pass


def fps_flag(fps: int) -> int:
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

    Each session makes its own for a window and hands it over with its key: the
    server's batcher batches the rows of equal keys, run by the first row's group (see
    `ModelGroup`). Called with some rows, it
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
            with block_size(transformer, self.key.block):
                out = predict(
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


def predict(
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
def block_size(transformer: Any, requested: int | None) -> Iterator[int]:
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
