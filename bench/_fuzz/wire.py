"""Fuzz inputs as they go on the wire: JSON that ``json.dumps`` cannot write (``Raw``),
sizes counted in bytes, and padded inputs built only when sent.

Shared by the strategies (which make inputs), the shrinker (which makes smaller ones)
and the client (which sends them).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final, TypeAlias

import attrs

Wire: TypeAlias = str | bytes
"""One WebSocket message as sent: a text frame (str) or a binary frame (bytes)."""


@attrs.frozen
class Raw:
    """JSON text spliced in verbatim: ``NaN``, ``1e400``, 5000-digit numbers, deep
    nesting; what a hostile client can send but ``json.dumps`` will not write."""

    text: str


class _Absent:
    """Marks an optional field that a strategy left out."""


ABSENT: Final = _Absent()


_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def _has_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def to_json(value: Any, *, ascii: bool = True) -> str:
    """Serialise a fuzz value. Strings with lone surrogates are always written as
    ``\\udXXX`` escapes: a text frame must be UTF-8, so that is the only way to send them."""
    if isinstance(value, Raw):
        return value.text
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=ascii or _has_surrogate(value))
    if isinstance(value, list | tuple):
        return "[" + ",".join(to_json(item, ascii=ascii) for item in value) + "]"
    if isinstance(value, dict):
        items = (
            f"{to_json(str(k), ascii=ascii)}:{to_json(v, ascii=ascii)}" for k, v in value.items()
        )
        return "{" + ",".join(items) + "}"
    raise TypeError(f"not a fuzz JSON value: {type(value).__name__}")


def wire_size(wire: Wire) -> int:
    """Bytes on the wire, which is what the server's size limits count."""
    return len(wire) if isinstance(wire, bytes) else len(wire.encode("utf-8"))


@attrs.frozen
class Padded:
    """``head + unit * count + tail``, built only when sent: size-limit inputs are
    megabytes each, and thousands of them held as strings would fill the memory."""

    head: str
    unit: str
    count: int
    tail: str
    binary: bool

    def build(self) -> Wire:
        text = self.head + self.unit * self.count + self.tail
        return text.encode("utf-8") if self.binary else text


@attrs.frozen
class PaddedFrame:
    """An input video frame, ``head`` (an image), then zeros up to ``size`` bytes, built
    only when sent: frames over the 1 MiB cap are megabytes, like `Padded` inputs."""

    head: bytes
    size: int

    def build(self) -> bytes:
        return self.head + bytes(max(0, self.size - len(self.head)))


@attrs.frozen
class FuzzInput:
    """One message to send, labelled with the strategy that made it (for the summary)."""

    kind: str
    payload: Wire | Padded | PaddedFrame

    @property
    def wire(self) -> Wire:
        payload = self.payload
        return payload.build() if isinstance(payload, Padded | PaddedFrame) else payload
