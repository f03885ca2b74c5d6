"""Prompt words the shapes model does not know are remembered for the log, within a bound.

A client may send a new made-up word in every prompt, for as long as the server runs;
what the engine keeps about them must not grow with that.
"""

from __future__ import annotations

import logging

import pytest

from trio_vstream.engines.shapes import MAX_REPORTED_WORDS, ShapesEngine, create_engine


@pytest.fixture(scope="module")
def engine() -> ShapesEngine:
    return create_engine(device="cpu")


def test_made_up_words_do_not_grow_the_engine_without_bound(
    engine: ShapesEngine, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = MAX_REPORTED_WORDS + 500
    with caplog.at_level(logging.INFO, logger="trio_vstream.engines.shapes"):
        for i in range(prompts):
            engine.report_unknown((f"zzword{i}", f"zzword{i}"), f"req-{i}")
    assert len(engine._reported_words) == MAX_REPORTED_WORDS
    # Every prompt's unknown word is still said once, remembered or not.
    logged = [r for r in caplog.records if "unknown prompt word" in r.getMessage()]
    assert len(logged) == prompts
    assert all(r.getMessage().count("zzword") == 1 for r in logged)


def test_a_remembered_word_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    fresh = create_engine(device="cpu")
    with caplog.at_level(logging.INFO, logger="trio_vstream.engines.shapes"):
        fresh.report_unknown(("blorp",), "a")
        fresh.report_unknown(("blorp",), "b")
    assert sum("blorp" in r.getMessage() for r in caplog.records) == 1
