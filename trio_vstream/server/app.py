"""`VideoServer`: the server's nursery, admission, and one session per upgrade.

The server is put together here from parts that each hold one idea: `Router` serves
each connection, from its slots to its request's answer (``trio_vstream.server.routing``,
the firewall between connections); `RunningSessions` counts the sessions and drains
them (``trio_vstream.server.running``); `EngineHealth` says when the engine is wedged
(``trio_vstream.server.health``); ``trio_vstream.server.documents`` writes ``/stats``
and ``/v1/models``. What stays here is what ties them to one engine: the resources
every session shares, who is admitted, and the order of start and stop.

Admission has two levels. A connection holds a connection slot from accept to close
(``trio_vstream.server.connections``: a cap below the descriptor limit, a head timeout, and a
reserve that keeps ``/health`` answering at the cap). A session slot
(``--max-sessions``) is taken when ``session.start`` arrives (``trio_vstream.server.slots``).
An upgrade for a session is accepted only with a slot free, and then holds a claim on
it for ``CLAIM_SECONDS`` (2 s), which its ``session.start`` turns into the slot; with
none free (sessions run in every slot, or upgrades just accepted claim them) the upgrade
is answered with HTTP 503, ``Retry-After`` and the ``server_busy`` error as JSON, before
anything is accepted, so that a balancer tries another server. An upgrade idle beyond
its claim holds a connection slot until the start timeout, never a session slot, so idle
upgrades cannot keep a real client out for longer than the claim; if its
``session.start`` then finds no slot free, it gets ``server_busy`` in the session.
Viewers of watch links are never refused for session slots, nor do they take any.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import attrs
import trio
from trio_websocket import WebSocketRequest

from trio_vstream import protocol
from trio_vstream.engines.contract import Engine
from trio_vstream.engines.interfaces import (
    audio_format,
    live_input_chunk_frames,
    live_settings,
    max_batch,
    max_chunk_frames,
)
from trio_vstream.logsafe import get_logger
from trio_vstream.outputs import taps
from trio_vstream.outputs.recording import Recorder
from trio_vstream.outputs.recording_hls import RecordingHLS
from trio_vstream.outputs.taps import TapFactory
from trio_vstream.outputs.watch import HLS_MARKER, WATCH_PREFIX, WatchRegistry
from trio_vstream.protocol import ErrorCode
from trio_vstream.scheduling.batcher import StepBatcher
from trio_vstream.scheduling.progress import EngineProgress
from trio_vstream.server import _websocket_compat, access, connections, fleet, http, metrics
from trio_vstream.server.config import VIDEO_PATH, ServerConfig
from trio_vstream.server.documents import models_document, stats_document
from trio_vstream.server.health import EngineHealth
from trio_vstream.server.routing import Router
from trio_vstream.server.running import RunningSessions
from trio_vstream.server.slots import Claim, SessionSlots
from trio_vstream.session.session import (
    ServerCounters,
    ServerResources,
    Session,
    SessionSummary,
)

logger = get_logger(__name__)

_websocket_compat.patch_ping_during_close()  # trio-websocket #184; see that module

BUSY_RETRY_AFTER = "1"
"""The ``Retry-After`` (seconds) of the 503 that a full server answers an upgrade with."""

WEDGED_EXIT_STATUS = 69
"""The process's exit status after ``exit_when_wedged`` drained it (``EX_UNAVAILABLE``
in BSD's sysexits.h): non-zero, so that ``Restart=on-failure`` restarts it."""


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
        self._sessions = RunningSessions()
        self._slots = SessionSlots(config.max_sessions, lambda: self._sessions.running)
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
            node=config.fleet.node_name,
            max_chunk_frames=max_chunk_frames(engine),
        )
        self.relay = fleet.Relay(
            config.fleet,
            ssl_context=config.ssl_context,
            send_timeout=config.session.stall_timeout,
            close_timeout=config.session.close_timeout,
        )
        """Viewers whose links name another node of the fleet go there."""
        # Who follows each session, in this order: viewers first, then the caller's.
        self.tap_factories: list[TapFactory] = [self.watch.taps]
        if taps is not None:
            self.tap_factories.append(taps)
        if isinstance(taps, Recorder):
            self.metrics.follow_recordings(taps)
        self._started_at = int(time.time())
        self.router = Router(self)
        """Serves each connection (`Router.handle`)."""
        self.engine_health = EngineHealth(
            config.max_stuck_calls, self.metrics, on_wedged=self._exit_when_wedged
        )
        self.abandoned_calls = self.engine_health.abandoned_calls
        """Engine calls still running after their sessions ended (see ``health``)."""
        self.exit_status = 0
        """What the process should exit with once `run` returns: `WEDGED_EXIT_STATUS`
        after a drain that ``exit_when_wedged`` began, else 0."""
        progress = EngineProgress()
        self.live_defaults = live_settings(engine)
        """What the engine suggests for live sessions (`engines.interfaces.live_settings`):
        read, and checked, once at start-up."""
        self.live_input_chunk_frames = live_input_chunk_frames(engine)
        """The chunk length it suggests for live sessions that follow a camera
        (`engines.interfaces.live_input_chunk_frames`), likewise."""
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
                on_stuck=self.engine_health.check,
            )
            if batch > 1
            else None
        )
        self.engine_health.batcher = self.batcher
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
            # A session without a claim (each session gets its own, see serve_websocket).
            admit=partial(self._admit, None),
            abandoned_calls=self.abandoned_calls,
        )
        self.recordings = (
            RecordingHLS(taps.directory, limiter=self._resources.thread_limiter)
            if isinstance(taps, Recorder)
            else None
        )
        """The recordings, played as HLS at ``/v1/recordings/`` (with ``--record`` only)."""

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
        what is left of it; see `RunningSessions.drain`)."""
        return self.config.shutdown_grace + 2 * self.config.session.close_timeout

    @property
    def wedged(self) -> bool:
        """The engine is wedged (`EngineHealth.wedged`): new sessions are refused."""
        return self.engine_health.wedged

    def _exit_when_wedged(self) -> None:
        """Told by `EngineHealth` each time the engine becomes wedged."""
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
                    self.router.handle,
                    self.config.port,
                    host=self.config.host,
                    handler_nursery=handlers,
                )
            )
            self.port = listeners[0].socket.getsockname()[1]
            listener.start_soon(self._sessions.return_memory_when_idle)
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

    async def _drain(self, handlers: trio.Nursery) -> None:
        """No new sessions; the running ones drain (`RunningSessions.drain`); then cancel
        what remains: connections still in their handshake, and anything left."""
        self._draining = True
        await self._sessions.drain(
            self.config.shutdown_grace,
            self.config.session.close_timeout,
            self.watch.wait_connections_closed,
            self.relay.wait_none,
        )
        handlers.cancel_scope.cancel()

    @property
    def running_sessions(self) -> int:
        """Sessions that count against ``max_sessions`` (`RunningSessions.running`)."""
        return self._sessions.running

    @property
    def claimed_sessions(self) -> int:
        """Upgrades holding a claim on a session slot now (`SessionSlots.claimed`)."""
        return self._slots.claimed

    def _admit(self, claim: Claim | None) -> tuple[ErrorCode, str] | None:
        """Asked by a session when its ``session.start`` arrives: None gives it a slot,
        into which the claim its upgrade took turns (it marks itself admitted before any
        checkpoint); else why not: ``engine_unavailable`` while the engine is wedged,
        ``server_busy`` when no slot is free (its claim ran out, and others took them)."""
        if self.engine_health.wedged:
            self._slots.release(claim)
            return ErrorCode.ENGINE_UNAVAILABLE, self.engine_health.unavailable_message()
        if self._slots.admit(claim):
            return None
        return self._busy()

    def _busy(self) -> tuple[ErrorCode, str]:
        """The ``server_busy`` refusal, at an upgrade or at a ``session.start``."""
        return (
            ErrorCode.SERVER_BUSY,
            f"Server busy: {self.config.max_sessions} sessions running; try again later",
        )

    def health(self) -> tuple[int, str]:
        """``GET /health``: 200 ``ok``, or 503 while draining or wedged
        (`EngineHealth.answer`)."""
        return self.engine_health.answer(draining=self._draining)

    def models(self) -> dict[str, Any]:
        """``GET /v1/models`` (`documents.models_document`)."""
        return models_document(
            self.engine,
            served_model=self.served_model,
            created=self._started_at,
            limits=self.config.session.limits,
            live_defaults=self.live_defaults,
            live_input_chunk_frames=self.live_input_chunk_frames,
            max_batch=self.batcher.max_batch if self.batcher else 1,
        )

    def stats_snapshot(self) -> dict[str, Any]:
        """``GET /stats`` (`documents.stats_document`)."""
        return stats_document(
            self.engine.name,
            self.stats,
            self._sessions,
            self._slots.claimed,
            self.batcher,
            node=self.config.fleet.node_name,
        )

    async def _serve_viewer(self, request: WebSocketRequest, target: str, host: str | None) -> None:
        """A watch link's viewer: relayed to the node that owns the session, or accepted,
        then served by the watch links or refused."""
        node, token = fleet.split_watch_target(target)
        where = fleet.locate(
            self.config.fleet,
            node,
            port=self.config.port if self.port is None else self.port,
            relayed=fleet.is_relayed(request.headers),
        )
        with self.watch.connection():
            if isinstance(where, fleet.Peer):
                self.metrics.viewer_relayed()
                unreachable = await self.relay.serve(request, where, host)
                if unreachable is None:
                    return
                where = unreachable
            ws = await request.accept(
                subprotocol=access.selected_subprotocol(request.proposed_subprotocols)
            )
            admitted = self.watch.admit(token) if isinstance(where, fleet.Local) else where
            if isinstance(admitted, protocol.Error):
                await http.refuse_websocket(ws, admitted, self.config.session.close_timeout)
            else:
                await self.watch.serve(ws, *admitted)

    async def serve_watch_get(
        self, path: str, query: str, headers: Sequence[tuple[bytes, bytes]]
    ) -> http.Answer:
        """A plain GET under a watch link: its LL-HLS playlist, init segment, parts and
        segments (`WatchRegistry.playlist`), here or relayed to the node that owns it."""
        link, marker, resource = path[len(WATCH_PREFIX) :].partition(HLS_MARKER)
        if not marker:
            return http.Answer(426, f"{path} is a WebSocket endpoint\n")
        node, token = fleet.split_watch_target(link)
        where = fleet.locate(
            self.config.fleet,
            node,
            port=self.config.port if self.port is None else self.port,
            relayed=fleet.is_relayed(headers),
        )
        if isinstance(where, fleet.Peer):
            target = f"{path}?{query}" if query else path
            relayed = await self.relay.get(where, target, headers)
            if isinstance(relayed, protocol.Error):
                return http.Answer(404, relayed.to_json(), "application/json")
            return http.Answer(relayed.status, relayed.body, headers=relayed.headers)
        window = self.watch.playlist(token) if isinstance(where, fleet.Local) else None
        if window is None:
            gone = protocol.Error(
                ErrorCode.WATCH_NOT_FOUND, "no session at this link (it may have ended)"
            )
            return http.Answer(404, gone.to_json(), "application/json")
        try:
            fields = parse_qsl(query, keep_blank_values=True, max_num_fields=8)
        except ValueError:  # more fields than any playlist request has
            return http.Answer(400, "too many query fields for a playlist\n")
        if len({name for name, _ in fields}) != len(fields):
            return http.Answer(400, "a playlist query names each directive once\n")
        answer = await window.respond(resource, dict(fields))
        headers_out = {name.lower(): value for name, value in answer.headers.items()}
        if self.config.watch.requires_key and "public" in headers_out.get("cache-control", ""):
            # A link that needs a key is no shared cache's to keep and hand out.
            headers_out["cache-control"] = headers_out["cache-control"].replace("public", "private")
        return http.Answer(answer.status, answer.body, answer.content_type, headers_out)

    async def serve_websocket(self, request: WebSocketRequest, *, host: str | None = None) -> None:
        """An upgrade whose head passed the router's checks: a viewer of a watch link, or
        a session if one may start now."""
        path = urlsplit(request.path).path
        if path.startswith(WATCH_PREFIX):
            await self._serve_viewer(request, path[len(WATCH_PREFIX) :], host)
            return
        if path != VIDEO_PATH:  # refused from the head already; here for direct callers
            await http.reject_upgrade(request, 404, f"no WebSocket endpoint at {path}\n")
            return
        if self._draining:  # began since the head was read
            await http.reject_upgrade(request, 503, "draining: try another server\n")
            return
        if self.engine_health.wedged:
            await http.reject_upgrade(request, 503, self.engine_health.unavailable_body())
            return
        # Taken as the check is made, before the accept's first checkpoint: two upgrades
        # cannot both have the last slot (see trio_vstream.server.slots).
        claim = self._slots.claim()
        if claim is None:
            await self._refuse_busy(request)
            return
        try:
            ws = await request.accept(
                subprotocol=access.selected_subprotocol(request.proposed_subprotocols)
            )
            # This session's own admission: its session.start turns its claim into a slot.
            resources = attrs.evolve(self._resources, admit=partial(self._admit, claim))
            await self._sessions.run(Session(ws, resources), self._on_session_end)
        finally:
            self._slots.release(claim)

    async def _refuse_busy(self, request: WebSocketRequest) -> None:
        """No session slot free: an HTTP 503 before the upgrade, which a balancer retries
        on another server (nginx: ``proxy_next_upstream http_503``), with ``server_busy``
        as JSON for a client to read, and counted in ``/metrics``."""
        self.metrics.session_refused(ErrorCode.SERVER_BUSY)
        await http.reject_upgrade(
            request,
            503,
            protocol.Error(*self._busy()),
            headers={"retry-after": BUSY_RETRY_AFTER},
        )


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


async def serve(
    engine: Engine,
    config: ServerConfig = ServerConfig(),
    *,
    task_status: trio.TaskStatus[VideoServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled: the one-call form of ``VideoServer(...).run()``."""
    await VideoServer(engine, config).run(task_status=task_status)


__all__ = [
    "BUSY_RETRY_AFTER",
    "VIDEO_PATH",
    "WEDGED_EXIT_STATUS",
    "ServerConfig",
    "VideoServer",
    "serve",
]
