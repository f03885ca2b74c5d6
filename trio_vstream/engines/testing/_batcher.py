"""Several streams' batched rows run as batches, from the streams' own threads.

The server's ``StepBatcher`` is Trio code, and the kit is plain threads (the import
contracts keep Trio out of ``engines/``): `Batcher` plays its part for the batching rule
(`_batching`), which the kit's checkpoint (`_probe.Probe`) hands each batched row to.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any

import attrs

from trio_vstream.engines.contract import EngineError, RunBatch, batch_result


@attrs.define(eq=False)
class Row:
    run_batch: RunBatch[Any, Any]
    data: Any
    results: Sequence[Any] = ()
    index: int = 0
    done: bool = False


class Batcher:
    """Runs the rows of several streams' batched steps (``engines.batched``) as batches,
    as the server's ``StepBatcher`` does, but from the streams' own threads: the rows of
    one key run as one call (the ``run_batch`` of the batch's first row) once every
    stream still running has handed over its row (or ``max_batch`` rows wait, or every
    stream waits), in the thread of the row that completed the batch.
    Waiting for every live stream, where the server waits only for those inside
    ``batched()``, makes each batch as large as it can be, so that rows of different
    streams surely meet."""

    def __init__(self, max_batch: int, streams: int) -> None:
        self.max_batch = max_batch
        self.live = streams
        """Streams not yet finished (`stream_done`)."""
        self.sizes: list[int] = []
        """Each batch's row count."""
        self._given_up = False
        self._queues: dict[Any, list[Row]] = {}
        self._running = False
        self._changed = threading.Condition()

    def stream_done(self) -> None:
        with self._changed:
            self.live -= 1
            self._changed.notify_all()

    def give_up(self) -> None:
        """Fail every waiting row: the kit stopped waiting for the streams."""
        with self._changed:
            self._given_up = True
            self._changed.notify_all()

    def step(self, key: Hashable, run_batch: RunBatch[Any, Any], data: Any) -> Any:
        row = Row(run_batch, data)
        with self._changed:
            self._queues.setdefault(key, []).append(row)
            self._changed.notify_all()
            while not row.done:
                if self._given_up:
                    raise EngineError("check_engine stopped waiting for this batch")
                queue = self._queues.get(key, [])
                waiting = sum(len(rows) for rows in self._queues.values())
                # Every live stream's row is in, or as many as a batch takes; or every
                # stream waits, some with another key: then rows of this one go.
                full = len(queue) >= min(self.max_batch, self.live) or waiting >= self.live
                if not self._running and queue and full:
                    self._run(key, queue)
                else:
                    self._changed.wait()
        return batch_result(row.results, row.index, len(row.results))

    def _run(self, key: Hashable, queue: list[Row]) -> None:
        """Run the oldest rows of ``key``'s ``queue`` with the first one's ``run_batch``:
        called, and returning, with the lock held, which is let go while it runs."""
        rows = queue[: self.max_batch]
        del queue[: len(rows)]
        if not queue:
            del self._queues[key]
        run_batch = rows[0].run_batch
        self._running = True
        self._changed.release()
        try:
            try:
                results: Sequence[Any] = run_batch([row.data for row in rows])
            except Exception as exc:  # the whole batch failed: every row fails with it
                results = [exc] * len(rows)
        finally:
            self._changed.acquire()
            self._running = False
        for index, row in enumerate(rows):
            row.results, row.index, row.done = results, index, True
        self.sizes.append(len(rows))
        self._changed.notify_all()
