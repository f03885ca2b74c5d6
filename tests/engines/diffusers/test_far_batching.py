"""AnyFlow FAR chunks batched across sessions (issue 24): with ``max_batch`` > 1 the
flow-map steps of several sessions' chunks run as one transformer forward, each row
reading its own session's KV cache (joined along the batch dimension for the forward).

Sessions run as the server runs them (test_batching's `run_batched`: a `StepBatcher`,
each session's checkpoint, ``next_chunk`` in a worker thread), joining and leaving
mid-stream; each one's frames are compared with the same request run alone on the
unbatched path (``max_batch`` 1), which test_far checks against the pipeline's single
call. What reaches the transformer is watched through a hook on the real module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
import trio

from tests.engines.diffusers.support import START, encode, live_tensor_bytes, no_stop, run_session
from tests.engines.diffusers.test_batching import Session, alone, assert_same, run_batched
from tests.engines.diffusers.test_far import (  # noqa: F401 (an autouse fixture)
    _eager_flex_attention,
    far_request,
)
from trio_vstream.engines import Engine, load_engine
from trio_vstream.engines.contract import PromptChange
from trio_vstream.engines.diffusers import DiffusersEngine
from trio_vstream.engines.diffusers.loops import far
from trio_vstream.engines.testing import check_engine

GUIDED = {"guidance_scale": 3.0, "negative_prompt": "blurry"}


def fr(request_id: str, seed: int, num_frames: int = 25, **fields: Any) -> Any:
    """32x32, three steps a chunk, guided: 25 frames are chunks of 1, 8, 8 and 8 frames
    (latent 1, 2, 2, 2; the fourth sees the first compressed), 17 frames three chunks."""
    values: dict[str, Any] = {"num_inference_steps": 3, **GUIDED}
    values.update(fields)
    return far_request(request_id=request_id, seed=seed, num_frames=num_frames, **values)


@pytest.fixture
def engine(anyflow_far: Path, make_engine: Any) -> DiffusersEngine:
    made: DiffusersEngine = make_engine(anyflow_far, segment_frames="8", max_batch="8")
    return made


@attrs.define
class Forwards:
    """The transformer forwards seen by a hook on the real module: per flow-map step and
    per cache pass, its chunk partition (up to its chunk) and its batch dimension."""

    steps: list[tuple[tuple[int, ...], int]] = attrs.Factory(list)
    cache_passes: list[tuple[tuple[int, ...], int]] = attrs.Factory(list)

    def sizes(self) -> list[int]:
        return [size for _, size in self.steps]

    def clear(self) -> None:
        self.steps.clear()
        self.cache_passes.clear()


@pytest.fixture
def forwards(engine: DiffusersEngine) -> Iterator[Forwards]:
    seen = Forwards()

    def before_forward(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen_now = (tuple(kwargs["chunk_partition"]), int(kwargs["hidden_states"].shape[0]))
        if kwargs["kv_cache_flag"]["is_cache_step"]:
            seen.cache_passes.append(seen_now)
        else:
            seen.steps.append(seen_now)

    hook = engine.model.pipe.transformer.register_forward_pre_hook(before_forward, with_kwargs=True)
    yield seen
    hook.remove()


def test_far_chunks_batch_when_the_engine_does(anyflow_far: Path, make_engine: Any) -> None:
    assert far.LOOP.batches  # type: ignore[attr-defined]
    assert make_engine(anyflow_far, segment_frames="8").max_batch == 1  # the default
    assert make_engine(anyflow_far, segment_frames="8", max_batch="4").max_batch == 4


def test_a_lone_batching_session_runs_its_rows_in_place(
    engine: DiffusersEngine, forwards: Forwards
) -> None:
    # The base checkpoint (no server) runs each row alone: the batched path, one session,
    # the image's chunk (context, not denoised) included.
    image = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)
    for req in (fr("a", 1), fr("i", 2, image=image, guidance_scale=1.0, negative_prompt=None)):
        forwards.clear()
        stream = engine.open_stream(req)
        chunks = []
        try:
            while (chunk := stream.next_chunk(no_stop)) is not None:
                chunks.append(chunk.frames)
        finally:
            stream.close()
        guided = req.guidance_scale > 1.0
        denoised = 4 if req.image is None else 3
        assert forwards.sizes() == [2 if guided else 1] * (3 * denoised)
        np.testing.assert_array_equal(np.concatenate(chunks), alone(engine, req))


@pytest.mark.slow
async def test_batched_chunks_equal_each_session_alone(
    engine: DiffusersEngine, forwards: Forwards
) -> None:
    # a and b start together; c (three chunks) and d join once a has made its first
    # chunk, so they are a chunk behind a and b: a step of another chunk index attends
    # to another length of history at other positions, so the pairs share no forward.
    # c leaves after three chunks, while d goes on.
    sessions = [
        Session(fr("a", 1)),
        Session(fr("b", 2)),
        Session(fr("c", 3, num_frames=17), after=("a", 1)),
        Session(fr("d", 4), after=("a", 1)),
    ]
    frames, batcher = await run_batched(engine, sessions)
    # Guided rows run their conditional and unconditional passes in one forward (2 per
    # row), and rows of several sessions share forwards (a and b at least: they are in
    # their chunks together; whether c and d meet is the threads' timing).
    assert all(size % 2 == 0 for size in forwards.sizes())
    assert max(forwards.sizes()) >= 4, forwards
    # Each chunk's steps and each cache pass (one before every chunk but the first) are
    # rows.
    assert batcher.rows == 3 * (4 + 4 + 3 + 4) + (3 + 3 + 2 + 3)
    assert batcher.batches < batcher.rows
    forwards.clear()
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(engine, s.req))
    assert forwards.steps and max(forwards.sizes()) == 2  # the references: one guided row a forward


@pytest.mark.slow
async def test_a_stop_and_an_interaction_touch_only_their_own_rows(
    engine: DiffusersEngine,
) -> None:
    to_whale = {2: PromptChange("w", "a whale in the sea", 0)}
    sessions = [
        Session(fr("stopped", 1), stop_at=5),  # chunk 1's first step, after its cache pass
        Session(fr("changed", 2), changes=to_whale),
        Session(fr("plain", 2)),  # the same seed and prompt as "changed"
    ]
    frames, _ = await run_batched(engine, sessions)
    stopped, changed, plain = frames["stopped"], frames["changed"], frames["plain"]
    assert stopped is not None and stopped.shape[0] == 1  # chunk 0 only: 1 is not decoded
    assert_same(stopped, alone(engine, sessions[0].req)[:1])
    assert changed is not None and plain is not None
    assert_same(changed[:9], plain[:9])  # the same up to the change, but for rounding
    assert not np.array_equal(changed[9:], plain[9:])
    assert_same(changed, alone(engine, sessions[1].req, to_whale))
    assert_same(plain, alone(engine, sessions[2].req))


@pytest.mark.slow
async def test_rows_of_other_chunks_or_shapes_run_apart(
    engine: DiffusersEngine, forwards: Forwards
) -> None:
    # Guidance off against on, another size, and another partition (chunks of 1, 3, 3):
    # four keys at every chunk, but for the first chunk of the guided session and the
    # one of another partition, which are alike (one latent frame, no history).
    sessions = [
        Session(fr("plain", 1, guidance_scale=1.0, negative_prompt=None)),
        Session(fr("guided", 2)),
        Session(fr("wide", 3, width=48)),
        Session(fr("three", 4, extra_params={"chunk_partition": [1, 3, 3]})),
    ]
    frames, batcher = await run_batched(engine, sessions)
    assert batcher.rows == 3 * (4 + 4 + 4 + 3) + (3 + 3 + 3 + 2)
    # One row alone, or one guided row's pair; two pairs only at the first chunk.
    for seen in (forwards.steps, forwards.cache_passes):
        later = {size for partition, size in seen if partition != (1,)}
        first = {size for partition, size in seen if partition == (1,)}
        assert later == {1, 2} and first <= {1, 2, 4}, forwards
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(engine, s.req))


@pytest.mark.slow
async def test_memory_is_flat_over_batched_chunks(
    engine: DiffusersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What test_far checks of a lone session holds for sessions stepped together: what
    # each keeps is allocated at its first chunk, and nothing grows after it; the caches
    # a batch joins for its forwards outlive neither the forward nor the chunk.
    held: dict[int, list[int]] = {}
    finish = far.FarLoop._finish

    def recording(self: far.FarLoop, checkpoint: Any, pipe: Any, latents: Any) -> Any:
        video = finish(self, checkpoint, pipe, latents)
        held.setdefault(id(self), []).append(self.held_bytes)
        return video

    monkeypatch.setattr(far.FarLoop, "_finish", recording)
    chunks = 5
    frames = 1 + 8 * (chunks - 1)
    sessions = [Session(fr(name, seed, num_frames=frames)) for name, seed in (("a", 1), ("b", 2))]
    await run_batched(engine, sessions)  # the pipeline's own first-use allocations
    before = live_tensor_bytes()
    held.clear()
    _, batcher = await run_batched(engine, sessions)
    assert batcher.rows > batcher.batches  # the two sessions' rows shared forwards
    assert len(held) == 2
    for kept in held.values():
        assert len(kept) == chunks and len(set(kept[1:])) == 1, kept
    latent_frame = 16 * 4 * 4 * 4  # channels x 4x4 x float32
    assert abs(live_tensor_bytes() - before) < latent_frame


def test_a_batched_forward_gives_each_row_what_it_gives_the_row_alone(
    engine: DiffusersEngine, forwards: Forwards
) -> None:
    # Two guided sessions at their fourth chunk, whose history holds a compressed chunk:
    # the third chunk's cache pass and a step of the fourth, for both rows in one
    # forward, and for each row alone on a copy of its cache. Deterministic (no threads),
    # so the forwards of four rows are certain to have run.
    streams = [engine.open_stream(fr(name, seed)) for name, seed in (("a", 1), ("b", 2))]
    pipe = engine.model.pipe
    embeds, negative = encode(pipe, "a red fox in the snow"), encode(pipe, "blurry")
    try:
        for stream in streams:
            for _ in range(3):
                assert stream.next_chunk(no_stop) is not None
        runs = [stream._run for stream in streams]
        assert all(run.chunks_done == 3 and run._cached_chunks == 2 for run in runs)
        partition = runs[0].plan.partition

        def key(latents: torch.Tensor, chunks: int, cache_pass: bool) -> far.FarKey:
            return far.FarKey(
                partition=partition[:chunks],
                input_shape=tuple(latents.shape),
                embeds_shape=tuple(embeds.shape),
                guided=True,
                dtype=str(latents.dtype),
                lora=None,
                alone=None,
                cache_pass=cache_pass,
            )

        def copied(cache: dict[int, dict[str, torch.Tensor]]) -> Any:
            return {i: {n: t.clone() for n, t in names.items()} for i, names in cache.items()}

        # The cache pass over chunks 0 to 2: the caches it writes.
        history = [run._output[:, : sum(partition[:3])] for run in runs]  # type: ignore[index]
        passes = far.CachePassGroup(engine, engine.model, key(history[0], 3, True), None, None)
        own = [copied(run._kv_cache) for run in runs]  # type: ignore[arg-type]
        guided = {"embeds": embeds, "negative": negative}
        forwards.clear()
        for row_cache, latents in zip(own, history, strict=True):
            passes([far.CacheRow(latents=latents, cache=row_cache, **guided)])
        rows = [
            far.CacheRow(latents=latents, cache=run._kv_cache, **guided)  # type: ignore[arg-type]
            for latents, run in zip(history, runs, strict=True)
        ]
        assert passes(rows) == [None, None]
        assert forwards.cache_passes == [(partition[:3], 2)] * 2 + [(partition[:3], 4)]
        for row_cache, run in zip(own, runs, strict=True):
            assert run._kv_cache is not None
            for layer, names in run._kv_cache.items():
                for name, written in names.items():
                    alone_wrote = row_cache[layer][name]
                    torch.testing.assert_close(written, alone_wrote, rtol=1e-4, atol=1e-5)
        for run in runs:  # as the session counts its passes
            assert run._kv_flag is not None
            run._kv_flag["num_cached_chunks"] += 1
        # A step of chunk 3, each row at its own timestep and guidance scale.
        start, end = runs[0].plan.bounds(3)
        own_steps = ((999.0, 500.0, 3.0), (700.0, 0.0, 5.0))
        step_rows = [
            far.ChunkRow(
                latents=run._noise[:, start:end],  # type: ignore[index]
                timestep=torch.tensor(t),
                r_timestep=torch.tensor(r),
                guidance=guidance,
                cache=run._kv_cache,  # type: ignore[arg-type]
                **guided,
            )
            for run, (t, r, guidance) in zip(runs, own_steps, strict=True)
        ]
        step_key = key(step_rows[0].latents, 4, False)
        group = far.ChunkGroup(engine, engine.model, step_key, None, None)
        together = group(step_rows)
        apart = [group([row])[0] for row in step_rows]
        assert forwards.steps == [(partition, 4), (partition, 2), (partition, 2)]
        assert not torch.equal(apart[0], apart[1])
        for joint, lone in zip(together, apart, strict=True):
            assert isinstance(joint, torch.Tensor) and isinstance(lone, torch.Tensor)
            torch.testing.assert_close(joint, lone, rtol=1e-4, atol=1e-5)
    finally:
        for stream in streams:
            stream.close()


@pytest.mark.slow
def test_a_batching_far_engine_keeps_the_contract(anyflow_far: Path) -> None:
    # The kit steps a few streams alone and then together (its own batcher), stops each
    # at every checkpoint in turn (cache passes included), fails one, interacts with two.
    def factory() -> Engine:
        args = {
            "model": str(anyflow_far),
            "segment_frames": "8",
            "threads": "1",
            "max_batch": "4",
        }
        return load_engine("diffusers", args, device="cpu")

    check_engine(factory, fr("kit", 1, num_inference_steps=2))


@pytest.fixture(scope="module")
def far_lora(anyflow_far: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LoRA for the FAR transformer (its attention names are Wan's)."""
    from trio_vstream.engines.diffusers.testing import build_lora

    root = tmp_path_factory.mktemp("far_lora")
    made = build_lora(anyflow_far, root / "lora", model_class="AnyFlowFARTransformer3DModel")
    return Path(made) / "pytorch_lora_weights.safetensors"


@pytest.mark.slow
async def test_rows_share_a_forward_only_with_the_same_lora(
    anyflow_far: Path, make_engine: Any, far_lora: Path
) -> None:
    engine = make_engine(
        anyflow_far, segment_frames="8", max_batch="8", lora_root=str(far_lora.parents[1])
    )
    sizes: list[int] = []
    hook = engine.model.pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(int(kwargs["hidden_states"].shape[0])),
        with_kwargs=True,
    )
    lora = {"path": str(far_lora), "scale": 0.8}
    unguided = {"guidance_scale": 1.0, "negative_prompt": None, "num_frames": 17}
    sessions = [
        Session(fr("lora1", 1, lora=lora, **unguided)),
        Session(fr("lora2", 2, lora=lora, **unguided)),
        Session(fr("plain", 1, **unguided)),
        Session(fr("half", 2, lora={**lora, "scale": 0.4}, **unguided)),
    ]
    try:
        frames, _ = await run_batched(engine, sessions)
    finally:
        hook.remove()
    # The two sessions of the same adapter and scale share forwards (steps and cache
    # passes alike); the plain one and the one at another scale run apart.
    assert max(sizes) == 2 and sizes.count(2) >= 1, sizes
    for s in sessions:
        assert_same(frames[s.req.request_id], alone(engine, s.req))
    assert not np.array_equal(frames["lora1"], frames["plain"])  # the adapter was on


@pytest.mark.slow
async def test_a_server_batches_the_sessions_of_a_far_engine(
    engine: DiffusersEngine, serve: Any
) -> None:
    server, summaries = await serve(engine)
    assert server.batcher is not None and server.batcher.max_batch == 8
    start = {**START, "size": "32x32", "num_frames": 17, "num_inference_steps": 2, **GUIDED}
    transcripts: list[Any] = []

    async def one(seed: int) -> None:
        transcripts.append(await run_session(server.url, {**start, "seed": seed}))

    async with trio.open_nursery() as nursery:
        for seed in (1, 2, 3):
            nursery.start_soon(one, seed)
    for transcript in transcripts:
        media = [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
        assert [m["num_frames"] for m in media] == [1, 8, 8]
        assert transcript.terminal[-1]["type"] == "session.done"
    with trio.fail_after(5):
        await summaries.wait_for(3)
    assert [s.outcome.value for s in summaries] == ["completed"] * 3
    # Every step and cache pass went through the batcher (whether sessions met in a
    # batch depends on when their connections came: that rows do share is tested above).
    assert server.batcher.rows == 3 * (3 * 2 + 2)
