"""The interface rule: the engine and its streams have the contract's members, and
what they declare beyond it is well formed.

It runs first: an engine without the contract's members cannot be driven, and the
engine's sound, read here, is what the audio rule (`_audio`) checks each chunk against.
"""

from __future__ import annotations

from trio_vstream.engines.contract import Engine, EngineError
from trio_vstream.engines.interfaces import (
    INTERACTION_KINDS,
    audio_format,
    interaction_kinds,
    max_batch,
    missing_members,
)
from trio_vstream.engines.testing._kit import Kit, Skip
from trio_vstream.values import VideoDefaults


def check_interface(kit: Kit) -> None:
    engine = kit.engine
    if not isinstance(engine, Engine):
        missing = ", ".join(missing_members(engine, Engine))
        kit.fail("interface", f"the factory made {engine!r}, which lacks {missing}")
        raise Skip
    if not isinstance(engine.video_defaults, VideoDefaults):
        kit.fail("interface", f"video_defaults is {engine.video_defaults!r}, not VideoDefaults")
    steps = engine.max_concurrent_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        kit.fail("interface", f"max_concurrent_steps must be None or an int >= 1, got {steps!r}")
    kinds = interaction_kinds(engine)
    if not kinds <= INTERACTION_KINDS:
        unknown = ", ".join(sorted(kinds - INTERACTION_KINDS))
        kit.fail("interface", f"unknown interaction kind(s): {unknown}")
    try:
        max_batch(engine)
    except EngineError as exc:
        kit.fail("interface", str(exc))
    try:
        kit.sound = audio_format(engine)
    except EngineError as exc:
        kit.fail("audio", str(exc))
