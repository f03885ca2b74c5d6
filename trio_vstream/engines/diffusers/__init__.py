"""Serve a diffusers video pipeline from a local directory (``--engine diffusers``).

``--engine-arg model=/path/to/pipeline`` names a directory written by
``pipeline.save_pretrained`` (a ``model_index.json`` and one folder per
component). It is loaded once per server process with
``from_pretrained(path, local_files_only=True)``, with the Hugging Face hub in
offline mode: nothing is ever downloaded.

Streaming. How a video is made depends on the pipeline's family, found once at start-up
(``loops.loop_for``): fixed-length pipelines (Wan) segment by segment, one pipeline call
of ``segment_frames`` frames per segment, each continued from the last frame of the one
before through an image-to-video pipeline (``i2v_model=/path``, or the main pipeline
itself when its ``__call__`` takes ``image=``) or an independent clip seeded ``seed +
index``; chunk-autoregressive pipelines (Helios) one call per chunk, continued from the
session's history latents; and pipelines whose call keeps its loop to itself
(SkyReels-V2 DF, AnyFlow FAR, FramePack) by a loop the engine drives from the
pipeline's parts, one window, chunk or section at a time; LTX-2 segment by segment with
its soundtrack (the engine then declares its sound, `interfaces.SupportsAudio`, and each
chunk carries its frames' samples); Wan's video-to-video pipeline one call per chunk on
the input frames the server feeds the session for it (the engine then declares
``video_input``, `interfaces.SupportsVideoInput`). Each family is one module of
``loops``, whose docstring lists them and says how to add one. Each chunk is handed to
the server as soon as it is decoded; a request's ``image_reference`` conditions the
first.

Cancellation. The pipeline's ``callback_on_step_end`` calls the session's
``checkpoint()`` after every denoising step, and the engine calls it before
each pipeline call: when the session is over it raises, the exception leaves
the pipeline call, and neither the remaining steps nor the VAE decode run.

Sharing. One pipeline serves every session, and its state (scheduler, LoRA
adapters, per-call attributes) belongs to one call at a time, so whole
segments are serialised under a lock, and ``max_concurrent_steps`` is 1.
A session waiting for the lock waits inside ``checkpoint.waiting()`` and
polls ``checkpoint.check_cancelled()``: it can be stopped while it waits, and
the server does not take a long queue for a stall while the segment holding
the lock makes progress. Segments of different sessions alternate: the lock
serves its waiters first come, first served.
A session's LoRA is loaded (once per path, shared by the sessions that use
it), activated for that session's segments only and unloaded when the last
session using it closes. With ``max_batch`` > 1, the families that batch (SkyReels-V2 DF
windows, FramePack vanilla sections, AnyFlow FAR chunks, and the forwards of Wan
segments' and Helios chunks' pipeline calls, `loops._calls`) hold the lock per batched
forward instead of per chunk, and run every session's denoising steps that share a batch
key as one forward (docs/diffusers.md, "Batching sessions' steps").

Layout. This module holds the engine (what every family shares of request planning)
and its factory; ``loops`` holds the families, one module each. What each private
module holds is in the layout map of ``docs/architecture.md``.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from typing import Any

import torch

from trio_vstream.engines.contract import GenerationRequest, InvalidRequestError
from trio_vstream.engines.devices import resolve_device
from trio_vstream.engines.diffusers._extra import check_extra_params, schedule_steps
from trio_vstream.engines.diffusers._loading import (
    PipelineInfo,
    check_pipeline_dir,
    config_value,
    flow_shift_key,
    import_diffusers,
    load_pipeline,
    video_defaults,
)
from trio_vstream.engines.diffusers._lock import SegmentLock
from trio_vstream.engines.diffusers._lora import (
    LoadedLora,
    LoraAdapters,
    LoraSpec,
    lora_problems,
    parse_lora_spec,
)
from trio_vstream.engines.diffusers._settings import (
    DiffusersSettings,
    config_error,
    parse_settings,
)
from trio_vstream.engines.diffusers._stream import DiffusersStream, FollowingStream, StreamPlan

# Importable here as before the split (bench/run.py converts a pipeline's output exactly
# as the engine does), though not part of the engine's surface.
from trio_vstream.engines.diffusers._stream import frames_to_uint8 as _frames_to_uint8  # noqa: F401
from trio_vstream.engines.diffusers.loops import (
    Draft,
    InputLoop,
    SoundLoop,
    WorldLoop,
    loop_for,
)
from trio_vstream.logsafe import get_logger

__all__ = [
    "DiffusersEngine",
    "DiffusersSettings",
    "DiffusersStream",
    "LoraAdapters",
    "LoraSpec",
    "PipelineInfo",
    "SegmentLock",
    "check_pipeline_dir",
    "create_engine",
    "load_pipeline",
    "parse_settings",
]

logger = get_logger(__name__)

_ENGINE_SET_ARGS: Mapping[str, str] = {
    # __call__ arguments the engine sets itself, and what to use instead: refused like
    # any key outside the family's allow-list (`_extra`), with this hint.
    "prompt": "the request's prompt",
    "negative_prompt": "the request's negative_prompt",
    "prompt_embeds": "the request's prompt",
    "negative_prompt_embeds": "the request's negative_prompt",
    "prompt_attention_mask": "the request's prompt",
    "negative_prompt_attention_mask": "the request's negative_prompt",
    "height": "size or height",
    "width": "size or width",
    "num_frames": "num_frames or seconds",
    "num_inference_steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
    "guidance_scale_2": "guidance_scale_2",
    "true_cfg_scale": "true_cfg_scale",
    "boundary_ratio": "boundary_ratio",
    "generator": "seed",
    "seed": "seed",
    "fps": "fps",
    "frame_rate": "fps",
    "image": "image_reference",
    "latents": "",
    "image_embeds": "image_reference",
    "last_image": "",
    "video": "",
    "output_type": "",
    "return_dict": "",
    "num_videos_per_prompt": "",
    "callback_on_step_end": "",
    "callback_on_step_end_tensor_inputs": "",
    "callback": "",
    "callback_steps": "",
}


class DiffusersEngine:
    """A diffusers pipeline (and optionally an image-to-video one) shared by all sessions."""

    max_concurrent_steps = 1
    interaction_kinds: frozenset[str] = frozenset({"prompt"})
    """Prompts only, but for a world model's family (`loops.WorldLoop`, SANA-WM), which
    takes cameras too."""

    def __init__(
        self,
        settings: DiffusersSettings,
        model: PipelineInfo,
        i2v: PipelineInfo | None,
        device: torch.device,
    ) -> None:
        self.settings = settings
        self.device = device
        self.model = model
        self.i2v = i2v
        self.lock = SegmentLock()
        self.decode_lock = SegmentLock()
        """One decode at a time for the families that batch: their windows' decodes run
        beside the batched forwards, not under ``lock`` (the VAE is no part of what a
        batch changes on the shared pipeline, and each session decodes with a cache of its
        own), so that a batch does not wait for them; one at a time bounds the memory the
        decodes take together."""
        self.loras = LoraAdapters(self.lock)
        self.name = settings.name or settings.model.resolve().name or "diffusers"
        self.loop = loop_for(model)
        """The family that serves ``model`` (`loops`): how a request is planned and how
        each chunk is made."""
        if isinstance(self.loop, WorldLoop):
            # A world model (SANA-WM): the session's cameras steer it.
            self.interaction_kinds = frozenset({"prompt", "camera"})
        sound = self.loop.audio_format(model, i2v) if isinstance(self.loop, SoundLoop) else None
        self.audio_sample_rate: int | None = sound.sample_rate if sound is not None else None
        """The sound the pipelines make (`interfaces.SupportsAudio`): None but for a family
        that makes it (LTX-2's vocoder), whose chunks then carry their audio."""
        self.audio_channels = sound.channels if sound is not None else 1
        self.video_input = isinstance(self.loop, InputLoop)
        """Whether sessions may follow an input video (`interfaces.SupportsVideoInput`):
        only for a family that does (`loops.InputLoop`, Wan's video-to-video pipeline),
        whose every session must."""
        if model.takes_video and not self.video_input:
            raise config_error(
                f"model: {model.class_name} makes its video from an input video, which the "
                "engine follows with WanVideoToVideoPipeline only; serve its text-to-video "
                "or image-to-video sibling"
            )
        if i2v is not None and not self.loop.frame_continued:
            if isinstance(self.loop, WorldLoop):
                how = "along its camera path"
            elif self.video_input:
                how = "from its own input frames"
            else:
                how = "from its own history latents"
            raise config_error(
                f"i2v_model: {model.class_name} continues each chunk {how} and takes "
                "image_reference itself; leave i2v_model out"
            )
        self.continuation: PipelineInfo | None = None
        """The pipeline that continues a segment from the last frame, if any."""
        if self.loop.frame_continued:
            self.continuation = i2v if i2v is not None else (model if model.takes_image else None)
        self.extra_params = self.loop.extra_params(model)
        """The ``extra_params`` a request may set, and how they are checked (`_extra`)."""
        pipelines = [model] + ([i2v] if i2v is not None else [])
        self.size_multiple = math.lcm(*(p.size_multiple for p in pipelines))
        self.frame_step = math.lcm(*(p.frame_step for p in pipelines))
        self.segment_frames = self.loop.segment_frames(
            model, settings.segment_frames, self.frame_step
        )
        self.video_defaults = video_defaults(model, self.size_multiple, self.segment_frames)
        batches = bool(getattr(self.loop, "batches", False))
        batches_for = getattr(self.loop, "batches_for", None)
        if batches and batches_for is not None:
            # A family of pipeline calls batches only the pipelines its forwards fit.
            batches = bool(batches_for(model, i2v))
        self.max_batch = settings.max_batch if batches else 1
        """Rows per batched step (`interfaces.SupportsBatching`): ``max_batch`` for a family
        that batches its steps (its ``LOOP.batches``, read with a default so that a family
        written before batching needs no change), else 1, which the server takes as "step
        each session alone"."""
        if settings.max_batch > 1 and not batches:
            logger.warning(
                "diffusers engine: max_batch=%d ignored: %s (%s) does not batch sessions' "
                "steps (each session's chunk runs alone under the lock)",
                settings.max_batch,
                self.loop.name,
                model.class_name,
            )
        if settings.defer_decode and not (
            self.max_batch > 1 and getattr(self.loop, "defers_decode", False)
        ):
            logger.warning(
                "diffusers engine: defer_decode ignored: only batched (max_batch > 1) "
                "SkyReels-V2 DF windows defer their decode; %s decodes in next_chunk",
                self.loop.name,
            )
        if self.max_batch > 1 and settings.offload != "none":
            raise config_error(
                f"max_batch={settings.max_batch} needs offload=none: a batch holds the "
                "transformer on the device between other sessions' encodes and decodes"
            )

    # ------------------------------------------------------------ interface

    def open_stream(self, request: GenerationRequest) -> DiffusersStream:
        """A stream for ``request``, or `InvalidRequestError` naming everything this
        pipeline cannot do of it; nothing runs on the pipeline until ``next_chunk``."""
        plan = self._plan(request)
        if plan.follows is not None:
            stream: DiffusersStream = FollowingStream(self, request, plan, None)
        else:
            stream = DiffusersStream(self, request, plan, None)
        stream._lora = self._claim_lora(request)  # last: nothing after it can fail
        return stream

    def close(self) -> None:
        """Drop the pipelines, and on CUDA hand their memory back to the driver."""
        for info in (self.model, self.i2v):
            if info is not None:
                info.pipe = None
        self.continuation = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------ validation

    def _plan(self, request: GenerationRequest) -> StreamPlan:
        """Check ``request`` against the pipelines that will serve it (the first segment's
        and the following ones') and fix their call arguments, collecting every problem."""
        problems: list[str] = []
        model, continuation = self.model, self.continuation
        multiple = self.size_multiple
        if request.width % multiple or request.height % multiple:
            problems.append(
                f"width and height must be multiples of {multiple} for {model.class_name}, "
                f"got {request.width}x{request.height}"
            )
        if request.image is not None:
            if model.takes_image or self.loop.image_in_loop:
                first = model
            elif self.i2v is not None:
                first = self.i2v
            elif self.video_input:
                first = model
                problems.append(
                    f"image_reference: {model.class_name} follows the input video, and takes "
                    "no image"
                )
            else:
                first = model
                problems.append(
                    f"image_reference needs an image-to-video pipeline, and {model.class_name} "
                    "takes no image (start the server with --engine-arg i2v_model=...)"
                )
        else:
            first = model
            if model.needs_image and not isinstance(self.loop, WorldLoop):
                problems.append(
                    f"{model.class_name} is an image-to-video pipeline: image_reference is required"
                )
        if request.input_video is not None and not self.video_input:
            problems.append(f"input_video: {model.class_name} follows no input video")
        following = continuation if continuation is not None else model
        used = [first] if following is first else [first, following]

        call_kwargs: dict[str, dict[str, Any]] = {info.role: {} for info in used}

        def put(name: str, value: Any, field: str) -> None:
            if value is None:
                return
            refusing = [info.class_name for info in used if not info.accepts(name)]
            if refusing:
                problems.append(f"{field} is not supported by {', '.join(refusing)}")
                return
            for info in used:
                call_kwargs[info.role][name] = value

        for info in used:
            call_kwargs[info.role]["height"] = request.height
            call_kwargs[info.role]["width"] = request.width
        steps = request.num_inference_steps
        stages = model.pyramid_stages
        if steps is not None and stages is not None:
            # A pyramid pipeline (HeliosPyramidPipeline) counts steps per resolution stage.
            put("pyramid_num_inference_steps_list", [steps] * stages, "num_inference_steps")
        else:
            put("num_inference_steps", steps, "num_inference_steps")
        put("guidance_scale", request.guidance_scale, "guidance_scale")
        put("true_cfg_scale", request.sampling.true_cfg_scale, "true_cfg_scale")
        if request.sampling.guidance_scale_2 is not None:
            single = [i.class_name for i in used if config_value(i.pipe, "boundary_ratio") is None]
            if "boundary_ratio" in model.pipe.config and single:
                problems.append(
                    "guidance_scale_2 needs a two-stage pipeline (boundary_ratio set in its "
                    f"model_index.json); {', '.join(single)} has one stage"
                )
            else:
                put("guidance_scale_2", request.sampling.guidance_scale_2, "guidance_scale_2")
        config_overrides: dict[str, Any] = {}
        if request.sampling.boundary_ratio is not None:
            if all(info.accepts("boundary_ratio") for info in used):
                put("boundary_ratio", request.sampling.boundary_ratio, "boundary_ratio")
            elif all(config_value(i.pipe, "boundary_ratio") is not None for i in used):
                config_overrides["boundary_ratio"] = request.sampling.boundary_ratio
            else:
                problems.append(
                    "boundary_ratio needs a two-stage pipeline (boundary_ratio set in its "
                    "model_index.json)"
                )
        for info in used:
            if info.accepts("fps"):
                call_kwargs[info.role]["fps"] = request.fps
            elif info.accepts("frame_rate"):
                call_kwargs[info.role]["frame_rate"] = request.fps
        if request.negative_prompt is not None and not all(
            info.accepts("negative_prompt") for info in used
        ):
            problems.append("negative_prompt is not supported by this pipeline")

        scheduler_overrides: dict[str, Any] = {}
        if request.sampling.flow_shift is not None:
            keys = {flow_shift_key(info.pipe) for info in used}
            key = keys.pop() if len(keys) == 1 else None
            if key is not None:
                scheduler_overrides[key] = request.sampling.flow_shift
            else:
                names = ", ".join(
                    type(getattr(i.pipe, "scheduler", None)).__name__
                    for i in used
                    if flow_shift_key(i.pipe) is None
                )
                problems.append(f"flow_shift is not supported by the scheduler ({names})")

        engine_set = {**dict.fromkeys(self.loop.engine_set, ""), **_ENGINE_SET_ARGS}
        extra = check_extra_params(
            request.extra_params,
            family=self.extra_params,
            used=used,
            engine_set=engine_set,
            steps=steps,
            problems=problems,
        )
        for key, value in extra.items():
            for info in used:
                call_kwargs[info.role][key] = value
        if steps is None:
            put("num_inference_steps", schedule_steps(extra), "extra_params.sigmas")

        max_sequence_length = extra.get("max_sequence_length", model.default("max_sequence_length"))
        guidance = request.guidance_scale
        if guidance is None:
            default = model.default("guidance_scale")
            guidance = float(default) if isinstance(default, (int, float)) else None

        if request.lora is not None:
            problems.extend(lora_problems(request.lora, self.settings.lora_root, used))

        loop_plan = self.loop.plan(
            Draft(
                request=request,
                model=model,
                extra=extra,
                segment_frames=self.segment_frames,
                frame_step=self.frame_step,
                continues=continuation is not None,
                call_kwargs=call_kwargs,
                problems=problems,
            )
        )
        if problems:
            raise InvalidRequestError("; ".join(problems))
        seed = request.seed
        if seed is None:
            seed = secrets.randbits(63)
            logger.info("request %s: seed %d", request.request_id, seed)
        return StreamPlan(
            first=first,
            following=following,
            loop=self.loop,
            world=self.loop if isinstance(self.loop, WorldLoop) else None,
            follows=self.loop if isinstance(self.loop, InputLoop) else None,
            loop_plan=loop_plan,
            call_kwargs=call_kwargs,
            scheduler_overrides=scheduler_overrides,
            config_overrides=config_overrides,
            max_sequence_length=max_sequence_length,
            guidance_scale=guidance,
            seed=seed,
        )

    def _claim_lora(self, request: GenerationRequest) -> tuple[LoadedLora, float] | None:
        """The request's adapter, now counted as used by one more stream (so ``open_stream``
        claims it last: a failure after the claim would leave the count too high)."""
        if request.lora is None:
            return None
        spec, problems = parse_lora_spec(request.lora, self.settings.lora_root)
        if spec is None or problems:  # checked in _plan already; the file may have gone since
            raise InvalidRequestError("; ".join(problems) or "lora: invalid")
        return self.loras.claim(spec), spec.scale


def create_engine(*, device: str = "auto", **engine_args: str) -> DiffusersEngine:
    """Factory for ``--engine diffusers``."""
    settings = parse_settings(engine_args)
    # Fail fast, before the slow imports, on what can be checked without them.
    check_pipeline_dir(settings.model, "model")
    if settings.i2v_model is not None:
        check_pipeline_dir(settings.i2v_model, "i2v_model")
    if settings.lora_root is not None and not settings.lora_root.is_dir():
        raise config_error(f"lora_root={settings.lora_root}: no such directory")
    resolved = resolve_device("diffusers", device, allow_mps=True)
    if settings.offload != "none" and resolved.type != "cuda":
        raise config_error(f"offload={settings.offload} needs a CUDA device, not {resolved}")
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    diffusers = import_diffusers()
    model = load_pipeline(diffusers, settings.model, "model", settings, resolved)
    i2v = None
    if settings.i2v_model is not None:
        if settings.i2v_model.resolve() == settings.model.resolve():
            i2v = model
        else:
            i2v = load_pipeline(diffusers, settings.i2v_model, "i2v_model", settings, resolved)
        if not i2v.takes_image:
            raise config_error(
                f"i2v_model={settings.i2v_model}: {i2v.class_name} takes no image "
                "(its __call__ has no image argument)"
            )
    return DiffusersEngine(settings, model, i2v, resolved)
