"""A procedural engine: the server's test double and transport benchmark.

It behaves like a diffusion model from the server's point of view (a number
of blocking "denoising steps" per chunk, each preceded by a checkpoint; an
optional delay per step to stand in for GPU time; interactions blended over
chunks) but renders a cheap moving pattern whose colours follow the prompt,
so an interaction visibly changes the picture. Faults can be injected to test
the server: ``fail_at_chunk`` raises while generating that chunk,
``hang_at_chunk`` stops making progress there (while still honouring
cancellation), and ``block_at_chunk`` blocks there without a checkpoint, as a
hung CUDA kernel would: nothing reaches it until the engine releases it (`Blocks`,
at the engine's close, or a test's ``engine.blocks.release()``), or until
``block_seconds`` have passed (`BLOCK_SECONDS_MAX` when not given): a kernel that hangs
for a while, then returns. Every block ends by itself, so that no client of a synthetic
server can pin a thread for good, and a long run (the soak) can block many sessions
without piling up threads that never end. All four are engine args (every session) and
``extra_params`` of a ``session.start`` (that session alone), so a soak can mix
faulty sessions with healthy ones on one server.

``audio_tone`` (Hz) makes it an engine with sound (`interfaces.SupportsAudio`): a sine at
half scale, mono, at ``audio_sample_rate`` (48000 by default), continuous across chunks
(sample n of the stream is ``0.5 * sin(2 pi f n / rate)``), each chunk's samples exactly
its frames' duration. Known to the sample, so a test can check the sound end to end on
a CPU: its count, its phase (no drift), its correlation after the AAC round trip.

It takes input video (`interfaces.SupportsVideoInput`), so that the server's video in can
be exercised without a model (the fuzz, the soak, the tests): a session with
``input_video`` gets a stream that follows its input (`interfaces.FollowsInput`), each
output frame its input frame blended with the pattern by the request's ``strength``
(0: the input exactly; 1: the pattern exactly, as without input). Sound, faults and
interactions are the same as without input.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping

import attrs
import numpy as np

from trio_vstream.engines.args import parse_number_arg, reject_unknown_args
from trio_vstream.engines.contract import (
    Checkpoint,
    Chunk,
    EngineConfigError,
    EngineError,
    GenerationRequest,
    InvalidRequestError,
    PromptChange,
)
from trio_vstream.engines.transitions import PromptSchedule
from trio_vstream.logsafe import get_logger
from trio_vstream.values import AUDIO_SAMPLE_RATES, VideoDefaults, audio_samples_through

logger = get_logger(__name__)

_HANG_POLL_SECONDS = 0.005
BLOCK_SECONDS_MAX = 60.0
"""The longest ``block_seconds``, and how long a block lasts without it: longer than
any stall or close timeout worth testing, short enough that a blocked thread of a
client's choosing always ends."""
_PHASE_LEVELS = 256
"""Phase steps per band cycle: finer than 8-bit colour can show."""
_BLEND_LEVELS = 256
"""Steps of ``strength`` in the blend of input and pattern: integer weights, so that
strength 0 gives the input and 1 the pattern exactly, byte for byte."""


def _phase_index(cycles: np.ndarray) -> np.ndarray:
    """Phase in cycles -> table index in 0.._PHASE_LEVELS-1 (wrapping)."""
    return np.round(np.asarray(cycles) * _PHASE_LEVELS).astype(np.int64) % _PHASE_LEVELS


@attrs.frozen(kw_only=True)
class SyntheticSettings:
    steps: int = 4
    step_delay: float = 0.0
    chunk_frames: int = 8
    fail_at_chunk: int | None = None
    hang_at_chunk: int | None = None
    block_at_chunk: int | None = None
    block_seconds: float | None = None
    """How long a ``block_at_chunk`` block lasts at most (None: `BLOCK_SECONDS_MAX`),
    unless the engine releases it first."""
    concurrency: int | None = None
    audio_tone: float | None = None
    """Hz of the sine the engine sounds; None (the default) makes no sound."""
    audio_sample_rate: int = 48000


def parse_settings(args: Mapping[str, str]) -> SyntheticSettings:
    """Turn ``--engine-arg`` strings into settings, naming any bad one."""
    reject_unknown_args("synthetic", args, (f.name for f in attrs.fields(SyntheticSettings)))
    values: dict[str, object] = {}
    for name, raw in args.items():
        if name == "step_delay":
            values[name] = parse_number_arg("synthetic", name, raw, float, minimum=0)
        elif name == "block_seconds":
            value = parse_number_arg(
                "synthetic", name, raw, float, minimum=0, maximum=BLOCK_SECONDS_MAX
            )
            if value == 0:
                raise EngineConfigError(f"synthetic engine: {name} must be > 0, got {raw}")
            values[name] = value
        elif name == "audio_tone":
            values[name] = parse_number_arg("synthetic", name, raw, float, minimum=1)
        elif name == "audio_sample_rate":
            rate = parse_number_arg("synthetic", name, raw, int, minimum=1)
            if rate not in AUDIO_SAMPLE_RATES:
                raise EngineConfigError(
                    f"synthetic engine: {name} must be one of {sorted(AUDIO_SAMPLE_RATES)}, "
                    f"got {raw}"
                )
            values[name] = rate
        elif name == "concurrency":
            # 0 means no limit, as in "any number of steps at once".
            values[name] = parse_number_arg("synthetic", name, raw, int, minimum=0) or None
        else:
            minimum = 0 if name.endswith("_at_chunk") else 1
            values[name] = parse_number_arg("synthetic", name, raw, int, minimum=minimum)
    # Each value has its field's type, parsed above by name: a dict cannot say so.
    settings = SyntheticSettings(**values)  # type: ignore[arg-type]
    tone = settings.audio_tone
    if tone is not None and tone >= settings.audio_sample_rate / 2:
        raise EngineConfigError(
            f"synthetic engine: audio_tone must be below half the sample rate "
            f"({settings.audio_sample_rate / 2:g} Hz), got {tone:g}"
        )
    return settings


_FAULTS = ("fail_at_chunk", "hang_at_chunk", "block_at_chunk")
"""The chunk indices a session may override through ``extra_params``."""


def session_settings(settings: SyntheticSettings, request: GenerationRequest) -> SyntheticSettings:
    """The engine's settings with the request's fault injections applied: the chunk
    indices, and ``block_seconds``, a number in (0, `BLOCK_SECONDS_MAX`].

    Other ``extra_params`` are ignored: this engine stands in for any model, so a
    request meant for another one still streams here.
    """
    faults: dict[str, int | float] = {}
    for name in _FAULTS:
        value = request.extra_params.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRequestError(f"extra_params.{name} must be an integer >= 0, got {value!r}")
        faults[name] = value
    seconds = request.extra_params.get("block_seconds")
    if seconds is not None:
        number = not isinstance(seconds, bool) and isinstance(seconds, int | float)
        if not number or not 0 < seconds <= BLOCK_SECONDS_MAX:  # NaN fails the comparison
            raise InvalidRequestError(
                f"extra_params.block_seconds must be a number > 0 and <= {BLOCK_SECONDS_MAX:g}, "
                f"got {seconds!r}"
            )
        faults["block_seconds"] = float(seconds)
    # The chunk indices are ints and block_seconds a float: a dict cannot say which.
    return attrs.evolve(settings, **faults)  # type: ignore[arg-type]


def blend(source: np.ndarray, pattern: np.ndarray, strength: float) -> np.ndarray:
    """``source`` moved towards ``pattern`` by ``strength`` in [0, 1] (both uint8 of one
    shape): in `_BLEND_LEVELS` integer steps, rounded, so 0 is ``source`` and 1 is
    ``pattern`` exactly."""
    weight = round(min(max(strength, 0.0), 1.0) * _BLEND_LEVELS)
    if weight == 0:
        return source
    if weight == _BLEND_LEVELS:
        return pattern
    # uint16 holds 255 * 256 + 128 and stays half the size of float32.
    mixed = source.astype(np.uint16) * (_BLEND_LEVELS - weight)
    mixed += pattern.astype(np.uint16) * weight
    mixed += _BLEND_LEVELS // 2
    mixed >>= 8
    return mixed.astype(np.uint8)


def prompt_colour(prompt: str) -> np.ndarray:
    """A stable, saturated RGB colour for a prompt (float32, 0..255)."""
    digest = hashlib.sha256(prompt.strip().lower().encode()).digest()
    hue = digest[0] / 256.0
    # HSV with full saturation and value, so different prompts look different.
    sector = hue * 6.0
    x = 1.0 - abs(sector % 2.0 - 1.0)
    rgb = [(1, x, 0), (x, 1, 0), (0, 1, x), (0, x, 1), (x, 0, 1), (1, 0, x)][int(sector) % 6]
    return np.array(rgb, dtype=np.float32) * 255.0


class Blocks:
    """Where ``block_at_chunk`` streams wait: an event the engine owns, so that a test
    releases them when it chooses and the engine's close releases them for good (no
    thread of a finished test or server is left waiting). A block with a timeout
    (``block_seconds``) also ends by itself."""

    def __init__(self) -> None:
        self._released = threading.Event()
        self._changed = threading.Condition()
        self.waiting = 0
        """Streams blocked now."""

    def block(self, timeout: float | None = None) -> None:
        """Wait, in the engine's thread, until released or ``timeout`` seconds have passed:
        no checkpoint, no cancellation."""
        with self._changed:
            self.waiting += 1
            self._changed.notify_all()
        try:
            self._released.wait(timeout)
        finally:
            with self._changed:
                self.waiting -= 1
                self._changed.notify_all()

    def release(self) -> None:
        """Release every blocked stream, and those that reach their block later."""
        self._released.set()

    def wait_blocked(self, count: int = 1, timeout: float | None = None) -> bool:
        """Block (a test, in a thread) until ``count`` streams are blocked at once."""
        with self._changed:
            return self._changed.wait_for(lambda: self.waiting >= count, timeout)


class SyntheticStream:
    """One session's frames; for a request with ``input_video``, also `FollowsInput`:
    `next_chunk` then needs the frames `feed_input` handed over just before (an
    `EngineError` without them, or with the wrong shape)."""

    def __init__(
        self,
        request: GenerationRequest,
        settings: SyntheticSettings,
        blocks: Blocks | None = None,
    ) -> None:
        self._request = request
        self._settings = settings
        self._blocks = blocks or Blocks()
        self._schedule = PromptSchedule(request.prompt)
        self._next_index = 0
        self._frames_done = 0
        self._fed: np.ndarray | None = None
        """The next chunk's input frames (`feed_input`), for a session with input video."""
        self._closed = threading.Event()
        self.seed = request.seed if request.seed is not None else 0
        self._phase = (self.seed % 997) / 997.0
        height, width = request.height, request.width
        # The bands' phase at a pixel is 1.5 * x + 1.5 * y cycles (x, y in 0..1), quantised
        # to _PHASE_LEVELS steps per cycle and split into a column part and a row part, so
        # that a frame is a gather of whole rows from a small table (see `_render`).
        self._column_phase = _phase_index(np.linspace(0.0, 1.5, width))
        self._row_phase = _phase_index(np.linspace(0.0, 1.5, height))

    def interact(self, change: PromptChange) -> None:
        self._schedule.push(change)

    @property
    def next_chunk_frames(self) -> int:
        """The next chunk's frame count; 0 once the video is complete (`FollowsInput`)."""
        remaining = self._request.num_frames - self._frames_done
        return max(0, min(self._settings.chunk_frames, remaining))

    def feed_input(self, frames: np.ndarray) -> None:
        """The next chunk's input (`FollowsInput`): (next_chunk_frames, H, W, 3) uint8.
        Refused (`EngineError`) for a session without input video or another shape."""
        request = self._request
        if request.input_video is None:
            raise EngineError("synthetic engine: input frames fed to a session without input_video")
        expected = (self.next_chunk_frames, request.height, request.width, 3)
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
            raise EngineError(
                f"synthetic engine: input frames must be a uint8 array, got "
                f"{getattr(frames, 'dtype', type(frames).__name__)}"
            )
        if frames.shape != expected:
            raise EngineError(
                f"synthetic engine: input frames of shape {frames.shape}, expected {expected}"
            )
        self._fed = frames

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        remaining = self._request.num_frames - self._frames_done
        if remaining <= 0:
            return None
        index = self._next_index
        settings = self._settings
        fed, self._fed = self._fed, None
        if self._request.input_video is not None and fed is None:
            raise EngineError(f"synthetic engine: no input frames fed for chunk {index}")
        if settings.block_at_chunk == index:
            # Stuck outside any checkpoint until released, or block_seconds have passed.
            self._blocks.block(settings.block_seconds or BLOCK_SECONDS_MAX)
        conditioning = self._schedule.next_conditioning()
        for step in range(settings.steps):
            checkpoint()
            if settings.hang_at_chunk == index:
                while True:  # no progress, but still cancellable
                    checkpoint.check_cancelled()
                    time.sleep(_HANG_POLL_SECONDS)
            if settings.fail_at_chunk == index and step == settings.steps - 1:
                raise EngineError(f"synthetic engine failure at chunk {index} (fail_at_chunk)")
            if settings.step_delay:
                time.sleep(settings.step_delay)
        checkpoint()
        count = min(settings.chunk_frames, remaining)
        colour = sum(
            (weight * prompt_colour(prompt) for prompt, weight in conditioning.mix),
            start=np.zeros(3, dtype=np.float32),
        )
        input_video = self._request.input_video
        if fed is not None and input_video is not None:
            if len(fed) != count:  # a feed and its chunk must agree
                raise EngineError(f"synthetic engine: {len(fed)} input frames for {count}")
            strength = input_video.strength
            # At strength 0 the pattern is not even drawn: the input is the output.
            pattern = self._render(self._frames_done, count, colour) if strength > 0 else fed
            frames = blend(fed, pattern, strength)
        else:
            frames = self._render(self._frames_done, count, colour)
        audio = self._sound(self._frames_done, count)
        self._frames_done += count
        self._next_index += 1
        chunk = conditioning.chunk(frames, index)
        return attrs.evolve(chunk, audio=audio) if audio is not None else chunk

    def _sound(self, first: int, count: int) -> np.ndarray | None:
        """Frames ``first`` .. ``first + count``'s stretch of the tone: samples
        ``audio_samples_through(first)`` up to ``audio_samples_through(first + count)``."""
        tone, rate = self._settings.audio_tone, self._settings.audio_sample_rate
        if tone is None:
            return None
        fps = self._request.fps
        begin = audio_samples_through(first, rate, fps)
        end = audio_samples_through(first + count, rate, fps)
        # The phase in whole cycles is dropped in integers first: exact however long.
        n = np.arange(begin, end, dtype=np.int64)
        phase = (n * round(tone * 1000) % (rate * 1000)) / (rate * 1000)
        return (0.5 * np.sin(2.0 * np.pi * phase)).astype(np.float32)

    def _render(self, first: int, count: int, colour: np.ndarray) -> np.ndarray:
        """Diagonal bands drifting at 0.5 cycles per second, in the prompt's colour.

        Cheap on purpose: this engine stands in for a model whose work happens on a GPU
        (the step delays), so its CPU cost must not be what a benchmark measures. Evaluating
        a sine per pixel per frame cost ~4 ms of CPU per 832x480 frame, 60 ms per 16-frame
        chunk, which on a small machine starved the server's event loop and delayed
        stops by a whole render. Here the colour of phase k is a 256-entry table; `rows[c]`
        is the row whose first pixel has phase c; a frame is `rows` gathered by each row's
        phase plus the frame's drift: a row-wise copy, ~0.5 ms per 832x480 frame.
        """
        levels = np.arange(_PHASE_LEVELS)
        table = (
            (0.5 + 0.5 * np.sin(2.0 * np.pi * levels / _PHASE_LEVELS))[:, None] * colour
        ).astype(np.uint8)
        rows = table[(self._column_phase[None, :] + levels[:, None]) % _PHASE_LEVELS]
        times = (first + np.arange(count)) / self._request.fps
        drift = _phase_index(self._phase - 0.5 * times)
        return rows[(self._row_phase[None, :] + drift[:, None]) % _PHASE_LEVELS]

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()


class SyntheticEngine:
    """Engine object; see the module docstring for the knobs."""

    name = "synthetic"
    video_defaults = VideoDefaults(width=256, height=256, fps=24, num_frames=48)
    interaction_kinds: frozenset[str] = frozenset({"prompt"})
    """Prompts only: the colour follows the prompt, and there is no camera to move."""
    video_input = True
    """Its streams follow an input video (`interfaces.SupportsVideoInput`): see the
    module's docstring."""

    def __init__(self, settings: SyntheticSettings | None = None) -> None:
        self.settings = settings or SyntheticSettings()
        self.max_concurrent_steps = self.settings.concurrency
        tone = self.settings.audio_tone is not None
        self.audio_sample_rate: int | None = self.settings.audio_sample_rate if tone else None
        """Sound only with ``audio_tone`` (`interfaces.SupportsAudio`)."""
        self.audio_channels = 1
        self.max_chunk_frames = self.settings.chunk_frames
        """Every chunk but the last of a session is this long (`interfaces.SupportsChunkFrames`)."""
        self.blocks = Blocks()
        """Where ``block_at_chunk`` streams wait; released at `close`."""

    def open_stream(self, request: GenerationRequest) -> SyntheticStream:
        if request.image is not None:
            logger.info("synthetic engine ignores image_reference (request %s)", request.request_id)
        return SyntheticStream(request, session_settings(self.settings, request), self.blocks)

    def close(self) -> None:
        self.blocks.release()


def create_engine(*, device: str = "auto", **engine_args: str) -> SyntheticEngine:
    """Factory for ``--engine synthetic``; the device is irrelevant here."""
    del device
    return SyntheticEngine(parse_settings(engine_args))
