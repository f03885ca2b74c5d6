"""Client-given text in the engine's messages and log lines: short and escaped.

A request's keys, paths and values end up in ``invalid_request`` messages (sent back to
the client, and shown to viewers) and in the log. Whatever the client sent, what is
shown is bounded in length and has its control characters escaped, so one request can
neither forge a log line nor make an error message megabytes long.
"""

from __future__ import annotations

import re
import reprlib

_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
"""Names shown as they are (most keys and file names); anything else is quoted."""

_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlong = 40
_REPR.maxlist = _REPR.maxtuple = 6
_REPR.maxdict = 4
_REPR.maxlevel = 2


def shown(value: object) -> str:
    """``value`` for a message: a plain name as it is, anything else as a bounded
    ``repr`` (strings quoted, control characters escaped, long values cut in the middle,
    lists and objects cut after a few entries)."""
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return value
    return quoted(value)


def quoted(value: object) -> str:
    """``value`` as a bounded ``repr``, strings always quoted (where the message shows
    that a value is a string)."""
    return _REPR.repr(value)
