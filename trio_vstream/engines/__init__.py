"""Engines: the model side of the server, one module each.

``load_engine("synthetic", {...})`` builds a built-in engine by name;
``load_engine("package.module:factory", {...})`` builds a lab's own. See
``trio_vstream.engines.contract`` for the contract an engine keeps,
``trio_vstream.engines.interfaces`` for what it may declare beyond it, and
``trio_vstream.engines.testing.check_engine`` to prove that it keeps the rules.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from trio_vstream.engines.contract import (
    BatchRunner,
    Checkpoint,
    Chunk,
    DeferredFrames,
    Engine,
    EngineConfigError,
    EngineError,
    EngineFactory,
    EngineStream,
    GenerationRequest,
    InvalidRequestError,
    PromptChange,
    RunBatch,
    SamplingSettings,
    VideoInput,
    batch_result,
    batched,
    checkpoint_calling,
    release_frames,
)
from trio_vstream.engines.interfaces import (
    DEFAULT_INTERACTION_KINDS,
    interaction_kinds,
    missing_members,
)
from trio_vstream.engines.transitions import ChunkConditioning, PromptSchedule

__all__ = [
    "BUILTIN_ENGINES",
    "DEFAULT_INTERACTION_KINDS",
    "BatchRunner",
    "Checkpoint",
    "Chunk",
    "ChunkConditioning",
    "DeferredFrames",
    "Engine",
    "EngineConfigError",
    "EngineError",
    "EngineFactory",
    "EngineStream",
    "GenerationRequest",
    "InvalidRequestError",
    "PromptChange",
    "PromptSchedule",
    "RunBatch",
    "SamplingSettings",
    "VideoInput",
    "batch_result",
    "batched",
    "checkpoint_calling",
    "interaction_kinds",
    "load_engine",
    "release_frames",
]

BUILTIN_ENGINES: Mapping[str, str] = {
    "synthetic": "trio_vstream.engines.synthetic:create_engine",
    "diffusers": "trio_vstream.engines.diffusers:create_engine",
    "shapes": "trio_vstream.engines.shapes:create_engine",
}
"""Short names for ``--engine``; each maps to a ``module:factory`` path."""


def resolve_factory(spec: str) -> EngineFactory:
    """Find the factory for a built-in name or a ``package.module:factory`` path."""
    path = BUILTIN_ENGINES.get(spec, spec)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise EngineConfigError(
            f"unknown engine {spec!r}: use one of {', '.join(sorted(BUILTIN_ENGINES))} "
            "or 'package.module:factory'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineConfigError(f"cannot import engine module {module_name!r}: {exc}") from exc
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise EngineConfigError(f"engine module {module_name!r} has no {attr!r}") from None
    if not callable(factory):
        raise EngineConfigError(f"engine factory {path!r} is not callable")
    return factory


def load_engine(spec: str, args: Mapping[str, str], *, device: str = "auto") -> Engine:
    """Build the engine named by ``--engine`` with its ``--engine-arg`` options."""
    engine = resolve_factory(spec)(device=device, **dict(args))
    if not isinstance(engine, Engine):
        missing = ", ".join(missing_members(engine, Engine))
        raise EngineConfigError(
            f"engine {spec!r} does not implement the engine interface: missing {missing}"
        )
    return engine
