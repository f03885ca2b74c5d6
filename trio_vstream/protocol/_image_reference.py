"""``image_reference``: an inline ``data:`` URL decoded, or an ``https://`` URL checked.

The one part of ``session.start`` that names something outside the request: the bytes
of an image, or a host the server may connect to. Apart from `_start` because its rules
are of URLs, not of video requests: strict forms (base64 only, no credentials, no
control characters, ASCII host names) that keep the server from becoming an SSRF or a
local-file-read gadget. Nothing is fetched here: whether an https URL is fetched at all
is the server's decision (``trio_vstream.media.image_fetch``).
"""

import base64
import binascii
import ipaddress
import re
import urllib.parse
from typing import Final, Self

import attrs

from trio_vstream.protocol._wire import show


@attrs.frozen
class ImageInput:
    """A decoded ``data:`` URL; turning the bytes into pixels is the engine side's job."""

    mime_type: str
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")


MAX_IMAGE_URL_CHARS: Final = 2048
"""Longer ``https://`` image URLs are refused (browsers and servers stop near here too)."""

# Dot-separated DNS labels (underscores too: some real hosts have them).
_LABEL: Final = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME: Final = re.compile(rf"(?:{_LABEL}\.)*{_LABEL}")


@attrs.frozen
class ImageURL:
    """An ``https://`` image URL, checked for form but not fetched.

    Whether to fetch it (from which hosts, within which limits) is the server's decision,
    made in ``trio_vstream.media.image_fetch``; the protocol stays free of I/O. ``host`` is
    lower-case, without the brackets of an IPv6 literal or a trailing dot, ready to be
    compared with an allow list; ``target`` is the HTTP request target (path and query,
    never the fragment).
    """

    url: str
    host: str
    port: int
    target: str

    @property
    def authority(self) -> str:
        """The ``Host`` header: the host, with the port when it is not 443."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == 443 else f"{host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse an ``https://`` URL; raises ``ValueError`` saying what is wrong with it.

        Strict on purpose, because the result names a host the server may connect to:
        credentials, spaces and control characters (which could split an HTTP request
        line), non-ASCII host names (their ``xn--`` form is accepted) and malformed
        ports are refused rather than repaired.
        """
        if len(text) > MAX_IMAGE_URL_CHARS:
            raise ValueError(f"is longer than {MAX_IMAGE_URL_CHARS} characters")
        if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in text):
            raise ValueError("holds spaces or control characters")
        if not text.isascii():
            raise ValueError("holds non-ASCII characters (percent-encode them)")
        try:
            parts = urllib.parse.urlsplit(text)
        except ValueError:  # e.g. brackets around something that is no IPv6 address
            raise ValueError("is not a valid URL") from None
        if parts.scheme.lower() != "https":
            raise ValueError("must be an https:// URL")
        if "@" in parts.netloc:
            raise ValueError("must not hold a user name or password")
        try:
            port = 443 if parts.port is None else parts.port
        except ValueError:
            raise ValueError("has an invalid port") from None
        if port == 0:
            raise ValueError("has an invalid port")
        host = (parts.hostname or "").removesuffix(".")
        if not host:
            raise ValueError("has no host")
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            if parts.netloc.startswith("[") or not _HOST_NAME.fullmatch(host):
                raise ValueError("has an invalid host name") from None
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        return cls(url=text, host=host, port=port, target=target)


_DATA_URL: Final = re.compile(
    r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*?)(?P<b64>;base64)?,(?P<data>.*)",
    re.DOTALL | re.IGNORECASE,
)
_IMAGE_TYPE: Final = re.compile(r"image/[a-z0-9][a-z0-9!#$&^_.+-]*")


def decode_image_url(url: str) -> tuple[ImageInput | ImageURL | None, str | None]:
    """Decode ``data:image/...;base64,...``, or parse (never fetch) an ``https://`` URL.

    Reading paths or fetching other URLs on behalf of a client would turn the server
    into an SSRF / local-file-read gadget, so nothing else is accepted; whether an https
    URL is fetched at all is the server's choice (off unless its operator lists hosts).
    """
    where = "image_reference.image_url"
    if url[:6].lower() == "https:":
        try:
            return ImageURL.parse(url), None
        except ValueError as exc:
            return None, f"{where} {exc}, got {show(url)}"
    match = _DATA_URL.fullmatch(url)
    if match is None:
        return None, (
            f"{where} must be a data:image/<type>;base64,<data> URL or an https:// URL "
            f"(other URLs and file paths are not fetched), got {show(url)}"
        )
    mime_type = match["type"].strip().lower()
    if not _IMAGE_TYPE.fullmatch(mime_type):
        return None, f"{where} must have an image/* media type, got {show(mime_type or '')}"
    if match["b64"] is None:
        return None, f"{where} must be base64-encoded (data:{mime_type};base64,...)"
    payload = re.sub(r"[ \t\r\n]", "", match["data"])
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None, f"{where} has invalid base64 data"
    if not data:
        return None, f"{where} has no image data"
    return ImageInput(mime_type=mime_type, data=data), None
