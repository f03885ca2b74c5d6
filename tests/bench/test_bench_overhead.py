"""The ``overhead`` benchmark scenario: one real ``--quick`` run (a synthetic server the
harness starts and the bare encoder's process; ~6 s), checked for what it reports and
how, not for speed; plus its pure parts: the figures' arithmetic, and the bare encoder's
bitstream, which must be the server encoder's byte for byte (else it is not a
yardstick for the same work).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from av.video.reformatter import VideoReformatter

from bench._bare_encoder import BareJob, encode_bare, encode_chunk
from bench.scenarios.overhead import OVERHEAD_LIMIT, overhead_figures
from trio_vstream.media.encoding import FragmentedMP4Encoder
from trio_vstream.media.h264 import open_h264, to_sample

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "run.py"
FIGURES = (
    "server_ms_per_frame",
    "engine_ms_per_frame",
    "serving_ms_per_frame",
    "bare_ms_per_frame",
    "bare_generate_ms_per_frame",
    "ratio",
    "ratio_with_generation",
    "aggregate_fps",
    "errors",
)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``--quick --scenario overhead`` run: its JSON report and stdout."""
    output = tmp_path_factory.mktemp("bench") / "overhead.json"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--scenario", "overhead", "--output", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        "report": json.loads(output.read_text()),
        "stdout": done.stdout,
        "elapsed": time.monotonic() - started,
    }


def test_quick_run_reports_every_figure_once(quick: dict[str, Any]) -> None:
    assert quick["elapsed"] < 60
    result = quick["report"]["overhead"]
    for name in FIGURES:
        figure = result["figures"][f"overhead.{name}"]
        assert figure["n"] == 1, name
        assert math.isfinite(figure["median"]), name
    assert result["figures"]["overhead.errors"]["max"] == 0
    assert "overhead.ratio" in quick["stdout"]


def test_quick_run_measured_both_sides_on_the_same_frames(quick: dict[str, Any]) -> None:
    result = quick["report"]["overhead"]
    (run,) = result["runs"]
    assert run["order"] == ["server", "bare"]
    settings = quick["report"]["settings"]
    expected = settings["overhead_sessions"] * settings["overhead_frames"]
    assert run["server"]["frames"] == run["bare"]["frames"] == expected
    assert run["server"]["server_exit"] == 0
    # The engine's share is its own figure, measured by the server, and part of the whole.
    assert 0 < run["server"]["engine_cpu_s"] < run["server"]["cpu_s"]
    assert run["bare"]["encode_cpu_s"] > 0 and run["bare"]["generate_cpu_s"] > 0
    figures = run["figures"]
    assert figures["ratio"] == pytest.approx(
        figures["serving_ms_per_frame"] / figures["bare_ms_per_frame"]
    )
    assert result["bare"]["sessions"] == settings["overhead_sessions"]
    assert result["server"]["engine"] == "synthetic"


def test_quick_run_judges_the_target_and_the_cleanup(quick: dict[str, Any]) -> None:
    verdicts = {v["target"]: v for v in quick["report"]["overhead"]["targets"]}
    ratio = next(v for name, v in verdicts.items() if name.startswith("overhead: server CPU"))
    assert ratio["threshold"] == OVERHEAD_LIMIT
    assert ratio["status"] in ("PASS", "FAIL")  # measured, whatever the machine's load
    cleanup = next(v for name, v in verdicts.items() if "cleanup" in name)
    assert cleanup["status"] == "PASS"


def test_overhead_figures_leave_the_engine_out_of_the_ratio() -> None:
    figures = overhead_figures(
        server_cpu_s=3.0,
        engine_cpu_s=0.5,
        frames=1000,
        bare_encode_cpu_s=2.0,
        bare_generate_cpu_s=0.4,
        bare_frames=1000,
    )
    assert figures["server_ms_per_frame"] == pytest.approx(3.0)
    assert figures["serving_ms_per_frame"] == pytest.approx(2.5)
    assert figures["ratio"] == pytest.approx(1.25)
    assert figures["ratio_with_generation"] == pytest.approx(3.0 / 2.4)


def test_overhead_figures_without_a_measurement_are_nan() -> None:
    figures = overhead_figures(
        server_cpu_s=None,
        engine_cpu_s=None,
        frames=0,
        bare_encode_cpu_s=1.0,
        bare_generate_cpu_s=0.1,
        bare_frames=10,
    )
    assert math.isnan(figures["ratio"]) and math.isnan(figures["server_ms_per_frame"])
    assert figures["bare_ms_per_frame"] == pytest.approx(100.0)


def test_the_bare_encoder_makes_the_server_encoders_bitstream() -> None:
    rng = np.random.default_rng(3)
    chunks = [rng.integers(0, 256, (4, 48, 64, 3), dtype=np.uint8) for _ in range(3)]
    server = FragmentedMP4Encoder(width=64, height=48, fps=24)
    ctx, reformatter = open_h264(width=64, height=48, fps=24), VideoReformatter()
    first = 0
    for chunk in chunks:
        fragment = server.encode(chunk)
        samples = b"".join(
            to_sample(bytes(p)) for p in encode_chunk(ctx, reformatter, chunk, first)
        )
        first += chunk.shape[0]
        # The fragment's mdat is exactly the bare encoder's samples, in order.
        assert fragment.endswith(b"mdat" + samples)


def test_encode_bare_counts_every_frame_and_both_costs() -> None:
    job = BareJob(
        sessions=2, num_frames=6, width=64, height=48, fps=24, chunk_frames=4, prompt="x", seed=1
    )
    result = encode_bare(job)
    assert result["frames"] == 12
    assert result["encode_cpu_s"] > 0 and result["generate_cpu_s"] >= 0
