"""One module per family of diffusers pipelines, behind one protocol (`Loop`).

A family is the pipelines the engine streams one way:

- ``segments``: fixed-length pipelines (Wan, LTX, CogVideoX, ...), one call per segment,
  each continued from the last frame or an independent clip. It takes any pipeline, so
  it is asked last.
- ``history``: chunk-autoregressive pipelines (Helios, pyramid and distilled included),
  one call per chunk with the session's history latents passed back in.
- ``forcing``: diffusion-forcing pipelines (SkyReels-V2 DF), their window loop driven by
  the engine from the pipeline's parts.
- ``far``: AnyFlow FAR, its causal chunk loop (KV cache included) driven by the engine.
- ``framepack``: FramePack, its vanilla section loop driven by the engine; its inverted
  sampling goes the segment path.
- ``sana_wm``: SANA-WM, the segment path with each call's camera path built from the
  session's camera interactions (a `WorldLoop`).
- ``ltx2``: LTX-2, the segment path with its soundtrack: each chunk carries its frames'
  samples of the call's vocoder waveform. A family that makes sound also implements
  `SoundLoop` (the engine then declares the sound).
- ``wan_v2v``: Wan's video-to-video pipeline, one call a chunk on the chunk's input
  frames. A family that follows an input video also implements `InputLoop` (the engine
  then declares ``video_input``).

The engine asks the registry once, at start-up (`loop_for`): the families are asked in
the order `FAMILIES` lists them, and the first that recognises the ``model`` pipeline
serves it; that one value decides everything the engine does per family. A family's
module is imported when the registry first asks it (as vLLM's model registry imports a
model's module only when it is needed): importing this package imports none of them.

Adding a family is one new module (or package) here, its name in `FAMILIES`, and its
tests:

1. ``loops/<family>.py`` (a name without a leading underscore; ``_``-modules hold what
   families share, such as `_vae`), or a package ``loops/<family>/`` when the family is
   more than one idea (``forcing``, ``far``, ``framepack``: the family and its plan, a
   session's loop, its batched forwards, each a private module), defines ``LOOP``, an
   object implementing `Loop`: its ``name``, ``recognises`` (what the pipeline's
   ``__call__`` takes and the parts its loop needs), ``segment_frames`` (what the engine
   arg means for it), ``extra_params`` (its allow-list: `ExtraParams` built from the
   checks in ``_extra``, ``by_plan`` for the keys its plan checks against the video),
   ``engine_set``, ``plan`` (a request's video, every problem appended, nothing run) and
   ``start``, whose `Run` makes each chunk (``next_chunk``) and drops its tensors
   (``close``). A loop the engine drives hands each pass to
   ``DiffusersStream.driven_chunk`` (the lock, the LoRA, the prompt blend, the host
   copy); a loop of pipeline calls can build on ``segments.SegmentRun``, as ``history``
   does. A family whose steps can run batched across sessions also sets ``batches =
   True`` (optional, read with a default) and, when the engine's ``max_batch`` > 1,
   steps inside ``batched(checkpoint, group, key)`` (``trio_vstream.engines.batched``),
   each session with a group of its own and the pass's hashable batch key, rows of
   equal keys batched together, as ``forcing``, ``framepack`` and ``far`` do: each
   makes its batched pass with ``_batch.batched_chunk`` and its groups on
   ``_batch.ModelGroup``. A family of pipeline calls built on ``SegmentRun`` batches its
   calls' transformer forwards through ``_calls.BatchedCall`` (``segments``,
   ``history``); its optional ``batches_for(model, i2v)`` says which pipelines it
   batches.
2. Its module's name in `FAMILIES`, before the first family that would take its
   pipelines (always before ``segments``, which takes any): the registry asks only the
   families listed there, and ``tests/engines/diffusers/test_loops.py`` fails while a
   module of this package that defines ``LOOP`` is missing from it.
3. ``tests/engines/diffusers/test_<family>.py``, on a tiny random pipeline of the family
   (a builder in ``testing``): the streamed frames equal the pipeline's own single call,
   sessions take turns, a stop ends within a step and the stopped chunk is not decoded,
   memory stays flat (or says why not), and the ``extra_params`` it refuses.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from trio_vstream.engines.diffusers.loops._protocol import (
    Draft,
    InputLoop,
    Loop,
    Run,
    SoundLoop,
    WorldLoop,
)

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo

__all__ = [
    "FAMILIES",
    "Draft",
    "InputLoop",
    "Loop",
    "Run",
    "SoundLoop",
    "WorldLoop",
    "family",
    "loop_for",
    "registered",
]

FAMILIES: tuple[str, ...] = (
    "history",
    "forcing",
    "far",
    "framepack",
    "sana_wm",
    "ltx2",
    "wan_v2v",
    "segments",  # last: it takes any pipeline
)
"""Every family's module, in the order the registry asks them: the first that
recognises a pipeline serves it."""


def family(name: str) -> Loop[Any]:
    """The ``LOOP`` of family ``name`` (one of `FAMILIES`), its module imported now if
    it was not yet."""
    module = importlib.import_module(f"{__name__}.{name}")
    loop: Loop[Any] | None = getattr(module, "LOOP", None)
    if loop is None:
        raise ImportError(f"{module.__name__}: a family's module defines LOOP")
    return loop


def _asked() -> Iterator[Loop[Any]]:
    """The families in the order the registry asks them, each imported when reached."""
    for name in FAMILIES:
        yield family(name)


def registered() -> tuple[Loop[Any], ...]:
    """Every family's ``LOOP``, in the order the registry asks them (`FAMILIES`); this
    imports them all."""
    return tuple(_asked())


def loop_for(info: PipelineInfo) -> Loop[Any]:
    """The family that serves ``info``: the first, in `FAMILIES`' order, that recognises
    it. Only the families asked are imported."""
    for loop in _asked():
        if loop.recognises(info):
            return loop
    raise LookupError(f"no family serves {info.class_name}")  # the segment path takes any
