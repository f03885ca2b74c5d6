"""The diffusers engine batches sessions' denoising steps (issue 24), for the families
that declare it (``LOOP.batches``): SkyReels-V2 diffusion-forcing windows.

Sessions run as the server runs them (a `StepBatcher`, each session's `SessionCheckpoint`,
its ``next_chunk`` in a worker thread), joining and leaving mid-stream; each one's frames
are compared with the same request run alone on today's path (``max_batch`` 1), and what
reaches the transformer is watched through a hook on the real module."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
import trio

from tests.engines.diffusers.support import START, no_stop, request, run_session
from tests.instrumented import FirstStepMeeting, StoppingCheckpoint
from tests.server.test_wedged import HungForward, wedged_by_a_hung_batch
from trio_vstream.engines import Engine, load_engine
from trio_vstream.engines.contract import EngineConfigError, GenerationRequest, PromptChange
from trio_vstream.engines.diffusers import DiffusersEngine
from trio_vstream.engines.diffusers.loops import forcing
from trio_vstream.engines.interfaces import max_batch
from trio_vstream.engines.testing import check_engine
from trio_vstream.scheduling.batcher import StepBatcher
from trio_vstream.scheduling.progress import EngineProgress

GUIDED = {"guidance_scale": 6.0, "negative_prompt": "blurry"}


def df_request(request_id: str, seed: int, num_frames: int = 33, **fields: Any) -> Any:
    """32x32, two steps a window of 17 frames (the engine's ``segment_frames``): 33 frames
    are three windows (17, 8, 8 new frames), 25 two."""
    values: dict[str, Any] = {
        "request_id": request_id,
        "seed": seed,
        "width": 32,
        "height": 32,
        "num_frames": num_frames,
        "fps": 24,
        **GUIDED,
    }
    values.update(fields)
    return request(**values)


@pytest.fixture
def engine(skyreels: dict[str, Path], make_engine: Any) -> DiffusersEngine:
    made: DiffusersEngine = make_engine(skyreels["t2v"], segment_frames="17", max_batch="8")
    return made


@pytest.fixture
def batch_sizes(engine: DiffusersEngine) -> Iterator[list[int]]:
    """The batch dimension of every transformer forward."""
    sizes: list[int] = []

    def before_forward(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        sizes.append(int(kwargs["hidden_states"].shape[0]))

    hook = engine.model.pipe.transformer.register_forward_pre_hook(before_forward, with_kwargs=True)
    yield sizes
    hook.remove()


def alone(
    engine: DiffusersEngine, req: GenerationRequest, changes: dict[int, PromptChange] | None = None
) -> np.ndarray:
    """``req``'s frames on today's path: the engine made not to batch, the window under
    the lock, its steps one forward (two with guidance) each."""
    engine.max_batch, batching = 1, engine.max_batch
    stream = engine.open_stream(req)
    chunks = []
    try:
        while True:
            if len(chunks) in (changes or {}):
                stream.interact((changes or {})[len(chunks)])
            chunk = stream.next_chunk(no_stop)
            if chunk is None:
                return np.concatenate(chunks)
            chunks.append(chunk.frames)
    finally:
        stream.close()
        engine.max_batch = batching


@attrs.define
class Session:
    req: GenerationRequest
    after: tuple[str, int] | None = None
    """Start once that session has made that many chunks (joining mid-stream)."""
    changes: dict[int, PromptChange] = attrs.Factory(dict)
    stop_at: int | None = None


async def run_batched(
    engine: DiffusersEngine, sessions: list[Session]
) -> tuple[dict[str, np.ndarray | None], StepBatcher]:
    """Run ``sessions`` concurrently through one batcher, as the server does; frames per
    request id (None for a session stopped before its first chunk)."""
    batcher = StepBatcher(max_batch(engine), EngineProgress())
    frames: dict[str, np.ndarray | None] = {}
    made: dict[str, list[trio.Event]] = {
        s.req.request_id: [trio.Event() for _ in range(8)] for s in sessions
    }
    together = sum(1 for s in sessions if s.after is None)
    meet = FirstStepMeeting(together) if together > 1 else None

    async def session(s: Session) -> None:
        if s.after is not None:
            await made[s.after[0]][s.after[1] - 1].wait()
        scope = trio.CancelScope()
        checkpoint = StoppingCheckpoint(
            batcher, scope, s.stop_at, meet if s.after is None else None
        )
        chunks: list[np.ndarray] = []
        stream = engine.open_stream(s.req)
        try:
            with scope:
                while True:
                    if len(chunks) in s.changes:
                        stream.interact(s.changes[len(chunks)])
                    chunk = await trio.to_thread.run_sync(stream.next_chunk, checkpoint)
                    if chunk is None:
                        break
                    chunks.append(chunk.frames)
                    made[s.req.request_id][len(chunks) - 1].set()
            frames[s.req.request_id] = np.concatenate(chunks) if chunks else None
        finally:
            checkpoint.left()
            stream.close()
            for event in made[s.req.request_id]:
                event.set()  # nobody waits for a session that has ended

    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.run)
        async with trio.open_nursery() as running:
            for s in sessions:
                running.start_soon(session, s)
        nursery.cancel_scope.cancel()
    return frames, batcher


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def assert_same(batched: np.ndarray | None, reference: np.ndarray) -> None:
    """A batched session's frames against the same session alone: equal but for float
    rounding (a forward of 2N rows may sum in another order than two of one row), so at
    least 40 dB and never more than one level apart. On this machine most sessions come
    out bit for bit; a guided session whose pair ran as a forward of two differed by one
    level in 2 of 115,200 values."""
    assert batched is not None and batched.shape == reference.shape
    assert psnr(batched, reference) >= 40.0
    assert np.abs(batched.astype(np.int16) - reference.astype(np.int16)).max() <= 1


@pytest.mark.slow
async def test_batched_windows_equal_each_session_alone(
    engine: DiffusersEngine, batch_sizes: list[int]
) -> None:
    # a and b start together; c joins after a's first window and leaves after two (25
    # frames); d joins after c's first window, while b and a go on: the rows of a
    # window-shaped group change at every window boundary.
    sessions = [
        Session(df_request("a", 1)),
        Session(df_request("b", 2)),
        Session(df_request("c", 3, num_frames=25), after=("a", 1)),
        Session(df_request("d", 4), after=("c", 1)),
    ]
    frames, batcher = await run_batched(engine, sessions)
    shared = [size for size in batch_sizes if size > 2]
    # Guided rows run their conditional and unconditional passes in one forward (2 per
    # row), and rows of several sessions share forwards. (Two sessions at least: a and
    # b are inside their first window together. Whether a third's window overlaps theirs
    # is the threads' timing, not a rule: on CI it did not, once, and the test failed.)
    assert all(size % 2 == 0 for size in batch_sizes)
    assert shared and max(shared) >= 4, batch_sizes
    assert batcher.rows == 2 * (3 + 3 + 2 + 3) and batcher.batches < batcher.rows
    batch_sizes.clear()
    for s in sessions:
        reference = alone(engine, s.req)
        assert_same(frames[s.req.request_id], reference)
    assert batch_sizes and max(batch_sizes) == 1  # the references: one row a forward


@pytest.mark.slow
async def test_a_session_stopped_mid_batch_leaves_the_others_unchanged(
    engine: DiffusersEngine,
) -> None:
    sessions = [
        Session(df_request("a", 1)),
        Session(df_request("b", 2), stop_at=3),  # window 1's first step
        Session(df_request("c", 3)),
    ]
    frames, _ = await run_batched(engine, sessions)
    stopped = frames["b"]
    assert stopped is not None and stopped.shape[0] == 17  # window 0 only: 1 is not decoded
    np.testing.assert_array_equal(stopped, alone(engine, sessions[1].req)[:17])
    for s in (sessions[0], sessions[2]):
        assert_same(frames[s.req.request_id], alone(engine, s.req))


@pytest.mark.slow
async def test_an_interaction_changes_only_its_own_row(engine: DiffusersEngine) -> None:
    to_whale = {1: PromptChange("w", "a whale in the sea", 0)}
    sessions = [
        Session(df_request("a", 1), changes=to_whale),
        Session(df_request("b", 1)),  # the same seed and prompt: only the change differs
    ]
    frames, _ = await run_batched(engine, sessions)
    changed, plain = frames["a"], frames["b"]
    assert changed is not None and plain is not None
    np.testing.assert_array_equal(changed[:17], plain[:17])
    assert not np.array_equal(changed[17:], plain[17:])
    assert_same(changed, alone(engine, sessions[0].req, to_whale))
    assert_same(plain, alone(engine, sessions[1].req))


@pytest.mark.slow
async def test_rows_of_other_shapes_run_apart(
    engine: DiffusersEngine, batch_sizes: list[int]
) -> None:
    # Guidance off against on, and another size: three keys, so no forward is shared.
    sessions = [
        Session(df_request("plain", 1, num_frames=25, guidance_scale=1.0, negative_prompt=None)),
        Session(df_request("guided", 2, num_frames=25)),
        Session(df_request("wide", 3, num_frames=25, width=48)),
    ]
    frames, batcher = await run_batched(engine, sessions)
    assert batcher.rows == 3 * 2 * 2
    assert sorted(set(batch_sizes)) == [1, 2]  # one row alone, or one guided row's pair
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(engine, s.req))


def test_max_batch_is_an_engine_arg_of_the_families_that_batch(
    skyreels: dict[str, Path], models: Any, make_engine: Any
) -> None:
    assert make_engine(skyreels["t2v"], segment_frames="17").max_batch == 1  # the default
    assert make_engine(skyreels["t2v"], segment_frames="17", max_batch="4").max_batch == 4
    assert forcing.LOOP.batches  # type: ignore[attr-defined]
    # Wan segments batch their calls' forwards too (test_batching_calls.py); a family
    # that does not batch is served with 1 (test_sana_wm.py).
    assert make_engine(models.t2v, max_batch="4").max_batch == 4
    with pytest.raises(EngineConfigError, match="max_batch must be >= 1"):
        make_engine(skyreels["t2v"], max_batch="0")
    engine = make_engine(skyreels["t2v"], segment_frames="17")
    settings = attrs.evolve(engine.settings, offload="model", max_batch=2)
    with pytest.raises(EngineConfigError, match="needs offload=none"):
        DiffusersEngine(settings, engine.model, None, torch.device("cpu"))


def test_a_lone_batching_session_runs_its_rows_in_place(
    engine: DiffusersEngine, batch_sizes: list[int]
) -> None:
    # The base checkpoint (no server) runs each row alone: the batched path, one session.
    req = df_request("a", 1, num_frames=25)
    stream = engine.open_stream(req)
    chunks = []
    try:
        while (chunk := stream.next_chunk(no_stop)) is not None:
            chunks.append(chunk.frames)
    finally:
        stream.close()
    assert batch_sizes == [2] * 4  # two windows of two steps, each a guided pair
    assert_same(np.concatenate(chunks), alone(engine, req))


@pytest.mark.slow
def test_a_batching_engine_keeps_the_contract(skyreels: dict[str, Path]) -> None:
    # The kit steps a few streams alone and then together (its own batcher), stops
    # each at every checkpoint in turn, fails one, interacts with two.
    def factory() -> Engine:
        args = {
            "model": str(skyreels["t2v"]),
            "segment_frames": "17",
            "threads": "1",
            "max_batch": "4",
        }
        return load_engine("diffusers", args, device="cpu")

    check_engine(
        factory, df_request("kit", 1, num_frames=25, guidance_scale=1.0, negative_prompt=None)
    )


@pytest.mark.slow
async def test_a_server_batches_the_sessions_of_a_batching_engine(
    engine: DiffusersEngine, serve: Any
) -> None:
    server, summaries = await serve(engine)
    assert server.batcher is not None and server.batcher.max_batch == 8
    start = {
        **START,
        "size": "32x32",
        "fps": 24,
        "num_frames": 25,
        "guidance_scale": 6.0,
        "negative_prompt": "blurry",
    }
    transcripts: list[Any] = []

    async def one(seed: int) -> None:
        transcripts.append(await run_session(server.url, {**start, "seed": seed}))

    async with trio.open_nursery() as nursery:
        for seed in (1, 2, 3):
            nursery.start_soon(one, seed)
    for transcript in transcripts:
        media = [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
        assert [m["num_frames"] for m in media] == [17, 8]
        assert transcript.terminal[-1]["type"] == "session.done"
    with trio.fail_after(5):
        await summaries.wait_for(3)
    assert [s.outcome.value for s in summaries] == ["completed"] * 3
    # Every step went through the batcher (whether sessions met in a batch depends on
    # when their connections came: that rows do share forwards is tested above).
    assert server.batcher.rows == 3 * 2 * 2


@pytest.mark.slow
async def test_a_hung_batched_forward_wedges_the_server_until_it_returns(
    engine: DiffusersEngine, serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transformer's forward hangs (a wedged GPU) once two sessions' rows share it;
    the scenario of `wedged_by_a_hung_batch`. The hang is a pre-hook on the real module
    that blocks in the batcher's thread only, so a session stepping alone is never held."""
    hung = HungForward()

    def before_forward(module: Any, args: Any) -> None:
        hung.forward(batched=threading.current_thread().name == "engine call _call_batch")

    hook = engine.model.pipe.transformer.register_forward_pre_hook(before_forward)
    hung.meeting(monkeypatch)
    server, summaries = await serve(engine, stall_timeout=5.0, close_timeout=0.2)

    def released() -> None:
        hung.release()
        hook.remove()

    start = {**START, "size": "32x32", "fps": 24, "num_frames": 25}
    await wedged_by_a_hung_batch(server, start, released, summaries.wait_for)


# -- FramePack, vanilla sections

FP_IMAGE = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)
TRUE_CFG = {"true_cfg_scale": 3.0, "negative_prompt": "blurry"}


def fp_request(request_id: str, seed: int, num_frames: int = 27, **fields: Any) -> Any:
    """32x32, two steps a section of 12 frames (``segment_frames``), true CFG: 27 frames
    are three sections (4, 12 and 11 frames sent), 13 two."""
    values: dict[str, Any] = {
        "request_id": request_id,
        "seed": seed,
        "width": 32,
        "height": 32,
        "num_frames": num_frames,
        "image": FP_IMAGE,
        "extra_params": {"sampling_type": "vanilla"},
        **TRUE_CFG,
    }
    values.update(fields)
    return request(**values)


@pytest.fixture
def fp_engine(framepack: Path, make_engine: Any) -> DiffusersEngine:
    made: DiffusersEngine = make_engine(framepack, segment_frames="12", max_batch="8")
    return made


@pytest.fixture
def fp_batch_sizes(fp_engine: DiffusersEngine) -> Iterator[list[int]]:
    sizes: list[int] = []

    def before_forward(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        sizes.append(int(kwargs["hidden_states"].shape[0]))

    transformer = fp_engine.model.pipe.transformer
    hook = transformer.register_forward_pre_hook(before_forward, with_kwargs=True)
    yield sizes
    hook.remove()


@pytest.mark.slow
async def test_batched_sections_equal_each_session_alone(
    fp_engine: DiffusersEngine, fp_batch_sizes: list[int]
) -> None:
    assert fp_engine.max_batch == 8
    # a and b together; c joins after a's first section and leaves after two.
    sessions = [
        Session(fp_request("a", 1)),
        Session(fp_request("b", 2)),
        Session(fp_request("c", 3, num_frames=13), after=("a", 1)),
    ]
    frames, batcher = await run_batched(fp_engine, sessions)
    assert all(size % 2 == 0 for size in fp_batch_sizes)  # prompt and negative together
    assert max(fp_batch_sizes) >= 4, fp_batch_sizes  # rows of sessions shared forwards
    assert batcher.rows == 2 * (3 + 3 + 2) and batcher.batches < batcher.rows
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(fp_engine, s.req))


@pytest.mark.slow
async def test_sections_a_stop_and_an_interaction_touch_only_their_own_rows(
    fp_engine: DiffusersEngine,
) -> None:
    to_whale = {1: PromptChange("w", "a whale in the sea", 0)}
    sessions = [
        Session(fp_request("stopped", 1), stop_at=3),  # section 1's first step
        Session(fp_request("changed", 2), changes=to_whale),
        Session(fp_request("plain", 2)),  # the same seed and prompt as "changed"
    ]
    frames, _ = await run_batched(fp_engine, sessions)
    stopped, changed, plain = frames["stopped"], frames["changed"], frames["plain"]
    assert stopped is not None and stopped.shape[0] == 4  # section 0 only
    assert_same(stopped, alone(fp_engine, sessions[0].req)[:4])
    assert changed is not None and plain is not None
    assert_same(changed[:4], plain[:4])  # two rows of one forward: rounding apart at most
    assert not np.array_equal(changed[4:], plain[4:])
    assert_same(changed, alone(fp_engine, sessions[1].req, to_whale))
    assert_same(plain, alone(fp_engine, sessions[2].req))


@pytest.fixture(scope="module")
def df_lora(skyreels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LoRA for the SkyReels-V2 DF transformer (its attention is Wan's)."""
    from trio_vstream.engines.diffusers.testing import build_lora

    root = tmp_path_factory.mktemp("df_lora")
    return Path(build_lora(skyreels["t2v"], root / "lora")) / "pytorch_lora_weights.safetensors"


@pytest.mark.slow
async def test_rows_share_a_forward_only_with_the_same_lora(
    skyreels: dict[str, Path], make_engine: Any, df_lora: Path
) -> None:
    engine = make_engine(
        skyreels["t2v"], segment_frames="17", max_batch="8", lora_root=str(df_lora.parents[1])
    )
    sizes: list[int] = []
    hook = engine.model.pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(int(kwargs["hidden_states"].shape[0])),
        with_kwargs=True,
    )
    lora = {"path": str(df_lora), "scale": 0.8}
    unguided = {"guidance_scale": 1.0, "negative_prompt": None, "num_frames": 25}
    sessions = [
        Session(df_request("lora1", 1, lora=lora, **unguided)),
        Session(df_request("lora2", 2, lora=lora, **unguided)),
        Session(df_request("plain", 1, **unguided)),
        Session(df_request("half", 2, lora={**lora, "scale": 0.4}, **unguided)),
    ]
    try:
        frames, _ = await run_batched(engine, sessions)
    finally:
        hook.remove()
    # The two sessions of the same adapter and scale share forwards; the plain one and
    # the one at another scale run apart (a batch of two is only ever that pair).
    assert max(sizes) == 2 and sizes.count(2) >= 1, sizes
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(engine, s.req))
    assert not np.array_equal(frames["lora1"], frames["plain"])  # the adapter was on
