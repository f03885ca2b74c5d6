"""The WebSocket server: admission, one guarded task per connection, graceful shutdown.

trio-websocket runs each connection's handler in a shared nursery, so an
exception escaping one handler would cancel every other connection and the
listener with it. ``_handle_connection`` is therefore a firewall: whatever
happens inside a session is logged with its request id and stays there; only
cancellation passes through.

Shutdown follows the hypercorn pattern: stop listening, ask every session to
wind down (streaming sessions stop their engine and end with a terminal
message), and after a grace period abort what is left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, serve_websocket

from trio_vstream import protocol
from trio_vstream.engines.base import Engine
from trio_vstream.protocol import ErrorCode
from trio_vstream.session import (
    Outcome,
    ServerResources,
    Session,
    SessionConfig,
    SessionStats,
    SessionSummary,
)

logger = logging.getLogger(__name__)

VIDEO_PATH = "/v1/realtime/video"


@attrs.frozen(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port; ``VideoServer.port`` tells which."""
    max_sessions: int = 16
    shutdown_grace: float = 10.0
    """Seconds running sessions get to finish after a shutdown request."""
    session: SessionConfig = attrs.field(factory=SessionConfig)


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
    ) -> None:
        self.engine = engine
        self.config = config
        self.stats = SessionStats()
        self.port: int | None = None
        self._on_session_end = on_session_end
        self._sessions: set[Session] = set()
        self._shutdown_requested = trio.Event()
        self._closing = False
        steps = engine.max_concurrent_steps
        self._resources = ServerResources(
            engine=engine,
            config=config.session,
            stats=self.stats,
            step_limiter=trio.CapacityLimiter(steps) if steps else None,
            # Each session runs at most two blocking calls at once (engine, encoder).
            thread_limiter=trio.CapacityLimiter(2 * config.max_sessions + 4),
        )

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"ws://{host}:{self.port}{VIDEO_PATH}"

    def shutdown(self) -> None:
        """Begin a graceful shutdown (idempotent)."""
        self._shutdown_requested.set()

    @property
    def shutting_down(self) -> bool:
        return self._shutdown_requested.is_set()

    async def run(
        self, *, task_status: trio.TaskStatus[VideoServer] = trio.TASK_STATUS_IGNORED
    ) -> None:
        limits = self.config.session.limits
        # Room to receive an oversized message and answer it with message_too_large;
        # beyond this, trio-websocket closes the connection with code 1009.
        max_message = 2 * max(limits.max_start_bytes, limits.max_control_bytes)
        async with trio.open_nursery() as handlers:
            async with trio.open_nursery() as listener:
                ws_server = await listener.start(
                    lambda task_status: serve_websocket(
                        self._handle_connection,
                        self.config.host,
                        self.config.port,
                        ssl_context=None,
                        handler_nursery=handlers,
                        max_message_size=max_message,
                        task_status=task_status,
                    )
                )
                self.port = ws_server.port
                logger.info("serving %s with engine %s", self.url, self.engine.name)
                task_status.started(self)
                await self._shutdown_requested.wait()
                listener.cancel_scope.cancel()
            await self._drain(handlers)

    async def _drain(self, handlers: trio.Nursery) -> None:
        """Wind sessions down, then abort stragglers, then cancel what remains."""
        self._closing = True
        logger.info("shutting down: %d session(s) running", len(self._sessions))
        for session in list(self._sessions):
            session.shutdown()
        with trio.move_on_after(self.config.shutdown_grace):
            while self._sessions:
                await trio.sleep(0.01)
        for session in list(self._sessions):
            session.abort(Outcome.SHUTDOWN, (ErrorCode.SERVER_SHUTDOWN, "Server is shutting down"))
        with trio.move_on_after(self.config.session.close_timeout):
            while self._sessions:
                await trio.sleep(0.01)
        # Connections still in their handshake, and anything left, go now.
        handlers.cancel_scope.cancel()

    async def _handle_connection(self, request: WebSocketRequest) -> None:
        try:
            await self._serve_request(request)
        except BaseException as exc:
            # Let cancellation through; keep everything else inside this connection.
            cancelled, rest = _split_cancelled(exc)
            if rest is not None:
                logger.error("connection handler failed", exc_info=rest)
            if cancelled is not None:
                raise cancelled from None

    async def _serve_request(self, request: WebSocketRequest) -> None:
        path = urlsplit(request.path).path
        if path != VIDEO_PATH:
            await request.reject(404, body=f"no WebSocket endpoint at {path}\n".encode())
            return
        ws = await request.accept()
        refusal: protocol.Error | None = None
        if self._closing:
            refusal = protocol.Error(ErrorCode.SERVER_SHUTDOWN, "Server is shutting down")
        elif len(self._sessions) >= self.config.max_sessions:
            refusal = protocol.Error(
                ErrorCode.SERVER_BUSY,
                f"Server busy: {self.config.max_sessions} sessions running; try again later",
            )
        if refusal is not None:
            with trio.move_on_after(self.config.session.close_timeout):
                try:
                    await ws.send_message(refusal.to_json())
                    await ws.aclose()
                except ConnectionClosed:
                    pass
            return
        session = Session(ws, self._resources)
        self._sessions.add(session)
        try:
            summary = await session.run()
        finally:
            self._sessions.discard(session)
        if self._on_session_end is not None:
            self._on_session_end(summary)


def _split_cancelled(
    exc: BaseException,
) -> tuple[BaseException | None, BaseException | None]:
    """Separate cancellation (to re-raise) from real errors (to log), groups included."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split((trio.Cancelled, KeyboardInterrupt, SystemExit))
    if isinstance(exc, trio.Cancelled | KeyboardInterrupt | SystemExit):
        return exc, None
    return None, exc


async def serve(
    engine: Engine,
    config: ServerConfig = ServerConfig(),
    *,
    task_status: trio.TaskStatus[VideoServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled: the one-call form of ``VideoServer(...).run()``."""
    await VideoServer(engine, config).run(task_status=task_status)


__all__ = ["VIDEO_PATH", "ServerConfig", "VideoServer", "serve"]
