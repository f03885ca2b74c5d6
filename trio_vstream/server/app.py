"""The WebSocket server: access, admission, one guarded task per connection, draining.

trio-websocket runs each connection's handler in a shared nursery, so an
exception escaping one handler would cancel every other connection and the
listener with it. ``_handle_tcp`` is therefore a firewall: whatever
happens inside a session is logged with its request id and stays there; only
cancellation passes through.

Shutdown is a drain, for rolling restarts behind a load balancer: no session
is admitted any more (``/health`` and WebSocket upgrades answer 503 before
anything is accepted, so the balancer retries elsewhere), running sessions
finish their videos, and only those still running when the grace period ends
are wound down with ``server_shutdown``; after that, what is left is aborted.
Viewers of watch links get one close timeout more (within that bound) to receive
what was queued for them and their session's terminal message. An engine call stuck
outside a checkpoint is not waited for (``trio_vstream.scheduling.engine_calls``): its session
ends without it, so the drain keeps its bound and the process exits.

Admission has two levels. A connection holds a connection slot from accept to close
(``trio_vstream.server.connections``: a cap below the descriptor limit, a head timeout, and a
reserve that keeps ``/health`` answering at the cap). A session slot
(``--max-sessions``) is taken only when ``session.start`` arrives: an upgrade that never
sends one holds a connection slot until the start timeout, never a session slot, so idle
upgrades cannot keep a real client out. An upgrade that arrives while started sessions
fill every session slot is refused at once with ``server_busy``; one that found a slot
free but whose ``session.start`` finds none gets the same ``server_busy`` then.
"""

from __future__ import annotations

import contextlib
import enum
import os
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import attrs
import h11
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, wrap_server_stream

from trio_vstream import protocol
from trio_vstream.engines.contract import Engine
from trio_vstream.engines.interfaces import (
    audio_format,
    interaction_kinds,
    live_settings,
    max_batch,
)
from trio_vstream.logsafe import get_logger
from trio_vstream.outputs import taps
from trio_vstream.outputs.recording import Recorder
from trio_vstream.outputs.taps import TapFactory
from trio_vstream.outputs.watch import WATCH_PREFIX, WatchConfig, WatchRegistry
from trio_vstream.protocol import ErrorCode
from trio_vstream.scheduling.batcher import StepBatcher
from trio_vstream.scheduling.engine_calls import AbandonedCalls
from trio_vstream.scheduling.progress import EngineProgress
from trio_vstream.server import _websocket_compat, access, connections, http, memory, metrics
from trio_vstream.session.session import (
    Outcome,
    ServerCounters,
    ServerResources,
    Session,
    SessionConfig,
    SessionSummary,
)

logger = get_logger(__name__)

_websocket_compat.patch_ping_during_close()  # trio-websocket #184; see that module

VIDEO_PATH = "/v1/realtime/video"
RECENT_SESSIONS = 256
"""Finished sessions kept for /stats."""
IDLE_BEFORE_TRIM = 10.0
"""Seconds without sessions before freed memory is given back to the system."""
AT_CAPACITY = "too many connections: try again later\n"
"""The 503's body at the connection cap (``trio_vstream.server.connections``)."""
TOO_MANY_FROM_ADDRESS = "too many connections from this address: try again later\n"
"""The 429's body at the per-address cap (``--max-connections-per-ip``)."""
TURN_AWAY_SECONDS = 1.0
"""The most a connection turned away at the cap may take to receive its 503."""
WEDGED_EXIT_STATUS = 69
"""The process's exit status after ``exit_when_wedged`` drained it (``EX_UNAVAILABLE``
in BSD's sysexits.h): non-zero, so that ``Restart=on-failure`` restarts it."""


@attrs.frozen(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port; ``VideoServer.port`` tells which."""
    max_sessions: int = 16
    encode_concurrency: int = attrs.field(factory=lambda: max(1, os.cpu_count() or 1))
    """Chunks encoded at once, server-wide; by default one per core. Measured on 2 cores
    (docs/benchmarks-history.md, "Server overhead"): 1.5x the aggregate fps of cores - 1 with 8
    and 16 sessions, ping and stop -> done p99 within their targets; unbounded, 8 x264
    encoders starved the event loop (ping p99 55 ms, stop -> done p99 466 ms)."""
    shutdown_grace: float = 30.0
    """Seconds running sessions get to finish their videos after a shutdown request:
    long enough for typical clips, so that a rolling restart loses nothing."""
    session: SessionConfig = attrs.field(factory=SessionConfig)
    access: access.AccessPolicy = attrs.field(factory=access.AccessPolicy)
    ssl_context: ssl.SSLContext | None = attrs.field(default=None, eq=False)
    """Serve ``wss://`` and ``https://`` on the port."""
    watch: WatchConfig = attrs.field(factory=WatchConfig)
    """Watch links: read-only viewers of a session (``trio_vstream.outputs.watch``)."""
    max_connections: int | None = None
    """Connections served at once: sessions, viewers, upgrades waiting for
    ``session.start``, plain requests. None: derived from the descriptor limit
    (``connections.default_max_connections``). A few reserved slots beyond it answer
    ``/health`` only."""
    max_connections_per_ip: int | None = None
    """Connections one client address (an IPv6 /64) may hold at once; more get a 429.
    None: no cap, as behind a proxy, where every connection comes from the proxy."""
    max_stuck_calls: int = 2
    """Engine calls left running after their sessions ended (stuck outside a checkpoint:
    a hung kernel) at which the engine counts as wedged: ``/health`` answers 503 and new
    sessions are refused with ``engine_unavailable`` until enough of them return. 0:
    never. Two, not one, so that one slow call (a first compile, a huge decode) does not
    take a server out of rotation, while a device that hangs every call does at once."""
    exit_when_wedged: bool = False
    """Once wedged, drain and make `VideoServer.run` return, with `VideoServer.exit_status`
    `WEDGED_EXIT_STATUS`: for a supervisor that restarts the process (systemd's
    ``Restart=on-failure``, Kubernetes), which is what frees a wedged device."""
    head_timeout: float = 5.0
    """Seconds a connection gets to send its whole HTTP request head (after the TLS
    handshake): a client that dawdles (slowloris) loses its connection slot. Separate
    from the session's start timeout, which runs after the upgrade."""


class VideoServer:
    """Serves one engine at ``/v1/realtime/video``.

    ``await nursery.start(server.run)`` returns once the port is bound;
    ``server.shutdown()`` starts a graceful shutdown, after which ``run``
    returns. Cancelling ``run`` stops everything at once.
    """

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig = ServerConfig(),
        *,
        on_session_end: Callable[[SessionSummary], None] | None = None,
        taps: TapFactory | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.stats = ServerCounters()
        self.port: int | None = None
        self._on_session_end = on_session_end
        self._sessions: set[Session] = set()
        self._sessions_changed = trio.Event()
        self._recent: deque[SessionSummary] = deque(maxlen=RECENT_SESSIONS)
        self._became_idle = trio.Event()
        self._last_idle = 0.0
        self._shutdown_requested = trio.Event()
        self._draining = False
        steps = engine.max_concurrent_steps
        self.metrics = metrics.ServerMetrics(self.served_model)
        self.max_connections = (
            config.max_connections
            if config.max_connections is not None
            else connections.default_max_connections(config.max_sessions)
        )
        self.connections = connections.ConnectionSlots(self.max_connections)
        self.per_address = connections.PerAddress(config.max_connections_per_ip)
        self.metrics.follow_connections(self.connections, self.per_address)
        self.watch = WatchRegistry(
            config.watch,
            self.metrics,
            close_timeout=config.session.close_timeout,
            send_timeout=config.session.stall_timeout,
        )
        # Who follows each session, in this order: viewers first, then the caller's.
        self.tap_factories: list[TapFactory] = [self.watch.taps]
        if taps is not None:
            self.tap_factories.append(taps)
        if isinstance(taps, Recorder):
            self.metrics.follow_recordings(taps)
        self._started_at = int(time.time())
        # Refusals are counted in /metrics; the log gets a line per kind every few seconds.
        self._log_key_refused = access.RateLimitedLog(
            logger, "refused a request for %s from %s: API key %s"
        )
        self._log_host_refused = access.RateLimitedLog(
            logger,
            "refused a request for Host %s from %s: not a name served here (--allowed-hosts)",
        )
        self.abandoned_calls = AbandonedCalls(on_change=self._abandoned_calls_changed)
        """Engine calls still running after their sessions ended (see ``health``)."""
        self._wedged = False
        self.exit_status = 0
        """What the process should exit with once `run` returns: `WEDGED_EXIT_STATUS`
        after a drain that ``exit_when_wedged`` began, else 0."""
        progress = EngineProgress()
        self.live_defaults = live_settings(engine)
        """What the engine suggests for live sessions (`engines.interfaces.live_settings`):
        read, and checked, once at start-up."""
        batch = max_batch(engine)
        audio_format(engine)  # an engine's sound the server cannot carry fails here, at start
        # A batching engine's steps all go through its batcher, one batch at a time:
        # step slots on top would only make sessions wait for each other's turns.
        self.batcher = (
            StepBatcher(
                batch,
                progress,
                self.metrics.batch_run,
                abandoned=self.abandoned_calls,
                on_stuck=self._check_wedged,
            )
            if batch > 1
            else None
        )
        self._resources = ServerResources(
            engine=engine,
            config=config.session,
            stats=self.stats,
            step_limiter=trio.CapacityLimiter(steps) if steps and not self.batcher else None,
            engine_progress=progress,
            batcher=self.batcher,
            taps=partial(_compose_taps, self.tap_factories),
            # The server's own work: each session runs at most one such call at a time
            # (encoder set-up or close, image decoding), and it always returns.
            thread_limiter=trio.CapacityLimiter(2 * config.max_sessions + 4),
            # The engine's calls, which may never return, on a budget of their own. Each
            # running session has at most two (a step, a chunk's copy to the host); the
            # calls left stuck stay below the wedge bound plus what the sessions admitted
            # before it was reached leave: so this never runs out while admission works.
            engine_limiter=trio.CapacityLimiter(
                4 * config.max_sessions + config.max_stuck_calls + 4
            ),
            encode_limiter=trio.CapacityLimiter(config.encode_concurrency),
            metrics=self.metrics,
            admit=self._refusal,
            abandoned_calls=self.abandoned_calls,
        )

    @property
    def served_model(self) -> str:
        """The name clients ask for in ``session.start.model`` and find in ``/v1/models``."""
        return self.config.session.served_model or self.engine.name

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        scheme = "wss" if self.config.ssl_context is not None else "ws"
        return f"{scheme}://{host}:{self.port}{VIDEO_PATH}"

    def shutdown(self) -> None:
        """Begin a graceful shutdown, a drain (idempotent)."""
        self._shutdown_requested.set()

    @property
    def drain_bound(self) -> float:
        """The most seconds a drain takes from `shutdown` to `run`'s return: the grace,
        then a close timeout to wind sessions down and one to abort the rest (viewers get
        what is left of it; see `_drain`)."""
        return self.config.shutdown_grace + 2 * self.config.session.close_timeout

    @property
    def wedged(self) -> bool:
        """The engine has ``max_stuck_calls`` calls stuck after their sessions ended, or
        its batcher is stuck on a hung batched step (`StepBatcher.stuck`)."""
        return self._wedged

    def _abandoned_calls_changed(self, running: int) -> None:
        """Told by `AbandonedCalls` whenever a call is abandoned or returns: sessions'
        calls and a batcher's hung batch alike."""
        self.metrics.engine_calls_abandoned(self.abandoned_calls.total, running)
        self._check_wedged()

    def _check_wedged(self) -> None:
        """Told whenever the count of stuck calls changes, and by the batcher whenever it
        becomes stuck or takes rows again: a batching engine whose
        batched step hangs can serve nobody, however few calls are stuck."""
        bound = self.config.max_stuck_calls
        stuck = self.abandoned_calls.stuck
        batcher_stuck = self.batcher is not None and self.batcher.stuck
        wedged = bound > 0 and (stuck >= bound or batcher_stuck)
        if wedged == self._wedged:
            return
        self._wedged = wedged
        if not wedged:
            logger.warning(
                "engine recovered: %d engine call(s) still stuck, below %d; new sessions "
                "are admitted again",
                stuck,
                bound,
            )
            return
        self.metrics.engine_wedged()
        why, names = self._why_wedged(), self.abandoned_calls.names()
        if names:  # none yet for a batch: counted just after the batcher is stuck
            why += f" ({', '.join(names)})"
        logger.error(
            "engine wedged: %s; /health answers 503 and new sessions are refused with "
            "engine_unavailable",
            why,
        )
        if self.config.exit_when_wedged and not self.shutting_down:
            logger.error(
                "draining, then exiting with status %d for a restart (--exit-when-wedged)",
                WEDGED_EXIT_STATUS,
            )
            self.exit_status = WEDGED_EXIT_STATUS
            self.shutdown()

    async def wait_shutdown_requested(self) -> None:
        """Return once a shutdown has been asked for (`shutdown`, or a wedged engine)."""
        await self._shutdown_requested.wait()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def shutting_down(self) -> bool:
        return self._shutdown_requested.is_set()

    async def run(
        self, *, task_status: trio.TaskStatus[VideoServer] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as handlers, trio.open_nursery() as listener:
            listeners = await listener.start(
                partial(
                    trio.serve_tcp,
                    self._handle_tcp,
                    self.config.port,
                    host=self.config.host,
                    handler_nursery=handlers,
                )
            )
            self.port = listeners[0].socket.getsockname()[1]
            listener.start_soon(self._return_memory_when_idle)
            if self.batcher is not None:  # lives as long as the sessions it serves
                handlers.start_soon(self.batcher.run)
            logger.info("serving %s with engine %s", self.url, self.engine.name)
            self._log_connection_cap()
            task_status.started(self)
            await self._shutdown_requested.wait()
            # Still listening while draining: a balancer's health check and new
            # upgrades get a 503, which sends them elsewhere at once.
            await self._drain(handlers)
            listener.cancel_scope.cancel()

    def _log_connection_cap(self) -> None:
        """Say what the connection cap is, and warn when it cannot work as meant."""
        descriptors = connections.descriptor_limit()
        logger.info(
            "at most %d connections (+%d for /health; descriptor limit %d)",
            self.max_connections,
            self.connections.reserved,
            descriptors,
        )
        if self.max_connections < self.config.max_sessions:
            logger.warning(
                "%d connections cannot carry %d sessions: raise the descriptor limit "
                "(ulimit -n) or --max-connections, or lower --max-sessions",
                self.max_connections,
                self.config.max_sessions,
            )
        safe = connections.default_max_connections(self.config.max_sessions, descriptors)
        if self.max_connections > safe:
            logger.warning(
                "--max-connections %d is above %d, what the descriptor limit (%d) leaves: "
                "at the limit accept() fails (EMFILE) and nothing is served",
                self.max_connections,
                safe,
                descriptors,
            )

    async def _return_memory_when_idle(self) -> None:
        """Give freed memory back to the system once no session has run for a while.

        Not at once when the last session ends: the next session would fault it all
        back in, which showed up as tens of milliseconds on its first chunk.
        """
        while True:
            await self._became_idle.wait()
            self._became_idle = trio.Event()
            await trio.sleep_until(self._last_idle + IDLE_BEFORE_TRIM)
            if not self._sessions and trio.current_time() >= self._last_idle + IDLE_BEFORE_TRIM:
                # On the event loop: it takes milliseconds and nothing is streaming, while
                # a worker thread would linger for Trio's idle-thread timeout afterwards.
                memory.return_free_memory()

    async def _drain(self, handlers: trio.Nursery) -> None:
        """Let running sessions finish within the grace; then wind down the rest, abort
        stragglers, let viewers receive their last chunks, and cancel what remains."""
        self._draining = True
        grace = self.config.shutdown_grace
        close_timeout = self.config.session.close_timeout
        # The drain's bound: the grace, then a close timeout to wind down, one to abort.
        bound = trio.current_time() + grace + 2 * close_timeout
        logger.info(
            "draining: no new sessions; %d running get %g s to finish", len(self._sessions), grace
        )
        with trio.move_on_after(grace):
            await self._wait_no_sessions()
        if self._sessions:
            logger.warning(
                "grace over: %d session(s) still running end with server_shutdown",
                len(self._sessions),
            )
            for session in list(self._sessions):
                session.shutdown()
            with trio.move_on_after(self.config.session.close_timeout):
                await self._wait_no_sessions()
            for session in list(self._sessions):
                session.abort(
                    Outcome.SHUTDOWN, (ErrorCode.SERVER_SHUTDOWN, "Server is shutting down")
                )
            with trio.move_on_after(self.config.session.close_timeout):
                await self._wait_no_sessions()
        # Viewers may still be sending what was queued for them and the terminal
        # message (a viewer a few chunks behind): a close timeout more for them, never
        # past the bound, so the drain stays within what docs/server.md promises.
        with trio.move_on_at(min(trio.current_time() + close_timeout, bound)):
            await self.watch.wait_connections_closed()
        # Connections still in their handshake, and anything left, go now.
        handlers.cancel_scope.cancel()

    async def _wait_no_sessions(self) -> None:
        while self._sessions:
            await self._sessions_changed.wait()

    def _session_ended(self, session: Session) -> None:
        self._sessions.discard(session)
        self._sessions_changed.set()
        self._sessions_changed = trio.Event()

    @property
    def running_sessions(self) -> int:
        """Sessions that count against ``max_sessions``: admitted at their ``session.start``
        and not only closing their socket. An upgrade still waiting for its
        ``session.start`` holds a connection slot, not a session slot."""
        return sum(1 for session in self._sessions if session.admitted and not session.finishing)

    def _refusal(self) -> tuple[ErrorCode, str] | None:
        """Why a new session cannot start now (``engine_unavailable`` while the engine is
        wedged, ``server_busy`` when started sessions fill every session slot), or None.

        Asked at an upgrade, and by each session when its ``session.start`` arrives:
        None then gives it a slot (it marks itself admitted before any checkpoint).
        """
        if self._wedged:
            return ErrorCode.ENGINE_UNAVAILABLE, self._unavailable_message()
        if self.running_sessions < self.config.max_sessions:
            return None
        return (
            ErrorCode.SERVER_BUSY,
            f"Server busy: {self.config.max_sessions} sessions running; try again later",
        )

    async def _handle_tcp(self, tcp: trio.SocketStream) -> None:
        """One TCP connection: a plain HTTP GET, or a WebSocket upgrade (TLS first, if on).

        It holds a connection slot from here to its close; with none left, not even a
        reserved one, it is turned away before anything is read.
        """
        address = connections.address_key(_peer(tcp))
        if not self.per_address.take(address):
            await self._refuse_address(tcp)
            return
        try:
            slot = self.connections.take()
            if slot is None:
                await self._turn_away(tcp)
                return
            await self._serve_tcp(tcp, slot)
        finally:
            self.per_address.release(address)

    async def _serve_tcp(self, tcp: trio.SocketStream, slot: connections.ConnectionSlot) -> None:
        stream: trio.abc.Stream = tcp
        if self.config.ssl_context is not None:
            # https_compatible: closing never waits on the peer (a half-done handshake
            # would otherwise hold a shielded close open), as HTTPS servers do.
            stream = trio.SSLStream(
                tcp, self.config.ssl_context, server_side=True, https_compatible=True
            )
        try:
            async with trio.open_nursery() as connection:
                await self._route(stream, connection, slot)
                connection.cancel_scope.cancel()  # the WebSocket reader task, if any
        except BaseException as exc:
            # Let cancellation through; keep everything else inside this connection.
            cancelled, rest = _split_cancelled(exc)
            if rest is not None and not _is_disconnect(rest):
                logger.error("connection handler failed", exc_info=rest)
            if cancelled is not None:
                raise cancelled from None
        finally:
            # A TLS peer may vanish without its close_notify.
            try:
                with (
                    # A deadline on every shielded wait: nothing may hold the exit for good.
                    trio.CancelScope(shield=True, deadline=trio.current_time() + TURN_AWAY_SECONDS),
                    contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
                ):
                    await stream.aclose()
            finally:
                slot.release()  # once its descriptor is closed

    async def _refuse_address(self, tcp: trio.SocketStream) -> None:
        """The client's address holds its share of connections: a 429 once its head is
        read (within the reserve's head timeout), then close. Read first because closing
        a socket with unread bytes resets it, and a reset can reach the client before the
        answer does (it did, one run in three, under load). With TLS only the close.
        Holds no slot, and its descriptor for about a second at most."""
        with (
            trio.move_on_after(connections.RESERVED_HEAD_TIMEOUT + TURN_AWAY_SECONDS),
            contextlib.suppress(
                trio.BrokenResourceError, trio.ClosedResourceError, http.HeadTooLarge
            ),
        ):
            if self.config.ssl_context is None:
                with trio.move_on_after(connections.RESERVED_HEAD_TIMEOUT):
                    await http.read_head(tcp)
                await http.respond(tcp, 429, TOO_MANY_FROM_ADDRESS, headers={"retry-after": "1"})
        await trio.aclose_forcefully(tcp)

    async def _turn_away(self, tcp: trio.SocketStream) -> None:
        """Every connection slot is taken, the reserved ones past their heads: a 503 at
        once, without reading the request, then close. With TLS only the close: a
        handshake would hold the connection. Bounded, though a fresh socket's buffer
        takes a short response without waiting."""
        with (
            trio.move_on_after(TURN_AWAY_SECONDS),
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
        ):
            if self.config.ssl_context is None:
                await http.respond(tcp, 503, AT_CAPACITY, headers={"retry-after": "1"})
        await trio.aclose_forcefully(tcp)

    async def _route(
        self, stream: trio.abc.Stream, connection: trio.Nursery, slot: connections.ConnectionSlot
    ) -> None:
        with slot.reading_head(self.config.head_timeout) as too_slow:
            try:
                head = await http.read_head(stream)
            except http.HeadTooLarge:
                await http.respond(stream, 431, "request head too large\n")
                return
        if too_slow.cancelled_caught or not head:
            return
        request = http.parse_head(head)
        if request is None:
            await http.respond(stream, 400, "malformed HTTP request\n")
            return
        policy = self.config.access
        if not policy.host_allowed(request.headers, bind=self.config.host):
            # First of all, upgrades and /health included: a page whose DNS name was
            # re-pointed here (DNS rebinding) learns nothing, not even whether keys are on.
            self.metrics.host_refused()
            host = b", ".join(v for n, v in request.headers if n.lower() == b"host")
            self._log_host_refused(ascii(host.decode("latin-1")[:100]), _peer(stream))
            await http.respond(
                stream, 421, "misdirected_request: this server does not serve that Host\n"
            )
            return
        path = urlsplit(request.target.decode("latin-1")).path
        if slot.reserved and not _is_health_check(request, path):
            # Taken in beyond the cap, for health checks only: others try again later.
            self.connections.count_refused()
            await http.respond(stream, 503, AT_CAPACITY, headers={"retry-after": "1"})
            return
        watching = path.startswith(WATCH_PREFIX)
        refusal = policy.check_key(request.headers, self._need(path, watching=watching))
        if refusal is not None:
            # Before anything else, upgrades included: no session starts without a key.
            self.metrics.auth_refused(refusal)
            self._log_key_refused(ascii(path[:200]), _peer(stream), refusal.value)
            await http.respond(
                stream,
                refusal.status,
                refusal.message,
                headers={"www-authenticate": 'Bearer realm="trio_vstream"'}
                if refusal.status == 401
                else None,
            )
            return
        if http.is_websocket_upgrade(request):
            if not policy.origin_allowed(
                request.headers, secure=self.config.ssl_context is not None
            ):
                await http.respond(stream, 403, "this Origin may not open sessions here\n")
                return
            if self._draining and not watching:  # a watched session runs here till it ends
                await http.respond(stream, 503, "draining: try another server\n")
                return
            if self._wedged and not watching:  # before the upgrade: a balancer retries
                await http.respond(
                    stream, 503, self._unavailable_body(), headers={"retry-after": "10"}
                )
                return
            if not watching and path != VIDEO_PATH:
                await http.respond(stream, 404, f"no WebSocket endpoint at {path}\n")
                return
            problem = http.handshake_problem(request)
            if problem is not None:
                await http.respond(stream, problem[0], problem[1], headers=problem[2])
                return
            limits = self.config.session.limits
            # Room to receive an oversized message and answer it with message_too_large;
            # beyond this, trio-websocket closes the connection with code 1009.
            ws_request = await wrap_server_stream(
                connection,
                http.ReplayStream(stream, head),
                max_message_size=2 * max(limits.max_start_bytes, limits.max_control_bytes),
            )
            await self._serve_request(ws_request)
        elif request.method != b"GET":
            await http.respond(stream, 405, "only GET and WebSocket upgrades here\n")
        elif path == "/health":
            await http.respond(stream, *self.health())
        elif path == "/metrics":
            await http.respond(
                stream, 200, self.metrics.exposition(), content_type=metrics.CONTENT_TYPE
            )
        elif path == "/stats":
            await http.respond(stream, 200, self.stats_snapshot())
        elif path == "/v1/models":
            await http.respond(stream, 200, self.models())
        elif path == "/" or path.startswith("/static/"):
            found = http.static_file("index.html" if path == "/" else path[len("/static/") :])
            if found is None:
                await http.respond(stream, 404, f"nothing at {path}\n")
            else:
                await http.respond(stream, 200, found[0], content_type=found[1])
        elif path == VIDEO_PATH or watching:
            await http.respond(stream, 426, f"{path} is a WebSocket endpoint\n")
        else:
            await http.respond(stream, 404, f"nothing at {path}\n")

    def _need(self, path: str, *, watching: bool) -> access.Need:
        """What a request for ``path`` must carry (see `access.Need`)."""
        if path == "/stats":
            return access.Need.STATS
        if path == "/metrics":
            return access.Need.METRICS
        if path in ("/", "/health") or path.startswith("/static/"):
            return access.Need.NOTHING
        if watching and not self.config.watch.requires_key:
            return access.Need.NOTHING  # the link's token is the capability
        return access.Need.KEY

    def health(self) -> tuple[int, str]:
        """``GET /health``: 200 ``ok``, or 503 and why not.

        503 while draining, and while the engine is wedged (`wedged`: as many engine calls
        stuck after their sessions ended as ``max_stuck_calls``): a thread stuck outside
        a checkpoint usually means a hung device, on which new sessions would stall too.
        A balancer then sends new sessions elsewhere, and an orchestrator's health check
        can restart the server (its drain does not wait for the stuck threads); new
        sessions are refused here meanwhile, while those already streaming carry on.
        Fewer stuck calls than that: 200, ``degraded`` and how many.
        """
        if self._draining:
            return 503, "draining\n"
        if self._wedged:
            return 503, self._unavailable_body()
        stuck = self.abandoned_calls.stuck
        if stuck:
            return 200, (
                f"degraded: {stuck} engine call(s) stuck after their sessions ended "
                f"(wedged at {self.config.max_stuck_calls})\n"
            )
        return 200, "ok\n"

    def _why_wedged(self) -> str:
        """What wedges the engine, for its log and its clients."""
        if self.batcher is not None and self.batcher.stuck:
            return "its batched step is stuck (a forward that never returned)"
        return f"{self.abandoned_calls.stuck} engine call(s) stuck after their sessions ended"

    def _unavailable_message(self) -> str:
        return f"Engine unavailable: {self._why_wedged()}; try another server"

    def _unavailable_body(self) -> str:
        """A refusal's HTTP body: the code first, as in the ``error`` message."""
        return f"{ErrorCode.ENGINE_UNAVAILABLE.value}: {self._unavailable_message()}\n"

    def models(self) -> dict[str, Any]:
        """``GET /v1/models``: OpenAI's list shape, so existing tooling finds the model.

        The ``trio_vstream`` key is this server's extension: what a page or a client
        may ask for (the engine's defaults, the server's limits, what an interaction may
        carry) without trial and error.
        """
        defaults = self.engine.video_defaults
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_model,
                    "object": "model",
                    "created": self._started_at,
                    "owned_by": "trio_vstream",
                    "trio_vstream": {
                        "engine": self.engine.name,
                        "endpoint": VIDEO_PATH,
                        "video_defaults": attrs.asdict(defaults),
                        "limits": attrs.asdict(self.config.session.limits),
                        "interaction_kinds": sorted(interaction_kinds(self.engine)),
                        "live_defaults": self.live_defaults,
                        "max_batch": self.batcher.max_batch if self.batcher else 1,
                    },
                }
            ],
        }

    def stats_snapshot(self) -> dict[str, Any]:
        """``GET /stats``: counters for dashboards and benchmarks, as JSON. Times are
        ``time.monotonic()`` seconds, which other processes on the same host can compare
        with their own."""
        stats = self.stats
        return {
            "engine": self.engine.name,
            "monotonic": time.monotonic(),
            "sessions_active": stats.sessions_active,
            "sessions_running": self.running_sessions,
            "sessions_waiting": sum(1 for session in self._sessions if not session.admitted),
            "sessions_total": stats.sessions_total,
            "streams_open": stats.streams_open,
            "worker_threads": stats.worker_threads,
            "chunks_sent": stats.chunks_sent,
            "engine_cpu_seconds": stats.engine_cpu_seconds,
            "batches": self.batcher.batches if self.batcher else 0,
            "batch_rows": self.batcher.rows if self.batcher else 0,
            "threads_alive": threading.active_count(),
            "rss_bytes": _rss_bytes(),
            "recent_sessions": [attrs.asdict(s, value_serializer=_jsonable) for s in self._recent],
        }

    async def _serve_viewer(self, request: WebSocketRequest, token: str) -> None:
        """A watch link's viewer: accepted, then served by the watch links or refused."""
        with self.watch.connection():
            ws = await request.accept(
                subprotocol=access.selected_subprotocol(request.proposed_subprotocols)
            )
            admitted = self.watch.admit(token)
            if isinstance(admitted, protocol.Error):
                await http.refuse_websocket(ws, admitted, self.config.session.close_timeout)
            else:
                await self.watch.serve(ws, *admitted)

    async def _serve_request(self, request: WebSocketRequest) -> None:
        path = urlsplit(request.path).path
        if path.startswith(WATCH_PREFIX):
            await self._serve_viewer(request, path[len(WATCH_PREFIX) :])
            return
        if path != VIDEO_PATH:  # refused from the head already; here for direct callers
            await http.reject_upgrade(request, 404, f"no WebSocket endpoint at {path}\n")
            return
        if self._draining:  # began since the head was read
            await http.reject_upgrade(request, 503, "draining: try another server\n")
            return
        if self._wedged:
            await http.reject_upgrade(request, 503, self._unavailable_body())
            return
        ws = await request.accept(
            subprotocol=access.selected_subprotocol(request.proposed_subprotocols)
        )
        # Started sessions fill every slot: say so now rather than after session.start.
        # A free slot is not held for this connection: its session.start takes one if
        # one is still free then (the session asks _refusal again).
        refusal = self._refusal()
        if refusal is not None:
            await http.refuse_websocket(
                ws, protocol.Error(*refusal), self.config.session.close_timeout
            )
            return
        session = Session(ws, self._resources)
        self._sessions.add(session)
        try:
            summary = await session.run()
        finally:
            self._session_ended(session)
        self._recent.append(summary)
        if self._on_session_end is not None:
            self._on_session_end(summary)
        if not self._sessions:
            self._last_idle = trio.current_time()
            self._became_idle.set()


def _compose_taps(
    factories: list[TapFactory], request_id: str, start: protocol.SessionStart
) -> taps.SessionTaps:
    """Every factory's taps for one session, in order, and their ``video.start`` fields
    merged. One that fails is logged and left out: the others still follow the session."""
    found: list[taps.SessionTap] = []
    fields: dict[str, Any] = {}
    for factory in factories:
        try:
            part = factory(request_id, start)
        except Exception:
            logger.exception("session %s: a tap factory failed; going on without it", request_id)
            continue
        found.extend(part.taps)
        fields.update(part.video_start_fields)
    return taps.SessionTaps(found, fields)


def _is_health_check(request: h11.Request, path: str) -> bool:
    """A plain ``GET /health``: what a reserved connection slot may serve."""
    return path == "/health" and request.method == b"GET" and not http.is_websocket_upgrade(request)


def _split_cancelled(
    exc: BaseException,
) -> tuple[BaseException | None, BaseException | None]:
    """Separate cancellation (to re-raise) from real errors (to log), groups included."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split((trio.Cancelled, KeyboardInterrupt, SystemExit))
    if isinstance(exc, trio.Cancelled | KeyboardInterrupt | SystemExit):
        return exc, None
    return None, exc


def _is_disconnect(exc: BaseException) -> bool:
    """A peer going away mid-handshake is routine, not a server error."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_disconnect(e) for e in exc.exceptions)
    return isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError | ConnectionClosed)


def _peer(stream: trio.abc.Stream) -> str:
    """The client's address, for the log ("?" if the socket has none any more)."""
    transport = getattr(stream, "transport_stream", stream)  # under TLS, the TCP stream
    sock = getattr(transport, "socket", None)
    try:
        return "?" if sock is None else str(sock.getpeername()[0])
    except (OSError, IndexError, TypeError):
        return "?"


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _jsonable(_inst: Any, _field: Any, value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


async def serve(
    engine: Engine,
    config: ServerConfig = ServerConfig(),
    *,
    task_status: trio.TaskStatus[VideoServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled: the one-call form of ``VideoServer(...).run()``."""
    await VideoServer(engine, config).run(task_status=task_status)


__all__ = ["VIDEO_PATH", "WEDGED_EXIT_STATUS", "ServerConfig", "VideoServer", "serve"]
