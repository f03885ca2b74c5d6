"""FAR's batched forwards across sessions: what rows must share (`FarKey`), a flow-map
step's row and a cache pass's (`ChunkRow`, `CacheRow`), and the groups that run them
(`ChunkGroup`, `CachePassGroup`) over the rows' KV caches joined for one forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from trio_vstream.engines.diffusers.loops._batch import (
    ModelGroup,
    required_negative,
)

if TYPE_CHECKING:
    pass


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
