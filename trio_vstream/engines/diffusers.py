"""Serve a diffusers video pipeline from a local directory (``--engine diffusers``).

``--engine-arg model=/path/to/pipeline`` names a directory written by
``pipeline.save_pretrained`` (a ``model_index.json`` and one folder per
component). It is loaded once per server process with
``from_pretrained(path, local_files_only=True)``, with the Hugging Face hub in
offline mode: nothing is ever downloaded.

Streaming. A video is made segment by segment: one pipeline call of
``segment_frames`` frames per segment, and each segment is one chunk, handed
to the server as soon as it is decoded. With an image-to-video pipeline
(``i2v_model=/path``, or the main pipeline itself when its ``__call__`` takes
``image=``) every segment after the first continues from the last frame of
the previous one (whose copy, the new segment's first frame, is dropped);
without one, segments are independent clips seeded ``seed + index``. A
request's ``image_reference`` conditions the first segment.

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
the lock makes progress. Segments of different sessions alternate.
A session's LoRA is loaded (once per path, shared by the sessions that use
it), activated for that session's segments only and unloaded when the last
session using it closes.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import json
import logging
import math
import os
import secrets
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from trio_vstream.engines.base import (
    Checkpoint,
    Chunk,
    EngineConfigError,
    EngineError,
    GenerationRequest,
    InvalidRequestError,
    PromptChange,
    parse_number_arg,
)
from trio_vstream.engines.devices import resolve_device
from trio_vstream.engines.transitions import ChunkConditioning, PromptSchedule
from trio_vstream.video import VideoDefaults

logger = logging.getLogger(__name__)

_LOCK_POLL_SECONDS = 0.05
"""The longest a session waiting for the pipeline goes without checking for a
stop (so a stop reaches it within this time)."""

_DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
_OFFLOAD_MODES = ("none", "model", "sequential")

_ENGINE_SET_ARGS: Mapping[str, str] = {
    # __call__ arguments the engine sets itself, and what to use instead.
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

_LORA_KEYS = ("path", "scale", "name", "weight_name")


# --------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class DiffusersSettings:
    """The engine args, parsed (see ``parse_settings``)."""

    model: Path
    i2v_model: Path | None = None
    dtype: str = "auto"
    vae_dtype: str = "auto"
    offload: str = "none"
    segment_frames: int | None = None
    threads: int | None = None
    name: str | None = None
    lora_root: Path | None = None


_SETTING_HELP = {
    "model": "directory of a diffusers pipeline (required)",
    "i2v_model": "directory of an image-to-video pipeline used to continue segments",
    "dtype": "auto|bfloat16|float16|float32",
    "vae_dtype": "auto|bfloat16|float16|float32",
    "offload": "none|model|sequential",
    "segment_frames": "frames per pipeline call",
    "threads": "torch CPU threads",
    "name": "served model name",
    "lora_root": "directory that request LoRA paths must be inside",
}


def _config_error(message: str) -> EngineConfigError:
    return EngineConfigError(f"diffusers engine: {message}")


def parse_settings(args: Mapping[str, str]) -> DiffusersSettings:
    """Turn ``--engine-arg`` strings into settings, naming any bad one."""
    unknown = sorted(set(args) - set(_SETTING_HELP))
    if unknown:
        raise _config_error(
            f"unknown engine arg(s) {', '.join(unknown)}; known: "
            + ", ".join(f"{k} ({v})" for k, v in _SETTING_HELP.items())
        )
    if not args.get("model"):
        raise _config_error("--engine-arg model=/path/to/pipeline is required")
    values: dict[str, Any] = {"model": Path(args["model"]).expanduser()}
    for key in ("i2v_model", "lora_root"):
        if args.get(key):
            values[key] = Path(args[key]).expanduser()
    for key in ("dtype", "vae_dtype"):
        if key in args:
            raw = args[key].strip().lower()
            if raw != "auto" and raw not in _DTYPES:
                raise _config_error(
                    f"{key} must be auto, bfloat16, float16 or float32, got {args[key]!r}"
                )
            values[key] = raw
    if "offload" in args:
        raw = args["offload"].strip().lower()
        if raw not in _OFFLOAD_MODES:
            raise _config_error(
                f"offload must be none, model or sequential, got {args['offload']!r}"
            )
        values["offload"] = raw
    for key, minimum in (("segment_frames", 2), ("threads", 1)):
        if key in args:
            values[key] = parse_number_arg("diffusers", key, args[key], int, minimum=minimum)
    if args.get("name"):
        values["name"] = args["name"]
    return DiffusersSettings(**values)


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def _import_diffusers() -> Any:
    """Import diffusers with the hub offline; a clear error when the extra is missing."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    hub_constants = sys.modules.get("huggingface_hub.constants")
    if hub_constants is not None and not getattr(hub_constants, "HF_HUB_OFFLINE", True):
        # Imported before us: the environment variable came too late for it.
        hub_constants.HF_HUB_OFFLINE = True
    try:
        return importlib.import_module("diffusers")
    except ImportError as exc:
        raise _config_error(
            f"needs the optional dependencies: pip install 'trio-vstream[diffusers]' ({exc})"
        ) from exc


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


def check_pipeline_dir(path: Path, arg: str = "model") -> dict[str, Any]:
    """Say precisely what is wrong with a pipeline directory; return its model_index."""
    where = f"{arg}={path}"
    if not path.exists():
        raise _config_error(f"{where}: no such directory")
    if not path.is_dir():
        raise _config_error(f"{where}: not a directory")
    index_path = path / "model_index.json"
    if not index_path.is_file():
        raise _config_error(
            f"{where}: missing model_index.json, so not a diffusers pipeline directory "
            "(write one with pipeline.save_pretrained(path))"
        )
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _config_error(f"{where}: model_index.json is unreadable or not JSON: {exc}") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise _config_error(f"{where}: model_index.json has no _class_name (the pipeline class)")
    missing: list[str] = []
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2:
            continue
        library, class_name = spec
        if library is None or class_name is None:
            continue  # an optional component left out
        folder = path / name
        if not folder.is_dir():
            missing.append(f"{name}/ ({class_name})")
            continue
        files = [p for p in folder.rglob("*") if p.is_file()]
        if not files:
            missing.append(f"{name}/ is empty ({class_name})")
        elif class_name.endswith("Scheduler"):
            if not (folder / "scheduler_config.json").is_file():
                missing.append(f"{name}/scheduler_config.json")
        elif "Tokenizer" in class_name or "Processor" in class_name:
            pass
        else:
            if not (folder / "config.json").is_file():
                missing.append(f"{name}/config.json")
            if not any(p.name.endswith(_WEIGHT_SUFFIXES) for p in files):
                missing.append(f"{name}/ weights (*.safetensors or *.bin)")
    if missing:
        raise _config_error(f"{where}: incomplete pipeline directory: missing {', '.join(missing)}")
    return index


def _resolve_dtypes(
    settings: DiffusersSettings, device: torch.device, index: Mapping[str, Any]
) -> dict[str, torch.dtype]:
    default = (
        _DTYPES[settings.dtype]
        if settings.dtype != "auto"
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    if settings.vae_dtype != "auto":
        vae = _DTYPES[settings.vae_dtype]
    else:
        # Wan's VAE is meant to decode in float32 (the diffusers docs' recommendation).
        vae_spec = index.get("vae")
        is_wan_vae = isinstance(vae_spec, list) and vae_spec[-1] == "AutoencoderKLWan"
        vae = torch.float32 if is_wan_vae else default
    return {"default": default, "vae": vae}


def _dtype_kwargs(diffusers: Any, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    # diffusers renamed torch_dtype to dtype; use whichever this version knows.
    deprecation = sys.modules.get("diffusers.utils.deprecation_utils")
    if deprecation is None:
        with contextlib.suppress(ImportError):
            deprecation = importlib.import_module("diffusers.utils.deprecation_utils")
    if deprecation is not None and hasattr(deprecation, "_resolve_dtype"):
        return {"dtype": dtypes}
    return {"torch_dtype": dtypes}


def _call_params(pipe: Any) -> tuple[Mapping[str, inspect.Parameter], bool]:
    params = dict(inspect.signature(type(pipe).__call__).parameters)
    params.pop("self", None)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {
        k: p
        for k, p in params.items()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }
    return named, var_kw


@attrs.define(eq=False)
class PipelineInfo:
    """One loaded pipeline and what its ``__call__`` can do."""

    pipe: Any
    role: str
    class_name: str
    params: Mapping[str, inspect.Parameter]
    var_kwargs: bool
    takes_image: bool
    needs_image: bool
    size_multiple: int
    frame_step: int
    """Valid frame counts are ``frame_step * n + 1`` (1: any count)."""
    encode_params: frozenset[str] | None
    """``encode_prompt``'s parameters, or None when prompts go in as strings."""
    embed_layout: str | None = None
    """Decided at the first encode: ``"pair"`` (embeds, negative), ``"masked"``
    (embeds, mask, negative, negative mask) or ``"strings"`` (no blending)."""

    def accepts(self, name: str) -> bool:
        return self.var_kwargs or name in self.params

    def default(self, name: str) -> Any:
        param = self.params.get(name)
        if param is None or param.default is inspect.Parameter.empty:
            return None
        return param.default


def _component(pipe: Any, name: str) -> Any:
    return getattr(pipe, name, None)


def _describe_pipeline(pipe: Any, role: str) -> PipelineInfo:
    class_name = type(pipe).__name__
    params, var_kw = _call_params(pipe)
    where = f"{role}: {class_name}"
    if "num_frames" not in params:
        raise _config_error(f"{where} is not a video pipeline: its __call__ takes no num_frames")
    if "callback_on_step_end" not in params:
        raise _config_error(
            f"{where} cannot be stopped between steps: its __call__ takes no callback_on_step_end"
        )
    missing = [n for n in ("prompt", "height", "width", "generator") if n not in params]
    if missing:
        raise _config_error(f"{where}: its __call__ lacks {', '.join(missing)}")
    image = params.get("image")
    spatial = (
        getattr(pipe, "vae_scale_factor_spatial", None)
        or getattr(pipe, "vae_spatial_compression_ratio", None)
        or getattr(pipe, "vae_scale_factor", None)
        or 8
    )
    temporal = (
        getattr(pipe, "vae_scale_factor_temporal", None)
        or getattr(pipe, "vae_temporal_compression_ratio", None)
        or 1
    )
    patch = 1
    for denoiser in ("transformer", "transformer_2", "unet"):
        config = getattr(_component(pipe, denoiser), "config", None)
        size = getattr(config, "patch_size", None) if config is not None else None
        if isinstance(size, int):
            patch = max(patch, size)
        elif isinstance(size, (list, tuple)) and size:
            patch = max(patch, int(size[-1]))
    multiple = int(spatial) * patch
    if class_name.startswith("Wan"):
        multiple = math.lcm(multiple, 16)  # WanPipeline.check_inputs
    encode = getattr(pipe, "encode_prompt", None)
    encode_params: frozenset[str] | None = None
    if encode is not None and "prompt_embeds" in params:
        names = frozenset(inspect.signature(encode).parameters)
        if "prompt" in names:
            encode_params = names
    return PipelineInfo(
        pipe=pipe,
        role=role,
        class_name=class_name,
        params=params,
        var_kwargs=var_kw,
        takes_image=image is not None,
        needs_image=image is not None and image.default is inspect.Parameter.empty,
        size_multiple=max(2, multiple),
        frame_step=max(1, int(temporal)),
        encode_params=encode_params,
    )


def _valid_frames(count: int, step: int) -> int:
    """The smallest frame count >= count of the form step * n + 1."""
    if step <= 1:
        return max(1, count)
    return max(0, math.ceil((count - 1) / step)) * step + 1


def load_pipeline(
    diffusers: Any,
    path: Path,
    arg: str,
    settings: DiffusersSettings,
    device: torch.device,
) -> PipelineInfo:
    index = check_pipeline_dir(path, arg)
    class_name = index["_class_name"]
    cls = getattr(diffusers, class_name, None)
    if cls is None:
        raise _config_error(
            f"{arg}={path}: model_index.json names {class_name}, which diffusers "
            f"{getattr(diffusers, '__version__', '?')} does not provide"
        )
    dtypes = _resolve_dtypes(settings, device, index)
    try:
        pipe = cls.from_pretrained(
            str(path), local_files_only=True, **_dtype_kwargs(diffusers, dtypes)
        )
    except Exception as exc:
        raise _config_error(f"{arg}={path}: cannot load {class_name}: {exc}") from exc
    info = _describe_pipeline(pipe, arg)
    try:
        if settings.offload == "model":
            pipe.enable_model_cpu_offload(device=device)
        elif settings.offload == "sequential":
            pipe.enable_sequential_cpu_offload(device=device)
        else:
            pipe.to(device)
    except Exception as exc:
        raise _config_error(f"{arg}={path}: cannot place {class_name} on {device}: {exc}") from exc
    with contextlib.suppress(Exception):
        pipe.set_progress_bar_config(disable=True)
    logger.info(
        "diffusers engine: loaded %s from %s on %s (%s, offload %s)",
        class_name,
        path,
        device,
        dtypes["default"],
        settings.offload,
    )
    return info


# --------------------------------------------------------------------------------------
# The lock that serialises segments, and LoRA adapters
# --------------------------------------------------------------------------------------


class SegmentLock:
    """Serialises whole segments on the shared pipeline; waits cancellably.

    A session waiting for the lock is queued behind the holder
    (``checkpoint.waiting()``) and polls ``checkpoint.check_cancelled()``, so it
    can be stopped while it waits, takes no step slot of the server's, and is
    not taken for stalled while the holder makes progress.

    Work that must not run during a segment but must not wait for one
    (unloading the LoRA of a stream that closes while another session's
    segment runs) is deferred: the holder runs it when it lets go.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._deferred: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def held(self, checkpoint: Checkpoint) -> Iterator[None]:
        """Hold the lock for a segment."""
        self._acquire(checkpoint)
        try:
            self._run_deferred()
            yield
        finally:
            self._release()

    def run_soon(self, work: Callable[[], None]) -> None:
        """Run ``work`` under the lock: now if it is free, else when the holder lets go."""
        with self._cond:
            self._deferred.append(work)
            if self._held:
                return
            self._held = True
        self._release()

    def _try_take(self) -> bool:
        with self._cond:
            if self._held:
                return False
            self._held = True
            return True

    def _acquire(self, checkpoint: Checkpoint) -> None:
        checkpoint.check_cancelled()
        if self._try_take():
            return
        with checkpoint.waiting():
            while True:
                checkpoint.check_cancelled()
                with self._cond:
                    if not self._held:
                        self._held = True
                        return
                    self._cond.wait(timeout=_LOCK_POLL_SECONDS)

    def _release(self) -> None:
        while True:
            try:
                self._run_deferred()
            finally:
                with self._cond:
                    self._held = False
                    self._cond.notify_all()
            with self._cond:
                if not self._deferred or self._held:
                    return  # nothing came in meanwhile, or the new holder runs it
                self._held = True

    def _run_deferred(self) -> None:
        while True:
            with self._cond:
                if not self._deferred:
                    return
                work = self._deferred.pop(0)
            try:
                work()
            except Exception:
                logger.exception("diffusers engine: deferred cleanup failed")

    @property
    def locked(self) -> bool:
        with self._cond:
            return self._held


@attrs.frozen
class LoraSpec:
    path: Path
    weight_name: str | None
    scale: float
    name: str | None

    @property
    def key(self) -> tuple[str, str | None]:
        return (str(self.path), self.weight_name)


@attrs.define(eq=False)
class _LoadedLora:
    adapter: str
    spec: LoraSpec
    users: int = 0
    loaded_into: list[PipelineInfo] = attrs.field(factory=list)


class LoraAdapters:
    """LoRA adapters on the shared pipelines, one per path, counted by the streams using them.

    ``activate`` runs under the segment lock, before each segment: it loads the
    stream's adapter into the pipeline if needed and makes it the only active
    one (or disables LoRA for a stream without one). When the last stream of an
    adapter closes, the adapter is deleted under the lock, and once no adapter
    is left the LoRA layers are removed altogether.
    """

    def __init__(self, lock: SegmentLock) -> None:
        self._lock = lock
        self._mutex = threading.Lock()
        self._loaded: dict[tuple[str, str | None], _LoadedLora] = {}
        self._names = itertools.count(1)

    def claim(self, spec: LoraSpec) -> _LoadedLora:
        with self._mutex:
            entry = self._loaded.get(spec.key)
            if entry is None:
                entry = _LoadedLora(adapter=f"trio_vstream_lora_{next(self._names)}", spec=spec)
                self._loaded[spec.key] = entry
            entry.users += 1
            return entry

    def release(self, entry: _LoadedLora) -> None:
        with self._mutex:
            entry.users -= 1
            if entry.users > 0:
                return
            if self._loaded.get(entry.spec.key) is entry:
                del self._loaded[entry.spec.key]
        self._lock.run_soon(lambda: self._unload(entry))

    def activate(self, info: PipelineInfo, entry: _LoadedLora | None, scale: float) -> None:
        pipe = info.pipe
        if entry is None:
            if _adapter_names(pipe):
                pipe.disable_lora()
            return
        if info not in entry.loaded_into:
            spec = entry.spec
            kwargs: dict[str, Any] = {"adapter_name": entry.adapter, "local_files_only": True}
            if spec.weight_name:
                kwargs["weight_name"] = spec.weight_name
            try:
                pipe.load_lora_weights(str(spec.path), **kwargs)
            except Exception as exc:
                if entry.adapter in _adapter_names(pipe):
                    with contextlib.suppress(Exception):
                        pipe.delete_adapters([entry.adapter])
                raise EngineError(f"cannot load LoRA {spec.path}: {exc}") from exc
            entry.loaded_into.append(info)
            logger.info("diffusers engine: loaded LoRA %s as %s", spec.path, entry.adapter)
        pipe.enable_lora()
        pipe.set_adapters([entry.adapter], [scale])

    def _unload(self, entry: _LoadedLora) -> None:
        for info in entry.loaded_into:
            pipe = info.pipe
            if entry.adapter in _adapter_names(pipe):
                pipe.delete_adapters([entry.adapter])
            if not _adapter_names(pipe):
                pipe.unload_lora_weights()
        entry.loaded_into.clear()
        logger.info("diffusers engine: unloaded LoRA %s (%s)", entry.spec.path, entry.adapter)


def _adapter_names(pipe: Any) -> set[str]:
    get = getattr(pipe, "get_list_adapters", None)
    if get is None:
        return set()
    try:
        listed = get()
    except Exception:
        return set()
    return {name for names in listed.values() for name in names}


# --------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------


@attrs.frozen
class _Plan:
    """What ``open_stream`` validated, for ``next_chunk`` to use."""

    first: PipelineInfo
    """Runs segment 0."""
    following: PipelineInfo
    """Runs the segments after it."""
    continues: bool
    """Whether the following segments start from the previous segment's last frame."""
    call_kwargs: Mapping[str, Mapping[str, Any]]
    """Per pipeline role: fixed call kwargs (size, steps, guidance, extra params)."""
    scheduler_overrides: Mapping[str, Any]
    config_overrides: Mapping[str, Any]
    max_sequence_length: int | None
    guidance_scale: float | None
    seed: int
    segment_frames: int
    frame_step: int


class DiffusersStream:
    """One session: segments generated on the engine's shared pipeline."""

    def __init__(
        self,
        engine: DiffusersEngine,
        request: GenerationRequest,
        plan: _Plan,
        lora: tuple[_LoadedLora, float] | None,
    ) -> None:
        self._engine = engine
        self._request = request
        self._plan = plan
        self.seed = plan.seed
        """The seed in use (drawn here when the request has none): echoed in video.start."""
        self._schedule = PromptSchedule(request.prompt)
        self._lora = lora
        self._embeddings: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._last_frame: Any = None
        self._frames_done = 0
        self._next_index = 0
        self._closed = False
        self._image = None
        if request.image is not None:
            self._image = _to_pil(request.image, request.width, request.height)

    # ------------------------------------------------------------ interface

    def interact(self, change: PromptChange) -> None:
        self._schedule.push(change)

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        request, plan = self._request, self._plan
        remaining = request.num_frames - self._frames_done
        if remaining <= 0:
            return None
        index = self._next_index
        conditioning = self._schedule.next_conditioning()
        if index == 0:
            info, image, continuing = plan.first, self._image, False
        elif plan.continues:
            info, image, continuing = plan.following, self._last_frame, True
        else:
            info, image, continuing = plan.following, None, False
        needed = remaining + (1 if continuing else 0)
        count = min(plan.segment_frames, _valid_frames(needed, plan.frame_step))
        video = self._generate(checkpoint, info, conditioning, count, image, index)
        frames = _frames_to_uint8(video)
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
            self._last_frame = _to_pil(host[-1], request.width, request.height)
        if continuing:
            host = host[1:]
        host = np.ascontiguousarray(host[:remaining])
        if host.shape[0] == 0:
            raise EngineError(f"{info.class_name} made no new frame ({count} asked for)")
        self._frames_done += host.shape[0]
        self._next_index += 1
        return conditioning.chunk(host, index)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._embeddings.clear()
        self._last_frame = None
        self._image = None
        if self._lora is not None:
            entry, self._lora = self._lora[0], None
            self._engine.loras.release(entry)

    # ------------------------------------------------------------ generation

    def _generate(
        self,
        checkpoint: Checkpoint,
        info: PipelineInfo,
        conditioning: ChunkConditioning,
        count: int,
        image: Any,
        index: int,
    ) -> Any:
        plan, request, engine = self._plan, self._request, self._engine
        kwargs: dict[str, Any] = dict(plan.call_kwargs[info.role])
        kwargs["num_frames"] = count
        kwargs["generator"] = torch.Generator(device="cpu").manual_seed((plan.seed + index) % 2**64)
        if image is not None:
            kwargs["image"] = image
        if info.accepts("output_type"):
            kwargs["output_type"] = "pt"  # stays on the device; one host copy per chunk
        with engine.lock.held(checkpoint):

            def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> Any:
                checkpoint()  # raises when the session is over: no more steps, no decode
                return tensors

            kwargs["callback_on_step_end"] = on_step_end
            lora = self._lora
            engine.loras.activate(info, lora[0] if lora else None, lora[1] if lora else 1.0)
            kwargs.update(self._prompt_kwargs(info, conditioning))
            with _call_overrides(info, plan, offloaded=engine.settings.offload != "none"):
                checkpoint()
                logger.debug(
                    "request %s: segment %d, %d frames on %s",
                    request.request_id,
                    index,
                    count,
                    info.class_name,
                )
                output = info.pipe(**kwargs)
        video = getattr(output, "frames", None)
        if video is None:
            video = output[0]
        return video

    def _prompt_kwargs(self, info: PipelineInfo, conditioning: ChunkConditioning) -> dict[str, Any]:
        plan, request = self._plan, self._request
        negative_text = request.negative_prompt
        if info.encode_params is not None and info.embed_layout != "strings":
            mixed = self._mix(info, conditioning.mix)
            if mixed is not None:
                embeds, mask = mixed
                kwargs: dict[str, Any] = {"prompt_embeds": embeds}
                if mask is not None:
                    kwargs["prompt_attention_mask"] = mask
                guidance = plan.guidance_scale
                if guidance is None or guidance > 1.0:
                    negative, negative_mask = self._encode(info, negative_text or "")
                    kwargs["negative_prompt_embeds"] = negative
                    if negative_mask is not None:
                        kwargs["negative_prompt_attention_mask"] = negative_mask
                return kwargs
        kwargs = {"prompt": conditioning.prompt}
        if negative_text is not None:
            kwargs["negative_prompt"] = negative_text
        return kwargs

    def _mix(
        self, info: PipelineInfo, mix: tuple[tuple[str, float], ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The weighted sum of each prompt's embedding (the schedule's blend)."""
        encoded = [(self._encode(info, prompt), weight) for prompt, weight in mix]
        if info.embed_layout == "strings":
            return None
        if len(encoded) == 1:
            return encoded[0][0]
        first = encoded[0][0][0]
        if any(e.shape != first.shape for (e, _), _ in encoded):
            # Different sequence lengths cannot be blended: use the dominant prompt.
            return encoded[0][0]
        total = torch.zeros_like(first, dtype=torch.float32)
        for (embeds, _), weight in encoded:
            total += weight * embeds.float()
        mask = None
        masks = [m for (_, m), _ in encoded if m is not None]
        if masks:
            mask = masks[0]
            for other in masks[1:]:
                mask = torch.maximum(mask, other)
        return total.to(first.dtype), mask

    def _encode(self, info: PipelineInfo, text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One prompt's embedding (and mask), encoded once per stream and pipeline."""
        key = (id(info), text)
        cached = self._embeddings.get(key)
        if cached is not None:
            return cached
        assert info.encode_params is not None
        params = info.encode_params
        kwargs: dict[str, Any] = {"prompt": text}
        if "do_classifier_free_guidance" in params:
            kwargs["do_classifier_free_guidance"] = False
        if "max_sequence_length" in params and self._plan.max_sequence_length is not None:
            kwargs["max_sequence_length"] = self._plan.max_sequence_length
        with torch.no_grad():
            result = info.pipe.encode_prompt(**kwargs)
        entry = _embedding_of(info, result)
        self._embeddings[key] = entry
        return entry


def _embedding_of(info: PipelineInfo, result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read ``encode_prompt``'s result; decide the pipeline's layout the first time."""
    parts = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    layout = info.embed_layout
    if layout is None:
        if len(parts) == 2 and isinstance(parts[0], torch.Tensor):
            layout = "pair"
        elif (
            len(parts) == 4
            and isinstance(parts[0], torch.Tensor)
            and isinstance(parts[1], torch.Tensor)
            and info.accepts("prompt_attention_mask")
            and info.accepts("negative_prompt_attention_mask")
        ):
            layout = "masked"
        else:
            layout = "strings"
            logger.info(
                "diffusers engine: %s.encode_prompt returns %d values; "
                "prompts go in as text (no blending)",
                info.class_name,
                len(parts),
            )
        info.embed_layout = layout
    if layout == "pair":
        return parts[0], None
    if layout == "masked":
        return parts[0], parts[1]
    return torch.empty(0), None


@contextlib.contextmanager
def _call_overrides(info: PipelineInfo, plan: _Plan, *, offloaded: bool) -> Iterator[None]:
    """A fresh scheduler (and config overrides) for one call, put back afterwards."""
    pipe = info.pipe
    scheduler = getattr(pipe, "scheduler", None)
    restore_config: dict[str, Any] = {}
    if scheduler is not None:
        pipe.scheduler = type(scheduler).from_config(scheduler.config, **plan.scheduler_overrides)
    for key, value in plan.config_overrides.items():
        restore_config[key] = pipe.config.get(key)
        pipe.register_to_config(**{key: value})
    completed = False
    try:
        yield
        completed = True
    finally:
        if offloaded and not completed:
            # A stopped call skips the pipeline's own offload at its end.
            with contextlib.suppress(Exception):
                pipe.maybe_free_model_hooks()
        if scheduler is not None:
            pipe.scheduler = scheduler
        if restore_config:
            pipe.register_to_config(**restore_config)
        if getattr(pipe, "_current_timestep", None) is not None:
            pipe._current_timestep = None  # a stopped call leaves its timestep tensor here


def _frames_to_uint8(video: Any) -> torch.Tensor:
    """A pipeline's video output to (T, H, W, 3) uint8, on the device it came on."""
    if isinstance(video, list):
        first = video[0]
        if isinstance(first, list):  # lists of PIL images
            video = np.stack([np.asarray(frame.convert("RGB")) for frame in first])
        else:
            video = first
    if isinstance(video, np.ndarray):
        video = torch.from_numpy(np.asarray(video))
    if not isinstance(video, torch.Tensor):
        video = torch.from_numpy(np.asarray(video))
    if video.ndim == 5:
        video = video[0]
    if video.ndim != 4:
        raise EngineError(f"pipeline returned video of shape {tuple(video.shape)}")
    if video.shape[-1] not in (1, 3) and video.shape[1] in (1, 3):
        video = video.permute(0, 2, 3, 1)
    if video.shape[-1] == 1:
        video = video.expand(-1, -1, -1, 3)
    if video.is_floating_point():
        video = (video.float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    elif video.dtype != torch.uint8:
        video = video.clamp(0, 255).to(torch.uint8)
    return video.contiguous()


def _to_pil(frame: np.ndarray, width: int, height: int) -> Any:
    from PIL import Image

    image = Image.fromarray(np.ascontiguousarray(frame, dtype=np.uint8))
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return image


# --------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------


class DiffusersEngine:
    """A diffusers pipeline (and optionally an image-to-video one) shared by all sessions."""

    max_concurrent_steps = 1

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
        self.loras = LoraAdapters(self.lock)
        self.name = settings.name or settings.model.resolve().name or "diffusers"
        self.continuation = i2v if i2v is not None else (model if model.takes_image else None)
        pipelines = [model] + ([i2v] if i2v is not None else [])
        self.size_multiple = math.lcm(*(p.size_multiple for p in pipelines))
        self.frame_step = math.lcm(*(p.frame_step for p in pipelines))
        if settings.segment_frames is not None:
            segment = settings.segment_frames
            if (segment - 1) % self.frame_step:
                raise _config_error(
                    f"segment_frames must be {self.frame_step}*n+1 for {model.class_name} "
                    f"(e.g. {_valid_frames(segment, self.frame_step)}), got {segment}"
                )
        else:
            segment = _default_segment_frames(model, self.frame_step)
        self.segment_frames = segment
        self.video_defaults = _video_defaults(model, self.size_multiple, segment)

    # ------------------------------------------------------------ interface

    def open_stream(self, request: GenerationRequest) -> DiffusersStream:
        plan = self._plan(request)
        stream = DiffusersStream(self, request, plan, None)
        stream._lora = self._claim_lora(request)  # last: nothing after it can fail
        return stream

    def close(self) -> None:
        for info in (self.model, self.i2v):
            if info is not None:
                info.pipe = None
        self.continuation = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------ validation

    def _plan(self, request: GenerationRequest) -> _Plan:
        problems: list[str] = []
        model, continuation = self.model, self.continuation
        multiple = self.size_multiple
        if request.width % multiple or request.height % multiple:
            problems.append(
                f"width and height must be multiples of {multiple} for {model.class_name}, "
                f"got {request.width}x{request.height}"
            )
        if request.image is not None:
            if model.takes_image:
                first = model
            elif self.i2v is not None:
                first = self.i2v
            else:
                first = model
                problems.append(
                    f"image_reference needs an image-to-video pipeline, and {model.class_name} "
                    "takes no image (start the server with --engine-arg i2v_model=...)"
                )
        else:
            first = model
            if model.needs_image:
                problems.append(
                    f"{model.class_name} is an image-to-video pipeline: image_reference is required"
                )
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
        put("num_inference_steps", request.num_inference_steps, "num_inference_steps")
        put("guidance_scale", request.guidance_scale, "guidance_scale")
        put("true_cfg_scale", request.true_cfg_scale, "true_cfg_scale")
        if request.guidance_scale_2 is not None:
            single = [i.class_name for i in used if _config_value(i.pipe, "boundary_ratio") is None]
            if "boundary_ratio" in model.pipe.config and single:
                problems.append(
                    "guidance_scale_2 needs a two-stage pipeline (boundary_ratio set in its "
                    f"model_index.json); {', '.join(single)} has one stage"
                )
            else:
                put("guidance_scale_2", request.guidance_scale_2, "guidance_scale_2")
        config_overrides: dict[str, Any] = {}
        if request.boundary_ratio is not None:
            if all(info.accepts("boundary_ratio") for info in used):
                put("boundary_ratio", request.boundary_ratio, "boundary_ratio")
            elif all(_config_value(i.pipe, "boundary_ratio") is not None for i in used):
                config_overrides["boundary_ratio"] = request.boundary_ratio
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
        if request.flow_shift is not None:
            keys = {_flow_shift_key(info.pipe) for info in used}
            if len(keys) == 1 and None not in keys:
                scheduler_overrides[keys.pop()] = request.flow_shift  # type: ignore[index]
            else:
                names = ", ".join(
                    type(getattr(i.pipe, "scheduler", None)).__name__
                    for i in used
                    if _flow_shift_key(i.pipe) is None
                )
                problems.append(f"flow_shift is not supported by the scheduler ({names})")

        extra = dict(request.extra_params)
        reserved = sorted(k for k in extra if k in _ENGINE_SET_ARGS)
        if reserved:
            hints = [
                f"{k} (use {_ENGINE_SET_ARGS[k]})" if _ENGINE_SET_ARGS[k] else k for k in reserved
            ]
            problems.append(f"extra_params set by the engine: {', '.join(hints)}")
        unknown = sorted(
            k
            for k in extra
            if k not in _ENGINE_SET_ARGS and not all(info.accepts(k) for info in used)
        )
        if unknown:
            problems.append(f"unknown extra_params for {model.class_name}: {', '.join(unknown)}")
        for key, value in extra.items():
            if key not in _ENGINE_SET_ARGS and key not in unknown:
                for info in used:
                    call_kwargs[info.role][key] = value

        max_sequence_length = extra.get("max_sequence_length")
        if not isinstance(max_sequence_length, int):
            max_sequence_length = model.default("max_sequence_length")
        guidance = request.guidance_scale
        if guidance is None:
            default = model.default("guidance_scale")
            guidance = float(default) if isinstance(default, (int, float)) else None

        if request.lora is not None:
            problems.extend(self._lora_problems(request.lora, used))

        if problems:
            raise InvalidRequestError("; ".join(problems))
        seed = request.seed
        if seed is None:
            seed = secrets.randbits(63)
            logger.info("request %s: seed %d", request.request_id, seed)
        return _Plan(
            first=first,
            following=following,
            continues=continuation is not None,
            call_kwargs=call_kwargs,
            scheduler_overrides=scheduler_overrides,
            config_overrides=config_overrides,
            max_sequence_length=max_sequence_length,
            guidance_scale=guidance,
            seed=seed,
            segment_frames=self.segment_frames,
            frame_step=self.frame_step,
        )

    def _lora_spec(self, lora: Mapping[str, Any]) -> tuple[LoraSpec | None, list[str]]:
        problems: list[str] = []
        unknown = sorted(set(lora) - set(_LORA_KEYS))
        if unknown:
            problems.append(
                f"lora: unknown key(s) {', '.join(unknown)} (known: {', '.join(_LORA_KEYS)})"
            )
        raw_path = lora.get("path")
        if not isinstance(raw_path, str) or not raw_path:
            problems.append("lora.path must be a local path (a string)")
            return None, problems
        scale = lora.get("scale", 1.0)
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not math.isfinite(scale)
        ):
            problems.append("lora.scale must be a number")
            scale = 1.0
        weight_name = lora.get("weight_name")
        if weight_name is not None and not isinstance(weight_name, str):
            problems.append("lora.weight_name must be a string")
            weight_name = None
        name = lora.get("name")
        path = Path(raw_path).expanduser()
        root = self.settings.lora_root
        if root is not None:
            path = (root / path).resolve()
            if not path.is_relative_to(root.resolve()):
                problems.append(f"lora.path must be inside the server's lora_root ({root})")
                return None, problems
        if not path.exists():
            problems.append(f"lora.path {raw_path}: no such file or directory")
            return None, problems
        return LoraSpec(path.resolve(), weight_name, float(scale), str(name) if name else None), (
            problems
        )

    def _lora_problems(self, lora: Mapping[str, Any], used: list[PipelineInfo]) -> list[str]:
        _, problems = self._lora_spec(lora)
        refusing = [i.class_name for i in used if not hasattr(i.pipe, "load_lora_weights")]
        if refusing:
            problems.append(f"lora is not supported by {', '.join(refusing)}")
        elif not _peft_available():
            problems.append("lora needs peft installed on the server")
        return problems

    def _claim_lora(self, request: GenerationRequest) -> tuple[_LoadedLora, float] | None:
        if request.lora is None:
            return None
        spec, problems = self._lora_spec(request.lora)
        if spec is None or problems:  # checked in _plan already; the file may have gone since
            raise InvalidRequestError("; ".join(problems) or "lora: invalid")
        return self.loras.claim(spec), spec.scale


def _config_value(pipe: Any, key: str) -> Any:
    config = getattr(pipe, "config", None)
    if config is None:
        return None
    try:
        return config.get(key)
    except AttributeError:
        return getattr(config, key, None)


def _flow_shift_key(pipe: Any) -> str | None:
    """The scheduler config entry that ``flow_shift`` maps to, if any."""
    scheduler = getattr(pipe, "scheduler", None)
    config = getattr(scheduler, "config", None)
    if config is None:
        return None
    if "flow_shift" in config and config.get("use_flow_sigmas", True):
        return "flow_shift"
    if "shift" in config and not config.get("use_dynamic_shifting", False):
        return "shift"
    return None


def _peft_available() -> bool:
    constants = sys.modules.get("diffusers.utils.constants")
    if constants is None:
        with contextlib.suppress(ImportError):
            constants = importlib.import_module("diffusers.utils.constants")
    return bool(getattr(constants, "USE_PEFT_BACKEND", False))


def _default_segment_frames(model: PipelineInfo, step: int) -> int:
    window = model.default("num_latent_frames_per_chunk")
    if isinstance(window, int) and window > 1 and step > 1:
        return (window - 1) * step + 1  # a pipeline that generates in windows (Helios): one
    return 4 * step + 1 if step > 1 else 16


def _video_defaults(model: PipelineInfo, multiple: int, segment: int) -> VideoDefaults:
    if model.class_name.startswith("Wan"):
        return VideoDefaults(width=832, height=480, fps=16, num_frames=2 * segment - 1)
    width = model.default("width")
    height = model.default("height")
    if not isinstance(width, int) or width % multiple:
        width = 832 // multiple * multiple
    if not isinstance(height, int) or height % multiple:
        height = 480 // multiple * multiple
    fps = model.default("fps") or model.default("frame_rate")
    fps = int(fps) if isinstance(fps, (int, float)) and fps >= 1 else 16
    return VideoDefaults(width=width, height=height, fps=fps, num_frames=2 * segment - 1)


def create_engine(*, device: str = "auto", **engine_args: str) -> DiffusersEngine:
    """Factory for ``--engine diffusers``."""
    settings = parse_settings(engine_args)
    # Fail fast, before the slow imports, on what can be checked without them.
    check_pipeline_dir(settings.model, "model")
    if settings.i2v_model is not None:
        check_pipeline_dir(settings.i2v_model, "i2v_model")
    if settings.lora_root is not None and not settings.lora_root.is_dir():
        raise _config_error(f"lora_root={settings.lora_root}: no such directory")
    resolved = resolve_device("diffusers", device, allow_mps=True)
    if settings.offload != "none" and resolved.type != "cuda":
        raise _config_error(f"offload={settings.offload} needs a CUDA device, not {resolved}")
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    diffusers = _import_diffusers()
    model = load_pipeline(diffusers, settings.model, "model", settings, resolved)
    i2v = None
    if settings.i2v_model is not None:
        if settings.i2v_model.resolve() == settings.model.resolve():
            i2v = model
        else:
            i2v = load_pipeline(diffusers, settings.i2v_model, "i2v_model", settings, resolved)
        if not i2v.takes_image:
            raise _config_error(
                f"i2v_model={settings.i2v_model}: {i2v.class_name} takes no image "
                "(its __call__ has no image argument)"
            )
    return DiffusersEngine(settings, model, i2v, resolved)
