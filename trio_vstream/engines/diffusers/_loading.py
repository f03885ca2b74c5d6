"""Loading a pipeline directory offline, and learning what its ``__call__`` can do.

``check_pipeline_dir`` says precisely what is wrong with a directory before diffusers is
even imported; ``load_pipeline`` calls ``from_pretrained(path, local_files_only=True)``
with the hub offline and describes the result as a `PipelineInfo`. The engine plans
requests from that description alone (which arguments the call takes, the size and
frame-count granularity), so any video pipeline that follows diffusers' conventions
works without a per-class table.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from trio_vstream.engines.diffusers._settings import DTYPES, DiffusersSettings, config_error
from trio_vstream.logsafe import get_logger
from trio_vstream.values import VideoDefaults

logger = get_logger(__package__)  # the engine's one logger, whichever module logs


def import_diffusers() -> Any:
    """Import diffusers with the hub offline; a clear error when the extra is missing."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # Any: a module looked up by name, whose attributes the type checker cannot know.
    hub_constants: Any = sys.modules.get("huggingface_hub.constants")
    if hub_constants is not None and not getattr(hub_constants, "HF_HUB_OFFLINE", True):
        # Imported before us: the environment variable came too late for it.
        hub_constants.HF_HUB_OFFLINE = True
    try:
        return importlib.import_module("diffusers")
    except ImportError as exc:
        raise config_error(
            f"needs the optional dependencies: pip install 'trio-vstream[diffusers]' ({exc})"
        ) from exc


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


def check_pipeline_dir(path: Path, arg: str = "model") -> dict[str, Any]:
    """Say precisely what is wrong with a pipeline directory; return its model_index."""
    where = f"{arg}={path}"
    if not path.exists():
        raise config_error(f"{where}: no such directory")
    if not path.is_dir():
        raise config_error(f"{where}: not a directory")
    index_path = path / "model_index.json"
    if not index_path.is_file() and (path / "modular_model_index.json").is_file():
        raise config_error(
            f"{where}: a modular pipeline repository (modular_model_index.json), which this "
            "engine does not load: give the standard pipeline directory (model_index.json) "
            "of the same checkpoint"
        )
    if not index_path.is_file():
        raise config_error(
            f"{where}: missing model_index.json, so not a diffusers pipeline directory "
            "(write one with pipeline.save_pretrained(path))"
        )
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise config_error(f"{where}: model_index.json is unreadable or not JSON: {exc}") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise config_error(f"{where}: model_index.json has no _class_name (the pipeline class)")
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
        raise config_error(f"{where}: incomplete pipeline directory: missing {', '.join(missing)}")
    return index


def _resolve_dtypes(
    settings: DiffusersSettings, device: torch.device, index: Mapping[str, Any]
) -> dict[str, torch.dtype]:
    """Per-component dtypes for ``from_pretrained``: ``auto`` is bfloat16 on CUDA (half the
    memory of float32) and float32 elsewhere, where bfloat16 is slow or unsupported."""
    default = (
        DTYPES[settings.dtype]
        if settings.dtype != "auto"
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    if settings.vae_dtype != "auto":
        vae = DTYPES[settings.vae_dtype]
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
    """``__call__``'s named parameters, and whether it also takes ``**kwargs`` (then any
    extra parameter may be meant for it, and only the call itself can refuse it)."""
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
    takes_video: bool = False
    """Whether the call makes its frames from an input video: it takes ``video=`` and no
    ``num_frames`` (a video-to-video pipeline, as many frames out as in)."""
    embed_layout: str | None = None
    """Decided at the first encode: ``"pair"`` (embeds, negative), ``"masked"``
    (embeds, mask, negative, negative mask) or ``"strings"`` (no blending)."""

    def accepts(self, name: str) -> bool:
        """Whether ``__call__`` takes ``name``: checked at ``open_stream``, so a request
        the pipeline cannot serve is refused before any segment runs."""
        return self.var_kwargs or name in self.params

    def default(self, name: str) -> Any:
        """``__call__``'s default for ``name`` (None without one): the pipeline's own
        choice is the engine's default too."""
        param = self.params.get(name)
        if param is None or param.default is inspect.Parameter.empty:
            return None
        return param.default

    @property
    def pyramid_stages(self) -> int | None:
        """How many resolution stages a pyramid pipeline (``HeliosPyramidPipeline``)
        counts its steps per: its ``__call__`` takes ``pyramid_num_inference_steps_list``
        (one count a stage) and no ``num_inference_steps``. None for any other pipeline."""
        stages = self.default("pyramid_num_inference_steps_list")
        if isinstance(stages, list) and not self.accepts("num_inference_steps"):
            return len(stages)
        return None


def _component(pipe: Any, name: str) -> Any:
    """A pipeline component, or None: optional components may be absent or set to None."""
    return getattr(pipe, name, None)


def _describe_pipeline(pipe: Any, role: str) -> PipelineInfo:
    """What the engine needs to know of ``pipe``, refusing pipelines it cannot stream (no
    frame count, no per-step callback to stop at) at start-up rather than mid-session."""
    class_name = type(pipe).__name__
    params, var_kw = _call_params(pipe)
    where = f"{role}: {class_name}"
    takes_video = "video" in params and "num_frames" not in params
    if "num_frames" not in params and not takes_video:
        raise config_error(f"{where} is not a video pipeline: its __call__ takes no num_frames")
    if "callback_on_step_end" not in params:
        raise config_error(
            f"{where} cannot be stopped between steps: its __call__ takes no callback_on_step_end"
        )
    missing = [n for n in ("prompt", "height", "width", "generator") if n not in params]
    if missing:
        raise config_error(f"{where}: its __call__ lacks {', '.join(missing)}")
    video = params.get("video")
    if video is not None and video.default is inspect.Parameter.empty and not takes_video:
        raise config_error(
            f"{where} needs an input video (video=) beside its num_frames, which the engine "
            "does not serve (it follows input video with WanVideoToVideoPipeline only); "
            "serve its text-to-video or image-to-video sibling"
        )
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
    elif class_name.startswith("LTX"):
        multiple = math.lcm(multiple, 32)  # LTXPipeline's and LTX2Pipeline's check_inputs
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
        takes_video=takes_video,
    )


def valid_frames(count: int, step: int) -> int:
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
    """Load the pipeline at ``path`` (named by the engine arg ``arg`` in errors) offline,
    place it on ``device`` as ``settings.offload`` says, and describe it."""
    index = check_pipeline_dir(path, arg)
    class_name = index["_class_name"]
    cls = getattr(diffusers, class_name, None)
    if cls is None:
        raise config_error(
            f"{arg}={path}: model_index.json names {class_name}, which diffusers "
            f"{getattr(diffusers, '__version__', '?')} does not provide"
        )
    dtypes = _resolve_dtypes(settings, device, index)
    try:
        pipe = cls.from_pretrained(
            str(path), local_files_only=True, **_dtype_kwargs(diffusers, dtypes)
        )
    except Exception as exc:
        raise config_error(f"{arg}={path}: cannot load {class_name}: {exc}") from exc
    info = _describe_pipeline(pipe, arg)
    try:
        if settings.offload == "model":
            pipe.enable_model_cpu_offload(device=device)
        elif settings.offload == "sequential":
            pipe.enable_sequential_cpu_offload(device=device)
        else:
            pipe.to(device)
    except Exception as exc:
        raise config_error(f"{arg}={path}: cannot place {class_name} on {device}: {exc}") from exc
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


def config_value(pipe: Any, key: str) -> Any:
    """``pipe.config[key]`` or None: configs are FrozenDicts in some diffusers versions and
    plain objects in others."""
    config = getattr(pipe, "config", None)
    if config is None:
        return None
    try:
        return config.get(key)
    except AttributeError:
        return getattr(config, key, None)


def flow_shift_key(pipe: Any) -> str | None:
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


def default_segment_frames(model: PipelineInfo, step: int, *, window_arg: str | None = None) -> int:
    """Frames per pipeline call when ``segment_frames`` is not set: one chunk for a
    pipeline that generates in chunks (``num_latent_frames_per_chunk``: Helios' 33), the
    call's own window where ``window_arg`` names the argument that sets it (a diffusion-
    forcing window, ``base_num_frames``: SkyReels-V2 DF's 97), else five latent frames (17
    for Wan)."""
    window = model.default("num_latent_frames_per_chunk")
    if isinstance(window, int) and window > 1 and step > 1:
        return (window - 1) * step + 1
    base = model.default(window_arg) if window_arg is not None else None
    if isinstance(base, int) and base > 1:
        return valid_frames(base, step)
    return 4 * step + 1 if step > 1 else 16


def checked_segment_frames(model: PipelineInfo, given: int | None, step: int) -> int:
    """``segment_frames`` as the operator gave it (a ``step * n + 1`` count, else a start-up
    error naming the nearest), or `default_segment_frames` when not given."""
    if given is None:
        return default_segment_frames(model, step)
    if (given - 1) % step:
        raise config_error(
            f"segment_frames must be {step}*n+1 for {model.class_name} "
            f"(e.g. {valid_frames(given, step)}), got {given}"
        )
    return given


def video_defaults(model: PipelineInfo, multiple: int, segment: int) -> VideoDefaults:
    """What a request that leaves size, fps or length out gets: the model family's native
    size where known (Wan), else the pipeline's own defaults rounded to what it accepts;
    two segments long, so a default request shows one continuation."""
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
