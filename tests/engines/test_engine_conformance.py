"""Every built-in engine keeps the engine contract, as `check_engine` proves it: the
synthetic and shapes engines here, the diffusers engine in each of its loop families in
tests/engines/diffusers/test_conformance.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from trio_vstream.engines import Engine, load_engine
from trio_vstream.engines.contract import GenerationRequest
from trio_vstream.engines.testing import check_engine

REQUEST = GenerationRequest(
    request_id="conformance",
    prompt="a red circle moving left",
    width=32,
    height=32,
    fps=8,
    num_frames=16,
    seed=1,
)
"""Two chunks of eight frames for both engines: small, as the kit runs a few dozen streams."""

ENGINES = [
    pytest.param(lambda: load_engine("synthetic", {}), id="synthetic"),
    pytest.param(
        lambda: load_engine("synthetic", {"audio_tone": "440", "audio_sample_rate": "44100"}),
        id="synthetic-with-sound",
    ),
    # Batches (max_batch 8): the kit also steps three streams together. Seconds of
    # sampling on a CPU (3 to 9 s measured on a loaded 2-core machine).
    pytest.param(
        lambda: load_engine("shapes", {}, device="cpu"), id="shapes", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("factory", ENGINES)
def test_the_built_in_engine_keeps_the_contract(factory: Callable[[], Engine]) -> None:
    check_engine(factory, REQUEST)
