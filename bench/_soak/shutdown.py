"""Shutdown rounds: a server of their own each, with sessions streaming, stopped with a
signal and then another, from outside, as an operator's double Ctrl-C.

The sessions' part of the soak ends with one SIGTERM, a drain; these rounds test what a
second signal promises (cli/serve.py: "a second one at once"): the server stops and its
process exits within ``Timing.stop_bound``, with status 0, every client's connection
ends (with ``server_shutdown`` or cut, nothing else), and the log has no error. A
second signal once deadlocked the shapes engine's step batcher: rows in flight were
never finished when the cancel came before the batch's thread started, so the process
never exited (issue 20, item 11). ``double_signal`` rounds alternate shapes (its batcher)
and synthetic. ``engine_stuck`` rounds (synthetic) send the signals, or one (a drain),
while sessions' engine calls are blocked outside a checkpoint for longer than any bound:
the process must still exit within its bound (issue 20, item 10), and its log must show
the calls left running (the threads were stuck when it went).

Every choice is in the round's plan (``plans.make_shutdown_plan``); the round records
what it saw (``shutdown_checks.RoundRecord``) and is judged afterwards by pure checks.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio
from trio_websocket import ConnectionRejected, HandshakeError, wrap_client_stream

from bench._client import CLIENT_MAX_MESSAGE, RECEIVE_BUFFER
from bench._harness import log_size, parse_log, read_log
from bench._output import now, progress
from bench._server import Endpoint, ServerProcess
from bench._soak.client import Conn, describe_error, rejected_upgrade
from bench._soak.plans import ShutdownPlan, make_shutdown_plans, stuck_at
from bench._soak.report import Violation
from bench._soak.serverlog import log_problems, signal_problems, stuck_problems, taken_line
from bench._soak.settings import (
    BLOCKED_SILENCE_S,
    CLOSE_AFTER_EXIT_S,
    ROUND_START_TIMEOUT_S,
    SIGNAL_TAKEN_WAIT_S,
    STREAMING_WAIT_S,
    Settings,
    Timing,
    round_server_command,
)
from bench._soak.shutdown_checks import (
    RoundRecord,
    check_round_client,
    check_round_process,
    exit_bound,
    round_ending,
)
from bench._soak.transcript import Transcript


async def run_round(
    plan: ShutdownPlan, timing: Timing, log_path: Path, command: list[str] | None = None
) -> RoundRecord:
    """Start the round's server (``command``, by default ``round_server_command``), stream
    its sessions, send its signals, and wait (bounded) for the process and every client.

    Whatever happens, the server is gone when this returns: killed at ``exit_bound``
    after the last signal, or by ``ServerProcess.stop`` on the way out."""
    rec = RoundRecord(transcripts=[Transcript(t0=now(), wall0=time.time()) for _ in plan.starts])
    server = ServerProcess(command or round_server_command(plan.engine, timing), log_path)
    started = now()
    try:
        try:
            url = await server.start(timeout=ROUND_START_TIMEOUT_S)
        except RuntimeError as exc:
            rec.error = f"the round's server did not start: {exc}"
            return rec
        rec.startup_s = now() - started
        endpoint = Endpoint.parse(url)
        async with trio.open_nursery() as clients:
            streaming = [trio.Event() for _ in plan.starts]
            for start, tr, event in zip(plan.starts, rec.transcripts, streaming, strict=True):
                clients.start_soon(_client, endpoint, start, tr, event)
            with trio.move_on_after(STREAMING_WAIT_S):
                for event in streaming:
                    await event.wait()
            if all(event.is_set() for event in streaming):
                rec.streaming_at = now()
            await _send_signals(plan, rec, server, log_path)
            await _wait_exit(server, rec, exit_bound(plan, timing))
            # The process is gone: each client's connection ends now, or is reported open.
            clients.cancel_scope.deadline = trio.current_time() + CLOSE_AFTER_EXIT_S
    finally:
        await server.stop(grace=1.0)  # only if something above failed: shielded, bounded
    return rec


async def _client(
    endpoint: Endpoint, start: dict[str, Any], tr: Transcript, streaming: trio.Event
) -> None:
    """One session: start, read everything until the connection ends (Conn records it),
    and say when its first media chunk has arrived, or for a stuck one (``stuck_at``),
    when it is blocked (`_blocked`)."""
    tr.t0, tr.wall0 = now(), time.time()
    stream: trio.SocketStream | None = None
    try:
        stream = await trio.open_tcp_stream(endpoint.host, endpoint.port)
        async with trio.open_nursery() as nursery:
            try:  # inside the nursery, which would wrap it in a group
                ws = await wrap_client_stream(
                    nursery,
                    stream,
                    endpoint.host_header,
                    endpoint.resource,
                    max_message_size=CLIENT_MAX_MESSAGE,
                    receive_buffer_size=RECEIVE_BUFFER,
                )
            except (ConnectionRejected, HandshakeError) as exc:
                tr.client_error = f"WebSocket handshake failed: {type(exc).__name__}: {exc}"
                nursery.cancel_scope.cancel()
                return
            tr.connected_at = now()
            conn = Conn(ws, tr)
            nursery.start_soon(conn.read_loop)
            await conn.send(json.dumps({"type": "session.start", **start}), "session.start")
            at_chunk = stuck_at(start)
            if at_chunk is not None:
                if await _blocked(conn, at_chunk):
                    streaming.set()
            elif await conn.wait_for(
                lambda: any(e.text is None for e in tr.received()), STREAMING_WAIT_S
            ):
                streaming.set()
            await conn.closed.wait()
            nursery.cancel_scope.cancel()
    except OSError as exc:  # the connect
        tr.client_error = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        if rejected_upgrade(exc) is None:
            raise  # a soak bug: the round fails loudly
        tr.client_error = describe_error(exc)  # a refused upgrade (in a nursery's group)
    finally:
        tr.ended_at = now()
        tr.timed_out = tr.closed_at is None and tr.client_error is None
        if stream is not None:
            with trio.CancelScope(shield=True):
                await stream.aclose()


async def _blocked(conn: Conn, at_chunk: int) -> bool:
    """Whether a stuck session got blocked within ``STREAMING_WAIT_S``: ``video.start``
    and its ``at_chunk`` media chunks, then nothing for ``BLOCKED_SILENCE_S`` while its
    connection stayed open. Its engine asks for the next chunk as soon as it has made one,
    so that silence is the block (the stall guard would speak only after a stall timeout)."""

    def media() -> int:
        return sum(1 for e in conn.tr.received() if e.text is None)

    with trio.move_on_after(STREAMING_WAIT_S):
        if not await conn.wait_for(
            lambda: conn.video_started and media() >= at_chunk, STREAMING_WAIT_S
        ):
            return False
        while not conn.closed.is_set():
            seen = len(conn.tr.events)
            await trio.sleep(BLOCKED_SILENCE_S)
            if len(conn.tr.events) == seen and not conn.closed.is_set():
                return True
    return False


async def _send_signals(
    plan: ShutdownPlan, rec: RoundRecord, server: ServerProcess, log_path: Path
) -> None:
    """Each signal of the plan at its moment; for one sent ``after="taken"``, first wait
    (bounded) for the server's record of the signal before it."""
    assert server.process is not None
    offsets: list[int] = []
    for i, step in enumerate(plan.signals):
        if step.after == "taken" and i > 0:
            line = taken_line(plan.signals[i - 1].name, first=i == 1)
            rec.taken_at[i - 1] = await _wait_logged(log_path, offsets[i - 1], line)
        if step.delay_s:
            await trio.sleep(step.delay_s)
        offsets.append(log_size(log_path))
        server.process.send_signal(getattr(signal, step.name))
        rec.sent_at.append(now())
        rec.taken_at.append(None)


async def _wait_logged(log_path: Path, offset: int, line: str) -> float | None:
    """When ``line`` appeared in the log after ``offset`` (polled every 2 ms, from
    outside: the soak only sees what an operator would), None if not in time."""
    with trio.move_on_after(SIGNAL_TAKEN_WAIT_S):
        # Polled (ASYNC110): the server's log, from outside, has no event to wait on.
        while line not in read_log(log_path, offset):  # noqa: ASYNC110
            await trio.sleep(0.002)
        return now()
    return None


async def _wait_exit(server: ServerProcess, rec: RoundRecord, bound: float) -> None:
    """Wait ``bound`` seconds for the process to exit; kill it after that."""
    process = server.process
    assert process is not None
    with trio.move_on_after(bound):
        await process.wait()
    if process.poll() is None:
        rec.killed = True
        process.kill()
        await process.wait()
    rec.exited_at = now()
    rec.exit_status = process.returncode


def judge_round(plan: ShutdownPlan, rec: RoundRecord, log_text: str, timing: Timing) -> list[str]:
    """Every rule a round broke: the process, each client, the log."""
    problems = check_round_process(plan, rec, timing)
    if rec.error is not None:
        return problems
    for i, (start, tr) in enumerate(zip(plan.starts, rec.transcripts, strict=True)):
        stuck = stuck_at(start) is not None
        problems += [f"session {i}: {p}" for p in check_round_client(tr, rec, stuck=stuck)]
    records = parse_log(log_text)
    problems += signal_problems(plan, records)
    problems += stuck_problems(plan, rec.transcripts, records)
    for record in log_problems(records, expected_ids=set()):
        problems.append(f"server log: {record.level} {record.lines[0].split(': ', 1)[-1][:200]}")
    return problems


def round_summary(plan: ShutdownPlan, rec: RoundRecord, problems: list[str]) -> dict[str, Any]:
    """One round for the JSON report: the plan, what happened (times from the first
    signal, in seconds), each client's ending, and the problems."""
    first = rec.sent_at[0] if rec.sent_at else None

    def since_first(t: float | None) -> float | None:
        return None if t is None or first is None else round(t - first, 4)

    last = rec.sent_at[-1] if rec.sent_at else None
    return {
        **plan.to_json(),
        "startup_s": None if rec.startup_s is None else round(rec.startup_s, 2),
        "sent_s": [since_first(t) for t in rec.sent_at],
        "taken_s": [since_first(t) for t in rec.taken_at],
        "exit_status": rec.exit_status,
        "exit_s": None if rec.exited_at is None or last is None else round(rec.exited_at - last, 3),
        "killed": rec.killed,
        "clients": dict(Counter(round_ending(tr) for tr in rec.transcripts).most_common()),
        "problems": problems,
    }


async def run_rounds(
    settings: Settings, log_dir: Path, deadline: float
) -> tuple[list[dict[str, Any]], list[Violation]]:
    """The seed's shutdown rounds, one after another, each judged; none is started after
    the soak's ``deadline`` (Trio time), and those left out are a violation."""
    plans = make_shutdown_plans(settings.seed, settings.shutdown_rounds)
    summaries: list[dict[str, Any]] = []
    violations: list[Violation] = []
    for plan in plans:
        if trio.current_time() >= deadline:
            violations.append(
                Violation(
                    f"the soak's deadline ({settings.total_deadline_s:.0f} s) cut the shutdown "
                    f"rounds short: {len(summaries)} of {len(plans)} ran"
                )
            )
            break
        log_path = log_dir / f"round-{plan.index}.server.log"
        rec = await run_round(plan, settings.timing, log_path)
        log_text = read_log(log_path)
        problems = judge_round(plan, rec, log_text, settings.timing)
        summary = round_summary(plan, rec, problems)
        summaries.append(summary)
        progress(
            f"shutdown round {plan.index} {plan.label}: exit {summary['exit_status']} "
            f"{summary['exit_s']} s after the last signal, {len(problems)} problem(s)"
        )
        kind = f"shutdown round {plan.index} {plan.label}"
        details: dict[str, Any] = {"round": {k: v for k, v in summary.items() if k != "problems"}}
        details["server_log"] = log_text.splitlines()[-40:]
        violations += [Violation(problem, kind=kind, details=details) for problem in problems]
    return summaries, violations
