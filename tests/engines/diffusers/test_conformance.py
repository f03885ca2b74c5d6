"""The diffusers engine keeps the engine contract (`check_engine`) in each of its loop
families, on the tiny pipelines: whole segments (Wan), history chunks (Helios),
diffusion-forcing windows (SkyReels-V2 DF), causal chunks (AnyFlow FAR) and sections
(FramePack)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engines.diffusers import support
from trio_vstream.engines import Engine, load_engine
from trio_vstream.engines.testing import check_engine

IMAGE = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)


def _wan(models: Any) -> Path:
    return Path(models.t2v)


def _variant(name: str) -> Callable[[dict[str, Path]], Path]:
    return lambda variants: variants[name]


def _itself(path: Path) -> Path:
    return path


# family: the conftest fixture that builds its pipelines, which of them, segment_frames,
# and the request's fields: each request makes two to four chunks, in sizes the family's
# own tests use.
FAMILIES: dict[str, tuple[str, Callable[[Any], Path], str, dict[str, Any]]] = {
    "segments": ("models", _wan, "5", {}),
    "history chunks": (
        "helios",
        _variant("base"),
        "33",
        {"width": 64, "height": 64, "num_frames": 65, "num_inference_steps": 1},
    ),
    "forcing windows": (
        "skyreels",
        _variant("t2v"),
        "17",
        {"width": 32, "height": 32, "fps": 24, "num_frames": 25},
    ),
    "far": ("anyflow_far", _itself, "8", {"width": 32, "height": 32, "num_frames": 25}),
    "framepack": (
        "framepack",
        _itself,
        "12",
        {
            "width": 32,
            "height": 32,
            "num_frames": 27,
            "image": IMAGE,
            "extra_params": {"sampling_type": "vanilla"},
        },
    ),
}


@pytest.fixture
def _eager_flex_attention() -> Iterator[None]:
    """FAR's flex attention without its dynamo wrapper on CPU (see test_far.py): the same
    math in a fraction of the time."""
    from torch.nn.attention import flex_attention

    before = getattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False)
    flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
    flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before


@pytest.mark.slow
@pytest.mark.usefixtures("_eager_flex_attention")
@pytest.mark.parametrize(
    ("fixture", "pick", "segment_frames", "fields"), FAMILIES.values(), ids=FAMILIES.keys()
)
def test_each_loop_family_keeps_the_contract(
    request: pytest.FixtureRequest,
    fixture: str,
    pick: Callable[[Any], Path],
    segment_frames: str,
    fields: dict[str, Any],
) -> None:
    model = pick(request.getfixturevalue(fixture))

    def factory() -> Engine:
        args = {"model": str(model), "segment_frames": segment_frames, "threads": "1"}
        return load_engine("diffusers", args, device="cpu")

    check_engine(factory, support.request(**fields))
