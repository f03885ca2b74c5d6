"""The soak's held engine (``bench/_soak/held_engine.py``): a client's hold token is
checked before it names a file; the sessions of one token batch together and apart
from others; a batch of two or more of their rows blocks until the token's file
exists, a single row never; and with its file there, the engine keeps the engine
contract (`check_engine`, which also steps streams together).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from bench._soak.held_engine import (
    MAX_BATCH,
    HeldEngine,
    HeldStep,
    create_engine,
    hold_token,
)
from trio_vstream.engines.contract import EngineConfigError, GenerationRequest, InvalidRequestError
from trio_vstream.engines.testing import check_engine


def test_a_token_must_be_short_lower_case_letters_digits_and_dashes() -> None:
    assert hold_token({}) is None
    assert hold_token({"chunk_frames": 4}) is None
    assert hold_token({"hold": "wedge-0-0a1b2c"}) == "wedge-0-0a1b2c"
    assert hold_token({"hold": "a" * 32}) == "a" * 32
    for bad in ("../etc/passwd", "a/b", "a.b", "..", "", "A", "a" * 33, "a b", 5, None, ["a"]):
        with pytest.raises(InvalidRequestError, match=r"extra_params\.hold must be"):
            hold_token({"hold": bad})


def _rows(results: list[Any]) -> Any:
    def run(steps: Sequence[Any]) -> list[Any]:
        results.append(list(steps))
        return [f"x0 of {step}" for step in steps]

    return run


def test_the_sessions_of_one_token_batch_together_and_apart_from_others(tmp_path: Path) -> None:
    """The server's batcher groups rows by their batched-step function: every stream of
    one token has its own `HeldStep`, equal (and hashed alike) to the others of the
    token, and to no other token's."""
    run = _rows([])
    one, same = HeldStep("t-1", tmp_path / "t-1", run), HeldStep("t-1", tmp_path / "t-1", run)
    other = HeldStep("t-2", tmp_path / "t-2", run)
    assert one == same and hash(one) == hash(same)
    assert one != other
    assert len({one: 1, same: 2, other: 3}) == 2


def test_a_batch_of_two_rows_is_held_until_the_tokens_file_exists(tmp_path: Path) -> None:
    calls: list[Any] = []
    step = HeldStep("w-1", tmp_path / "w-1", _rows(calls))
    assert step(["alone"]) == ["x0 of alone"]  # a row alone is never held
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(step(["a", "b"])), daemon=True)
    thread.start()
    assert step.held.wait(timeout=10), "the batch of two was not held"
    assert thread.is_alive() and results == [] and calls == [["alone"]]
    (tmp_path / "w-1").touch()  # the release
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert results == [["x0 of a", "x0 of b"]] and calls == [["alone"], ["a", "b"]]
    # Released, the token holds nothing any more.
    assert step(["c", "d"]) == ["x0 of c", "x0 of d"]


def test_the_engine_needs_a_hold_directory(tmp_path: Path) -> None:
    with pytest.raises(EngineConfigError, match="hold_dir=DIR is required"):
        create_engine(device="cpu")
    with pytest.raises(EngineConfigError, match="is not a directory"):
        create_engine(device="cpu", hold_dir=str(tmp_path / "missing"))


REQUEST = GenerationRequest(
    request_id="held",
    prompt="a red circle moving left",
    width=32,
    height=32,
    fps=8,
    num_frames=16,
    seed=1,
)


@pytest.mark.slow
def test_with_its_file_there_the_held_engine_keeps_the_contract(tmp_path: Path) -> None:
    """Streams of a released token, stepped alone and together by the kit: the held
    step is the shapes engine's, the token taken out of the request before shapes sees
    it (shapes refuses any extra parameter but ``chunk_frames``)."""
    (tmp_path / "done").touch()
    engines: list[HeldEngine] = []

    def factory() -> HeldEngine:
        engines.append(create_engine(device="cpu", hold_dir=str(tmp_path)))
        return engines[-1]

    check_engine(factory, attrs.evolve(REQUEST, extra_params={"hold": "done"}))
    assert engines[0].max_batch == MAX_BATCH == 4 and engines[0].name == "held"
    with pytest.raises(InvalidRequestError, match=r"extra_params\.hold must be"):
        engines[0].open_stream(attrs.evolve(REQUEST, extra_params={"hold": "../done"}))
