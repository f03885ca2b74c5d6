"""The shapes engine itself: its settings, the loaded model, and each session's stream.

`ShapesEngine` holds the model every stream shares (and runs the rows of several
sessions as one batch); `ShapesStream` is one session's video, chunk after chunk, each
conditioned on the last frame before it. Per stream: slots the prompt leaves out are
drawn once from the seed (a request without a seed gets a random one, logged), so an
interaction that names only a new colour keeps the rest; so is where the object starts
when there is no reference image (given to the model as a position hint), away from the
edges so that the first frame shows it whole (`start_position`). The conditioning of
each chunk is the ``PromptSchedule`` mix of prompt embeddings, weighted as the
reference's transition rules say, with a paced session's steers integrated over the
chunk's action window (the rules: `trio_vstream.engines.shapes.steering`); its frames
become pixels on the model's device (`trio_vstream.engines.shapes.pixels`). A stream that
follows an input video moves each frame toward the input's coloured region
(`trio_vstream.engines.shapes.following`).
"""

from __future__ import annotations

import random
import secrets
import threading
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Final

import attrs
import numpy as np
import torch

from trio_vstream.engines.args import parse_bool_arg, parse_number_arg, reject_unknown_args
from trio_vstream.engines.contract import (
    Checkpoint,
    Chunk,
    DeferredFrames,
    EngineConfigError,
    EngineError,
    GenerationRequest,
    InvalidRequestError,
    PromptChange,
    batched,
)
from trio_vstream.engines.devices import resolve_device
from trio_vstream.engines.shapes.following import InputFollower, region_centres
from trio_vstream.engines.shapes.pixels import (
    Drawing,
    Picture,
    ShapesFrames,
    decode_frames,
    image_to_context,
    read_drawing,
)
from trio_vstream.engines.shapes.steering import (
    WindowChange,
    camera_motion,
    conditioning_key,
    integrated_motion,
    window_shares,
)
from trio_vstream.engines.shapes.view import ObjectView, outline
from trio_vstream.engines.transitions import PromptSchedule
from trio_vstream.logsafe import get_logger
from trio_vstream.models.shapes.model import (
    ShapesDenoiser,
    WeightsError,
    load_weights,
    slot_vectors,
)
from trio_vstream.models.shapes.render import NATIVE_SIZE, SIZE_RADII, position_hint
from trio_vstream.models.shapes.sampler import StepInput, denoise, sample
from trio_vstream.models.shapes.vocab import (
    SLOT_NAMES,
    SeedDefaults,
    Slots,
    fill_slots,
    parse_prompt,
)
from trio_vstream.values import VideoDefaults

# The engine's logger: these are its lines, under the name they had as one module.
logger = get_logger("trio_vstream.engines.shapes")

_MAX_STEPS = 200


def default_weights_path() -> Path:
    """The checkpoint shipped as package data."""
    return Path(str(resources.files("trio_vstream.models.shapes") / "weights.safetensors"))


@attrs.frozen(kw_only=True)
class ShapesSettings:
    """``--engine-arg`` options; requests can override steps, guidance and shift."""

    weights: Path | None = None
    """A checkpoint to load instead of the shipped one."""
    steps: int = 4
    """Denoising steps per chunk when the request has no ``num_inference_steps``."""
    guidance_scale: float = 1.25
    """Classifier-free guidance when the request has none; 1 turns the extra branch off."""
    flow_shift: float = 1.0
    """Timestep shift when the request has no ``flow_shift``."""
    threads: int | None = None
    """torch CPU threads (default: torch's own choice)."""
    max_batch: int = 8
    """Sessions whose steps run as one batch; 1 steps each session alone. On a 2-core
    CPU a batch of 8 makes about twice the frames per second of single steps."""
    defer_decode: bool = True
    """Return each chunk after the first before its decode (the resize to the requested
    size and the conversion to uint8), as `DeferredFrames` the server decodes in its
    encode thread while the next chunk is denoised; 0 decodes in ``next_chunk``. The
    first chunk is always decoded in ``next_chunk``: its decode then does not compete
    with the second chunk's steps. The frames are the same either way (tested)."""


def parse_settings(args: Mapping[str, str]) -> ShapesSettings:
    """Turn ``--engine-arg`` strings into settings, naming any bad one."""
    reject_unknown_args("shapes", args, (field.name for field in attrs.fields(ShapesSettings)))
    values: dict[str, object] = {}
    for name, raw in args.items():
        if name == "weights":
            values[name] = Path(raw).expanduser()
        elif name == "steps":
            values[name] = parse_number_arg("shapes", name, raw, int, minimum=1, maximum=_MAX_STEPS)
        elif name == "defer_decode":
            values[name] = parse_bool_arg("shapes", name, raw)
        elif name in ("threads", "max_batch"):
            values[name] = parse_number_arg("shapes", name, raw, int, minimum=1)
        elif name == "flow_shift":
            values[name] = parse_number_arg("shapes", name, raw, float, minimum=1e-3)
        else:
            values[name] = parse_number_arg("shapes", name, raw, float, minimum=0.0)
    # Each value has its field's type, parsed above by name: a dict cannot say so.
    return ShapesSettings(**values)  # type: ignore[arg-type]


MAX_REPORTED_WORDS: Final = 4096
"""How many unknown prompt words an engine remembers having logged (see
`ShapesEngine.report_unknown`)."""


LIVE_INPUT_CHUNK_FRAMES: Final = 4
"""The chunk length suggested for live sessions that follow a camera: 4 frames wait 125 ms
for their window of input at 24 fps, against 292 ms for the model's 8, and camera to
frame in the player fell from 505 to 340 ms (bench ``camera_in``, one thread, 3 runs
each). The model still computes its whole 8-frame chunk for each and keeps 4, so a
session makes half the frames a second (a chunk in 62 to 72 ms on one thread, 2.3 to
2.7 times real time); 2 frames gained 80 ms more for half again, too little headroom on
a shared 2-core machine."""


class ShapesEngine:
    """The loaded model, shared by every stream of the server."""

    name = "shapes"
    video_defaults = VideoDefaults(width=256, height=256, fps=24, num_frames=48)
    live_settings: Mapping[str, int | float] = MappingProxyType(
        {"num_inference_steps": 3, "guidance_scale": 1.0}
    )
    """For live sessions (`interfaces.SupportsLiveSettings`): 3 steps without the guidance
    branch make a chunk in about 60% of the default's time (83 against 134 ms for 8
    frames at 256x256 on one thread of the development machine), and still meet every
    quality bar of the model card (docs/shapes.md: shape 91.7% against 93.8% on the
    tune split, the rest unchanged)."""
    max_concurrent_steps: int | None = 1
    """One step at a time: on CPU the cores are shared anyway, on CUDA one GPU."""
    interaction_kinds: frozenset[str] = frozenset({"prompt", "camera"})
    """Prompts, and camera velocities as steering (see `camera_motion`)."""
    video_input = True
    """Its streams follow an input video (`interfaces.SupportsVideoInput`): the object goes
    where the input's coloured region is (`trio_vstream.engines.shapes.following`)."""

    def __init__(
        self, model: ShapesDenoiser, device: torch.device, settings: ShapesSettings
    ) -> None:
        self.model = model
        self.device = device
        self.settings = settings
        self.max_batch = settings.max_batch
        self.max_chunk_frames: int = model.config.chunk_frames
        """A session may ask for shorter chunks (``extra_params.chunk_frames``), never
        longer (`interfaces.SupportsChunkFrames`)."""
        self.live_input_chunk_frames: int = min(LIVE_INPUT_CHUNK_FRAMES, self.max_chunk_frames)
        """For a live session that follows a camera (`interfaces.SupportsLiveInputChunk`):
        see `LIVE_INPUT_CHUNK_FRAMES`."""
        self._reported_words: set[str] = set()
        self._lock = threading.Lock()
        with torch.inference_mode():
            empty = Slots()
            self.null_embedding = self.embed(empty)

    def embed(self, slots: Slots) -> torch.Tensor:
        """The prompt embedding (E,) of some slots; unspecified slots are "null"."""
        indices = {
            name: torch.tensor([-1 if i is None else i], device=self.device)
            for name, i in zip(SLOT_NAMES, slots.indices(), strict=True)
        }
        with torch.inference_mode():
            return self.model.embed(slot_vectors(indices))[0]

    def report_unknown(self, words: tuple[str, ...], request_id: str) -> None:
        """Log each word the parser did not know once per engine, not once per prompt.

        The words come from clients, so what is remembered is bounded
        (`MAX_REPORTED_WORDS`): a client sending a new made-up word in every prompt
        would otherwise grow this set for as long as the server runs. Past the bound,
        a word is logged again each time it comes, one line per prompt as before.
        """
        with self._lock:
            new = [w for w in dict.fromkeys(words) if w not in self._reported_words]
            room = MAX_REPORTED_WORDS - len(self._reported_words)
            self._reported_words.update(new[: max(room, 0)])
        if new:
            logger.info(
                "shapes engine: ignoring unknown prompt word(s) %s (request %s)",
                ", ".join(repr(w) for w in new),
                request_id,
            )

    def run_batch(self, steps: Sequence[StepInput]) -> list[torch.Tensor | Exception]:
        """One denoising step for the rows of several sessions, as one model call.

        A row whose prediction is not finite fails alone (its session ends with the
        error, the others go on); the model itself is shared, so anything else that
        goes wrong fails the whole batch.
        """
        with torch.inference_mode():
            results: list[torch.Tensor | Exception] = list(denoise(self.model, steps))
        for i, x0 in enumerate(results):
            assert isinstance(x0, torch.Tensor)
            if not bool(torch.isfinite(x0).all()):
                results[i] = EngineError("the shapes model predicted non-finite values")
        return results

    def warm_up(self) -> None:
        """One tiny sampling pass, so the first real chunk does not pay for kernel setup."""
        config = self.model.config
        size = config.native_size
        with torch.inference_mode():
            for guided in (False, True):
                sample(
                    self.model,
                    cond=self.null_embedding[None],
                    uncond=self.null_embedding[None] if guided else None,
                    context=torch.zeros(1, 3, size, size, device=self.device),
                    context_mask=torch.zeros(1, device=self.device),
                    generator=torch.Generator(self.device).manual_seed(0),
                    steps=1,
                    guidance_scale=2.0 if guided else 1.0,
                )

    def open_stream(self, request: GenerationRequest) -> ShapesStream:
        return ShapesStream(self, request)

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class ShapesStream:
    """One session's video: chunk after chunk, each conditioned on the last frame before it."""

    def __init__(self, engine: ShapesEngine, request: GenerationRequest) -> None:
        if request.lora:
            raise InvalidRequestError("the shapes engine has no LoRA support")
        self._chunk_frames = _chunk_frames_of(
            request.extra_params, engine.model.config.chunk_frames
        )
        ignored = {
            "guidance_scale_2": request.sampling.guidance_scale_2,
            "true_cfg_scale": request.sampling.true_cfg_scale,
            "boundary_ratio": request.sampling.boundary_ratio,
            "quality": request.quality,
        }
        for name, value in ignored.items():
            if value is not None:
                logger.info("shapes engine ignores %s (request %s)", name, request.request_id)
        settings = engine.settings
        self._engine = engine
        self._request = request
        self._steps = request.num_inference_steps or settings.steps
        guidance = request.guidance_scale
        self._guidance = settings.guidance_scale if guidance is None else guidance
        shift = request.sampling.flow_shift
        self._shift = shift if shift else settings.flow_shift
        if request.seed is None:
            self.seed = secrets.randbits(31)
            logger.info("shapes engine: request %s uses seed %d", request.request_id, self.seed)
        else:
            self.seed = request.seed
        self._defaults = SeedDefaults.from_seed(self.seed)
        # The schedule blends conditioning keys: a prompt and the motion a camera set for
        # it (see `conditioning_key`), so that steering blends and reports event ids like
        # prompts.
        self._prompt = request.prompt
        self._steered_motion: str | None = None
        self._schedule = PromptSchedule(conditioning_key(request.prompt, None))
        # The window of the next chunk (see `window_shares`): each change queued for
        # it, with its key and offset. Taken with the schedule's queue under one lock, so
        # that a change `interact` queues from the event loop's thread is in both or in
        # neither when `next_chunk` takes them.
        self._window_lock = threading.Lock()
        self._window: list[WindowChange] = []
        self._last_mix: tuple[tuple[str, float], ...] = (
            (conditioning_key(request.prompt, None), 1.0),
        )
        self._prompt_motions: dict[str, str] = {}
        self._embeddings: dict[str, torch.Tensor] = {}
        self._embedding(
            conditioning_key(request.prompt, None)
        )  # unknown words are logged at the start
        device = engine.device
        self._uncond = engine.null_embedding
        if request.negative_prompt:
            negative = parse_prompt(request.negative_prompt)
            engine.report_unknown(negative.unknown_words, request.request_id)
            self._uncond = engine.embed(negative.slots)
        size = engine.model.config.native_size
        self._context = torch.zeros(1, 3, size, size, device=device)
        self._context_mask = torch.zeros(1, device=device)
        self._hint: torch.Tensor | None = None
        if request.image is not None:
            self._context = image_to_context(request.image, size, device)
            self._context_mask = torch.ones(1, device=device)
        else:
            # Where the object starts: drawn from the seed, like the slots a prompt omits.
            start = torch.tensor(start_position(self.seed, size), device=device)
            self._hint = position_hint(start[:1], start[1:], size)
        self._generator = torch.Generator(device).manual_seed(self.seed)
        self._frames_done = 0
        self._next_index = 0
        # Following an input video (`interfaces.FollowsInput`): the next chunk's region
        # centres, in native pixels, from `feed_input`.
        self._follower: InputFollower | None = None
        self._targets: np.ndarray | None = None
        if request.input_video is not None:
            strength = request.input_video.strength
            if not 0.0 <= strength <= 1.0:
                raise InvalidRequestError(
                    f"input_video.strength must be in [0, 1], got {strength!r}"
                )
            self._follower = InputFollower(strength, size)
        # Where the screen shows the object (`ObjectView`): whole, never across two edges.
        self._view = ObjectView(size)
        self._drawing: Drawing | None = None

    @property
    def next_chunk_frames(self) -> int:
        """How many frames the next chunk has (`interfaces.FollowsInput`); 0 once the
        video is complete."""
        return max(0, min(self._chunk_frames, self._request.num_frames - self._frames_done))

    def feed_input(self, frames: np.ndarray) -> None:
        """The next chunk's input frames (`interfaces.FollowsInput`), read at once: the
        stream keeps where each frame's coloured region is, not the frames."""
        if self._follower is None:
            raise EngineError("feed_input: this session's request has no input_video")
        request = self._request
        expected = (self.next_chunk_frames, request.height, request.width, 3)
        shape = getattr(frames, "shape", None)
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or shape != expected:
            got = f"{type(frames).__name__} {shape} {getattr(frames, 'dtype', '')}".rstrip()
            raise EngineError(
                f"input frames must be a {expected} uint8 array (the next chunk's frames "
                f"at the request's size), got {got}"
            )
        self._targets = region_centres(frames) * self._engine.model.config.native_size

    def slots_for(self, prompt: str) -> Slots:
        """A prompt's slots, completed with this stream's seed defaults."""
        parsed = parse_prompt(prompt)
        self._engine.report_unknown(parsed.unknown_words, self._request.request_id)
        for note in parsed.notes:
            logger.info("shapes engine: %s (request %s)", note, self._request.request_id)
        return fill_slots(parsed.slots, self._defaults)

    def _embedding(self, key: str) -> torch.Tensor:
        if key not in self._embeddings:
            motion, _, prompt = key.partition("|")
            slots = self.slots_for(prompt)
            if motion:
                slots = attrs.evolve(slots, motion=motion)
            logger.debug("shapes engine: %r -> %s", key, slots.describe())
            self._embeddings[key] = self._engine.embed(slots)
        return self._embeddings[key]

    def interact(self, change: PromptChange) -> None:
        """Queue a prompt and/or a steering camera for the next chunk.

        A camera sets the motion slot, and keeps it through later prompts until one
        names a motion of its own; a camera-only change switches at the next chunk
        (there is no prompt to blend from, and steering should answer at once) unless
        the client asked for a transition.
        """
        prompt = self._prompt if change.prompt is None else change.prompt
        motion = self._steered_motion
        if change.prompt is not None and parse_prompt(change.prompt).slots.motion is not None:
            motion = None  # the new prompt says how the object moves
        if change.camera is not None:
            motion = camera_motion(change.camera)
        transition = change.transition_chunks
        if change.prompt is None and transition is None:
            transition = 0
        key = conditioning_key(prompt, motion)
        with self._window_lock:
            self._schedule.push(PromptChange(change.event_id, key, transition, change.camera))
            self._window.append(
                WindowChange(
                    key=key,
                    offset=change.window_offset,
                    steer=change.prompt is None and transition == 0,
                )
            )
        self._prompt, self._steered_motion = prompt, motion

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        request = self._request
        remaining = request.num_frames - self._frames_done
        if remaining <= 0:
            return None
        targets, self._targets = self._targets, None
        if self._follower is not None and targets is None:
            raise EngineError(
                "next_chunk: a session that follows an input video is fed each chunk's "
                "input (feed_input) before the chunk"
            )
        with self._window_lock:
            conditioning = self._schedule.next_conditioning()
            window, self._window = self._window, []
        mix = self._integrated(window, conditioning.mix)
        self._last_mix = conditioning.mix
        model = self._engine.model
        config = model.config
        with torch.inference_mode():
            cond = sum(
                (weight * self._embedding(key) for key, weight in mix),
                start=torch.zeros_like(self._uncond),
            )
            with batched(checkpoint, self._engine.run_batch) as step:
                x0 = sample(
                    model,
                    cond=cond[None],
                    uncond=self._uncond[None],
                    context=self._context,
                    context_mask=self._context_mask,
                    generator=self._generator,
                    steps=self._steps,
                    guidance_scale=self._guidance,
                    shift=self._shift,
                    hint=self._hint,
                    step=step,
                )
            size = config.native_size
            # A shorter chunk keeps the model's first frames and continues from the last
            # one kept: the model always generates its full chunk, so this buys latency
            # with throughput.
            kept = x0.view(config.chunk_frames, 3, size, size)[: self._chunk_frames]
            count = min(self._chunk_frames, remaining)
            if self._follower is not None and targets is not None:
                kept, self._context = self._follower.follow(kept[:count], targets)
            else:
                self._context = kept[-1:].clone()
            self._context_mask = torch.ones(1, device=kept.device)
            self._hint = None
            native = kept[:count]
            held = None
            if self._follower is not None and targets is not None and self._follower.gain > 0:
                held = np.isfinite(targets[:count]).all(axis=1)
            sampled = x0.view(config.chunk_frames, 3, size, size)
            picture = self._picture(native, sampled, held)
            frames: torch.Tensor | DeferredFrames
            if self._engine.settings.defer_decode and self._next_index > 0:
                # The next chunk is conditioned on the native frame kept above, never on
                # decoded pixels: the decode can wait for the server's encode thread. Not
                # the first chunk's: deferred, it would compete with the second chunk's
                # steps for the first picture (the time to first chunk), where eager it
                # has the machine to itself.
                frames = ShapesFrames(native, request.width, request.height, picture)
            else:
                checkpoint()  # the decode: draw (or resize) and convert
                frames = decode_frames(native, request.width, request.height, picture)
        index = self._next_index
        self._next_index += 1
        self._frames_done += count
        return conditioning.chunk(frames, index)

    def _picture(
        self, native: torch.Tensor, sampled: torch.Tensor, held: np.ndarray | None
    ) -> Picture | None:
        """What the chunk's frames show, to be drawn at the requested size: the model's
        drawing (its colours those of the whole chunk ``sampled``), and where the view
        puts its object (`ObjectView`; ``held``: the frames an input's region holds); None
        to resize the frames as they are (a size under the native one, or frames two
        colours do not explain).

        Read on the host: the view's choices are the host's (a few numbers a frame), and
        a CUDA chunk's native frames cross to it once here (100 kB; it waits for the
        chunk's sampling, which its decode would wait for anyway), the drawing's
        membership back (32 kB) to be drawn on the device.
        """
        request = self._request
        size = native.shape[-1]
        if request.width < size or request.height < size:
            return None
        cpu = torch.device("cpu")
        drawing = read_drawing(native.to(cpu), self._drawing, sampled.to(cpu))
        self._drawing = drawing
        if drawing is None:
            return None
        found = outline(drawing.membership.double().numpy())
        shown = self._view.place(found, held)
        shifts = np.where(np.isfinite(shown), shown - found.centres, 0.0)
        return Picture(drawing=drawing.to(native.device), shifts=shifts, windows=shown)

    def _integrated(
        self, window: Sequence[WindowChange], mix: tuple[tuple[str, float], ...]
    ) -> tuple[tuple[str, float], ...]:
        """The chunk's mix with the steers of its window integrated (a paced session's).

        ``mix`` is the schedule's: the last steer's key from the first frame. With steers
        placed in the window, the chunk takes the last steer's prompt with the motion
        `integrated_motion` gives (the last steer, unless the window ends still: then the
        window's net displacement, from `window_shares`); the next chunk goes on from
        ``mix``, the velocity in force at the window's end.
        """
        shares = window_shares(self._last_mix, window)
        if shares is None:
            return mix
        motions: dict[str, float] = {}
        for key, share in shares.items():
            motion = self._motion_of(key)
            motions[motion] = motions.get(motion, 0.0) + share
        last = window[-1].key
        prompt = last.partition("|")[2]
        return ((conditioning_key(prompt, integrated_motion(motions, self._motion_of(last))), 1.0),)

    def _motion_of(self, key: str) -> str:
        """The motion a conditioning key gives: its steer, else its prompt's or the seed's."""
        motion, _, prompt = key.partition("|")
        if motion:
            return motion
        if prompt not in self._prompt_motions:
            self._prompt_motions[prompt] = self.slots_for(prompt).motion or "still"
        return self._prompt_motions[prompt]

    def close(self) -> None:
        self._embeddings.clear()


START_MARGIN: Final = SIZE_RADII[-1] + 2.5
"""How far (native pixels, at the native size) the start position keeps from the edges.

The largest object's radius, plus one frame of motion (the model's first frame is one
step on from the start), plus a pixel and a half for anti-aliasing and the model's own
blur: so the first frame shows the object whole, never cut in two across the torus's
edges, whatever its size and motion."""


def start_position(seed: int, size: int) -> tuple[float, float]:
    """Where a stream's object starts (x, y in native pixels), drawn from its seed.

    Uniform over the square `START_MARGIN` in from the edges of the world. The world
    is a torus, so any position is valid to the model, but a start near an edge shows
    the first frames' object in pieces at opposite edges, which a viewer reads as two
    objects: the start is a choice of the engine's, and it chooses a whole object.
    """
    margin = START_MARGIN * size / NATIVE_SIZE
    rng = random.Random(f"shapes-start-{seed}")
    return rng.uniform(margin, size - margin), rng.uniform(margin, size - margin)


def _chunk_frames_of(extra_params: Mapping[str, object], native: int) -> int:
    """``extra_params.chunk_frames``: frames per chunk, 1 to the model's chunk (the default).

    The only extra parameter this engine takes; any other is named and refused.
    """
    unknown = sorted(str(name) for name in extra_params if name != "chunk_frames")
    if unknown:
        raise InvalidRequestError(
            f"the shapes engine takes only extra_params.chunk_frames, got {', '.join(unknown)}"
        )
    value = extra_params.get("chunk_frames", native)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= native:
        raise InvalidRequestError(
            f"extra_params.chunk_frames must be an integer from 1 to {native}, got {value!r}"
        )
    return value


def create_engine(*, device: str = "auto", **engine_args: str) -> ShapesEngine:
    """Factory for ``--engine shapes``: loads the weights (shipped or ``weights=PATH``)."""
    settings = parse_settings(engine_args)
    torch_device = resolve_device("shapes", device)
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    path = settings.weights or default_weights_path()
    try:
        model = load_weights(path, torch_device)
    except WeightsError as exc:
        raise EngineConfigError(f"shapes engine: {exc}") from None
    engine = ShapesEngine(model, torch_device, settings)
    engine.warm_up()
    logger.info(
        "shapes engine: %s on %s, %d steps, guidance %.1f",
        path,
        torch_device,
        settings.steps,
        settings.guidance_scale,
    )
    return engine
