"""The checks on a soak server's ``GET /health``: its answers while sessions run (a stuck
call said, never a wedge), and the batched part's wedge rounds (wedged, refusing, released,
recovered). Pure functions on what the soak saw from outside, unit-tested with made-up
answers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

import attrs

from bench._soak.plans import Plan
from bench._soak.settings import Timing
from bench._soak.transcript import Transcript


@attrs.frozen
class HealthSample:
    """One ``GET /health`` during the run: when it went, when the answer came, the answer
    (its body stripped)."""

    sent_at: float
    received_at: float
    status: int | None
    body: str

    @property
    def ok(self) -> bool:
        """``200 ok``: no engine call stuck."""
        return self.status == 200 and self.body == "ok"

    @property
    def degraded(self) -> bool:
        """``200 degraded: N engine call(s) stuck ...``: some, fewer than the wedge bound."""
        return self.status == 200 and self.body.startswith("degraded")

    @property
    def unavailable(self) -> bool:
        """``503 engine_unavailable: ...``: the engine is wedged."""
        return self.status == 503 and self.body.startswith("engine_unavailable")

    @property
    def stuck_calls(self) -> int | None:
        """The N of a ``degraded`` answer (None for any other)."""
        match = DEGRADED.match(self.body) if self.degraded else None
        return int(match[1]) if match else None

    def __str__(self) -> str:
        return f"{self.status} {self.body[:200]}"


DEGRADED: Final = re.compile(r"degraded: (\d+) engine call")
"""``/health``'s answer while engine calls are stuck below the wedge bound (server.py)."""


def check_health(
    plan: Plan, tr: Transcript, record: dict[str, Any] | None, samples: Sequence[HealthSample]
) -> list[str]:
    """An ``abandoned`` ``engine_stuck`` session: from its end (its call left running in
    its thread) until the earliest its block can end (the block began after the client
    connected), ``/health`` must not answer ``200 ok``: the server knows a call is stuck
    and must say ``200 degraded`` (a 503 is `wedge_problems`'). Only answers wholly
    inside that window are judged."""
    if plan.kind != "engine_stuck" or plan.params.get("variant") != "abandoned":
        return []
    ended = record.get("ended_at") if record is not None else None
    if not isinstance(ended, int | float) or tr.connected_at is None:
        return []
    until = tr.connected_at + plan.params["block_s"]
    ok = [s for s in samples if s.ok and ended < s.sent_at and s.received_at < until]
    if not ok:
        return []
    return [
        f"GET /health answered 200 ok {ok[0].sent_at - ended:.2f} s after the session ended "
        f"with its engine call still blocked (for {until - ended:.2f} s more at least): "
        f"expected 200 degraded"
    ]


def wedge_problems(samples: Sequence[HealthSample], bound: int) -> list[str]:
    """The soak's own server is never to be wedged: its ``--max-stuck-calls`` is above
    what its mix leaves stuck (`settings.stuck_calls_bound`). A ``/health`` 503 while
    its sessions ran says the server counted more stuck calls than the mix can leave
    (a call it never let go of), or that the mix outgrew its bound; so does a
    ``degraded`` count at the bound. One problem for the first such answer."""
    for sample in samples:
        if sample.status == 503:
            return [
                f"GET /health answered {sample}: the engine counted as wedged, although "
                f"--max-stuck-calls ({bound}) is above what the mix leaves stuck"
            ]
        stuck = sample.stuck_calls
        if stuck is not None and stuck >= bound:
            return [f"GET /health answered {sample}: at the wedge bound {bound}"]
    return []


def peak_stuck_calls(samples: Sequence[HealthSample]) -> int:
    """The most engine calls ``/health`` said were stuck at once (0: it never said)."""
    return max((s.stuck_calls or 0 for s in samples), default=0)


@attrs.define
class WedgeRecord:
    """What one wedge round saw from outside, judged afterwards (`check_wedge_round`).

    Its held sessions' transcripts are judged with the batched part's other sessions
    (kind ``held``: ``stall_timeout`` on time, then close 1000); this is the server's side
    of the round: wedged, refusing, released, recovered."""

    index: int
    token: str
    held: list[int] = attrs.Factory(list)
    """The plan numbers of its held sessions."""
    after: list[int] = attrs.Factory(list)
    """The plan numbers of the sessions after its release."""
    clients_done_at: float | None = None
    """When both held clients' part had ended (their stall error and close)."""
    health: list[HealthSample] = attrs.Factory(list)
    """Every ``/health`` answer of the round, from the clients' end on, in order."""
    wedged: HealthSample | None = None
    """The first 503 (None: none came within ``Timing.wedge_bound``)."""
    upgrade: tuple[int | None, str] | None = None
    """A new WebSocket upgrade while wedged: its HTTP status (101: accepted) and body."""
    released_at: float | None = None
    """When the soak created the token's file."""
    recovered: HealthSample | None = None
    """The first ``200 ok`` after the release (None: none within ``Timing.recover_bound``)."""


BATCH_STUCK: Final = "batched step is stuck"
"""What the server's 503 says when its batcher is stuck (server/health.py's
``EngineHealth.unavailable_message``), as opposed to too many stuck calls."""


def check_wedge_round(rec: WedgeRecord, timing: Timing) -> list[str]:
    """A wedge round: once its held clients were done, ``/health`` answered 503
    ``engine_unavailable`` naming the stuck batched step within ``Timing.wedge_bound``;
    a new upgrade then got HTTP 503 ``engine_unavailable``; every answer until the
    release stayed 503; after the release, ``200 ok`` within ``Timing.recover_bound``."""
    problems: list[str] = []
    if rec.clients_done_at is None:
        return ["the held sessions' clients did not end (the soak's deadline?)"]
    answers = ", ".join(dict.fromkeys(str(s) for s in rec.health)) or "none"
    wedged = rec.wedged
    if wedged is None:
        problems.append(
            f"GET /health did not answer 503 within {timing.wedge_bound:.1f} s of the held "
            f"sessions' end (answers: {answers[:300]})"
        )
    else:
        after = wedged.sent_at - rec.clients_done_at
        if after > timing.wedge_bound:
            problems.append(
                f"GET /health answered 503 {after:.2f} s after the held sessions' end, "
                f"expected within {timing.wedge_bound:.1f} s"
            )
        if not wedged.unavailable or BATCH_STUCK not in wedged.body:
            problems.append(
                f"GET /health answered {wedged} while wedged, expected 503 "
                f"engine_unavailable naming the stuck batched step"
            )
        if rec.upgrade is None:
            problems.append("no WebSocket upgrade was tried while wedged")
        else:
            status, body = rec.upgrade
            if status != 503 or not body.startswith("engine_unavailable"):
                problems.append(
                    f"a new WebSocket upgrade while wedged got HTTP {status} {body[:200]!r}, "
                    f"expected 503 engine_unavailable before the upgrade"
                )
        released = rec.released_at if rec.released_at is not None else float("inf")
        early = [s for s in rec.health if wedged.sent_at < s.sent_at and s.received_at < released]
        ended = [s for s in early if s.status != 503]
        if ended:
            problems.append(
                f"GET /health answered {ended[0]} {ended[0].sent_at - wedged.sent_at:.2f} s "
                f"after the wedge, before the release: the held batch still ran"
            )
    if rec.released_at is None:
        problems.append("the hold was never released")
    elif rec.recovered is None:
        last = rec.health[-1] if rec.health else None
        problems.append(
            f"GET /health did not answer 200 ok within {timing.recover_bound:.1f} s of the "
            f"release (last: {last})"
        )
    elif rec.recovered.sent_at - rec.released_at > timing.recover_bound:
        problems.append(
            f"GET /health answered 200 ok {rec.recovered.sent_at - rec.released_at:.2f} s after "
            f"the release, expected within {timing.recover_bound:.1f} s"
        )
    return problems
