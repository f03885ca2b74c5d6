"""LoRA adapters (``trio_vstream.engines.diffusers._lora``): loaded for the session that
asks, and gone, layers and all, when it closes. (Two sessions with and without a LoRA at
once: ``test_engine.py``.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.engines.diffusers.support import no_stop, request, run_all
from trio_vstream.engines import InvalidRequestError


def test_lora_is_loaded_for_its_session_and_unloaded_when_it_closes(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v, lora_root=str(models.root))
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


def test_without_a_lora_root_no_request_loads_a_lora(
    models: SimpleNamespace, make_engine: Any
) -> None:
    """Clients name files on the server: loading LoRAs is the operator's opt-in."""
    engine = make_engine(models.t2v)
    with pytest.raises(InvalidRequestError, match="loads no LoRA named in a request"):
        engine.open_stream(request(lora={"path": str(models.lora)}))
    assert not any("lora_A" in n for n, _ in engine.model.pipe.transformer.named_modules())
