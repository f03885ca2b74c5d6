"""The shapes prompt parser: deterministic, forgiving, and honest about what it ignored."""

from __future__ import annotations

import pytest

from trio_vstream.models.shapes.vocab import (
    BACKGROUNDS,
    OBJECT_COLOURS,
    SeedDefaults,
    Slots,
    fill_slots,
    parse_prompt,
    vocabulary_table,
)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (
            "a red circle moving left on a black background",
            Slots("red", "circle", "left", "black", None),
        ),
        (
            "A BIG Blue BALL, falling -- grey backdrop!!",
            Slots("blue", "circle", "down", "gray", "large"),
        ),
        ("tiny yellow box sliding to the right", Slots("yellow", "square", "right", None, "small")),
        (
            "navy background with a cyan wedge rising",
            Slots("cyan", "triangle", "up", "navy", None),
        ),
        (
            "one orange triangle standing still over dark green",
            Slots("orange", "triangle", "still", "dark green", None),
        ),
        ("white square not moving, on white", Slots("white", "square", "still", None, None)),
        ("purple", Slots("purple", None, None, None, None)),
        ("", Slots()),
    ],
)
def test_prompts_parse_to_slots(prompt: str, expected: Slots) -> None:
    assert parse_prompt(prompt).slots == expected


def test_unknown_words_are_reported_once_each_and_ignored() -> None:
    parsed = parse_prompt("a majestic red circle, majestic and shiny, moving up")
    assert parsed.slots == Slots("red", "circle", "up", None, None)
    assert parsed.unknown_words == ("majestic", "shiny")


def test_colour_outside_its_palette_goes_to_the_nearest_one_with_a_note() -> None:
    parsed = parse_prompt("a navy circle on a blue background")
    assert parsed.slots.colour == "blue"
    assert parsed.slots.background == "navy"
    assert any("navy" in note for note in parsed.notes)


def test_first_mention_wins() -> None:
    parsed = parse_prompt("a red circle, no, a green square")
    assert (parsed.slots.colour, parsed.slots.shape) == ("red", "circle")
    assert len(parsed.notes) == 2


def test_missing_slots_come_from_the_seed_deterministically() -> None:
    slots = parse_prompt("a circle").slots
    first = fill_slots(slots, SeedDefaults.from_seed(7))
    assert first == fill_slots(slots, SeedDefaults.from_seed(7))
    assert first.shape == "circle"
    assert None not in (first.colour, first.motion, first.background, first.size)
    drawn = {fill_slots(Slots(), SeedDefaults.from_seed(seed)) for seed in range(40)}
    assert len(drawn) > 20  # the seed really draws


def test_background_is_never_the_object_colour() -> None:
    for seed in range(50):
        filled = fill_slots(Slots(colour="white"), SeedDefaults.from_seed(seed))
        assert filled.background != "white"
    explicit = fill_slots(parse_prompt("white circle on white").slots, SeedDefaults.from_seed(1))
    assert explicit.background in BACKGROUNDS and explicit.background != "white"


def test_vocabulary_table_lists_every_value() -> None:
    text = vocabulary_table()
    for name in (*OBJECT_COLOURS, *BACKGROUNDS, "circle", "triangle", "still", "large"):
        assert name in text
