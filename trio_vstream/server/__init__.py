"""The listener: one port, its connections, who may use it, and what it counts.

``app`` holds `VideoServer`, the nursery that accepts connections and runs sessions,
and ``config`` its `ServerConfig`; ``routing`` serves one connection from accept to
close (its slots, its head's checks, then an answer or a WebSocket), and ``http`` the
plain-HTTP side of it (the player page, health, stats, metrics); ``access`` decides who
may come in (Host, API keys, Origin); ``connections`` bounds connections per address and
idle ones; ``running`` counts the running sessions and drains them at a shutdown;
``slots`` holds the session slots and the short claims of upgrades not yet started;
``health`` is the wedge check, when the engine counts as wedged; ``documents`` writes
``/stats`` and ``/v1/models``; ``metrics`` is the Prometheus registry; ``memory`` hands
freed memory back to the system; ``last_resort`` is the process's way out when a stop
cannot finish.

The server's public names (`VideoServer`, `ServerConfig`, `serve`) are imported on
first use (PEP 562), so that importing ``trio_vstream.server.access`` (as the client's
command line does) does not load the session, the encoder and the engines with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["ServerConfig", "VideoServer", "serve"]

if TYPE_CHECKING:
    from trio_vstream.server.app import ServerConfig, VideoServer, serve


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'trio_vstream.server' has no attribute {name!r}")
    return getattr(importlib.import_module("trio_vstream.server.app"), name)
