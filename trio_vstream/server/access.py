"""Who may use the server: the Host check, API keys and the Origin check, from a request head.

Pure functions over h11 request headers, so they are tested without sockets and
applied before a WebSocket is accepted (a refused client never holds a session).

API keys travel as ``Authorization: Bearer KEY`` (vLLM's convention). A browser
cannot set headers on a WebSocket, so an upgrade may instead offer the key as a
``Sec-WebSocket-Protocol`` entry, ``trio-vstream.key.<KEY in unpadded
base64url>``, beside the protocol name ``trio-vstream``, which the server then
selects. Unlike a query parameter, the key stays out of URLs, access logs and
browser history; it is still visible to the page's own scripts, like any key a
page holds.

The Host check comes first, on every request: it is what stops DNS rebinding. A
page on ``attacker.example`` whose name is re-pointed to 127.0.0.1 reaches a local
server as the same origin it came from (Origin and Host both name
``attacker.example``), so the Origin check alone lets it in. Only a DNS *name* can
be re-pointed like that: a server that answers only the names it is meant to serve
(``localhost``, the name it was bound to, those given with ``--allowed-hosts``) and
IP addresses cannot be reached through someone else's name.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hmac
import ipaddress
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import urlsplit

import attrs

SUBPROTOCOL = "trio-vstream"
"""The protocol name a browser offers beside its key; the server selects it."""
KEY_SUBPROTOCOL_PREFIX = "trio-vstream.key."

Headers = Iterable[tuple[bytes, bytes]]

SHORT_KEY = 16
"""Keys shorter than this are warned about at start: guessable by a patient client."""

LOOPBACK_NAMES = frozenset({"localhost"})
"""Names that always mean this machine (browsers never resolve them through DNS)."""

_HOST_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")
_PORT = re.compile(r"[0-9]{1,5}")


class Need(enum.Enum):
    """What a request must carry, by what it asks for."""

    NOTHING = enum.auto()
    """The page's files, /health, a watch link whose token is the capability."""
    KEY = enum.auto()
    """Sessions and /v1/models: an API key (or an admin key) when the server has keys."""
    METRICS = enum.auto()
    """/metrics: aggregate figures. An admin key when the server has admin keys, else an
    API key when it has those: a Prometheus scraper carries a bearer token either way."""
    STATS = enum.auto()
    """/stats: every session's request id and errors. An admin key; a server with API
    keys but no admin key shows it to nobody (a key holder must not read other users'
    sessions); a server without any key shows it to its local users, as before."""
    RECORDING = enum.auto()
    """/v1/recordings/: a recorded session's video. An admin key when the server has admin
    keys, else an API key when it has those (as `METRICS`): without admin keys, the
    request id, 128 random bits told only to the session's client, is what keeps one
    user from another's recordings."""


class Refusal(enum.StrEnum):
    """Why a request's key was refused: the ``reason`` label of
    ``trio_vstream_auth_refused_total`` and the code that starts the response body."""

    MISSING = "missing"
    INVALID = "invalid"
    TOO_MANY = "too_many"
    """More than one key entry: each would be compared, so one head could make the
    server try a thousand guesses at once."""
    NOT_ADMIN = "not_admin"

    @property
    def status(self) -> int:
        return {Refusal.TOO_MANY: 400, Refusal.NOT_ADMIN: 403}.get(self, 401)

    @property
    def message(self) -> str:
        """The response body: the code first, for clients to branch on."""
        text = {
            Refusal.MISSING: "a valid API key is required (Authorization: Bearer KEY)",
            Refusal.INVALID: "a valid API key is required (Authorization: Bearer KEY)",
            Refusal.TOO_MANY: "offer one API key per request, in Authorization or in one "
            f"{KEY_SUBPROTOCOL_PREFIX} entry",
            Refusal.NOT_ADMIN: "this needs an admin key (the server's --admin-api-key)",
        }[self]
        return f"{self.value}: {text}\n"


def key_subprotocol(key: str) -> str:
    """The ``Sec-WebSocket-Protocol`` entry that carries ``key`` (for clients)."""
    encoded = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
    return KEY_SUBPROTOCOL_PREFIX + encoded


def normalise_allowed_hosts(entries: Iterable[str]) -> tuple[str, ...]:
    """``--allowed-hosts`` entries in the form the check compares: lower case, addresses
    in their short form, without brackets. ``*`` allows any host, ``.example.org`` that
    name and its subdomains (Django's ``ALLOWED_HOSTS``). Raises ``ValueError`` naming
    an entry that is not a bare name or address (a port or scheme would never match)."""
    normalised: list[str] = []
    for entry in entries:
        text = entry.strip().lower()
        if text == "*":
            normalised.append(text)
            continue
        dot = "." if text.startswith(".") else ""
        host = _host_name_or_address(text.removeprefix(".").removeprefix("[").removesuffix("]"))
        if host is None or (dot and _ip(host) is not None):
            raise ValueError(
                f"--allowed-hosts: {entry!r} is not a host name like video.example.org, "
                "a .example.org suffix, an address or *"
            )
        normalised.append(dot + host)
    return tuple(dict.fromkeys(normalised))


@attrs.frozen
class AccessPolicy:
    """The server's keys, the host names it serves and the origins allowed besides its own."""

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    """Origins (``scheme://host[:port]``) a browser page may connect from; ``*`` for any."""
    admin_keys: tuple[str, ...] = ()
    """Keys for the operator's endpoints (``/stats``, ``/metrics``); also API keys."""
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), converter=normalise_allowed_hosts)
    """Host names served besides the loopback ones and the bind address (see `host_allowed`)."""

    @property
    def needs_key(self) -> bool:
        return bool(self.api_keys)

    def key_accepted(self, headers: Headers) -> bool:
        """Whether the request may open a session (`Need.KEY`)."""
        return self.check_key(headers, Need.KEY) is None

    def check_key(self, headers: Headers, need: Need) -> Refusal | None:
        """None if the request carries what ``need`` asks for; else why not.

        Exactly one key entry is looked at, compared with every configured key in
        constant time: no early exit, so the time taken does not tell which key nearly
        matched, and a request offering more than one entry is refused unread.
        """
        if need is Need.KEY:
            valid = (*self.api_keys, *self.admin_keys) if self.api_keys else None
        elif self.admin_keys:
            valid = self.admin_keys
        elif self.api_keys:
            valid = self.api_keys if need in (Need.METRICS, Need.RECORDING) else ()
        else:
            valid = None  # no key configured: the local development server, open
        if need is Need.NOTHING or valid is None:
            return None
        offered = _offered_keys(headers)
        if len(offered) > 1:
            return Refusal.TOO_MANY
        if not offered:
            return Refusal.MISSING
        if offered[0] is None:
            return Refusal.INVALID
        candidate = offered[0].encode()
        matched = known = False
        for key in (*self.api_keys, *self.admin_keys):
            equal = hmac.compare_digest(candidate, key.encode())
            if key in valid:
                matched |= equal
            else:
                known |= equal
        if matched:
            return None
        return Refusal.NOT_ADMIN if known else Refusal.INVALID

    def host_allowed(self, headers: Headers, *, bind: str) -> bool:
        """Whether the request's one ``Host`` names this server (DNS rebinding).

        Served: ``localhost`` and loopback addresses; the address (or name) the server
        is bound to, and for a wildcard bind (``0.0.0.0``, ``::``) any IP address, since
        an address cannot be re-pointed; and what ``--allowed-hosts`` lists. A missing,
        repeated or malformed Host is refused: browsers always send exactly one.
        """
        values = [value for name, value in headers if name.lower() == b"host"]
        if len(values) != 1:
            return False
        host = parse_host(values[0].decode("latin-1"))
        if host is None:
            return False
        if "*" in self.allowed_hosts or host in LOOPBACK_NAMES:
            return True
        address = _ip(host)
        bound = bind.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
        bound_address = _ip(bound) if bound else ipaddress.IPv4Address("0.0.0.0")
        if address is not None:
            if address.is_loopback or address == bound_address:
                return True
            if bound_address is not None and bound_address.is_unspecified:
                return True
        elif host == bound:
            return True
        for entry in self.allowed_hosts:
            if host == entry or (
                entry.startswith(".") and (host == entry[1:] or host.endswith(entry))
            ):
                return True
        return False

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


def _offered_keys(headers: Headers) -> list[str | None]:
    """The key entries the request offers (each ``Authorization: Bearer`` header, then
    key subprotocol entries until there are two: more are never decoded); None for an
    entry that does not decode."""
    headers = list(headers)
    offered: list[str | None] = []
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                offered.append(token.strip())
    for entry in _subprotocols(headers):
        if len(offered) > 1:
            break
        if entry.startswith(KEY_SUBPROTOCOL_PREFIX):
            encoded = entry[len(KEY_SUBPROTOCOL_PREFIX) :]
            try:
                offered.append(
                    base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
                )
            except (binascii.Error, ValueError):
                offered.append(None)
    return offered


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


def parse_host(value: str) -> str | None:
    """The host of a ``Host`` header in the form `AccessPolicy.host_allowed` compares (lower
    case, no port, no brackets, no trailing dot); None if it is not a name or address with
    an optional port."""
    value = value.strip().lower()
    if value.startswith("["):
        inside, bracket, rest = value[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else None
        if not bracket or (rest and (port is None or not _PORT.fullmatch(port))):
            return None
        try:
            return str(ipaddress.IPv6Address(inside))
        except ValueError:
            return None
    host, colon, port = value.partition(":")
    if colon and not _PORT.fullmatch(port):
        return None
    return _host_name_or_address(host)


def _host_name_or_address(text: str) -> str | None:
    """A bare name or address, normalised; None if it is neither."""
    text = text.removesuffix(".")  # the absolute form of a name, "localhost."
    address = _ip(text)
    if address is not None:
        return str(address)
    if len(text) > 253 or not _HOST_NAME.fullmatch(text):
        return None
    return text


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def is_loopback(bind: str) -> bool:
    """Whether a bind address (``--host``) reaches this machine only."""
    bound = bind.strip().lower().removeprefix("[").removesuffix("]")
    address = _ip(bound)
    return bound in LOOPBACK_NAMES or (address is not None and address.is_loopback)


class RateLimitedLog:
    """Log refusals of one kind at most once per ``interval`` seconds, with the count of
    those left out since the last line: a client that hammers the server with wrong
    keys fills the metrics, not the log. The exact count is in ``/metrics``."""

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        *,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._message = message
        self._interval = interval
        self._clock = clock
        self._next_at = -math.inf
        self._suppressed = 0

    def __call__(self, *args: object) -> bool:
        """Log ``message % args`` unless a line was logged less than ``interval`` ago;
        returns whether it was. Callers pass only text they know is safe to log (never
        a key; client text through ``ascii()``)."""
        now = self._clock()
        if now < self._next_at:
            self._suppressed += 1
            return False
        suppressed, self._suppressed = self._suppressed, 0
        self._next_at = now + self._interval
        tail = f" ({suppressed} more since the last such line)" if suppressed else ""
        self._logger.warning(self._message + "%s", *args, tail)
        return True
