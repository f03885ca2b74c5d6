"""The soak test (``bench/soak.py``): its short form against a real server, and the
server it starts.

The short form (200 randomized sessions of every kind, a stuck engine's among them, then
3 shutdown rounds that stop a server with two signals, one of them with an engine call
stuck, ~60 s) runs in CI like the benchmark's ``--quick``: as a subprocess, judged from
its JSON report. It must find no violation. The checks that
decide that are unit-tested module by module, with bad input that proves each can fail
(``test_soak_checks.py``, ``test_soak_serverlog.py``, ``test_soak_resources.py``,
``test_soak_plans.py``, ``test_soak_shutdown.py``), since a soak that never fails
proves nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench._soak.plans import make_plans
from bench._soak.settings import (
    KINDS,
    ROUND_KINDS,
    ROUND_SESSIONS,
    ROUND_SHUTDOWN_GRACE,
    STUCK_VARIANTS,
    Settings,
    Timing,
    round_server_command,
    server_command,
    stuck_calls_bound,
)

REPO = Path(__file__).resolve().parents[2]
SOAK = REPO / "bench" / "soak.py"
SHORT_FORM = ("--sessions", "200", "--concurrency", "8", "--seed", "1", "--deadline", "140")
SHORT_FORM += ("--shutdown-rounds", "3")


@pytest.mark.timeout(240)
def test_short_soak_finds_no_violation(tmp_path: Path) -> None:
    output = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SOAK), *SHORT_FORM, "--json", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert output.exists(), done.stderr[-3000:]
    report = json.loads(output.read_text())
    shown = json.dumps(report["violations"][:10], indent=1)[:20000]
    assert report["violation_count"] == 0, f"{done.stdout[-3000:]}\n{shown}"
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["passed"] is True
    # Every kind ran, and each ended the way it should at least once.
    assert set(report["kinds"]) == set(KINDS)
    assert sum(k["count"] for k in report["kinds"].values()) == 200
    assert report["kinds"]["engine_fail"]["outcomes"] == {
        "error:generation_failed": report["kinds"]["engine_fail"]["count"]
    }
    assert report["kinds"]["oversized_frame"]["outcomes"] == {
        "close:1009": report["kinds"]["oversized_frame"]["count"]
    }
    # A stuck engine: the stall error on time, while blocked (the server's record is
    # checked too); /health said degraded while calls were stuck, never 503 (the wedge
    # bound is above what the mix leaves stuck), and ok once they had returned.
    stuck = report["kinds"]["engine_stuck"]
    assert stuck["outcomes"] == {"error:stall_timeout": stuck["count"]}
    assert stuck["server_outcomes"] == {"stalled:stall_timeout": stuck["count"]}
    assert report["health"]["at_the_end"] == "200 ok"
    # Seed 1's short form has both variants: calls that return while their session waits,
    # and calls abandoned, during which /health must say degraded (and did, when polled).
    plans = make_plans(1, 200, Settings(concurrency=8).warmup_sessions)
    variants = {p.params["variant"] for p in plans if p.kind == "engine_stuck" and not p.warmup}
    assert variants == set(STUCK_VARIANTS)
    answers = report["health"]["answers"]
    assert answers.get("200 degraded", 0) > 0
    assert not [answer for answer in answers if answer.startswith("503")]
    resources = report["resources"]
    assert resources["final"]["threads"] <= resources["baseline"]["threads"]
    assert resources["final"]["fds"] <= resources["baseline"]["fds"]
    assert report["server"]["exit_status"] == 0
    # The shutdown rounds: every kind, both engines, each server out at once after its
    # second signal, a stuck engine's too.
    rounds = report["shutdown_rounds"]
    assert {r["kind"] for r in rounds} == set(ROUND_KINDS)
    assert {r["engine"] for r in rounds} == {"shapes", "synthetic"}
    assert all(r["stuck"] > 0 for r in rounds if r["kind"] == "engine_stuck")
    for info in rounds:
        assert info["problems"] == [] and info["exit_status"] == 0 and not info["killed"]
        assert info["exit_s"] <= report["thresholds"]["second_signal_exit_s"]
        assert sum(info["clients"].values()) == info["sessions"]
    assert sum("shutdown round" in line for line in done.stdout.splitlines()) == 3
    assert "soak PASS" in done.stdout.splitlines()[-1]


def test_the_server_command_only_listens_on_loopback() -> None:
    command = server_command(Settings(concurrency=5), stuck_plans=3)
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--max-sessions") + 1] == "5"
    # Never wedged by its mix: every session's calls and every stuck plan's, and one more.
    assert command[command.index("--max-stuck-calls") + 1] == str(2 * 5 + 3 + 1)
    assert "--no-exit-when-wedged" in command
    assert Settings(sessions=200).total_deadline_s < Settings().total_deadline_s
    rounds = round_server_command("shapes", Timing())
    assert rounds[rounds.index("--host") + 1] == "127.0.0.1"
    assert rounds[rounds.index("--engine") + 1] == "shapes"
    assert float(rounds[rounds.index("--shutdown-grace") + 1]) == ROUND_SHUTDOWN_GRACE
    assert rounds[rounds.index("--max-stuck-calls") + 1] == str(
        stuck_calls_bound(ROUND_SESSIONS[1], 0)
    )
    # A second signal must beat the drain by far, or a drain could pass for it.
    assert Timing().stop_bound < ROUND_SHUTDOWN_GRACE / 2
    assert Settings(shutdown_rounds=0).total_deadline_s < Settings().total_deadline_s
