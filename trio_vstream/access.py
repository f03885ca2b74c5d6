"""Who may use the server: API keys and the Origin check, decided from a request head.

Pure functions over h11 request headers, so they are tested without sockets and
applied before a WebSocket is accepted (a refused client never holds a session).

API keys travel as ``Authorization: Bearer KEY`` (vLLM's convention). A browser
cannot set headers on a WebSocket, so an upgrade may instead offer the key as a
``Sec-WebSocket-Protocol`` entry, ``trio-vstream.key.<KEY in unpadded
base64url>``, beside the protocol name ``trio-vstream``, which the server then
selects. Unlike a query parameter, the key stays out of URLs, access logs and
browser history; it is still visible to the page's own scripts, like any key a
page holds.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

import attrs

SUBPROTOCOL = "trio-vstream"
"""The protocol name a browser offers beside its key; the server selects it."""
KEY_SUBPROTOCOL_PREFIX = "trio-vstream.key."

Headers = Iterable[tuple[bytes, bytes]]


def key_subprotocol(key: str) -> str:
    """The ``Sec-WebSocket-Protocol`` entry that carries ``key`` (for clients)."""
    encoded = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
    return KEY_SUBPROTOCOL_PREFIX + encoded


@attrs.frozen
class AccessPolicy:
    """The server's keys and the origins allowed besides its own."""

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    """Origins (``scheme://host[:port]``) a browser page may connect from; ``*`` for any."""

    @property
    def needs_key(self) -> bool:
        return bool(self.api_keys)

    def key_accepted(self, headers: Headers) -> bool:
        """Whether the request carries one of the keys, compared in constant time."""
        if not self.api_keys:
            return True
        offered = list(_offered_keys(headers))
        accepted = False
        for candidate in offered:
            for key in self.api_keys:
                # No early exit: the time taken does not tell which key nearly matched.
                accepted |= hmac.compare_digest(candidate.encode(), key.encode())
        return accepted

    def origin_allowed(self, headers: Headers, *, secure: bool) -> bool:
        """Refuse a browser page of another site (cross-site WebSocket hijacking).

        No Origin header: not a browser, served. The server's own origin (the
        request's Host, on this scheme) is always allowed.
        """
        origin = _header(headers, b"origin")
        if origin is None:
            return True
        if "*" in self.allowed_origins:
            return True
        normalised = normalise_origin(origin)
        if normalised is None:
            return False
        host = _header(headers, b"host")
        if host is not None:
            own = normalise_origin(("https://" if secure else "http://") + host)
            if normalised == own:
                return True
        allowed = {normalise_origin(o) for o in self.allowed_origins}
        return normalised in allowed


def selected_subprotocol(proposed: Iterable[str]) -> str | None:
    """The protocol to select when accepting: ours, if the client offered it (a browser
    that offers a key entry fails the connection unless one of its entries is chosen)."""
    return SUBPROTOCOL if SUBPROTOCOL in proposed else None


def _offered_keys(headers: Headers) -> Iterable[str]:
    headers = list(headers)
    authorization = _header(headers, b"authorization")
    if authorization is not None:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            yield token.strip()
    for entry in _subprotocols(headers):
        if entry.startswith(KEY_SUBPROTOCOL_PREFIX):
            encoded = entry[len(KEY_SUBPROTOCOL_PREFIX) :]
            try:
                yield base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
            except (binascii.Error, ValueError):
                continue


def _subprotocols(headers: Headers) -> Sequence[str]:
    entries: list[str] = []
    for name, value in headers:
        if name.lower() == b"sec-websocket-protocol":
            entries.extend(p.strip() for p in value.decode("latin-1").split(",") if p.strip())
    return entries


def _header(headers: Headers, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def normalise_origin(origin: str) -> str | None:
    """``scheme://host:port`` in lower case with the default port made explicit."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    if port is None:
        port = 443 if scheme == "https" else 80
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"
