"""The families served by pipeline calls batch their transformer forwards across sessions
(issue 24): Wan-style segments and Helios history chunks (`loops._calls.BatchedCall`).

Sessions run as the server runs them (test_batching's `run_batched`: a `StepBatcher`,
each session's checkpoint, its ``next_chunk`` in a worker thread), joining and leaving
mid-stream; each one's frames are compared with the same request run alone on the
unbatched path (``max_batch`` 1, the whole call under the lock), and what reaches the
transformer is watched through a hook on the real module."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import trio

from tests.engines.diffusers.support import START, no_stop, request, run_session
from tests.engines.diffusers.test_batching import (
    Session,
    alone,
    assert_same,
    run_batched,
)
from trio_vstream.engines import Engine, load_engine
from trio_vstream.engines.contract import PromptChange
from trio_vstream.engines.diffusers import DiffusersEngine
from trio_vstream.engines.diffusers._lock import SegmentLock
from trio_vstream.engines.diffusers.loops import _calls, history, segments
from trio_vstream.engines.testing import check_engine

GUIDED = {"guidance_scale": 6.0, "negative_prompt": "blurry"}
TO_WHALE = {1: PromptChange("w", "a whale in the sea", 0)}


def wan_request(request_id: str, seed: int, num_frames: int = 12, **fields: Any) -> Any:
    """48x32, two steps, guided: 12 frames are three segments of 5, 5 and 2 new frames
    (independent clips: the t2v pipeline takes no image), 7 two."""
    return request(request_id=request_id, seed=seed, num_frames=num_frames, **{**GUIDED, **fields})


def helios_request(request_id: str, seed: int, num_frames: int = 66, **fields: Any) -> Any:
    """64x64 (the smallest the tiny Helios takes), three steps, guided (six forwards a
    chunk): 66 frames are two chunks of 33, 33 one."""
    values: dict[str, Any] = {
        "request_id": request_id,
        "seed": seed,
        "num_frames": num_frames,
        "width": 64,
        "height": 64,
        "num_inference_steps": 3,
        **GUIDED,
    }
    values.update(fields)
    return request(**values)


def watch_batches(module: Any) -> tuple[list[int], Callable[[], None]]:
    """The batch dimension of every forward of the real ``module``, and the hook's remover."""
    sizes: list[int] = []
    hook = module.register_forward_pre_hook(
        lambda m, args, kwargs: sizes.append(int(kwargs["hidden_states"].shape[0])),
        with_kwargs=True,
    )
    return sizes, hook.remove


@pytest.fixture
def wan(models: Any, make_engine: Any) -> DiffusersEngine:
    made: DiffusersEngine = make_engine(models.t2v, max_batch="8")
    return made


@pytest.fixture
def wan_sizes(wan: DiffusersEngine) -> Iterator[list[int]]:
    sizes, remove = watch_batches(wan.model.pipe.transformer)
    yield sizes
    remove()


@pytest.fixture
def helios_engine(helios: dict[str, Path], make_engine: Any) -> DiffusersEngine:
    made: DiffusersEngine = make_engine(helios["base"], segment_frames="33", max_batch="8")
    return made


# -- Wan segments


def test_pipelines_whose_forwards_fit_batch_and_the_others_do_not(
    models: Any, helios: dict[str, Path], framepack: Path, make_engine: Any
) -> None:
    assert segments.LOOP.batches and history.LOOP.batches  # type: ignore[attr-defined]
    assert make_engine(models.t2v).max_batch == 1  # the default
    assert make_engine(models.t2v, max_batch="4").max_batch == 4
    assert make_engine(models.i2v, max_batch="4").max_batch == 4
    assert make_engine(helios["base"], segment_frames="33", max_batch="4").max_batch == 4
    # FramePack's inverted calls go down the segment path, but its transformer is not
    # one whose forwards are known to batch: they stay whole calls under the lock.
    fp = make_engine(framepack, segment_frames="12", max_batch="4")
    assert not _calls.batchable(fp.model)


def test_a_pipeline_whose_forwards_do_not_fit_is_served_with_one(
    models: Any, make_engine: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # As a segment pipeline of another transformer (LTX, CogVideoX) is: the engine says
    # max_batch is ignored, and its calls run whole under the lock.
    monkeypatch.setattr(_calls, "BATCHING_TRANSFORMERS", frozenset())
    engine = make_engine(models.t2v, max_batch="4")
    assert engine.max_batch == 1
    assert "max_batch=4 ignored: segments (WanPipeline)" in caplog.text


@pytest.mark.slow
async def test_batched_segments_equal_each_session_alone(
    wan: DiffusersEngine, wan_sizes: list[int]
) -> None:
    # a and b start together; c joins after a's first segment and leaves after two;
    # d joins after c's first, while a and b go on.
    sessions = [
        Session(wan_request("a", 1)),
        Session(wan_request("b", 2)),
        Session(wan_request("c", 3, num_frames=7), after=("a", 1)),
        Session(wan_request("d", 4), after=("c", 1)),
    ]
    frames, batcher = await run_batched(wan, sessions)
    # Each step is two forwards (the call's conditional and unconditional passes), each
    # a row: rows of several sessions shared forwards.
    assert max(wan_sizes) >= 2, wan_sizes
    assert batcher.rows == 2 * 2 * (3 + 3 + 2 + 3) and batcher.batches < batcher.rows
    wan_sizes.clear()
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(wan, s.req))
    assert wan_sizes and max(wan_sizes) == 1  # the references: one row a forward


@pytest.mark.slow
async def test_segments_a_stop_and_an_interaction_touch_only_their_own_rows(
    wan: DiffusersEngine,
) -> None:
    sessions = [
        Session(wan_request("stopped", 1), stop_at=5),  # segment 1's first forward
        Session(wan_request("changed", 2), changes=TO_WHALE),
        Session(wan_request("plain", 2)),  # the same seed and prompt as "changed"
    ]
    frames, _ = await run_batched(wan, sessions)
    stopped, changed, plain = frames["stopped"], frames["changed"], frames["plain"]
    assert stopped is not None and stopped.shape[0] == 5  # segment 0 only: 1 not decoded
    assert_same(stopped, alone(wan, sessions[0].req)[:5])
    assert changed is not None and plain is not None
    np.testing.assert_array_equal(changed[:5], plain[:5])
    assert not np.array_equal(changed[5:], plain[5:])
    assert_same(changed, alone(wan, sessions[1].req, TO_WHALE))
    assert_same(plain, alone(wan, sessions[2].req))


@pytest.mark.slow
async def test_continued_segments_batch_on_the_image_to_video_pipeline(
    models: Any, make_engine: Any
) -> None:
    # The i2v pipeline continues each segment from the last frame: its image encoder and
    # VAE encode run beside the batches, each under its lock.
    engine = make_engine(models.i2v, max_batch="8")
    sizes, remove = watch_batches(engine.model.pipe.transformer)
    image = (np.random.default_rng(0).random((32, 48, 3)) * 255).astype(np.uint8)
    sessions = [
        Session(wan_request("a", 1, num_frames=9, image=image)),
        Session(wan_request("b", 2, num_frames=9, image=image)),
    ]
    try:
        frames, _ = await run_batched(engine, sessions)
    finally:
        remove()
    assert max(sizes) >= 2, sizes
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(engine, s.req))


@pytest.fixture(scope="module")
def wan22(models: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Wan as Wan 2.2 makes it: a second expert (``transformer_2``, other
    weights) for the low-noise steps below ``boundary_ratio``."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(models.t2v, local_files_only=True)
    second = copy.deepcopy(pipe.transformer)
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.mul_(0.5)
    made = WanPipeline(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        transformer=pipe.transformer,
        vae=pipe.vae,
        scheduler=pipe.scheduler,
        transformer_2=second,
        boundary_ratio=0.8,
    )
    path = tmp_path_factory.mktemp("wan22") / "Wan2.2-tiny"
    made.save_pretrained(path)
    return path


@pytest.mark.slow
async def test_both_experts_of_a_two_stage_wan_batch(wan22: Path, make_engine: Any) -> None:
    engine = make_engine(wan22, max_batch="8")
    pipe = engine.model.pipe
    first, remove_first = watch_batches(pipe.transformer)
    second, remove_second = watch_batches(pipe.transformer_2)
    sessions = [
        # Six steps: three on each expert (timesteps 999, 937, 857 | 750, 600, 376).
        Session(wan_request("a", 1, num_inference_steps=6)),
        Session(wan_request("b", 2, num_inference_steps=6)),
    ]
    try:
        frames, _ = await run_batched(engine, sessions)
    finally:
        remove_first()
        remove_second()
    assert max(first) == 2 and max(second) == 2, (first, second)
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(engine, s.req))


@pytest.mark.slow
async def test_a_session_with_another_lora_shares_no_forward(models: Any, make_engine: Any) -> None:
    engine = make_engine(models.t2v, max_batch="8", lora_root=str(models.root))
    sizes, remove = watch_batches(engine.model.pipe.transformer)
    lora = {"path": str(Path(models.lora) / "pytorch_lora_weights.safetensors"), "scale": 0.8}
    sessions = [
        Session(wan_request("lora", 1, num_frames=7, lora=lora)),
        Session(wan_request("plain", 1, num_frames=7)),
    ]
    try:
        frames, _ = await run_batched(engine, sessions)
    finally:
        remove()
    assert max(sizes) == 1, sizes  # two groups: never in one forward
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(engine, s.req))
    assert not np.array_equal(frames["lora"], frames["plain"])  # the adapter was on


def test_a_lone_batching_session_runs_its_call_as_alone(
    wan: DiffusersEngine, wan_sizes: list[int]
) -> None:
    # The base checkpoint (no server) runs each row alone: the batched path, one session.
    req = wan_request("a", 1, num_frames=7)
    stream = wan.open_stream(req)
    chunks = []
    try:
        while (chunk := stream.next_chunk(no_stop)) is not None:
            chunks.append(chunk.frames)
    finally:
        stream.close()
    assert wan_sizes == [1] * 8  # two segments of two steps, each a guided pair
    np.testing.assert_array_equal(np.concatenate(chunks), alone(wan, req))


def test_decodes_never_overlap_and_the_shared_pipeline_is_untouched(
    wan: DiffusersEngine,
) -> None:
    # Two sessions' calls in two threads (the base checkpoint runs their rows in place):
    # every frame their VAE decodes is decoded under the decode lock, so no two decodes
    # are ever inside the VAE at once; and the call's per-call attributes and scheduler
    # are on the session's copy of the pipeline, never on the shared one.
    pipe = wan.model.pipe
    scheduler = pipe.scheduler
    inside, most, unlocked = [0], [0], [0]
    guard = threading.Lock()

    def enter(module: Any, args: Any) -> None:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            unlocked[0] += not wan.decode_lock._held

    def leave(module: Any, args: Any, output: Any) -> None:
        with guard:
            inside[0] -= 1

    hooks = [
        pipe.vae.decoder.register_forward_pre_hook(enter),
        pipe.vae.decoder.register_forward_hook(leave),
    ]
    results: dict[int, np.ndarray] = {}

    def one(seed: int) -> None:
        stream = wan.open_stream(wan_request(str(seed), seed))
        try:
            results[seed] = np.concatenate(
                [c.frames for c in iter(lambda: stream.next_chunk(no_stop), None)]
            )
        finally:
            stream.close()

    try:
        threads = [threading.Thread(target=one, args=(seed,)) for seed in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for hook in hooks:
            hook.remove()
    assert most[0] == 1 and unlocked[0] == 0
    assert pipe.scheduler is scheduler and getattr(pipe, "_guidance_scale", None) is None
    for seed in (1, 2):
        assert_same(results[seed], alone(wan, wan_request(str(seed), seed)))


@pytest.mark.slow
async def test_a_server_batches_the_segments_of_its_sessions(
    wan: DiffusersEngine, serve: Any
) -> None:
    server, summaries = await serve(wan)
    assert server.batcher is not None and server.batcher.max_batch == 8
    start = {**START, "num_frames": 7, "guidance_scale": 6.0, "negative_prompt": "blurry"}
    transcripts: list[Any] = []

    async def one(seed: int) -> None:
        transcripts.append(await run_session(server.url, {**start, "seed": seed}))

    async with trio.open_nursery() as nursery:
        for seed in (1, 2, 3):
            nursery.start_soon(one, seed)
    for transcript in transcripts:
        media = [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
        assert [m["num_frames"] for m in media] == [5, 2]
        assert transcript.terminal[-1]["type"] == "session.done"
    with trio.fail_after(5):
        await summaries.wait_for(3)
    assert [s.outcome.value for s in summaries] == ["completed"] * 3
    # Every forward went through the batcher: 3 sessions, 2 segments of 2 guided steps.
    assert server.batcher.rows == 3 * 2 * 2 * 2


@pytest.mark.slow
def test_a_batching_segment_engine_keeps_the_contract(models: Any) -> None:
    def factory() -> Engine:
        args = {"model": str(models.t2v), "segment_frames": "5", "threads": "1", "max_batch": "4"}
        return load_engine("diffusers", args, device="cpu")

    check_engine(factory, wan_request("kit", 1))


# -- Helios history chunks


@pytest.mark.slow
async def test_batched_history_chunks_equal_each_session_alone(
    helios_engine: DiffusersEngine,
) -> None:
    sizes, remove = watch_batches(helios_engine.model.pipe.transformer)
    # a and b start together; c joins after a's first chunk; a's prompt changes at its
    # second chunk; b is stopped at its second chunk's first forward (its seventh).
    sessions = [
        Session(helios_request("a", 1), changes=TO_WHALE),
        Session(helios_request("b", 2), stop_at=7),
        Session(helios_request("c", 3, num_frames=33), after=("a", 1)),
    ]
    try:
        frames, batcher = await run_batched(helios_engine, sessions)
    finally:
        remove()
    assert max(sizes) >= 2, sizes
    assert batcher.batches < batcher.rows
    stopped = frames["b"]
    assert stopped is not None and stopped.shape[0] == 33  # chunk 0 only
    assert_same(stopped, alone(helios_engine, sessions[1].req)[:33])
    assert_same(frames["a"], alone(helios_engine, sessions[0].req, TO_WHALE))
    assert_same(frames["c"], alone(helios_engine, sessions[2].req))


@pytest.mark.slow
async def test_helios_sessions_with_an_image_reference_batch(
    helios_engine: DiffusersEngine,
) -> None:
    image = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)
    sessions = [
        Session(helios_request("a", 1, image=image)),
        Session(helios_request("b", 2)),
    ]
    frames, _ = await run_batched(helios_engine, sessions)
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(helios_engine, s.req))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["pyramid", "distilled"])
async def test_pyramid_stages_batch_stage_by_stage(
    helios: dict[str, Path], make_engine: Any, variant: str
) -> None:
    # Each stage denoises at its own resolution: rows of sessions at the same stage share
    # forwards, whatever the step; the latents' shape keeps the stages apart.
    engine = make_engine(helios[variant], segment_frames="33", max_batch="8")
    sizes, remove = watch_batches(engine.model.pipe.transformer)
    unguided = {"guidance_scale": 1.0, "negative_prompt": None, "num_inference_steps": 2}
    sessions = [
        Session(helios_request("a", 1, **unguided)),
        Session(helios_request("b", 2, **unguided)),
    ]
    try:
        frames, _ = await run_batched(engine, sessions)
    finally:
        remove()
    assert max(sizes) == 2, sizes
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(engine, s.req))


@pytest.mark.slow
def test_a_batching_helios_engine_keeps_the_contract(helios: dict[str, Path]) -> None:
    def factory() -> Engine:
        args = {
            "model": str(helios["base"]),
            "segment_frames": "33",
            "threads": "1",
            "max_batch": "4",
        }
        return load_engine("diffusers", args, device="cpu")

    check_engine(factory, helios_request("kit", 1, guidance_scale=1.0, negative_prompt=None))


# -- what may share a forward


def test_rows_share_a_forward_only_when_their_arguments_agree() -> None:
    module = torch.nn.Linear(2, 2)
    other = torch.nn.Linear(2, 2)

    def key(*args: Any, of: Any = module, context: str | None = "cond", **kwargs: Any) -> Any:
        return _calls.row_key(of, context, args, kwargs)

    row = {"hidden_states": torch.zeros(1, 4, 2), "timestep": torch.ones(1), "return_dict": False}
    # Other values, another step and the other pass (no cache hooks): one forward.
    assert key(**row) == key(
        **{**row, "hidden_states": torch.ones(1, 4, 2), "timestep": torch.zeros(1)},
        context="uncond",
    )
    assert key(**row) != key(**row, of=other)  # Wan 2.2's other expert
    assert key(**row) != key(**{**row, "hidden_states": torch.zeros(1, 6, 2)})  # a size
    assert key(**row) != key(**{**row, "hidden_states": torch.zeros(1, 4, 2).double()})
    assert key(**row) != key(**{**row, "return_dict": True})
    # Alone: what cannot be joined or compared.
    assert key(**row, attention_kwargs={"scale": 0.5}) is None
    assert key(torch.zeros(1, 2), **row) is None
    assert key(**{**row, "hidden_states": torch.zeros(2, 4, 2)}) is None
    assert key(**{**row, "timestep": torch.tensor(1.0)}) is None
    assert key(**row, attention_kwargs=None) is not None


def test_a_group_runs_the_largest_set_of_equal_rows_and_puts_the_others_off() -> None:
    sizes: list[int] = []

    class Doubling(torch.nn.Module):
        def forward(self, hidden_states: torch.Tensor, scale: float) -> tuple[torch.Tensor]:
            sizes.append(hidden_states.shape[0])
            if scale < 0:
                raise ValueError("refused")
            return (hidden_states * scale,)

    module = Doubling()
    engine = SimpleNamespace(lock=SegmentLock(), loras=SimpleNamespace(activate=lambda *a: None))
    group = _calls.CallGroup(engine, SimpleNamespace(), "key", None)  # type: ignore[arg-type]

    def row(value: float, width: int = 2, scale: float = 2.0, put_off: int = 0) -> Any:
        kwargs = {"hidden_states": torch.full((1, width), value), "scale": scale}
        key = _calls.row_key(module, None, (), kwargs)
        return _calls.CallRow(module, None, kwargs, key, put_off)

    # The largest set of equal keys runs, in one forward; the others are put off.
    results = group([row(1.0), row(2.0, width=3), row(3.0), row(4.0, scale=-1.0)])
    assert sizes == [2]  # the two rows of width 2 and scale 2
    assert [r[0].tolist() for r in results[::2]] == [[[2.0, 2.0]], [[6.0, 6.0]]]
    assert results[1] is _calls.DEFERRED and results[3] is _calls.DEFERRED
    # Put off as often as may be, they run: each in a forward of its own.
    last = _calls.MAX_DEFERRED
    results = group([row(2.0, width=3, put_off=last), row(4.0, scale=-1.0, put_off=last)])
    assert sizes == [2, 1, 1]
    assert results[0][0].tolist() == [[4.0] * 3]
    assert isinstance(results[1], ValueError)  # its own forward failed: only its row
    # A tie goes to the row put off most, then to the oldest.
    results = group([row(1.0), row(2.0, width=3, put_off=1)])
    assert results[0] is _calls.DEFERRED and results[1] is not _calls.DEFERRED
    results = group([row(1.0), row(2.0, width=3)])
    assert results[0] is not _calls.DEFERRED and results[1] is _calls.DEFERRED
    # A row that can share no forward is never put off.
    alone_row = _calls.CallRow(
        module, None, {"hidden_states": torch.ones(1, 2), "scale": 1.0}, None
    )
    results = group([row(1.0), row(3.0), alone_row])
    assert all(result is not _calls.DEFERRED for result in results)
    assert not engine.lock._held
