"""Log lines a client cannot forge: what a client sent is escaped before it is logged.

Client text reaches the log in many places: a refused ``model`` or an unknown field's
name inside an error message, a prompt word an engine ignores, a LoRA path, an
exception's text. Written as is, a newline in it starts a line of the client's making
(``2026-01-01 ... ERROR ...``) that a reader or a log shipper takes for the server's,
a carriage return or an ANSI escape rewrites what a terminal shows, a bidi override
reorders it, and a lone surrogate (valid in JSON) makes the handler fail to encode
the line at all.

So the escaping is done once, for every record of the project's loggers, rather than
at each call site (the next log line that mentions client text would be the one that
forgot): `get_logger` gives each module its logger with `ClientTextFilter` on it. The
filter escapes the formatted message with `log_safe` and bounds its length, and
renders the record's traceback itself, escaping only the exception messages in it:
a traceback's own line breaks are kept (it is meant to be read as lines), while the
text of an exception, which may quote a client, is escaped like a message. The
command line puts the same filter on its handlers too, for the records of libraries
(trio-websocket logs what it receives at debug level).

What is kept is an allow-list: printable characters (`str.isprintable`, plus the
space). Everything else is written the way ``repr`` writes it (``\\n``, ``\\x1b``,
``\\u2028``, ``\\ud800``), so the line still shows what was sent.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Final

__all__ = ["MAX_LOGGED_CHARS", "ClientTextFilter", "escape_on_handlers", "get_logger", "log_safe"]

MAX_LOGGED_CHARS: Final = 4000
"""The longest message (and exception text) written: a client's 4 MiB ``model`` name
would otherwise be one 4 MiB log line per session. Far above any line the server
writes of its own."""

_ESCAPED: Final = "_trio_vstream_log_safe"
"""Marks a record already escaped (the logger's filter and a handler's may both see it)."""


def log_safe(text: str, limit: int | None = MAX_LOGGED_CHARS) -> str:
    """``text`` as one printable line: characters outside the allow-list escaped as
    ``repr`` does, and at most ``limit`` characters of it kept (the rest counted)."""
    cut = 0
    if limit is not None and len(text) > limit:
        cut = len(text) - limit
        text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return f"{text}... ({cut} more characters)" if cut else text


class ClientTextFilter(logging.Filter):
    """Escapes a record's message and its exception text (see the module's docstring).

    Never refuses a record. A record whose arguments do not fit its format is left as
    it is, for the handler to report as it always does.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _ESCAPED, False):
            return True
        try:
            message = record.getMessage()
        except Exception:
            return True
        record.msg = log_safe(message)
        record.args = ()
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = _safe_traceback(*record.exc_info)
        setattr(record, _ESCAPED, True)
        return True


_FILTER: Final = ClientTextFilter()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with `ClientTextFilter` on it (once)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, ClientTextFilter) for f in logger.filters):
        logger.addFilter(_FILTER)
    return logger


def escape_on_handlers(handlers: list[logging.Handler]) -> None:
    """Put `ClientTextFilter` on ``handlers`` (once each): then the records of other
    packages' loggers that reach them are escaped too."""
    for handler in handlers:
        if not any(isinstance(f, ClientTextFilter) for f in handler.filters):
            handler.addFilter(_FILTER)


def _safe_traceback(
    kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
) -> str:
    """What `logging.Formatter.formatException` writes, with every exception's own text
    (its message and notes, in chained exceptions and groups too) escaped.

    The frames are the server's files and lines; only the messages can carry a client's
    text, so only they are escaped, and the traceback keeps its shape.
    """
    assert kind is not None and value is not None
    root = traceback.TracebackException(kind, value, tb, compact=True)
    pending = [root]
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        original = node.format_exception_only

        def escaped(original: Any = original, **kwargs: Any) -> Iterator[str]:
            for line in original(**kwargs):
                yield log_safe(line.removesuffix("\n")) + "\n"

        # Replaced on this one instance, which mypy refuses for a method (and the
        # wrapper's signature, with its default argument, differs from the method's).
        node.format_exception_only = escaped  # type: ignore[method-assign,assignment]
        pending += [n for n in (node.__cause__, node.__context__) if n is not None]
        pending += node.exceptions or []
    return "".join(root.format()).removesuffix("\n")
