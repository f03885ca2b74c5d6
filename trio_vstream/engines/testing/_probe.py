"""The kit's checkpoint: `Probe`, and what it raises to stop (`CheckpointStopped`)
or fail (`StepFailed`) a stream.

Every rule drives streams through a `Probe`, counting their steps, stopping, failing or
parking them at one; it is the one piece of the server every rule's module plays, so it
lives on its own.

A stop is a ``BaseException`` (`CheckpointStopped`), as the server's is (``trio.Cancelled``),
so an engine that catches ``Exception`` around its steps still lets it through.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import cast

from trio_vstream.engines.contract import (
    BatchRunner,
    Checkpoint,
    In,
    Out,
    RunBatch,
    batch_result,
)
from trio_vstream.engines.testing._batcher import Batcher


class CheckpointStopped(BaseException):
    """What the kit's checkpoint raises to stop a stream: the session is over."""


class StepFailed(Exception):
    """What the kit's checkpoint raises to fail a step, as a failed batch row would."""


class Probe(Checkpoint, BatchRunner):
    """The kit's checkpoint for one stream: counts its steps, and may stop it at one,
    fail it at one, park it at one (until ``unpark`` is set), or batch its rows."""

    def __init__(
        self,
        *,
        stop_at: int | None = None,
        fail_at: int | None = None,
        park_at: int | None = None,
        batcher: Batcher | None = None,
    ) -> None:
        self.steps = 0
        """Steps begun: ``checkpoint()`` calls and batched steps."""
        self.stop_at, self.fail_at, self.park_at = stop_at, fail_at, park_at
        self.stopped = False
        """The stop was raised: from now on every call raises it again."""
        self.failed = False
        self.calls_after_stop = 0
        self.parked = threading.Event()
        self.unpark = threading.Event()
        self._batcher = batcher

    def __call__(self) -> None:
        self.check_cancelled()
        self.steps += 1
        if self.steps == self.park_at:
            self.parked.set()
            self.unpark.wait()
        if self.steps == self.stop_at:
            self.stopped = True
            raise CheckpointStopped
        if self.steps == self.fail_at:
            self.failed = True
            raise StepFailed(f"check_engine failed step {self.steps}")

    def check_cancelled(self) -> None:
        if self.stopped:
            self.calls_after_stop += 1
            raise CheckpointStopped

    @contextlib.contextmanager
    def batched_steps(
        self, run_batch: RunBatch[In, Out], key: Hashable
    ) -> Iterator[Callable[[In], Out]]:
        """`BatchRunner`'s side: with a batcher, each row is a step and then a row of a
        batch of ``key``'s rows; without, a step and then ``run_batch([row])``."""
        batcher = self._batcher

        def together(row: In) -> Out:
            self()
            if batcher is None:
                return batch_result(run_batch([row]), 0, 1)
            return cast(Out, batcher.step(key, run_batch, row))

        yield together
