"""The engine contract: what a model must provide to be served, and nothing else.

An engine is everything model-specific; the server is everything else. The
server calls the blocking methods below from worker threads (never from the
event loop), so an engine is plain synchronous Python: no Trio, no sockets,
no video encoding. Three rules keep the server's guarantees intact:

* ``EngineStream.next_chunk`` calls ``checkpoint()`` before every unit of
  heavy work (each denoising step, the decode). ``checkpoint()`` raises when
  the session is over (stop, disconnect, stall, error, shutdown), and that is
  how a session stops within one step. Let that exception propagate: never
  catch ``BaseException`` around a checkpoint. A ``checkpoint()`` call is
  also the session's sign of progress (the stall guard aborts a session that
  makes none for the stall timeout), and where concurrent sessions take turns
  on the engine's step slots (``Engine.max_concurrent_steps``), so it may
  block for a while. An engine that waits for something other sessions hold
  (a lock on a shared pipeline) waits inside ``with checkpoint.waiting():``
  and polls ``checkpoint.check_cancelled()``, which only raises: the session
  is then not stalled while the engine makes progress for the others, and a
  stop still reaches it at once. See `Checkpoint`.
* The server never calls two methods of the same stream at once, except
  ``interact``, which arrives from another thread and must only queue the
  change (``PromptSchedule`` does that, with the reference's transition rules).
* ``close`` is always called exactly once per opened stream, even after an
  error or a cancellation, and must release everything the stream holds. After
  a call the server stopped waiting for (one stuck outside a checkpoint, see
  `trio_vstream.scheduling.engine_calls`), it is called in that call's thread as it returns.

`trio_vstream.engines.testing.check_engine` drives an engine through these rules.
What an engine may declare beyond them (interaction kinds, batching, a device, a
stream's seed) are Protocols of their own in `trio_vstream.engines.interfaces`; the
helpers the built-in engines share live beside this module (`frames`, `args`). An
engine that batches its steps across sessions enters batching with `batched`, whose
checkpoint side (`BatchRunner`) only the server and the kit implement.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs
import numpy as np

from trio_vstream.values import Camera, VideoDefaults

In = TypeVar("In")
Out = TypeVar("Out")
RunBatch = Callable[[Sequence[In]], Sequence["Out | Exception"]]
"""An engine's batched step: one result (or an ``Exception``, failing that row) per row."""


class Checkpoint:
    """The engine's line to the server between steps, passed to ``next_chunk``.

    Three calls, for three situations an engine meets:

    * ``checkpoint()``: a unit of heavy work (a denoising step, the decode) is
      about to start. Raises when the session is over; may block while
      sessions take turns on the engine's step slots; counts as progress.
    * ``checkpoint.check_cancelled()``: only raises when the session is over.
      No turn is taken and no progress is claimed, so it suits polling loops:
      waiting for a lock, or for an external worker.
    * ``with checkpoint.waiting():``: the session is queued behind other
      sessions (for example on a lock around a shared pipeline). While inside,
      the stall guard counts the engine's progress for any session as this
      session's too, so a long queue is not mistaken for a hang; an engine
      that makes no progress at all is still caught.

    An engine that batches its steps across sessions does so through `batched`
    (``with batched(checkpoint, run_batch, key) as step``), not through a method
    here: batching is a capability of its own (`BatchRunner`), which an engine
    that does not batch never meets.

    This base class never cancels, never blocks and records nothing: use it to
    run a stream directly (tests, evaluation scripts). The server passes its
    own subclass; `checkpoint_calling` wraps a plain function.
    """

    def __call__(self) -> None:
        self.check_cancelled()

    def check_cancelled(self) -> None:
        """Raise if the session is over; nothing else."""

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Mark the session as queued behind others while inside."""
        yield

    def batched(
        self, run_batch: RunBatch[In, Out]
    ) -> contextlib.AbstractContextManager[Callable[[In], Out]]:
        """Deprecated: ``batched(checkpoint, run_batch)``, the module's function, instead.

        Kept for one release so that an engine written against it still batches; it
        warns (``DeprecationWarning``) and forwards to `batched`, with the key
        ``run_batch`` itself (rows batch together only when they come with the same
        ``run_batch``, as before)."""
        warnings.warn(
            "Checkpoint.batched(run_batch) is deprecated and will be removed in the next "
            "release: use trio_vstream.engines.batched(checkpoint, run_batch, key)",
            DeprecationWarning,
            stacklevel=2,
        )
        return batched(self, run_batch)


@runtime_checkable
class BatchRunner(Protocol):
    """A checkpoint that can run a stream's steps batched with other streams' steps.

    The server's checkpoint is one (its rows go to the server's step batcher), and so
    is the conformance kit's; a plain `Checkpoint` is not. An engine never calls this
    itself: it enters batching through `batched`, which uses a checkpoint's
    ``batched_steps`` when the checkpoint is a ``BatchRunner`` and runs each row alone
    otherwise. Implement it to write a server of one's own, or a checkpoint that wraps
    another (forward ``batched_steps`` to the inner one, or its rows run alone).
    """

    def batched_steps(
        self, run_batch: RunBatch[In, Out], key: Hashable
    ) -> contextlib.AbstractContextManager[Callable[[In], Out]]:
        """``with runner.batched_steps(run_batch, key) as step``: ``step(row)`` is one
        step whose work is ``run_batch(rows)[i]``, for a batch of rows handed over with
        equal ``key`` (never None here: `batched` has already made it ``run_batch``
        where the engine gave none); see `batched` for what the engine may rely on."""
        ...


@contextlib.contextmanager
def batched(
    checkpoint: Checkpoint, run_batch: RunBatch[In, Out], key: Hashable = None
) -> Iterator[Callable[[In], Out]]:
    """Run a stream's steps together with other sessions' steps:
    ``with batched(checkpoint, run_batch, key) as step: ... result = step(row) ...``.

    Inside, ``step(row)`` is one step whose work is ``run_batch(rows)[i]``:
    ``run_batch`` takes the rows of several sessions at once (each row everything one
    step needs: latents, timestep, conditioning) and returns one result per row, in
    order; a result that is an ``Exception`` fails only its row's session (raised from
    its ``step``), while an exception raised by ``run_batch`` fails every row in the
    batch. ``step`` is also a checkpoint: it raises when the session is over, and a
    stopped session's row leaves the batch at the next step boundary. Stay inside only
    while stepping (one chunk's denoising loop, say): the server waits for every session
    inside to send its next row before it runs a batch, so slow work between steps holds
    the others back.

    ``key`` says which rows may share a batch: any hashable value, and rows handed over
    with equal keys are batched together, whichever session's ``run_batch`` they came
    with. A batch runs the ``run_batch`` that came with its first row, called from one
    thread at a time; so the ``run_batch`` of every row of one key must be
    interchangeable (put in the key whatever a batch's forward depends on: shapes,
    dtype, the LoRA), and each session may build its own. ``key`` None (the default)
    means ``run_batch`` itself: only rows with the same (equal) ``run_batch`` batch.

    The rows batch when ``checkpoint`` is a `BatchRunner` (the server's, for an engine
    that declares ``max_batch`` > 1, see `interfaces.SupportsBatching`; the conformance
    kit's). Any other checkpoint (a plain ``Checkpoint()`` in a test or an evaluation
    script) runs each row alone: a step (``checkpoint()``), then ``run_batch([row])``.
    """
    group = run_batch if key is None else key
    hash(group)  # a TypeError here, not in the server's thread, for an unhashable key
    if isinstance(checkpoint, BatchRunner):
        with checkpoint.batched_steps(run_batch, group) as step:
            yield step
        return

    def alone(row: In) -> Out:
        checkpoint()
        return batch_result(run_batch([row]), 0, 1)

    yield alone


def batch_result(results: Sequence[Out | Exception], index: int, rows: int) -> Out:
    """Row ``index``'s result of a ``run_batch`` over ``rows`` rows: raised if it failed."""
    if len(results) != rows:
        raise EngineError(f"run_batch returned {len(results)} results for {rows} rows")
    result = results[index]
    if isinstance(result, Exception):
        raise result
    return result


class _FunctionCheckpoint(Checkpoint):
    def __init__(self, step: Callable[[], None], check: Callable[[], None] | None) -> None:
        self._step = step
        self._check = check

    def __call__(self) -> None:
        self._step()

    def check_cancelled(self) -> None:
        if self._check is not None:
            self._check()


def checkpoint_calling(
    step: Callable[[], None], check_cancelled: Callable[[], None] | None = None
) -> Checkpoint:
    """A `Checkpoint` whose steps call ``step`` (and whose probes ``check_cancelled``):
    how a test counts an engine's steps or stops it at a chosen one."""
    return _FunctionCheckpoint(step, check_cancelled)


class EngineError(Exception):
    """The engine cannot do what was asked; the message is shown to the client."""


class InvalidRequestError(EngineError):
    """The request asks for something this engine cannot do (an unknown extra
    parameter, an unsupported size): the client gets ``invalid_request``."""


class EngineConfigError(EngineError):
    """The engine was configured wrongly (bad --engine-arg, missing weights): a start-up error."""


@attrs.frozen(kw_only=True)
class SamplingSettings:
    """Sampler settings that some model families have and others do not.

    Wan 2.2's two-stage sampling (``guidance_scale_2`` for the low-noise stage,
    ``boundary_ratio`` where it begins), true classifier-free guidance with a negative
    prompt (``true_cfg_scale``), and the timestep shift of flow-matching schedulers
    (``flow_shift``). Each is ``None`` when the client left it to the engine. They are
    kept apart from `GenerationRequest`'s common fields so that what every engine must
    answer stays small: an engine reads those its sampler has, and refuses or ignores
    (saying so in its log) the others.
    """

    guidance_scale_2: float | None = None
    true_cfg_scale: float | None = None
    boundary_ratio: float | None = None
    flow_shift: float | None = None


@attrs.frozen(kw_only=True)
class VideoInput:
    """A session that follows an input video (video-to-video): what its engine is told.

    Only an engine that declares `interfaces.SupportsVideoInput` gets a request with one;
    its stream is then fed the input's frames chunk by chunk (`interfaces.FollowsInput`).
    """

    fps: int
    """The input's frame rate as the client declared it. The frames a stream is fed are
    already resampled to the output's rate: one input frame per output frame."""
    strength: float
    """In [0, 1]: how far the output may depart from its input. 0 keeps the input (as
    far as the model can), 1 ignores it; video-to-video pipelines call it ``strength``."""


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One validated session.start, resolved to what an engine needs.

    ``num_frames``, ``width``, ``height`` and ``fps`` are always set (the
    request's values or the engine's defaults); optional sampling fields are
    ``None`` when the client left them to the engine. Model-family sampler
    settings are in ``sampling``.
    """

    request_id: str
    prompt: str
    width: int
    height: int
    fps: int
    num_frames: int
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    sampling: SamplingSettings = attrs.field(factory=SamplingSettings)
    """Settings of some model families' samplers (Wan 2.2's second stage, ...)."""
    seed: int | None = None
    quality: str | None = None
    image: np.ndarray | None = attrs.field(default=None, eq=False)
    """The ``image_reference`` decoded to (H, W, 3) uint8 RGB, for image-to-video."""
    lora: Mapping[str, Any] | None = None
    extra_params: Mapping[str, Any] = attrs.field(factory=dict)
    """Model-specific options from the request (``video_codec_options`` removed)."""
    input_video: VideoInput | None = None
    """Set when the session follows an input video (``session.start``'s ``input_video``),
    for an engine that declares `interfaces.SupportsVideoInput` only."""


@attrs.frozen
class PromptChange:
    """A ``session.interaction``: a new prompt, blended in over some chunks, and/or a camera.

    An engine only receives the kinds it declared (`interfaces.SupportsInteractionKinds`): the
    session refuses the others before they get here. So an engine that takes only
    prompts (the default) can rely on ``prompt`` being set and ``camera`` being None;
    one that also takes cameras must handle a camera-only change (``prompt`` None,
    meaning "keep the prompt").
    """

    event_id: str
    prompt: str | None
    transition_chunks: int | None = None
    """Chunk boundaries over which to blend; ``None`` means the engine's default."""
    camera: Camera | None = None
    """The camera motion or pose, already validated (finite, a unit quaternion)."""
    window_offset: float = 0.0
    """Where in the chunk's action window the change was received, as a fraction in
    [0, 1) of the window: 0.0 applies it from the chunk's first frame, 0.5 from its
    middle. Only a paced camera session (``streaming_buffer_seconds`` on an engine that
    takes cameras) sets it: each chunk's window is as long as its media, so a key
    pressed halfway through it belongs halfway through the chunk it steers. Always 0.0
    otherwise. An engine may use it to place or integrate the change inside the chunk
    (a velocity pressed late in the window counts for less of it, a short press still
    counts); one that ignores it applies the change from the chunk's start, which is
    still correct, only less precise."""

    @property
    def kinds(self) -> frozenset[str]:
        """What this change carries, in `interfaces.SupportsInteractionKinds`' terms."""
        return frozenset(
            kind
            for kind, value in (("prompt", self.prompt), ("camera", self.camera))
            if value is not None
        )


@runtime_checkable
class DeferredFrames(Protocol):
    """A chunk's frames, decoded later and off the step path: ``Chunk.frames`` may be one.

    An engine whose decode is heavy work (a VAE's, a resize) returns its chunk as soon as
    the denoising is done, with its frames still to decode: the server then runs
    ``decode()`` in the chunk's encode thread, while the engine's thread already denoises
    the next chunk. So a chunk's decode overlaps the next one's steps, and a chunk's
    decode and encode run back to back in one thread, without a hand-off between them.

    What the server promises:

    * ``decode()`` runs at most once, after the ``next_chunk`` that returned it, in
      another thread than the stream's ``next_chunk`` (which may run meanwhile), and in
      chunk order: a stream's chunk k is decoded before its chunk k+1 (a causal decoder
      cache carried from chunk to chunk stays in order), and never after a chunk of the
      stream was dropped.
    * A chunk that will not be sent (a stop, a disconnect, a stall, an error, a shutdown)
      is not decoded: ``release()`` is called instead. (A decode already under way when
      the session ends is let finish, in its thread; its frames are dropped.)
      ``release()`` is also called once the server is done with a decoded chunk, and
      after a failed ``decode()``.
    * Either may come after the stream's ``close``: the object owns what it needs (its
      latents, the session's decoder cache), not the stream.

    What the engine promises: ``shape`` is the (T, H, W, 3) of the frames ``decode()``
    will return, known without decoding (the session paces its chunks by it and the
    server refuses frames that differ); ``decode()`` returns what ``Chunk.frames`` would
    otherwise hold (a test may call it twice; after ``release()`` it may raise
    `EngineError`); ``release()`` drops what the object holds, never blocks (the server
    may call it from its event loop), may be called more than once and after
    ``decode()``. A decode takes no checkpoint: the server checks the session is still
    on just before it. The memory this costs is one chunk's decode beside the next
    chunk's steps: an engine where both do not fit keeps the decode in ``next_chunk``
    (see docs/engines.md).
    """

    @property
    def shape(self) -> tuple[int, ...]:
        """(T, H, W, 3): the shape of the frames ``decode()`` returns."""
        ...

    def decode(self) -> Any:
        """The frames, as ``Chunk.frames`` would hold them. Blocking; a worker thread."""
        ...

    def release(self) -> None:
        """Drop what is still held (latents, a cache reference), decoded or not."""
        ...


def release_frames(frames: object) -> None:
    """Release a chunk's frames if they are `DeferredFrames`; nothing otherwise.

    For whoever drops or has finished with a chunk (the server, a test, a benchmark).
    """
    if isinstance(frames, DeferredFrames):
        frames.release()


@attrs.frozen(kw_only=True)
class Chunk:
    """Frames an engine produced, and which interactions they reflect."""

    frames: Any
    """(T, H, W, 3) uint8 RGB: a numpy array, or a torch tensor on any device
    (the server converts it off the event loop); or `DeferredFrames` that decode to
    one, for the server to decode off the engine's step path."""
    index: int
    """The generation chunk index, 0-based."""
    started_event_ids: tuple[str, ...] = ()
    active_event_ids: tuple[str, ...] = ()
    completed_event_ids: tuple[str, ...] = ()
    audio: Any = attrs.field(default=None, eq=False)
    """The sound of these frames, from an engine that makes sound
    (`interfaces.SupportsAudio`), else None: PCM in [-1, 1] as a numpy array or a torch
    tensor, float (float32 preferred), shape ``(samples,)`` for mono or ``(channels,
    samples)``. It covers exactly the chunk's frames: ``audio_samples_through(end) -
    audio_samples_through(start)`` samples (`trio_vstream.values`), where ``start`` and
    ``end`` count the stream's frames before and after this chunk, so the sound never
    drifts from the picture. The server refuses a chunk whose count is off."""


@runtime_checkable
class EngineStream(Protocol):
    """One session's generation, driven chunk by chunk from a worker thread."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        """Generate the next chunk; ``None`` when the video is complete."""
        ...

    def interact(self, change: PromptChange) -> None:
        """Queue a prompt change for the next chunk boundary. Called from
        another thread while ``next_chunk`` may be running: only queue."""
        ...

    def close(self) -> None:
        """Release the stream's resources. Called exactly once."""
        ...

    # Optional: ``seed: int``, the seed the stream uses (`interfaces.SupportsSeed`).


@runtime_checkable
class Engine(Protocol):
    """A loaded model, shared by every session of the server process."""

    name: str
    """The served model name by default (what ``session.start.model`` is checked against)."""
    max_concurrent_steps: int | None
    """How many steps of different sessions may run at once (1 for one GPU);
    ``None`` for no limit. Sessions take turns fairly, step by step."""
    video_defaults: VideoDefaults
    """Size, fps and frame count used where a request leaves them out."""

    # Optional capabilities are Protocols of their own, in `trio_vstream.engines.interfaces`
    # (``interaction_kinds``, ``max_batch``, ``device``): not members here, so that an
    # engine written before cameras or batching existed still satisfies
    # ``isinstance(x, Engine)``, and declaring one is adding an attribute.

    def open_stream(self, request: GenerationRequest) -> EngineStream:
        """Start generating for one request. Blocking; runs in a worker thread.
        Raise ``EngineError`` for requests this engine cannot serve."""
        ...

    def close(self) -> None:
        """Release the model at server shutdown."""
        ...


EngineFactory = Callable[..., Engine]
"""``factory(device=..., **engine_args)``: engine args arrive as strings."""
