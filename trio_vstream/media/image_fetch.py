"""Fetch a session's ``image_reference`` https URL without becoming an SSRF gadget.

A server that fetches the URLs its clients name can be made to reach what only the
server can reach: a cloud metadata endpoint, an admin page on localhost, a database on
the private network (server-side request forgery). So fetching is off unless the
operator lists hosts (``--allow-image-urls HOST ...``), and even then:

* only ``https://`` URLs on a listed host (exact name match) and port are fetched, and
  the same holds for every redirect (at most `ImageFetchConfig.max_redirects`): a
  redirect to a host or port off the list, or to plain http, is refused, not followed.
  The port is 443 unless the operator lists the host with another one
  (``images.example.org:8443``): an allowed host may run other services on other ports
  (an admin page, a debug server), and a client must not be able to pick one;
* the fetcher resolves the name itself and refuses it when *any* resolved address is
  not public (loopback, private, link-local, multicast, reserved, ...); it then connects
  to a vetted address while sending the name for SNI, certificate checking and
  ``Host``. No second DNS answer is ever asked for, so DNS rebinding cannot swap in an
  internal address between the check and the connection;
* one deadline covers everything (resolution, connection, TLS, redirects, body); the
  body is read against a byte limit and reading stops there; only a 200 with an
  ``image/*`` type is accepted.

Each refusal is an `ImageFetchError` whose message names the URL and the reason, which
the session sends back as ``invalid_request``.

Everything runs on the event loop with Trio and h11 (no thread but Trio's own for
``getaddrinfo``), so nothing blocks it, and cancelling the caller's scope (a shutdown,
an aborted session) ends a fetch at once and closes its connection.

Tests need a local HTTPS server on 127.0.0.1 with their own certificate authority. For
them, and only for them, `ImageFetchConfig` has three injection points, none of which
the command line sets: ``ssl_context`` (default: the system's trust store),
``address_policy`` (default: `public_addresses_only`, which refuses loopback) and
``resolver`` (default: the system resolver).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import re
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final, TypeAlias, cast

import attrs
import h11
import trio

from trio_vstream.protocol import ImageInput, ImageURL

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address

AddressPolicy: TypeAlias = Callable[[IPAddress], "str | None"]
"""Vets one resolved address: ``None`` to allow it, else why not (``"loopback"``)."""

Resolver: TypeAlias = Callable[[str, int], Awaitable[Sequence[IPAddress]]]
"""``(host, port) -> addresses``; every address it returns is vetted before any is used."""

DEFAULT_MAX_BYTES: Final = 16 * 1024 * 1024
"""16 MiB: a large photo; ``decode_image`` bounds the pixels such a file may claim."""
DEFAULT_TIMEOUT: Final = 10.0
"""Seconds for the whole fetch, redirects included: the client waits for video.start."""
DEFAULT_MAX_REDIRECTS: Final = 3

_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
_IMAGE_TYPE: Final = re.compile(r"image/[a-z0-9][a-z0-9!#$&^_.+-]*")
_READ_SIZE: Final = 64 * 1024
_URL_SHOWN: Final = 200
"""Characters of a URL quoted in an error message (a URL may be 2048 long)."""

_NAT64: Final = ipaddress.IPv6Network("64:ff9b::/96")


def public_addresses_only(address: IPAddress) -> str | None:
    """The production policy: only globally routable unicast addresses.

    IPv6 forms that carry an IPv4 address (mapped, 6to4, NAT64) are judged by the IPv4
    address they lead to, since that is where the connection ends up.
    """
    if isinstance(address, ipaddress.IPv6Address):
        embedded: ipaddress.IPv4Address | None = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            reason = public_addresses_only(embedded)
            return None if reason is None else f"{reason} (inside {address})"
    for reason, flagged in (
        ("an unspecified", address.is_unspecified),
        ("a loopback", address.is_loopback),
        ("a link-local", address.is_link_local),
        ("a multicast", address.is_multicast),
        ("a reserved", address.is_reserved),
        ("a private", address.is_private),
        ("a non-public", not address.is_global),
    ):
        if flagged:
            return f"{reason} address"
    return None


async def system_resolver(host: str, port: int) -> list[IPAddress]:
    """Every address the system resolver gives for ``host`` (Trio runs it in a thread)."""
    infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    addresses: list[IPAddress] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        # Strip an IPv6 scope ("fe80::1%eth0"); such addresses are link-local anyway.
        address = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


_AUTHORITY: Final = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")


def allowed_authority(entry: str) -> str:
    """One ``--allow-image-urls`` entry as the `ImageURL.authority` it allows: a host
    name or IP address (IPv6 with or without brackets), with ``:PORT`` when the port is
    not 443 (``images.example.org``, ``images.example.org:8443``, ``[2001:db8::1]:8443``).

    Raises ``ValueError`` on anything else: a scheme, a path or a wildcard would never
    match a URL, and the operator would wonder why nothing is fetched.
    """
    text = entry.strip()
    with contextlib.suppress(ValueError):  # a bare IPv6 address (its colons are no port)
        return ImageURL.parse(f"https://[{ipaddress.IPv6Address(text)}]/").authority
    if not _AUTHORITY.fullmatch(text):
        raise ValueError(f"{entry!r} is not a host name like images.example.org[:PORT]")
    try:
        return ImageURL.parse(f"https://{text}/").authority
    except ValueError as exc:
        raise ValueError(
            f"{entry!r} is not a host name like images.example.org[:PORT]: {exc}"
        ) from None


def _allowed_authorities(hosts: Iterable[str]) -> frozenset[str]:
    return frozenset(map(allowed_authority, hosts))


@attrs.frozen(kw_only=True)
class ImageFetchConfig:
    """Whether, from where and within which limits ``image_reference`` URLs are fetched.

    The default fetches nothing: ``allowed_hosts`` is empty.
    """

    allowed_hosts: frozenset[str] = attrs.field(default=frozenset(), converter=_allowed_authorities)
    """Exact host names (or IP literals) that may be fetched from, redirects included,
    each with ``:PORT`` when its port is not 443 (see `allowed_authority`)."""
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout: float = DEFAULT_TIMEOUT
    max_redirects: int = DEFAULT_MAX_REDIRECTS
    # Injection points for tests (see the module docstring); the command line never sets
    # them, and their defaults are the only safe choice for a real server.
    ssl_context: ssl.SSLContext | None = attrs.field(default=None, eq=False)
    """Trust for the image hosts' certificates; None: the system's trust store."""
    address_policy: AddressPolicy = public_addresses_only
    resolver: Resolver = system_resolver

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_hosts)


class ImageFetchError(Exception):
    """The image could not be fetched; the message names the URL and the reason."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"image_reference.image_url {_show_url(url)}: {reason}")
        self.url = url
        self.reason = reason


@functools.cache
def _system_trust() -> ssl.SSLContext:
    """The system's trust store, loaded once (reading it would block the event loop)."""
    return ssl.create_default_context()


def _show_url(url: str) -> str:
    return repr(url if len(url) <= _URL_SHOWN else url[: _URL_SHOWN - 3] + "...")


DISABLED_REASON: Final = (
    "this server does not fetch image URLs (off by default: a server that fetches the "
    "URLs its clients name can be made to reach internal services); send the image "
    "inline as a data:image/...;base64 URL, or have the operator allow the host with "
    "--allow-image-urls HOST"
)


async def fetch_image(url: ImageURL, config: ImageFetchConfig) -> ImageInput:
    """Fetch the image at ``url`` within ``config``'s rules and limits.

    Raises `ImageFetchError` for every refusal and failure; only cancellation passes
    through otherwise.
    """
    if not config.enabled:
        raise ImageFetchError(url.url, DISABLED_REASON)
    with trio.move_on_after(config.timeout):
        return await _fetch_following_redirects(url, config)
    raise ImageFetchError(
        url.url,
        f"no complete answer within {config.timeout:g} s (the server's image URL timeout)",
    )


async def _fetch_following_redirects(url: ImageURL, config: ImageFetchConfig) -> ImageInput:
    current = url
    for hop in range(config.max_redirects + 1):
        # Every hop: https (ImageURL.parse refuses anything else), a listed host, and
        # the port the list gives it (443 unless named).
        if current.authority not in config.allowed_hosts:
            where = "its" if hop == 0 else f"it redirects to {_show_url(current.url)}, whose"
            listed = {ImageURL.parse(f"https://{a}/").host for a in config.allowed_hosts}
            if current.host not in listed:
                raise ImageFetchError(
                    url.url,
                    f"{where} host {current.host!r} is not one this server fetches from "
                    "(--allow-image-urls)",
                )
            raise ImageFetchError(
                url.url,
                f"{where} port {current.port} on {current.host!r} is not one this server "
                f"fetches from (443 unless --allow-image-urls names the port, like "
                f"{current.authority})",
            )
        answer = await _fetch_once(current, config, original=url)
        if isinstance(answer, ImageInput):
            return answer
        try:  # a redirect: checked like the first URL on the next round
            current = ImageURL.parse(urllib.parse.urljoin(current.url, answer))
        except ValueError as exc:
            raise ImageFetchError(
                url.url, f"it redirects to {_show_url(answer)}, which {exc}"
            ) from None
    raise ImageFetchError(url.url, f"more than {config.max_redirects} redirects")


async def _vetted_addresses(
    url: ImageURL, config: ImageFetchConfig, original: ImageURL
) -> Sequence[IPAddress]:
    """The host's addresses, each one checked: one bad address refuses the host."""
    try:
        addresses: Sequence[IPAddress] = [ipaddress.ip_address(url.host)]
    except ValueError:
        try:
            addresses = await config.resolver(url.host, url.port)
        except OSError as exc:
            raise ImageFetchError(
                original.url, f"cannot resolve {url.host!r}: {exc.strerror or exc}"
            ) from None
    if not addresses:
        raise ImageFetchError(original.url, f"{url.host!r} resolves to no address")
    for address in addresses:
        reason = config.address_policy(address)
        if reason is not None:
            raise ImageFetchError(
                original.url,
                f"{url.host!r} resolves to {address}, {reason}, which this server "
                "does not connect to",
            )
    return addresses


async def _connect(
    url: ImageURL, addresses: Sequence[IPAddress], original: ImageURL
) -> trio.SocketStream:
    """A TCP connection to the first vetted address that answers (never a new lookup)."""
    errors: list[str] = []
    for address in addresses:
        try:
            # An IP literal: Trio's getaddrinfo answers it without asking DNS.
            return await trio.open_tcp_stream(str(address), url.port)
        except OSError as exc:
            errors.append(f"{address}: {exc.strerror or exc}")
    raise ImageFetchError(
        original.url, f"cannot connect to {url.host!r} port {url.port} ({'; '.join(errors)})"
    )


async def _fetch_once(
    url: ImageURL, config: ImageFetchConfig, *, original: ImageURL
) -> ImageInput | str:
    """One GET: the image, or the ``Location`` of a redirect still to be checked."""
    addresses = await _vetted_addresses(url, config, original)
    tcp = await _connect(url, addresses, original)
    context = config.ssl_context
    if context is None:
        context = await trio.to_thread.run_sync(_system_trust)
    # server_hostname is the name, not the address: SNI and certificate checks as usual.
    stream = trio.SSLStream(tcp, context, server_hostname=url.host, https_compatible=True)
    try:
        return await _exchange(stream, url, config, original)
    except trio.BrokenResourceError as exc:
        cause = exc.__cause__
        if isinstance(cause, ssl.SSLCertVerificationError):
            reason = f"TLS certificate check failed: {cause.verify_message}"
        elif isinstance(cause, ssl.SSLError):
            reason = f"TLS failed: {cause.reason or cause}"
        else:
            reason = f"the connection broke: {cause or exc}"
        raise ImageFetchError(original.url, reason) from None
    except h11.RemoteProtocolError as exc:
        raise ImageFetchError(original.url, f"the answer is not valid HTTP: {exc}") from None
    finally:
        await trio.aclose_forcefully(stream)


async def _exchange(
    stream: trio.SSLStream[trio.SocketStream],
    url: ImageURL,
    config: ImageFetchConfig,
    original: ImageURL,
) -> ImageInput | str:
    connection = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="GET",
        target=url.target,
        headers=[
            ("Host", url.authority),
            ("User-Agent", "trio_vstream"),
            ("Accept", "image/*"),
            ("Accept-Encoding", "identity"),
            ("Connection", "close"),
        ],
    )
    await stream.send_all(connection.send(request) + (connection.send(h11.EndOfMessage()) or b""))

    async def next_event() -> h11.Event | type[h11.PAUSED]:
        while True:
            event = connection.next_event()
            if event is not h11.NEED_DATA:
                # h11's sentinels are classes, which mypy does not narrow by identity.
                return cast("h11.Event | type[h11.PAUSED]", event)
            # bytes() of bytes is the same object; h11 is typed for bytes only.
            connection.receive_data(bytes(await stream.receive_some(_READ_SIZE)))

    event = await next_event()
    while isinstance(event, h11.InformationalResponse):
        event = await next_event()
    if not isinstance(event, h11.Response):
        raise ImageFetchError(original.url, "the server closed the connection without an answer")
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
    if event.status_code in _REDIRECTS and "location" in headers:
        return headers["location"]
    if event.status_code != 200:
        reason = event.reason.decode("latin-1", "replace")
        raise ImageFetchError(
            original.url, f"the server answered HTTP {event.status_code} {reason}".rstrip()
        )
    mime_type = headers.get("content-type", "").partition(";")[0].strip().lower()
    if not _IMAGE_TYPE.fullmatch(mime_type):
        raise ImageFetchError(
            original.url,
            f"the server sent {mime_type or 'no content type'!s}, not an image/* type",
        )
    too_large = f"the image is larger than {config.max_bytes} bytes (the server's limit)"
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > config.max_bytes:
        raise ImageFetchError(original.url, too_large)
    body = bytearray()
    while True:
        event = await next_event()
        if isinstance(event, h11.Data):
            body += event.data
            if len(body) > config.max_bytes:  # stop reading here
                raise ImageFetchError(original.url, too_large)
        elif isinstance(event, h11.EndOfMessage):
            break
        else:
            raise ImageFetchError(original.url, "the server closed the connection mid-image")
    if not body:
        raise ImageFetchError(original.url, "the server sent no image data")
    return ImageInput(mime_type=mime_type, data=bytes(body))


__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_REDIRECTS",
    "DEFAULT_TIMEOUT",
    "DISABLED_REASON",
    "AddressPolicy",
    "IPAddress",
    "ImageFetchConfig",
    "ImageFetchError",
    "Resolver",
    "allowed_authority",
    "fetch_image",
    "public_addresses_only",
    "system_resolver",
]
