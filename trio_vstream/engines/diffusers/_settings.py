"""The diffusers engine's ``--engine-arg`` strings, parsed into `DiffusersSettings`.

Kept apart from loading: ``create_engine`` names every bad argument before the slow
part (importing diffusers, reading a pipeline) begins.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from trio_vstream.engines.args import parse_bool_arg, parse_number_arg
from trio_vstream.engines.contract import EngineConfigError

DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
"""The names ``dtype=`` and ``vae_dtype=`` accept (besides ``auto``)."""
OFFLOAD_MODES = ("none", "model", "sequential")
"""``offload=``: everything on the device, whole models moved in turn, or layer by layer."""


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
    max_batch: int = 1
    """Sessions whose denoising steps may run as one batch (families that batch:
    ``DiffusersEngine.max_batch``); 1 runs each session's chunk alone under the lock."""
    defer_decode: bool = False
    """Return a batched SkyReels-V2 DF window before its VAE decode, for the server to
    decode in its encode thread while the next window is denoised (`DeferredFrames`):
    off by default, since the device then holds a decode beside the next steps."""


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
    "max_batch": "sessions' steps batched together (1: none)",
    "defer_decode": "1: decode batched DF windows in the server's encode thread (0: off)",
}


def config_error(message: str) -> EngineConfigError:
    """A start-up error that names the engine, so the operator knows which flags to fix."""
    return EngineConfigError(f"diffusers engine: {message}")


def parse_settings(args: Mapping[str, str]) -> DiffusersSettings:
    """Turn ``--engine-arg`` strings into settings, naming any bad one."""
    unknown = sorted(set(args) - set(_SETTING_HELP))
    if unknown:
        raise config_error(
            f"unknown engine arg(s) {', '.join(unknown)}; known: "
            + ", ".join(f"{k} ({v})" for k, v in _SETTING_HELP.items())
        )
    if not args.get("model"):
        raise config_error("--engine-arg model=/path/to/pipeline is required")
    values: dict[str, Any] = {"model": Path(args["model"]).expanduser()}
    for key in ("i2v_model", "lora_root"):
        if args.get(key):
            values[key] = Path(args[key]).expanduser()
    for key in ("dtype", "vae_dtype"):
        if key in args:
            raw = args[key].strip().lower()
            if raw != "auto" and raw not in DTYPES:
                raise config_error(
                    f"{key} must be auto, bfloat16, float16 or float32, got {args[key]!r}"
                )
            values[key] = raw
    if "offload" in args:
        raw = args["offload"].strip().lower()
        if raw not in OFFLOAD_MODES:
            raise config_error(
                f"offload must be none, model or sequential, got {args['offload']!r}"
            )
        values["offload"] = raw
    for key, minimum in (("segment_frames", 2), ("threads", 1), ("max_batch", 1)):
        if key in args:
            values[key] = parse_number_arg("diffusers", key, args[key], int, minimum=minimum)
    if "defer_decode" in args:
        values["defer_decode"] = parse_bool_arg("diffusers", "defer_decode", args["defer_decode"])
    if args.get("name"):
        values["name"] = args["name"]
    return DiffusersSettings(**values)
