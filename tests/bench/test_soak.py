"""The soak test (``bench/soak.py``): its short form against real servers, and the
servers it starts.

The short form runs in CI like the benchmark's ``--quick``: as a subprocess, judged from
its JSON report, and must find no violation. It is the main mix small (20 randomized
sessions, so every kind once, a stuck engine's of both variants among them, and a
session that follows an input video, on the synthetic engine), then the batched part: a
server whose engine batches 4 sessions' steps, 8 sessions on it, and 2 wedge rounds (two
sessions whose batch is held wedge it: 503 on /health and on a new upgrade, until the
soak releases the batch; then 200 ok and sessions complete again). 80-90 s on a loaded
2-core machine. The shutdown rounds are left out here (``--shutdown-rounds 0``):
``test_soak_shutdown.py`` runs real ones. The checks that decide are unit-tested module
by module, with bad input that proves each can fail (``test_soak_checks.py``,
``test_soak_serverlog.py``, ``test_soak_resources.py``, ``test_soak_plans.py``,
``test_soak_shutdown.py``, ``test_soak_held_engine.py``), since a soak that never fails
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
    BATCHED_MAX_SESSIONS,
    HELD_ENGINE,
    KINDS,
    ROUND_SESSIONS,
    ROUND_SHUTDOWN_GRACE,
    STUCK_VARIANTS,
    Settings,
    Timing,
    batched_server_command,
    round_server_command,
    server_command,
    stuck_calls_bound,
)

REPO = Path(__file__).resolve().parents[2]
SOAK = REPO / "bench" / "soak.py"
SEED = 127
"""Its 20 sessions have an ``engine_stuck`` session of each variant (with 19 kinds, one
session is drawn beyond one of each: few seeds make it the second ``engine_stuck``), and
its warm-up three more ``input_video`` sessions, held and ended with their input."""
SHORT_FORM = ("--sessions", "20", "--concurrency", "8", "--seed", str(SEED))
SHORT_FORM += ("--shutdown-rounds", "0", "--batched-sessions", "8", "--wedge-rounds", "2")


@pytest.mark.timeout(290)
def test_short_soak_finds_no_violation(tmp_path: Path) -> None:
    output = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SOAK), *SHORT_FORM, "--json", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=270,
    )
    assert output.exists(), done.stderr[-3000:]
    report = json.loads(output.read_text())
    shown = json.dumps(report["violations"][:10], indent=1)[:20000]
    assert report["violation_count"] == 0, f"{done.stdout[-3000:]}\n{shown}"
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["passed"] is True
    # Every kind ran, and each ended the way it should at least once.
    assert set(report["kinds"]) == set(KINDS)
    assert sum(k["count"] for k in report["kinds"].values()) == 20
    assert report["kinds"]["engine_fail"]["outcomes"] == {
        "error:generation_failed": report["kinds"]["engine_fail"]["count"]
    }
    assert report["kinds"]["oversized_frame"]["outcomes"] == {
        "close:1009": report["kinds"]["oversized_frame"]["count"]
    }
    # Video in: JPEG frames at the input's rate while streaming, then input_video.end;
    # the session completes, its frames used (or dropped, counted), none refused.
    videos = report["kinds"]["input_video"]
    assert videos["outcomes"] == {"done": videos["count"]}
    assert videos["server_outcomes"] == {"completed": videos["count"]}
    inputs = report["input_video"]
    assert inputs["sessions"] == 4 and 0 < inputs["used"] <= inputs["sent"]
    # A stuck engine: the stall error on time, while blocked (the server's record is
    # checked too); /health said degraded while calls were stuck, never 503 (the wedge
    # bound is above what the mix leaves stuck), and ok once they had returned.
    stuck = report["kinds"]["engine_stuck"]
    assert stuck["outcomes"] == {"error:stall_timeout": stuck["count"]}
    assert stuck["server_outcomes"] == {"stalled:stall_timeout": stuck["count"]}
    assert report["health"]["at_the_end"] == "200 ok"
    plans = make_plans(SEED, 20, Settings(concurrency=8).warmup_sessions)
    variants = {p.params["variant"] for p in plans if p.kind == "engine_stuck" and not p.warmup}
    assert variants == set(STUCK_VARIANTS)
    answers = report["health"]["answers"]
    assert answers.get("200 degraded", 0) > 0
    assert not [answer for answer in answers if answer.startswith("503")]
    assert 0 < report["health"]["peak_stuck_calls"] < report["settings"]["max_stuck_calls"]
    resources = report["resources"]
    assert resources["final"]["threads"] <= resources["baseline"]["threads"]
    assert resources["final"]["fds"] <= resources["baseline"]["fds"]
    assert report["server"]["exit_status"] == 0
    # The batched part: its sessions completed, batched; each wedge round wedged the
    # server (503 on /health and before an upgrade), and it recovered once released.
    batched = report["batched"]
    assert batched["sessions"] == {"warmup": 4, "batched": 8, "held": 4, "after_wedge": 4}
    assert batched["kinds"]["normal"]["outcomes"] == {"done": 8 + 4}
    assert batched["kinds"]["held"]["outcomes"] == {"error:stall_timeout": 4}
    assert batched["kinds"]["held"]["server_outcomes"] == {"stalled:stall_timeout": 4}
    assert batched["batches"]["batch_rows"] > batched["batches"]["batches"] > 0
    assert len(batched["wedge_rounds"]) == 2
    for info in batched["wedge_rounds"]:
        assert info["problems"] == [] and info["after"] == {"done": 2}
        assert info["health_wedged"].startswith("503 engine_unavailable: ")
        assert info["upgrade"].startswith("503 engine_unavailable: ")
        assert info["recovered_after_s"] <= report["thresholds"]["recover_s"]
    resources = batched["resources"]
    assert resources["final"]["threads"] <= resources["baseline"]["threads"]
    assert resources["final"]["fds"] <= resources["baseline"]["fds"]
    assert batched["server"]["exit_status"] == 0
    assert sum("wedge round" in line for line in done.stdout.splitlines()) == 2
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
    held = batched_server_command(Timing(), Path("/tmp/holds"))
    assert held[held.index("--host") + 1] == "127.0.0.1"
    assert held[held.index("--engine") + 1] == HELD_ENGINE
    assert "hold_dir=/tmp/holds" in held and f"max_batch={BATCHED_MAX_SESSIONS}" in held
    assert held[held.index("--max-sessions") + 1] == str(BATCHED_MAX_SESSIONS)
    assert int(held[held.index("--max-stuck-calls") + 1]) > 0  # the batcher can wedge it
    no_batched = Settings(batched_sessions=0, wedge_rounds=0)
    assert not no_batched.batched and no_batched.total_deadline_s < Settings().total_deadline_s
