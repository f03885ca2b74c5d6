"""The fuzz run: the start and control phases, health checks, and shrinking what failed.

Start inputs go over a few concurrent connections; control inputs go in order into as
few sessions as they allow (`CONTROL_SESSION_INPUTS` at most each), each followed by a
ping, the sessions following an input video of each format in turn, or none
(``settings.CONTROL_INPUT_FORMATS``). A session
killed after a control message is blamed on the interactions queued but not yet
applied, each replayed alone; a frame's problem, on the frame.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import trio
from trio_websocket import (
    HandshakeError,
)

from bench._fuzz.client import (
    SessionRefused,
    connect,
    control_alone,
    end_session,
    exchange,
    open_session,
    request_id_of,
    run_start,
)
from bench._fuzz.oracle import (
    Problem,
    asks_input_video,
    judge_control,
    judge_start,
    shorten,
)
from bench._fuzz.serverlog import (
    log_causes,
    log_excerpt,
)
from bench._fuzz.settings import (
    CONTROL_INPUT_FORMATS,
    CONTROL_SESSION_INPUTS,
    HEALTH_EVERY,
    STUCK_AFTER,
    progress,
)
from bench._fuzz.shrinker import shrink
from bench._fuzz.wire import (
    FuzzInput,
    Wire,
    wire_size,
)
from bench._harness import log_size, read_log
from bench._server import Endpoint, ServerProcess, fetch_stats, http_get
from trio_vstream import protocol

LATE_REFUSALS: Final = "refused later"
"""`Run.frames`' count of refusals that came after their frame's pong (the decoder's)."""


@attrs.define
class Violation:
    """One input (or server event) that broke the oracle."""

    phase: str
    """``start``, ``control`` or ``server``."""
    problem: Problem
    index: int | None = None
    input: FuzzInput | None = None
    messages: Sequence[Wire] = attrs.field(factory=list)
    close_code: int | None = None
    request_id: str | None = None
    candidates: list[int] = attrs.field(factory=list)
    """Control inputs that may have caused a session failure (queued, not yet applied)."""
    cause: str | None = None
    """The exception the server logged for this session, if any: two bugs that both
    answer ``internal_error`` are two kinds of violation, each shrunk on its own."""
    input_format: str | None = None
    """For a control input: the input video its session followed (None: none), which a
    replay follows too."""

    @property
    def signature(self) -> str:
        cause = f"[{self.cause}]" if self.cause else ""
        return f"{self.phase}:{self.problem.key}{cause}"


@attrs.define
class Minimal:
    """A violation's smallest reproduction, replayed alone on the server."""

    input: FuzzInput | None
    tries: int
    messages: list[Wire]
    close_code: int | None
    request_id: str | None
    log: list[str]
    note: str = ""


@attrs.define
class Options:
    """One fuzz run as the command line chose it."""

    inputs: int
    seed: int
    time_limit: float
    shrink_time: float
    workers: int
    limits: protocol.Limits
    server_args: tuple[str, ...] = ()
    log_path: Path | None = None


@attrs.define
class Run:
    """The state of one fuzz run, shared by the phases."""

    options: Options
    server: ServerProcess
    url: str
    endpoint: Endpoint
    start_inputs: list[FuzzInput]
    control_inputs: list[FuzzInput]
    outcomes: dict[str, Counter[str]] = attrs.field(
        factory=lambda: {"start": Counter(), "control": Counter()}
    )
    kinds: Counter[str] = attrs.field(factory=Counter)
    done: Counter[str] = attrs.field(factory=Counter)
    violations: list[Violation] = attrs.field(factory=list)
    input_video_starts: Counter[str] = attrs.field(factory=Counter)
    """Outcomes of the starts that asked for an input video."""
    frames: Counter[str] = attrs.field(factory=Counter)
    """Outcomes of the frames sent into control sessions that follow an input video (by
    the pong of the ping behind each), and the refusals that came later."""
    health_checks: int = 0
    control_sessions: int = 0
    retries: int = 0
    crashed: bool = False
    abort_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    progress_every: int = 1

    def record(self, phase: str, item: FuzzInput, outcome: str) -> None:
        self.outcomes[phase][outcome] += 1
        self.kinds[f"{item.kind}:{outcome.split(':')[0]}"] += 1

    def violate(self, violation: Violation) -> None:
        self.violations.append(violation)
        if sum(1 for v in self.violations if v.signature == violation.signature) == 1:
            progress(f"violation {violation.signature}: {violation.problem.detail}")

    async def after_input(self, phase: str) -> None:
        """Count an input; every `HEALTH_EVERY` of them, check the server is healthy."""
        self.done[phase] += 1
        total = sum(self.done.values())
        if total % self.progress_every == 0:
            progress(f"{total} inputs done ({dict(self.done)}), {len(self.violations)} violations")
        if self.done[phase] % HEALTH_EVERY == 0:
            await self.check_health()

    async def check_health(self) -> bool:
        self.health_checks += 1
        process = self.server.process
        if process is not None and process.poll() is not None:
            self.crash(f"server exited with status {process.returncode}")
            return False
        status, body = await http_get(self.endpoint, "/health")
        if status != 200 or body.strip() != b"ok":
            if process is not None and process.poll() is not None:
                self.crash(f"server exited with status {process.returncode}")
            else:
                self.violate(
                    Violation(
                        "server", Problem("health-failed", f"{status}: {shorten(repr(body))}")
                    )
                )
            return False
        return True

    def crash(self, detail: str) -> None:
        if not self.crashed:
            self.crashed = True
            self.violate(Violation("server", Problem("server-crashed", detail)))
            self.abort_scope.cancel()


async def start_phase(run: Run) -> None:
    """Every start input on its own connection, a few at a time."""
    send, receive = trio.open_memory_channel[tuple[int, FuzzInput]](0)
    async with trio.open_nursery() as nursery:
        for _ in range(run.options.workers):
            nursery.start_soon(_start_worker, run, receive.clone())
        await receive.aclose()
        async with send:
            for index, item in enumerate(run.start_inputs):
                await send.send((index, item))


async def _start_worker(
    run: Run, receive: trio.MemoryReceiveChannel[tuple[int, FuzzInput]]
) -> None:
    limit = run.options.limits.max_start_bytes
    async with receive:
        async for index, item in receive:
            transcript = await run_start(run.url, item.wire)
            outcome, problems = judge_start(transcript, limit)
            run.record("start", item, outcome)
            if asks_input_video(item.wire):
                run.input_video_starts[outcome.split(":")[0]] += 1
            for problem in problems:
                run.violate(
                    Violation(
                        "start",
                        problem,
                        index,
                        item,
                        transcript.messages,
                        transcript.close_code,
                        request_id_of(transcript.messages),
                    )
                )
            if transcript.connect_error is not None:
                await run.check_health()
            await run.after_input("start")


async def control_phase(run: Run) -> None:
    """All control inputs in order, in as few sessions as the inputs allow, each of at
    most `CONTROL_SESSION_INPUTS`, following each input video in turn."""
    inputs = run.control_inputs
    limit = run.options.limits.max_control_bytes
    index = 0
    retried: set[int] = set()
    while index < len(inputs):
        try:
            async with connect(run.url) as ws:
                formats = CONTROL_INPUT_FORMATS
                session = await open_session(ws, formats[run.control_sessions % len(formats)])
                run.control_sessions += 1
                last = index + CONTROL_SESSION_INPUTS
                while index < min(last, len(inputs)) and session.alive:
                    item = inputs[index]
                    session.since_chunk.append(index)
                    result = await exchange(session, item.wire, index, item.kind)
                    outcome, problems = judge_control(result, limit, limits=run.options.limits)
                    if outcome == "completed" and index not in retried:
                        retried.add(index)  # the video ran out: try again in a new one
                        run.retries += 1
                        break
                    run.record("control", item, outcome)
                    if result.frame is not None:
                        run.frames[outcome] += 1
                    current = result.frame.number if result.frame is not None else None
                    late = [n for n, _ in result.frame_errors if n != current]
                    run.frames[LATE_REFUSALS] += len(late)
                    suspects = sorted({*session.pending.values(), index})
                    for problem in problems:
                        run.violate(
                            Violation(
                                "control",
                                problem,
                                index,
                                item,
                                result.messages,
                                result.close_code,
                                session.request_id,
                                suspects if not session.alive else [index],
                                input_format=session.input_format,
                            )
                        )
                    for blamed, problem in result.frame_problems:
                        run.violate(
                            Violation(
                                "control",
                                problem,
                                blamed,
                                inputs[blamed] if 0 <= blamed < len(inputs) else item,
                                result.messages,
                                result.close_code,
                                session.request_id,
                                [blamed],
                                input_format=session.input_format,
                            )
                        )
                    index += 1
                    await run.after_input("control")
                    if session.alive and session.stuck:
                        run.violate(
                            Violation(
                                "control",
                                Problem("session-stuck", f"no chunk for {STUCK_AFTER:.0f} s"),
                                index - 1,
                                item,
                                result.messages,
                                None,
                                session.request_id,
                                sorted({*session.pending.values(), *session.since_chunk}),
                                input_format=session.input_format,
                            )
                        )
                        break  # stop it and go on in a new session
                if session.alive:
                    outcome, problems, result = await end_session(session, limit)
                    for problem in problems:
                        run.violate(
                            Violation(
                                "control",
                                problem,
                                None,
                                FuzzInput("control.final-stop", protocol.STOP_MESSAGE),
                                result.messages,
                                result.close_code,
                                session.request_id,
                                input_format=session.input_format,
                            )
                        )
        except (SessionRefused, HandshakeError, OSError) as exc:
            run.violate(
                Violation(
                    "server", Problem("control-session-refused", f"{type(exc).__name__}: {exc}")
                )
            )
            if not await run.check_health():
                return
            index += 1  # do not loop on the same input


async def shrink_phase(run: Run, deadline: float) -> dict[str, Minimal]:
    """Shrink the first violation of each kind to a small input that still shows it."""
    limits = run.options.limits
    minimal: dict[str, Minimal] = {}
    firsts: dict[str, Violation] = {}
    for violation in run.violations:
        firsts.setdefault(violation.signature, violation)
    for signature, violation in firsts.items():
        if violation.phase == "server" or violation.input is None or run.crashed:
            continue
        now = trio.current_time()
        left = len(firsts) - len(minimal)
        if now >= deadline - 1:
            break
        budget = now + max(1.0, (deadline - now) / max(1, left))
        key, cause = violation.problem.key, violation.cause

        def same_cause(offset: int, request_id: str | None, cause: str | None = cause) -> bool:
            if cause is None:
                return True
            return log_causes(read_log(run.server.log_path, offset)).get(request_id or "") == cause

        fails: Callable[[Wire], Awaitable[bool]]
        if violation.phase == "start":

            async def fails_at_start(wire: Wire, key: str = key) -> bool:
                offset = log_size(run.server.log_path)
                transcript = await run_start(run.url, wire)
                _, problems = judge_start(transcript, limits.max_start_bytes)
                return any(p.key == key for p in problems) and same_cause(
                    offset, request_id_of(transcript.messages)
                )

            fails = fails_at_start
            wire = violation.input.wire
            kind = violation.input.kind
            note = ""
        else:
            # The input itself first, then the interactions queued before it, newest first.
            order = [
                violation.index,
                *sorted((c for c in violation.candidates if c != violation.index), reverse=True),
            ]
            suspects = {c: run.control_inputs[c] for c in order if c is not None}
            # A suspect is judged as what it is (a frame, input_video.end); what the
            # shrinker makes of it, as any message.
            kinds = {suspect.wire: suspect.kind for suspect in suspects.values()}
            fails = functools.partial(
                _fails_alone, run, key, same_cause, violation.input_format, kinds
            )
            culprit = None
            for number, suspect in suspects.items():
                if trio.current_time() >= budget:
                    break
                if await fails(suspect.wire):
                    culprit = number
                    break
            if culprit is None:
                minimal[signature] = Minimal(
                    None, 0, [], None, None, [], "not reproduced by any suspect alone"
                )
                continue
            wire, kind = suspects[culprit].wire, suspects[culprit].kind
            note = f"caused by control input #{culprit} ({kind})"
            if violation.input_format is not None and isinstance(wire, bytes):
                # A frame is judged by what it is: a smaller one is another frame.
                minimal[signature] = await _replay(
                    run, violation, suspects[culprit], 0, note + "; a frame: replayed, not shrunk"
                )
                continue
        progress(f"shrinking {signature} ({wire_size(wire)} bytes)")
        small, tries = await shrink(wire, fails, deadline=budget)
        minimal[signature] = await _replay(run, violation, FuzzInput(kind, small), tries, note)
    return minimal


async def _fails_alone(
    run: Run,
    key: str,
    same_cause: Callable[[int, str | None], bool],
    input_format: str | None,
    kinds: Mapping[Wire, str],
    wire: Wire,
) -> bool:
    """Whether a control input alone (in a session following ``input_format``) still
    shows the problem ``key`` (of the same logged cause)."""
    offset = log_size(run.server.log_path)
    problems, _, _, request_id = await control_alone(
        run.url,
        wire,
        run.options.limits.max_control_bytes,
        kind=kinds.get(wire, ""),
        input_format=input_format,
        limits=run.options.limits,
    )
    return any(p.key == key for p in problems) and same_cause(offset, request_id)


async def _replay(
    run: Run, violation: Violation, item: FuzzInput, tries: int, note: str
) -> Minimal:
    """Run the minimal input once more, for the report: its messages and the server log."""
    if violation.phase == "start":
        transcript = await run_start(run.url, item.wire)
        messages, close_code = transcript.messages, transcript.close_code
        request_id = request_id_of(messages)
    else:
        _, messages, close_code, request_id = await control_alone(
            run.url,
            item.wire,
            run.options.limits.max_control_bytes,
            kind=item.kind,
            input_format=violation.input_format,
            limits=run.options.limits,
        )
    log = log_excerpt(read_log(run.server.log_path), request_id) if request_id else []
    return Minimal(item, tries, messages, close_code, request_id, log, note)


async def check_released(run: Run, timeout: float = 10.0) -> None:
    """After the run: no session, engine stream or worker thread may be left."""
    keys = ("sessions_active", "streams_open", "worker_threads")
    metrics: dict[str, Any] | None = None
    with trio.move_on_after(timeout):
        while True:
            metrics = await fetch_stats(run.endpoint)
            if metrics is None or all(metrics.get(key, 0) == 0 for key in keys):
                return
            await trio.sleep(0.05)
    left = {key: metrics.get(key) for key in keys} if metrics else {}
    run.violate(
        Violation(
            "server", Problem("resources-not-released", f"{timeout:.0f} s after the run: {left}")
        )
    )
