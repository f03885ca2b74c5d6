"""An engine's optional capabilities are Protocols (trio_vstream.engines.interfaces): what
the built-in engines declare, what an engine that declares nothing gets, and the loader's
check of the contract itself."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import attrs
import pytest

from trio_vstream.engines import Engine, EngineConfigError, load_engine
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest
from trio_vstream.engines.interfaces import (
    DEFAULT_INTERACTION_KINDS,
    AudioFormat,
    SupportsBatching,
    SupportsInteractionKinds,
    audio_format,
    interaction_kinds,
    live_input_chunk_frames,
    live_settings,
    max_batch,
    missing_members,
    supports_audio,
    supports_batching,
    supports_device,
    supports_interaction_kinds,
    supports_seed,
)
from trio_vstream.engines.shapes import create_engine as create_shapes
from trio_vstream.engines.synthetic import create_engine as create_synthetic
from trio_vstream.values import VideoDefaults

REQUEST = GenerationRequest(request_id="r", prompt="red", width=32, height=32, fps=8, num_frames=8)


class BareStream:
    """A stream with what the contract asks and nothing more."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        return None

    def interact(self, change: object) -> None:
        pass

    def close(self) -> None:
        pass


class BareEngine:
    """An engine written before any capability existed: the contract's members only."""

    name = "bare"
    max_concurrent_steps: int | None = 1
    video_defaults = VideoDefaults(width=32, height=32, fps=8, num_frames=8)

    def open_stream(self, request: GenerationRequest) -> BareStream:
        return BareStream()

    def close(self) -> None:
        pass


def test_an_engine_that_declares_nothing_keeps_the_contract_and_gets_the_defaults() -> None:
    engine = BareEngine()
    assert isinstance(engine, Engine)
    assert not supports_interaction_kinds(engine) and not supports_batching(engine)
    assert not supports_device(engine) and not supports_seed(engine.open_stream(REQUEST))
    assert interaction_kinds(engine) == DEFAULT_INTERACTION_KINDS == {"prompt"}
    assert max_batch(engine) == 1
    assert not supports_audio(engine) and audio_format(engine) is None


def test_an_engine_with_sound_declares_its_rate_and_channels() -> None:
    engine = BareEngine()
    engine.audio_sample_rate = 24000  # type: ignore[attr-defined]
    engine.audio_channels = 2  # type: ignore[attr-defined]
    assert supports_audio(engine)
    assert audio_format(engine) == AudioFormat(24000, 2)
    engine.audio_sample_rate = None  # type: ignore[attr-defined]
    assert not supports_audio(engine) and audio_format(engine) is None  # silent as configured


@pytest.mark.parametrize(
    ("rate", "channels", "match"),
    [
        (96000, 1, "audio_sample_rate must be one of"),
        (True, 1, "audio_sample_rate must be one of"),
        (48000.0, 1, "audio_sample_rate must be one of"),
        ("48000", 1, "audio_sample_rate must be one of"),
        (48000, 3, "audio_channels must be 1 or 2, got 3"),
        (48000, True, "audio_channels must be 1 or 2"),
        (48000, None, "audio_channels must be 1 or 2, got None"),
    ],
)
def test_sound_the_server_cannot_carry_fails_at_start_up(
    rate: object, channels: object, match: str
) -> None:
    engine = BareEngine()
    engine.audio_sample_rate = rate  # type: ignore[attr-defined]
    if channels is not None:
        engine.audio_channels = channels  # type: ignore[attr-defined]
    with pytest.raises(EngineConfigError, match=f"engine bare: {match}"):
        audio_format(engine)


@pytest.mark.slow
def test_the_built_in_engines_declare_their_capabilities() -> None:
    synthetic = create_synthetic()
    assert supports_interaction_kinds(synthetic) and interaction_kinds(synthetic) == {"prompt"}
    assert not supports_batching(synthetic) and max_batch(synthetic) == 1
    stream = synthetic.open_stream(attrs.evolve(REQUEST, seed=7))
    assert supports_seed(stream) and stream.seed == 7
    shapes = create_shapes(device="cpu", max_batch="3")
    assert isinstance(shapes, SupportsInteractionKinds) and isinstance(shapes, SupportsBatching)
    assert interaction_kinds(shapes) == {"prompt", "camera"} and max_batch(shapes) == 3
    assert supports_device(shapes) and str(shapes.device) == "cpu"


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8"])
def test_a_max_batch_that_is_not_a_positive_integer_fails_at_start_up(value: object) -> None:
    engine = BareEngine()
    engine.max_batch = value  # type: ignore[attr-defined]
    assert isinstance(engine, SupportsBatching)
    with pytest.raises(EngineConfigError, match="engine bare: max_batch must be an integer >= 1"):
        max_batch(engine)


@pytest.mark.parametrize("seed", [None, True, "7", 7.0])
def test_a_seed_that_is_not_an_integer_is_not_echoed(seed: object) -> None:
    stream = BareStream()
    stream.seed = seed  # type: ignore[attr-defined]
    assert not supports_seed(stream)


@pytest.fixture
def lab_module() -> Iterator[types.ModuleType]:
    """A lab's engine module, importable as ``lab_engine:create_engine``."""
    module = types.ModuleType("lab_engine")
    sys.modules["lab_engine"] = module
    yield module
    del sys.modules["lab_engine"]


def test_the_loader_names_what_an_engine_lacks(lab_module: types.ModuleType) -> None:
    class Incomplete:
        name = "lab"

        def close(self) -> None:
            pass

    lab_module.create_engine = lambda device: Incomplete()  # type: ignore[attr-defined]
    assert missing_members(Incomplete(), Engine) == [
        "max_concurrent_steps",
        "video_defaults",
        "open_stream",
    ]
    with pytest.raises(
        EngineConfigError,
        match=r"engine .lab_engine:create_engine. does not implement the engine interface: "
        r"missing max_concurrent_steps, video_defaults, open_stream$",
    ):
        load_engine("lab_engine:create_engine", {})
    lab_module.create_engine = lambda device: BareEngine()  # type: ignore[attr-defined]
    assert isinstance(load_engine("lab_engine:create_engine", {}), BareEngine)


class LiveEngine(BareEngine):
    def __init__(self, settings: object) -> None:
        self.live_settings = settings


def test_live_settings_are_read_and_checked_at_start_up() -> None:
    assert live_settings(BareEngine()) == {}
    shapes = create_shapes(threads="1")
    try:
        assert live_settings(shapes) == {"num_inference_steps": 3, "guidance_scale": 1.0}
    finally:
        shapes.close()
    assert live_settings(LiveEngine({"flow_shift": 2})) == {"flow_shift": 2}


class InputChunkEngine(BareEngine):
    def __init__(self, frames: object, longest: int | None = None) -> None:
        self.live_input_chunk_frames = frames
        if longest is not None:
            self.max_chunk_frames = longest


def test_the_live_input_chunk_is_read_and_checked_at_start_up() -> None:
    assert live_input_chunk_frames(BareEngine()) is None
    shapes = create_shapes(threads="1")
    try:
        # Half the model's chunk: a camera frame waits 125 ms for its window, not 292.
        assert live_input_chunk_frames(shapes) == 4 < shapes.max_chunk_frames
    finally:
        shapes.close()
    assert live_input_chunk_frames(InputChunkEngine(2)) == 2
    for bad in (0, -1, True, 2.0, "4"):
        with pytest.raises(EngineConfigError, match="must be a positive integer"):
            live_input_chunk_frames(InputChunkEngine(bad))
    with pytest.raises(EngineConfigError, match="6 is more than its max_chunk_frames 4"):
        live_input_chunk_frames(InputChunkEngine(6, longest=4))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"prompt": 3}, "may name flow_shift, guidance_scale, num_inference_steps, not 'prompt'"),
        ({"num_inference_steps": True}, "must be a finite number"),
        ({"guidance_scale": float("nan")}, "must be a finite number"),
        ({"guidance_scale": float("inf")}, "must be a finite number"),
        ({"guidance_scale": "1"}, "must be a finite number"),
    ],
)
def test_live_settings_outside_the_allow_list_fail_at_start_up(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(EngineConfigError, match=message):
        live_settings(LiveEngine(settings))
