"""`session_interactions.Interactions`: which live interactions a session accepts, and
when its engine gets each, called directly (the sessions' tests drive it over a socket)."""

from __future__ import annotations

import pytest

from trio_vstream import protocol
from trio_vstream.engines.contract import EngineError, PromptChange
from trio_vstream.protocol import ErrorCode
from trio_vstream.session.interaction_queue import InteractionQueue
from trio_vstream.session.interactions import VIDEO_ENDED, Interactions
from trio_vstream.session.scripts import Scripts
from trio_vstream.values import Camera

CAMERA = Camera("velocity", (0.1, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))


class Stream:
    """An engine stream that keeps what it is handed, or refuses the ids in ``refuse``."""

    def __init__(self, refuse: tuple[str, ...] = (), crash: tuple[str, ...] = ()) -> None:
        self.refuse = refuse
        self.crash = crash
        self.handed: list[PromptChange] = []

    def interact(self, change: PromptChange) -> None:
        if change.event_id in self.refuse:
            raise EngineError("no such motion")
        if change.event_id in self.crash:
            raise RuntimeError("a bug in the engine")
        self.handed.append(change)


def prompt(text: str = "a blue square") -> protocol.Interaction:
    return protocol.Interaction(None, text)


def camera() -> protocol.Interaction:
    return protocol.Interaction(None, None, 0, CAMERA)


def scripts_owning_camera() -> Scripts:
    scripts = Scripts()
    scripts.owns_camera = True
    scripts.event_ids = {"script-0"}
    return scripts


def test_an_accepted_interaction_goes_to_the_engine_at_once_unpaced() -> None:
    interactions = Interactions(frozenset({"prompt"}))
    stream = Stream()
    assert interactions.accept("e1", prompt(), stream, now=0.0) is None
    assert [c.event_id for c in stream.handed] == ["e1"]
    assert stream.handed[0].window_offset == 0.0
    assert interactions.queue.pending == 1  # until a chunk lists it as started
    interactions.queue.started(["e1"])
    assert interactions.queue.pending == 0


@pytest.mark.parametrize(
    ("kinds", "scripts", "message", "stream", "code", "text"),
    [
        ({"prompt"}, Scripts(), camera(), Stream(), ErrorCode.INTERACTION_FAILED, "camera"),
        (
            {"prompt", "camera"},
            scripts_owning_camera(),
            camera(),
            Stream(),
            ErrorCode.INTERACTION_FAILED,
            "camera_action_script",
        ),
        ({"prompt"}, Scripts(), prompt(), None, ErrorCode.INTERACTION_FAILED, "Failed to apply"),
        (
            {"prompt"},
            Scripts(),
            prompt(),
            Stream(refuse=("e1",)),
            ErrorCode.INTERACTION_FAILED,
            "Failed to apply interaction: no such motion",
        ),
        (
            {"prompt"},
            Scripts(),
            prompt(),
            Stream(crash=("e1",)),
            ErrorCode.INTERACTION_FAILED,
            "Failed to apply interaction",
        ),
    ],
)
def test_each_refusal_says_why_and_leaves_the_event_id_free(
    kinds: set[str],
    scripts: Scripts,
    message: protocol.Interaction,
    stream: Stream | None,
    code: ErrorCode,
    text: str,
) -> None:
    interactions = Interactions(frozenset(kinds))
    interactions.prepared(scripts, InteractionQueue())
    refusal = interactions.accept("e1", message, stream, now=0.0)
    assert refusal is not None
    assert refusal[0] is code
    assert text in refusal[1]
    assert "e1" not in interactions.event_ids
    assert interactions.queue.pending == 0
    # The same id is accepted once the cause is gone.
    assert interactions.accept("e1", prompt(), Stream(), now=0.0) is None


def test_an_event_id_in_use_or_a_scripts_own_is_a_conflict() -> None:
    interactions = Interactions(frozenset({"prompt", "camera"}))
    interactions.prepared(scripts_owning_camera(), InteractionQueue())
    stream = Stream()
    assert interactions.accept("e1", prompt(), stream, now=0.0) is None
    for used in ("e1", "script-0"):
        refusal = interactions.accept(used, prompt(), stream, now=0.0)
        assert refusal == (ErrorCode.EVENT_ID_CONFLICT, "event_id_conflict")
    assert [c.event_id for c in stream.handed] == ["e1"]


def test_a_full_queue_is_its_own_refusal_and_hands_nothing_over() -> None:
    interactions = Interactions(frozenset({"prompt"}))
    interactions.prepared(Scripts(), InteractionQueue(limit=2))
    stream = Stream()
    for event_id in ("a", "b"):
        assert interactions.accept(event_id, prompt(), stream, now=0.0) is None
    refusal = interactions.accept("c", prompt(), stream, now=0.0)
    assert refusal is not None and refusal[0] is ErrorCode.INTERACTION_QUEUE_FULL
    assert "'c'" in refusal[1]
    assert [c.event_id for c in stream.handed] == ["a", "b"]
    interactions.queue.started(["a"])  # a chunk started one: room again
    assert interactions.accept("c", prompt(), stream, now=0.0) is None


def test_a_paced_camera_session_holds_each_interaction_for_its_window() -> None:
    interactions = Interactions(frozenset({"prompt", "camera"}))
    interactions.prepared(Scripts(), InteractionQueue(windows=True))
    stream = Stream(refuse=("refused",))
    interactions.queue.open_window(10.0, 0.5)  # the last chunk began at 10 s: 0.5 s of media
    assert interactions.accept("early", camera(), stream, now=10.1) is None
    assert interactions.accept("refused", camera(), stream, now=10.2) is None
    assert interactions.accept("late", camera(), stream, now=10.5) is None
    assert stream.handed == []  # held, not handed
    refused = interactions.take_due(stream)
    assert [(c.event_id, c.window_offset) for c in stream.handed] == [("early", pytest.approx(0.2))]
    assert [(event_id, error[0]) for event_id, error in refused] == [
        ("refused", ErrorCode.INTERACTION_FAILED)
    ]
    assert "refused" not in interactions.event_ids  # free for a retry
    assert interactions.queue.pending == 2  # "early" handed, "late" still held


def test_a_generated_chunk_ends_its_interactions_pending_and_opens_its_window() -> None:
    interactions = Interactions(frozenset({"prompt", "camera"}))
    interactions.prepared(Scripts(), InteractionQueue(windows=True))
    stream = Stream()
    assert interactions.accept("held", camera(), stream, now=0.0) is None
    assert interactions.take_due(stream) == []  # before the first chunk: from its start
    assert interactions.queue.pending == 1 and interactions.deadline is None
    interactions.chunk_generated(["held"], began=10.0, seconds=0.5, frame=1 / 24)
    assert interactions.queue.pending == 0 and interactions.deadline == 10.5
    # Woke 10 ms after that deadline: the next window keeps to the media clock.
    interactions.chunk_generated([], began=10.51, seconds=0.5, frame=1 / 24)
    assert interactions.deadline == 11.0


def test_when_the_video_ends_the_held_interactions_are_refused_and_so_is_any_later() -> None:
    interactions = Interactions(frozenset({"prompt", "camera"}))
    interactions.prepared(Scripts(), InteractionQueue(windows=True))
    stream = Stream()
    interactions.queue.open_window(10.0, 0.5)
    assert interactions.accept("first", camera(), stream, now=10.1) is None
    assert interactions.accept("second", camera(), stream, now=10.6) is None
    refused = interactions.end()
    assert refused == [
        ("first", (ErrorCode.INTERACTION_FAILED, VIDEO_ENDED)),
        ("second", (ErrorCode.INTERACTION_FAILED, VIDEO_ENDED)),
    ]
    assert "video ended" in VIDEO_ENDED
    assert stream.handed == [] and interactions.queue.pending == 0
    # The stream is still open (it closes a moment later), but makes no more chunks.
    assert interactions.accept("after", camera(), stream, now=10.7) == (
        ErrorCode.INTERACTION_FAILED,
        VIDEO_ENDED,
    )
    assert stream.handed == []
    assert interactions.end() == []
