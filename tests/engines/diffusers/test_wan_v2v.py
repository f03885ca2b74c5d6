"""Wan's video-to-video pipeline (``WanVideoToVideoPipeline``) served chunk by chunk
(``loops/wan_v2v.py``): each chunk one call on the input frames fed for it, as the server
feeds a session that follows an input video (`interfaces.FollowsInput`).

The pipeline is `testing.build_wan_v2v`'s, the tiny Wan parts under the video-to-video
class; building it takes seconds, so the tests that use it are ``slow``. Chunks are 5
frames (``segment_frames``), 48x32, two steps."""

from __future__ import annotations

import gc
import itertools
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.engines.diffusers.support import (
    Probe,
    Stopped,
    assert_fox_to_whale,
    encode,
    fox_to_whale,
    live_tensor_bytes,
    no_stop,
    request,
)
from trio_vstream.engines import (
    Checkpoint,
    Chunk,
    Engine,
    EngineError,
    EngineStream,
    GenerationRequest,
    InvalidRequestError,
    PromptChange,
    load_engine,
)
from trio_vstream.engines.contract import VideoInput, checkpoint_calling
from trio_vstream.engines.diffusers import DiffusersEngine
from trio_vstream.engines.diffusers._stream import frames_to_uint8, to_pil
from trio_vstream.engines.diffusers.loops import InputLoop, registered, wan_v2v
from trio_vstream.engines.interfaces import FollowsInput, supports_video_input
from trio_vstream.engines.testing import check_engine

WIDTH, HEIGHT = 48, 32
CHUNK = 5
"""``segment_frames``: two latent frames a chunk."""


@pytest.fixture(scope="module")
def v2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from trio_vstream.engines.diffusers.testing import build_wan_v2v

    return build_wan_v2v(tmp_path_factory.mktemp("wan_v2v_models") / "Wan-tiny-V2V")


def load(model: Path) -> DiffusersEngine:
    args = {"model": str(model), "segment_frames": str(CHUNK), "threads": "1"}
    engine = load_engine("diffusers", args, device="cpu")
    assert isinstance(engine, DiffusersEngine)
    return engine


@pytest.fixture(scope="module")
def engine(v2v: Path) -> Iterator[DiffusersEngine]:
    """One engine for the module's tests (each leaves the shared pipeline as it found it)."""
    threads = torch.get_num_threads()
    engine = load(v2v)
    yield engine
    engine.close()
    torch.set_num_threads(threads)


def v2v_request(**fields: Any) -> GenerationRequest:
    """48x32, two steps, no guidance, seed 1, strength 1 (both steps run)."""
    strength = fields.pop("strength", 1.0)
    return request(input_video=VideoInput(fps=8, strength=strength), **fields)


def source(frames: int, seed: int = 0) -> np.ndarray:
    """An input video: (frames, 32, 48, 3) uint8, a smooth random picture drifting right
    a pixel a frame (something a VAE can encode, unlike pixel noise)."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((5, 8, 3)) * 255
    picture = np.kron(coarse, np.ones((8, 8, 1)))[:HEIGHT]  # (32, 64, 3)
    shifts = [np.roll(picture, t, axis=1)[:, :WIDTH] for t in range(frames)]
    return np.stack(shifts).round().astype(np.uint8)


class Fed:
    """A stream fed as the server feeds one that follows an input video: before each
    chunk, its ``next_chunk_frames`` frames of ``video``, in order, then ``next_chunk``."""

    def __init__(self, stream: EngineStream, video: np.ndarray) -> None:
        assert isinstance(stream, FollowsInput)
        self.stream = stream
        self.video = video
        self.fed: list[int] = []
        """How many frames each chunk was fed."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        at = sum(self.fed)
        count = self.stream.next_chunk_frames
        self.stream.feed_input(self.video[at : at + count].copy())
        self.fed.append(count)
        return self.stream.next_chunk(checkpoint)

    def interact(self, change: PromptChange) -> None:
        self.stream.interact(change)

    def close(self) -> None:
        self.stream.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)  # seed, next_chunk_frames


class FedEngine:
    """The engine as the server serves sessions that follow an input video: each stream
    `Fed` from a video of its own (until `check_engine` feeds streams itself)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def open_stream(self, request: GenerationRequest) -> Fed:
        return Fed(self.engine.open_stream(request), source(request.num_frames))

    def close(self) -> None:
        self.engine.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)  # name, video_defaults, video_input, ...


def all_chunks(stream: Fed) -> list[np.ndarray]:
    """Every chunk's frames; the stream is closed afterwards."""
    chunks = []
    try:
        while (chunk := stream.next_chunk(no_stop)) is not None:
            chunks.append(chunk.frames)
    finally:
        stream.close()
    return chunks


def direct(pipe: Any, frames: np.ndarray, *, seed: int, **kw: Any) -> np.ndarray:
    """The pipeline's own call on ``frames`` (padded with the last to a 4n+1 count), as a
    client of diffusers would make it: the frames it made for those given."""
    video = [to_pil(frame, WIDTH, HEIGHT) for frame in frames]
    video += [video[-1]] * ((-(len(video) - 1)) % 4)
    output = pipe(
        video=video,
        prompt="a red fox in the snow",
        height=HEIGHT,
        width=WIDTH,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
        **kw,
    )
    return frames_to_uint8(output.frames).numpy()[: len(frames)]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_only_the_video_to_video_family_follows_an_input_video() -> None:
    # The engine declares video_input for a family that is an InputLoop, and only then.
    followers = [loop for loop in registered() if isinstance(loop, InputLoop)]
    assert followers == [wan_v2v.LOOP]


@pytest.mark.slow
def test_each_chunk_is_the_direct_call_on_its_input_frames(
    engine: DiffusersEngine, probes: list[Any]
) -> None:
    assert engine.loop is wan_v2v.LOOP
    assert supports_video_input(engine)
    pipe = engine.model.pipe
    latents: list[torch.Tensor] = []  # what every transformer forward was given

    def seen(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        latents.append(kwargs["hidden_states"].detach().clone())

    probes.append(pipe.transformer.register_forward_pre_hook(seen, with_kwargs=True))
    video = source(12)
    settings = {"num_inference_steps": 4, "guidance_scale": 2.0, "strength": 0.5}
    stream = Fed(engine.open_stream(v2v_request(num_frames=12, seed=7, **settings)), video)
    chunks = all_chunks(stream)
    # Two whole chunks, then the last two frames (made as a padded 5-frame call).
    assert stream.fed == [5, 5, 2, 0]
    assert [c.shape[0] for c in chunks] == [5, 5, 2]
    streamed, latents[:] = latents[:], []
    starts = [0, 5, 10]
    for chunk, start in zip(chunks, starts, strict=True):
        # Every chunk's noise from the session's seed, the same for each.
        expected = direct(pipe, video[start : start + len(chunk)], seed=7, **settings)
        assert psnr(chunk, expected) >= 40, start
    # Each chunk was its own window's call: the transformer saw exactly what it saw in
    # the direct calls (two steps at strength 0.5, two forwards a step with guidance)...
    assert len(streamed) == len(latents) == 3 * 2 * 2
    for made, reference in zip(streamed, latents, strict=True):
        torch.testing.assert_close(made, reference, rtol=0, atol=0)
    # ... and each window's noised input differs from the others'.
    firsts = streamed[::4]
    for one, other in itertools.pairwise(firsts):
        assert (one - other).abs().max() > 1e-3


@pytest.mark.slow
def test_other_input_makes_other_frames(
    engine: DiffusersEngine,
) -> None:
    black = np.zeros((5, HEIGHT, WIDTH, 3), np.uint8)
    white = np.full((5, HEIGHT, WIDTH, 3), 255, np.uint8)

    def made(video: np.ndarray, strength: float) -> np.ndarray:
        asked = v2v_request(num_frames=5, num_inference_steps=4, strength=strength)
        (chunk,) = all_chunks(Fed(engine.open_stream(asked), video))
        return chunk

    from_black = made(black, 0.25)
    assert np.array_equal(made(black, 0.25), from_black)  # the same input, the same frames
    # The tiny random VAE hardly tells pictures apart (tested above on its latents), but
    # a black input and a white one make other frames.
    assert psnr(made(white, 0.25), from_black) < 55


@pytest.mark.slow
def test_a_stop_lands_within_a_step_and_the_stopped_chunk_is_not_decoded(
    engine: DiffusersEngine, probes: list[Any]
) -> None:
    pipe = engine.model.pipe
    forwards: list[int] = []
    decodes: list[int] = []
    probes.append(pipe.transformer.register_forward_pre_hook(lambda *_: forwards.append(1)))
    probes.append(pipe.vae.decoder.register_forward_pre_hook(lambda *_: decodes.append(1)))
    seen: list[tuple[int, int]] = []
    stop_at = [0]

    def step() -> None:
        seen.append((len(forwards), len(decodes)))
        if len(seen) == stop_at[0]:
            raise Stopped

    # Four steps at strength 0.75: the call denoises the last three.
    stream = Fed(engine.open_stream(v2v_request(num_inference_steps=4, strength=0.75)), source(12))
    checkpoint = checkpoint_calling(step)
    try:
        assert stream.next_chunk(checkpoint) is not None
        # One checkpoint before each step, the last one before the decode.
        decoded = len(decodes)
        assert decoded > 0
        assert seen == [(0, 0), (1, 0), (2, 0), (3, 0)]
        stop_at[0] = len(seen) + 2  # the second chunk, after its first step
        with pytest.raises(Stopped):
            stream.next_chunk(checkpoint)
        assert stream._frames_done == CHUNK  # the stopped chunk sent nothing
    finally:
        stream.close()
    assert len(forwards) == 3 + 1  # no step after the stop
    assert len(decodes) == decoded  # the stopped chunk was never decoded
    assert len(seen) == 4 + 2
    assert not engine.lock.locked


@pytest.mark.slow
def test_a_prompt_change_blends_from_the_next_chunk(
    engine: DiffusersEngine, probes: list[Any]
) -> None:
    pipe = engine.model.pipe
    probe = Probe(pipe, keep_embeds=True)
    probes.append(probe)
    stream = Fed(engine.open_stream(v2v_request(prompt="a red fox", num_frames=20)), source(20))
    chunks = fox_to_whale(stream)
    assert len(chunks) == 4
    # Two steps a chunk at strength 1; guidance 1: one transformer call a step.
    assert_fox_to_whale(chunks, probe.embeds, lambda text: encode(pipe, text), steps=2)


@pytest.mark.slow
def test_memory_is_flat_over_a_long_session(engine: DiffusersEngine) -> None:
    chunks, first, traced, last = 32, 5, 20, 30
    stream = Fed(
        engine.open_stream(v2v_request(num_frames=CHUNK * chunks, strength=0.5)),
        source(CHUNK * chunks),
    )
    run = stream.stream._run
    chunk_bytes = CHUNK * HEIGHT * WIDTH * 3  # one chunk's input frames (its output's too)
    tensors: dict[int, int] = {}
    try:
        for index in range(chunks):
            chunk = stream.next_chunk(no_stop)
            assert chunk is not None and chunk.frames.shape[0] == CHUNK
            del chunk
            # Between chunks the run keeps no input: the next feed brings the next one.
            assert run._fed is None and not run._call_video
            if index == first:
                tensors[first] = live_tensor_bytes()
            elif index == traced:
                # Python's allocations from here on still alive at the last chunk: the fed
                # frames (numpy), the PIL images, lists, anything kept a chunk. Over ten
                # chunks, not 25: tracing makes each chunk three times slower.
                tracemalloc.start()
            elif index == last:
                gc.collect()
                python = tracemalloc.get_traced_memory()[0]
                tracemalloc.stop()
                tensors[last] = live_tensor_bytes()
        assert stream.next_chunk(no_stop) is None
    finally:
        tracemalloc.stop()
        stream.close()
    # 25 chunks later, not one chunk's latents more in tensors (the latents, the frames
    # before their host copy); ten chunks later, less than a tenth of a chunk's input a
    # chunk more in Python's allocations (torch and diffusers keep growing a little).
    latent_bytes = 16 * 2 * (HEIGHT // 8) * (WIDTH // 8) * 4
    assert abs(tensors[last] - tensors[first]) < latent_bytes, tensors
    assert python < (last - traced) * chunk_bytes // 10, python


def test_the_memory_measures_see_a_leak_of_a_chunk_a_chunk() -> None:
    """What `test_memory_is_flat_over_a_long_session` measures would see its session keep
    one chunk's frames a chunk, as numpy arrays or as tensors, ten times over its bounds:
    the test can fail."""
    chunk_bytes = CHUNK * HEIGHT * WIDTH * 3
    tracemalloc.start()
    try:
        kept = [np.ones((CHUNK, HEIGHT, WIDTH, 3), np.uint8) for _ in range(10)]
        assert tracemalloc.get_traced_memory()[0] >= 10 * chunk_bytes
    finally:
        tracemalloc.stop()
    before = live_tensor_bytes()
    frames = [torch.ones((CHUNK, HEIGHT, WIDTH, 3), dtype=torch.uint8) for _ in range(25)]
    assert live_tensor_bytes() - before >= 25 * chunk_bytes
    del kept, frames


@pytest.mark.slow
def test_what_a_request_may_ask_and_what_is_refused(engine: DiffusersEngine) -> None:
    def refused(match: str, asked: GenerationRequest) -> None:
        with pytest.raises(InvalidRequestError, match=match):
            engine.open_stream(asked)

    refused("session.start needs input_video", request(num_frames=5))
    refused(r"strength 0\.4 with 2 steps denoises in no step", v2v_request(strength=0.4))
    refused(
        "image_reference: WanVideoToVideoPipeline follows the input video",
        v2v_request(image=source(1)[0]),
    )
    for block in (0, 22, True, "3"):
        refused(
            "num_frames_per_block must be an integer from 1 to 21",
            v2v_request(extra_params={"num_frames_per_block": block}),
        )
    refused("set by the engine: strength", v2v_request(extra_params={"strength": 0.5}))
    refused("set by the engine: video", v2v_request(extra_params={"video": []}))

    # num_frames_per_block counts latent frames: 3 of them are 9 frames.
    stream = engine.open_stream(
        v2v_request(num_frames=12, extra_params={"num_frames_per_block": 3})
    )
    try:
        assert isinstance(stream, FollowsInput)
        assert stream.next_chunk_frames == 9
        with pytest.raises(EngineError, match="follows 9 input frames, and none were fed"):
            stream.next_chunk(no_stop)
        with pytest.raises(EngineError, match=r"takes the next chunk's \(9, 32, 48, 3\) uint8"):
            stream.feed_input(source(9).astype(np.float32))
        with pytest.raises(EngineError, match=r"\(9, 32, 48, 3\) uint8"):
            stream.feed_input(source(5))
    finally:
        stream.close()


@pytest.mark.slow
def test_it_keeps_the_engine_contract(v2v: Path) -> None:
    def factory() -> Engine:
        return FedEngine(load(v2v))

    check_engine(factory, v2v_request(num_frames=10))


# -- served: the client streams a clip through it, as the README's command does


def write_clip(path: Path, frames: np.ndarray, fps: int) -> Path:
    """``frames`` (T, H, W, 3) as a lossless video file the client reads with PyAV."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for picture in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())
    return path


async def test_the_client_streams_a_clip_through_the_served_model(
    engine: DiffusersEngine, serve: Any, tmp_path: Path
) -> None:
    """``python -m trio_vstream client --input-video clip "a watercolour painting" -o
    out.mp4`` against the tiny model: the video is the clip's length, every input frame
    used (at the clip's rate: at another, the output would resample it)."""
    import subprocess
    import sys

    import trio

    from tests.conftest import decode_video

    server, _ = await serve(engine)
    clip = write_clip(tmp_path / "clip.mkv", source(10), fps=8)
    out = tmp_path / "out.mp4"
    command = [
        sys.executable,
        "-m",
        "trio_vstream",
        "client",
        "--url",
        server.url,
        "--input-video",
        str(clip),
        "--size",
        "48x32",
        "--fps",
        "8",
        "--steps",
        "2",
        "--strength",
        "1.0",
        "--json",
        "a watercolour painting",
        "-o",
        str(out),
    ]
    done = await trio.to_thread.run_sync(
        lambda: subprocess.run(command, capture_output=True, text=True, timeout=120)
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["input_video"]["sent"] == 10
    assert summary["input_video"]["used"] == 10
    assert len(decode_video(out.read_bytes())) == 10
