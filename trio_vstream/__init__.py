"""trio_vstream: stream generated video from diffusion models over WebSockets, on Trio.

The public surface is small: run a ``VideoServer`` (or ``python -m trio_vstream``)
with an engine from ``trio_vstream.engines``; speak the wire protocol with
``trio_vstream.protocol``.
"""

from trio_vstream.engines import Engine, EngineStream, load_engine
from trio_vstream.protocol import Limits
from trio_vstream.server import ServerConfig, VideoServer, serve
from trio_vstream.session import SessionConfig

__version__ = "0.1.0"

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
