"""The training entry point at toy scale: it runs, writes a loadable checkpoint and
its JSON record, and the same seed gives the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file

from trio_vstream.models.shapes.model import load_weights
from trio_vstream.models.shapes.train import TrainSettings, main, train

TINY = TrainSettings(steps=3, batch=2, channels=(8, 16), minutes=5.0, warmup=2)


@pytest.mark.slow
def test_training_writes_weights_and_record_and_is_deterministic(tmp_path: Path) -> None:
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    report = train(TINY, first)
    train(TINY, second)
    assert report["steps_done"] == 3
    record = json.loads(first.with_suffix(".json").read_text())
    assert record["steps_done"] == 3 and record["settings"]["channels"] == [8, 16]
    model = load_weights(first)
    assert model.config.channels == (8, 16) and model.config.context_skip
    a, b = load_file(str(first)), load_file(str(second))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[key], b[key]) for key in a)

    other = tmp_path / "c.safetensors"
    train(attrs.evolve(TINY, seed=1), other)
    c = load_file(str(other))
    assert not all(torch.equal(a[key], c[key]) for key in a)


@pytest.mark.slow
def test_command_line_trains_a_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "cli.safetensors"
    args = ["--steps", "2", "--batch", "2", "--channels", "8,16", "--out", str(out)]
    assert main([*args, "--no-context-skip", "--halo", "0"]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["settings"]["context_skip"] is False and record["settings"]["halo"] == 0
    assert load_weights(out).config.context_skip is False
