"""One session: from ``session.start`` to its terminal message, in one nursery.

``session`` holds `Session`: its nursery, its generation loop (the engine's blocking
steps through ``trio.to_thread``) and its stall guard. The rest are the parts it is made
of, each a unit of its own: ``prepare`` (from ``session.start`` to ``video.start``),
``receiving`` (the receive loop: each message the client sends, read and answered),
``delivery`` (the deliverer: each chunk encoded in a thread and sent with its metadata,
the encoder and its trailer), ``calls`` (the engine and encoder calls, each abandonable),
``request`` (the validated request), ``resources`` (what it borrows from the server),
``interactions`` with ``interaction_queue`` and ``scripts`` (steering), ``pacing``
(playback pacing), ``sending`` (the one way to write to the socket), ``endings`` (which
reason ends it, and what the client is told) and ``early_messages`` (what arrives while
it prepares).

`Session` and `SessionConfig` are imported on first use (PEP 562), so that the pure
units (``endings``, ``pacing``, ...) can be imported without the whole session.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["Session", "SessionConfig"]

if TYPE_CHECKING:
    from trio_vstream.session.session import Session, SessionConfig


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'trio_vstream.session' has no attribute {name!r}")
    return getattr(importlib.import_module("trio_vstream.session.session"), name)
