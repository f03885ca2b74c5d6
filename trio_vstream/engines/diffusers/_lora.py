"""LoRA adapters on the shared pipeline: per-request specs, loaded once per file.

A request's ``lora`` (``path``, ``scale``, ``name``, ``weight_name``) becomes a `LoraSpec`
(`parse_lora_spec`): one ``.safetensors`` file, its path resolved (links included) and
confined to the operator's ``lora_root``. `LoraAdapters` loads each file once, however
many sessions use it, activates it for its own sessions' segments only (under the
`SegmentLock`), and unloads it when the last of them closes, so the pipeline a LoRA-less
session sees is the pristine one.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math
import re
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from trio_vstream.engines.contract import EngineError
from trio_vstream.engines.diffusers._loading import PipelineInfo
from trio_vstream.engines.diffusers._lock import SegmentLock
from trio_vstream.engines.diffusers._messages import shown
from trio_vstream.logsafe import get_logger

logger = get_logger(__package__)  # the engine's one logger, whichever module logs

LORA_KEYS = ("path", "scale", "name", "weight_name")
"""The keys a request's ``lora`` object may have."""

LORA_SUFFIX = ".safetensors"
"""The only LoRA files loaded: safetensors hold tensors and nothing else, whereas
diffusers falls back to unpickling a ``.bin`` file, which can run code."""

DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
"""The file taken from a ``lora.path`` directory without ``weight_name``: the name
diffusers' ``save_lora_weights`` writes (its ``LORA_WEIGHT_NAME_SAFE``)."""

_WEIGHT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,243}" + re.escape(LORA_SUFFIX))
"""``weight_name``: a bare file name of at most 255 characters, from an allow-list (no
separator, no leading dot so neither ``.`` nor ``..``, no NUL), ending in `LORA_SUFFIX`."""

MAX_PATH_CHARS = 1024
"""The longest ``lora.path`` taken."""

NOT_FOUND = (
    "lora: no LoRA file (.safetensors) at lora.path (with lora.weight_name) inside the "
    "server's lora_root"
)
"""The one refusal for a LoRA file that cannot be used, whatever the reason (missing,
outside ``lora_root``, behind a link that leads out, a directory, not a .safetensors
file), so that a client cannot learn whether a file outside ``lora_root`` exists. The
log says which."""


@attrs.frozen
class LoraSpec:
    """A usable LoRA request: a file inside ``lora_root``, the scale to apply it at."""

    file: Path
    """The LoRA file, resolved (no link, no ``..``): what diffusers is handed."""
    scale: float
    name: str | None
    shown: str
    """The client's own ``path`` (and ``weight_name``), bounded and escaped, for messages."""

    @property
    def key(self) -> str:
        """What identifies the weights: sessions with the same file share one adapter
        (each at its own scale), however each named it."""
        return str(self.file)


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
        self._loaded: dict[str, LoadedLora] = {}
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
            try:
                # The file as checked at open_stream, unless a link has appeared on its
                # path since: diffusers gets one resolved file (not a directory and a
                # name to join), and safetensors only (no unpickling fallback).
                if spec.file.resolve(strict=True) != spec.file:
                    raise EngineError(f"{spec.file} now resolves elsewhere")
                pipe.load_lora_weights(
                    str(spec.file),
                    adapter_name=entry.adapter,
                    local_files_only=True,
                    use_safetensors=True,
                )
            except Exception as exc:
                if entry.adapter in adapter_names(pipe):
                    with contextlib.suppress(Exception):
                        pipe.delete_adapters([entry.adapter])
                logger.warning("diffusers engine: cannot load LoRA %s: %s", spec.file, exc)
                # The client learns which of its LoRAs failed, not the server's paths.
                raise EngineError(f"cannot load LoRA {spec.shown}") from None
            entry.loaded_into.append(info)
            logger.info("diffusers engine: loaded LoRA %s as %s", spec.file, entry.adapter)
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
        logger.info("diffusers engine: unloaded LoRA %s (%s)", entry.spec.file, entry.adapter)


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
    loaded. With it, ``path`` is taken relative to it (an absolute one must lead inside
    it too) and ``weight_name`` must be a bare ``.safetensors`` file name in that
    directory (`DEFAULT_WEIGHT_NAME` when left out); ``path`` may also name the file
    itself. The file is resolved, links and ``..`` included, and must lie inside the
    resolved ``lora_root``: see `locate_lora` and `NOT_FOUND`.
    """
    problems: list[str] = []
    if lora_root is None:
        problems.append(
            "this server loads no LoRA named in a request (its operator can allow LoRAs "
            "from one directory with --engine-arg lora_root=DIR)"
        )
        return None, problems
    unknown = sorted(shown(k) for k in set(lora) - set(LORA_KEYS))
    if unknown:
        problems.append(
            f"lora: unknown key(s) {', '.join(unknown)} (known: {', '.join(LORA_KEYS)})"
        )
    raw_path = lora.get("path")
    if (
        not isinstance(raw_path, str)
        or not raw_path
        or len(raw_path) > MAX_PATH_CHARS
        or not raw_path.isprintable()
    ):
        problems.append(
            f"lora.path must be a path (printable text, at most {MAX_PATH_CHARS} characters)"
        )
        return None, problems
    scale = lora.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        problems.append("lora.scale must be a number")
        scale = 1.0
    weight_name = lora.get("weight_name")
    if weight_name is not None and (
        not isinstance(weight_name, str) or not _WEIGHT_NAME.fullmatch(weight_name)
    ):
        problems.append(
            f"lora.weight_name must be a bare file name ending in {LORA_SUFFIX} (letters, "
            "digits, '_', '-', '+' and '.', not first; no directory), got "
            f"{shown(weight_name)}"
        )
        return None, problems
    name = lora.get("name")
    what = shown(raw_path) + (f" ({shown(weight_name)})" if weight_name else "")
    file = locate_lora(lora_root, raw_path, weight_name)
    if file is None:
        problems.append(NOT_FOUND)
        return None, problems
    return LoraSpec(file, float(scale), str(name) if name else None, what), problems


def locate_lora(lora_root: Path, raw_path: str, weight_name: str | None) -> Path | None:
    """The LoRA file that ``path`` (and ``weight_name``) name inside ``lora_root``,
    resolved, or None (the reason logged, not told: `NOT_FOUND`).

    Every name is resolved with ``strict=True`` (a missing file, a dangling link or a
    loop is an error, not a guess) and the result must lie inside the resolved root: a
    link inside the root that leads out is refused like a ``..`` that leads out.
    """
    try:
        return _locate(lora_root, raw_path, weight_name)
    except (_Unusable, OSError, RuntimeError, ValueError) as exc:  # OSError: missing, a loop
        where = f"lora.path {shown(raw_path)}, weight_name {shown(weight_name)}"
        logger.info("diffusers engine: refused LoRA (%s): %s: %s", where, type(exc).__name__, exc)
        return None


class _Unusable(Exception):
    """Why a LoRA file is refused: for the log only (the client gets `NOT_FOUND`)."""


def _locate(lora_root: Path, raw_path: str, weight_name: str | None) -> Path:
    root = lora_root.resolve(strict=True)
    target = (root / raw_path).resolve(strict=True)
    if not target.is_relative_to(root):
        raise _Unusable("outside lora_root")
    if target.is_dir():
        target = (target / (weight_name or DEFAULT_WEIGHT_NAME)).resolve(strict=True)
        if not target.is_relative_to(root):
            raise _Unusable("outside lora_root")
    elif weight_name is not None:
        raise _Unusable("lora.path is a file, yet weight_name is given")
    if not target.is_file():
        raise _Unusable("not a regular file")
    if target.suffix != LORA_SUFFIX:
        raise _Unusable(f"not a {LORA_SUFFIX} file")
    return target


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
