"""The segment path: fixed-length pipelines (Wan, LTX, CogVideoX, ...), one call a chunk.

Each ``next_chunk`` is one pipeline call of ``segment_frames`` frames under the engine's
lock: the prompt's embeddings (blended while a transition runs), a generator seeded
``seed + index``, a fresh scheduler, the session's LoRA, and a per-step callback that
calls ``checkpoint()`` so a stop ends the call between steps, before the VAE decode. The
frames come back as uint8 on the device and are copied to the host once. With an
image-to-video pipeline (``i2v_model``, or the model itself when its ``__call__`` takes
``image=``) every segment after the first continues from the last frame of the one
before (whose copy, the new segment's first frame, is dropped); without one, segments
are independent clips. A request's ``image_reference`` conditions the first segment.
With ``max_batch`` > 1 and a Wan transformer, the call runs in the session's thread on a
copy of the pipeline, and only its transformer forwards go, batched with other sessions',
under the lock (`_calls.BatchedCall`).

This family takes any pipeline the engine loads, so the registry asks it last. Its run,
`SegmentRun`, is also what a family of pipeline calls builds on: Helios' chunks
(``history``) and FramePack's inverted sampling (``framepack``) change a few of its
steps (`SegmentRun`'s hooks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from trio_vstream.engines.contract import Checkpoint, Chunk, EngineError
from trio_vstream.engines.diffusers._extra import COMMON, ExtraParams
from trio_vstream.engines.diffusers._loading import checked_segment_frames, valid_frames
from trio_vstream.engines.diffusers._stream import frames_to_uint8, logger, to_pil
from trio_vstream.engines.diffusers.loops._calls import BatchedCall, batchable
from trio_vstream.engines.diffusers.loops._protocol import Draft, Loop

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream
    from trio_vstream.engines.transitions import ChunkConditioning

EXTRA_PARAMS = ExtraParams("a pipeline served segment by segment", COMMON)
"""Wan, SkyReels-V2 and other fixed-length pipelines take the common keys only."""


@attrs.frozen(kw_only=True)
class SegmentPlan:
    """A request's segments: how long each is and how each continues."""

    continues: bool
    """Whether the segments after the first start from the previous one's last frame."""
    segment_frames: int
    frame_step: int
    call_frames: int | None = None
    """The most ``num_frames`` a segment's call is asked for, whatever frames the segment
    keeps (None: the segment's own count). FramePack's inverted call runs whole sections,
    one per ``(latent_window_size-1)*4+1`` frames asked for, and one section makes
    ``4*latent_window_size+1``: asking for the segment's count would run two."""


class Segments:
    """The segment path (`Loop`): any pipeline, one call a segment."""

    name = "segments"
    batches = True
    """Its calls' forwards run batched across sessions when the engine's ``max_batch`` > 1,
    for the pipelines whose transformer takes it (`batches_for`)."""
    frame_continued = True
    image_in_loop = False
    engine_set: tuple[str, ...] = ()

    def recognises(self, info: PipelineInfo) -> bool:
        return True

    def batches_for(self, model: PipelineInfo, i2v: PipelineInfo | None) -> bool:
        """Whether the engine's pipelines batch: each one's transformers are of a class
        whose forward is known to take rows of several calls (Wan's)."""
        return batchable(model) and (i2v is None or batchable(i2v))

    def segment_frames(self, model: PipelineInfo, given: int | None, frame_step: int) -> int:
        return checked_segment_frames(model, given, frame_step)

    def extra_params(self, model: PipelineInfo) -> ExtraParams:
        return EXTRA_PARAMS

    def plan(self, draft: Draft) -> SegmentPlan:
        return SegmentPlan(
            continues=draft.continues,
            segment_frames=draft.segment_frames,
            frame_step=draft.frame_step,
        )

    def start(self, stream: DiffusersStream, plan: SegmentPlan) -> SegmentRun:
        return SegmentRun(stream, plan)


LOOP: Loop[SegmentPlan] = Segments()


class SegmentRun:
    """One session's segments, each one pipeline call.

    A family of pipeline calls changes its steps by overriding the hooks: `_frames` (how
    many frames a call makes), `_seed_call` (the call's generator and image),
    `_before_call` (under the lock, before the LoRA and the prompt), `_on_step` (each
    step's tensors), `_after_call`, `_prompt_kwargs`, `_video` (what of the call's output
    is its video) and `_chunk` (the chunk its new frames make)."""

    def __init__(self, stream: DiffusersStream, plan: SegmentPlan) -> None:
        self.plan = plan
        self._seed = stream.plan.seed
        self._last_frame: Any = None

    def next_chunk(self, stream: DiffusersStream, checkpoint: Checkpoint, remaining: int) -> Chunk:
        """The next segment's new frames."""
        plan = self.plan
        request = stream.request
        index = stream.index
        conditioning = stream.next_conditioning()
        if index == 0:
            info, image, continuing = stream.plan.first, stream.image, False
        elif plan.continues:
            info, image, continuing = stream.plan.following, self._last_frame, True
        else:
            info, image, continuing = stream.plan.following, None, False
        count = self._frames(remaining, continuing)
        video = self._generate(stream, checkpoint, info, conditioning, count, image, index)
        frames = frames_to_uint8(video)
        del video
        if tuple(frames.shape[1:3]) != (request.height, request.width):
            raise EngineError(
                f"{info.class_name} made {frames.shape[2]}x{frames.shape[1]} frames "
                f"for a {request.width}x{request.height} request"
            )
        # Some pipelines make more than asked for (Helios: whole 33-frame windows).
        host = frames[:count].cpu().numpy()  # the one device-to-host copy of this chunk
        del frames
        if plan.continues:
            self._last_frame = to_pil(host[-1], request.width, request.height)
        if continuing:
            host = host[1:]
        host = np.ascontiguousarray(host[:remaining])
        if host.shape[0] == 0:
            raise EngineError(f"{info.class_name} made no new frame ({count} asked for)")
        return self._chunk(stream, host, conditioning, index, continuing)

    def close(self) -> None:
        self._last_frame = None

    def _generate(
        self,
        stream: DiffusersStream,
        checkpoint: Checkpoint,
        info: PipelineInfo,
        conditioning: ChunkConditioning,
        count: int,
        image: Any,
        index: int,
    ) -> Any:
        """One pipeline call of ``count`` frames: its forwards batched with other sessions'
        when the engine batches and the pipeline can (`_calls.batchable`), else holding
        the lock for all of it (the scheduler, the LoRA and the per-call attributes are
        the pipeline's, not ours)."""
        plan = self.plan
        kwargs: dict[str, Any] = dict(stream.plan.call_kwargs[info.role])
        if info.accepts("num_frames"):  # a video-to-video call makes as many as it is given
            kwargs["num_frames"] = (
                count if plan.call_frames is None else min(count, plan.call_frames)
            )
        self._seed_call(kwargs, index, image)
        if info.accepts("output_type"):
            kwargs["output_type"] = "pt"  # stays on the device; one host copy per chunk

        batched = stream.engine.max_batch > 1 and batchable(info)
        # Batched, each forward's ``step`` is the checkpoint (it counts the progress and
        # takes the turn), so the callback only looks for a stop: no third hand-over to
        # the event loop a step.
        check = checkpoint.check_cancelled if batched else checkpoint

        def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> Any:
            check()  # raises when the session is over: no more steps, no decode
            self._on_step(tensors)
            return tensors

        kwargs["callback_on_step_end"] = on_step_end
        if batched:
            return self._video(
                self._batched_call(stream, checkpoint, info, conditioning, kwargs, index, image)
            )
        with stream.engine.lock.held(checkpoint):
            self._before_call(stream, checkpoint, info, info.pipe, kwargs, index, image)
            stream.activate_lora(info)
            kwargs.update(self._prompt_kwargs(stream, info, conditioning))
            with stream.call_overrides(info):
                checkpoint()
                self._log(stream, index, count, info)
                output = info.pipe(**kwargs)
            self._after_call(info)
        return self._video(output)

    def _batched_call(
        self,
        stream: DiffusersStream,
        checkpoint: Checkpoint,
        info: PipelineInfo,
        conditioning: ChunkConditioning,
        kwargs: dict[str, Any],
        index: int,
        image: Any,
    ) -> Any:
        """The call in the session's thread, on a copy of the pipeline whose forwards go
        to the batch (`_calls.BatchedCall`). The lock is held only for the prompt's
        encoding (with the session's LoRA, as the call's own encoding would be); the call
        takes it again for each batched forward and each encoder call, and the VAE's
        lock for each encode and decode; never while waiting for a batch."""
        engine = stream.engine
        call = BatchedCall(
            engine,
            info,
            checkpoint,
            stream.lora,
            stream.fresh_scheduler(info),
            stream.plan.config_overrides,
            (stream.request.width, stream.request.height, kwargs["num_frames"]),
        )
        with engine.lock.held(checkpoint):
            stream.activate_lora(info)
            kwargs.update(self._prompt_kwargs(stream, info, conditioning))
        with call.running() as pipe:
            self._before_call(stream, checkpoint, info, pipe, kwargs, index, image)
            checkpoint()
            self._log(stream, index, kwargs["num_frames"], info)
            output = pipe(**kwargs)
        self._after_call(info)
        return output

    def _log(self, stream: DiffusersStream, index: int, count: int, info: PipelineInfo) -> None:
        logger.debug(
            "request %s: segment %d, %d frames on %s",
            stream.request.request_id,
            index,
            count,
            info.class_name,
        )

    # ------------------------------------------------------------ hooks

    def _frames(self, remaining: int, continuing: bool) -> int:
        """Frames the next call makes: a segment, or what is left (with the frame it
        continues from), as a count the pipeline takes."""
        plan = self.plan
        needed = remaining + (1 if continuing else 0)
        return min(plan.segment_frames, valid_frames(needed, plan.frame_step))

    def _seed_call(self, kwargs: dict[str, Any], index: int, image: Any) -> None:
        """The call's own generator, seeded ``seed + index``, and the image it starts from."""
        seed = (self._seed + index) % 2**64
        kwargs["generator"] = torch.Generator(device="cpu").manual_seed(seed)
        if image is not None:
            kwargs["image"] = image

    def _before_call(
        self,
        stream: DiffusersStream,
        checkpoint: Checkpoint,
        info: PipelineInfo,
        pipe: Any,
        kwargs: dict[str, Any],
        index: int,
        image: Any,
    ) -> None:
        """Before the call, on ``pipe``, the pipeline it calls: nothing here. Unbatched,
        under the lock, before the LoRA and the prompt; batched, after them, on the
        session's copy of the pipeline (`_calls.BatchedCall`), whose VAE takes its own
        lock."""

    def _on_step(self, tensors: dict[str, Any]) -> None:
        """After each denoising step, with the call's ``callback_on_step_end`` tensors."""

    def _after_call(self, info: PipelineInfo) -> None:
        """After the call (unbatched, still under the lock)."""

    def _video(self, output: Any) -> Any:
        """The call's video: its output's ``frames``, or its first value. A family whose
        call returns more (LTX-2's soundtrack) keeps the rest here."""
        video = getattr(output, "frames", None)
        if video is None:
            video = output[0]
        return video

    def _chunk(
        self,
        stream: DiffusersStream,
        host: np.ndarray,
        conditioning: ChunkConditioning,
        index: int,
        continuing: bool,
    ) -> Chunk:
        """The chunk of ``host``, the segment's new frames on the host (``continuing``:
        the call's first frame, the last one sent, was dropped from them)."""
        return stream.chunk(host, conditioning, index)

    def _prompt_kwargs(
        self, stream: DiffusersStream, info: PipelineInfo, conditioning: ChunkConditioning
    ) -> dict[str, Any]:
        """The call's prompt arguments (the stream's: embeddings blended, or the text)."""
        return stream.prompt_kwargs(info, conditioning)
