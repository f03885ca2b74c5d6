"""Tests for trio_vstream.media.encoding: the fMP4 bytes must be playable chunk by chunk.

Every check decodes with PyAV (FFmpeg) rather than trusting the box writer, because the
point of the module is what a player can do with the bytes it has received so far.
"""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import av
import numpy as np
import pytest
from av.video.frame import PictureType
from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

from trio_vstream.media.encoding import EncodingAbandoned, EncodingError, FragmentedMP4Encoder
from trio_vstream.media.fmp4 import fragment_starts_with_keyframe
from trio_vstream.media.h264 import to_encoder_frame
from trio_vstream.media.image_decode import decode_image

# Frame index i is painted as a flat colour with two channels carrying base-12 digits 20 levels
# apart, so lossy coding (a few levels of error) cannot turn one index into another.
_STEP = 20


def _indexed_frames(start: int, count: int, height: int, width: int) -> np.ndarray:
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    for offset in range(count):
        index = start + offset
        frames[offset] = (10 + _STEP * (index % 12), 10 + _STEP * (index // 12), 128)
    return frames


def _index_of(rgb: np.ndarray) -> int:
    h, w = rgb.shape[:2]
    centre = rgb[h // 4 : 3 * h // 4, w // 4 : 3 * w // 4].reshape(-1, 3).mean(axis=0)
    low, high = (round((float(c) - 10) / _STEP) for c in centre[:2])
    return high * 12 + low


def _decode(data: bytes) -> list[av.VideoFrame]:
    with av.open(io.BytesIO(data), mode="r") as container:
        return list(container.decode(video=0))


def _boxes(data: bytes) -> list[tuple[bytes, bytes]]:
    """Split bytes into (type, payload) top-level boxes, failing on any size inconsistency."""
    boxes = []
    pos = 0
    while pos < len(data):
        size, kind = struct.unpack_from(">I4s", data, pos)
        assert size >= 8 and pos + size <= len(data), f"bad box size {size} at {pos}"
        boxes.append((kind, data[pos + 8 : pos + size]))
        pos += size
    return boxes


def _child(payload: bytes, kind: bytes) -> bytes:
    for child_kind, child_payload in _boxes(payload):
        if child_kind == kind:
            return child_payload
    raise AssertionError(f"no {kind!r} box")


def _encode_all(
    encoder: FragmentedMP4Encoder, chunk_sizes: list[int], height: int, width: int
) -> list[bytes]:
    outputs = []
    start = 0
    for size in chunk_sizes:
        outputs.append(encoder.encode(_indexed_frames(start, size, height, width)))
        start += size
    return outputs


@pytest.mark.parametrize(("width", "height"), [(256, 256), (832, 480)])
def test_each_chunk_carries_all_its_frames(width: int, height: int) -> None:
    encoder = FragmentedMP4Encoder(width=width, height=height, fps=24)
    received = b""
    expected = 0
    for size in (1, 5, 3):
        received += encoder.encode(_indexed_frames(expected, size, height, width))
        expected += size
        assert encoder.frames_encoded == expected
        # A player holding only the bytes so far must be able to show every frame so far.
        assert len(_decode(received)) == expected
    encoder.close()


@pytest.mark.parametrize(("width", "height", "fps"), [(256, 256, 24), (832, 480, 16)])
def test_whole_stream_decodes_in_order_at_size_and_rate(width: int, height: int, fps: int) -> None:
    encoder = FragmentedMP4Encoder(width=width, height=height, fps=fps)
    chunks = [4, 4, 2] if width > 256 else [8, 7, 9, 1]
    data = b"".join(_encode_all(encoder, chunks, height, width)) + encoder.close()

    frames = _decode(data)
    assert [_index_of(f.to_ndarray(format="rgb24")) for f in frames] == list(range(sum(chunks)))
    assert {(f.width, f.height) for f in frames} == {(width, height)}
    assert [f.time for f in frames] == [i / fps for i in range(sum(chunks))]
    with av.open(io.BytesIO(data), mode="r") as container:
        assert container.streams.video[0].average_rate == Fraction(fps)


def test_stream_parses_without_seeking() -> None:
    """Browsers and Python clients read the stream front to back; no seek may be needed."""

    class Pipe:
        def __init__(self, data: bytes) -> None:
            self._buf = io.BytesIO(data)

        def read(self, n: int) -> bytes:
            return self._buf.read(n)

    encoder = FragmentedMP4Encoder(width=256, height=256, fps=24)
    data = b"".join(_encode_all(encoder, [3, 3], 256, 256)) + encoder.close()
    with av.open(Pipe(data), mode="r", format="mp4") as container:
        assert len(list(container.decode(video=0))) == 6


def test_box_layout_is_one_fragment_per_call() -> None:
    encoder = FragmentedMP4Encoder(width=256, height=256, fps=30)
    outputs = _encode_all(encoder, [2, 3, 1], 256, 256)
    trailer = encoder.close()

    assert outputs[0][4:8] == b"ftyp"
    assert [k for k, _ in _boxes(outputs[0])] == [b"ftyp", b"moov", b"moof", b"mdat"]
    for later in outputs[1:]:
        assert [k for k, _ in _boxes(later)] == [b"moof", b"mdat"]
    assert [k for k, _ in _boxes(trailer)] == [b"mfra"]

    moov = _boxes(outputs[0])[1][1]
    for kind in (b"mvex", b"trak"):
        _child(moov, kind)
    mdhd = _child(_child(_child(moov, b"trak"), b"mdia"), b"mdhd")
    timescale = struct.unpack_from(">I", mdhd, 12)[0]
    assert timescale % 30 == 0
    duration = timescale // 30

    frames_before = 0
    for sequence, (out, count) in enumerate(zip(outputs, [2, 3, 1], strict=True), start=1):
        moof = dict(_boxes(out))[b"moof"]
        assert struct.unpack_from(">I", _child(moof, b"mfhd"), 4)[0] == sequence
        traf = _child(moof, b"traf")
        tfhd = _child(traf, b"tfhd")
        assert struct.unpack_from(">I", tfhd)[0] & 0x020000  # default-base-is-moof
        base_time = struct.unpack_from(">Q", _child(traf, b"tfdt"), 4)[0]
        assert base_time == frames_before * duration
        assert struct.unpack_from(">I", _child(traf, b"trun"), 4)[0] == count
        frames_before += count


def test_no_b_frames() -> None:
    encoder = FragmentedMP4Encoder(width=256, height=256, fps=24)
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (12, 256, 256, 3), dtype=np.uint8)
    data = encoder.encode(frames[:6]) + encoder.encode(frames[6:]) + encoder.close()
    with av.open(io.BytesIO(data), mode="r") as container:
        packets = [p for p in container.demux(video=0) if p.size]
    assert [p.pts for p in packets] == [p.dts for p in packets]
    assert [p.pts for p in packets] == sorted(p.pts for p in packets)
    assert {f.pict_type for f in _decode(data)} <= {PictureType.I, PictureType.P}


def test_b_frames_asked_through_x264_params_are_refused() -> None:
    """What would bring back encoder delay is not on the allow-list (see also
    tests/security/test_codec_options.py), so no encoder with it is ever opened."""
    with pytest.raises(EncodingError, match=r"codec_options\.x264-params: bframes is not allowed"):
        FragmentedMP4Encoder(
            width=256, height=256, fps=24, codec_options={"x264-params": "bframes=2:force-cfr=0"}
        )


def test_overriding_tune_keeps_zero_delay() -> None:
    encoder = FragmentedMP4Encoder(
        width=256, height=256, fps=24, codec_options={"preset": "medium", "tune": "film"}
    )
    data = encoder.encode(_indexed_frames(0, 3, 256, 256))
    assert len(_decode(data)) == 3
    encoder.close()


def test_codec_options_override_defaults() -> None:
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 256, (3, 256, 256, 3), dtype=np.uint8)
    sizes = {}
    for crf in ("10", "45"):
        encoder = FragmentedMP4Encoder(width=256, height=256, fps=24, codec_options={"crf": crf})
        sizes[crf] = len(encoder.encode(frames))
        encoder.close()
    assert sizes["10"] > 2 * sizes["45"]

    # x264 writes its settings into an SEI of the first frame: the override must show there.
    encoder = FragmentedMP4Encoder(width=256, height=256, fps=24, codec_options={"crf": 33})
    assert b"crf=33.0" in encoder.encode(frames[:1])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"crf": "abc"}, r"codec_options.crf: must be a number in 0..51"),
        ({"preset": "no-such-preset"}, "codec_options.preset: .* is not allowed"),
        ({"no_such_option": "1"}, "codec_options: option no_such_option is not allowed"),
        ({"crf": [1, 2]}, "codec_options.crf: must be a number"),
    ],
)
def test_bad_codec_options_raise_encoding_error(options: dict, match: str) -> None:
    with pytest.raises(EncodingError, match=match):
        FragmentedMP4Encoder(width=256, height=256, fps=24, codec_options=options)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"width": 255, "height": 256, "fps": 24}, "even"),
        ({"width": 256, "height": 0, "fps": 24}, "height"),
        ({"width": 256, "height": 256, "fps": 0}, "fps"),
        ({"width": 256, "height": 256, "fps": 23.976}, "fps"),
    ],
)
def test_bad_geometry_raises(kwargs: dict, match: str) -> None:
    with pytest.raises(EncodingError, match=match):
        FragmentedMP4Encoder(**kwargs)


@pytest.mark.parametrize(
    ("frames", "got"),
    [
        (np.zeros((8, 480, 832), np.float32), r"got \(8, 480, 832\) float32"),
        (np.zeros((2, 480, 832, 3), np.float32), r"got \(2, 480, 832, 3\) float32"),
        (np.zeros((2, 832, 480, 3), np.uint8), r"got \(2, 832, 480, 3\) uint8"),
        (np.zeros((2, 480, 832, 4), np.uint8), r"got \(2, 480, 832, 4\) uint8"),
        (np.zeros((480, 832, 3), np.uint8), r"got \(480, 832, 3\) uint8"),
        (np.zeros((0, 480, 832, 3), np.uint8), r"T must be >= 1"),
        ([[0]], "got list"),
    ],
)
def test_bad_frames_raise_encoding_error(frames: object, got: str) -> None:
    encoder = FragmentedMP4Encoder(width=832, height=480, fps=24)
    with pytest.raises(EncodingError, match=r"expected frames .*\(T, 480, 832, 3\) uint8"):
        encoder.encode(frames)  # type: ignore[arg-type]
    with pytest.raises(EncodingError, match=got):
        encoder.encode(frames)  # type: ignore[arg-type]
    # Bad input is rejected before touching the codec, so the session can carry on.
    assert len(_decode(encoder.encode(_indexed_frames(0, 1, 480, 832)))) == 1
    encoder.close()


def test_non_contiguous_frames_are_accepted() -> None:
    encoder = FragmentedMP4Encoder(width=256, height=256, fps=24)
    wide = _indexed_frames(0, 2, 256, 512)[:, :, ::2]
    assert len(_decode(encoder.encode(wide))) == 2
    encoder.close()


def test_close_is_idempotent_and_final() -> None:
    encoder = FragmentedMP4Encoder(width=256, height=256, fps=24)
    data = encoder.encode(_indexed_frames(0, 2, 256, 256))
    trailer = encoder.close()
    assert trailer
    assert encoder.close() == b""
    assert len(_decode(data + trailer)) == 2
    with pytest.raises(EncodingError, match="closed"):
        encoder.encode(_indexed_frames(2, 1, 256, 256))
    assert encoder.frames_encoded == 2


def test_close_without_encoding_returns_nothing() -> None:
    encoder = FragmentedMP4Encoder(width=256, height=256, fps=24)
    assert encoder.close() == b""
    assert encoder.close() == b""


def test_codec_string_names_the_stream() -> None:
    encoder = FragmentedMP4Encoder(width=256, height=256, fps=24)
    assert encoder.codec_string is not None
    assert encoder.codec_string.startswith("avc1.42")  # ultrafast -> Constrained Baseline
    encoder.close()


def _png_bytes(rgb: np.ndarray, pix_fmt: str = "rgb24") -> bytes:
    ctx = av.CodecContext.create("png", "w")
    ctx.width = rgb.shape[1]
    ctx.height = rgb.shape[0]
    ctx.pix_fmt = pix_fmt
    frame = av.VideoFrame.from_ndarray(rgb, format=pix_fmt)
    return b"".join(bytes(p) for p in [*ctx.encode(frame), *ctx.encode(None)])


def test_decode_image_round_trip() -> None:
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    decoded = decode_image(_png_bytes(rgb))
    assert decoded.dtype == np.uint8
    np.testing.assert_array_equal(decoded, rgb)


def test_decode_image_drops_alpha() -> None:
    rgba = np.zeros((8, 6, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[..., 3] = 255
    decoded = decode_image(_png_bytes(rgba, "rgba"))
    assert decoded.shape == (8, 6, 3)
    assert (decoded[..., 0] == 200).all()


@pytest.mark.parametrize("junk", [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\0" * 40])
def test_decode_image_rejects_junk(junk: bytes) -> None:
    with pytest.raises(EncodingError):
        decode_image(junk)


def test_decode_image_rejects_oversized_images() -> None:
    png = _png_bytes(np.zeros((40, 50, 3), dtype=np.uint8))
    assert decode_image(png, max_pixels=2000).shape == (40, 50, 3)
    with pytest.raises(EncodingError, match="50x40"):
        decode_image(png, max_pixels=1999)


def test_an_image_format_without_a_decoder_is_an_encoding_error() -> None:
    """Found by bench/fuzz.py: FFmpeg probes an SVG but has no decoder for it here."""
    svg = b"<svg xmlns='http://www.w3.org/2000/svg' width='2' height='2'/>"
    with pytest.raises(EncodingError):
        decode_image(svg)


def test_an_abandoned_encode_stops_between_frames_and_the_encoder_only_closes() -> None:
    encoder = FragmentedMP4Encoder(width=32, height=32, fps=8)
    frames = np.zeros((6, 32, 32, 3), np.uint8)
    asked = 0

    def abandon_at_the_third_frame() -> bool:
        nonlocal asked
        asked += 1
        return asked == 3

    with pytest.raises(EncodingAbandoned):
        encoder.encode(frames, abandon=abandon_at_the_third_frame)
    assert asked == 3
    with pytest.raises(EncodingError, match="abandoned"):
        encoder.encode(frames)
    encoder.close()


def test_every_chunk_starts_with_an_idr_and_decodes_alone_after_the_init_segment() -> None:
    # What a viewer joining mid-stream gets: the init segment, then a chunk from the middle.
    encoder = FragmentedMP4Encoder(width=256, height=256, fps=24)
    outputs = _encode_all(encoder, [4, 4, 4, 4], 256, 256)
    init = encoder.init_segment
    assert init is not None and outputs[0].startswith(init)
    assert fragment_starts_with_keyframe(outputs[0])  # the init segment is skipped over
    for chunk, out in enumerate(outputs[1:], start=1):
        assert fragment_starts_with_keyframe(out)
        with av.open(io.BytesIO(init + out), mode="r") as container:
            packets = [p for p in container.demux(video=0) if p.size]
        assert [p.is_keyframe for p in packets] == [True, False, False, False]
        # From the join on, to the end: every frame, in order.
        frames = _decode(init + b"".join(outputs[chunk:]))
        assert [_index_of(f.to_ndarray(format="rgb24")) for f in frames] == list(
            range(4 * chunk, 16)
        )
    encoder.close()


def test_without_keyframes_at_chunk_starts_a_later_chunk_is_no_place_to_join() -> None:
    encoder = FragmentedMP4Encoder(width=256, height=256, fps=24, keyframe_interval=0)
    outputs = _encode_all(encoder, [4, 4, 4], 256, 256)
    assert fragment_starts_with_keyframe(outputs[0])
    assert not any(fragment_starts_with_keyframe(out) for out in outputs[1:])
    encoder.close()


def test_a_keyframe_interval_forces_an_idr_every_k_chunks() -> None:
    encoder = FragmentedMP4Encoder(width=256, height=256, fps=24, keyframe_interval=3)
    outputs = _encode_all(encoder, [4] * 7, 256, 256)
    assert [fragment_starts_with_keyframe(out) for out in outputs] == [
        True, False, False, True, False, False, True
    ]  # fmt: skip
    encoder.close()
    with pytest.raises(EncodingError, match="keyframe_interval"):
        FragmentedMP4Encoder(width=256, height=256, fps=24, keyframe_interval=-1)


@pytest.mark.parametrize("junk", [b"", b"\x00\x00\x00\x08moof", b"\x00\x00\x00\x04abcd", b"x" * 40])
def test_fragment_starts_with_keyframe_says_no_to_what_it_cannot_read(junk: bytes) -> None:
    assert not fragment_starts_with_keyframe(junk)


def test_the_encoders_conversion_reads_the_array_in_place_and_matches_a_copy() -> None:
    """`to_encoder_frame` hands swscale a view of the engine's array (no copy): the YUV
    planes are those of converting a copy (``from_ndarray``), for contiguous frames and
    for a strided view (made contiguous first), and the array is left as it was."""
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, (2, 48, 64, 3), dtype=np.uint8)
    before = frames.copy()
    ours, theirs = VideoReformatter(), VideoReformatter()
    for picture in (frames[0], frames[1], frames[0, :, ::-1]):
        converted = to_encoder_frame(ours, picture)
        expected = theirs.reformat(
            av.VideoFrame.from_ndarray(np.ascontiguousarray(picture), format="rgb24"),
            format="yuv420p",
            dst_colorspace=Colorspace.ITU709,
            dst_color_range=ColorRange.MPEG,
        )
        assert converted.format.name == "yuv420p"
        assert np.array_equal(converted.to_ndarray(), expected.to_ndarray())
    assert np.array_equal(frames, before)
