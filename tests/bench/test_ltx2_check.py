"""``bench/ltx2_check.py``, the LTX-2 step of ``gpu_check.sh``: it runs where no GPU is,
on the tests' tiny pipeline, so the day a GPU is lent it runs too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import ltx2_check


@pytest.mark.slow
def test_it_measures_a_session_with_exact_audio_on_a_cpu(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    out = tmp_path / "ltx2.json"
    args = ["--tiny", "--device", "cpu", "--segments", "2", "--steps", "1", "--json", str(out)]
    assert ltx2_check.main(args) == 0
    figures = json.loads(out.read_text())
    assert figures["chunks"] == [9, 8]
    assert figures["audio"] == {"sample_rate": 24000, "channels": 2}
    assert figures["audio_exact"] is True
    assert 0 < figures["first_chunk_s"] <= figures["total_s"]
    assert figures["real_time_factor"] > 0 and figures["peak_memory_mib"] > 0
