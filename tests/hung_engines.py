"""Engines that hang, for tests that run the server as a process
(``python -m trio_vstream --engine tests.hung_engines:NAME``, from the repository root).

Each hangs the way a wedged GPU does, outside any checkpoint, on an event nobody sets:
the process around it must still answer its clients and end on SIGTERM. What they leave
hanging dies with the test's process, which is the point of the tests that use them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trio_vstream.engines import shapes
from trio_vstream.engines.synthetic import SyntheticEngine, parse_settings

_NEVER = threading.Event()
"""What the hung calls wait for: never set."""


class _CloseHangs(SyntheticEngine):
    def close(self) -> None:
        """Freeing the model blocks in the driver, for good (the blocks stay blocked)."""
        _NEVER.wait()


def synthetic_whose_close_hangs(*, device: str = "auto", **args: str) -> SyntheticEngine:
    """The synthetic engine, but its ``close`` (run after the server stopped) never returns."""
    return _CloseHangs(parse_settings(args))


def synthetic_with_a_stuck_thread(*, device: str = "auto", **args: str) -> SyntheticEngine:
    """The synthetic engine, with a non-daemon thread of its own that never ends: the
    interpreter joins such threads at exit, for good."""
    threading.Thread(target=_NEVER.wait, name="engine's own worker", daemon=False).start()
    return SyntheticEngine(parse_settings(args))


def shapes_whose_batches_hang(*, device: str = "auto", **args: str) -> shapes.ShapesEngine:
    """The built-in model (``max_batch`` as given) whose batched forward hangs once it
    holds two rows or more, outside any checkpoint; a lone row steps as usual."""
    engine = shapes.create_engine(device="cpu", **args)
    forward = engine.run_batch

    def run_batch(steps: Sequence[Any]) -> list[Any]:
        if len(steps) > 1:
            _NEVER.wait()
        return forward(steps)

    engine.run_batch = run_batch  # type: ignore[method-assign]
    return engine


def shapes_whose_batches_wait(*, device: str = "auto", **args: str) -> shapes.ShapesEngine:
    """The built-in model whose batched forward of two rows or more, each time, writes
    ``entered`` into the folder ``markers`` (an engine arg) and waits, outside any
    checkpoint, until a file ``release`` appears there (at most 60 s); then it runs, and
    writes ``returned``: a step that is slow, not hung."""
    markers = Path(args.pop("markers"))
    engine = shapes.create_engine(device="cpu", **args)
    forward = engine.run_batch

    def run_batch(steps: Sequence[Any]) -> list[Any]:
        if len(steps) > 1:
            (markers / "entered").touch()
            waited_until = time.monotonic() + 60.0
            while not (markers / "release").exists() and time.monotonic() < waited_until:
                time.sleep(0.01)  # another process's file: nothing to wait on
        results = forward(steps)
        if len(steps) > 1:
            (markers / "returned").touch()
        return results

    engine.run_batch = run_batch  # type: ignore[method-assign]
    return engine
