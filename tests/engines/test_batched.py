"""`trio_vstream.engines.batched`: how an engine enters batching. A plain `Checkpoint`
runs each row alone; a `BatchRunner` gets the rows with their key; the deprecated
``Checkpoint.batched`` still works, and warns."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import pytest

from trio_vstream.engines import (
    BatchRunner,
    Checkpoint,
    EngineError,
    RunBatch,
    batch_result,
    batched,
    checkpoint_calling,
)
from trio_vstream.scheduling.checkpoint import SessionCheckpoint


class Recorder:
    """A ``run_batch`` adding one to each row, which records the batches it ran."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, rows: Sequence[int]) -> list[int | Exception]:
        self.batches.append(list(rows))
        return [ValueError(f"row {row}") if row < 0 else row + 1 for row in rows]


class Runner(Checkpoint):
    """A checkpoint that is a `BatchRunner`: records what it was handed, runs rows alone."""

    def __init__(self) -> None:
        self.entered: list[tuple[RunBatch[Any, Any], Hashable]] = []

    @contextlib.contextmanager
    def batched_steps(self, run_batch: RunBatch[Any, Any], key: Hashable) -> Iterator[Any]:
        self.entered.append((run_batch, key))
        yield lambda row: batch_result(run_batch([row]), 0, 1)


def counting() -> tuple[Checkpoint, list[str]]:
    events: list[str] = []
    return checkpoint_calling(lambda: events.append("step")), events


def test_a_plain_checkpoint_runs_each_row_alone_after_a_step() -> None:
    checkpoint, events = counting()
    run_batch = Recorder()
    original = run_batch.__call__

    def recording(rows: Sequence[int]) -> list[int | Exception]:
        events.append(f"rows {list(rows)}")
        return original(rows)

    with batched(checkpoint, recording, key="any") as step:
        assert [step(1), step(5)] == [2, 6]
    assert events == ["step", "rows [1]", "step", "rows [5]"]
    assert not isinstance(checkpoint, BatchRunner)
    assert not isinstance(Checkpoint(), BatchRunner)


def test_a_plain_checkpoint_raises_a_failed_row_and_a_wrong_count() -> None:
    with batched(Checkpoint(), Recorder()) as step, pytest.raises(ValueError, match="row -1"):
        step(-1)
    with (
        batched(Checkpoint(), lambda rows: [1, 2]) as step,
        pytest.raises(EngineError, match="2 results for 1 rows"),
    ):
        step(0)


def test_a_stop_at_the_step_runs_no_row() -> None:
    class Stopped(Exception):
        pass

    def stop() -> None:
        raise Stopped

    run_batch = Recorder()
    with batched(checkpoint_calling(stop), run_batch) as step, pytest.raises(Stopped):
        step(1)
    assert run_batch.batches == []


def test_a_batch_runner_gets_the_key_or_the_run_batch_itself() -> None:
    runner, run_batch = Runner(), Recorder()
    assert isinstance(runner, BatchRunner)
    with batched(runner, run_batch, key=("shape", 4)) as step:
        assert step(1) == 2
    with batched(runner, run_batch) as step:
        assert step(2) == 3
    assert runner.entered == [(run_batch, ("shape", 4)), (run_batch, run_batch)]


def test_an_unhashable_key_is_refused_before_any_batching() -> None:
    runner = Runner()
    with pytest.raises(TypeError), batched(runner, Recorder(), key=["a", "list"]):
        pass
    assert runner.entered == []


def test_the_servers_checkpoint_is_a_batch_runner() -> None:
    # (The kit's is too: tests/engines/test_engine_testing.py sees its rows batch by key.)
    assert issubclass(SessionCheckpoint, BatchRunner)


def test_the_deprecated_method_warns_and_still_runs_rows_alone() -> None:
    checkpoint, events = counting()
    run_batch = Recorder()
    with pytest.warns(DeprecationWarning, match=r"engines\.batched\(checkpoint"):
        context = checkpoint.batched(run_batch)
    with context as step:
        assert [step(1), step(2)] == [2, 3]
    assert events == ["step", "step"]
    assert run_batch.batches == [[1], [2]]


def test_the_deprecated_method_forwards_to_a_batch_runner_keyed_by_its_run_batch() -> None:
    runner, run_batch = Runner(), Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with runner.batched(run_batch) as step:
            assert step(3) == 4
    assert [w.category for w in caught] == [DeprecationWarning]
    assert caught[0].filename == __file__  # points at the engine's call, not at the shim
    assert runner.entered == [(run_batch, run_batch)]
