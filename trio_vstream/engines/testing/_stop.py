"""The stop, close and cancellation rules: how a stream ends, and that the engine
serves the next one.

A stream is closed before its first step, stopped at each checkpoint of its first chunks
in turn, and failed at its first step; each ending is followed by the next stream, which
is where an engine left in a bad state shows.
"""

from __future__ import annotations

from trio_vstream.engines.testing._kit import Hung, Kit, Run, Skip
from trio_vstream.engines.testing._probe import CheckpointStopped, Probe


def check_close_unstepped(kit: Kit) -> None:
    """A session may end between ``open_stream`` and its first step (its client left)."""
    stream = kit.open(kit.request)
    kit.close(stream, "before the stream's first step")


def check_stops(kit: Kit, full: Run) -> None:
    """Stop a stream at each checkpoint of its first chunks in turn, then fail one at
    its first step: each must end at once, close, and leave the engine serving."""
    steps = sum(full.steps_per_chunk[: kit.chunks])
    endings = [(f"a stop at checkpoint {k}", Probe(stop_at=k)) for k in range(1, steps + 1)]
    if steps:
        endings.append(("a failed first step", Probe(fail_at=1)))
    previous: str | None = None
    for what, probe in endings:
        stream = kit.open(kit.request, previous)
        try:
            run = kit.drive(stream, probe, kit.chunks)
        except Hung as exc:
            if probe.stopped:
                kit.fail("stop", f"{what}: {exc}: let the checkpoint's exception propagate")
            else:
                kit.fail("cancellation", f"{exc} (after {previous or 'a full stream'})")
            raise Skip from exc
        kit.close(stream, f"after {what}")
        if probe.stopped:
            check_stopped(kit, what, probe, run)
        elif not probe.failed and run.error is not None:
            kit.fail("cancellation", f"after {previous}, next_chunk {run.ending()}", once="raised")
        previous = what
    stream = kit.open(kit.request, previous)
    try:
        run = kit.drive(stream, Probe(), kit.chunks)
    except Hung as exc:
        kit.fail("cancellation", f"{exc} (after {previous})")
        raise Skip from exc
    kit.close(stream, "after the stream ended")
    if run.error is not None or len(run.chunks) < min(kit.chunks, len(full.chunks)):
        kit.fail("cancellation", f"after {previous}, the next stream {run.ending()}")


def check_stopped(kit: Kit, what: str, probe: Probe, run: Run) -> None:
    if probe.calls_after_stop:
        kit.fail(
            "stop",
            f"{what}: the engine called the checkpoint {probe.calls_after_stop} more "
            "time(s) after it raised: let its exception propagate (never catch "
            "BaseException around a checkpoint)",
            once="again",
        )
    elif not isinstance(run.error, CheckpointStopped):
        kit.fail(
            "stop",
            f"{what}: next_chunk {run.ending()} instead of raising the checkpoint's "
            "exception: let it propagate",
            once="propagate",
        )
