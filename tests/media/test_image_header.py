"""`trio_vstream.media.image_header`: the size of a PNG, JPEG or WebP from its bytes alone.

Real files from PyAV's encoders (and Pillow's, where installed) give the right size and
extent; every truncation of them, every malformed header in the table below, and random
damage (Hypothesis) give an `ImageHeaderError`, never another exception.
"""

from __future__ import annotations

import contextlib
import io
import struct
import zlib
from collections.abc import Callable

import av
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_vstream.media.image_decode import decode_image
from trio_vstream.media.image_header import (
    MAX_PARTS,
    ImageHeader,
    ImageHeaderError,
    read_image_header,
)

WIDTH, HEIGHT = 24, 16
PIXELS = np.random.default_rng(3).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)


def encoded(codec: str, pix_fmt: str, **options: str) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="image2pipe") as container:
        stream = container.add_stream(codec, rate=1, options=options)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, pix_fmt
        frame = av.VideoFrame.from_ndarray(PIXELS, format="rgb24")
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return buffer.getvalue()


def riff(*chunks: tuple[bytes, bytes]) -> bytes:
    body = b"WEBP" + b"".join(
        kind + struct.pack("<I", len(data)) + data + b"\x00" * (len(data) & 1)
        for kind, data in chunks
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


def webp_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 12
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos + 4)
        chunks.append((data[pos : pos + 4], data[pos + 8 : pos + 8 + length]))
        pos += 8 + length + (length & 1)
    return chunks


def vp8x(width: int, height: int, flags: int = 0) -> tuple[bytes, bytes]:
    size = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return b"VP8X", bytes([flags, 0, 0, 0]) + size


PNG = encoded("png", "rgb24")
PNG16 = encoded("png", "rgba64be")
JPEG = encoded("mjpeg", "yuvj420p")
WEBP_LOSSY = encoded("libwebp", "yuv420p")
WEBP_LOSSLESS = encoded("libwebp", "yuv420p", lossless="1")
WEBP_EXTENDED = riff(vp8x(WIDTH, HEIGHT), *webp_chunks(WEBP_LOSSLESS), (b"EXIF", b"II*\x00"))
SAMPLES = {
    "PNG": PNG,
    "PNG 16-bit RGBA": PNG16,
    "JPEG": JPEG,
    "WebP lossy": WEBP_LOSSY,
    "WebP lossless": WEBP_LOSSLESS,
    "WebP extended": WEBP_EXTENDED,
}


def pillow_samples() -> dict[str, bytes]:
    """What cameras and browsers make: progressive JPEG, EXIF, WebP with alpha."""
    image_module = pytest.importorskip("PIL.Image")
    image = image_module.fromarray(PIXELS)
    out = {}
    for name, mode, fmt, options in (
        ("progressive JPEG", "RGB", "JPEG", {"progressive": True}),
        ("greyscale JPEG", "L", "JPEG", {}),
        ("CMYK JPEG", "CMYK", "JPEG", {}),
        ("WebP with alpha", "RGBA", "WEBP", {}),
        ("palette PNG", "P", "PNG", {}),
    ):
        buffer = io.BytesIO()
        image.convert(mode).save(buffer, fmt, **options)
        out[name] = buffer.getvalue()
    return out


@pytest.mark.parametrize("name", SAMPLES)
def test_real_files_give_their_size_and_extent(name: str) -> None:
    data = SAMPLES[name]
    header = read_image_header(data + b"trailing bytes are not the image's")
    assert (header.width, header.height, header.length) == (WIDTH, HEIGHT, len(data))
    assert header.format == name.split()[0]
    assert decode_image(data).shape == (HEIGHT, WIDTH, 3)


def test_files_from_pillow_too() -> None:
    for name, data in pillow_samples().items():
        header = read_image_header(data)
        assert (header.width, header.height, header.length) == (WIDTH, HEIGHT, len(data)), name
        assert decode_image(data).shape == (HEIGHT, WIDTH, 3), name


@pytest.mark.parametrize("name", SAMPLES)
def test_every_truncation_is_a_clean_error(name: str) -> None:
    data = SAMPLES[name]
    for end in range(len(data)):
        with pytest.raises(ImageHeaderError):
            read_image_header(data[:end])


def png_with(
    ihdr: bytes | None = None, *chunks: tuple[bytes, bytes], crc: int | None = None
) -> bytes:
    ihdr = struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 2, 0, 0, 0) if ihdr is None else ihdr
    out = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr
    out += struct.pack(">I", zlib.crc32(b"IHDR" + ihdr) if crc is None else crc)
    for kind, body in chunks:
        out += (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )
    return out


def jpeg_replacing(old: bytes, new: bytes) -> Callable[[], bytes]:
    assert old in JPEG
    return lambda: JPEG.replace(old, new, 1)


def sos_first() -> bytes:
    sof = JPEG.index(b"\xff\xc0")
    sos = JPEG.index(b"\xff\xda")
    return JPEG[:sof] + JPEG[sos:]


def vp8_not_key() -> bytes:
    chunks = webp_chunks(WEBP_LOSSY)
    kind, data = chunks[0]
    return riff((kind, bytes([data[0] | 1]) + data[1:]))


IEND = (b"IEND", b"")


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda: b"", "not an image in an accepted format (PNG, JPEG, WebP)"),
        (lambda: b"\x89PNG\r\n\x1a\n", "PNG is truncated before the end of its IHDR"),
        (lambda: png_with(crc=0) + PNG[-12:], "PNG IHDR chunk fails its CRC check"),
        (lambda: png_with(b"\x00" * 12) + bytes(20), "PNG does not begin with a valid IHDR chunk"),
        (
            lambda: png_with(struct.pack(">IIBBBBB", 0, 5, 8, 2, 0, 0, 0), IEND),
            "PNG declares an invalid size 0x5",
        ),
        (
            lambda: png_with(struct.pack(">IIBBBBB", 2**31, 5, 8, 2, 0, 0, 0), IEND),
            "PNG declares an invalid size 2147483648x5",
        ),
        (
            lambda: png_with(struct.pack(">IIBBBBB", 5, 5, 3, 2, 0, 0, 0), IEND),
            "PNG declares an invalid bit depth 3 for colour type 2",
        ),
        (
            lambda: png_with(None, (b"IHDR", PNG[16:29]), IEND),
            "PNG has more than one IHDR chunk",
        ),
        (lambda: png_with(None, (b"ID\x00T", b""), IEND), "PNG has a malformed chunk at byte 33"),
        (lambda: png_with(None, (b"IDAT", b"")), "PNG is truncated (no IEND chunk)"),
        (lambda: JPEG[:-2], "JPEG is truncated (no end-of-image marker)"),
        (lambda: JPEG[:20] + b"\x00" + JPEG[20:], "JPEG has no marker where one belongs (byte 20)"),
        (sos_first, "JPEG has a scan before its frame header (SOF)"),
        (
            jpeg_replacing(b"\xff\xc0", b"\xff\xc3"),
            "JPEG coding process SOF3 (lossless, hierarchical or arithmetic-coded) is not accepted",
        ),
        (
            jpeg_replacing(b"\xff\xc0", b"\xff\xc9"),
            "JPEG coding process SOF9 (lossless, hierarchical or arithmetic-coded) is not accepted",
        ),
        (jpeg_replacing(b"\xff\xdb", b"\xff\xf0"), "JPEG has an unexpected marker 0xFFF0"),
        (
            jpeg_replacing(b"\xff\xdb\x00\x43", b"\xff\xdb\x00\x44"),
            "JPEG has a malformed 0xFFDB segment (its length does not match its contents)",
        ),
        (lambda: b"\xff\xd8\xff\xd9", "JPEG has no frame header (SOF)"),
        (lambda: b"\xff\xd8\xff\xd8\xff\xd9", "JPEG has an unexpected marker 0xFFD8"),
        (lambda: WEBP_LOSSY[:8] + b"WEBP", "WebP is truncated (shorter than its RIFF header says)"),
        (lambda: riff(), "WebP holds no image (no VP8 or VP8L chunk)"),
        (lambda: riff((b"VP8 ", b"\x00" * 9)), "WebP VP8 chunk is too short"),
        (vp8_not_key, "WebP VP8 bitstream does not start with a key frame"),
        (lambda: riff((b"VP8L", b"\x00" * 5)), "WebP VP8L bitstream has no signature"),
        (lambda: riff((b"XYZW", b"")), "WebP begins with an unknown 'XYZW' chunk"),
        (
            lambda: riff(vp8x(WIDTH, HEIGHT, flags=0x02), *webp_chunks(WEBP_LOSSLESS)),
            "animated WebP is not accepted",
        ),
        (
            lambda: riff(vp8x(WIDTH, HEIGHT), (b"ANMF", b"")),
            "animated WebP is not accepted",
        ),
        (
            lambda: riff(vp8x(16000, 16000), *webp_chunks(WEBP_LOSSLESS)),
            f"WebP canvas 16000x16000 differs from its image {WIDTH}x{HEIGHT}",
        ),
        (
            lambda: riff(*webp_chunks(WEBP_LOSSLESS), *webp_chunks(WEBP_LOSSY)),
            "WebP holds more than one image chunk",
        ),
        (lambda: riff(vp8x(9, 9))[:-2], "WebP is truncated (shorter than its RIFF header says)"),
        pytest.param(
            lambda: png_with(None, *[(b"tEXt", b"")] * MAX_PARTS, IEND),
            f"PNG has more than {MAX_PARTS} chunks",
            marks=pytest.mark.slow,  # 1.6 to 1.9 s: a CRC for each of the chunks
        ),
        (
            lambda: JPEG[:2] + b"\xff\xfe\x00\x02" * MAX_PARTS + JPEG[2:],
            f"JPEG has more than {MAX_PARTS} markers",
        ),
        (
            lambda: riff(vp8x(WIDTH, HEIGHT), *[(b"XMP ", b"")] * MAX_PARTS),
            f"WebP has more than {MAX_PARTS} chunks",
        ),
        (lambda: b"GIF87a" + bytes(10), "format not accepted (GIF); accepted: PNG, JPEG, WebP"),
        (
            lambda: b"\x00\x00\x00\x18ftypheic" + bytes(8),
            "format not accepted (ISO media, brand 'heic'); accepted: PNG, JPEG, WebP",
        ),
    ],
)
def test_malformed_headers_are_named(make: Callable[[], bytes], problem: str) -> None:
    with pytest.raises(ImageHeaderError) as caught:
        read_image_header(make())
    assert str(caught.value) == problem


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(sorted(SAMPLES)),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(0, 10_000),
)
def test_damaged_files_give_a_header_or_a_clean_error(
    name: str, damage: list[tuple[int, int]], cut: int
) -> None:
    data = bytearray(SAMPLES[name])
    for at, value in damage:
        data[at % len(data)] = value
    damaged = bytes(data[: len(data) - cut % 64])
    try:
        header = read_image_header(damaged)
    except ImageHeaderError:
        return
    assert isinstance(header, ImageHeader)
    assert header.width >= 1 and header.height >= 1
    assert 0 < header.length <= len(damaged)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF\x40\x00\x00\x00WEBP", b""]),
    st.binary(max_size=200),
)
def test_random_bytes_behind_a_signature_are_a_clean_error(prefix: bytes, rest: bytes) -> None:
    with contextlib.suppress(ImageHeaderError):
        read_image_header(prefix + rest)
