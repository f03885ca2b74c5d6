"""Wan's video-to-video pipeline (``WanVideoToVideoPipeline``), one call a chunk on the
chunk's input frames.

A session that follows an input video (``input_video``) is fed each chunk's frames by the
server just before the chunk is made (`interfaces.FollowsInput`): as many as
``next_chunk_frames``, already at the video's size and frame rate. The pipeline's call is
exactly the transformation one chunk needs: it encodes its ``video`` with the VAE, noises
the latents to ``strength`` along the scheduler's own timesteps (the last
``int(num_inference_steps * strength)`` of them), denoises them with the prompt and
decodes as many frames as it was given. So each chunk is one call on that chunk's input,
made as the segment path makes a call (`segments.SegmentRun`: the engine's lock, the
session's LoRA, the prompt's embeddings blended while a transition runs, a fresh
scheduler, ``checkpoint()`` before the call and after each of its steps), and output
frame ``j`` is made from input frame ``j``.

Choices, each for a reason:

- A chunk is ``4n+1`` frames (what Wan's causal VAE encodes whole): the engine's
  ``segment_frames`` (default 17), or ``extra_params.num_frames_per_block`` latent frames
  (``n`` latent frames are ``4n-3`` frames; vllm-omni's name for a realtime block, which
  counts latent frames as the Self-Forcing models it serves do). The video's last chunk
  is what is left; when that is no ``4n+1``, its input is padded with its last frame up to
  one and the extra frames made are dropped, so every chunk has exactly the frames fed.
- Every chunk's noise comes from a generator seeded with the session's ``seed``, the same
  for every chunk (the segment path seeds ``seed + index``): the input carries the
  motion, and the same noise over the same picture keeps a still part of it still across
  a chunk boundary instead of re-rolling its details at each one.
- Chunks are independent calls: nothing but the input carries over from one to the next
  (no latents, no last frame), so a chunk boundary is where the output may change more
  than the input does; a lower ``strength`` or longer chunks make it smaller.
- A request without ``input_video`` is refused (``invalid_request``): the pipeline has
  nothing to start from, and making something up would be another model's job. So is a
  ``strength`` whose steps round to none (``int(steps * strength) == 0``), on which the
  call would fail.

Not served: other pipelines' video input (CogVideoX's, SkyReels-V2 DF's, AnimateDiff's),
refused at start-up (`DiffusersEngine`), and batching: the calls run one at a time under
the lock (``max_batch`` > 1 is ignored, as the engine logs; not tried batched).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from trio_vstream.engines.contract import EngineError
from trio_vstream.engines.diffusers._extra import COMMON, ExtraParams, Refused, whole
from trio_vstream.engines.diffusers._loading import checked_segment_frames, valid_frames
from trio_vstream.engines.diffusers._stream import to_pil
from trio_vstream.engines.diffusers.loops._protocol import Draft, InputLoop, Loop, Run
from trio_vstream.engines.diffusers.loops.segments import SegmentPlan, SegmentRun

if TYPE_CHECKING:
    from trio_vstream.engines.contract import Checkpoint, Chunk
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream

BLOCK = "num_frames_per_block"
"""The ``extra_params`` key that sets a request's chunk length, in latent frames."""

MAX_BLOCK = 21
"""The most latent frames a chunk may have: 81 frames, the length Wan 2.1 was trained on
(a chunk's activations grow with it; the server bounds the video, not its chunks)."""

block_latent_frames = whole(1, MAX_BLOCK)
"""``num_frames_per_block``'s check."""

EXTRA_PARAMS = ExtraParams(
    "Wan video-to-video",
    {**COMMON, BLOCK: block_latent_frames},
    consumed=frozenset({BLOCK}),
)
"""The common keys, and the chunk length: the engine's to honour, never the call's."""


@attrs.frozen(kw_only=True)
class FollowPlan:
    """A request's chunks: how long each is, and how far from its input it may go."""

    chunk_frames: int
    """Frames of every chunk but maybe the last, ``frame_step * n + 1``."""
    frame_step: int
    strength: float


class WanVideoToVideo:
    """Wan's video-to-video pipeline (`Loop`, `InputLoop`): one call a chunk, on its input."""

    name = "Wan video-to-video"
    batches = False
    """Its calls run alone under the lock (not tried batched)."""
    frame_continued = False
    """Each chunk starts from its own input: ``i2v_model`` is refused."""
    image_in_loop = False
    engine_set: tuple[str, ...] = ("strength",)
    """``input_video.strength`` sets it."""

    def recognises(self, info: PipelineInfo) -> bool:
        """A call whose frames are its input video's and that takes a ``strength``, on
        Wan's VAE (whose latent normalisation and frame counts the family assumes)."""
        vae = getattr(info.pipe, "vae", None)
        return (
            info.takes_video
            and "strength" in info.params
            and type(vae).__name__ == "AutoencoderKLWan"
        )

    def segment_frames(self, model: PipelineInfo, given: int | None, frame_step: int) -> int:
        """The default chunk: ``segment_frames``, ``4n+1`` (default 17)."""
        return checked_segment_frames(model, given, frame_step)

    def extra_params(self, model: PipelineInfo) -> ExtraParams:
        return EXTRA_PARAMS

    def plan(self, draft: Draft) -> FollowPlan | None:
        """The chunk length and the ``strength`` (set on the call); refuses a request
        without ``input_video`` and a strength that leaves no step."""
        request, model, problems = draft.request, draft.model, draft.problems
        if request.input_video is None:
            problems.append(
                f"{model.class_name} makes its video from an input video: "
                "session.start needs input_video"
            )
            return None
        chunk = draft.segment_frames
        if BLOCK in request.extra_params:
            # Consumed keys are checked (a bad value is a problem already) but not handed
            # on, so the value is read again here.
            try:
                block = block_latent_frames(BLOCK, request.extra_params[BLOCK], [model])
            except Refused:
                return None
            chunk = (block - 1) * draft.frame_step + 1
        call = draft.call_kwargs[model.role]
        steps = call.get("num_inference_steps", model.default("num_inference_steps"))
        strength = request.input_video.strength
        if isinstance(steps, int) and int(steps * strength) < 1:
            problems.append(
                f"input_video.strength {strength:g} with {steps} steps denoises in no step "
                f"(int(steps * strength) is 0): raise strength to {1 / steps:g} or more, "
                "or num_inference_steps"
            )
            return None
        call["strength"] = strength
        return FollowPlan(chunk_frames=chunk, frame_step=draft.frame_step, strength=strength)

    def start(self, stream: DiffusersStream, plan: FollowPlan) -> FollowRun:
        return FollowRun(stream, plan)

    def chunk_frames(self, run: Run, remaining: int) -> int:
        return _ours(run).chunk_frames(remaining)

    def feed(self, run: Run, frames: np.ndarray) -> None:
        _ours(run).feed(frames)


LOOP: Loop[FollowPlan] = WanVideoToVideo()

if TYPE_CHECKING:
    _FOLLOWS: InputLoop = WanVideoToVideo()  # checked: the family follows an input video


def _ours(run: Run) -> FollowRun:
    if not isinstance(run, FollowRun):  # the engine only starts FollowRuns for us
        raise EngineError("input frames reached another family's run")
    return run


class FollowRun(SegmentRun):
    """One session's chunks: each one call of the video-to-video pipeline on the frames
    fed for it (`feed`), padded to a count the VAE takes."""

    def __init__(self, stream: DiffusersStream, plan: FollowPlan) -> None:
        super().__init__(
            stream,
            SegmentPlan(
                continues=False, segment_frames=plan.chunk_frames, frame_step=plan.frame_step
            ),
        )
        self.follow = plan
        self._size = (stream.request.width, stream.request.height)
        self._fed: np.ndarray | None = None
        """The next chunk's input, until that chunk takes it."""
        self._call_video: Sequence[Any] = ()
        """The call's ``video`` (PIL images), while the call runs."""

    def chunk_frames(self, remaining: int) -> int:
        """The next chunk's frames, with ``remaining`` left to make."""
        return min(self.follow.chunk_frames, remaining)

    def feed(self, frames: np.ndarray) -> None:
        """Keep the next chunk's input (a later feed before that chunk replaces it)."""
        self._fed = frames

    def next_chunk(self, stream: DiffusersStream, checkpoint: Checkpoint, remaining: int) -> Chunk:
        """The chunk made from the frames fed for it; an `EngineError` when none were."""
        fed, self._fed = self._fed, None
        expected = self.chunk_frames(remaining)
        if fed is None or fed.shape[0] != expected:
            got = "none" if fed is None else str(fed.shape[0])
            raise EngineError(
                f"chunk {stream.index} follows {expected} input frames, and {got} were fed "
                "(feed_input before next_chunk)"
            )
        width, height = self._size
        video = [to_pil(frame, width, height) for frame in fed]
        del fed
        # A count Wan's VAE encodes whole (4n+1): the last frame again; its frames are
        # dropped from the chunk (`SegmentRun.next_chunk` keeps ``remaining``).
        video += [video[-1]] * (valid_frames(expected, self.follow.frame_step) - expected)
        self._call_video = video
        try:
            return super().next_chunk(stream, checkpoint, remaining)
        finally:
            self._call_video = ()

    def close(self) -> None:
        super().close()
        self._fed = None
        self._call_video = ()

    def _frames(self, remaining: int, continuing: bool) -> int:
        return len(self._call_video)

    def _seed_call(self, kwargs: dict[str, Any], index: int, image: Any) -> None:
        """The chunk's input, and a generator seeded ``seed`` for every chunk (see the
        module's docstring)."""
        kwargs["generator"] = torch.Generator(device="cpu").manual_seed(self._seed)
        kwargs["video"] = list(self._call_video)
