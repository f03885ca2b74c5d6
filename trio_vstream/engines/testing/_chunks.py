"""The chunks and checkpoint rules: one stream run to its end.

This run is what the other rules build on: its chunks are the frames the deferred and
batching rules compare against, and its steps per chunk are where the stop and interact
rules stop or park a stream.
"""

from __future__ import annotations

from trio_vstream.engines.testing._audio import check_audio
from trio_vstream.engines.testing._kit import Hung, Kit, Run, Skip
from trio_vstream.engines.testing._probe import Probe


def check_full_run(kit: Kit) -> Run:
    """One stream to its end: the chunks and checkpoint rules, and how many steps each
    chunk takes, where the other checks stop or park a stream."""
    stream = kit.open(kit.request)
    try:
        run = kit.drive(stream, Probe(), None)
    except Hung as exc:
        kit.fail("chunks", f"{exc} (a stream run to its end)")
        raise Skip from exc
    kit.close(stream, "after the stream ended")
    if run.error is not None:
        kit.fail("chunks", f"next_chunk raised {run.error!r} (a stream run to its end)")
        raise Skip
    for index, steps in enumerate(run.steps_per_chunk):
        if not steps:
            kit.fail(
                "checkpoint",
                f"chunk {index} was made without calling checkpoint(): call it before "
                "each step and the decode, or a stop cannot reach the stream",
            )
            break
    if kit.sound is not None:
        check_audio(kit, run, kit.sound)
    total = sum(len(frames) for frames in run.frames)
    asked = kit.request.num_frames
    if total != asked and not kit.reported("chunks", "frames"):
        kit.fail(
            "chunks",
            f"the stream {run.ending()}, {total} frames; the request asked for {asked}",
        )
    return run
