"""``bench/gpu_check.sh``, the one command for a GPU machine: it must still fit the tools it
calls on the day it runs, so its flags and paths are checked here, where no GPU is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it runs the whole check")
def test_without_cuda_it_says_so_and_runs_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path / "out")},
    )
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "script",
    [
        "bench/run.py",
        "bench/evaluate_shapes.py",
        "bench/ltx2_check.py",
        "bench/diffusers_batching.py",
    ],
)
def test_every_flag_it_passes_exists(script: str) -> None:
    text = SCRIPT.read_text()
    calls = [m.group(1) for m in re.finditer(rf"{re.escape(script)}((?:[^\n]|\\\n)*)", text)]
    assert calls, f"{script} is not called"
    flags = {f for call in calls for f in re.findall(r"(--[a-z][a-z-]*)", call)}
    help_text = subprocess.run(
        [sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    missing = sorted(f for f in flags if f not in help_text)
    assert not missing, f"{script} has no {missing}"


def test_the_tests_it_selects_exist() -> None:
    text = SCRIPT.read_text()
    [selection] = re.findall(r"-m pytest (.*?)(?<!\\)\n", text, flags=re.DOTALL)
    args = selection.replace("\\\n", " ").split()
    cuda_tests = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout
    # At least the shapes engine's and the diffusers engine's CUDA tests.
    selected = [line for line in cuda_tests.splitlines() if "::" in line]
    assert len(selected) >= 2, cuda_tests
