"""Tests for trio_vstream.media.fmp4, the sans-IO box writer, as tables of bytes.

Samples are built by hand and the boxes they must become are written out byte for byte, as
h11 tests its writer: no codec, no PyAV, no numpy (the module imports none, and one test
checks so in a fresh interpreter). The last test alone uses PyAV, to hold the layout to
FFmpeg's own mov muxer (``movflags=empty_moov+default_base_moof``) for the same packets.
"""

from __future__ import annotations

import io
import itertools
import struct
import subprocess
import sys
from fractions import Fraction

import pytest

from trio_vstream.media import fmp4
from trio_vstream.media.fmp4 import (
    AudioSample,
    AudioTrack,
    VideoSample,
    VideoTrack,
    fragment_starts_with_keyframe,
    init_segment,
    media_fragment,
    track_timescale,
    trailer,
)

# A baseline-profile AVCDecoderConfigurationRecord: version 1, profile 66, level 30, one
# (made-up, short) SPS and one PPS.
AVC_CONFIG = bytes.fromhex("01 42c01e ff e1 0004 6742c01e 01 0002 68ce")
VIDEO = VideoTrack(width=64, height=48, timescale=12288, frame_duration=512, avc_config=AVC_CONFIG)
AUDIO = AudioTrack(
    sample_rate=48000,
    channels=2,
    audio_specific_config=bytes.fromhex("1190"),
    bit_rate=128000,
    frame_samples=1024,
    priming=1024,
)
IDR = VideoSample(bytes.fromhex("00000001 65"), sync=True)
P_FRAME = VideoSample(bytes.fromhex("00000002 419a"), sync=False)

CONTAINERS = {b"moov", b"trak", b"edts", b"mdia", b"minf", b"dinf", b"stbl", b"mvex"}
CONTAINERS |= {b"moof", b"traf", b"mfra"}


def boxes(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, payload) of each box in ``data``, failing on any size that does not add up."""
    out = []
    pos = 0
    while pos < len(data):
        size, kind = struct.unpack_from(">I4s", data, pos)
        assert size >= 8 and pos + size <= len(data), f"bad box size {size} at {pos}"
        out.append((kind, data[pos + 8 : pos + size]))
        pos += size
    return out


def tree(data: bytes, skip: frozenset[bytes] = frozenset()) -> list[str]:
    """Every box's path (``moov/trak/tkhd``), in order, sample entries' children included;
    the boxes of ``skip`` and all inside them left out."""
    paths: list[str] = []

    def walk(payload: bytes, prefix: str) -> None:
        for kind, body in boxes(payload):
            if kind in skip:
                continue
            path = prefix + kind.decode()
            paths.append(path)
            if kind in CONTAINERS:
                walk(body, path + "/")
            elif kind == b"stsd":
                walk(body[8:], path + "/")  # version+flags, entry_count
            elif kind == b"avc1":
                walk(body[78:], path + "/")  # the VisualSampleEntry's fixed fields
            elif kind == b"mp4a":
                walk(body[28:], path + "/")  # the AudioSampleEntry's fixed fields

    walk(data, "")
    return paths


def child(payload: bytes, *path: bytes) -> bytes:
    """The payload at ``path`` below ``payload`` (the first box of each type)."""
    for kind in path:
        payload = dict(boxes(payload))[kind]
    return payload


# --- One fragment: hand-built samples in, every byte of the moof+mdat out ---------------

FRAGMENTS = {
    "two video frames, an IDR then a P frame": (
        dict(sequence_number=7, frame_duration=512, video_decode_time=1024, video=[IDR, P_FRAME]),
        [
            "0000006c moof",
            "00000010 mfhd 00000000 00000007",  # sequence number
            "00000054 traf",
            # default-base-is-moof | default-sample-duration; track 1, 512 a frame
            "00000014 tfhd 00020008 00000001 00000200",
            "00000014 tfdt 01000000 0000000000000400",  # version 1: 64-bit decode time
            # data-offset | sizes | flags; 2 samples, data at moof + 116
            "00000024 trun 00000601 00000002 00000074",
            "00000005 02000000",  # 5 bytes, sync (depends on nothing)
            "00000006 01010000",  # 6 bytes, non-sync (depends on others)
            "00000013 mdat 0000000165 00000002419a",
        ],
    ),
    "audio only: two AAC frames, the last one short": (
        dict(
            sequence_number=3,
            frame_duration=512,
            video_decode_time=0,
            video=[],
            audio_decode_time=2048,
            audio=[AudioSample(b"\x21\x10", 1024), AudioSample(b"\x21", 700)],
        ),
        [
            "00000068 moof",
            "00000010 mfhd 00000000 00000003",
            "00000050 traf",
            "00000010 tfhd 00020000 00000002",  # default-base-is-moof; track 2
            "00000014 tfdt 01000000 0000000000000800",
            # data-offset | durations | sizes; data at moof + 112
            "00000024 trun 00000301 00000002 00000070",
            "00000400 00000002",  # 1024 samples, 2 bytes
            "000002bc 00000001",  # 700 samples, 1 byte
            "0000000b mdat 2110 21",
        ],
    ),
    "video and audio: the video's traf first, the audio's samples after the video's": (
        dict(
            sequence_number=1,
            frame_duration=512,
            video_decode_time=0,
            video=[IDR],
            audio_decode_time=0,
            audio=[AudioSample(b"\xaa\xbb", 1024)],
        ),
        [
            "000000ac moof",
            "00000010 mfhd 00000000 00000001",
            "0000004c traf",
            "00000014 tfhd 00020008 00000001 00000200",
            "00000014 tfdt 01000000 0000000000000000",
            "0000001c trun 00000601 00000001 000000b4 00000005 02000000",
            "00000048 traf",
            "00000010 tfhd 00020000 00000002",
            "00000014 tfdt 01000000 0000000000000000",
            # the audio's data offset: past the video's 5 bytes
            "0000001c trun 00000301 00000001 000000b9 00000400 00000002",
            "0000000f mdat 0000000165 aabb",
        ],
    ),
}


def _hex(lines: list[str]) -> bytes:
    """The table's bytes: hex digits, with box types written as their four letters
    (every type here has a letter past ``f``)."""
    out = b""
    for line in lines:
        for word in line.split():
            try:
                out += bytes.fromhex(word)
            except ValueError:
                out += word.encode()
    return out


@pytest.mark.parametrize(("args", "expected"), FRAGMENTS.values(), ids=FRAGMENTS.keys())
def test_a_fragment_is_exactly_these_bytes(args: dict, expected: list[str]) -> None:
    assert media_fragment(**args).hex(" ", 4) == _hex(expected).hex(" ", 4)


def test_the_trailer_is_an_mfra_holding_only_its_mfro() -> None:
    assert trailer() == _hex(["00000018 mfra", "00000010 mfro 00000000 00000018"])


@pytest.mark.parametrize(
    ("fps", "timescale"), [(1, 16384), (8, 16384), (16, 16384), (24, 12288), (30, 15360),
                           (25, 12800), (60, 15360), (10000, 10000), (12000, 12000)]
)  # fmt: skip
def test_the_track_timescale_is_fps_times_a_power_of_two_from_10000(
    fps: int, timescale: int
) -> None:
    assert track_timescale(fps) == timescale
    assert timescale % fps == 0


# --- The init segment ---------------------------------------------------------------

VIDEO_TREE = [
    "ftyp",
    "moov",
    "moov/mvhd",
    "moov/trak",
    "moov/trak/tkhd",
    "moov/trak/mdia",
    "moov/trak/mdia/mdhd",
    "moov/trak/mdia/hdlr",
    "moov/trak/mdia/minf",
    "moov/trak/mdia/minf/vmhd",
    "moov/trak/mdia/minf/dinf",
    "moov/trak/mdia/minf/dinf/dref",
    "moov/trak/mdia/minf/stbl",
    "moov/trak/mdia/minf/stbl/stsd",
    "moov/trak/mdia/minf/stbl/stsd/avc1",
    "moov/trak/mdia/minf/stbl/stsd/avc1/avcC",
    "moov/trak/mdia/minf/stbl/stts",
    "moov/trak/mdia/minf/stbl/stsc",
    "moov/trak/mdia/minf/stbl/stsz",
    "moov/trak/mdia/minf/stbl/stco",
]
AUDIO_TRAK_TREE = [
    "moov/trak",
    "moov/trak/tkhd",
    "moov/trak/edts",
    "moov/trak/edts/elst",
    "moov/trak/mdia",
    "moov/trak/mdia/mdhd",
    "moov/trak/mdia/hdlr",
    "moov/trak/mdia/minf",
    "moov/trak/mdia/minf/smhd",
    "moov/trak/mdia/minf/dinf",
    "moov/trak/mdia/minf/dinf/dref",
    "moov/trak/mdia/minf/stbl",
    "moov/trak/mdia/minf/stbl/stsd",
    "moov/trak/mdia/minf/stbl/stsd/mp4a",
    "moov/trak/mdia/minf/stbl/stsd/mp4a/esds",
    "moov/trak/mdia/minf/stbl/stts",
    "moov/trak/mdia/minf/stbl/stsc",
    "moov/trak/mdia/minf/stbl/stsz",
    "moov/trak/mdia/minf/stbl/stco",
]


def test_a_video_init_segment_has_empty_sample_tables_and_a_trex() -> None:
    data = init_segment(VIDEO)
    assert tree(data) == [*VIDEO_TREE, "moov/mvex", "moov/mvex/trex"]
    (_, ftyp), (_, moov) = boxes(data)
    assert ftyp == b"isom" + bytes.fromhex("00000200") + b"isomiso5iso6avc1mp41"
    # mvhd: movie timescale 1000, no duration (fragmented); next_track_ID 2.
    mvhd = child(moov, b"mvhd")
    assert struct.unpack_from(">I", mvhd, 12)[0] == 1000
    assert struct.unpack_from(">I", mvhd, len(mvhd) - 4)[0] == 2
    tkhd = child(moov, b"trak", b"tkhd")
    assert tkhd[:4] == bytes.fromhex("00000003")  # enabled, in movie
    assert struct.unpack_from(">I", tkhd, 12)[0] == 1  # track_ID
    assert tkhd[-8:] == struct.pack(">II", 64 << 16, 48 << 16)  # 16.16 width, height
    mdhd = child(moov, b"trak", b"mdia", b"mdhd")
    assert mdhd == bytes.fromhex("00000000 00000000 00000000 00003000 00000000 55c4 0000")
    stbl = child(moov, b"trak", b"mdia", b"minf", b"stbl")
    avc1 = child(stbl, b"stsd")[8 + 8 :]  # past the stsd's header and the avc1's
    assert struct.unpack_from(">HH", avc1, 24) == (64, 48)
    assert avc1[78:] == struct.pack(">I4s", 8 + len(AVC_CONFIG), b"avcC") + AVC_CONFIG
    for empty, entries in ((b"stts", "00000000"), (b"stsc", "00000000"),
                           (b"stsz", "00000000 00000000"), (b"stco", "00000000")):  # fmt: skip
        assert child(stbl, empty) == bytes(4) + bytes.fromhex(entries)
    # trex: track 1, description 1, 512 a sample, size 0, non-sync by default.
    trex = child(moov, b"mvex", b"trex")
    assert trex == bytes.fromhex("00000000 00000001 00000001 00000200 00000000 01010000")


def test_an_audio_track_comes_second_with_its_edit_list_and_esds() -> None:
    data = init_segment(VIDEO, AUDIO)
    assert tree(data) == [
        *VIDEO_TREE,
        *AUDIO_TRAK_TREE,
        "moov/mvex",
        "moov/mvex/trex",
        "moov/mvex/trex",
    ]
    moov = child(data, b"moov")
    mvhd = child(moov, b"mvhd")
    assert struct.unpack_from(">I", mvhd, len(mvhd) - 4)[0] == 3  # next_track_ID
    audio_trak = [body for kind, body in boxes(moov) if kind == b"trak"][1]
    assert struct.unpack_from(">I", child(audio_trak, b"tkhd"), 12)[0] == 2
    # One edit: media_time 1024 (the priming cut), rate 1.0, duration 0 (open-ended).
    assert child(audio_trak, b"edts", b"elst") == bytes.fromhex(
        "00000000 00000001 00000000 00000400 0001 0000"
    )
    mdhd = child(audio_trak, b"mdia", b"mdhd")
    assert struct.unpack_from(">I", mdhd, 12)[0] == 48000  # a tick per sample
    stsd = child(audio_trak, b"mdia", b"minf", b"stbl", b"stsd")
    mp4a = stsd[8 + 8 :]
    assert struct.unpack_from(">HH", mp4a, 16) == (2, 16)  # channels, bits
    assert struct.unpack_from(">I", mp4a, 24)[0] == 48000 << 16
    esds = mp4a[28 + 8 + 4 :]  # past the entry's fields, the esds' header and version
    assert esds == bytes.fromhex(
        "03 80808022 0002 00"  # ES_Descriptor: ES_ID 2 (the track), no flags
        "04 80808014 40 15 000000 0001f400 0001f400"  # MPEG-4 audio; 128 kb/s
        "05 80808002 1190"  # DecoderSpecificInfo: the AudioSpecificConfig
        "06 80808001 02"  # SLConfigDescriptor: predefined 2 (MP4)
    )
    trexes = [body for kind, body in boxes(child(moov, b"mvex")) if kind == b"trex"]
    # The audio's: track 2, 1024 samples a frame, every frame a sync sample.
    assert trexes[1] == bytes.fromhex("00000000 00000002 00000001 00000400 00000000 02000000")


# --- Reading boxes back -------------------------------------------------------------


def _moof_with_trun(flags: int, *fields: int) -> bytes:
    trun = struct.pack(">I4sI", 12 + 4 * len(fields), b"trun", flags)
    trun += b"".join(struct.pack(">I", field) for field in fields)
    traf = struct.pack(">I4s", 8 + len(trun), b"traf") + trun
    return struct.pack(">I4s", 8 + len(traf), b"moof") + traf


KEYFRAME_CASES = {
    "a fragment that starts with an IDR": (
        init_segment(VIDEO)
        + media_fragment(sequence_number=1, frame_duration=512, video_decode_time=0, video=[IDR]),
        True,
    ),
    "a fragment that starts with a P frame": (
        media_fragment(sequence_number=2, frame_duration=512, video_decode_time=0,
                       video=[P_FRAME, IDR]),
        False,
    ),
    # FFmpeg's way: first_sample_flags in the trun (data offset, first flags, sizes).
    # (trun flags; sample count, data offset, then the fields those flags say.)
    "first_sample_flags say sync": (_moof_with_trun(0x205, 2, 0x78, 0x02000000, 5, 6), True),
    "first_sample_flags say non-sync": (_moof_with_trun(0x205, 1, 0x78, 0x01010000, 5), False),
    "durations and sizes before sync flags": (
        _moof_with_trun(0x701, 1, 0x78, 0x200, 5, 0x02000000), True
    ),
    "durations and sizes before non-sync flags": (
        _moof_with_trun(0x701, 1, 0x78, 0x200, 5, 0x01010000), False
    ),
    "no flags at all": (_moof_with_trun(0x201, 1, 0x78, 5), False),
    "per-sample flags but no samples": (_moof_with_trun(0x401, 0, 0x78), False),
    "a sample's flags missing": (_moof_with_trun(0x401, 1, 0x78), False),
    "a trun too short for its count": (_moof_with_trun(0x401), False),
    "only an init segment": (init_segment(VIDEO), False),
    "nothing": (b"", False),
    "a box whose size runs past the end": (b"\x00\x00\x01\x00moof", False),
    "a box of size 0": (b"\x00\x00\x00\x00moof" + bytes(16), False),
}  # fmt: skip


@pytest.mark.parametrize(("data", "expected"), KEYFRAME_CASES.values(), ids=KEYFRAME_CASES.keys())
def test_fragment_starts_with_keyframe(data: bytes, expected: bool) -> None:
    assert fragment_starts_with_keyframe(data) is expected


def test_the_writer_loads_no_codec_and_no_event_loop() -> None:
    """Sans-IO in fact, not only in lint-imports' graph: importing the writer in a fresh
    interpreter loads neither PyAV, numpy nor Trio."""
    check = (
        "import sys, trio_vstream.media.fmp4; "
        "print(sorted(m for m in ('av', 'numpy', 'trio') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


# --- Against FFmpeg's own muxer -----------------------------------------------------

# Boxes FFmpeg writes that the writer leaves out on purpose: its tool name (udta), the
# random-access index of its mfra (tfra: an index would grow with every fragment), and
# the colour description (colr), which the stream carries in its SPS (`open_h264` tags
# BT.709 there, where every decoder reads it).
FFMPEG_ONLY = frozenset({b"udta", b"tfra", b"colr"})


def _samples(data: bytes) -> list[tuple[int, int, bytes]]:
    """Each video sample's (decode time, sync, bytes), read from the fragments the way a
    player does: tfhd defaults, trun overrides (first_sample_flags included), data
    offsets from the moof."""
    out = []
    pos = 0
    for kind, body in boxes(data):
        size = 8 + len(body)
        if kind == b"moof":
            traf = child(body, b"traf")
            tfhd = child(traf, b"tfhd")
            tfhd_flags = int.from_bytes(tfhd[1:4], "big")
            fields = iter(struct.unpack_from(f">{(len(tfhd) - 8) // 4}I", tfhd, 8))
            default = {}
            for bit, name in ((0x1, "base"), (0x1, "base2"), (0x2, "index"), (0x8, "duration"),
                              (0x10, "size"), (0x20, "flags")):  # fmt: skip
                if tfhd_flags & bit:
                    default[name] = next(fields)
            time = struct.unpack_from(">Q", child(traf, b"tfdt"), 4)[0]
            trun = child(traf, b"trun")
            flags, count = int.from_bytes(trun[1:4], "big"), struct.unpack_from(">I", trun, 4)[0]
            words = iter(struct.unpack_from(f">{(len(trun) - 8) // 4}I", trun, 8))
            offset = next(words) if flags & 0x1 else 0
            first_flags = next(words) if flags & 0x4 else None
            at = pos + offset
            for index in range(count):
                duration = next(words) if flags & 0x100 else default["duration"]
                sample_size = next(words) if flags & 0x200 else default["size"]
                sample_flags = next(words) if flags & 0x400 else default["flags"]
                if index == 0 and first_flags is not None:
                    sample_flags = first_flags
                out.append((time, not sample_flags & 0x00010000, data[at : at + sample_size]))
                time += duration
                at += sample_size
        pos += size
    return out


def test_the_layout_is_ffmpegs_empty_moov_default_base_moof_box_for_box() -> None:
    """The same H.264 packets through FFmpeg's mov muxer (``empty_moov+default_base_moof``,
    cutting a fragment at each keyframe) and through the writer (a fragment from each
    keyframe on): the same boxes in the same places, the same timescale, ``avcC``, decode
    times, sync samples and sample bytes. FFmpeg puts its sample defaults in the ``tfhd``
    and the first sample's flags apart; the writer lists them per sample, as readers of
    both accept, so those boxes' fields differ and their meaning is compared instead."""
    av = pytest.importorskip("av")
    import numpy as np  # the encoder's input only: the writer never sees an array
    from av.video.frame import PictureType
    from av.video.reformatter import VideoReformatter

    from trio_vstream.media.h264 import (
        avc_config_from_parameter_sets,
        open_h264,
        to_encoder_frame,
        to_sample,
    )

    width, height, fps = 64, 48, 24
    ctx = open_h264(width=width, height=height, fps=fps)
    reformatter = VideoReformatter()
    packets = []
    for index in range(7):
        shade = (index * 37) % 256
        rgb = bytes([shade, 255 - shade, (index * 91) % 256]) * (width * height)
        picture = np.frombuffer(rgb, np.uint8).reshape(height, width, 3)
        frame = to_encoder_frame(reformatter, picture)
        frame.pts = index
        if index in (0, 3, 5):
            frame.pict_type = PictureType.I
        packets.extend(ctx.encode(frame))
    assert [p.is_keyframe for p in packets] == [True, False, False, True, False, True, False]

    # FFmpeg's stream is described by FFmpeg's own reading of the encoder's SPS/PPS (an
    # H.264 elementary stream's), not by anything of the writer's.
    elementary = av.open(io.BytesIO(bytes(ctx.extradata) + bytes(packets[0])), format="h264")
    reference = io.BytesIO()
    movflags = "empty_moov+default_base_moof+frag_keyframe"
    with av.open(reference, "w", format="mp4", options={"movflags": movflags}) as container:
        stream = container.add_stream_from_template(elementary.streams.video[0])
        stream.time_base = Fraction(1, fps)
        for packet in packets:
            packet.stream = stream
            container.mux(packet)
    elementary.close()
    ffmpeg = reference.getvalue()

    timescale = track_timescale(fps)
    track = VideoTrack(
        width=width,
        height=height,
        timescale=timescale,
        frame_duration=timescale // fps,
        avc_config=avc_config_from_parameter_sets(bytes(ctx.extradata)),
    )
    ours = init_segment(track)
    starts = [i for i, p in enumerate(packets) if p.is_keyframe] + [len(packets)]
    for number, (begin, end) in enumerate(itertools.pairwise(starts), start=1):
        ours += media_fragment(
            sequence_number=number,
            frame_duration=track.frame_duration,
            video_decode_time=begin * track.frame_duration,
            video=[VideoSample(to_sample(bytes(p)), p.is_keyframe) for p in packets[begin:end]],
        )
    ours += trailer()

    assert tree(ours) == tree(ffmpeg, skip=FFMPEG_ONLY)
    for path in ((b"moov", b"trak", b"mdia", b"mdhd"), (b"moov", b"trak", b"tkhd")):
        assert child(ours, *path) == child(ffmpeg, *path), path
    stsd = (b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stsd")
    # The avc1 entry's fields, then its avcC: FFmpeg's reading of the SPS/PPS, the same.
    our_avc1, ffmpeg_avc1 = (child(data, *stsd)[8 + 8 :] for data in (ours, ffmpeg))
    assert our_avc1[:78] == ffmpeg_avc1[:78]
    assert child(our_avc1[78:], b"avcC") == child(ffmpeg_avc1[78:], b"avcC")
    assert _samples(ours) == _samples(ffmpeg)
    assert [kind for kind, _ in boxes(ours)] == [kind for kind, _ in boxes(ffmpeg)]
    assert fmp4.fragment_starts_with_keyframe(ffmpeg)
