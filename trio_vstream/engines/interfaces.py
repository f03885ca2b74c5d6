"""What an engine may do beyond the contract: its optional capabilities, as Protocols.

`trio_vstream.engines.contract.Engine` and ``EngineStream`` are what every engine must
provide. An engine may also declare more, each a small ``runtime_checkable`` Protocol
here, checked with its ``supports_*`` function (as vLLM's ``interfaces.py`` does for
its models) rather than with ``getattr`` and a default scattered through the server:

* `SupportsInteractionKinds`: what a ``session.interaction`` may carry for it (prompts
  only when it does not say); read with `interaction_kinds`.
* `SupportsBatching`: it runs several sessions' steps as one batch
  (``trio_vstream.engines.batched``); read with `max_batch`.
* `SupportsDevice`: the device it runs on, named in recordings.
* `SupportsSeed`, for a stream: the seed it uses, echoed to a client that chose none.
* `SupportsLiveSettings`: the sampling settings it suggests for live (paced,
  steered) sessions, where a chunk's time is a person's wait; read with `live_settings`.
* `SupportsAudio`: it makes sound, at this sample rate and channel count; every chunk then
  carries its ``audio`` (`trio_vstream.engines.contract.Chunk`); read with `audio_format`.
* `SupportsVideoInput`: its streams follow a live input video (video-to-video); such a
  stream is `FollowsInput`, fed each chunk's input frames; read with `supports_video_input`.
* `SupportsLiveInputChunk`: the chunk length it suggests for a live session that follows
  a camera, where a chunk's window of input is a person's wait; read with
  `live_input_chunk_frames`.

Each is a Protocol of its own, not a member of ``Engine``: an engine written before a
capability existed (before cameras, before batching) still satisfies
``isinstance(x, Engine)``, and declaring a capability is adding one attribute.

A ``runtime_checkable`` Protocol checks only that the attribute is there: `supports_seed`
checks the value's type too, and `max_batch` refuses a value of the wrong kind (at the
server's start-up).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol, TypeGuard, runtime_checkable

import attrs
import numpy as np

from trio_vstream.engines.contract import Engine, EngineConfigError
from trio_vstream.values import AUDIO_MAX_CHANNELS, AUDIO_SAMPLE_RATES

__all__ = [
    "DEFAULT_INTERACTION_KINDS",
    "INTERACTION_KINDS",
    "AudioFormat",
    "FollowsInput",
    "SupportsAudio",
    "SupportsBatching",
    "SupportsChunkFrames",
    "SupportsDevice",
    "SupportsInteractionKinds",
    "SupportsLiveInputChunk",
    "SupportsLiveSettings",
    "SupportsSeed",
    "SupportsVideoInput",
    "audio_format",
    "interaction_kinds",
    "live_input_chunk_frames",
    "live_settings",
    "max_batch",
    "max_chunk_frames",
    "missing_members",
    "supports_audio",
    "supports_batching",
    "supports_device",
    "supports_interaction_kinds",
    "supports_seed",
    "supports_video_input",
]

INTERACTION_KINDS: frozenset[str] = frozenset({"prompt", "camera"})
"""Every kind a ``session.interaction`` can carry (`PromptChange.kinds`)."""

DEFAULT_INTERACTION_KINDS: frozenset[str] = frozenset({"prompt"})
"""What an engine that declares no kinds takes: prompts, as every engine did before cameras."""

LIVE_SETTING_FIELDS: frozenset[str] = frozenset(
    {"num_inference_steps", "guidance_scale", "flow_shift"}
)
"""The ``session.start`` fields an engine's `SupportsLiveSettings` may name: numbers a
client sends as they are, which the protocol checks like any other request's."""


@runtime_checkable
class SupportsInteractionKinds(Protocol):
    """An engine that says what a ``session.interaction`` may carry for it."""

    interaction_kinds: frozenset[str]
    """Some of `INTERACTION_KINDS`: ``"prompt"``, ``"camera"``. The session refuses
    the other kinds before they reach ``EngineStream.interact``, so a prompt-only engine
    always gets a prompt, and one that takes cameras must handle a camera-only change
    (``prompt`` None, meaning "keep the prompt")."""


@runtime_checkable
class SupportsBatching(Protocol):
    """An engine that runs the steps of several sessions as one batch.

    Its streams step inside ``with batched(checkpoint, run_batch, key) as step:`` (see
    `trio_vstream.engines.contract.batched`); ``max_batch`` > 1 asks the server to batch
    them, at most that many rows a call, and 1 makes it step each session alone
    (``max_concurrent_steps`` then applies). ``run_batch`` and ``key`` are handed over
    when a stream enters batching, so they are no members here: an engine may batch more
    than one kind of step, each under keys of its own. Rows of equal keys are batched
    together and run by the ``run_batch`` of the batch's first row, so a key names
    everything the batched call depends on (shapes, dtype, an adapter), and each stream
    may build its own ``run_batch`` (holding references to the shared model, not copies).

    The checkpoint side is `trio_vstream.engines.contract.BatchRunner`, which the server's
    checkpoint implements; an engine never calls it, nor needs to know of it.
    """

    max_batch: int


@runtime_checkable
class SupportsDevice(Protocol):
    """An engine that says which device it runs on (a ``torch.device``, or its name)."""

    device: object


@runtime_checkable
class SupportsSeed(Protocol):
    """A stream that says which seed it uses: when the request had none, the server adds
    it to ``video.start``'s config echo, so a client can ask for the same video again."""

    seed: int


@runtime_checkable
class SupportsLiveSettings(Protocol):
    """An engine that suggests sampling settings for live sessions.

    In a live session (paced by ``streaming_buffer_seconds``, steered by a person) every
    millisecond of a chunk's generation is on the path from a key to the screen, and a
    chunk must also be made faster than it plays with room to spare. An engine whose
    defaults are tuned for quality may name cheaper settings here (fewer steps, no
    guidance branch), with what they cost in its docs. ``GET /v1/models`` lists them as
    ``live_defaults``; the player's Live mode sends them unless the person set the field.
    Keys are some of `LIVE_SETTING_FIELDS`, values numbers.
    """

    live_settings: Mapping[str, int | float]


@runtime_checkable
class SupportsChunkFrames(Protocol):
    """An engine that says the most frames one chunk of any session can have.

    A Low-Latency HLS playlist declares its longest part before the first one exists
    (``PART-TARGET``, which may never change), and every chunk is one part; the server
    derives it from this and the session's frame rate. Without it the server assumes
    ``--hls-part-seconds``; a chunk longer than that is served as a segment of its own
    (still valid, less low-latency).
    """

    max_chunk_frames: int


@runtime_checkable
class SupportsLiveInputChunk(Protocol):
    """An engine that suggests a chunk length for live sessions that follow an input video.

    The server makes a chunk once its whole window of input is in, so the first frame of
    the window waits ``(chunk frames - 1) / fps`` before the chunk can even start: at 24
    fps an 8-frame chunk puts 292 ms of capture between a camera frame and the screen, on
    top of the chunk's generation and delivery. An engine that takes
    ``extra_params.chunk_frames`` may name a shorter chunk for such sessions here, with
    what it costs in its docs (fewer frames a second, where the engine computes a whole
    chunk for each). ``GET /v1/models`` lists it as ``live_input_chunk_frames``; the
    player's Live mode sends it as ``extra_params.chunk_frames`` with Camera in. It is a
    suggestion to clients: the engine's own default chunk is unchanged.
    """

    live_input_chunk_frames: int


@runtime_checkable
class SupportsAudio(Protocol):
    """An engine that makes sound: each chunk's ``Chunk.audio`` is that chunk's PCM.

    The server then muxes an AAC track beside the video (every chunk carries both), says
    so in ``video.start``'s config and each ``video.chunk_metadata``, and checks that each
    chunk's audio covers exactly its frames (see ``Chunk.audio``).
    """

    audio_sample_rate: int | None
    """Samples per second, one of `trio_vstream.values.AUDIO_SAMPLE_RATES`; ``None`` for an
    engine that declares the attribute but makes no sound (as configured)."""
    audio_channels: int
    """1 (mono) or 2 (stereo)."""


@runtime_checkable
class SupportsVideoInput(Protocol):
    """An engine whose streams can follow a live input video (video-to-video).

    A client asks for it with ``session.start``'s ``input_video``; the server refuses that
    (``invalid_request``) for an engine without this capability. A request that has it
    carries ``GenerationRequest.input_video``, and the stream `open_stream` returns for it
    must be `FollowsInput`: before each chunk the server hands it that chunk's input.
    """

    video_input: bool
    """True when this engine, as configured, takes input video (a diffusers engine does
    only for a family that has a video-to-video pipeline)."""


@runtime_checkable
class FollowsInput(Protocol):
    """A stream that follows an input video: the server feeds it each chunk's frames.

    For every chunk the server reads ``next_chunk_frames``, gathers that many input
    frames (the ones whose media time falls in the chunk's window, resampled to the
    output's frame rate: see docs/protocol.md for late, early and missing input), then
    calls ``feed_input(frames)`` and ``next_chunk`` in one worker thread, one after the
    other. The chunk that call returns must have exactly ``next_chunk_frames`` frames:
    output frame ``j`` is made from input frame ``frames[j]``.
    """

    next_chunk_frames: int
    """How many frames the next chunk will have; 0 once the video is complete (the next
    ``next_chunk`` returns None, and is called without input). Read by the server
    between calls, from its event loop: a plain value, not work."""

    def feed_input(self, frames: np.ndarray) -> None:
        """The next chunk's input: (next_chunk_frames, H, W, 3) uint8 RGB at the
        request's size. Keep it for the ``next_chunk`` call that follows (the array is the
        stream's; the server never touches it again)."""
        ...


@attrs.frozen
class AudioFormat:
    """What an engine's sound is: its sample rate and channel count."""

    sample_rate: int
    channels: int


def supports_audio(engine: object) -> TypeGuard[SupportsAudio]:
    """Whether ``engine`` makes sound: it declares a sample rate that is not None."""
    return (
        isinstance(engine, SupportsAudio) and getattr(engine, "audio_sample_rate", None) is not None
    )


def audio_format(engine: Engine) -> AudioFormat | None:
    """The sound ``engine`` makes, or None; raises `EngineConfigError` for a rate or a
    channel count the server cannot carry (at the server's start-up)."""
    name = engine.name
    rate = getattr(engine, "audio_sample_rate", None)
    if rate is None:
        return None
    # Read without the Protocol: a rate without a channel count is a mistake to report,
    # not an engine to serve silently.
    channels = getattr(engine, "audio_channels", None)
    if isinstance(rate, bool) or not isinstance(rate, int) or rate not in AUDIO_SAMPLE_RATES:
        raise EngineConfigError(
            f"engine {name}: audio_sample_rate must be one of "
            f"{sorted(AUDIO_SAMPLE_RATES)}, got {rate!r}"
        )
    if (
        isinstance(channels, bool)
        or not isinstance(channels, int)
        or not 1 <= channels <= AUDIO_MAX_CHANNELS
    ):
        raise EngineConfigError(f"engine {name}: audio_channels must be 1 or 2, got {channels!r}")
    return AudioFormat(rate, channels)


def supports_video_input(engine: object) -> bool:
    """Whether ``engine`` takes input video: it declares ``video_input`` True."""
    return isinstance(engine, SupportsVideoInput) and engine.video_input is True


def supports_interaction_kinds(engine: object) -> TypeGuard[SupportsInteractionKinds]:
    """Whether ``engine`` declares its interaction kinds (read them with `interaction_kinds`)."""
    return isinstance(engine, SupportsInteractionKinds)


def supports_batching(engine: object) -> TypeGuard[SupportsBatching]:
    """Whether ``engine`` declares ``max_batch`` (read it with `max_batch`; 1 does not batch)."""
    return isinstance(engine, SupportsBatching)


def supports_device(engine: object) -> TypeGuard[SupportsDevice]:
    """Whether ``engine`` says which device it runs on."""
    return isinstance(engine, SupportsDevice)


def supports_seed(stream: object) -> TypeGuard[SupportsSeed]:
    """Whether ``stream`` says which seed it uses: an ``int`` (not a ``bool``)."""
    if not isinstance(stream, SupportsSeed):
        return False
    seed = stream.seed
    return isinstance(seed, int) and not isinstance(seed, bool)


def interaction_kinds(engine: Engine) -> frozenset[str]:
    """What ``engine`` takes in a ``session.interaction``; prompts only when it does not say."""
    if not supports_interaction_kinds(engine):
        return DEFAULT_INTERACTION_KINDS
    return frozenset(engine.interaction_kinds)


def max_chunk_frames(engine: Engine) -> int | None:
    """The most frames in one chunk, when the engine says (`SupportsChunkFrames`);
    `EngineConfigError` for anything but a positive whole number (at start-up)."""
    if not isinstance(engine, SupportsChunkFrames):
        return None
    value = engine.max_chunk_frames
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(
            f"engine {engine.name}: max_chunk_frames must be a positive integer, got {value!r}"
        )
    return value


def max_batch(engine: Engine) -> int:
    """How many sessions' steps ``engine`` runs together; 1 when it does not batch."""
    name = engine.name
    if not supports_batching(engine):
        return 1
    value = engine.max_batch
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(f"engine {name}: max_batch must be an integer >= 1")
    return value


def live_settings(engine: Engine) -> dict[str, int | float]:
    """The settings ``engine`` suggests for live sessions (empty when it suggests none);
    `EngineConfigError` for a field outside `LIVE_SETTING_FIELDS` or a value that is not
    a finite number (at the server's start-up)."""
    if not isinstance(engine, SupportsLiveSettings):
        return {}
    settings = dict(engine.live_settings)
    for key, value in settings.items():
        if key not in LIVE_SETTING_FIELDS:
            raise EngineConfigError(
                f"engine {engine.name}: live_settings may name "
                f"{', '.join(sorted(LIVE_SETTING_FIELDS))}, not {key!r}"
            )
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise EngineConfigError(
                f"engine {engine.name}: live_settings[{key!r}] must be a finite number"
            )
    return settings


def live_input_chunk_frames(engine: Engine) -> int | None:
    """The chunk length ``engine`` suggests for live sessions that follow an input video
    (`SupportsLiveInputChunk`), None when it suggests none; `EngineConfigError` for
    anything but a positive whole number, or one longer than its ``max_chunk_frames``
    (at the server's start-up)."""
    if not isinstance(engine, SupportsLiveInputChunk):
        return None
    value = engine.live_input_chunk_frames
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(
            f"engine {engine.name}: live_input_chunk_frames must be a positive integer, "
            f"got {value!r}"
        )
    longest = max_chunk_frames(engine)
    if longest is not None and value > longest:
        raise EngineConfigError(
            f"engine {engine.name}: live_input_chunk_frames {value} is more than its "
            f"max_chunk_frames {longest}"
        )
    return value


def missing_members(obj: object, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks, in the order the Protocol declares
    them: what ``isinstance(obj, protocol)`` found wanting, for an error message."""
    members: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        for name in (*getattr(cls, "__annotations__", {}), *vars(cls)):
            if not name.startswith("_"):
                members[name] = None
    return [name for name in members if not hasattr(obj, name)]
