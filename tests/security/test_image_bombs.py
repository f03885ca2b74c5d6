"""Attacks through ``image_reference`` images (issue 20, item 2).

A decoder allocates and fills whatever picture a header declares, so a 729 KB PNG that
declares 16000x16000 cost the server 740 MB before it was refused. These tests send such
bombs (made here: a valid PNG whose IDAT inflates to 768 MB of zeros), images in formats
that cannot be vetted from their header, and headers that disagree with themselves, and
check that each is refused as ``invalid_request`` before anything decodes; and that a
server decodes only a bounded number of images at once.
"""

from __future__ import annotations

import base64
import io
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import trio
import trio.testing

import trio_vstream.session.prepare
from trio_vstream.media import image_decode, image_header
from trio_vstream.media.errors import EncodingError
from trio_vstream.media.image_decode import decode_image
from trio_vstream.media.image_header import ImageHeader
from trio_vstream.session.session import IMAGE_DECODES_AT_ONCE

REPO = Path(__file__).resolve().parents[2]
START = {"type": "session.start", "prompt": "a red circle", "size": "64x48", "num_frames": 2}


def png_chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(kind + body)
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def png_bomb(width: int, height: int) -> bytes:
    """A valid 8-bit RGB PNG of zeros, ``width`` x ``height``, in well under 1 MB.

    The IDAT is built from one deflate block of 100 zero rows, repeated: after a full
    flush a compressor starts afresh, so every such block compresses to the same bytes.
    The Adler-32 of n zero bytes is n mod 65521 in its high half and 1 in its low half.
    """
    row = 1 + 3 * width  # the filter byte, then RGB
    block = bytes(row * 100)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    repeated = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
    end = deflate.flush(zlib.Z_FINISH)
    adler = ((row * height) % 65521) << 16 | 1
    idat = b"\x78\xda" + repeated * (height // 100) + end + struct.pack(">I", adler)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )


BOMB = png_bomb(16000, 16000)
REFUSED = "image is 16000x16000, more than the 33177600 pixels (or 16384 a side) allowed"


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_the_bomb_is_what_the_issue_describes() -> None:
    """Small on the wire, and a real PNG: the same bytes at 200x100 decode."""
    assert len(BOMB) < 800_000
    assert image_header.read_image_header(BOMB) == ImageHeader("PNG", 16000, 16000, len(BOMB))
    small = png_bomb(200, 100)
    assert np.array_equal(decode_image(small), np.zeros((100, 200, 3), np.uint8))


def test_the_bomb_is_refused_before_anything_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic: no decoder and no demuxer is even created for it."""

    def no(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a decoder was opened for an image refused by its header")

    monkeypatch.setattr(av, "open", no)
    monkeypatch.setattr(av.CodecContext, "create", no)
    with pytest.raises(EncodingError) as caught:
        decode_image(BOMB)
    assert str(caught.value) == REFUSED


_MEASURE = """
import resource, sys
from trio_vstream.media.errors import EncodingError
from trio_vstream.media.image_decode import decode_image
bomb = open(sys.argv[1], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    decode_image(bomb)
except EncodingError as exc:
    message = str(exc)
else:
    message = "decoded"
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024, message)
"""


def test_the_bomb_raises_peak_memory_by_less_than_150_mb(tmp_path: Path) -> None:
    """Peak RSS (ru_maxrss, a high-water mark) in a fresh process, around the refusal."""
    path = tmp_path / "bomb.png"
    path.write_bytes(BOMB)
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    grown, _, message = done.stdout.strip().partition(" ")
    assert message == REFUSED
    assert int(grown) < 150 * 1024 * 1024, f"peak RSS grew by {int(grown) / 2**20:.0f} MiB"


def test_a_header_the_decoder_disagrees_with_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the header says, the picture decoded must have that size."""
    png = png_bomb(200, 100)

    def lying(data: bytes) -> ImageHeader:
        return ImageHeader("PNG", 100, 100, len(data))

    monkeypatch.setattr(image_decode, "read_image_header", lying)
    with pytest.raises(EncodingError, match="decoded to 200x100, not the 100x100 its header"):
        decode_image(png)


def jpeg_of(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="image2pipe") as container:
        stream = container.add_stream("mjpeg", rate=1)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuvj420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), "rgb24")
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return buffer.getvalue()


def sof_of(width: int, height: int) -> bytes:
    """A baseline frame header for one component."""
    return b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"


def hidden_in_dqt(jpeg: bytes, hidden: bytes) -> bytes:
    """``jpeg`` with ``hidden`` after the contents of its first DQT segment, the segment's
    length stretched over it: FFmpeg reads the table, then looks for markers from there."""
    at = jpeg.index(b"\xff\xdb")
    (length,) = struct.unpack_from(">H", jpeg, at + 2)
    body = jpeg[at + 4 : at + 2 + length]
    stretched = struct.pack(">H", 2 + len(body) + len(hidden))
    return jpeg[:at] + b"\xff\xdb" + stretched + body + hidden + jpeg[at + 2 + length :]


def with_height(jpeg: bytes, height: int) -> bytes:
    """``jpeg`` with the height in its frame header replaced."""
    at = jpeg.index(b"\xff\xc0") + 5  # marker, length, precision
    return jpeg[:at] + struct.pack(">H", height) + jpeg[at + 2 :]


@pytest.mark.parametrize(
    ("name", "make", "problem"),
    [
        (
            "a second, larger frame header after the scan",
            lambda j: j[:-2] + sof_of(16000, 16000) + b"\xff\xd9",
            "JPEG declares two sizes, 64x48 and 16000x16000",
        ),
        (
            "a frame header hidden after a table's contents",
            lambda j: hidden_in_dqt(j, sof_of(16000, 16000)),
            "JPEG has a malformed 0xFFDB segment (its length does not match its contents)",
        ),
        (
            "a frame height left to a DNL marker",
            lambda j: with_height(j, 0),
            "JPEG declares an invalid size 64x0",
        ),
    ],
)
def test_jpegs_whose_headers_disagree_are_refused(name: str, make: Any, problem: str) -> None:
    jpeg = jpeg_of(64, 48)
    assert decode_image(jpeg).shape == (48, 64, 3)
    with pytest.raises(EncodingError) as caught:
        decode_image(make(jpeg))
    assert str(caught.value) == problem, name


def test_a_large_frame_header_inside_an_app_segment_is_not_the_image() -> None:
    """A thumbnail (or anything) inside APPn is skipped by its length, by the header
    reader as by the decoder: the image is the 64x48 one, and it decodes."""
    jpeg = jpeg_of(64, 48)
    thumbnail = b"Exif\x00\x00" + b"\xff\xd8" + sof_of(16000, 16000) + b"\xff\xd9"
    app1 = b"\xff\xe1" + struct.pack(">H", 2 + len(thumbnail)) + thumbnail
    with_app = jpeg[:2] + app1 + jpeg[2:]
    assert image_header.read_image_header(with_app).width == 64
    assert decode_image(with_app).shape == (48, 64, 3)


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (b"GIF89a\x10\x00\x10\x00\x80\x00\x00" + bytes(20), "GIF"),
        (b"BM" + bytes(60), "BMP"),
        (b"II*\x00" + bytes(60), "TIFF"),
        (b"\x00\x00\x00\x1cftypavif" + bytes(40), "AVIF"),
    ],
)
def test_formats_that_cannot_be_vetted_are_refused_by_name(data: bytes, name: str) -> None:
    with pytest.raises(EncodingError) as caught:
        decode_image(data)
    assert str(caught.value) == f"format not accepted ({name}); accepted: PNG, JPEG, WebP"
    with pytest.raises(EncodingError, match="not an image in an accepted format"):
        decode_image(b'<svg xmlns="http://www.w3.org/2000/svg" width="99999" height="99999"/>')


# ---------------------------------------------------------------- through a server


async def test_a_server_refuses_the_bomb_as_an_invalid_request(start_server: Any) -> None:
    running = await start_server()
    with trio.fail_after(30):
        transcript = await running.run_session(
            {**START, "image_reference": {"image_url": data_url(BOMB)}}
        )
    assert transcript.types == ["error"]
    assert transcript.messages[0]["code"] == "invalid_request"
    assert transcript.messages[0]["message"] == (
        f"Invalid session.start: image_reference: {REFUSED}"
    )
    assert running.engine.streams == []


async def test_a_server_refuses_a_gif_by_name(start_server: Any) -> None:
    running = await start_server()
    gif = b"GIF89a\x10\x00\x10\x00\x80\x00\x00" + bytes(20)
    transcript = await running.run_session(
        {**START, "image_reference": {"image_url": data_url(gif, "image/gif")}}
    )
    assert transcript.messages[0]["message"] == (
        "Invalid session.start: image_reference: format not accepted (GIF); "
        "accepted: PNG, JPEG, WebP"
    )


async def test_a_server_decodes_a_bounded_number_of_images_at_once(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three sessions send an image together; the decodes are held open (in their
    threads) until the test lets them go: only IMAGE_DECODES_AT_ONCE ever run."""
    assert IMAGE_DECODES_AT_ONCE == 2
    release = threading.Event()
    lock = threading.Lock()
    running_now: list[int] = [0]
    most: list[int] = [0]

    def held_decode(data: bytes) -> np.ndarray:
        with lock:
            running_now[0] += 1
            most[0] = max(most[0], running_now[0])
        try:
            if not release.wait(30):
                raise AssertionError("never released")
            return decode_image(data)
        finally:
            with lock:
                running_now[0] -= 1

    monkeypatch.setattr(trio_vstream.session.prepare, "decode_image", held_decode)
    running = await start_server()
    limiter = running.server._resources.image_limiter
    start = {**START, "image_reference": {"image_url": data_url(png_bomb(200, 100))}}
    transcripts: list[Any] = []

    async def session() -> None:
        transcripts.append(await running.run_session(start))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(session)
            # Two decode, the third waits for one of them, and nothing else moves.
            while (limiter.borrowed_tokens, limiter.statistics().tasks_waiting) != (2, 1):
                await trio.testing.wait_all_tasks_blocked(0.01)
            with lock:
                assert running_now[0] == 2
            release.set()
    assert most[0] == 2
    assert [t.terminal[-1]["type"] for t in transcripts] == ["session.done"] * 3
    assert all(s.request.image is not None for s in running.engine.streams)


def test_ffmpeg_reads_a_frame_header_hidden_after_a_tables_contents() -> None:
    """Why the header reader insists on exact segment lengths: with the only frame
    header moved into a DQT segment's slack, FFmpeg still finds and uses it."""
    jpeg = jpeg_of(64, 48)
    at = jpeg.index(b"\xff\xc0")
    (length,) = struct.unpack_from(">H", jpeg, at + 2)
    moved = hidden_in_dqt(jpeg[:at] + jpeg[at + 2 + length :], jpeg[at : at + 2 + length])
    decoder = av.CodecContext.create("mjpeg", "r")
    frames = decoder.decode(av.Packet(moved)) + decoder.decode(None)
    assert [(frame.width, frame.height) for frame in frames] == [(64, 48)]
    with pytest.raises(image_header.ImageHeaderError, match="malformed 0xFFDB segment"):
        image_header.read_image_header(moved)
