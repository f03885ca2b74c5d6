"""PromptSchedule: the reference's transition semantics, without any engine."""

from __future__ import annotations

import threading

import pytest

from trio_vstream.engines.contract import PromptChange
from trio_vstream.engines.transitions import PromptSchedule


def weights(schedule_output: object) -> dict[str, float]:
    return {p: round(w, 6) for p, w in schedule_output.mix}  # type: ignore[attr-defined]


def test_without_interactions_every_chunk_uses_the_prompt() -> None:
    schedule = PromptSchedule("a")
    for _ in range(3):
        c = schedule.next_conditioning()
        assert weights(c) == {"a": 1.0}
        assert c.started_event_ids == c.active_event_ids == c.completed_event_ids == ()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_blend_reaches_target_on_the_nth_chunk(n: int) -> None:
    schedule = PromptSchedule("old")
    schedule.next_conditioning()
    schedule.push(PromptChange("e", "new", n))
    seen = [schedule.next_conditioning() for _ in range(n + 1)]
    for k, c in enumerate(seen[:n], start=1):
        assert weights(c)["new"] == pytest.approx(k / n)
    assert weights(seen[n - 1]) == {"new": 1.0}
    assert seen[0].started_event_ids == ("e",)
    assert [c.active_event_ids for c in seen] == [("e",)] * (n - 1) + [(), ()]
    assert [c.completed_event_ids for c in seen] == [()] * (n - 1) + [("e",), ()]


@pytest.mark.parametrize("n", [0, 1])
def test_zero_or_one_chunk_is_a_hard_switch(n: int) -> None:
    schedule = PromptSchedule("old")
    schedule.push(PromptChange("e", "new", n))
    c = schedule.next_conditioning()
    assert weights(c) == {"new": 1.0}
    assert c.started_event_ids == ("e",) and c.completed_event_ids == ("e",)
    assert c.active_event_ids == ()


def test_default_transition_is_three_chunks() -> None:
    schedule = PromptSchedule("old")
    schedule.push(PromptChange("e", "new"))
    assert weights(schedule.next_conditioning())["new"] == pytest.approx(1 / 3)


def test_a_newer_event_supersedes_one_still_blending() -> None:
    schedule = PromptSchedule("a")
    schedule.push(PromptChange("e1", "b", 2))
    first = schedule.next_conditioning()
    assert weights(first) == {"a": 0.5, "b": 0.5}
    schedule.push(PromptChange("e2", "c", 2))
    second = schedule.next_conditioning()
    # e1 is completed (superseded); the blend restarts from the 50/50 mix.
    assert second.completed_event_ids == ("e1",)
    assert second.started_event_ids == ("e2",) and second.active_event_ids == ("e2",)
    assert weights(second) == {"a": 0.25, "b": 0.25, "c": 0.5}
    third = schedule.next_conditioning()
    assert weights(third) == {"c": 1.0} and third.completed_event_ids == ("e2",)
    assert sum(w for _, w in second.mix) == pytest.approx(1.0)


def test_two_events_at_one_boundary_apply_in_order() -> None:
    schedule = PromptSchedule("a")
    schedule.push(PromptChange("e1", "b", 0))
    schedule.push(PromptChange("e2", "c", 0))
    c = schedule.next_conditioning()
    assert c.started_event_ids == ("e1", "e2")
    assert c.completed_event_ids == ("e1", "e2")
    assert weights(c) == {"c": 1.0}
    assert c.prompt == "c"


def test_push_from_another_thread_is_safe() -> None:
    schedule = PromptSchedule("a")
    threads = [
        threading.Thread(target=schedule.push, args=(PromptChange(f"e{i}", f"p{i}", 0),))
        for i in range(50)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = schedule.next_conditioning()
    assert sorted(c.started_event_ids) == sorted(f"e{i}" for i in range(50))


def test_a_camera_only_change_is_refused_at_once() -> None:
    schedule = PromptSchedule("a")
    with pytest.raises(ValueError, match="needs a prompt"):
        schedule.push(PromptChange("e", None))
    assert schedule.next_conditioning().started_event_ids == ()
