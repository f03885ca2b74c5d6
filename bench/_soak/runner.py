"""The soak run: sessions against one server, admission slots, abandoned connections,
/stats polling, and waiting for the server to settle.

A connection counts against ``--max-sessions`` until the server has closed its socket,
which for a connection the client abandoned is seen only in /proc; the runner holds the
slot that long, so that a ``server_busy`` is always the server's mistake.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import trio
from trio_websocket import (
    ConnectionRejected,
    HandshakeError,
    wrap_client_stream,
)

from bench._client import CLIENT_MAX_MESSAGE as BENCH_CLIENT_MAX_MESSAGE
from bench._client import RECEIVE_BUFFER
from bench._output import now, progress
from bench._server import Endpoint, ServerProcess, fetch_stats, http_get
from bench._soak.checks import (
    Verdict,
    check_transcript,
)
from bench._soak.client import (
    DRIVERS,
    Abandon,
    Conn,
    describe_error,
    refusal_message,
    rejected_upgrade,
)
from bench._soak.health_checks import HealthSample
from bench._soak.plans import (
    Plan,
)
from bench._soak.resources import (
    TRIO_IDLE_TIMEOUT_S,
    Snapshot,
    SocketWatch,
    idle_problems,
    resource_problems,
    server_side_inode,
)
from bench._soak.settings import (
    CLIENT_RCVBUF_STOPPED,
    CLOSE_HANDSHAKE_WAIT_S,
    EOF_WAIT_S,
    METRICS_PERIOD_S,
    PROGRESS_PERIOD_S,
    SETTLE_EXTRA_S,
    Settings,
)
from bench._soak.transcript import Transcript
from trio_vstream.server.running import IDLE_BEFORE_TRIM


@attrs.define
class SessionResult:
    """One session's plan and transcript, judged at the end (with the server's record)."""

    plan: Plan
    tr: Transcript
    verdict: Verdict | None = None
    request_id: str | None = None


class Soak:
    """Runs the plans against one server and collects what the checks need."""

    def __init__(
        self,
        settings: Settings,
        server: ServerProcess,
        endpoint: Endpoint,
    ) -> None:
        self.s = settings
        self.server = server
        self.endpoint = endpoint
        assert server.pid is not None
        self.pid: int = server.pid
        self.watch = SocketWatch(self.pid)
        self.slots = trio.Semaphore(settings.concurrency)
        self.results: list[SessionResult] = []
        self.records: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.by_id: dict[str, dict[str, Any]] = {}
        self.metrics_failures = 0
        self.health: list[HealthSample] = []
        """Every ``GET /health`` answer, polled with /stats (see ``health_checks.check_health``)."""
        self.settled_health: HealthSample | None = None
        """The last answer while settling: 200 ok once no engine call is stuck."""
        self.metrics_lock = trio.Lock()
        """Held while a /stats connection is open: a snapshot of the server's open file
        descriptors must not count it."""
        self.running = 0
        self.lingering = 0
        self.releases: list[tuple[float, int, str, str]] = []
        self.done = 0
        self.phase = "starting"

    # ------------------------------------------------------------------ metrics

    async def poll_metrics(self) -> None:
        """Collect ``recent_sessions`` before the server's ring of 256 forgets them, and
        ask ``/health`` each time (degraded while an engine call is stuck)."""
        while True:
            async with self.metrics_lock:
                await self._fetch_stats()
                await self._fetch_health()
            await trio.sleep(METRICS_PERIOD_S)

    async def fetch_health(self) -> HealthSample:
        """``GET /health`` now (recorded with the others)."""
        async with self.metrics_lock:
            return await self._fetch_health()

    async def _fetch_health(self) -> HealthSample:
        sent_at = now()
        status, body = await http_get(self.endpoint, "/health")
        sample = HealthSample(sent_at, now(), status, body.decode(errors="replace").strip())
        self.health.append(sample)
        return sample

    async def fetch_stats(self) -> dict[str, Any] | None:
        async with self.metrics_lock:
            return await self._fetch_stats()

    async def _fetch_stats(self) -> dict[str, Any] | None:
        metrics = await fetch_stats(self.endpoint)
        if metrics is None:
            self.metrics_failures += 1
            return None
        for record in metrics.get("recent_sessions") or []:
            key = (record.get("request_id"), record.get("started_at"), record.get("ended_at"))
            self.records[key] = record
            if isinstance(record.get("request_id"), str):
                self.by_id[record["request_id"]] = record
        return metrics

    def record_of(self, request_id: str) -> dict[str, Any] | None:
        return self.by_id.get(request_id)

    async def report_progress(self) -> None:
        while True:
            await trio.sleep(PROGRESS_PERIOD_S)
            problems = sum(1 for r in self.results if r.verdict and r.verdict.problems)
            progress(
                f"{self.phase}: {self.done} sessions done, {self.running} running, "
                f"{self.lingering} abandoned not yet released, {problems} with problems"
            )

    # ----------------------------------------------------------------- sessions

    async def run_phase(self, plans: Sequence[Plan], name: str, deadline: float) -> bool:
        """Run ``plans`` with ``concurrency`` workers; False if the deadline cut it short."""
        self.phase = name
        queue: Iterator[Plan] = iter(plans)
        with trio.move_on_at(deadline) as scope:
            async with trio.open_nursery() as lingering, trio.open_nursery() as workers:
                for _ in range(self.s.concurrency):
                    workers.start_soon(self._worker, queue, lingering)
        return not scope.cancelled_caught

    async def _worker(self, queue: Iterator[Plan], lingering: trio.Nursery) -> None:
        for plan in queue:
            await self.slots.acquire()
            await self._session(plan, lingering)

    async def _session(self, plan: Plan, lingering: trio.Nursery) -> None:
        """One session, from connect to the end of the client's part. The admission slot
        is released once the server has closed the connection: here for sessions that
        ended with an end-of-stream from the server, in a lingering task otherwise."""
        tr = Transcript(t0=now(), wall0=time.time())
        tr.slots_held = self.s.concurrency - self.slots.value
        result = SessionResult(plan, tr)
        self.results.append(result)
        self.running += 1
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stream: trio.SocketStream | None = None
        abandon: Abandon | None = None
        handed_over = False
        try:
            if plan.kind == "stopped_reader":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF_STOPPED)
            with trio.move_on_after(self.s.timing.session_timeout()) as watchdog:
                await sock.connect((self.endpoint.host, self.endpoint.port))
                stream = trio.SocketStream(sock)
                abandon = await self._converse(plan, tr, stream)
            if watchdog.cancelled_caught:
                tr.timed_out = True
                abandon = Abandon("watchdog")
            if abandon is not None and stream is not None:
                await self._abandon(tr, stream, abandon)
                lingering.start_soon(self._linger, result, stream, abandon.how)
                handed_over = True
            elif tr.eof is False and stream is not None:
                lingering.start_soon(self._linger, result, stream, "eof")
                handed_over = True
        except Exception as exc:  # a refused upgrade, a soak bug, a transport surprise
            tr.client_error = describe_error(exc)
            tr.upgrade_refusal = refusal_message(exc)
        except BaseException as exc:
            # The watchdog catches its own cancellation: this is the soak's deadline.
            tr.cut_by_deadline = _is_cancellation(exc)
            raise
        finally:
            tr.ended_at = now()
            result.request_id = tr.request_id()
            # Judged again at the end, with the server's records; this is for progress.
            result.verdict = check_transcript(plan, tr, self.s.timing)
            self.running -= 1
            self.done += 1
            if not handed_over:
                with trio.CancelScope(shield=True):
                    if stream is not None:
                        await stream.aclose()
                    else:
                        sock.close()
                self._release(result, "client saw the server close")

    async def _converse(
        self, plan: Plan, tr: Transcript, stream: trio.SocketStream
    ) -> Abandon | None:
        client_port = stream.socket.getsockname()[1]
        abandon: Abandon | None = None
        async with trio.open_nursery() as nursery:
            try:
                ws = await wrap_client_stream(
                    nursery,
                    stream,
                    self.endpoint.host_header,
                    self.endpoint.resource,
                    max_message_size=BENCH_CLIENT_MAX_MESSAGE,
                    receive_buffer_size=RECEIVE_BUFFER,
                )
            except (ConnectionRejected, HandshakeError) as exc:
                tr.client_error = f"WebSocket handshake failed: {type(exc).__name__}: {exc}"
                tr.upgrade_refusal = refusal_message(exc)
                nursery.cancel_scope.cancel()
                return None
            tr.connected_at = now()
            tr.server_inode = server_side_inode(self.endpoint.port, client_port)
            conn = Conn(ws, tr)
            if plan.kind == "slow_reader":
                conn.read_delays = list(plan.params["read_delays"])
            nursery.start_soon(conn.read_loop)
            abandon = await DRIVERS[plan.kind](conn, plan, self.s.timing)
            if abandon is None:
                # Until the server's close, then (bounded) until its TCP close, which
                # trio-websocket's reader sees as end-of-stream.
                await conn.closed.wait()
                nursery.cancel_scope.deadline = trio.current_time() + EOF_WAIT_S
            elif abandon.how == "close":
                tr.abandoned, tr.abandoned_at = "close", now()
                with trio.move_on_after(CLOSE_HANDSHAKE_WAIT_S) as waited:
                    await ws.aclose()
                tr.close_answered = not waited.cancelled_caught
                nursery.cancel_scope.cancel()
            else:
                nursery.cancel_scope.cancel()  # trio-websocket stops reading the socket
        if abandon is None:
            tr.eof = not nursery.cancel_scope.cancelled_caught
        return abandon

    async def try_upgrade(self) -> tuple[int | None, str]:
        """A WebSocket upgrade and nothing more: ``(101, "accepted")`` (then closed at
        once), or the refusal's HTTP status and body, or ``(None, why)``."""
        try:
            with trio.fail_after(self.s.timing.reply_wait):
                stream = await trio.open_tcp_stream(self.endpoint.host, self.endpoint.port)
                try:
                    async with trio.open_nursery() as nursery:
                        ws = await wrap_client_stream(
                            nursery, stream, self.endpoint.host_header, self.endpoint.resource
                        )
                        await ws.aclose()
                finally:
                    await stream.aclose()
        except trio.TooSlowError:
            return None, f"no answer within {self.s.timing.reply_wait:.1f} s"
        except Exception as exc:
            rejected = rejected_upgrade(exc)
            if rejected is None:
                return None, describe_error(exc)
            body = (rejected.body or b"").decode(errors="replace").strip()
            return rejected.status_code, body
        return 101, "accepted"

    async def _abandon(self, tr: Transcript, stream: trio.SocketStream, abandon: Abandon) -> None:
        if tr.abandoned is None:
            tr.abandoned, tr.abandoned_at = abandon.how, now()
        if abandon.how in ("rst", "watchdog"):
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await stream.aclose()
        elif abandon.how == "fin":
            # shutdown(SHUT_WR): end of stream without a close frame. A close() with unread
            # data would make the kernel send RST instead: that is the rst kind.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_eof()

    def _release(self, result: SessionResult, how: str) -> None:
        """Give the admission slot back, and remember when: a ``server_busy`` is reported
        with the releases just before it."""
        self.releases.append((now(), result.plan.index, result.plan.label, how))
        self.slots.release()

    def releases_before(self, t: float, window: float = 0.25) -> list[str]:
        return [
            f"-{t - at:.3f} s: session {index} {label}: {how}"
            for at, index, label, how in self.releases
            if t - window <= at <= t
        ]

    async def _linger(self, result: SessionResult, stream: trio.SocketStream, how: str) -> None:
        """Hold the admission slot until the server has closed its socket (bounded)."""
        tr = result.tr
        self.lingering += 1
        started = now()
        bound = self.s.timing.release_bound(how)
        try:
            with trio.move_on_after(bound) as waited:
                if how == "fin":
                    await _drain(stream)  # the server's close arrives as end-of-stream
                elif tr.server_inode is not None:
                    async with trio.open_nursery() as nursery:
                        if how == "stop_reading":
                            nursery.start_soon(_watch_receive_queue, tr, stream)
                        await self.watch.wait_closed(tr.server_inode)
                        nursery.cancel_scope.cancel()
                else:
                    await trio.sleep(bound)  # no inode (not found): hold it the full bound
            if tr.server_inode is None and how != "fin":
                tr.released_after = None
            elif waited.cancelled_caught:
                what = {
                    "eof": "after the close handshake",
                    "stop_reading": "after the client stopped reading",
                    "watchdog": "after the client gave up",
                }.get(how, f"after the client's {how}")
                tr.release_problem = f"the server still held the connection {bound:.1f} s {what}"
            else:
                tr.released_after = now() - started
        except BaseException as exc:
            tr.cut_by_deadline = _is_cancellation(exc)
            raise
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            self.lingering -= 1
            released = "the server closed its socket" if tr.released_after is not None else "bound"
            self._release(result, f"{how}, then {released}")

    # ---------------------------------------------------------------- resources

    def last_session_end(self) -> float:
        ends = [r.get("ended_at") for r in self.records.values()]
        server_end = max((e for e in ends if isinstance(e, int | float)), default=0.0)
        client_end = max((r.tr.ended_at or 0.0 for r in self.results), default=0.0)
        return max(server_end, client_end)

    def last_block_end(self) -> float:
        """The latest an ``engine_stuck`` session's engine may still be blocked: its
        client's end plus the block's length (the block began before that end). Its
        thread returns then, and Trio's idle worker threads exit 10 s later."""
        return max(
            (
                r.tr.ended_at + r.plan.params["block_s"]
                for r in self.results
                if r.plan.kind == "engine_stuck" and r.tr.ended_at is not None
            ),
            default=0.0,
        )

    async def settle(self, baseline: Snapshot | None) -> tuple[Snapshot, list[str], float]:
        """Wait until the server is idle and past its idle trim, ``/health`` answers
        ``200 ok`` (no engine call stuck), no idle Trio worker thread is alive (their
        names, polled: such a thread counts among the process's threads until Trio's
        idle timeout ends it), and, with a baseline, back to it, bounded; returns the
        snapshot, what never settled, and the wait.

        The bound counts from the last session's end, or a stuck engine's, whichever is
        later; for the worker threads, from when no session and no engine call was left
        (`TRIO_IDLE_TIMEOUT_S` and slack after that: no job starts after it)."""
        started = now()
        last = max(self.last_session_end(), self.last_block_end())
        deadline = max(last + IDLE_BEFORE_TRIM + SETTLE_EXTRA_S, started + 2.0)
        calls_done_at: float | None = None
        while True:
            async with self.metrics_lock:
                metrics = await self._fetch_stats()
                snapshot = Snapshot.take(self.pid, metrics)
                health = self.settled_health = await self._fetch_health()
            pending = idle_problems(metrics)
            if not pending and health.ok and calls_done_at is None:
                calls_done_at = now()
            if not health.ok:
                pending.append(f"GET /health answered {health}, not 200 ok")
            idle_for = now() - self.last_session_end()
            if idle_for < IDLE_BEFORE_TRIM + 0.5:
                pending.append(f"idle for {idle_for:.1f} s only (trim after {IDLE_BEFORE_TRIM} s)")
            workers = snapshot.idle_workers
            if workers:
                pending.append(f"idle Trio worker thread(s) alive: {', '.join(workers)}")
            if baseline is not None:
                pending += [
                    p for p in resource_problems(baseline, snapshot) if not p.startswith("RSS")
                ]
            bound = deadline
            if calls_done_at is not None:
                bound = max(bound, calls_done_at + TRIO_IDLE_TIMEOUT_S + self.s.timing.slack)
            if not pending or now() >= bound:
                return snapshot, pending, now() - started
            await trio.sleep(0.25)


def _is_cancellation(exc: BaseException) -> bool:
    """Trio's cancellation, bare or in the exception groups nurseries wrap it in."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(trio.Cancelled) is not None
    return isinstance(exc, trio.Cancelled)


async def _watch_receive_queue(tr: Transcript, stream: trio.SocketStream) -> None:
    """For a stopped reader: when the bytes waiting in the client's receive queue last
    grew, i.e. when the server's sends stopped arriving. The stall clock runs from about
    then, not from when the client stopped reading."""
    last = -1
    tr.queue_full_at = now()
    while True:
        try:
            raw = fcntl.ioctl(stream.socket.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return
        queued = struct.unpack("i", raw)[0]
        if queued != last:
            last, tr.queue_full_at = queued, now()
        await trio.sleep(0.01)


async def _drain(stream: trio.SocketStream) -> None:
    """Read and drop until end-of-stream (or a reset)."""
    try:
        while await stream.receive_some(65536):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
