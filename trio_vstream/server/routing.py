"""One TCP connection from accept to close: its slots, TLS, its head, who may come in,
and where its request goes.

trio-websocket runs each connection's handler in a shared nursery, so an
exception escaping one handler would cancel every other connection and the
listener with it. `Router.handle` is therefore a firewall: whatever
happens inside a session is logged with its request id and stays there; only
cancellation passes through.

Before anything else the connection takes its slots (``trio_vstream.server.connections``:
one of the server's, one of its address's), or is turned away with a 503 or a 429. Its
request head is then checked in a fixed order, each check answering before the next can
tell anything: the Host (DNS rebinding), the reserve (``/health`` only beyond the cap),
the API key, and for an upgrade its Origin, the drain and the wedge check; only then is
a WebSocket accepted and handed to the server (`Served.serve_websocket`), or a plain GET
answered (``trio_vstream.server.http``). The router keeps none of the server's state: it
reads what it needs through `Served`, which `VideoServer` is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import h11
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, wrap_server_stream

from trio_vstream.logsafe import get_logger
from trio_vstream.outputs.recording_hls import RECORDINGS_PREFIX, RecordingHLS
from trio_vstream.outputs.watch import WATCH_PREFIX
from trio_vstream.server import access, connections, http, metrics
from trio_vstream.server.config import VIDEO_PATH, ServerConfig
from trio_vstream.server.health import EngineHealth

__all__ = ["AT_CAPACITY", "TOO_MANY_FROM_ADDRESS", "TURN_AWAY_SECONDS", "Router", "Served"]

logger = get_logger(__name__)

AT_CAPACITY = "too many connections: try again later\n"
"""The 503's body at the connection cap (``trio_vstream.server.connections``)."""
TOO_MANY_FROM_ADDRESS = "too many connections from this address: try again later\n"
"""The 429's body at the per-address cap (``--max-connections-per-ip``)."""
TURN_AWAY_SECONDS = 1.0
"""The most a connection turned away at the cap may take to receive its 503."""


class Served(Protocol):
    """What a `Router` reads of the server it routes for, and hands requests to."""

    @property
    def config(self) -> ServerConfig: ...

    @property
    def metrics(self) -> metrics.ServerMetrics: ...

    @property
    def per_address(self) -> connections.PerAddress: ...

    @property
    def connections(self) -> connections.ConnectionSlots: ...

    @property
    def engine_health(self) -> EngineHealth: ...

    @property
    def draining(self) -> bool: ...

    @property
    def recordings(self) -> RecordingHLS | None:
        """The recordings served as HLS (``--record``), or None."""
        ...

    def health(self) -> tuple[int, str]:
        """``GET /health``'s status and body."""
        ...

    def stats_snapshot(self) -> dict[str, Any]:
        """``GET /stats``'s document."""
        ...

    def models(self) -> dict[str, Any]:
        """``GET /v1/models``'s document."""
        ...

    async def serve_watch_get(
        self, path: str, query: str, headers: Sequence[tuple[bytes, bytes]]
    ) -> http.Answer:
        """A plain GET under a watch link (its LL-HLS playlist and parts)."""
        ...

    async def serve_websocket(self, request: WebSocketRequest, *, host: str | None = None) -> None:
        """Serve an upgrade that passed every check of its head: a session or a viewer.
        ``host``: its Host header (trio-websocket keeps it to itself), for a relay."""
        ...


class Router:
    """Serves each TCP connection of one server (`handle`: trio.serve_tcp's handler)."""

    def __init__(self, server: Served) -> None:
        self._server = server
        # Refusals are counted in /metrics; the log gets a line per kind every few seconds.
        self._log_key_refused = access.RateLimitedLog(
            logger, "refused a request for %s from %s: API key %s"
        )
        self._log_host_refused = access.RateLimitedLog(
            logger,
            "refused a request for Host %s from %s: not a name served here (--allowed-hosts)",
        )

    async def handle(self, tcp: trio.SocketStream) -> None:
        """One TCP connection: a plain HTTP GET, or a WebSocket upgrade (TLS first, if on).

        It holds a connection slot from here to its close; with none left, not even a
        reserved one, it is turned away before anything is read.
        """
        address = connections.address_key(_peer(tcp))
        if not self._server.per_address.take(address):
            await self._refuse_address(tcp)
            return
        try:
            slot = self._server.connections.take()
            if slot is None:
                await self._turn_away(tcp)
                return
            await self._serve_tcp(tcp, slot)
        finally:
            self._server.per_address.release(address)

    async def _serve_tcp(self, tcp: trio.SocketStream, slot: connections.ConnectionSlot) -> None:
        stream: trio.abc.Stream = tcp
        if self._server.config.ssl_context is not None:
            # https_compatible: closing never waits on the peer (a half-done handshake
            # would otherwise hold a shielded close open), as HTTPS servers do.
            stream = trio.SSLStream(
                tcp, self._server.config.ssl_context, server_side=True, https_compatible=True
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
            if self._server.config.ssl_context is None:
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
            if self._server.config.ssl_context is None:
                await http.respond(tcp, 503, AT_CAPACITY, headers={"retry-after": "1"})
        await trio.aclose_forcefully(tcp)

    async def _route(
        self, stream: trio.abc.Stream, connection: trio.Nursery, slot: connections.ConnectionSlot
    ) -> None:
        with slot.reading_head(self._server.config.head_timeout) as too_slow:
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
        policy = self._server.config.access
        if not policy.host_allowed(request.headers, bind=self._server.config.host):
            # First of all, upgrades and /health included: a page whose DNS name was
            # re-pointed here (DNS rebinding) learns nothing, not even whether keys are on.
            self._server.metrics.host_refused()
            host = b", ".join(v for n, v in request.headers if n.lower() == b"host")
            self._log_host_refused(ascii(host.decode("latin-1")[:100]), _peer(stream))
            await http.respond(
                stream, 421, "misdirected_request: this server does not serve that Host\n"
            )
            return
        path = urlsplit(request.target.decode("latin-1")).path
        if slot.reserved and not _is_health_check(request, path):
            # Taken in beyond the cap, for health checks only: others try again later.
            self._server.connections.count_refused()
            await http.respond(stream, 503, AT_CAPACITY, headers={"retry-after": "1"})
            return
        watching = path.startswith(WATCH_PREFIX)
        refusal = policy.check_key(request.headers, self._need(path, watching=watching))
        if refusal is not None:
            # Before anything else, upgrades included: no session starts without a key.
            self._server.metrics.auth_refused(refusal)
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
                request.headers, secure=self._server.config.ssl_context is not None
            ):
                await http.respond(stream, 403, "this Origin may not open sessions here\n")
                return
            if self._server.draining and not watching:  # a watched session runs here till it ends
                await http.respond(stream, 503, "draining: try another server\n")
                return
            health = self._server.engine_health
            if health.wedged and not watching:  # before the upgrade: a balancer retries
                await http.respond(
                    stream, 503, health.unavailable_body(), headers={"retry-after": "10"}
                )
                return
            if not watching and path != VIDEO_PATH:
                await http.respond(stream, 404, f"no WebSocket endpoint at {path}\n")
                return
            problem = http.handshake_problem(request)
            if problem is not None:
                await http.respond(stream, problem[0], problem[1], headers=problem[2])
                return
            limits = self._server.config.session.limits
            # Room to receive an oversized message and answer it with message_too_large;
            # beyond this, trio-websocket closes the connection with code 1009.
            ws_request = await wrap_server_stream(
                connection,
                http.ReplayStream(stream, head),
                max_message_size=2 * max(limits.max_start_bytes, limits.max_control_bytes),
            )
            host = next(v for n, v in request.headers if n.lower() == b"host")  # exactly one
            await self._server.serve_websocket(ws_request, host=host.decode("latin-1"))
        elif request.method != b"GET":
            await http.respond(stream, 405, "only GET and WebSocket upgrades here\n")
        elif path == "/health":
            await http.respond(stream, *self._server.health())
        elif path == "/metrics":
            await http.respond(
                stream, 200, self._server.metrics.exposition(), content_type=metrics.CONTENT_TYPE
            )
        elif path == "/stats":
            await http.respond(stream, 200, self._server.stats_snapshot())
        elif path == "/v1/models":
            await http.respond(stream, 200, self._server.models())
        elif path == "/" or path.startswith("/static/"):
            found = http.static_file("index.html" if path == "/" else path[len("/static/") :])
            if found is None:
                await http.respond(stream, 404, f"nothing at {path}\n")
            else:
                await http.respond(stream, 200, found[0], content_type=found[1])
        elif path.startswith(RECORDINGS_PREFIX):
            await self._serve_recording(stream, request, path)
        elif watching:  # a watch link's LL-HLS playlist and parts (a GET, not an upgrade)
            query = urlsplit(request.target.decode("latin-1")).query
            answer = await self._server.serve_watch_get(path, query, request.headers)
            await http.respond(
                stream,
                answer.status,
                answer.body,
                content_type=answer.content_type,
                headers=answer.headers,
            )
        elif path == VIDEO_PATH:
            await http.respond(stream, 426, f"{path} is a WebSocket endpoint\n")
        else:
            await http.respond(stream, 404, f"nothing at {path}\n")

    async def _serve_recording(
        self, stream: trio.abc.Stream, request: h11.Request, path: str
    ) -> None:
        """A recording played as HLS (``trio_vstream.outputs.recording_hls``)."""
        recordings = self._server.recordings
        if recordings is None:
            await http.respond(stream, 404, "recordings are not kept here (--record)\n")
            return
        answer = await recordings.answer(path, request.headers)
        await http.respond(
            stream,
            answer.status,
            answer.body,
            content_type=answer.content_type,
            headers=answer.headers,
        )

    def _need(self, path: str, *, watching: bool) -> access.Need:
        """What a request for ``path`` must carry (see `access.Need`)."""
        if path == "/stats":
            return access.Need.STATS
        if path.startswith(RECORDINGS_PREFIX):
            return access.Need.RECORDING
        if path == "/metrics":
            return access.Need.METRICS
        if path in ("/", "/health") or path.startswith("/static/"):
            return access.Need.NOTHING
        if watching and not self._server.config.watch.requires_key:
            return access.Need.NOTHING  # the link's token is the capability
        return access.Need.KEY


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
