"""What a family of pipelines implements (`Loop`), and one session's place in its loop
(`Run`).

The engine does what every family shares: it loads the pipelines, maps a request's
common fields onto the call (size, steps, guidance, fps, the negative prompt, the flow
shift, the LoRA), checks ``extra_params`` against the family's allow-list, and takes the
shared pipeline in turns between sessions (``DiffusersStream``: the lock, the prompt
embeddings and their blending, the frames' one copy to the host). A family does what
only it knows: which pipelines it serves, what ``segment_frames`` means for them, the
``extra_params`` it takes, what a request's video becomes (its plan), and how each chunk
is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import attrs

if TYPE_CHECKING:
    import numpy as np

    from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest, PromptChange
    from trio_vstream.engines.diffusers._extra import ExtraParams
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream
    from trio_vstream.engines.interfaces import AudioFormat

PlanT = TypeVar("PlanT")


@attrs.frozen(kw_only=True)
class Draft:
    """What the engine made of a request before the family plans the rest (`Loop.plan`)."""

    request: GenerationRequest
    model: PipelineInfo
    """The ``model`` pipeline (``i2v_model`` serves only the segment path's segments)."""
    extra: Mapping[str, Any]
    """The request's ``extra_params``, checked (`check_extra_params`); those the family
    declared `by_plan` are for its plan to check."""
    segment_frames: int
    """The engine's ``segment_frames``, as `Loop.segment_frames` made it."""
    frame_step: int
    """Valid frame counts are ``frame_step * n + 1``."""
    continues: bool
    """Whether the engine has a pipeline that continues a segment from the last frame
    (``i2v_model``, or the model itself when its call takes ``image=``)."""
    call_kwargs: dict[str, dict[str, Any]]
    """Per pipeline role, what each of its calls is given: the family may add to it."""
    problems: list[str]
    """Where the family's plan says what is wrong with the request."""


class Run(Protocol):
    """One session's place in its family's loop: what its next chunk starts from."""

    def next_chunk(self, stream: DiffusersStream, checkpoint: Checkpoint, remaining: int) -> Chunk:
        """Make ``stream``'s next chunk, of at most ``remaining`` frames (``remaining`` >
        0), and hand it to the stream (``DiffusersStream.chunk``). ``checkpoint()`` runs before
        every denoising step (and before the VAE work), so a stop leaves after the step in
        progress, and a stopped chunk is neither decoded nor kept."""
        ...

    def close(self) -> None:
        """Drop the session's tensors; called once, when the stream closes."""
        ...


class Loop(Protocol[PlanT]):
    """A family of pipelines, and the loop that streams them (one object per family, as
    ``LOOP`` in its module, named in the registry's ``FAMILIES``; see the package's
    docstring for how to add one)."""

    name: str
    """The family, for the log."""
    frame_continued: bool
    """Whether chunks after the first continue from the last frame, through an
    image-to-video pipeline (``i2v_model``, or the model itself). False for a family that
    carries its own state from chunk to chunk: ``i2v_model`` is refused."""
    image_in_loop: bool
    """Whether the family conditions its first chunk on ``image_reference`` itself (its
    loop drives the pipeline's parts), whatever the pipeline's ``__call__`` takes."""
    engine_set: tuple[str, ...]
    """Call arguments the family sets itself: refused in ``extra_params``."""

    def recognises(self, info: PipelineInfo) -> bool:
        """Whether this family serves ``info`` (what its ``__call__`` takes, and the
        parts its loop is made of)."""
        ...

    def segment_frames(self, model: PipelineInfo, given: int | None, frame_step: int) -> int:
        """The frames of one chunk: ``given`` (the ``segment_frames`` engine arg) checked
        for this family, or its default. An `EngineConfigError` (``config_error``) names
        a bad value at start-up."""
        ...

    def extra_params(self, model: PipelineInfo) -> ExtraParams:
        """The ``extra_params`` a request may set for ``model``, each with its check."""
        ...

    def plan(self, draft: Draft) -> PlanT | None:
        """What the request's video becomes in this family's loop, or None with what is
        wrong appended to ``draft.problems``: a bad request is refused before its stream
        exists. Runs nothing on the pipeline."""
        ...

    def start(self, stream: DiffusersStream, plan: PlanT) -> Run:
        """A session's run of ``plan``, in ``stream``; runs nothing on the pipeline. The
        run reads what it needs of ``stream`` (its plan, its request) but keeps no
        reference to it: the stream holds the run, and a cycle would keep a closed
        session's tensors alive until the garbage collector runs."""
        ...


@runtime_checkable
class WorldLoop(Protocol):
    """A family of world models, steered by camera interactions (SANA-WM's): the engine
    declares the ``camera`` interaction kind for it (and only for it), hands each camera
    to `steer`, and serves a request without ``image_reference`` (the family's run starts
    from a first frame of its own)."""

    def steer(self, run: Run, change: PromptChange) -> None:
        """Queue ``change``'s camera for ``run``'s next chunk (called from the event
        loop's thread, while a chunk may be in the making: only queue). A change that also
        carries a prompt goes to the prompt schedule as well; a camera-only one is listed
        in the chunk that applies it."""
        ...


@runtime_checkable
class SoundLoop(Protocol):
    """A family whose pipelines make sound (LTX-2): what a family may declare beyond
    `Loop`, as an engine declares `interfaces.SupportsAudio` beyond ``Engine``.

    The engine then declares the sound (``audio_sample_rate``, ``audio_channels``) and
    the family's run puts each chunk's PCM in ``Chunk.audio``, exactly the samples of its
    frames (`trio_vstream.values.audio_samples_through`)."""

    def audio_format(self, model: PipelineInfo, i2v: PipelineInfo | None) -> AudioFormat | None:
        """The sound the pipelines make (the same for ``model`` and ``i2v``, which
        continues it), or None for none; an `EngineConfigError` (``config_error``) at
        start-up for pipelines whose sound differs or cannot be read."""
        ...


@runtime_checkable
class InputLoop(Protocol):
    """A family whose runs follow an input video (Wan's video-to-video): each chunk is
    made from the input frames fed for it. The engine declares ``video_input``
    (`interfaces.SupportsVideoInput`) for it, and only for it, and opens its streams as
    `interfaces.FollowsInput`, whose ``next_chunk_frames`` and ``feed_input`` come here."""

    def chunk_frames(self, run: Run, remaining: int) -> int:
        """How many frames ``run``'s next chunk has, with ``remaining`` frames of the video
        left to make (> 0): what the server feeds it. Plain arithmetic: the server reads it
        from its event loop."""
        ...

    def feed(self, run: Run, frames: np.ndarray) -> None:
        """Keep ``frames``, the next chunk's input ((`chunk_frames`, H, W, 3) uint8 RGB at
        the request's size, checked by the stream), for ``run``'s next ``next_chunk``."""
        ...
