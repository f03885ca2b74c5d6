"""The shapes engine batches sessions' steps (issue 13): each row's frames are the ones it
would get alone, a stop or an interaction touches only its own row, and a server batches
by default."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import trio

from tests.conftest import Transcript, receive_into
from tests.instrumented import FirstStepMeeting, StoppingCheckpoint, meeting_streams
from trio_vstream.engines.contract import (
    Checkpoint,
    EngineConfigError,
    GenerationRequest,
    PromptChange,
)
from trio_vstream.engines.frames import frames_to_uint8_array
from trio_vstream.engines.shapes import ShapesEngine, create_engine
from trio_vstream.models.shapes import evaluate
from trio_vstream.scheduling.batcher import StepBatcher
from trio_vstream.scheduling.progress import EngineProgress
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.session.session import SessionConfig

REQUESTS = [
    ("a red circle moving left on a black background", 1),
    ("a blue square moving up on a white background", 2),
    ("a green triangle staying still on a navy background", 3),
]


@pytest.fixture(scope="module")
def engine() -> ShapesEngine:
    return create_engine(device="cpu")


def request(prompt: str, seed: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{seed}", prompt=prompt, width=64, height=64, fps=24, num_frames=32, seed=seed
    )


def alone(engine: ShapesEngine, req: GenerationRequest, changes: dict[int, PromptChange]) -> Any:
    stream = engine.open_stream(req)
    chunks = []
    try:
        while True:
            if len(chunks) in changes:
                stream.interact(changes[len(chunks)])
            chunk = stream.next_chunk(Checkpoint())
            if chunk is None:
                return np.concatenate(chunks)
            chunks.append(frames_to_uint8_array(chunk.frames, width=64, height=64))
    finally:
        stream.close()


async def batched(
    engine: ShapesEngine,
    requests: list[GenerationRequest],
    *,
    changes: dict[str, dict[int, PromptChange]] | None = None,
    stop: tuple[str, int] | None = None,
) -> tuple[dict[str, Any], StepBatcher]:
    """Run the requests as concurrent sessions through one batcher; frames per request id
    (None for a session stopped before its first chunk). ``stop`` = (request id, step)."""
    batcher = StepBatcher(8, EngineProgress())
    frames: dict[str, Any] = {}
    meet = FirstStepMeeting(len(requests))  # their first steps in one batch

    async def session(req: GenerationRequest) -> None:
        scope = trio.CancelScope()
        stop_at = stop[1] if stop is not None and stop[0] == req.request_id else None
        checkpoint = StoppingCheckpoint(batcher, scope, stop_at, meet)
        mine = (changes or {}).get(req.request_id, {})
        chunks: list[np.ndarray] = []
        stream = engine.open_stream(req)
        try:
            with scope:
                while True:
                    if len(chunks) in mine:
                        stream.interact(mine[len(chunks)])
                    chunk = await trio.to_thread.run_sync(stream.next_chunk, checkpoint)
                    if chunk is None:
                        break
                    chunks.append(frames_to_uint8_array(chunk.frames, width=64, height=64))
            frames[req.request_id] = np.concatenate(chunks) if chunks else None
        finally:
            checkpoint.left()
            stream.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.run)
        async with trio.open_nursery() as sessions:
            for req in requests:
                sessions.start_soon(session, req)
        nursery.cancel_scope.cancel()
    return frames, batcher


def assert_close(batched_frames: np.ndarray, alone_frames: np.ndarray) -> None:
    """Equal but for float rounding: batched convolutions sum in another order, which
    may flip a rare pixel by one level."""
    difference = np.abs(batched_frames.astype(np.int16) - alone_frames.astype(np.int16))
    assert difference.max() <= 1 and difference.mean() < 1e-3, (difference.max(), difference.mean())


@pytest.mark.slow
async def test_batched_rows_equal_each_session_alone(engine: ShapesEngine) -> None:
    requests = [request(prompt, seed) for prompt, seed in REQUESTS]
    frames, batcher = await batched(engine, requests)
    assert batcher.rows == 3 * 4 * 4 and batcher.batches < batcher.rows  # 4 chunks of 4 steps
    for req in requests:
        assert_close(frames[req.request_id], alone(engine, req, {}))


@pytest.mark.slow
async def test_a_session_stopped_mid_batch_leaves_the_others_unchanged(
    engine: ShapesEngine,
) -> None:
    requests = [request(prompt, seed) for prompt, seed in REQUESTS]
    frames, _ = await batched(engine, requests, stop=("r2", 6))  # mid-chunk 1
    assert frames["r2"] is not None and len(frames["r2"]) == 8  # chunk 0 only
    for req in requests:
        if req.request_id != "r2":
            assert_close(frames[req.request_id], alone(engine, req, {}))


@pytest.mark.slow
async def test_an_interaction_changes_only_its_own_row(engine: ShapesEngine) -> None:
    requests = [request(prompt, seed) for prompt, seed in REQUESTS]
    to_yellow = PromptChange("y", "a yellow circle moving left on a black background", 0)
    changes = {"r1": {1: to_yellow}}
    frames, _ = await batched(engine, requests, changes=changes)
    assert_close(frames["r1"], alone(engine, requests[0], changes["r1"]))
    assert evaluate.chunk_colours(frames["r1"]) == ["red", "yellow", "yellow", "yellow"]
    for req in requests[1:]:
        assert_close(frames[req.request_id], alone(engine, req, {}))


@pytest.mark.slow
def test_max_batch_is_an_engine_arg() -> None:
    assert create_engine(device="cpu").max_batch == 8
    assert create_engine(device="cpu", max_batch="1").max_batch == 1
    with pytest.raises(EngineConfigError, match="max_batch must be >= 1"):
        create_engine(device="cpu", max_batch="0")


@pytest.mark.slow
@pytest.mark.parametrize(("max_batch", "batches"), [(8, True), (1, False)])
async def test_a_server_batches_its_sessions_by_default(
    nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
    engine: ShapesEngine,
    max_batch: int,
    batches: bool,
) -> None:
    # The three sessions meet at their first step: else, under load, each can make its
    # video alone before the next has connected, and nothing is batched to count.
    meeting_streams(engine, monkeypatch, len(REQUESTS))
    engine.max_batch = max_batch
    try:
        server = VideoServer(
            engine,
            ServerConfig(host="127.0.0.1", port=0, session=SessionConfig(served_model="shapes")),
        )
    finally:
        engine.max_batch = 8
    await nursery.start(server.run)
    from trio_websocket import open_websocket_url

    transcripts = [Transcript() for _ in REQUESTS]

    async def run(index: int) -> None:
        prompt, seed = REQUESTS[index]
        start = {"type": "session.start", "prompt": prompt, "size": "64x64", "num_frames": 16}
        async with open_websocket_url(server.url, max_message_size=2**26) as ws:
            await ws.send_message(json.dumps({**start, "seed": seed}))
            await receive_into(ws, transcripts[index])

    async with trio.open_nursery() as clients:
        for index in range(len(REQUESTS)):
            clients.start_soon(run, index)
    assert [t.terminal[-1]["type"] for t in transcripts] == ["session.done"] * 3
    stats = server.stats_snapshot()
    assert stats["batch_rows"] == (3 * 2 * 4 if batches else 0)  # sessions, chunks, steps
    if batches:
        assert stats["batches"] < stats["batch_rows"]
    exposition = server.metrics.exposition().decode()
    count = f'trio_vstream_batch_rows_count{{model="shapes"}} {float(stats["batches"])}'
    assert count in exposition, exposition
    models = server.models()["data"][0]["trio_vstream"]
    assert models["max_batch"] == max_batch
    server.shutdown()
