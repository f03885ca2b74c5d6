"""The interact rule: ``interact`` only queues, and a change starts at the next
chunk, one received mid-window too.

The server counts on it: an interaction is pending until a chunk lists it in
``started_event_ids``, and a session may have only so many pending.
"""

from __future__ import annotations

import threading

from trio_vstream.engines.contract import PromptChange
from trio_vstream.engines.interfaces import interaction_kinds
from trio_vstream.engines.testing._kit import Hung, Kit, Run, Skip, in_thread
from trio_vstream.engines.testing._probe import Probe
from trio_vstream.values import Camera


def interaction(kit: Kit, event_id: str, window_offset: float = 0.0) -> PromptChange | None:
    """A change of a kind the engine takes (a prompt, else a camera); None if none."""
    kinds = interaction_kinds(kit.engine)
    if "prompt" in kinds:
        return PromptChange(event_id, "a blue square moving up", 0, window_offset=window_offset)
    if "camera" in kinds:
        camera = Camera("velocity", (0.0, 0.0, 1.0), (0.0, 0.0, 0.0, 1.0))
        return PromptChange(event_id, None, 0, camera, window_offset=window_offset)
    return None


def check_interact(kit: Kit, full: Run) -> None:
    """A change arrives while ``next_chunk`` waits in the last checkpoint of chunk 0,
    as one from a client arrives while the engine works: ``interact`` must return
    then, and the change start at chunk 1.

    Listing it in chunk 1's ``started_event_ids`` is what the server counts on: an
    interaction is pending until a chunk lists it there, and a session may have at
    most `protocol.MAX_PENDING_INTERACTIONS` pending (`trio_vstream.session.interaction_queue`),
    so an engine that never lists them ends its sessions' video requests after 64."""
    change = interaction(kit, "check-engine-1")
    if change is None:
        return
    if not full.steps_per_chunk or not full.steps_per_chunk[0]:
        return  # no checkpoint to wait in (the checkpoint rule said so)
    stream = kit.open(kit.request)
    probe = Probe(park_at=full.steps_per_chunk[0])
    queued = False
    first: list[Run] = []
    making = threading.Thread(
        target=lambda: first.append(kit.drive(stream, probe, 1, here=True)),
        name="check_engine: next_chunk",
        daemon=True,
    )
    making.start()
    try:
        if not probe.parked.wait(kit.timeout):
            kit.fail(
                "interact",
                f"next_chunk did not reach checkpoint {probe.park_at} within {kit.timeout:g} s",
            )
            raise Skip
        try:
            in_thread("interact", kit.timeout, stream.interact, change)
            queued = True
        except Hung:
            kit.fail(
                "interact",
                "interact did not return while next_chunk waited in a checkpoint: it "
                "must only queue the change (PromptSchedule does), never wait for the chunk",
            )
        except Exception as exc:
            kit.fail("interact", f"interact raised {exc!r}")
    finally:
        probe.unpark.set()
    making.join(kit.timeout)
    if not first:
        kit.fail("interact", f"next_chunk did not return within {kit.timeout:g} s")
        raise Skip
    if queued and first[0].error is None and len(full.chunks) > 1:
        try:
            following = kit.drive(stream, probe, 1, made=len(first[0].chunks))
        except Hung as exc:
            kit.fail("interact", f"{exc} (the chunk after an interaction)")
            raise Skip from exc
        check_started(kit, change.event_id, first[0], following)
    elif first[0].error is not None:
        kit.fail("interact", f"next_chunk {first[0].ending()} after an interaction")
    kit.close(stream, "after an interaction")


def check_window_offset(kit: Kit, full: Run) -> None:
    """A change received halfway through chunk 1's action window (a paced session's,
    ``window_offset`` 0.5) starts at chunk 1 like any other: an engine may place it
    inside the chunk or apply it from the chunk's start, but never drop or defer it."""
    change = interaction(kit, "check-engine-offset", window_offset=0.5)
    if change is None or len(full.chunks) < 2:
        return
    stream = kit.open(kit.request)
    try:
        first = kit.drive(stream, Probe(), 1)
        if first.error is not None or not first.chunks:
            kit.fail("interact", f"next_chunk {first.ending()} before a mid-window change")
            kit.close(stream, "after a failed chunk")
            return
        try:
            in_thread("interact", kit.timeout, stream.interact, change)
        except Exception as exc:  # Hung too: interact must only queue
            kit.fail("interact", f"interact({change!r}) raised {exc!r}")
            raise Skip from exc
        following = kit.drive(stream, Probe(), 1, made=1)
    except Hung as exc:
        kit.fail("interact", f"{exc} (a change with window_offset 0.5)")
        raise Skip from exc
    kit.close(stream, "after a mid-window change")
    if following.error is not None:
        kit.fail("interact", f"a change with window_offset 0.5: next_chunk {following.ending()}")
    elif not any(change.event_id in chunk.started_event_ids for chunk in following.chunks):
        kit.fail(
            "interact",
            "a change with window_offset 0.5 is not in the next chunk's "
            "started_event_ids: place it in the chunk or apply it from the chunk's "
            "start, but start it there",
        )


def check_started(kit: Kit, event_id: str, first: Run, following: Run) -> None:
    if following.error is not None:
        kit.fail("interact", f"the chunk after an interaction: next_chunk {following.ending()}")
    elif any(event_id in chunk.started_event_ids for chunk in first.chunks):
        kit.fail(
            "interact",
            "a change that arrived while chunk 0 was being made started in chunk 0: "
            "queue it for the next chunk boundary",
        )
    elif not any(event_id in chunk.started_event_ids for chunk in following.chunks):
        kit.fail(
            "interact",
            "the chunk after an interaction does not list it in started_event_ids: "
            "a change starts at the next chunk",
        )
