"""The shapes engine with its shipped weights: sampling, determinism, cancellation,
weight loading, image-to-video and interactions. Small sizes keep it quick on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from trio_vstream.engines import BUILTIN_ENGINES, EngineConfigError, load_engine
from trio_vstream.engines.contract import (
    Checkpoint,
    Chunk,
    GenerationRequest,
    InvalidRequestError,
    PromptChange,
    checkpoint_calling,
)
from trio_vstream.engines.frames import frames_to_uint8_array
from trio_vstream.engines.shapes import ShapesEngine, create_engine, default_weights_path
from trio_vstream.models.shapes import evaluate
from trio_vstream.models.shapes.model import (
    ModelConfig,
    ShapesDenoiser,
    load_weights,
    save_weights,
)
from trio_vstream.models.shapes.render import render_slots
from trio_vstream.models.shapes.sampler import sample, timesteps
from trio_vstream.models.shapes.vocab import BACKGROUND_NAMES, COLOUR_NAMES, SHAPES


class Stop(Exception):
    """What our fake session raises at a checkpoint once it is over."""


@pytest.fixture(scope="module")
def engine() -> ShapesEngine:
    return create_engine(device="cpu")


def request(
    prompt: str = "a red circle moving right on a black background", **kw: Any
) -> GenerationRequest:
    values: dict[str, Any] = {"width": 64, "height": 64, "fps": 24, "num_frames": 16, "seed": 3}
    values |= kw
    return GenerationRequest(request_id="test", prompt=prompt, **values)


def run(
    engine: ShapesEngine, req: GenerationRequest, changes: dict[int, PromptChange] | None = None
) -> list[Chunk]:
    stream = engine.open_stream(req)
    chunks = []
    try:
        while True:
            if changes and len(chunks) in changes:
                stream.interact(changes[len(chunks)])
            chunk = stream.next_chunk(Checkpoint())
            if chunk is None:
                return chunks
            chunks.append(chunk)
    finally:
        stream.close()


def frames_of(chunks: list[Chunk], size: int = 64) -> np.ndarray:
    return np.concatenate(
        [frames_to_uint8_array(c.frames, width=size, height=size) for c in chunks]
    )


# ------------------------------------------------------------------ sampler


@pytest.mark.slow
def test_same_seed_same_frames_and_another_seed_other_frames(engine: ShapesEngine) -> None:
    first = frames_of(run(engine, request(seed=11)))
    again = frames_of(run(engine, request(seed=11)))
    other = frames_of(run(engine, request(seed=12)))
    assert first.shape == (16, 64, 64, 3)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_cancellation_mid_sampling_stops_within_one_step(engine: ShapesEngine) -> None:
    model = engine.model
    calls = {"forward": 0, "checkpoint": 0}
    hook = model.register_forward_hook(
        lambda *_: calls.__setitem__("forward", calls["forward"] + 1)
    )

    def checkpoint() -> None:
        calls["checkpoint"] += 1
        if calls["checkpoint"] == 3:
            raise Stop

    try:
        stream = engine.open_stream(request(num_inference_steps=8))
        with pytest.raises(Stop):
            stream.next_chunk(checkpoint_calling(checkpoint))
        stream.close()
    finally:
        hook.remove()
    # Two steps ran; the third checkpoint raised before any more model work.
    assert calls == {"forward": 2, "checkpoint": 3}


def test_sampler_checks_in_before_every_step_and_honours_the_step_count() -> None:
    torch.manual_seed(0)
    model = ShapesDenoiser(ModelConfig(channels=(8, 16), native_size=16, chunk_frames=2)).eval()
    seen = []
    cond = torch.zeros(1, model.config.embed_dim)
    context = torch.zeros(1, 3, 16, 16)
    with torch.inference_mode():
        out = sample(
            model,
            cond=cond,
            uncond=cond,
            context=context,
            context_mask=torch.zeros(1),
            generator=torch.Generator().manual_seed(0),
            steps=5,
            guidance_scale=3.0,
            checkpoint=lambda: seen.append(1),
        )
    assert len(seen) == 5
    assert out.shape == (1, 6, 16, 16) and out.abs().max() <= 1.0
    assert timesteps(4) == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert timesteps(2, shift=3.0)[1] == pytest.approx(0.75)


# ------------------------------------------------------------------ weights


def test_shipped_weights_load_and_are_small() -> None:
    path = default_weights_path()
    assert path.is_file() and path.stat().st_size <= 20 * 1024 * 1024
    assert "shapes" in BUILTIN_ENGINES
    engine = load_engine("shapes", {"steps": "2"}, device="cpu")
    assert engine.name == "shapes" and engine.max_concurrent_steps == 1


def test_missing_weights_file_is_a_clear_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(EngineConfigError, match=r"weights file not found: .*nope\.safetensors"):
        create_engine(device="cpu", weights=str(missing))


def test_garbage_weights_file_is_a_clear_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(EngineConfigError, match="cannot read weights file"):
        create_engine(device="cpu", weights=str(bad))


def test_weights_of_another_shape_are_a_clear_config_error(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shipped = default_weights_path()
    state = load_file(str(shipped))
    key = "stem.weight"
    state[key] = torch.zeros(state[key].shape[0] + 1, *state[key].shape[1:])
    with safe_open(str(shipped), framework="pt") as handle:
        metadata = handle.metadata()  # keep the metadata: only the shape is wrong
    broken = tmp_path / "mismatch.safetensors"
    save_file(state, str(broken), metadata=metadata)
    with pytest.raises(EngineConfigError, match=r"stem\.weight has shape"):
        create_engine(device="cpu", weights=str(broken))

    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(3)}, str(foreign))
    with pytest.raises(EngineConfigError, match="not a shapes model checkpoint"):
        create_engine(device="cpu", weights=str(foreign))


@pytest.mark.slow
def test_another_checkpoint_loads_with_weights_arg(tmp_path: Path) -> None:
    torch.manual_seed(0)
    small = ShapesDenoiser(ModelConfig(channels=(8, 16), native_size=16))
    path = tmp_path / "small.safetensors"
    save_weights(small, path)
    assert load_weights(path).config.channels == (8, 16)
    engine = create_engine(device="cpu", weights=str(path))
    chunks = run(engine, request(num_frames=3))
    assert frames_of(chunks).shape == (3, 64, 64, 3)


@pytest.mark.slow
def test_context_skip_copies_the_context_into_every_frame() -> None:
    """With the skip, an untrained (zero-output) network already continues the
    context exactly; without a context, or without the skip, it does not."""
    torch.manual_seed(0)
    config = ModelConfig(channels=(8, 16), native_size=16, chunk_frames=3, context_skip=True)
    model = ShapesDenoiser(config).eval()
    x = torch.randn(2, 9, 16, 16)
    context = torch.rand(2, 3, 16, 16) * 2 - 1
    cond = torch.zeros(2, config.embed_dim)
    with torch.no_grad():
        out = model(x, torch.ones(2), context, torch.tensor([1.0, 0.0]), cond)
        plain = ShapesDenoiser(attrs.evolve(config, context_skip=False)).eval()
        plain.load_state_dict(model.state_dict())
        out_plain = plain(x, torch.ones(2), context, torch.tensor([1.0, 0.0]), cond)
    for frame in range(3):
        assert torch.equal(out[0, 3 * frame : 3 * frame + 3], context[0])
    assert torch.count_nonzero(out[1]) == 0
    assert torch.count_nonzero(out_plain) == 0


def test_checkpoints_without_the_context_skip_setting_load_without_it(tmp_path: Path) -> None:
    """Files written before the option existed keep meaning what they meant."""
    import json

    config = ModelConfig.from_json(json.dumps({"channels": [8, 16], "native_size": 16}))
    assert config.context_skip is False
    model = ShapesDenoiser(attrs.evolve(config, context_skip=True))
    path = tmp_path / "skip.safetensors"
    save_weights(model, path)
    assert load_weights(path).config.context_skip is True


def test_bad_engine_args_and_devices_are_config_errors() -> None:
    with pytest.raises(EngineConfigError, match="unknown engine arg"):
        create_engine(device="cpu", stepz="4")
    with pytest.raises(EngineConfigError, match="steps"):
        create_engine(device="cpu", steps="0")
    with pytest.raises(EngineConfigError, match="device"):
        create_engine(device="tpu")
    with pytest.raises(EngineConfigError, match=r"unsupported device 'mps'"):
        create_engine(device="mps")
    if not torch.cuda.is_available():
        with pytest.raises(EngineConfigError, match="no CUDA"):
            create_engine(device="cuda")


def test_requests_it_cannot_serve_are_rejected(engine: ShapesEngine) -> None:
    with pytest.raises(InvalidRequestError, match="extra_params"):
        engine.open_stream(request(extra_params={"knob": 1}))
    with pytest.raises(InvalidRequestError, match="LoRA"):
        engine.open_stream(request(lora={"name": "x"}))


# ------------------------------------------------------------------ behaviour


@pytest.mark.slow
def test_image_reference_is_where_the_video_starts(engine: ShapesEngine) -> None:
    """The object of chunk 0 starts where it is in the reference image."""
    red, black = COLOUR_NAMES.index("red"), BACKGROUND_NAMES.index("black")
    for x, y in ((8.0, 10.0), (22.0, 20.0)):
        image = render_slots(red, SHAPES.index("square"), black, 1, x, y)
        image = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
        req = request("a red square staying still on a black background", image=image, num_frames=8)
        frames = frames_of(run(engine, req))
        mask = evaluate.object_mask(frames[0], evaluate.background_colour(frames))
        ys, xs = np.nonzero(mask)
        # 32 native pixels -> 64 output pixels: scale 2.
        assert abs(xs.mean() + 0.5 - 2 * x) < 4 and abs(ys.mean() + 0.5 - 2 * y) < 4


@pytest.mark.slow
def test_interaction_changes_colour_and_reports_event_ids(engine: ShapesEngine) -> None:
    prompt = "a red square staying still on a black background"
    change = PromptChange("to-blue", prompt.replace("red", "blue"), transition_chunks=1)
    chunks = run(engine, request(prompt, num_frames=32, seed=5), changes={1: change})
    assert [c.index for c in chunks] == [0, 1, 2, 3]
    assert chunks[1].started_event_ids == ("to-blue",)
    assert chunks[1].completed_event_ids == ("to-blue",)
    colours = evaluate.chunk_colours(frames_of(chunks))
    assert colours[0] == "red" and colours[2:] == ["blue", "blue"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_frames_stay_on_the_gpu_as_uint8_and_are_deterministic() -> None:
    gpu = create_engine(device="cuda")
    first = run(gpu, request(seed=4))
    again = run(gpu, request(seed=4))
    assert first[0].frames.is_cuda and first[0].frames.dtype == torch.uint8
    assert first[0].frames.shape == (8, 64, 64, 3)
    assert np.array_equal(frames_of(first), frames_of(again))


@pytest.mark.slow
def test_the_in_process_evaluator_judges_the_engine_directly(engine: ShapesEngine) -> None:
    """``bench/shapes_in_process.py``: the engine called directly, no server, no codec."""
    from bench import shapes_in_process

    cases = evaluate.prompt_set("tune", 3)
    analyses = shapes_in_process.judge(engine, cases, num_frames=8)
    metrics = evaluate.score(cases, analyses)
    assert metrics["clips"] == 3 and metrics["colour"] == metrics["background"] == 1.0
    (line,) = evaluate.failures(cases[:1], [attrs.evolve(analyses[0], colour="nope")])
    assert line.startswith(f"{cases[0].prompt!r} seed {cases[0].seed}:") and "colour=nope" in line
