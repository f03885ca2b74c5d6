"""The ``decode`` benchmark scenario: one real ``--quick`` run (two shapes servers the
harness starts, deferred and eager decode; ~25 s), checked for sane figures, for the
servers it started and for its verdicts, never for speed; plus its pure parts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import run as bench
from bench.scenarios.decode import DECODE_MODES, DecodePreset, DecodeScenario

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "run.py"
QUICK = DecodePreset.named("quick")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``--quick --scenario decode`` run: its JSON report and stdout."""
    output = tmp_path_factory.mktemp("bench") / "decode.json"
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--scenario", "decode", "--output", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {"report": json.loads(output.read_text()), "stdout": done.stdout}


def _figures(quick: dict[str, Any]) -> dict[str, Any]:
    return quick["report"]["decode"]["figures"]


def test_both_modes_measure_ttfc_and_fps_at_every_level(quick: dict[str, Any]) -> None:
    figures = _figures(quick)
    for mode in DECODE_MODES:
        for level in QUICK.levels:
            prefix = f"decode.{mode}.n{level}"
            assert figures[f"{prefix}.aggregate_fps"]["min"] > 0, prefix
            ttfc = figures[f"{prefix}.ttfc_ms"]
            assert ttfc["n"] == level + (QUICK.ttfc_sessions - 1 if level == 1 else 0), prefix
            assert 0 < ttfc["min"] <= ttfc["median"], prefix
            for count in ("errors", "ended_early"):
                assert figures[f"{prefix}.{count}"]["max"] == 0, prefix
    for level in QUICK.levels:
        deferred = figures[f"decode.deferred.n{level}.aggregate_fps"]["median"]
        eager = figures[f"decode.eager.n{level}.aggregate_fps"]["median"]
        assert figures[f"decode.n{level}.fps_ratio"]["median"] == pytest.approx(deferred / eager)
        assert f"decode.n{level}.ttfc_ratio" in figures


def test_the_servers_differ_only_in_defer_decode(quick: dict[str, Any]) -> None:
    result = quick["report"]["decode"]
    servers = result["servers"]
    assert servers["deferred"]["engine_args"] == {"max_batch": "8", "defer_decode": "1"}
    assert servers["eager"]["engine_args"] == {"max_batch": "8", "defer_decode": "0"}
    run = result["runs"][0]
    assert run["order"] == ["deferred", "eager"]
    assert all(run["modes"][mode]["server_exit"] == 0 for mode in DECODE_MODES)
    assert all(check["ok"] is True for check in result["checks"]), result["checks"]


def test_verdicts_are_judged_and_printed(quick: dict[str, Any]) -> None:
    verdicts = quick["report"]["decode"]["targets"]
    assert [v["target"] for v in verdicts] == [
        "decode: aggregate fps at 2 sessions, deferred / eager",
        "decode: aggregate fps, one session, deferred / eager",
        "decode: time to first chunk, one session, deferred / eager",
        "decode: cleanup, nothing left on the server after each level",
    ]
    assert all(v["status"] in ("PASS", "FAIL") for v in verdicts), verdicts
    assert "| decode.deferred.n1.ttfc_ms | ms |" in quick["stdout"]


def test_presets_and_catalogue() -> None:
    parse = bench.build_parser().parse_args
    assert "decode" not in bench.settings_from(parse([])).scenarios
    with pytest.raises(SystemExit):
        bench.settings_from(parse(["--scenario", "decode", "--url", "ws://h:1/v"]))
    cpu = DecodePreset.named("cpu")
    assert (cpu.width, cpu.height, cpu.levels) == (256, 256, (1, 4))
    assert DecodePreset.named("gpu").device == "cuda"
    with pytest.raises(ValueError, match="unknown decode preset 'huge'"):
        DecodePreset.named("huge")
    scenario = DecodeScenario(bench.Settings(scenarios=("decode",)), cpu, [])
    assert set(scenario.targets) == set(DECODE_MODES)
    for name in (
        "decode.deferred.n4.aggregate_fps",
        "decode.eager.n1.ttfc_ms",
        "decode.n1.ttfc_ratio",
    ):
        assert bench.catalogue_key(name) in bench.CATALOGUE, name
