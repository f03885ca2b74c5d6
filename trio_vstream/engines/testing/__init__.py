"""Proving that an engine keeps the contract: `check_engine`, for an engine's own tests.

What ``trio.testing.check_two_way_stream`` is for a Trio stream, this is for an engine:
give it a factory, and it drives the engine through the rules of
`trio_vstream.engines.contract` as the server would, then reports every rule broken, each by
its name in `RULES`, in one `EngineContractError`::

    from trio_vstream.engines.testing import check_engine

    def test_my_engine_keeps_the_contract():
        check_engine(lambda: create_engine(device="cpu", steps="2"))

The kit is plain synchronous Python, like an engine (the import contracts keep Trio out
of ``engines/``): it plays the server's part from threads, one per engine call as the
server's worker threads are, with a `Checkpoint` of its own that counts steps, stops a
stream at a chosen one, parks it there, and batches the rows of several streams. So it
runs under any test runner, and an engine call that never returns is reported after
``timeout`` seconds instead of hanging the test (its thread, a daemon, is left behind,
and the checks after it are skipped: the engine's state is unknown).

A stop is a ``BaseException`` (`CheckpointStopped`), as the server's is (``trio.Cancelled``),
so an engine that catches ``Exception`` around its steps still lets it through.

The kit is a package: this module holds the entry point and the order the rules run in,
and each rule (or the few that one run of streams checks together) is a private module of
its own, with what they share in `_kit`, `_probe` and `_batcher`, and the report's names
in `_report`. An engine's tests import only from here.
"""

from __future__ import annotations

from collections.abc import Callable

from trio_vstream.engines.contract import Engine, GenerationRequest
from trio_vstream.engines.testing._batching import check_batching
from trio_vstream.engines.testing._chunks import check_full_run
from trio_vstream.engines.testing._deferred import check_deferred
from trio_vstream.engines.testing._interact import check_interact, check_window_offset
from trio_vstream.engines.testing._interface import check_interface
from trio_vstream.engines.testing._kit import Kit, Skip
from trio_vstream.engines.testing._probe import CheckpointStopped, StepFailed
from trio_vstream.engines.testing._report import RULES, EngineContractError, Violation
from trio_vstream.engines.testing._stop import check_close_unstepped, check_stops
from trio_vstream.engines.testing._video_input import check_video_input
from trio_vstream.values import VideoDefaults

__all__ = [
    "RULES",
    "CheckpointStopped",
    "EngineContractError",
    "StepFailed",
    "Violation",
    "check_engine",
    "default_request",
]


def default_request(engine: Engine) -> GenerationRequest:
    """The request `check_engine` uses when given none: the engine's video defaults (or
    `VideoDefaults`' own, if it has none), seed 1."""
    defaults = getattr(engine, "video_defaults", None)
    if not isinstance(defaults, VideoDefaults):
        defaults = VideoDefaults()  # the interface check reports it
    return GenerationRequest(
        request_id="check-engine",
        prompt="a red circle moving left",
        width=defaults.width,
        height=defaults.height,
        fps=defaults.fps,
        num_frames=defaults.num_frames,
        seed=1,
    )


def check_engine(
    factory: Callable[[], Engine],
    request: GenerationRequest | None = None,
    *,
    chunks: int = 2,
    timeout: float = 60.0,
    batch_atol: int = 1,
) -> None:
    """Drive the engine ``factory()`` makes through the contract's rules; raise
    `EngineContractError` naming each rule it broke.

    ``request`` is what every stream asks for (`default_request` when None): keep it
    small, as the kit runs many streams. One stream runs to its end, to check the frames
    it makes; the others run at most ``chunks`` chunks: one stopped at each of their
    checkpoints in turn, one failed at its first, two interacted with (a change while
    chunk 0 is made, and one received halfway through a window), and for an engine
    with ``max_batch`` > 1, a few stepped alone and then together, whose frames may
    differ by ``batch_atol`` levels (batched arithmetic sums in another order), and for an
    engine that takes input video, one fed an input chunk by chunk. An engine
    call that takes longer than ``timeout`` seconds counts as hung. The engine is closed
    at the end, once.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    engine = factory()
    if request is None:
        request = default_request(engine)
    kit = Kit(engine, request, chunks, timeout, batch_atol)
    _run(kit)
    if kit.violations:
        raise EngineContractError(
            str(getattr(engine, "name", type(engine).__name__)), kit.violations
        )


def _run(kit: Kit) -> None:
    """The rules, in the order they run; the engine is closed at the end, once."""
    try:
        check_interface(kit)
        full = check_full_run(kit)
        check_close_unstepped(kit)
        check_stops(kit, full)
        check_interact(kit, full)
        check_window_offset(kit, full)
        check_deferred(kit, full)
        check_batching(kit)
        check_video_input(kit)
    except Skip:
        pass
    finally:
        kit.close_engine()
