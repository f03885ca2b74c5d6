"""Fixtures of the diffusers engine tests: tiny random Wan pipelines, engines, a server.

The pipelines are built in code (``trio_vstream.engines.diffusers.testing``), saved with
``save_pretrained`` once per test session, and loaded back by the engine the way
``--engine diffusers --engine-arg model=...`` does. Tests that need them skip where the
``diffusers`` extra is not installed; the others (the lock's, the CLI's) run anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio

from tests.engines.diffusers.support import Summaries
from trio_vstream.engines import load_engine
from trio_vstream.engines.diffusers import DiffusersEngine
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.session.session import SessionConfig


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """``threads=1`` engines set torch's thread count for the process: put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def probes() -> Iterator[list[Any]]:
    """Hooks a test puts on the shared pipelines (anything with ``remove()``), taken off
    after the test whatever happens."""
    made: list[Any] = []
    yield made
    for probe in made:
        probe.remove()


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Pipeline directories: ``t2v`` (WanPipeline), ``i2v`` (WanImageToVideoPipeline) and
    ``lora`` (a LoRA for t2v's transformer)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from trio_vstream.engines.diffusers.testing import build_lora, build_wan_i2v, build_wan_t2v

    root = tmp_path_factory.mktemp("diffusers_models")
    t2v = build_wan_t2v(root / "Wan-tiny-T2V")
    return SimpleNamespace(
        root=root,
        t2v=t2v,
        i2v=build_wan_i2v(root / "Wan-tiny-I2V"),
        lora=build_lora(t2v, root / "lora"),
    )


@pytest.fixture(scope="session")
def helios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Chunk-autoregressive pipeline directories, by variant: ``base``
    (HeliosPipeline), ``pyramid`` (HeliosPyramidPipeline), ``distilled`` (the pyramid
    pipeline distilled, with HeliosDMDScheduler)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from trio_vstream.engines.diffusers.testing import HELIOS_VARIANTS, build_helios

    root = tmp_path_factory.mktemp("helios_models")
    return {v: build_helios(root / f"Helios-tiny-{v}", variant=v) for v in HELIOS_VARIANTS}


@pytest.fixture(scope="session")
def skyreels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SkyReels-V2 diffusion-forcing pipeline directories, by variant: ``t2v``
    (SkyReelsV2DiffusionForcingPipeline) and ``i2v`` (its image-to-video sibling), with
    the same weights."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from trio_vstream.engines.diffusers.testing import SKYREELS_DF_VARIANTS, build_skyreels_df

    root = tmp_path_factory.mktemp("skyreels_models")
    return {
        v: build_skyreels_df(root / f"SkyReels-DF-tiny-{v}", variant=v)
        for v in SKYREELS_DF_VARIANTS
    }


@pytest.fixture(scope="session")
def anyflow_far(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An AnyFlow FAR pipeline directory (AnyFlowFARPipeline, one transformer layer)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from trio_vstream.engines.diffusers.testing import build_anyflow_far

    return build_anyflow_far(tmp_path_factory.mktemp("anyflow_models") / "AnyFlow-FAR-tiny")


@pytest.fixture(scope="session")
def framepack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FramePack pipeline directory (HunyuanVideoFramepackPipeline, tokenizers and
    SigLIP built in code)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from trio_vstream.engines.diffusers.testing import build_framepack

    return build_framepack(tmp_path_factory.mktemp("framepack_models") / "Framepack-tiny")


@pytest.fixture
def make_engine() -> Iterator[Callable[..., DiffusersEngine]]:
    """Load engines as ``--engine diffusers`` does (CPU, 5-frame segments, one thread);
    each is closed after the test."""
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


@pytest.fixture
async def serve(nursery: trio.Nursery) -> Any:
    """Start a server on an engine; returns the server and its session summaries."""

    async def start(engine: Any, **session: Any) -> tuple[VideoServer, Summaries]:
        """``session``: `SessionConfig` fields (timeouts, say) beside the served model."""
        summaries = Summaries()
        config = ServerConfig(
            host="127.0.0.1",
            port=0,
            max_sessions=4,
            shutdown_grace=5.0,
            session=SessionConfig(served_model=engine.name, **session),
        )
        server = VideoServer(engine, config, on_session_end=summaries.record)
        await nursery.start(server.run)
        return server, summaries

    return start
