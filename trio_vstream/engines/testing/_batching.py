"""The batching rule: an engine with ``max_batch`` > 1 makes the same frames for rows
stepped together as for rows stepped alone.

Its streams step together through `_batcher.Batcher`, which stands in for the server's
step batcher.
"""

from __future__ import annotations

import threading

import attrs

from trio_vstream.engines.interfaces import max_batch
from trio_vstream.engines.testing._batcher import Batcher
from trio_vstream.engines.testing._kit import Hung, Kit, Run, Skip, max_difference
from trio_vstream.engines.testing._probe import Probe


def check_batching(kit: Kit) -> None:
    """Streams stepped together make the frames they make stepped alone."""
    rows = min(max_batch(kit.engine), 3)
    if rows < 2:
        return
    seed = kit.request.seed or 0
    requests = [
        attrs.evolve(kit.request, request_id=f"{kit.request.request_id}-{i}", seed=seed + i)
        for i in range(rows)
    ]
    alone = []
    for request in requests:
        stream = kit.open(request)
        try:
            alone.append(kit.drive(stream, Probe(), kit.chunks, request))
        except Hung as exc:
            kit.fail("batching", f"{exc} (a stream stepped alone)")
            raise Skip from exc
        kit.close(stream, "after the stream ended")
    batcher = Batcher(max_batch(kit.engine), len(requests))
    streams = [kit.open(request) for request in requests]
    together: dict[int, Run] = {}

    def step_together(i: int) -> None:
        try:
            probe = Probe(batcher=batcher)
            together[i] = kit.drive(streams[i], probe, kit.chunks, requests[i], here=True)
        finally:
            batcher.stream_done()

    threads = [
        threading.Thread(target=step_together, args=(i,), name="check_engine: batched", daemon=True)
        for i in range(len(requests))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(kit.timeout)
    if len(together) < len(requests):
        batcher.give_up()
        kit.fail("batching", f"streams stepped together did not end within {kit.timeout:g} s")
        raise Skip
    for stream in streams:
        kit.close(stream, "after the stream ended")
    for i, (request, single) in enumerate(zip(requests, alone, strict=True)):
        compare(kit, request.request_id, together[i], single, max(batcher.sizes, default=0))


def compare(kit: Kit, request_id: str, together: Run, alone: Run, largest: int) -> None:
    for run, how in ((together, "together"), (alone, "alone")):
        if run.error is not None:
            kit.fail("batching", f"{request_id}, stepped {how}: next_chunk {run.ending()}")
            return
    if len(together.frames) != len(alone.frames):
        kit.fail(
            "batching",
            f"{request_id}: {len(together.frames)} chunks stepped "
            f"together, {len(alone.frames)} alone",
        )
        return
    for index, (a, b) in enumerate(zip(together.frames, alone.frames, strict=True)):
        difference = max_difference(a, b)
        if difference > kit.batch_atol:
            kit.fail(
                "batching",
                f"{request_id}, chunk {index}: the frames stepped together (batches of "
                f"up to {largest} rows) differ from those stepped alone by up to "
                f"{difference} levels (allowed: {kit.batch_atol})",
                once="differ",
            )
            return
