"""Connection slots: a cap on open connections below the descriptor limit, and a reserve
that keeps ``/health`` answering at the cap.

Every accepted connection holds a file descriptor until it closes. Uncapped, idle
connections (a slowloris client, or a few hundred sockets that never send a byte) take
them all: ``accept()`` then fails with ``EMFILE``, Trio's listener logs it and retries
every 0.1 s, and nothing is served, ``/health`` included, until a connection closes.
Reproduced: 300 idle connections at a limit of 256 descriptors. So the server holds
connection slots (``ConnectionSlots``), taken at accept and given back at close:

* **Ordinary slots**: at most ``max_connections`` connections are served at once,
  whatever they are: a plain GET, an upgrade still waiting for its ``session.start``,
  a session, a viewer. The default (``default_max_connections``) is the descriptor
  limit less what the rest of the process needs, so the cap comes long before
  ``EMFILE``, and the listener never stalls on it.
* **The head timeout**: each connection must send its whole request head (after the TLS
  handshake, if any) within ``--head-timeout`` seconds, or it is closed unanswered. A
  slow head holds a slot for seconds, not for the start timeout or forever.
* **Reserved slots**: at the cap, ``RESERVED_SLOTS`` more connections are taken in,
  with a head timeout of at most ``RESERVED_HEAD_TIMEOUT``. They serve ``GET /health``
  only, as usual (200, or 503 while draining); any other request gets a 503 with
  ``Retry-After`` at once, so a load balancer or a client retries elsewhere or later.
  When all are taken, a new connection evicts the oldest one still waiting for its
  head. A health check sends its head at once, so a reserve filled with idle sockets
  does not keep it out: to do that, a client would have to open a reserve's worth of
  connections in the moment between a health check's connect and its head.
* **Turned away**: when every reserved slot holds a connection past its head (being
  answered, for an instant), a new connection gets a 503 written without reading its
  request, and is closed (with TLS, only closed: a handshake would hold it).

* **Per address** (``--max-connections-per-ip``, off by default): one client address may
  hold at most that many connections (sessions, viewers, requests) at once; more get a
  429 with ``Retry-After`` (with TLS, only a close), before any slot is taken. So one
  host cannot fill the slots above by itself. IPv6 addresses count per /64, the block a
  single host is usually given. Behind a proxy every connection comes from the proxy:
  leave it off there and let the proxy limit its clients.

Session slots (``--max-sessions``) are another matter: an upgraded connection takes
one only when its ``session.start`` arrives (see ``trio_vstream.server.app``).
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Iterator

import trio

try:
    import resource
except ImportError:  # pragma: no cover - not on Windows
    # Typed as the module, which this platform has; None only where it is missing.
    resource = None  # type: ignore[assignment]

FD_RESERVE = 64
"""Descriptors kept for the process itself: standard streams, log files, the listeners,
the event loop's own, and the engine's (model files, a GPU's device files)."""
FDS_PER_SESSION = 4
"""Descriptors a session may hold besides its connection: a recording's files (``--record``),
an image URL's fetch. Its viewers are connections, and have slots of their own."""
RESERVED_SLOTS = 8
"""Connections taken in beyond the cap, for ``GET /health`` only."""
RESERVED_HEAD_TIMEOUT = 1.0
"""Seconds a connection in a reserved slot gets for its head (or the head timeout, if
shorter): a health check sends its head at once."""
UNLIMITED_DESCRIPTORS = 65536
"""The descriptor limit assumed when the limit is unlimited (or cannot be read)."""


def descriptor_limit() -> int:
    """This process's soft limit on open files (``RLIMIT_NOFILE``, ``ulimit -n``)."""
    if resource is None:
        return UNLIMITED_DESCRIPTORS
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return UNLIMITED_DESCRIPTORS
    return int(soft)


def default_max_connections(max_sessions: int, descriptors: int | None = None) -> int:
    """The default ``--max-connections``: the descriptor limit (default: this process's
    ``descriptor_limit()``) less ``FD_RESERVE``, the ``RESERVED_SLOTS`` and
    ``FDS_PER_SESSION`` for each of ``max_sessions``; at least 1.

    At 1024 descriptors (a common default) and 16 sessions that is 888 connections; at
    256, 120.
    """
    if descriptors is None:
        descriptors = descriptor_limit()
    spare = descriptors - FD_RESERVE - RESERVED_SLOTS - FDS_PER_SESSION * max_sessions
    return max(1, spare)


class ConnectionSlot:
    """One connection's slot: ordinary, or one of the reserve for ``/health``."""

    def __init__(self, slots: ConnectionSlots, *, reserved: bool) -> None:
        self.reserved = reserved
        self._slots = slots
        self._released = False
        self.evicted = False
        """A newer connection took this reserved slot while this one waited for its head."""

    @contextlib.contextmanager
    def reading_head(self, timeout: float) -> Iterator[trio.CancelScope]:
        """The scope to read the request head in: cancelled after ``timeout`` seconds (at
        most ``RESERVED_HEAD_TIMEOUT`` for a reserved slot), or when a reserved slot is
        evicted. Check ``cancelled_caught`` afterwards: the connection then goes unanswered."""
        slots = self._slots
        if self.reserved:
            timeout = min(timeout, RESERVED_HEAD_TIMEOUT)
        with trio.move_on_after(timeout) as scope:
            if self.reserved:
                slots._waiting_heads[self] = scope
            try:
                yield scope
            finally:
                slots._waiting_heads.pop(self, None)
        if scope.cancelled_caught and not self.evicted:
            slots.head_timeouts += 1

    def release(self) -> None:
        """The connection is closed: its slot is free (idempotent)."""
        if self._released:
            return
        self._released = True
        if self.reserved:
            self._slots.reserved_open -= 1
        else:
            self._slots.ordinary_open -= 1


class ConnectionSlots:
    """The server's connection slots: ``limit`` ordinary ones, ``reserved`` for ``/health``.

    Plain counters on the event loop (no await between a check and its update), read
    by ``/metrics`` at scrape time.
    """

    def __init__(self, limit: int, reserved: int | None = None) -> None:
        self.limit = limit
        self.reserved = RESERVED_SLOTS if reserved is None else reserved
        self.ordinary_open = 0
        self.reserved_open = 0
        self.refused = 0
        """Connections turned away at the cap: a 503, an eviction, or a close unanswered."""
        self.head_timeouts = 0
        """Connections closed for not sending their request head within the head timeout."""
        self._waiting_heads: dict[ConnectionSlot, trio.CancelScope] = {}
        """Reserved slots still reading their head, oldest first: the ones to evict."""

    @property
    def open(self) -> int:
        """Connections holding a slot now, reserved ones included."""
        return self.ordinary_open + self.reserved_open

    def take(self) -> ConnectionSlot | None:
        """A slot for a connection just accepted, or None: turn it away at once."""
        if self.ordinary_open < self.limit:
            self.ordinary_open += 1
            return ConnectionSlot(self, reserved=False)
        if self.reserved_open < self.reserved:
            self.reserved_open += 1
            return ConnectionSlot(self, reserved=True)
        if self._waiting_heads:
            # The oldest connection still without a head gives its place to this one.
            oldest = next(iter(self._waiting_heads))
            self._waiting_heads.pop(oldest).cancel()
            oldest.evicted = True
            oldest._released = True  # its count is this connection's now
            self.refused += 1
            return ConnectionSlot(self, reserved=True)
        self.refused += 1
        return None

    def count_refused(self) -> None:
        """A connection in a reserved slot asked for something else than ``/health``."""
        self.refused += 1


def address_key(address: str) -> str:
    """What the per-address cap counts a peer address as: an IPv4 address (an IPv4-mapped
    IPv6 one too) as itself, an IPv6 address as its /64; anything else as given."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # a zone id names no host
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class PerAddress:
    """Connections open per client address (`address_key`), capped at ``limit`` (None:
    counted, never capped). Plain counters on the event loop, like `ConnectionSlots`."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.refused = 0
        """Connections turned away for their address's count."""
        self._open: dict[str, int] = {}

    def take(self, key: str) -> bool:
        """Count a connection just accepted from ``key``; False (nothing counted) when
        that address has ``limit`` open already."""
        count = self._open.get(key, 0)
        if self.limit is not None and count >= self.limit:
            self.refused += 1
            return False
        self._open[key] = count + 1
        return True

    def release(self, key: str) -> None:
        count = self._open[key] - 1
        if count:
            self._open[key] = count
        else:
            del self._open[key]  # no entry left behind per address ever seen

    def open_from(self, key: str) -> int:
        return self._open.get(key, 0)


__all__ = [
    "FDS_PER_SESSION",
    "FD_RESERVE",
    "RESERVED_HEAD_TIMEOUT",
    "RESERVED_SLOTS",
    "ConnectionSlot",
    "ConnectionSlots",
    "PerAddress",
    "address_key",
    "default_max_connections",
    "descriptor_limit",
]
