"""``bench/diffusers_batching.py``: its presets run (the GPU ones at a tiny size on this
CPU, so ``gpu_check.sh`` does not meet a broken script on the day a GPU is lent), and it
reports both modes, the ratios and the verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

pytest.importorskip("diffusers")

from bench import diffusers_batching


@pytest.mark.slow
def test_the_cpu_run_reports_both_modes_and_the_verdicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "batching.json"
    assert (
        diffusers_batching.main(["--preset", "tiny", "--levels", "1,4", "--output", str(out)]) == 0
    )
    [result] = json.loads(out.read_text())
    assert result["batches"] and [row["sessions"] for row in result["levels"]] == [1, 4]
    four = result["levels"][1]
    assert four["on_rows_per_batch"] > 1.0  # rows of several sessions shared forwards
    assert four["off_rows_per_batch"] != four["off_rows_per_batch"]  # NaN: no batcher
    assert four["fps_ratio"] > 0 and four["ttfc_ratio"] > 0
    shown = capsys.readouterr().out
    assert "aggregate fps at 4 sessions" in shown and "lone TTFC" in shown


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpu-skyreels", "gpu-wan"])
def test_the_gpu_presets_run_at_a_tiny_size_on_cpu(name: str) -> None:
    preset = attrs.evolve(
        diffusers_batching.PRESETS[name],
        size={},
        width=32,
        height=32,
        steps=1,
        device="cpu",
        threads=1,
    )
    result = diffusers_batching.measure(preset, 1, (1, 2))
    assert result["batches"]  # Wan's segments batch their calls' forwards too
    assert all(row["on_fps"] > 0 and row["off_fps"] > 0 for row in result["levels"])
    assert "| 2 |" in diffusers_batching.markdown(result)


@pytest.mark.slow
def test_the_far_preset_runs_batched_and_not() -> None:
    # AnyFlow FAR at the tests' size (one block, one step a chunk): the preset builds,
    # its sessions run in both modes, and the family batches.
    preset = attrs.evolve(diffusers_batching.PRESETS["cpu-far"], size={"layers": 1}, steps=1)
    result = diffusers_batching.measure(preset, 1, (1, 2))
    assert result["batches"]
    assert all(row["on_fps"] > 0 and row["off_fps"] > 0 for row in result["levels"])
