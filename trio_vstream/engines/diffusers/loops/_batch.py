"""What the batched steps of the engine-driven loops share (SkyReels-V2 DF windows,
AnyFlow FAR chunks, FramePack sections, and the calls of Wan and Helios).

A batch serves several sessions, so it runs outside any one session's checkpoint:
`NEVER_STOPS` is what it waits for the engine's lock with. `ModelGroup` holds what a
group of rows needs of the engine (its pipeline, the rows' key, their LoRA, their
``attention_kwargs``) and runs each batch's forward under the lock with that LoRA on
(`ModelGroup.locked`); `required_negative` is the guided rows' negative prompt.

A session's side of a batched pass of a loop the engine drives is `batched_chunk`: the
one order in which a window, a chunk or a section takes the engine's two locks, which
the families fill in with their own preparation, steps and decode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs
import torch

from trio_vstream.engines.contract import Checkpoint, Chunk, DeferredFrames, EngineError
from trio_vstream.engines.diffusers._stream import logger

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers import DiffusersEngine
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._lora import LoadedLora
    from trio_vstream.engines.diffusers._stream import DiffusersStream, DrivenPass
    from trio_vstream.engines.transitions import ChunkConditioning

NEVER_STOPS = Checkpoint()
"""The batch's own wait for the lock: a batch serves several sessions, and stops for
none of them (a stopped session's row leaves at the next step; see
`trio_vstream.engines.batched`).
The wait is bounded by one session's encoding (prompt, text or image) or one decode."""

Key = TypeVar("Key")
Prepared = TypeVar("Prepared")
Stepped = TypeVar("Stepped")


class ModelGroup(Generic[Key]):
    """The engine, pipeline, key, LoRA and ``attention_kwargs`` of a batched step's rows:
    a group's ``__call__`` (``run_batch``) runs their forward with them, inside
    `locked`. Each session builds its own group for a pass and hands it over with its
    key (``batched(checkpoint, group, key)``): rows of equal keys are batched together
    and run by the first row's group, so everything a group holds besides references to
    the engine's parts is made from its key (the LoRA's adapter and scale are in it; a
    row with ``attention_kwargs`` has a key of its own). A group is small: references
    to the engine, the pipeline and the LoRA, nothing copied.

    ``attention_kwargs`` is None for a group whose rows bring none, or whose forwards
    take them from the rows themselves (`_calls.CallGroup`)."""

    def __init__(
        self,
        engine: DiffusersEngine,
        info: PipelineInfo,
        key: Key,
        lora: tuple[LoadedLora, float] | None,
        attention_kwargs: Any = None,
    ) -> None:
        self._engine = engine
        self._info = info
        self.key = key
        self._lora = lora
        self._attention_kwargs = attention_kwargs

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """What a batch's forwards run in: no autograd, the engine's lock, and the group's
        LoRA (or none) on the shared pipeline. Every batched family's forward needs all
        three, in this order: the LoRA is the pipeline's state, which only the lock's
        holder may change, and another session's call may have left another one on. The
        lock is waited for with `NEVER_STOPS`: the batch serves several sessions and
        stops for none of them."""
        engine, lora = self._engine, self._lora
        with torch.no_grad(), engine.lock.held(NEVER_STOPS):
            engine.loras.activate(self._info, lora[0] if lora else None, lora[1] if lora else 1.0)
            yield


def required_negative(negative: torch.Tensor | None) -> torch.Tensor:
    """A guided row's negative prompt embeddings (a guided key is made only from rows
    that have them)."""
    if negative is None:
        raise EngineError("a guided row without negative prompt embeddings")
    return negative


@attrs.frozen(eq=False)
class BatchedPass:
    """What one batched pass of an engine-driven loop (a window, a chunk, a section) is
    made with, for the family's parts of `batched_chunk` to read."""

    stream: DiffusersStream
    checkpoint: Checkpoint
    remaining: int
    """Frames the video still needs (the chunk's frames are cut to it)."""
    info: PipelineInfo
    """The pipeline the pass runs on (the stream's first: a driven loop has one)."""
    conditioning: ChunkConditioning
    """The prompt schedule's step for this chunk (its mix)."""
    driven: DrivenPass
    """Its steps, guidance and the request's call arguments."""
    scheduler: Any
    """The session's own scheduler (`DiffusersStream.fresh_scheduler`): the steps run
    in the session's thread, never on the shared pipeline's."""

    @property
    def pipe(self) -> Any:
        return self.info.pipe

    @property
    def attention_kwargs(self) -> Any:
        """The request's ``attention_kwargs`` (a row with them runs alone: they apply to
        the whole forward)."""
        return self.driven.kwargs.get("attention_kwargs")

    @property
    def lora_key(self) -> tuple[str, float] | None:
        """The session's LoRA as a batch key holds it: adapter and scale, or None."""
        lora = self.stream.lora
        return None if lora is None else (lora[0].adapter, lora[1])


def batched_chunk(
    stream: DiffusersStream,
    checkpoint: Checkpoint,
    remaining: int,
    *,
    what: str,
    default_guidance: float,
    prepare: Callable[[BatchedPass], Prepared],
    steps: Callable[[BatchedPass, Prepared], Stepped],
    decode: Callable[[BatchedPass, Stepped], torch.Tensor],
    defer: Callable[[BatchedPass, Stepped], DeferredFrames] | None = None,
) -> Chunk:
    """The next chunk of a loop the engine drives, its steps batched with other
    sessions' (`trio_vstream.engines.batched`): the batched counterpart of
    `DiffusersStream.driven_chunk`.

    Every batched family makes a chunk in the same order, which is what keeps sessions
    from holding one another up; here it is written once:

    1. ``prepare``, under the engine's ``lock`` with the session's LoRA on: whatever
       touches the shared pipeline outside a forward (the prompt's encoding, the image's,
       the first chunk's noise and caches). Never while waiting for a batch.
    2. ``steps``, out of the lock: the denoising steps, each a row of a batch whose
       ``run_batch`` takes the lock itself (`ModelGroup.locked`); the session's
       scheduler steps its latents in its own thread.
    3. ``decode`` under the engine's ``decode_lock``, not ``lock``: one decode at a time
       on the shared VAE (whose causal caches live on the module), beside the batches.
       With the engine's ``defer_decode``, a family that can (``defer``) hands the
       server its frames to decode later instead, and the next chunk's steps start at
       once.
    4. The frames go to the host once, counted as sent (`DiffusersStream.finish_driven`).

    ``what`` names the pass in the log; ``default_guidance`` is the family's guidance
    when the request sets none. Returns the chunk; raises whatever ``checkpoint`` raises
    when the session is over (the stopped pass is not decoded)."""
    engine, request = stream.engine, stream.request
    info, index = stream.plan.first, stream.index
    conditioning = stream.next_conditioning()
    driven = stream.driven_pass(info, default_guidance)
    scheduler = stream.fresh_scheduler(info)
    logger.debug("request %s: %d, batched %s", request.request_id, index, what)
    pass_ = BatchedPass(stream, checkpoint, remaining, info, conditioning, driven, scheduler)
    with torch.no_grad():
        with engine.lock.held(checkpoint):
            stream.activate_lora(info)
            prepared = prepare(pass_)
        stepped = steps(pass_, prepared)
        del prepared
        if defer is not None and engine.settings.defer_decode:
            frames = defer(pass_, stepped)
            del stepped
            return stream.deferred_chunk(frames, conditioning, index)
        with engine.decode_lock.held(checkpoint):  # beside the batches, not under `lock`
            video = decode(pass_, stepped)
        del stepped
    return stream.finish_driven(video, remaining, conditioning, index)
