"""The shapes model as a person sees it (issue 35), on the decoded stream: each chunk
encoded as the server encodes it (`FragmentedMP4Encoder`) and the H.264 decoded, then
measured as ``bench/shapes_look.py`` measures it (`evaluate.look`): one whole object, never
split across two edges; a crisp edge; a clean background; at 256x256 and larger.

The bench runs the five prompts for 96 frames each; here each runs long enough for what
it checks (the page's default prompt long enough to cross an edge twice), to stay cheap.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.shapes_look import PROMPTS, TARGETS, stream_clip
from trio_vstream.engines.contract import PromptChange
from trio_vstream.engines.shapes import ShapesEngine, create_engine
from trio_vstream.models.shapes import evaluate
from trio_vstream.values import Camera


@pytest.fixture(scope="module")
def engine() -> ShapesEngine:
    return create_engine(device="cpu")


@pytest.mark.slow
def test_the_pages_default_prompt_shows_one_whole_crisp_object_on_a_clean_background(
    engine: ShapesEngine,
) -> None:
    """64 frames of a circle moving left a native pixel a frame: it crosses the edge of
    its 32-pixel world twice, and every frame shows it whole."""
    prompt, seed = PROMPTS[0]
    assert prompt == "a red circle moving left on a navy background"
    frames = stream_clip(engine, prompt, seed=seed, num_frames=64, width=256, height=256)
    seen = evaluate.look(frames)
    assert not seen.split.any() and not seen.cut.any()
    assert np.median(seen.edge_widths) <= TARGETS["edge_width_median"]
    assert seen.noise.max() <= TARGETS["background_noise"]
    verdict = evaluate.analyse_clip(frames)
    assert (verdict.colour, verdict.shape, verdict.motion, verdict.background) == (
        "red",
        "circle",
        "left",
        "navy",
    )


@pytest.mark.slow
@pytest.mark.parametrize(("prompt", "seed"), PROMPTS[1:], ids=lambda p: str(p)[:24])
def test_every_background_is_clean_and_every_edge_crisp(
    engine: ShapesEngine, prompt: str, seed: int
) -> None:
    frames = stream_clip(engine, prompt, seed=seed, num_frames=16, width=256, height=256)
    seen = evaluate.look(frames)
    assert not seen.split.any()
    assert np.median(seen.edge_widths) <= TARGETS["edge_width_median"]
    assert seen.noise.max() <= TARGETS["background_noise"]


@pytest.mark.slow
@pytest.mark.parametrize(("width", "height"), [(512, 512), (832, 480)])
def test_larger_frames_are_as_crisp(engine: ShapesEngine, width: int, height: int) -> None:
    """Drawn at the requested size, not resized to it: the edge is as narrow in output
    pixels at 512x512 and 832x480 as at 256x256 (a resize would widen it 2 to 3 times)."""
    prompt, seed = PROMPTS[1]
    frames = stream_clip(engine, prompt, seed=seed, num_frames=8, width=width, height=height)
    seen = evaluate.look(frames)
    assert not seen.split.any()
    assert np.median(seen.edge_widths) <= TARGETS["edge_width_median"]
    assert seen.noise.max() <= TARGETS["background_noise"]


@pytest.mark.slow
def test_a_steered_object_turns_the_keys_way_and_stays_whole(engine: ShapesEngine) -> None:
    """The page's keys steer by camera velocity, as before: right, then left; the object
    goes each way in turn and is never cut by an edge."""
    right = Camera("velocity", (0.1, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))
    left = Camera("velocity", (-0.1, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))
    prompt = "a red circle staying still on a navy background"
    changes = {1: PromptChange("d", None, 0, right), 4: PromptChange("a", None, 0, left)}
    frames = stream_clip(
        engine, prompt, seed=1, num_frames=56, width=256, height=256, changes=changes
    )
    seen = evaluate.look(frames)
    assert not seen.split.any() and not seen.cut.any()
    motions = [evaluate.analyse_clip(frames[i : i + 8]).motion for i in range(0, 56, 8)]
    assert motions[0] == "still" and motions[1:4] == ["right"] * 3 and motions[4:] == ["left"] * 3
