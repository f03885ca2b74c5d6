"""Loading (``trio_vstream.engines.diffusers._loading``): a bad pipeline directory fails
at start-up, naming the path and what is wrong with it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from trio_vstream.engines import EngineConfigError, load_engine


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such directory"),
        ("file", "not a directory"),
        ("empty", "missing model_index.json"),
        ("modular", r"a modular pipeline repository \(modular_model_index.json\)"),
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
    elif case == "modular":
        path.mkdir()
        (path / "modular_model_index.json").write_text('{"_class_name": "HeliosModularPipeline"}')
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


@pytest.mark.slow
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
