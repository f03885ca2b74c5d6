"""What an image file says it is, read from its bytes before anything decodes it.

A client's ``image_reference`` is decoded by FFmpeg, and a decoder allocates the picture
its header declares: a 729 KB PNG that declares 16000x16000 made the server allocate and
fill 768 MB before any check could see the size. So the size is read here, from the
header alone, and refused over the server's limits before a decoder is ever involved.

Only formats whose size can be vetted that way are accepted: PNG (``IHDR``), JPEG (every
``SOFn`` frame header) and WebP (``VP8``/``VP8L``/``VP8X``). Anything else (GIF, BMP,
TIFF, AVIF, SVG, ...) is refused by name. `read_image_header` also walks the whole file's
structure (PNG chunks to ``IEND``, JPEG segments to ``EOI``, WebP chunks to the end of
its RIFF) and reports where the image ends, so the decoder is handed exactly the bytes
that were vetted: one image, with one size, and nothing after it.

Pure: bytes in, an `ImageHeader` or an `ImageHeaderError` out; no PyAV, no Trio. Every
malformed or truncated input gives an `ImageHeaderError`, never an ``IndexError`` or a
``struct.error``.
"""

from __future__ import annotations

import re
import struct
import zlib
from typing import Final

import attrs

__all__ = ["ACCEPTED_FORMATS", "ImageHeader", "ImageHeaderError", "read_image_header"]

ACCEPTED_FORMATS: Final = ("PNG", "JPEG", "WebP")

MAX_PARTS: Final = 100_000
"""Chunks (PNG, WebP) or markers (JPEG) walked at most: real files have tens or
thousands, and a file of nothing but empty ones would otherwise cost seconds of CPU."""

_PNG_SIGNATURE: Final = b"\x89PNG\r\n\x1a\n"
_PNG_MAX_SIDE: Final = 2**31 - 1
# JPEG frame headers accepted: baseline, extended and progressive Huffman (SOF0-SOF2).
# Lossless, hierarchical and arithmetic-coded JPEGs are rare and refused.
_JPEG_SOF_ACCEPTED: Final = frozenset({0xC0, 0xC1, 0xC2})
_JPEG_SOF_OTHER: Final = frozenset(
    {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xDE}  # 0xDE: DHP
)
# The next marker after entropy-coded data: 0xFF (any fill) then neither a stuffed zero,
# nor a restart marker (which belongs to the scan), nor another fill byte.
_JPEG_NEXT_MARKER: Final = re.compile(rb"\xff+[^\x00\xd0-\xd7\xff]")

# Other formats, recognised only to be refused by name.
_OTHER_FORMATS: Final = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"\x8aMNG\r\n\x1a\n", "MNG"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
    (b"qoif", "QOI"),
)


class ImageHeaderError(ValueError):
    """Not an image this server accepts, or a malformed one; the message says which."""


@attrs.frozen
class ImageHeader:
    """An image's format and declared size, and where it ends in the bytes read."""

    format: str
    """One of `ACCEPTED_FORMATS`."""
    width: int
    height: int
    length: int
    """Bytes from the start to the end of the image (``IEND``, ``EOI``, the RIFF's end)."""


def read_image_header(data: bytes) -> ImageHeader:
    """The format, declared size and extent of the image in ``data``.

    Raises `ImageHeaderError` for a format not in `ACCEPTED_FORMATS` (naming it when it
    is known) and for any malformed, truncated or self-contradicting structure.
    """
    view = bytes(data)
    if view.startswith(_PNG_SIGNATURE):
        return _png(view)
    if view.startswith(b"\xff\xd8\xff"):
        return _jpeg(view)
    if view[:4] == b"RIFF" and view[8:12] == b"WEBP":
        return _webp(view)
    accepted = ", ".join(ACCEPTED_FORMATS)
    for signature, name in _OTHER_FORMATS:
        if view.startswith(signature):
            raise ImageHeaderError(f"format not accepted ({name}); accepted: {accepted}")
    if view[4:8] == b"ftyp":
        brand = view[8:12].decode("ascii", "replace")
        kind = "AVIF" if brand in ("avif", "avis") else f"ISO media, brand {brand!r}"
        raise ImageHeaderError(f"format not accepted ({kind}); accepted: {accepted}")
    raise ImageHeaderError(f"not an image in an accepted format ({accepted})")


# --------------------------------------------------------------------------- PNG


def _png(data: bytes) -> ImageHeader:
    """The ``IHDR`` size; then every chunk walked to ``IEND`` (one ``IHDR``, no truncation)."""
    pos = len(_PNG_SIGNATURE)
    if len(data) < pos + 8 + 13 + 4:
        raise ImageHeaderError("PNG is truncated before the end of its IHDR")
    length, kind = struct.unpack_from(">I4s", data, pos)
    if kind != b"IHDR" or length != 13:
        raise ImageHeaderError("PNG does not begin with a valid IHDR chunk")
    body = data[pos + 4 : pos + 8 + 13]
    (crc,) = struct.unpack_from(">I", data, pos + 8 + 13)
    if zlib.crc32(body) != crc:
        raise ImageHeaderError("PNG IHDR chunk fails its CRC check")
    width, height, depth, colour = struct.unpack_from(">IIBB", data, pos + 8)
    if not (1 <= width <= _PNG_MAX_SIDE and 1 <= height <= _PNG_MAX_SIDE):
        raise ImageHeaderError(f"PNG declares an invalid size {width}x{height}")
    if depth not in {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}.get(
        colour, ()
    ):
        raise ImageHeaderError(
            f"PNG declares an invalid bit depth {depth} for colour type {colour}"
        )
    pos += 8 + 13 + 4
    for _ in range(MAX_PARTS):
        if pos + 12 > len(data):
            raise ImageHeaderError("PNG is truncated (no IEND chunk)")
        length, kind = struct.unpack_from(">I4s", data, pos)
        if length > _PNG_MAX_SIDE or not kind.isalpha():
            raise ImageHeaderError(f"PNG has a malformed chunk at byte {pos}")
        end = pos + 12 + length
        if end > len(data):
            raise ImageHeaderError(f"PNG is truncated inside a {kind.decode()} chunk")
        if kind == b"IHDR":
            raise ImageHeaderError("PNG has more than one IHDR chunk")
        if kind == b"IEND":
            return ImageHeader("PNG", width, height, end)
        pos = end
    raise ImageHeaderError(f"PNG has more than {MAX_PARTS} chunks")


# -------------------------------------------------------------------------- JPEG


def _jpeg(data: bytes) -> ImageHeader:
    """Every segment walked from ``SOI`` to ``EOI``; every frame header must agree.

    A decoder takes its size from each ``SOFn`` it meets, so all of them are read (not
    only the first), including those after a scan's entropy-coded data. FFmpeg's decoder
    skips an ``APPn`` or ``COM`` segment by its length, but after a table or header
    segment it goes on from where that segment's contents ended and looks for the next
    marker there; so those segments must be exactly as long as their contents (as the
    standard says), or a frame header hidden after their contents would be read by the
    decoder and not here. Markers outside the usual set are refused for the same reason.
    """
    size: tuple[int, int] | None = None
    pos = 2
    for _ in range(MAX_PARTS):
        if pos >= len(data) or data[pos] != 0xFF:
            raise ImageHeaderError(_jpeg_no_marker(data, pos))
        while pos < len(data) and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= len(data):
            raise ImageHeaderError("JPEG is truncated (no end-of-image marker)")
        marker = data[pos]
        pos += 1
        if marker == 0xD9:  # EOI
            if size is None:
                raise ImageHeaderError("JPEG has no frame header (SOF)")
            return ImageHeader("JPEG", size[0], size[1], pos)
        if 0xD0 <= marker <= 0xD7:  # RSTn: no length, no contents
            continue
        if marker in _JPEG_SOF_OTHER:
            raise ImageHeaderError(
                f"JPEG coding process SOF{marker - 0xC0} (lossless, hierarchical or "
                "arithmetic-coded) is not accepted"
            )
        if not (marker in _JPEG_SEGMENTS or 0xE0 <= marker <= 0xEF):
            raise ImageHeaderError(f"JPEG has an unexpected marker 0xFF{marker:02X}")
        if pos + 2 > len(data):
            raise ImageHeaderError("JPEG is truncated inside a segment header")
        (length,) = struct.unpack_from(">H", data, pos)
        if length < 2 or pos + length > len(data):
            raise ImageHeaderError(f"JPEG is truncated or malformed at byte {pos}")
        segment = data[pos + 2 : pos + length]
        pos += length
        if marker in _JPEG_SEGMENTS and not _JPEG_SEGMENTS[marker](segment):
            raise ImageHeaderError(
                f"JPEG has a malformed 0xFF{marker:02X} segment (its length does not "
                "match its contents)"
            )
        if marker in _JPEG_SOF_ACCEPTED:
            height, width = struct.unpack_from(">HH", segment, 1)
            if width == 0 or height == 0:
                raise ImageHeaderError(f"JPEG declares an invalid size {width}x{height}")
            if size is not None and size != (width, height):
                raise ImageHeaderError(
                    f"JPEG declares two sizes, {size[0]}x{size[1]} and {width}x{height}"
                )
            size = (width, height)
        elif marker == 0xDA:  # SOS: entropy-coded data follows, up to the next marker
            if size is None:
                raise ImageHeaderError("JPEG has a scan before its frame header (SOF)")
            found = _JPEG_NEXT_MARKER.search(data, pos)
            if found is None:
                raise ImageHeaderError("JPEG is truncated (no end-of-image marker)")
            pos = found.start()
    raise ImageHeaderError(f"JPEG has more than {MAX_PARTS} markers")


def _jpeg_no_marker(data: bytes, pos: int) -> str:
    if pos >= len(data):
        return "JPEG is truncated (no end-of-image marker)"
    return f"JPEG has no marker where one belongs (byte {pos})"


def _sof_ok(segment: bytes) -> bool:
    """Precision, height, width, component count, then 3 bytes a component."""
    return len(segment) >= 6 and segment[5] >= 1 and len(segment) == 6 + 3 * segment[5]


def _sos_ok(segment: bytes) -> bool:
    """Component count, 2 bytes a component, then the spectral selection (3 bytes)."""
    return len(segment) >= 1 and segment[0] >= 1 and len(segment) == 1 + 2 * segment[0] + 3


def _dqt_ok(segment: bytes) -> bool:
    """One or more tables: precision/id, then 64 values of 1 byte (or 2 bytes)."""
    pos = 0
    while pos < len(segment):
        precision = segment[pos] >> 4
        if precision > 1:
            return False
        pos += 1 + 64 * (1 + precision)
    return pos == len(segment) > 0


def _dht_ok(segment: bytes) -> bool:
    """One or more tables: class/id, 16 code counts, then that many values (<= 256)."""
    pos = 0
    while pos < len(segment):
        if pos + 17 > len(segment):
            return False
        count = sum(segment[pos + 1 : pos + 17])
        if count > 256:
            return False
        pos += 17 + count
    return pos == len(segment) > 0


_JPEG_SEGMENTS: Final = {
    **dict.fromkeys(_JPEG_SOF_ACCEPTED, _sof_ok),
    0xC4: _dht_ok,  # DHT
    0xDB: _dqt_ok,  # DQT
    0xDA: _sos_ok,  # SOS
    0xDD: lambda segment: len(segment) == 2,  # DRI
    0xFE: lambda segment: True,  # COM: skipped by its length
}
"""Segments with a length besides APPn (0xE0-0xEF, skipped by their length), each with
the check that its length is exactly that of its contents."""


# -------------------------------------------------------------------------- WebP


def _webp(data: bytes) -> ImageHeader:
    """The size of the ``VP8``/``VP8L`` bitstream (and the ``VP8X`` canvas, which must
    match it). Every chunk is walked to the end of the RIFF: one image, no animation."""
    if len(data) < 12:
        raise ImageHeaderError("WebP is truncated in its RIFF header")
    (riff_size,) = struct.unpack_from("<I", data, 4)
    end = 8 + riff_size
    if riff_size < 4 or end > len(data):
        raise ImageHeaderError("WebP is truncated (shorter than its RIFF header says)")
    canvas: tuple[int, int] | None = None
    image: tuple[int, int] | None = None
    pos = 12
    for _ in range(MAX_PARTS):
        if pos >= end:
            break
        if pos + 8 > end:
            raise ImageHeaderError("WebP is truncated inside a chunk header")
        kind = data[pos : pos + 4]
        (length,) = struct.unpack_from("<I", data, pos + 4)
        if pos + 8 + length > end:
            raise ImageHeaderError(f"WebP is truncated inside its {_name(kind)} chunk")
        payload = data[pos + 8 : pos + 8 + length]
        if kind in (b"VP8 ", b"VP8L"):
            if image is not None:
                raise ImageHeaderError("WebP holds more than one image chunk")
            image = _vp8(payload) if kind == b"VP8 " else _vp8l(payload)
            if canvas is not None and canvas != image:
                raise ImageHeaderError(
                    f"WebP canvas {canvas[0]}x{canvas[1]} differs from its image "
                    f"{image[0]}x{image[1]}"
                )
        elif kind == b"VP8X":
            if pos != 12:
                raise ImageHeaderError("WebP has a misplaced VP8X chunk")
            if length < 10:
                raise ImageHeaderError("WebP VP8X chunk is too short")
            if payload[0] & 0x02:
                raise ImageHeaderError("animated WebP is not accepted")
            width = int.from_bytes(payload[4:7], "little") + 1
            height = int.from_bytes(payload[7:10], "little") + 1
            canvas = (width, height)
        elif kind in (b"ANIM", b"ANMF"):
            raise ImageHeaderError("animated WebP is not accepted")
        elif canvas is None:
            raise ImageHeaderError(f"WebP begins with an unknown {_name(kind)} chunk")
        pos += 8 + length + (length & 1)
    else:
        raise ImageHeaderError(f"WebP has more than {MAX_PARTS} chunks")
    if image is None:
        raise ImageHeaderError("WebP holds no image (no VP8 or VP8L chunk)")
    return ImageHeader("WebP", image[0], image[1], end)


def _vp8(payload: bytes) -> tuple[int, int]:
    """A lossy bitstream's key frame header (RFC 6386, 9.1)."""
    if len(payload) < 10:
        raise ImageHeaderError("WebP VP8 chunk is too short")
    if payload[0] & 0x01:
        raise ImageHeaderError("WebP VP8 bitstream does not start with a key frame")
    if payload[3:6] != b"\x9d\x01\x2a":
        raise ImageHeaderError("WebP VP8 bitstream has no start code")
    width, height = struct.unpack_from("<HH", payload, 6)
    width, height = width & 0x3FFF, height & 0x3FFF
    if width == 0 or height == 0:
        raise ImageHeaderError(f"WebP declares an invalid size {width}x{height}")
    return width, height


def _vp8l(payload: bytes) -> tuple[int, int]:
    """A lossless bitstream's header: signature 0x2F, then 14-bit width-1 and height-1."""
    if len(payload) < 5:
        raise ImageHeaderError("WebP VP8L chunk is too short")
    if payload[0] != 0x2F:
        raise ImageHeaderError("WebP VP8L bitstream has no signature")
    (bits,) = struct.unpack_from("<I", payload, 1)
    return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1


def _name(kind: bytes) -> str:
    """A chunk's four-character code for a message (printable ASCII, else in hex)."""
    text = kind.decode("ascii", "replace")
    return repr(text) if text.isprintable() and text.isascii() else kind.hex()
