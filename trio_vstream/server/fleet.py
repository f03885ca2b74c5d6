"""A fleet: many servers behind one balancer, and a watch link that works on any of them.

A session lives on the server that runs it; a balancer (nginx, ingress-nginx, a cloud
load balancer) sends a viewer of its watch link to whichever server it likes. So each
server has a name in its fleet (``--node-name``), its watch links carry it
(``/v1/realtime/video/watch/<node>/<token>``), and a server that gets a viewer for
another node's session relays it: it opens the same link on the owner and passes
messages both ways until either side closes.

Why a relay rather than routing in the balancer: it needs nothing of the balancer (the
shipped nginx configuration, an Ingress and a cloud balancer all work unchanged), no
extra stateful component, and nothing to update when servers come and go. In
Kubernetes the owner is found by DNS (``--peer-domain``: a StatefulSet's pods behind a
headless Service); on plain hosts by a list (``--peer NAME=HOST:PORT``). The cost is
one extra hop for viewers who land on the wrong server, inside the fleet's network.

A link is client input, so the node it names is looked up, never dialled as given: a
name must be a DNS label and either listed with ``--peer`` or placed under the one
``--peer-domain``, on this server's own port. A link naming anything else gets
``watch_not_found`` at once, as does one whose owner does not answer (a killed server's
sessions are gone). A relayed request says so in a header, and is never relayed again,
so a misconfigured fleet cannot loop.

What the owner decides stays its own: the relay forwards the viewer's ``Host``,
``Origin``, ``Authorization`` and proposed subprotocols, and the owner applies the
fleet's shared access rules to them; an owner that refuses the handshake (401, 421,
503, ...) has its status and body passed back as they are.
"""

from __future__ import annotations

import contextlib
import re
import ssl
from collections.abc import Iterator, Mapping, Sequence
from typing import Final

import attrs
import h11
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    WebSocketRequest,
    wrap_client_stream,
)

from trio_vstream import protocol
from trio_vstream.logsafe import get_logger
from trio_vstream.protocol import ErrorCode

logger = get_logger(__name__)

NODE_NAME: Final = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
"""A node's name: one DNS label (lower case), so that it can be a pod's host name."""

RELAYED_HEADER: Final = b"trio-vstream-relayed-from"
"""Set on a relayed handshake to the relaying node's name: never relayed a second time."""

FORWARDED_HEADERS: Final = frozenset({b"authorization", b"origin", b"x-forwarded-for"})
"""The viewer's headers the owner sees as they were (``Host`` and subprotocols too)."""

MAX_RELAYED_MESSAGE: Final = 256 * 1024 * 1024
"""The largest message taken from an owner: above any chunk a session sends."""

MAX_RELAYED_RESPONSE: Final = 64 * 1024 * 1024
"""The largest plain response taken from an owner (an HLS segment of a few seconds)."""

RELAYED_RESPONSE_HEADERS: Final = frozenset(
    {b"content-type", b"cache-control", b"etag", b"retry-after", b"www-authenticate"}
)
"""An owner's response headers a relayed GET passes on (the rest are this server's)."""


RELAYED_GET_SECONDS: Final = 30.0
"""The most a relayed GET may take once connected (a blocking playlist reload holds
its request for a few target durations at most)."""


@attrs.frozen
class RelayedResponse:
    """An owner's answer to a relayed GET."""

    status: int
    headers: dict[str, str]
    body: bytes


def node_name(text: str) -> str:
    """``text`` if it is a valid node name, else ValueError (for the command line)."""
    if NODE_NAME.fullmatch(text) is None:
        raise ValueError(
            f"a node name is one DNS label: a-z, 0-9 and '-', at most 63, got {text!r}"
        )
    return text


def peer_address(text: str) -> tuple[str, tuple[str, int]]:
    """``NAME=HOST:PORT`` (``--peer``), checked: the name, and where it listens."""
    name, sep, address = text.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected NAME=HOST:PORT, got {text!r}")
    return node_name(name), (host.removeprefix("[").removesuffix("]"), int(port))


@attrs.frozen(kw_only=True)
class FleetConfig:
    """This server's name in its fleet, and how it finds the others."""

    node_name: str | None = attrs.field(default=None)
    """This server's name; None: a server alone (links carry no node)."""
    peers: Mapping[str, tuple[str, int]] = attrs.field(factory=dict)
    """Other servers by name (``--peer``): where to relay their viewers."""
    peer_domain: str | None = None
    """Any other node ``N`` is at ``N.<peer_domain>`` on this server's port (a headless
    Service's DNS name in Kubernetes)."""
    connect_timeout: float = 5.0
    """Seconds to reach an owner and finish its handshake."""

    @node_name.validator
    def _check_name(self, _attribute: object, value: str | None) -> None:
        if value is not None:
            node_name(value)

    @property
    def relays(self) -> bool:
        return bool(self.peers) or self.peer_domain is not None


@attrs.frozen
class Peer:
    """The server that owns a watch link, and where to reach it."""

    name: str
    host: str
    port: int


class Local:
    """A watch link of this server's own sessions."""


LOCAL: Final = Local()


def split_watch_target(target: str) -> tuple[str | None, str]:
    """A watch link's part after the prefix: ``<token>`` or ``<node>/<token>``."""
    node, slash, token = target.rpartition("/")
    return (node if slash else None), token


def locate(
    config: FleetConfig, node: str | None, *, port: int, relayed: bool
) -> Local | Peer | protocol.Error:
    """Who serves a link that names ``node``: this server, a peer, or nobody (the
    coded error that says so)."""
    if node is None or node == config.node_name:
        return LOCAL
    if relayed or NODE_NAME.fullmatch(node) is None:
        return _not_found()
    listed = config.peers.get(node)
    if listed is not None:
        return Peer(node, *listed)
    if config.peer_domain is not None:
        return Peer(node, f"{node}.{config.peer_domain}", port)
    return _not_found()


def _not_found() -> protocol.Error:
    return protocol.Error(
        ErrorCode.WATCH_NOT_FOUND,
        "no running session at this watch link (it may have ended)",
    )


def is_relayed(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == RELAYED_HEADER for name, _ in headers)


class Relay:
    """One viewer relayed to the server that owns its session."""

    def __init__(
        self,
        config: FleetConfig,
        *,
        ssl_context: ssl.SSLContext | None,
        send_timeout: float,
        close_timeout: float,
    ) -> None:
        self._config = config
        self._ssl_context = ssl_context
        self._send_timeout = send_timeout
        self._close_timeout = close_timeout
        self._relaying = 0
        self._changed = trio.Event()

    @property
    def relaying(self) -> int:
        """Viewers being relayed now."""
        return self._relaying

    async def wait_none(self) -> None:
        """Return once no viewer is being relayed (for the server's drain)."""
        while self._relaying:
            await self._changed.wait()

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """Count a relay while inside, for `wait_none`."""
        self._relaying += 1
        try:
            yield
        finally:
            self._relaying -= 1
            self._changed.set()
            self._changed = trio.Event()

    async def serve(
        self, request: WebSocketRequest, peer: Peer, host: str | None
    ) -> protocol.Error | None:
        """Open the link on ``peer``, then accept the viewer and pass messages both ways
        until either closes. Returns the error to send the viewer (after accepting it)
        when the owner cannot be reached; a handshake the owner refused is refused
        here the same way, and None returned.

        ``host``: the viewer's Host header, which the owner checks as this server did
        (the fleet's servers share ``--allowed-hosts``); without it, the owner's address.
        """
        with self._counted():
            try:
                async with trio.open_nursery() as nursery:
                    try:
                        return await self._serve(nursery, request, peer, host)
                    finally:
                        nursery.cancel_scope.cancel()
            except* ConnectionRejected as group:
                rejected = group.exceptions[0]
        # The owner refused the handshake (its connection's task raised that).
        assert isinstance(rejected, ConnectionRejected)
        await _pass_rejection(request, rejected)
        return None

    async def _serve(
        self, nursery: trio.Nursery, request: WebSocketRequest, peer: Peer, host: str | None
    ) -> protocol.Error | None:
        owner: WebSocketConnection | None = None
        with trio.move_on_after(self._config.connect_timeout):
            try:
                owner = await self._connect(nursery, request, peer, host)
            except (OSError, HandshakeError, trio.BrokenResourceError) as exc:
                logger.warning("watch relay: node %s unreachable: %s", peer.name, exc)
                return _not_found()
        if owner is None:
            logger.warning("watch relay: node %s did not answer in time", peer.name)
            return _not_found()
        try:
            viewer = await request.accept(subprotocol=owner.subprotocol)
            await self._pump(viewer, owner)
        finally:
            with trio.move_on_after(self._close_timeout) as cleanup:
                cleanup.shield = True
                await owner.aclose()
        return None

    async def get(
        self, peer: Peer, target: str, headers: Sequence[tuple[bytes, bytes]]
    ) -> RelayedResponse | protocol.Error:
        """A plain GET of a watch link's resource (its HLS playlist and parts) on the
        owner, with the viewer's ``Host``, ``Authorization`` and ``X-Forwarded-For``; the
        owner's answer, or the error that says it could not be had. A blocking playlist
        reload waits on the owner as it would here, within the owner's own deadline."""
        with (
            self._counted(),
            trio.move_on_after(self._config.connect_timeout + RELAYED_GET_SECONDS),
        ):
            try:
                return await self._get(peer, target, headers)
            except (OSError, h11.ProtocolError, trio.BrokenResourceError) as exc:
                logger.warning("watch relay: node %s unreachable: %s", peer.name, exc)
                return _not_found()
        logger.warning("watch relay: node %s did not answer in time", peer.name)
        return _not_found()

    async def _get(
        self, peer: Peer, target: str, headers: Sequence[tuple[bytes, bytes]]
    ) -> RelayedResponse | protocol.Error:
        with trio.move_on_after(self._config.connect_timeout) as connecting:
            stream = await self._open(peer)
        if connecting.cancelled_caught:
            return _not_found()
        passed = FORWARDED_HEADERS | {b"host"}
        forwarded = [(n, v) for n, v in headers if n.lower() in passed]
        if not any(n.lower() == b"host" for n, _ in forwarded):
            forwarded.append((b"host", f"{peer.host}:{peer.port}".encode()))
        forwarded.append((RELAYED_HEADER, (self._config.node_name or "").encode()))
        forwarded.append((b"connection", b"close"))
        connection = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
        async with stream:
            request = h11.Request(method="GET", target=target, headers=forwarded)
            await stream.send_all(connection.send(request) + connection.send(h11.EndOfMessage()))
            status, kept, body = 0, {}, bytearray()
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    connection.receive_data(bytes(await stream.receive_some(65536)))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    kept = {
                        name.decode("latin-1"): value.decode("latin-1")
                        for name, value in event.headers
                        if name in RELAYED_RESPONSE_HEADERS
                    }
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > MAX_RELAYED_RESPONSE:
                        raise h11.ProtocolError("the owner's answer is too large to relay")
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    return RelayedResponse(status, kept, bytes(body))

    async def _open(self, peer: Peer) -> trio.SocketStream | trio.SSLStream[trio.SocketStream]:
        """A connection to ``peer``: TLS when this server serves TLS."""
        stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
        stream = await trio.open_tcp_stream(peer.host, peer.port)
        if self._ssl_context is not None:
            stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=peer.host)
            await stream.do_handshake()
        return stream

    async def _connect(
        self, nursery: trio.Nursery, request: WebSocketRequest, peer: Peer, host: str | None
    ) -> WebSocketConnection:
        stream = await self._open(peer)
        headers = [(n, v) for n, v in request.headers if n.lower() in FORWARDED_HEADERS]
        headers.append((RELAYED_HEADER, (self._config.node_name or "").encode()))
        return await wrap_client_stream(
            nursery,
            stream,
            host or f"{peer.host}:{peer.port}",
            request.path,
            subprotocols=request.proposed_subprotocols,
            extra_headers=headers,
            max_message_size=MAX_RELAYED_MESSAGE,
        )

    async def _pump(self, viewer: WebSocketConnection, owner: WebSocketConnection) -> None:
        """Owner to viewer and back, until one side closes; the other is then closed
        with the same code and reason."""
        async with trio.open_nursery() as nursery:

            async def down() -> None:
                try:
                    while True:
                        message = await owner.get_message()
                        with trio.fail_after(self._send_timeout):
                            await viewer.send_message(message)
                except ConnectionClosed:
                    pass
                except trio.TooSlowError:
                    logger.info("watch relay: a viewer stopped reading; closed")
                await _close_like(viewer, owner, self._close_timeout)
                nursery.cancel_scope.cancel()

            async def up() -> None:
                try:
                    while True:
                        await owner.send_message(await viewer.get_message())
                except ConnectionClosed:
                    pass
                await _close_like(owner, viewer, self._close_timeout)
                nursery.cancel_scope.cancel()

            nursery.start_soon(down)
            nursery.start_soon(up)


async def _close_like(ws: WebSocketConnection, closed: WebSocketConnection, timeout: float) -> None:
    """Close ``ws`` as ``closed`` was closed (its code and reason), within ``timeout``."""
    reason = closed.closed
    code, text = (1000, None) if reason is None else (reason.code, reason.reason)
    if code == 1005:  # closed with no status: a normal close, as far as anyone can tell
        code = 1000
    elif code == 1006:  # the other side vanished (a killed server, a dropped network)
        code, text = 1001, "the other side of the relay went away"
    with trio.move_on_after(timeout) as scope:
        scope.shield = True
        await ws.aclose(code, text)


async def _pass_rejection(request: WebSocketRequest, rejected: ConnectionRejected) -> None:
    """The owner's refusal, given to the viewer as it was."""
    kept = {b"content-type", b"retry-after", b"www-authenticate"}
    headers = [(n, v) for n, v in (rejected.headers or []) if n.lower() in kept]
    await request.reject(rejected.status_code, extra_headers=headers, body=rejected.body)
