"""Engine args (``trio_vstream.engines.diffusers._settings``, and what the engine checks of
them against the pipeline): a bad one fails at start-up, named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trio_vstream.engines import EngineConfigError, load_engine


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
