"""The batched part: a server of its own whose engine batches its sessions' steps, and
wedge rounds in which a hung batched forward wedges it, until the soak lets it go.

The server runs the held engine (``held_engine.py``: shapes, 4 sessions' rows per batch)
with ``--max-sessions 4`` and a wedge bound (`settings.batched_server_command`). After a
warm-up (4 sessions at once) and the baseline, ``--batched-sessions`` normal sessions
run 4 at a time: every one must complete as in the main mix (``session.done``, every
frame, close 1000). Then each of ``--wedge-rounds`` rounds:

1. two sessions start with the round's hold token (``extra_params.hold``): their rows meet
   in a batch, which the engine holds outside any checkpoint (a hung forward);
2. both clients get ``stall_timeout`` on time, then close 1000 (judged as sessions of
   kind ``held``; the server records them ``stalled``);
3. once the sessions have waited their close timeout for the calls they left, the
   batcher gives up on the batch and is stuck: ``/health`` answers 503
   ``engine_unavailable`` naming the stuck batched step, within ``Timing.wedge_bound``,
   and a new WebSocket upgrade gets HTTP 503 ``engine_unavailable`` before it is
   accepted; ``/health`` stays 503 until the release;
4. the soak creates the token's file: the batch returns, and ``/health`` answers
   ``200 ok`` within ``Timing.recover_bound``;
5. two sessions start at once (a batch of 2 rows): both complete normally.

Then the server must be back at its baseline (threads, named when they differ; file
descriptors; RSS), log each wedge's two ERROR records once and no other, and exit with
status 0 within ``--shutdown-grace`` of SIGTERM.
"""

from __future__ import annotations

import itertools
import os
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

from bench._harness import parse_log, read_log
from bench._output import now, progress
from bench._server import Endpoint, ServerProcess
from bench._soak.health_checks import WedgeRecord, check_wedge_round
from bench._soak.plans import hold_token, make_held_plan, make_plan
from bench._soak.report import Violation, judge_sessions
from bench._soak.resources import Snapshot, idle_problems, resource_problems
from bench._soak.runner import Soak
from bench._soak.serverlog import WEDGE_ERRORS, wedge_log_problems
from bench._soak.settings import (
    AFTER_WEDGE_SESSIONS,
    BATCHED_MAX_SESSIONS,
    HEALTH_POLL_S,
    HELD_SESSIONS,
    REPO_ROOT,
    ROUND_START_TIMEOUT_S,
    Settings,
    batched_server_command,
)
from bench._soak.shutdown_checks import sigterm_problems


def server_env() -> dict[str, str]:
    """The batched server's environment: ``bench`` importable (its engine is there),
    wherever the soak was started from."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *([path] if path else [])])}


async def run_batched(
    s: Settings, log_dir: Path, deadline: float
) -> tuple[dict[str, Any], list[Violation]]:
    """The batched part against a server of its own (its log beside ``log_dir``'s
    others); nothing started after ``deadline`` (Trio time). Its report, and violations."""
    timing = s.timing
    rng = random.Random(f"soak-batched-{s.seed}")
    numbers = itertools.count()
    hold_dir = log_dir / "holds"
    hold_dir.mkdir(exist_ok=True)
    log_path = log_dir / "batched.server.log"
    command = batched_server_command(timing, hold_dir)
    server = ServerProcess(command, log_path, env=server_env())
    warm = [
        make_plan(rng, next(numbers), "normal", warmup=True) for _ in range(BATCHED_MAX_SESSIONS)
    ]
    batched = [make_plan(rng, next(numbers), "normal") for _ in range(s.batched_sessions)]
    report: dict[str, Any] = {"server": {"command": command}}
    violations: list[Violation] = []
    rounds: list[WedgeRecord] = []
    soak: Soak | None = None
    try:
        try:
            url = await server.start(timeout=ROUND_START_TIMEOUT_S)
        except RuntimeError as exc:
            violations.append(Violation(f"the batched server did not start: {exc}", kind=KIND))
            return report, violations
        soak = Soak(attrs.evolve(s, concurrency=BATCHED_MAX_SESSIONS), server, Endpoint.parse(url))
        report["server"].update({"url": url, "pid": server.pid})
        progress(
            f"batched server {server.pid} at {url}; {len(warm)} warm-up + {len(batched)} "
            f"sessions, then {s.wedge_rounds} wedge round(s)"
        )
        async with trio.open_nursery() as background:
            background.start_soon(soak.poll_metrics)
            background.start_soon(soak.watch.run)
            background.start_soon(soak.report_progress)
            complete = await soak.run_phase(warm, "batched warm-up", deadline)
            baseline: Snapshot | None = None
            if complete:
                baseline, unsettled, waited = await soak.settle(None)
                report["baseline_wait_s"] = round(waited, 1)
                violations += [Violation(f"after the warm-up: {p}", kind=KIND) for p in unsettled]
                phase_start = now()
                complete = await soak.run_phase(batched, "batched sessions", deadline)
                report["sessions_s"] = round(now() - phase_start, 1)
            for index in range(s.wedge_rounds):
                if not complete or trio.current_time() >= deadline:
                    break
                rec = await wedge_round(soak, rng, index, numbers, hold_dir, deadline)
                rounds.append(rec)
                problems = check_wedge_round(rec, timing)
                progress(f"wedge round {index}: {round_line(rec)}, {len(problems)} problem(s)")
            if not complete or len(rounds) < s.wedge_rounds:
                violations.append(
                    Violation(
                        f"the soak's deadline ({s.total_deadline_s:.0f} s) cut the batched part "
                        f"short: {len(rounds)} of {s.wedge_rounds} wedge rounds ran",
                        kind=KIND,
                    )
                )
            progress("batched part done; waiting for its server to settle")
            final, unsettled, waited = await soak.settle(baseline)
            report["final_wait_s"] = round(waited, 1)
            stats = await soak.fetch_stats() or {}
            background.cancel_scope.cancel()
        report["batches"] = {key: stats.get(key) for key in ("batches", "batch_rows")}
        if baseline is not None:
            found = resource_problems(baseline, final)
        else:
            found = idle_problems(final.metrics)
        violations += [Violation(f"at the end: {problem}", kind=KIND) for problem in found]
        health = soak.settled_health
        if health is None or not health.ok:
            violations.append(
                Violation(f"at the end: GET /health answered {health}, expected 200 ok", kind=KIND)
            )
        report["resources"] = {
            "baseline": baseline.to_json() if baseline else None,
            "final": final.to_json(),
        }
    finally:
        sigterm_at = now()
        status = await server.stop(grace=timing.shutdown_grace + 10.0)
        exit_s = now() - sigterm_at
        report["server"].update({"exit_status": status, "exit_s": round(exit_s, 2)})
    violations += [
        Violation(p, kind=KIND) for p in sigterm_problems(status, exit_s, timing.shutdown_grace)
    ]
    assert soak is not None  # it returned above otherwise
    records = parse_log(read_log(log_path))
    session_violations, stats = judge_sessions(soak, records, timing, WEDGE_ERRORS)
    violations = [
        *(attrs.evolve(v, kind=f"{KIND}: {v.kind}") for v in session_violations),
        *violations,
    ]
    wedges = sum(1 for rec in rounds if rec.wedged is not None)
    violations += [Violation(p, kind=KIND) for p in wedge_log_problems(records, wedges)]
    report["wedge_rounds"] = []
    for rec in rounds:
        problems = check_wedge_round(rec, timing)
        report["wedge_rounds"].append(round_summary(soak, rec, problems))
        kind = f"{KIND}: wedge round {rec.index}"
        violations += [Violation(problem, kind=kind) for problem in problems]
    report.update(stats)
    report["sessions"] = {
        "warmup": len(warm),
        "batched": len(batched),
        "held": HELD_SESSIONS * len(rounds),
        "after_wedge": AFTER_WEDGE_SESSIONS * len(rounds),
    }
    return report, violations


KIND = "batched"
"""What the batched part's violations are about, in the report."""


async def wedge_round(
    soak: Soak,
    rng: random.Random,
    index: int,
    numbers: Iterator[int],
    hold_dir: Path,
    deadline: float,
) -> WedgeRecord:
    """One wedge round (the module's docstring): two held sessions, the wedge, a refused
    upgrade, the release, the recovery, two sessions after it. The hold is released
    whatever happens."""
    timing = soak.s.timing
    token = hold_token(rng, index)
    rec = WedgeRecord(index=index, token=token)
    held = [make_held_plan(rng, next(numbers), token) for _ in range(HELD_SESSIONS)]
    rec.held = [plan.index for plan in held]
    try:
        if not await soak.run_phase(held, f"wedge round {index}", deadline):
            return rec
        rec.clients_done_at = now()
        with trio.move_on_after(timing.wedge_bound):
            while rec.wedged is None:
                sample = await soak.fetch_health()
                rec.health.append(sample)
                if sample.status == 503:
                    rec.wedged = sample
                else:
                    await trio.sleep(HEALTH_POLL_S)
        if rec.wedged is not None:
            rec.upgrade = await soak.try_upgrade()
            rec.health.append(await soak.fetch_health())  # still wedged, right before
    finally:
        with trio.CancelScope(shield=True):
            await trio.Path(hold_dir / token).touch()
        rec.released_at = now()
    with trio.move_on_after(timing.recover_bound):
        while rec.recovered is None:
            sample = await soak.fetch_health()
            rec.health.append(sample)
            if sample.ok:
                rec.recovered = sample
            else:
                await trio.sleep(HEALTH_POLL_S)
    after = [make_plan(rng, next(numbers), "normal") for _ in range(AFTER_WEDGE_SESSIONS)]
    await soak.run_phase(after, f"after wedge round {index}", deadline)
    rec.after = [plan.index for plan in after]
    return rec


def _outcomes(soak: Soak | None, plans: list[int]) -> dict[str, int]:
    if soak is None:
        return {}
    outcomes = Counter(
        r.verdict.outcome if r.verdict else "unjudged"
        for r in soak.results
        if r.plan.index in plans
    )
    return dict(outcomes.most_common())


def round_summary(soak: Soak | None, rec: WedgeRecord, problems: list[str]) -> dict[str, Any]:
    """One wedge round for the JSON report (times in seconds)."""

    def since(t: float | None, start: float | None) -> float | None:
        return None if t is None or start is None else round(t - start, 3)

    return {
        "index": rec.index,
        "token": rec.token,
        "held": _outcomes(soak, rec.held),
        "wedged_after_s": since(rec.wedged.sent_at if rec.wedged else None, rec.clients_done_at),
        "health_wedged": str(rec.wedged) if rec.wedged else None,
        "upgrade": None if rec.upgrade is None else f"{rec.upgrade[0]} {rec.upgrade[1][:200]}",
        "recovered_after_s": since(
            rec.recovered.sent_at if rec.recovered else None, rec.released_at
        ),
        "after": _outcomes(soak, rec.after),
        "problems": problems,
    }


def round_line(rec: WedgeRecord) -> str:
    """A wedge round in a few words, for progress."""
    wedged = "no 503" if rec.wedged is None else "503"
    upgrade = "no upgrade tried" if rec.upgrade is None else f"upgrade {rec.upgrade[0]}"
    recovered = "200 ok" if rec.recovered is not None else "no 200 ok"
    return f"{wedged}, {upgrade}, released, {recovered}"
