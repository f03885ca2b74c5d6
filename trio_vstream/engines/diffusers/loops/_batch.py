"""What the batched steps of the engine-driven loops share (SkyReels-V2 DF windows,
AnyFlow FAR chunks, FramePack sections, and the calls of Wan and Helios).

A batch serves several sessions, so it runs outside any one session's checkpoint:
`NEVER_STOPS` is what it waits for the engine's lock with. `ModelGroup` holds what a
group of rows needs of the engine (its pipeline, the rows' key, their LoRA, their
``attention_kwargs``), and `required_negative` is the guided rows' negative prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from trio_vstream.engines.contract import Checkpoint, EngineError

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers import DiffusersEngine
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._lora import LoadedLora

NEVER_STOPS = Checkpoint()
"""The batch's own wait for the lock: a batch serves several sessions, and stops for
none of them (a stopped session's row leaves at the next step; see `Checkpoint.batched`).
The wait is bounded by one session's encoding (prompt, text or image) or one decode."""

Key = TypeVar("Key")


class ModelGroup(Generic[Key]):
    """The engine, pipeline, key, LoRA and ``attention_kwargs`` of a batched step's rows:
    a group's ``__call__`` (``run_batch``) runs their forward with them. The server's
    batcher gathers rows by the group object, so the engine hands the same one to every
    session of a key (`DiffusersEngine.batch_group`)."""

    def __init__(
        self,
        engine: DiffusersEngine,
        info: PipelineInfo,
        key: Key,
        lora: tuple[LoadedLora, float] | None,
        attention_kwargs: Any,
    ) -> None:
        self._engine = engine
        self._info = info
        self.key = key
        self._lora = lora
        self._attention_kwargs = attention_kwargs


def required_negative(negative: torch.Tensor | None) -> torch.Tensor:
    """A guided row's negative prompt embeddings (a guided key is made only from rows
    that have them)."""
    if negative is None:
        raise EngineError("a guided row without negative prompt embeddings")
    return negative
