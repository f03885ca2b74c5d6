"""``bench/sana_wm_check.py``, the GPU check's SANA-WM step: what ``gpu_check.sh`` passes it
exists, and it runs end to end on a CPU at the tiny size (the GPU preset is the same
code at another size)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import sana_wm_check

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_calls_it_with_flags_it_takes() -> None:
    text = (REPO / "bench" / "gpu_check.sh").read_text()
    [call] = re.findall(r"bench/sana_wm_check\.py((?:\\\n|[^\n])*)", text)
    args = call.replace("\\\n", " ").replace('"$out/sana_wm.json"', "out.json").split()
    parsed = sana_wm_check.parse_args(args)
    assert (parsed.preset, parsed.device, parsed.segments) == ("gpu", "cuda", 3)
    assert sana_wm_check.PRESETS["gpu"]["segment_frames"] % 8 == 1  # the real VAE's 8n+1


@pytest.mark.slow
def test_it_reports_a_steered_run_on_a_cpu(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    args = sana_wm_check.parse_args(["--preset", "tiny", "--steps", "1", "--guidance-scale", "1"])
    figures = sana_wm_check.run(args, tmp_path)
    assert figures["frames"] == [5, 4, 4]  # a first segment, then two continued ones
    assert figures["first_chunk_seconds"] == figures["segment_seconds"][0] > 0
    assert figures["real_time_factor"] > 0
    assert figures["peak_memory_kind"] == "process max RSS"
