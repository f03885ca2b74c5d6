"""The checks on a soak server's end: the SIGTERM that ends the soak's own servers (a
drain with nothing left to wait for), and the shutdown rounds, whose servers are stopped
with a signal and then another while sessions stream (``shutdown`` runs them). Pure
functions on what the soak saw from outside, unit-tested with made-up records.
"""

from __future__ import annotations

from typing import Final

import attrs

from bench._soak.plans import ShutdownPlan
from bench._soak.settings import (
    CLOSE_AFTER_EXIT_S,
    SIGNAL_TAKEN_WAIT_S,
    STREAMING_WAIT_S,
    Timing,
)
from bench._soak.transcript import Transcript, describe, read_messages


def sigterm_problems(status: int | None, exit_s: float, grace: float) -> list[str]:
    """A soak server's end: SIGTERM must end it with status 0 within its
    ``--shutdown-grace`` (its sessions are over by then, so the drain has nothing to wait
    for). ``status`` None: the process had to be killed."""
    if status != 0:
        return [f"after SIGTERM the server exited with status {status}"]
    if exit_s > grace:
        return [
            f"the server took {exit_s:.1f} s to exit after SIGTERM, more than its "
            f"--shutdown-grace of {grace:.0f} s"
        ]
    return []


@attrs.define
class RoundRecord:
    """What one shutdown round saw from outside: its clients' transcripts, when each
    signal went and when the server logged it, and how the process ended. Judged
    afterwards, like a transcript, so that each rule can be shown to fail."""

    transcripts: list[Transcript] = attrs.Factory(list)
    startup_s: float | None = None
    streaming_at: float | None = None
    """When every session had had a media chunk (None: not all within the wait)."""
    sent_at: list[float] = attrs.Factory(list)
    """When each signal was sent."""
    taken_at: list[float | None] = attrs.Factory(list)
    """When the soak saw the server log each signal: only for a signal a later one waits
    for (``after="taken"``), None otherwise or when it was not seen in time."""
    exited_at: float | None = None
    exit_status: int | None = None
    killed: bool = False
    """The server was still running at its bound, and was killed."""
    error: str | None = None
    """Why the round could not run at all (its server did not start)."""


ROUND_ENDINGS: Final = frozenset({"error:server_shutdown"})
"""The only terminal message a session may get in a shutdown round: its videos outlast
the round, so nothing else can end it before the server goes (a ``generation_failed``
is a stop reported as an engine failure, issue 20 item 12)."""
STUCK_ENDINGS: Final = ROUND_ENDINGS | {"error:stall_timeout"}
"""A stuck session (``engine_stuck`` rounds) may also end by its stall timeout: in a
drain it goes on as usual until then, and its call is left to its thread."""


def exit_bound(plan: ShutdownPlan, timing: Timing) -> float:
    """Seconds from a round's last signal to its server's exit."""
    return timing.stop_bound if len(plan.signals) > 1 else timing.drain_bound


def check_round_process(plan: ShutdownPlan, rec: RoundRecord, timing: Timing) -> list[str]:
    """The round as a whole: it ran, the sessions streamed, the server took each signal
    that another waited for, and exited with status 0 within ``exit_bound`` of the last.

    Status 0: cli/serve.py's second signal cancels the server's run, which then returns as
    after a drain (docs/server.md, Draining: "The exit status is 0. A second signal stops at
    once."); a process killed by the signal's default action would show -15, an
    interrupt's traceback 1."""
    if rec.error is not None:
        return [rec.error]
    problems: list[str] = []
    if rec.streaming_at is None:
        problems.append(
            f"not every session had a media chunk (or, if stuck, was blocked) within "
            f"{STREAMING_WAIT_S:.0f} s; the signals went anyway"
        )
    for i, step in enumerate(plan.signals[1:], start=1):
        taken = rec.taken_at[i - 1] if i - 1 < len(rec.taken_at) else None
        if step.after == "taken" and taken is None:
            problems.append(
                f"the server did not log signal {i} ({plan.signals[i - 1].name}) within "
                f"{SIGNAL_TAKEN_WAIT_S:.0f} s"
            )
    if len(rec.sent_at) < len(plan.signals):
        problems.append(f"only {len(rec.sent_at)} of {len(plan.signals)} signals were sent")
        return problems
    bound = exit_bound(plan, timing)
    what = "the second signal" if len(plan.signals) > 1 else "the signal"
    if rec.killed:
        problems.append(f"the server did not exit within {bound:.1f} s of {what}: killed")
    elif rec.exited_at is None or rec.exit_status is None:
        problems.append(f"the server's exit after {what} was not seen")
    else:
        exit_s = rec.exited_at - rec.sent_at[-1]
        if rec.exit_status != 0:
            problems.append(f"after {what} the server exited with status {rec.exit_status}")
        if exit_s > bound:
            problems.append(
                f"the server took {exit_s:.1f} s to exit after {what}, more than {bound:.1f} s"
            )
    return problems


def round_ending(tr: Transcript) -> str:
    """A round's session in a word: its terminal message (if any) and how it closed."""
    messages = read_messages(tr).messages
    last = messages[-1][1] if messages else {}
    terminal = ""
    if last.get("type") == "error":
        terminal = f"error:{last.get('code')}, "
    elif last.get("type") == "session.done":
        terminal = "done, "
    closed = f"close {tr.close_code}" if tr.closed_at is not None else "still open"
    return terminal + closed


def check_round_client(tr: Transcript, rec: RoundRecord, *, stuck: bool = False) -> list[str]:
    """One session of a shutdown round: well-formed messages from ``video.start`` on; at
    most one terminal message, last, and only ``server_shutdown``; then a close 1000,
    or the connection cut (1006: the process went); never before the first signal, and
    no later than ``CLOSE_AFTER_EXIT_S`` after the server's exit. A ``stuck`` session (its
    engine blocked) may also end with ``stall_timeout``, and then at any time."""
    endings = STUCK_ENDINGS if stuck else ROUND_ENDINGS
    received = read_messages(tr)
    problems = list(received.problems)
    messages = received.messages
    if tr.client_error is not None:
        problems.append(f"client: {tr.client_error}")
    if not messages or messages[0][1].get("type") != "video.start":
        first = describe(messages[0][1]) if messages else "no message"
        problems.append(f"first message {first}, expected video.start")
    ends = [i for i, (_, m) in enumerate(messages) if m.get("type") in ("session.done", "error")]
    terminal: str | None = None
    if ends:
        message = messages[ends[0]][1]
        if ends[0] != len(messages) - 1:
            after = ", ".join(describe(m) for _, m in messages[ends[0] + 1 :])
            problems.append(f"messages after the terminal message {describe(message)}: {after}")
        terminal = (
            "done" if message.get("type") == "session.done" else f"error:{message.get('code')}"
        )
        if terminal not in endings:
            also = ", stall_timeout (its engine is stuck)" if stuck else ""
            problems.append(
                f"the session ended with {describe(message)}: in a shutdown it ends with "
                f"server_shutdown{also} or its connection closes"
            )
    if tr.connected_at is None:
        return problems  # nothing to close (the client error says why)
    if tr.closed_at is None:
        if rec.exited_at is not None:
            problems.append(
                f"the connection was still open {CLOSE_AFTER_EXIT_S:.0f} s after the server exited"
            )
        else:
            problems.append("the connection never closed")
        return problems
    stalled = stuck and terminal == "error:stall_timeout"
    if rec.sent_at and tr.closed_at < rec.sent_at[0] and not stalled:
        problems.append(f"the connection closed (code {tr.close_code}) before the first signal")
    if tr.close_code == 1000 and terminal is None:
        problems.append("close 1000 without a terminal message")
    elif tr.close_code not in (1000, 1006):
        problems.append(
            f"close code {tr.close_code} ({tr.close_reason or 'no reason'}), expected 1000 "
            "after a terminal message, or 1006 (the server's process went)"
        )
    return problems
