"""The soak's checks on the server's log: no ERROR record or traceback other than the
injected engine failures', a summary of the warnings, and in a shutdown round, the
server's own word that it took each signal.

The log is parsed into records by ``bench._harness.parse_log`` (shared with the fuzz);
what counts as trouble is the soak's own call, so it lives here.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Final

from bench._harness import REQUEST_ID, LogRecord
from bench._soak.plans import ShutdownPlan, stuck_at
from bench._soak.transcript import (
    Transcript,
)

AT_EXIT_TROUBLE: Final = ("Fatal Python error", "Exception ignored in")
"""What Python prints, outside logging, when something fails as the process ends (a
thread or a finaliser): as serious as a traceback."""


def log_problems(
    records: Sequence[LogRecord], expected_ids: set[str], expected: Sequence[str] = ()
) -> list[LogRecord]:
    """ERROR records, tracebacks and Python's complaints at exit, except those of
    sessions whose failure was injected (``expected_ids``: their request ids), and ERROR
    records whose message has one of the ``expected`` fragments (with no traceback: a
    wedge round's, `WEDGE_ERRORS`, counted by `wedge_log_problems`)."""
    bad: list[LogRecord] = []
    for record in records:
        trouble = any(
            line.startswith("Traceback (most recent call last)") or line.startswith(AT_EXIT_TROUBLE)
            for line in record.lines
        )
        if not trouble:
            provoked = record.level == "ERROR" and any(f in record.lines[0] for f in expected)
            if provoked or record.level not in ("ERROR", "CRITICAL"):
                continue
        ids = set(REQUEST_ID.findall(record.text))
        if ids and ids <= expected_ids:
            continue
        bad.append(record)
    return bad


def log_summary(records: Sequence[LogRecord]) -> dict[str, int]:
    """WARNING and ERROR records by message, with ids and numbers blanked: what kinds of
    trouble the server reported, and how often."""
    counts: Counter[str] = Counter()
    for record in records:
        if record.level in ("WARNING", "ERROR", "CRITICAL"):
            message = record.lines[0].split(": ", 1)[-1]
            message = REQUEST_ID.sub("<id>", message)
            message = re.sub(r"\d+(\.\d+)?", "N", message)
            counts[f"{record.level} {message}"] += 1
    return dict(counts.most_common())


def log_excerpt(
    records: Sequence[LogRecord], tr: Transcript, request_id: str | None, limit: int = 20
) -> list[str]:
    """The server's lines about one session: by request id, else by time."""
    if request_id is not None:
        chosen = [r for r in records if request_id in r.text]
    else:
        start = tr.wall0 - 0.05
        end = tr.wall0 + ((tr.ended_at or tr.t0) - tr.t0) + 0.5
        chosen = [r for r in records if r.wall is not None and start <= r.wall <= end]
    lines = [line for record in chosen for line in record.lines[:40]]
    return lines[:limit] if len(lines) <= limit else [*lines[: limit - 1], "..."]


SIGNAL_TAKEN: Final = re.compile(r"\b(SIG[A-Z]+)(: shutting down gracefully| again: stopping now)$")
"""cli/serve.py's records of a signal: the first drains, any later one stops at once."""


def taken_line(name: str, first: bool) -> str:
    """What the server logs when it takes signal ``name`` (the first, or a later one)."""
    return f"{name}: shutting down gracefully" if first else f"{name} again: stopping now"


def signal_problems(plan: ShutdownPlan, records: Sequence[LogRecord]) -> list[str]:
    """The server's log must show each signal the round sent, taken: the first as a
    drain, the others as "stopping now"; in the order sent, except for signals sent
    back to back (``after="sent"``), which the kernel delivers lowest number first."""
    taken: list[str] = []
    drains = 0
    for record in records:
        match = SIGNAL_TAKEN.search(record.lines[0])
        if match:
            drains += match[2].startswith(":")
            taken.append(match[1] + ("" if match[2].startswith(":") else " again"))
    sent = [step.name for step in plan.signals]
    names = [name.removesuffix(" again") for name in taken]
    problems: list[str] = []
    shown = ", ".join(taken) or "none"
    if drains != 1 or (taken and taken[0].endswith(" again")):
        problems.append(f"the server's log shows {drains} drain(s) begun (signals taken: {shown})")
    if any(step.after == "sent" for step in plan.signals):
        if sorted(names) != sorted(sent):
            problems.append(f"sent {', '.join(sent)}; the server's log shows taken: {shown}")
    elif names != sent:
        problems.append(
            f"sent {', '.join(sent)} in this order; the server's log shows taken: {shown}"
        )
    return problems


LEFT_RUNNING: Final = "still running as the session ends; left to finish in its thread"
"""What the server logs (a warning) when a session ends without an engine call it left."""


def stuck_problems(
    plan: ShutdownPlan, transcripts: Sequence[Transcript], records: Sequence[LogRecord]
) -> list[str]:
    """An ``engine_stuck`` round: each stuck session's engine call must still have been
    blocked when its session ended, as the server's log says (`LEFT_RUNNING`), or the
    process did not exit with a stuck thread and the round proved nothing."""
    problems: list[str] = []
    for i, (start, tr) in enumerate(zip(plan.starts, transcripts, strict=True)):
        if stuck_at(start) is None:
            continue
        request_id = tr.request_id()
        if request_id is None:
            problems.append(f"session {i} (stuck): no video.start, so no request id to follow")
        elif not any(request_id in r.text and LEFT_RUNNING in r.text for r in records):
            problems.append(
                f"session {i} (stuck): the server's log does not show its blocked engine call "
                "left running as the session ended: the process did not exit with a stuck "
                "thread"
            )
    return problems


WEDGE_ERRORS: Final = (
    "hangs: its session was abandoned; rows fail at once until it returns",
    "engine wedged: ",
)
"""The ERROR records a wedge round makes the batched server log, once each: its batcher
giving up on the held batch (trio_vstream.scheduling.batcher), then the server counting
as wedged."""


def wedge_log_problems(records: Sequence[LogRecord], wedges: int) -> list[str]:
    """The batched server's log: each of `WEDGE_ERRORS` as an ERROR record exactly once per
    wedge round that wedged it (``wedges``): the server said so, once, each time. Any
    other ERROR is `log_problems`'."""
    problems: list[str] = []
    for fragment in WEDGE_ERRORS:
        found = [r for r in records if r.level == "ERROR" and fragment in r.lines[0]]
        if len(found) != wedges:
            problems.append(
                f"server log: {len(found)} ERROR record(s) with {fragment.strip()!r}, "
                f"expected {wedges} (one per wedge)"
            )
    return problems
