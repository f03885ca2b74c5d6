"""LoRA adapters on the shared pipeline: per-request specs, loaded once per path.

A request's ``lora`` (``path``, ``scale``, ``name``, ``weight_name``) becomes a `LoraSpec`
(`parse_lora_spec`); `LoraAdapters` loads each path once, however many sessions use it,
activates it for its own sessions' segments only (under the `SegmentLock`), and unloads
it when the last of them closes, so the pipeline a LoRA-less session sees is the
pristine one.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from trio_vstream.engines.base import EngineError
from trio_vstream.engines.diffusers._loading import PipelineInfo
from trio_vstream.engines.diffusers._lock import SegmentLock
from trio_vstream.logsafe import get_logger

logger = get_logger(__package__)  # the engine's one logger, whichever module logs

LORA_KEYS = ("path", "scale", "name", "weight_name")
"""The keys a request's ``lora`` object may have."""


@attrs.frozen
class LoraSpec:
    """A usable LoRA request: an existing local path, the scale to apply it at."""

    path: Path
    weight_name: str | None
    scale: float
    name: str | None

    @property
    def key(self) -> tuple[str, str | None]:
        """What identifies the weights: sessions with the same key share one adapter
        (each at its own scale)."""
        return (str(self.path), self.weight_name)


@attrs.define(eq=False)
class LoadedLora:
    """One adapter on the pipelines: its name there, and how many open streams use it."""

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
        self._loaded: dict[tuple[str, str | None], LoadedLora] = {}
        self._names = itertools.count(1)

    def claim(self, spec: LoraSpec) -> LoadedLora:
        """Count a new stream of ``spec``'s adapter; loading waits for its first segment
        (under the lock), so ``open_stream`` stays quick."""
        with self._mutex:
            entry = self._loaded.get(spec.key)
            if entry is None:
                entry = LoadedLora(adapter=f"trio_vstream_lora_{next(self._names)}", spec=spec)
                self._loaded[spec.key] = entry
            entry.users += 1
            return entry

    def release(self, entry: LoadedLora) -> None:
        """A stream of ``entry`` closed; after the last one the adapter is unloaded under
        the lock, without making the closing stream wait for a running segment."""
        with self._mutex:
            entry.users -= 1
            if entry.users > 0:
                return
            if self._loaded.get(entry.spec.key) is entry:
                del self._loaded[entry.spec.key]
        self._lock.run_soon(lambda: self._unload(entry))

    def activate(self, info: PipelineInfo, entry: LoadedLora | None, scale: float) -> None:
        """Make ``entry`` (at ``scale``) the only active adapter of ``info``'s pipeline, or
        none at all; call under the segment lock, before each segment."""
        pipe = info.pipe
        if entry is None:
            if adapter_names(pipe):
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
                if entry.adapter in adapter_names(pipe):
                    with contextlib.suppress(Exception):
                        pipe.delete_adapters([entry.adapter])
                raise EngineError(f"cannot load LoRA {spec.path}: {exc}") from exc
            entry.loaded_into.append(info)
            logger.info("diffusers engine: loaded LoRA %s as %s", spec.path, entry.adapter)
        pipe.enable_lora()
        pipe.set_adapters([entry.adapter], [scale])

    def _unload(self, entry: LoadedLora) -> None:
        for info in entry.loaded_into:
            pipe = info.pipe
            if entry.adapter in adapter_names(pipe):
                pipe.delete_adapters([entry.adapter])
            if not adapter_names(pipe):
                pipe.unload_lora_weights()
        entry.loaded_into.clear()
        logger.info("diffusers engine: unloaded LoRA %s (%s)", entry.spec.path, entry.adapter)


def adapter_names(pipe: Any) -> set[str]:
    """The adapters loaded into ``pipe`` (empty for a pipeline without LoRA support)."""
    get = getattr(pipe, "get_list_adapters", None)
    if get is None:
        return set()
    try:
        listed = get()
    except Exception:
        return set()
    return {name for names in listed.values() for name in names}


def peft_available() -> bool:
    """Whether diffusers can load LoRA weights here (it needs peft, an optional install)."""
    constants = sys.modules.get("diffusers.utils.constants")
    if constants is None:
        with contextlib.suppress(ImportError):
            constants = importlib.import_module("diffusers.utils.constants")
    return bool(getattr(constants, "USE_PEFT_BACKEND", False))


def parse_lora_spec(
    lora: Mapping[str, Any], lora_root: Path | None
) -> tuple[LoraSpec | None, list[str]]:
    """A request's ``lora`` as a spec (None when unusable), and every problem found with it,
    so that one ``invalid_request`` names them all.

    Clients name files on the server, so LoRAs are opt-in: without ``lora_root`` none is
    loaded; with it, the path is taken relative to it and must stay inside it (``..``
    and symbolic links are resolved before the check).
    """
    problems: list[str] = []
    if lora_root is None:
        problems.append(
            "this server loads no LoRA named in a request (its operator can allow LoRAs "
            "from one directory with --engine-arg lora_root=DIR)"
        )
        return None, problems
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        problems.append(
            f"lora: unknown key(s) {', '.join(unknown)} (known: {', '.join(LORA_KEYS)})"
        )
    raw_path = lora.get("path")
    if not isinstance(raw_path, str) or not raw_path:
        problems.append("lora.path must be a local path (a string)")
        return None, problems
    scale = lora.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        problems.append("lora.scale must be a number")
        scale = 1.0
    weight_name = lora.get("weight_name")
    if weight_name is not None and not isinstance(weight_name, str):
        problems.append("lora.weight_name must be a string")
        weight_name = None
    name = lora.get("name")
    path = (lora_root / raw_path).resolve()
    if not path.is_relative_to(lora_root.resolve()):
        problems.append("lora.path must be inside the server's lora_root")
        return None, problems
    if not path.exists():
        problems.append(f"lora.path {raw_path}: no such file or directory")
        return None, problems
    return LoraSpec(path.resolve(), weight_name, float(scale), str(name) if name else None), (
        problems
    )


def lora_problems(
    lora: Mapping[str, Any], lora_root: Path | None, used: list[PipelineInfo]
) -> list[str]:
    """What stops the pipelines ``used`` by a request from applying its ``lora``."""
    _, problems = parse_lora_spec(lora, lora_root)
    refusing = [i.class_name for i in used if not hasattr(i.pipe, "load_lora_weights")]
    if refusing:
        problems.append(f"lora is not supported by {', '.join(refusing)}")
    elif not peft_available():
        problems.append("lora needs peft installed on the server")
    return problems
