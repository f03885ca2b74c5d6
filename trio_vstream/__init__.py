"""trio_vstream: stream generated video from diffusion models over WebSockets, on Trio.

The public surface is small: run a ``VideoServer`` (or ``python -m trio_vstream``)
with an engine from ``trio_vstream.engines``; speak the wire protocol with
``trio_vstream.protocol``. The names below are imported on first use (PEP 562),
so that ``import trio_vstream.protocol`` loads the pure protocol alone, not the
server with PyAV and trio-websocket.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The one place the version is written: pyproject.toml takes it from here
# ([tool.setuptools.dynamic]), and `python -m trio_vstream --version` prints it. Keep it a
# plain string literal: setuptools reads it from this file without importing the package.
__version__ = "0.1.0"

_LAZY = {
    "Engine": "trio_vstream.engines",
    "EngineStream": "trio_vstream.engines",
    "load_engine": "trio_vstream.engines",
    "Limits": "trio_vstream.protocol",
    "ServerConfig": "trio_vstream.server.app",
    "VideoServer": "trio_vstream.server.app",
    "serve": "trio_vstream.server.app",
    "SessionConfig": "trio_vstream.session.session",
}

__all__ = [
    "Engine",
    "EngineStream",
    "Limits",
    "ServerConfig",
    "SessionConfig",
    "VideoServer",
    "__version__",
    "load_engine",
    "serve",
]

if TYPE_CHECKING:
    from trio_vstream.engines import Engine, EngineStream, load_engine
    from trio_vstream.protocol import Limits
    from trio_vstream.server.app import ServerConfig, VideoServer, serve
    from trio_vstream.session.session import SessionConfig


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trio_vstream' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
