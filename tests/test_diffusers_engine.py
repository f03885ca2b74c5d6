"""The diffusers engine on tiny random Wan pipelines, offline, on CPU.

The pipelines are built in code (``tests/diffusers_fixtures.py``), saved with
``save_pretrained`` once per test session, and loaded back by the engine the
way ``--engine diffusers --engine-arg model=...`` does. What reaches the models
is observed through hooks on the real modules (transformer calls, VAE decodes,
the image handed to the image-to-video pipeline); nothing under test is mocked.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import numpy as np
import torch
import trio
from trio_websocket import open_websocket_url

from tests.conftest import CLIENT_MAX_MESSAGE, Transcript, decode_video, receive_into
from tests.diffusers_fixtures import build_lora, build_wan_i2v, build_wan_t2v
from trio_vstream.engines import (
    Checkpoint,
    EngineConfigError,
    GenerationRequest,
    InvalidRequestError,
    PromptChange,
    checkpoint_calling,
    load_engine,
)
from trio_vstream.engines.diffusers import DiffusersEngine
from trio_vstream.server import ServerConfig, VideoServer
from trio_vstream.session import SessionConfig, SessionSummary

START = {
    "type": "session.start",
    "prompt": "a red fox in the snow",
    "size": "48x32",
    "fps": 8,
    "num_inference_steps": 2,
    "seed": 1,
}


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("diffusers_models")
    t2v = build_wan_t2v(root / "Wan-tiny-T2V")
    return SimpleNamespace(
        t2v=t2v,
        i2v=build_wan_i2v(root / "Wan-tiny-I2V"),
        lora=build_lora(t2v, root / "lora"),
    )


@pytest.fixture
def make_engine() -> Iterator[Callable[..., DiffusersEngine]]:
    engines: list[DiffusersEngine] = []

    def make(model: Path, **args: str) -> DiffusersEngine:
        args = {"model": str(model), "segment_frames": "5", "threads": "1", **args}
        engine = load_engine("diffusers", args, device="cpu")
        assert isinstance(engine, DiffusersEngine)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def request(**fields: Any) -> GenerationRequest:
    values: dict[str, Any] = {
        "request_id": "test",
        "prompt": "a red fox in the snow",
        "width": 48,
        "height": 32,
        "fps": 8,
        "num_frames": 12,
        "num_inference_steps": 2,
        "guidance_scale": 1.0,
        "seed": 1,
    }
    values.update(fields)
    return GenerationRequest(**values)


no_stop = Checkpoint()


def run_all(stream: Any, checkpoint: Checkpoint = no_stop) -> list[Any]:
    chunks = []
    try:
        while (chunk := stream.next_chunk(checkpoint)) is not None:
            chunks.append(chunk)
    finally:
        stream.close()
    return chunks


class Probe:
    """Watches a pipeline's real modules: every transformer call, every VAE decode."""

    def __init__(self, pipe: Any, *, step_delay: float = 0.0, keep_embeds: bool = False) -> None:
        self.pipe = pipe
        self.forwards: list[tuple[float, int]] = []
        self.decodes: list[tuple[float, int]] = []
        self.embeds: list[torch.Tensor] = []
        self.embed_refs: list[weakref.ref[torch.Tensor]] = []
        self.flow_shifts: list[float] = []
        self.images: list[np.ndarray] = []

        def before_forward(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            self.forwards.append((time.monotonic(), threading.get_ident()))
            embeds = kwargs["encoder_hidden_states"]
            self.embed_refs.append(weakref.ref(embeds))
            if keep_embeds:
                self.embeds.append(embeds.detach().clone())
            self.flow_shifts.append(pipe.scheduler.config.flow_shift)
            if step_delay:
                time.sleep(step_delay)

        self._hook = pipe.transformer.register_forward_pre_hook(before_forward, with_kwargs=True)
        decode = pipe.vae.decode

        def counting_decode(*args: Any, **kwargs: Any) -> Any:
            self.decodes.append((time.monotonic(), threading.get_ident()))
            return decode(*args, **kwargs)

        pipe.vae.decode = counting_decode
        processor = pipe.video_processor
        preprocess = processor.preprocess

        def recording_preprocess(image: Any, *args: Any, **kwargs: Any) -> Any:
            self.images.append(np.asarray(image).copy())
            return preprocess(image, *args, **kwargs)

        processor.preprocess = recording_preprocess

    def remove(self) -> None:
        self._hook.remove()
        del self.pipe.vae.decode
        del self.pipe.video_processor.preprocess


def encode(pipe: Any, text: str) -> torch.Tensor:
    """A prompt's embedding as the pipeline itself computes it for a call."""
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(
            prompt=text, do_classifier_free_guidance=False, max_sequence_length=512
        )
    return embeds


@pytest.fixture
async def serve(nursery: trio.Nursery) -> Any:
    async def start(engine: Any) -> tuple[VideoServer, list[SessionSummary]]:
        summaries: list[SessionSummary] = []
        config = ServerConfig(
            host="127.0.0.1",
            port=0,
            max_sessions=4,
            shutdown_grace=5.0,
            session=SessionConfig(served_model=engine.name),
        )
        server = VideoServer(engine, config, on_session_end=summaries.append)
        await nursery.start(server.run)
        return server, summaries

    return start


async def run_session(url: str, start: dict[str, Any]) -> Transcript:
    transcript = Transcript()
    async with open_websocket_url(url, max_message_size=CLIENT_MAX_MESSAGE) as ws:
        await ws.send_message(json.dumps(start))
        await receive_into(ws, transcript)
    return transcript


# ------------------------------------------------------------ through the server


async def test_server_streams_segments_that_decode_to_the_requested_video(
    models: SimpleNamespace, make_engine: Any, serve: Any
) -> None:
    engine = make_engine(models.t2v)
    assert engine.name == "Wan-tiny-T2V"
    server, summaries = await serve(engine)
    transcript = await run_session(server.url, {**START, "num_frames": 12})

    metas = transcript.of_type("video.chunk_metadata")
    media = [m for m in metas if m["kind"] == "media"]
    # Segments of 5 frames (Wan's 4k+1), the last one trimmed to what is left.
    assert [m["num_frames"] for m in media] == [5, 5, 2]
    assert [m["generation_chunk_index"] for m in media] == [0, 1, 2]
    assert transcript.terminal[-1]["type"] == "session.done"
    frames = decode_video(transcript.video_bytes)
    assert len(frames) == 12
    assert frames[0].shape == (32, 48, 3)
    assert summaries[0].outcome.value == "completed"


async def test_stop_mid_segment_runs_at_most_one_more_step_and_no_decode(
    models: SimpleNamespace, make_engine: Any, serve: Any
) -> None:
    engine = make_engine(models.t2v)
    probe = Probe(engine.model.pipe, step_delay=0.05)
    server, summaries = await serve(engine)
    transcript = Transcript()
    async with open_websocket_url(server.url, max_message_size=CLIENT_MAX_MESSAGE) as ws:
        await ws.send_message(
            json.dumps({**START, "num_inference_steps": 30, "guidance_scale": 1.0})
        )
        with trio.fail_after(10):
            while len(probe.forwards) < 3:  # well inside the first segment's steps
                await trio.sleep(0.005)
        stopped_at = time.monotonic()
        await ws.send_message('{"type": "session.stop"}')
        await receive_into(ws, transcript)
    probe.remove()

    done = transcript.terminal
    assert len(done) == 1 and done[0]["type"] == "session.done" and done[0]["stopped"] is True
    assert not [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
    assert sum(1 for t, _ in probe.forwards if t > stopped_at) <= 1  # one step per forward here
    assert len(probe.forwards) < 10
    assert probe.decodes == []  # the VAE never ran for the stopped segment
    with trio.fail_after(5):
        while not summaries:
            await trio.sleep(0.005)
    assert summaries[0].outcome.value == "stopped"
    # The pipeline is free again: another session runs to the end.
    transcript = await run_session(server.url, {**START, "num_frames": 5})
    assert len(decode_video(transcript.video_bytes)) == 5


async def test_unknown_extra_params_are_invalid_request(
    models: SimpleNamespace, make_engine: Any, serve: Any
) -> None:
    engine = make_engine(models.t2v)
    server, _ = await serve(engine)
    transcript = await run_session(
        server.url, {**START, "extra_params": {"bogus_knob": 1, "max_sequence_length": 64}}
    )
    [error] = transcript.terminal
    assert error["type"] == "error" and error["code"] == "invalid_request"
    assert "bogus_knob" in error["message"] and "max_sequence_length" not in error["message"]


async def test_concurrent_sessions_take_whole_segments_in_turn_and_keep_their_lora(
    models: SimpleNamespace, make_engine: Any, serve: Any
) -> None:
    engine = make_engine(models.t2v)
    lora = {"path": str(models.lora), "scale": 1.0}
    # Each session alone, straight on the engine: the reference frames.
    alone_plain = run_all(engine.open_stream(request(prompt="plain", num_frames=10)))
    alone_lora = run_all(engine.open_stream(request(prompt="lora", num_frames=10, lora=lora)))

    recorded: dict[str, list[np.ndarray]] = {"plain": [], "lora": []}
    open_stream = engine.open_stream

    def recording_open_stream(req: GenerationRequest) -> Any:
        stream = open_stream(req)
        next_chunk = stream.next_chunk

        def recording_next_chunk(checkpoint: Any) -> Any:
            chunk = next_chunk(checkpoint)
            if chunk is not None:
                recorded[req.prompt].append(chunk.frames)
            return chunk

        stream.next_chunk = recording_next_chunk  # type: ignore[method-assign]
        return stream

    engine.open_stream = recording_open_stream  # type: ignore[method-assign]
    probe = Probe(engine.model.pipe, step_delay=0.005)
    server, summaries = await serve(engine)
    common = {**START, "num_frames": 10, "guidance_scale": 1.0}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_session, server.url, {**common, "prompt": "plain"})
        nursery.start_soon(run_session, server.url, {**common, "prompt": "lora", "lora": lora})
    probe.remove()

    assert [s.outcome.value for s in summaries] == ["completed", "completed"]
    # Same frames as alone: the LoRA applied to its own session's segments only.
    for name, alone in (("plain", alone_plain), ("lora", alone_lora)):
        assert len(recorded[name]) == len(alone) == 2
        for got, expected in zip(recorded[name], alone, strict=True):
            np.testing.assert_array_equal(got, expected.frames)
    assert not np.array_equal(alone_plain[0].frames, alone_lora[0].frames)
    # Whole segments in turn: between a segment's first step and its decode, no other
    # session's step ran; and both sessions did run while the other was open.
    events = sorted(
        [(t, thread, "step") for t, thread in probe.forwards]
        + [(t, thread, "decode") for t, thread in probe.decodes]
    )
    owner = None
    for _, thread, kind in events:
        if kind == "step":
            assert owner in (None, thread), "steps of two segments interleaved"
            owner = thread
        else:
            assert owner == thread
            owner = None
    assert engine.model.pipe.get_list_adapters() in ({}, {"transformer": []})


# ------------------------------------------------------------ engine, directly


def test_interaction_blends_prompt_embeddings_over_the_next_segments(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v)
    pipe = engine.model.pipe
    probe = Probe(pipe, keep_embeds=True)
    stream = engine.open_stream(request(prompt="a red fox", num_frames=15))
    first = stream.next_chunk(no_stop)
    stream.interact(PromptChange("e1", "a blue whale", transition_chunks=2))
    second = stream.next_chunk(no_stop)
    third = stream.next_chunk(no_stop)
    assert stream.next_chunk(no_stop) is None
    stream.close()
    probe.remove()

    fox, whale = encode(pipe, "a red fox"), encode(pipe, "a blue whale")
    assert not torch.allclose(fox, whale)
    steps = 2  # per segment; guidance_scale 1: one transformer call per step
    used = [probe.embeds[i : i + steps] for i in range(0, len(probe.embeds), steps)]
    assert len(used) == 3
    expected = [fox, 0.5 * fox + 0.5 * whale, whale]
    for segment, target in zip(used, expected, strict=True):
        for embeds in segment:
            torch.testing.assert_close(embeds, target, rtol=1e-5, atol=1e-6)
    assert (first.started_event_ids, first.active_event_ids) == ((), ())
    assert (second.started_event_ids, second.active_event_ids) == (("e1",), ("e1",))
    assert (third.active_event_ids, third.completed_event_ids) == ((), ("e1",))


def test_request_parameters_reach_the_pipeline_call(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v)
    pipe = engine.model.pipe
    probe = Probe(pipe, keep_embeds=True)
    chunks = run_all(
        engine.open_stream(
            request(
                num_frames=5,
                num_inference_steps=3,
                guidance_scale=4.0,
                negative_prompt="blurry",
                flow_shift=5.0,
                seed=11,
            )
        )
    )
    probe.remove()
    assert len(probe.forwards) == 6  # 3 steps, each a conditional and an unconditional call
    torch.testing.assert_close(probe.embeds[0], encode(pipe, "a red fox in the snow"))
    torch.testing.assert_close(probe.embeds[1], encode(pipe, "blurry"))
    assert probe.flow_shifts == [5.0] * 6
    assert pipe.scheduler.config.flow_shift == 3.0  # for that call only
    # The seed decides the noise: same seed, same video; another seed, another video.
    again = run_all(
        engine.open_stream(
            request(
                num_frames=5,
                num_inference_steps=3,
                guidance_scale=4.0,
                negative_prompt="blurry",
                flow_shift=5.0,
                seed=11,
            )
        )
    )
    other = run_all(
        engine.open_stream(
            request(
                num_frames=5,
                num_inference_steps=3,
                guidance_scale=4.0,
                negative_prompt="blurry",
                flow_shift=5.0,
                seed=12,
            )
        )
    )
    np.testing.assert_array_equal(chunks[0].frames, again[0].frames)
    assert not np.array_equal(chunks[0].frames, other[0].frames)
    # Without an image-to-video pipeline, segments are clips of their own, each with its
    # own seed (seed + index): same prompt, yet a different clip.
    first, second = run_all(engine.open_stream(request(num_frames=10, seed=11)))
    assert not np.array_equal(first.frames, second.frames)


def test_i2v_segments_continue_from_the_previous_last_frame(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v, i2v_model=str(models.i2v))
    t2v_probe = Probe(engine.model.pipe)
    i2v_probe = Probe(engine.i2v.pipe)
    reference = np.zeros((20, 30, 3), np.uint8)
    reference[:, :15] = (250, 10, 10)
    chunks = run_all(engine.open_stream(request(num_frames=12, image=reference)))
    plain = run_all(engine.open_stream(request(num_frames=9)))
    t2v_probe.remove()
    i2v_probe.remove()

    # 5 frames, then 4 new ones per segment (the first is the frame continued from).
    assert [c.frames.shape[0] for c in chunks] == [5, 4, 3]
    images = i2v_probe.images
    assert len(images) == 3 + 1
    # The image reference, resized to the video, conditions the first segment...
    assert images[0].shape == (32, 48, 3)
    assert images[0][:, :20].mean(axis=(0, 1))[0] > 200
    assert images[0][:, 28:].max() < 10
    # ...and each later segment starts from the last frame of the one before.
    np.testing.assert_array_equal(images[1], chunks[0].frames[-1])
    np.testing.assert_array_equal(images[2], chunks[1].frames[-1])
    # Without an image, the text-to-video pipeline makes the first segment.
    assert len(t2v_probe.forwards) == 2 and len(t2v_probe.decodes) == 1
    assert [c.frames.shape[0] for c in plain] == [5, 4]
    np.testing.assert_array_equal(images[3], plain[0].frames[-1])


class _Stopped(BaseException):
    """Stands in for trio.Cancelled, which checkpoint() raises: a BaseException."""


def test_a_raising_checkpoint_stops_the_segment_before_more_steps_and_the_decode(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v)
    probe = Probe(engine.model.pipe)
    calls = 0

    def checkpoint() -> None:
        nonlocal calls
        calls += 1
        if len(probe.forwards) == 2:  # after the second step
            raise _Stopped

    stream = engine.open_stream(request(num_inference_steps=10))
    with pytest.raises(_Stopped):
        stream.next_chunk(checkpoint_calling(checkpoint, checkpoint))
    stream.close()
    assert len(probe.forwards) == 2
    assert probe.decodes == []
    # Nothing is left held: another stream runs.
    assert len(run_all(engine.open_stream(request(num_frames=5)))[0].frames) == 5
    probe.remove()


def test_a_session_waiting_for_the_pipeline_can_be_stopped(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v)
    probe = Probe(engine.model.pipe, step_delay=0.05)
    busy = engine.open_stream(request(num_frames=5, num_inference_steps=20))  # ~1 s
    holder = threading.Thread(target=run_all, args=(busy,))
    holder.start()
    try:
        deadline = time.monotonic() + 5
        while not probe.forwards and time.monotonic() < deadline:
            time.sleep(0.005)
        waiting = engine.open_stream(request(prompt="another session"))
        stop_at = time.monotonic() + 0.1

        def checkpoint() -> None:
            if time.monotonic() > stop_at:
                raise _Stopped

        with pytest.raises(_Stopped):
            waiting.next_chunk(checkpoint_calling(checkpoint, checkpoint))
        waited = time.monotonic() - stop_at
        waiting.close()
        assert holder.is_alive()  # the other segment still holds the pipeline...
        assert waited < 0.3  # ...yet the waiting session stopped at once
        assert {thread for _, thread in probe.forwards} == {holder.ident}
    finally:
        holder.join(timeout=30)
        probe.remove()
    assert len(probe.forwards) == 20 and len(probe.decodes) == 1


def test_lora_is_loaded_for_its_session_and_unloaded_when_it_closes(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v)
    pipe = engine.model.pipe
    modules_before = {name: type(m) for name, m in pipe.transformer.named_modules()}
    params_before = sum(p.numel() for p in pipe.transformer.parameters())
    plain = run_all(engine.open_stream(request(num_frames=5)))

    stream = engine.open_stream(
        request(num_frames=10, lora={"path": str(models.lora), "scale": 0.8, "name": "x"})
    )
    first = stream.next_chunk(no_stop)
    assert first is not None
    assert any("lora_A" in name for name, _ in pipe.transformer.named_modules())
    assert not np.array_equal(first.frames, plain[0].frames)
    stream.close()  # between segments: unloaded at once

    assert pipe.get_list_adapters() in ({}, {"transformer": []})
    assert {name: type(m) for name, m in pipe.transformer.named_modules()} == modules_before
    assert sum(p.numel() for p in pipe.transformer.parameters()) == params_before
    after = run_all(engine.open_stream(request(num_frames=5)))
    np.testing.assert_array_equal(after[0].frames, plain[0].frames)


def _count_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def test_no_tensor_of_a_finished_session_stays_referenced(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v, i2v_model=str(models.i2v))
    image = np.full((32, 48, 3), 120, np.uint8)
    lora = {"path": str(models.lora), "scale": 0.5}

    def session(stop_after_steps: int | None = None) -> weakref.ref[Any]:
        stream = engine.open_stream(request(num_frames=12, image=image, lora=lora))
        probe_count = len(probe.forwards)

        def checkpoint() -> None:
            if (
                stop_after_steps is not None
                and len(probe.forwards) - probe_count >= stop_after_steps
            ):
                raise _Stopped

        stop = checkpoint_calling(checkpoint, checkpoint)
        try:
            stream.next_chunk(stop)
            stream.interact(PromptChange("e1", "something else", transition_chunks=1))
            while stream.next_chunk(stop) is not None:
                pass
        except _Stopped:
            pass
        finally:
            stream.close()
        return weakref.ref(stream)

    probe = Probe(engine.i2v.pipe)
    session()  # warm-up: lazily created state is not the session's
    baseline = _count_tensors()
    for stop in (None, 3):  # a whole session, and one stopped mid-segment
        ref = session(stop)
        assert ref() is None
        assert _count_tensors() == baseline
        assert all(r() is None for r in probe.embed_refs)
    probe.remove()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_returns_to_baseline_after_a_session(models: SimpleNamespace) -> None:
    engine = load_engine(
        "diffusers", {"model": str(models.t2v), "segment_frames": "5"}, device="cuda"
    )
    lora = {"path": str(models.lora), "scale": 0.7}
    try:
        run_all(engine.open_stream(request(num_frames=10, lora=lora)))  # warm-up
        gc.collect()
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        stream = engine.open_stream(request(num_frames=10, lora=lora))
        stream.next_chunk(no_stop)
        stream.interact(PromptChange("e1", "other", transition_chunks=1))

        calls = 0

        def stop_mid_segment() -> None:
            nonlocal calls
            calls += 1
            if calls >= 3:  # after taking the pipeline, before the call, after one step
                raise _Stopped

        with pytest.raises(_Stopped):
            stream.next_chunk(checkpoint_calling(stop_mid_segment, stop_mid_segment))
        stream.close()
        del stream
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == baseline
    finally:
        engine.close()


# ------------------------------------------------------------ configuration errors


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such directory"),
        ("file", "not a directory"),
        ("empty", "missing model_index.json"),
        ("bad_json", "model_index.json is unreadable or not JSON"),
        ("no_vae", r"missing vae/ \(AutoencoderKLWan\)"),
        ("no_weights", r"missing transformer/ weights"),
        ("unknown_class", "names NoSuchPipeline, which diffusers"),
    ],
)
def test_a_bad_model_directory_fails_at_start_naming_path_and_problem(
    models: SimpleNamespace, tmp_path: Path, case: str, message: str
) -> None:
    path = tmp_path / "model"
    if case == "file":
        path.write_text("not a pipeline")
    elif case == "empty":
        path.mkdir()
    elif case == "bad_json":
        path.mkdir()
        (path / "model_index.json").write_text("{nope")
    elif case != "missing":
        shutil.copytree(models.t2v, path)
        if case == "no_vae":
            shutil.rmtree(path / "vae")
        elif case == "no_weights":
            for weights in (path / "transformer").glob("*.safetensors"):
                weights.unlink()
        else:
            index = json.loads((path / "model_index.json").read_text())
            index["_class_name"] = "NoSuchPipeline"
            (path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(EngineConfigError, match=message) as caught:
        load_engine("diffusers", {"model": str(path)}, device="cpu")
    assert str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"segment_frames": "6"}, r"segment_frames must be 4\*n\+1 .* got 6"),
        ({"dtype": "int8"}, "dtype must be auto, bfloat16, float16 or float32"),
        ({"offload": "model"}, "offload=model needs a CUDA device"),
        ({"colour": "red"}, "unknown engine arg"),
        ({"i2v_model": "SELF_T2V"}, "takes no image"),
    ],
)
def test_bad_engine_args_fail_at_start(
    models: SimpleNamespace, args: dict[str, str], message: str
) -> None:
    args = {k: (str(models.t2v) if v == "SELF_T2V" else v) for k, v in args.items()}
    with pytest.raises(EngineConfigError, match=message):
        load_engine("diffusers", {"model": str(models.t2v), **args}, device="cpu")


def test_cli_exits_2_with_the_message_for_a_missing_model() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trio_vstream",
            "--engine",
            "diffusers",
            "--engine-arg",
            "model=/nope",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "model=/nope: no such directory" in result.stderr


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"width": 40}, "multiples of 16 for WanPipeline, got 40x32"),
        ({"guidance_scale_2": 3.0}, "guidance_scale_2 needs a two-stage pipeline"),
        ({"boundary_ratio": 0.5}, "boundary_ratio needs a two-stage pipeline"),
        ({"true_cfg_scale": 2.0}, "true_cfg_scale is not supported by WanPipeline"),
        ({"image": np.zeros((8, 8, 3), np.uint8)}, "image_reference needs an image-to-video"),
        ({"extra_params": {"generator": 3}}, "extra_params set by the engine: generator"),
        ({"extra_params": {"attention_kwargs": {}, "zzz": 1}}, "unknown extra_params .*: zzz$"),
        ({"lora": {"path": "/no/such/lora"}}, "lora.path /no/such/lora: no such file"),
        ({"lora": {"path": "/", "alpha": 1}}, "lora: unknown key"),
    ],
)
def test_requests_the_pipeline_cannot_serve_are_rejected_when_opened(
    models: SimpleNamespace, make_engine: Any, fields: dict[str, Any], message: str
) -> None:
    engine = make_engine(models.t2v)
    with pytest.raises(InvalidRequestError, match=message):
        engine.open_stream(request(**fields))
