"""`ServerConfig`, what a `VideoServer` is told, and `VIDEO_PATH`, where sessions start.

Apart from the server so that the modules that serve a connection for it
(``trio_vstream.server.routing``) can name what they read without importing the server
itself, which sits above them.
"""

from __future__ import annotations

import os
import ssl

import attrs

from trio_vstream.outputs.watch import WatchConfig
from trio_vstream.server import access
from trio_vstream.server.fleet import FleetConfig
from trio_vstream.session.session import SessionConfig

__all__ = ["VIDEO_PATH", "ServerConfig"]

VIDEO_PATH = "/v1/realtime/video"
"""The WebSocket endpoint where sessions start."""


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
    fleet: FleetConfig = attrs.field(factory=FleetConfig)
    """This server's name among others behind one balancer, and where they are: a
    viewer whose link names another node is relayed to it (``trio_vstream.server.fleet``)."""
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
