"""The built-in model wedged by a hung batched forward (issue 30): ``max_batch`` 2, its
``run_batch`` hanging once two sessions' rows share it, until the test releases it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio

from tests.server.test_wedged import HungForward, serve_batching, wedged_by_a_hung_batch
from trio_vstream.engines.shapes import create_engine


@pytest.mark.slow
async def test_a_hung_batched_forward_wedges_the_server_until_it_returns(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = create_engine(device="cpu", max_batch="2")
    hung, forward = HungForward(), engine.run_batch

    def run_batch(steps: Sequence[Any]) -> list[Any]:
        hung.forward(batched=len(steps) > 1)
        return forward(steps)

    engine.run_batch = run_batch  # type: ignore[method-assign]
    hung.meeting(monkeypatch)
    server, ended = await serve_batching(nursery, engine, "shapes", stall_timeout=2.0)
    assert server.batcher is not None and server.batcher.max_batch == 2
    start = {"type": "session.start", "prompt": "a red circle", "size": "64x64", "num_frames": 96}
    await wedged_by_a_hung_batch(server, start, hung.release, ended.wait_for)
