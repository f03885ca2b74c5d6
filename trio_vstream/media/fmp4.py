"""Fragmented MP4 (ISO BMFF) boxes from already-encoded samples: sans-IO, no codec.

Bytes and counters in, bytes out, as h11 writes HTTP: `init_segment` gives the ``ftyp`` +
``moov`` for a track's description, `media_fragment` one ``moof`` + ``mdat`` from the
samples of one chunk and where they start on each track's timeline, `trailer` the
``mfra`` that ends a stream. Nothing is buffered between calls and nothing here knows an
encoder: `trio_vstream.media.encoding` keeps the counters (sequence number, decode times)
and hands over the samples its codecs made (`trio_vstream.media.h264`,
`trio_vstream.media.aac`). Import-linter keeps this module free of PyAV, numpy and Trio
(contract ``media-fmp4-pure``), and ``tests/media/test_fmp4.py`` tests it as tables of
bytes.

Layout choices, for MSE, mirror FFmpeg's ``empty_moov+default_base_moof`` output box for box
(``tests/media/test_fmp4.py`` checks it against FFmpeg's mov muxer for the same packets):
the ``moov`` has empty sample tables plus ``mvex``/``trex``; ``tfhd`` has
default-base-is-moof, ``tfdt`` carries the decode time, ``trun`` has per-sample size and sync
flags. The track timescale is ``fps`` times a power of two (>= 10000, `track_timescale`),
like FFmpeg's, so every frame duration is an exact integer.

Sound is a second track in the same ``moov`` and in every ``moof`` beside the video (one
``traf`` each, the video's first, so a fragment still starts where a viewer can join): an
``mp4a`` sample entry with its ``esds``, and an edit list that cuts the encoder's priming
(``elst`` media_time = `AudioTrack.priming`). A fragment's audio ``tfdt`` and per-sample
durations say where its samples belong, so the two tracks stay in step to the sample even
when a fragment's audio ends before its video.

`fragment_starts_with_keyframe` reads boxes back: where a viewer may join a stream.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

import attrs

__all__ = [
    "AudioSample",
    "AudioTrack",
    "VideoSample",
    "VideoTrack",
    "fragment_starts_with_keyframe",
    "init_segment",
    "media_fragment",
    "track_timescale",
    "trailer",
]

VIDEO_TRACK_ID: Final = 1
AUDIO_TRACK_ID: Final = 2
_MOVIE_TIMESCALE = 1000
SAMPLE_FLAGS_SYNC: Final = 0x02000000
"""sample_depends_on=2: an IDR (or an AAC frame) depends on nothing."""
SAMPLE_FLAGS_NON_SYNC: Final = 0x01010000
"""sample_depends_on=1, sample_is_non_sync_sample=1."""
_AUDIO_SAMPLE_FLAGS = SAMPLE_FLAGS_SYNC  # every AAC frame decodes on its own
_UNITY_MATRIX = struct.pack(">9I", 0x00010000, 0, 0, 0, 0x00010000, 0, 0, 0, 0x40000000)


@attrs.frozen
class VideoTrack:
    """What the init segment says of an H.264 track."""

    width: int
    height: int
    timescale: int
    """Ticks per second of the track (`track_timescale`)."""
    frame_duration: int
    """Ticks per frame: every sample's duration (``trex`` and ``tfhd`` defaults)."""
    avc_config: bytes
    """The AVCDecoderConfigurationRecord (ISO/IEC 14496-15 5.3.3.1): the ``avcC`` payload."""


@attrs.frozen
class AudioTrack:
    """What the init segment says of an AAC track."""

    sample_rate: int
    """Also the track's timescale: one tick per sample."""
    channels: int
    audio_specific_config: bytes
    """The encoder's extradata, carried in the ``esds``."""
    bit_rate: int
    frame_samples: int
    """Samples in one coded frame: the ``trex`` default duration (1024 for AAC-LC)."""
    priming: int
    """Samples of priming before the first real one, cut by the edit list."""


@attrs.frozen
class VideoSample:
    """One coded frame, as the ``mdat`` holds it (length-prefixed NAL units)."""

    data: bytes
    sync: bool
    """Whether a decoder may start here (an IDR)."""


@attrs.frozen
class AudioSample:
    """One coded audio frame and how many samples of the track it covers."""

    data: bytes
    duration: int


def track_timescale(fps: int) -> int:
    """``fps`` times the smallest power of two that reaches 10000, as FFmpeg picks."""
    timescale = fps
    while timescale < 10000:
        timescale *= 2
    return timescale


def _box(kind: bytes, *payload: bytes) -> bytes:
    """A box: its 32-bit size, its four-character type, its payload."""
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def _full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    """A box whose payload begins with a version byte and 24 bits of flags."""
    return _box(kind, struct.pack(">I", (version << 24) | flags), *payload)


def init_segment(video: VideoTrack, audio: AudioTrack | None = None) -> bytes:
    """``ftyp`` + ``moov``: the tracks with empty sample tables, and their ``trex``."""
    w, h = video.width, video.height
    ftyp = _box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isomiso5iso6avc1mp41")
    mvhd = _full_box(
        b"mvhd", 0, 0,
        struct.pack(">IIII", 0, 0, _MOVIE_TIMESCALE, 0),
        struct.pack(">IH10x", 0x00010000, 0x0100),
        _UNITY_MATRIX,
        bytes(24),
        struct.pack(">I", (AUDIO_TRACK_ID if audio is not None else VIDEO_TRACK_ID) + 1),
    )  # fmt: skip
    tkhd = _full_box(
        b"tkhd", 0, 0x3,  # track enabled, in movie
        struct.pack(">IIIII8xhhhH", 0, 0, VIDEO_TRACK_ID, 0, 0, 0, 0, 0, 0),
        _UNITY_MATRIX,
        struct.pack(">II", w << 16, h << 16),
    )  # fmt: skip
    mdhd = _full_box(
        b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, video.timescale, 0, 0x55C4, 0)
    )  # language "und"
    hdlr = _full_box(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, b"vide"), b"VideoHandler\x00")
    vmhd = _full_box(b"vmhd", 0, 1, bytes(8))
    dinf = _box(b"dinf", _full_box(b"dref", 0, 0, struct.pack(">I", 1), _full_box(b"url ", 0, 1)))
    avc1 = _box(
        b"avc1",
        struct.pack(">6xH16xHHIIIH", 1, w, h, 0x00480000, 0x00480000, 0, 1),
        bytes(32),  # compressorname
        struct.pack(">Hh", 0x0018, -1),
        _box(b"avcC", video.avc_config),
    )
    trak = _box(b"trak", tkhd, _box(b"mdia", mdhd, hdlr, _box(b"minf", vmhd, dinf, _stbl(avc1))))
    trex = _full_box(
        b"trex", 0, 0,
        struct.pack(
            ">IIIII", VIDEO_TRACK_ID, 1, video.frame_duration, 0, SAMPLE_FLAGS_NON_SYNC
        ),
    )  # fmt: skip
    if audio is None:
        return ftyp + _box(b"moov", mvhd, trak, _box(b"mvex", trex))
    audio_trex = _full_box(
        b"trex", 0, 0,
        struct.pack(">IIIII", AUDIO_TRACK_ID, 1, audio.frame_samples, 0, _AUDIO_SAMPLE_FLAGS),
    )  # fmt: skip
    return ftyp + _box(
        b"moov", mvhd, trak, _audio_trak(audio, dinf), _box(b"mvex", trex, audio_trex)
    )


def _stbl(sample_entry: bytes) -> bytes:
    """A sample table with one sample entry and no samples (they are in the fragments)."""
    return _box(
        b"stbl",
        _full_box(b"stsd", 0, 0, struct.pack(">I", 1), sample_entry),
        _full_box(b"stts", 0, 0, struct.pack(">I", 0)),
        _full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
        _full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)),
        _full_box(b"stco", 0, 0, struct.pack(">I", 0)),
    )


def _audio_trak(audio: AudioTrack, dinf: bytes) -> bytes:
    """The AAC track's ``trak``: an ``mp4a`` sample entry with its ``esds``, and the
    edit list that cuts the encoder's priming."""
    rate, channels = audio.sample_rate, audio.channels
    tkhd = _full_box(
        b"tkhd", 0, 0x3,
        # alternate_group 1, volume 1.0; an audio track has no size.
        struct.pack(">IIIII8xhhhH", 0, 0, AUDIO_TRACK_ID, 0, 0, 0, 1, 0x0100, 0),
        _UNITY_MATRIX,
        struct.pack(">II", 0, 0),
    )  # fmt: skip
    # One edit: from track time `priming` (the first real sample) on, for the whole rest
    # (a segment_duration of 0 in a fragmented file: its length is not known yet).
    elst = _full_box(b"elst", 0, 0, struct.pack(">IIiHH", 1, 0, audio.priming, 1, 0))
    mdhd = _full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, rate, 0, 0x55C4, 0))
    hdlr = _full_box(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, b"soun"), b"SoundHandler\x00")
    smhd = _full_box(b"smhd", 0, 0, struct.pack(">hH", 0, 0))
    mp4a = _box(
        b"mp4a",
        struct.pack(">6xH8xHHHH", 1, channels, 16, 0, 0),
        struct.pack(">I", rate << 16),
        _esds(audio.audio_specific_config, audio.bit_rate),
    )
    return _box(
        b"trak",
        tkhd,
        _box(b"edts", elst),
        _box(b"mdia", mdhd, hdlr, _box(b"minf", smhd, dinf, _stbl(mp4a))),
    )


def _descriptor(tag: int, *payload: bytes) -> bytes:
    """An MPEG-4 descriptor (ISO/IEC 14496-1 8.3.3): tag, a 4-byte size, the payload."""
    body = b"".join(payload)
    size = len(body)
    return bytes([tag, 0x80 | (size >> 21) & 0x7F, 0x80 | (size >> 14) & 0x7F,
                  0x80 | (size >> 7) & 0x7F, size & 0x7F]) + body  # fmt: skip


def _esds(audio_specific_config: bytes, bit_rate: int) -> bytes:
    """The ``esds`` of an AAC track: its AudioSpecificConfig (the encoder's extradata)."""
    decoder_config = _descriptor(
        0x04,
        # objectTypeIndication 0x40 (MPEG-4 audio), streamType 5 (audio) << 2 | 1,
        # bufferSizeDB 0, max and average bit rate.
        struct.pack(">BB3sII", 0x40, 0x15, bytes(3), bit_rate, bit_rate),
        _descriptor(0x05, audio_specific_config),
    )
    es = _descriptor(0x03, struct.pack(">HB", AUDIO_TRACK_ID, 0), decoder_config,
                     _descriptor(0x06, b"\x02"))  # fmt: skip
    return _full_box(b"esds", 0, 0, es)


def media_fragment(
    *,
    sequence_number: int,
    frame_duration: int,
    video_decode_time: int,
    video: Sequence[VideoSample],
    audio_decode_time: int = 0,
    audio: Sequence[AudioSample] = (),
) -> bytes:
    """One ``moof`` + ``mdat``: the video's ``traf`` (if it has samples), then the audio's
    (if it has any); the ``mdat`` holds their samples in that order.

    ``video_decode_time`` and ``audio_decode_time`` are where each track's first sample
    here starts, in its timescale (the ``tfdt``); every video sample lasts
    ``frame_duration``, every audio sample its own ``duration``.
    """
    entries: list[int] = []
    for sample in video:
        entries.append(len(sample.data))
        entries.append(SAMPLE_FLAGS_SYNC if sample.sync else SAMPLE_FLAGS_NON_SYNC)
    audio_entries: list[int] = []
    for audio_sample in audio:
        audio_entries += [audio_sample.duration, len(audio_sample.data)]
    video_bytes = sum(len(sample.data) for sample in video)

    def moof(data_offset: int) -> bytes:
        trafs = []
        if video:
            tfhd = _full_box(
                b"tfhd", 0, 0x020000 | 0x000008,  # default-base-is-moof, default duration
                struct.pack(">II", VIDEO_TRACK_ID, frame_duration),
            )  # fmt: skip
            tfdt = _full_box(b"tfdt", 1, 0, struct.pack(">Q", video_decode_time))
            trun = _full_box(
                b"trun", 0, 0x000001 | 0x000200 | 0x000400,  # data offset, sizes, flags
                struct.pack(f">Ii{len(entries)}I", len(video), data_offset, *entries),
            )  # fmt: skip
            trafs.append(_box(b"traf", tfhd, tfdt, trun))
        if audio:
            tfhd = _full_box(b"tfhd", 0, 0x020000, struct.pack(">I", AUDIO_TRACK_ID))
            tfdt = _full_box(b"tfdt", 1, 0, struct.pack(">Q", audio_decode_time))
            trun = _full_box(
                b"trun", 0, 0x000001 | 0x000100 | 0x000200,  # data offset, durations, sizes
                struct.pack(
                    f">Ii{len(audio_entries)}I",
                    len(audio), data_offset + video_bytes, *audio_entries,
                ),
            )  # fmt: skip
            trafs.append(_box(b"traf", tfhd, tfdt, trun))
        mfhd = _full_box(b"mfhd", 0, 0, struct.pack(">I", sequence_number))
        return _box(b"moof", mfhd, *trafs)

    moof_size = len(moof(0))
    mdat_payload = b"".join(s.data for s in video) + b"".join(s.data for s in audio)
    mdat_header = struct.pack(">I4s", 8 + len(mdat_payload), b"mdat")
    return moof(moof_size + len(mdat_header)) + mdat_header + mdat_payload


def trailer() -> bytes:
    """An ``mfra`` holding only its ``mfro``: it marks the end of the stream the way
    FFmpeg's trailer does, without an index that would grow with every fragment."""
    return _box(b"mfra", _full_box(b"mfro", 0, 0, struct.pack(">I", 8 + 16)))


def fragment_starts_with_keyframe(data: bytes) -> bool:
    """Whether the first fragment in ``data`` (after an init segment, if any) begins with a
    sync sample: where a viewer may join or resume, whatever the codec options made.

    Reads only box headers and the first ``trun`` entry (no decoding); anything it cannot
    read says False, so a stream it does not understand is never joined mid-GOP.
    """
    view = memoryview(data)
    moof = _find_box(view, b"moof")
    traf = _find_box(moof, b"traf") if moof is not None else None
    trun = _find_box(traf, b"trun") if traf is not None else None
    if trun is None or len(trun) < 8:
        return False
    flags = int.from_bytes(trun[1:4], "big")
    sample_count = int.from_bytes(trun[4:8], "big")
    pos = 8 + (4 if flags & 0x000001 else 0)  # data_offset
    if flags & 0x000004:  # first_sample_flags
        sample_flags = int.from_bytes(trun[pos : pos + 4], "big") if len(trun) >= pos + 4 else -1
    elif flags & 0x000400 and sample_count:  # per-sample flags: the first entry's
        pos += (4 if flags & 0x000100 else 0) + (4 if flags & 0x000200 else 0)
        sample_flags = int.from_bytes(trun[pos : pos + 4], "big") if len(trun) >= pos + 4 else -1
    else:
        return False
    return sample_flags >= 0 and not sample_flags & 0x00010000  # sample_is_non_sync_sample


def _find_box(data: memoryview, kind: bytes) -> memoryview | None:
    """The payload of the first box of ``kind`` among ``data``'s boxes, or None."""
    pos = 0
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos : pos + 4], "big")
        if size < 8 or pos + size > len(data):
            return None
        if data[pos + 4 : pos + 8] == kind:
            return data[pos + 8 : pos + size]
        pos += size
    return None
