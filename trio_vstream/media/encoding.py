"""H.264 in fragmented MP4, emitted chunk by chunk while the model is still generating.

Why we write the MP4 boxes ourselves instead of using FFmpeg's mov muxer
------------------------------------------------------------------------
FFmpeg's mov muxer cuts a fragment only when the *next* packet arrives (``frag_every_frame``,
``frag_duration`` and ``frag_size`` are all checked on packet arrival), or when the caller calls
``av_write_frame(ctx, NULL)`` (the only way ``frag_custom`` flushes). PyAV exposes neither a
NULL write nor any other muxer flush: ``OutputContainer.mux`` always goes through
``av_interleaved_write_frame`` with a real packet, and a zero-size packet is discarded by
movenc *before* the fragment check, so it flushes nothing (tested with PyAV 18 / FFmpeg 8).
Hence the upstream server's one-frame hold-back per chunk. The ``flush_packets`` flag does not
help either: it empties the AVIO buffer, while the held-back frame sits in the muxer itself.

So this module uses PyAV only as an encoder (a bare ``CodecContext``) and writes the ISO BMFF
boxes itself: one ``ftyp``+``moov`` init segment (``avcC`` built from the SPS/PPS that
libx264 puts in extradata under ``GLOBAL_HEADER``), then exactly one ``moof``+``mdat`` per
``encode()`` call holding all of that call's frames, and an ``mfra`` trailer on ``close()``.
Nothing is buffered between calls, no AVIO buffer exists that could hold bytes back, and the
state kept per session is a handful of counters (no ever-growing BytesIO, no per-fragment index).

Layout choices, for MSE, mirror FFmpeg's ``empty_moov+default_base_moof`` output box for box
(checked against it): the ``moov`` has empty sample tables plus ``mvex``/``trex``; ``tfhd`` has
default-base-is-moof, ``tfdt`` carries the decode time, ``trun`` has per-sample size and sync
flags. Timestamps are derived from the frame count, never from the codec, so the stream
always plays at ``fps``. The track timescale is ``fps`` times a power of two (>= 10000), like
FFmpeg's, so every frame duration is an exact integer.

Why some x264 parameters are forced: every frame handed to ``encode()`` must come out of that
same call, so the encoder must have zero delay. ``tune=zerolatency`` gives that, but a client
overriding ``tune``/``preset`` would silently bring back B-frames, lookahead, frame threads or
VFR-timestamp buffering, so the low-latency x264 parameters are always prepended to
``x264-params``. The options a caller may add are an allow-list with checked values
(``trio_vstream.protocol._codec_options``, shared with the protocol's validation), and none
of them can defeat those parameters, nor write a file (``dump-yuv=``), nor choose a
preset slower than ``medium``. Should an encoder ever delay a frame anyway, that is
detected (fewer packets than frames) and reported as :class:`EncodingError` rather than a
stalled stream.

Why every chunk begins with an IDR frame: a viewer who joins a running session (see
``trio_vstream.outputs.watch``) gets the init segment and then the chunks from the one it joined
at; its bytes decode on their own only if that chunk's first frame depends on nothing
before it. Forcing the first frame of each ``encode()`` to be an IDR makes every chunk a
join point (and a skip point for a viewer that falls behind), at a measured cost of a few
percent of the bitrate at the usual chunk lengths (docs/performance.md, "Keyframes").
``keyframe_interval`` (chunks from one forced IDR to the next; 0 leaves keyframes to
x264, every 250 frames and at scene cuts) exists for that measurement. A caller's ``g``
(or ``keyint``) only adds keyframes between those: it cannot remove the forced ones.

Sound, when the engine makes it (``audio_sample_rate``): a second track, AAC-LC from
FFmpeg's own encoder, in the same ``moov`` and in every ``moof`` beside the video (one
``traf`` each, the video's first, so a fragment still starts where a viewer can join).
Each chunk's PCM covers exactly its frames (`trio_vstream.values.audio_samples_through`);
AAC codes 1024-sample frames and its encoder holds one back, so a FIFO keeps the samples
that do not fill a frame yet and the packets come out a frame or two behind: a fragment
carries the audio encoded so far, and its timestamps (``tfdt``, per-sample durations) say
where it belongs, so the two tracks stay in step to the sample even though a fragment's
audio ends a little before its video. The encoder's priming (1024 samples of silence
before the first real one) is cut by the audio track's edit list (``elst``
media_time=1024), and ``close`` codes what is left in the FIFO as a short last frame
whose sample duration is the real count: the joined stream decodes to exactly the PCM
the engine returned, no sample more or less. A stopped session gets no trailer, so its
last one to two AAC frames are not sent.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Final

import av
import av.error
import numpy as np
from av.video.frame import PictureType
from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

from trio_vstream.media.image_header import ImageHeaderError, read_image_header
from trio_vstream.protocol import CodecOptionError, check_codec_options
from trio_vstream.values import AUDIO_MAX_CHANNELS, AUDIO_SAMPLE_RATES, audio_samples_through

__all__ = [
    "EncodingError",
    "FragmentedMP4Encoder",
    "decode_image",
    "fragment_starts_with_keyframe",
    "open_h264",
    "to_encoder_frame",
]


class EncodingError(Exception):
    """Bad input, bad codec options, or a codec failure; the message says which."""


class EncodingAbandoned(Exception):
    """``encode`` stopped between frames because its caller no longer wants the chunk.

    The encoder has taken part of the chunk and cannot go on; only ``close`` is left.
    """


DEFAULT_CODEC_OPTIONS: dict[str, str] = {
    "preset": "ultrafast",
    "tune": "zerolatency",
    "threads": "0",
}

# Applied on top of any preset/tune so that one frame in gives one packet out immediately:
# no B-frames (no reordering), no rate-control or threading lookahead, sliced rather than
# frame threads, and constant-frame-rate input (x264 otherwise waits for the next timestamp).
_LOW_LATENCY_X264_PARAMS = (
    "bframes=0:rc-lookahead=0:sync-lookahead=0:sliced-threads=1:force-cfr=1:mbtree=0"
)

# 8K UHD is the largest conditioning image worth accepting.
DEFAULT_MAX_IMAGE_PIXELS = 7680 * 4320
# And no panorama longer than this a side (WebP's own limit is 16383).
MAX_IMAGE_SIDE = 16384

_TRACK_ID = 1
_AUDIO_TRACK_ID = 2
_AAC_FRAME = 1024
"""Samples in one AAC-LC frame (one MP4 sample)."""
_AAC_PRIMING = 1024
"""Samples of priming FFmpeg's AAC encoder puts before the first real one (its
``initial_padding``): the first packet's pts is -1024, which `encode` checks."""
_AUDIO_SAMPLE_FLAGS = 0x02000000  # every AAC frame decodes on its own
AUDIO_CODEC_STRING: Final = "mp4a.40.2"
"""RFC 6381 codecs value of the audio track (AAC-LC), for MSE ``addSourceBuffer``."""
_MOVIE_TIMESCALE = 1000
_SAMPLE_FLAGS_SYNC = 0x02000000  # sample_depends_on=2 (an IDR depends on nothing)
_SAMPLE_FLAGS_NON_SYNC = 0x01010000  # sample_depends_on=1, sample_is_non_sync_sample=1
_UNITY_MATRIX = struct.pack(">9I", 0x00010000, 0, 0, 0, 0x00010000, 0, 0, 0, 0x40000000)
_NAL_SPS = 7
_NAL_PPS = 8


def _box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def _full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return _box(kind, struct.pack(">I", (version << 24) | flags), *payload)


def _split_nal_units(data: bytes) -> list[bytes]:
    """Return the NAL units of an access unit, accepting Annex B or 4-byte length prefixes.

    libx264 emits Annex B, but ``x264-params=annexb=0`` would switch to length prefixes, and
    MP4 samples need the latter, so both are normalised here.
    """
    if data.startswith((b"\x00\x00\x01", b"\x00\x00\x00\x01")):
        nals: list[bytes] = []
        start = data.find(b"\x00\x00\x01")
        while start >= 0:
            begin = start + 3
            nxt = data.find(b"\x00\x00\x01", begin)
            # A NAL unit never ends in 0x00 (H.264 7.4.1), so trailing zeros are the next
            # start code's leading zero_byte or trailing_zero_8bits padding.
            nal = data[begin : len(data) if nxt < 0 else nxt].rstrip(b"\x00")
            if nal:
                nals.append(nal)
            start = nxt
        return nals
    nals = []
    pos = 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise EncodingError("encoder produced a truncated length-prefixed NAL unit")
        (size,) = struct.unpack_from(">I", data, pos)
        pos += 4
        if size == 0 or pos + size > len(data):
            raise EncodingError("encoder produced a malformed length-prefixed NAL unit")
        nals.append(data[pos : pos + size])
        pos += size
    return nals


def _to_sample(packet_bytes: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(nal)) + nal for nal in _split_nal_units(packet_bytes))


def _build_avcc(sps_list: list[bytes], pps_list: list[bytes]) -> bytes:
    sps = sps_list[0]
    if len(sps) < 4:
        raise EncodingError("encoder produced an SPS too short to describe the stream")
    profile_idc = sps[1]
    parts = [
        bytes([1, profile_idc, sps[2], sps[3], 0xFF, 0xE0 | len(sps_list)]),
        *(struct.pack(">H", len(s)) + s for s in sps_list),
        bytes([len(pps_list)]),
        *(struct.pack(">H", len(p)) + p for p in pps_list),
    ]
    if profile_idc not in (66, 77, 88):
        # High-profile extension (ISO/IEC 14496-15 5.3.3.1.2). The values are fixed because
        # the encoder is always fed 8-bit yuv420p: chroma_format_idc=1, both bit depths 8.
        parts.append(bytes([0xFC | 1, 0xF8 | 0, 0xF8 | 0, 0]))
    return _box(b"avcC", *parts)


def _track_timescale(fps: int) -> int:
    timescale = fps
    while timescale < 10000:
        timescale *= 2
    return timescale


def open_h264(
    *,
    width: int,
    height: int,
    fps: int,
    codec_options: Mapping[str, str] | None = None,
    forced_idr: bool = True,
) -> av.VideoCodecContext:
    """An open libx264 context as `FragmentedMP4Encoder` encodes with: yuv420p, BT.709
    limited range tagged, SPS/PPS in extradata, the low-latency parameters on top of
    ``codec_options`` (checked against the allow-list). Its own function so that the
    benchmark's bare encoder (``bench/_bare_encoder.py``) runs exactly these settings.

    ``forced_idr``: a keyframe the caller forces is an IDR, not an open-GOP I frame a
    decoder cannot start from (the allow-list has no option that could say otherwise).
    """
    options = dict(DEFAULT_CODEC_OPTIONS)
    if codec_options is not None:
        # The protocol checked a client's options already; checking again here keeps
        # any other caller inside the same allow-list (no dump-yuv=, no slow preset).
        try:
            options.update(check_codec_options(codec_options, where="codec_options"))
        except CodecOptionError as exc:
            raise EncodingError(str(exc)) from None
    if forced_idr:
        options["forced-idr"] = "1"
    user_x264_params = options.get("x264-params", "")
    options["x264-params"] = (
        f"{_LOW_LATENCY_X264_PARAMS}:{user_x264_params}"
        if user_x264_params
        else _LOW_LATENCY_X264_PARAMS
    )

    try:
        ctx = av.CodecContext.create("libx264", "w")
    except (av.error.FFmpegError, ValueError) as exc:
        raise EncodingError(f"libx264 encoder is not available: {exc}") from exc
    assert isinstance(ctx, av.VideoCodecContext)
    ctx.width = width
    ctx.height = height
    ctx.pix_fmt = "yuv420p"
    ctx.time_base = Fraction(1, fps)
    ctx.framerate = Fraction(fps, 1)
    # SPS/PPS go to extradata (for avcC) instead of being repeated in-band.
    ctx.flags |= av.codec.context.Flags.global_header
    # Tag BT.709 limited range in the SPS VUI (`to_encoder_frame` converts so):
    # untagged streams are guessed as BT.601 by some decoders and BT.709 by others.
    ctx.colorspace = 1  # AVCOL_SPC_BT709
    ctx.color_primaries = 1  # AVCOL_PRI_BT709
    ctx.color_trc = 1  # AVCOL_TRC_BT709
    ctx.color_range = int(ColorRange.MPEG)
    ctx.options = options
    try:
        ctx.open()
    except (av.error.FFmpegError, ValueError) as exc:
        shown = {k: v for k, v in options.items() if k != "x264-params"}
        if user_x264_params:
            shown["x264-params"] = user_x264_params
        raise EncodingError(f"libx264 rejected the codec options {shown}: {exc}") from exc
    unused = sorted(ctx.options)
    if unused:
        # avcodec_open2 hands back the entries no option consumed: almost always typos.
        raise EncodingError(f"unknown libx264 codec option(s): {', '.join(unused)}")
    return ctx


def to_encoder_frame(reformatter: VideoReformatter, rgb: np.ndarray) -> av.VideoFrame:
    """One (H, W, 3) uint8 RGB picture as the yuv420p frame `open_h264`'s context takes
    (BT.709, limited range), through ``reformatter`` (one per encoder: it keeps its
    swscale context from frame to frame).

    The RGB frame is a view of the array, not a copy: ``from_ndarray`` copies the
    picture first, ~0.4 ms of CPU per 832x480 frame (a sixth of encoding it) for
    nothing, since swscale can read the pixels where they are and writes the YUV
    frame anyway. The output is the same, byte for byte.
    """
    frame = av.VideoFrame.from_numpy_buffer(np.ascontiguousarray(rgb), format="rgb24")
    return reformatter.reformat(
        frame,
        format="yuv420p",
        dst_colorspace=Colorspace.ITU709,
        dst_color_range=ColorRange.MPEG,
    )


class FragmentedMP4Encoder:
    """One per session. Not thread-safe; one call at a time (the server guarantees that).

    The codec is opened in the constructor so that bad ``codec_options`` fail at session
    start, before any generation work is spent, rather than on the first chunk.
    """

    def __init__(
        self,
        *,
        width: int,
        height: int,
        fps: int,
        codec_options: Mapping[str, str] | None = None,
        keyframe_interval: int = 1,
        audio_sample_rate: int | None = None,
        audio_channels: int = 1,
    ) -> None:
        for name, value in (("width", width), ("height", height), ("fps", fps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EncodingError(f"{name} must be a positive integer, got {value!r}")
        if width % 2 or height % 2:
            # yuv420p subsamples chroma 2x2; libx264 rejects odd sizes with a cryptic error.
            raise EncodingError(
                f"width and height must be even for H.264 4:2:0, got {width}x{height}"
            )
        self._width = width
        self._height = height
        self._fps = fps
        self._timescale = _track_timescale(fps)
        self._frame_duration = self._timescale // fps

        if keyframe_interval < 0:
            raise EncodingError(f"keyframe_interval must be >= 0, got {keyframe_interval}")
        self._keyframe_interval = keyframe_interval
        self._chunks_encoded = 0
        ctx = open_h264(
            width=width,
            height=height,
            fps=fps,
            codec_options=codec_options,
            forced_idr=keyframe_interval > 0,
        )

        self._ctx: av.VideoCodecContext | None = ctx
        self._audio: av.AudioCodecContext | None = None
        self._audio_channels = audio_channels
        self._audio_rate = audio_sample_rate
        self._audio_fifo = np.zeros((audio_channels, 0), dtype=np.float32)
        self._audio_fed = 0  # samples handed to the AAC encoder
        self._audio_written = 0  # track time of the next AAC sample (priming included)
        if audio_sample_rate is not None:
            self._audio = self._open_audio(audio_sample_rate, audio_channels)
        self._reformatter = VideoReformatter()
        self._avcc: bytes | None = None
        if ctx.extradata:
            self._avcc = self._avcc_from_parameter_sets(bytes(ctx.extradata))
        self._frames_encoded = 0
        self._sequence_number = 0
        self._init_written = False
        self._init_bytes: bytes | None = None
        self._closed = False
        self._failed: str | None = None

    @staticmethod
    def _open_audio(rate: int, channels: int) -> av.AudioCodecContext:
        if isinstance(rate, bool) or not isinstance(rate, int) or rate not in AUDIO_SAMPLE_RATES:
            raise EncodingError(
                f"audio_sample_rate must be one of {sorted(AUDIO_SAMPLE_RATES)}, got {rate!r}"
            )
        if isinstance(channels, bool) or channels not in range(1, AUDIO_MAX_CHANNELS + 1):
            raise EncodingError(f"audio_channels must be 1 or 2, got {channels!r}")
        try:
            actx = av.CodecContext.create("aac", "w")
            assert isinstance(actx, av.AudioCodecContext)
            actx.sample_rate = rate
            actx.layout = "mono" if channels == 1 else "stereo"
            actx.format = "fltp"
            actx.time_base = Fraction(1, rate)
            actx.bit_rate = 64000 * channels
            actx.open()
        except (av.error.FFmpegError, ValueError) as exc:
            raise EncodingError(f"the AAC encoder could not be opened: {exc}") from exc
        if actx.frame_size != _AAC_FRAME or not actx.extradata:
            raise EncodingError("the AAC encoder is not the AAC-LC one this muxer expects")
        return actx

    @property
    def frames_encoded(self) -> int:
        return self._frames_encoded

    @property
    def audio_sample_rate(self) -> int | None:
        """Samples per second of the audio track; None for a stream without sound."""
        return self._audio_rate

    @property
    def audio_channels(self) -> int:
        return self._audio_channels

    def audio_samples_for(self, frames: int) -> int:
        """How many audio samples the next chunk of ``frames`` frames must carry."""
        assert self._audio_rate is not None
        done = self._frames_encoded
        return audio_samples_through(
            done + frames, self._audio_rate, self._fps
        ) - audio_samples_through(done, self._audio_rate, self._fps)

    @property
    def init_segment(self) -> bytes | None:
        """The init segment (``ftyp`` + ``moov``) the first chunk began with; None before it.

        What a follower that joins mid-stream needs ahead of its first fragment."""
        return self._init_bytes

    @property
    def codec_string(self) -> str | None:
        """RFC 6381 codecs value (e.g. ``avc1.42c01e``), for MSE ``addSourceBuffer``."""
        if self._avcc is None:
            return None
        return "avc1." + self._avcc[9:12].hex()

    def encode(
        self,
        frames: np.ndarray,
        *,
        audio: np.ndarray | None = None,
        abandon: Callable[[], bool] | None = None,
    ) -> bytes:
        """One chunk's frames (and sound) as fMP4 bytes (the init segment first, the first
        time).

        ``audio``, for an encoder with an audio track and only then: (channels, samples)
        float32 in [-1, 1], exactly `audio_samples_for` this chunk's frames.
        ``abandon`` is asked before each frame: a stopped session does not wait for a
        whole chunk's encode (tens of milliseconds at 832x480 on a small CPU) whose
        bytes it will never send. It raises `EncodingAbandoned`.
        """
        self._check_usable()
        self._validate(frames)
        self._validate_audio(audio, frames.shape[0])
        ctx = self._ctx
        assert ctx is not None
        count = frames.shape[0]
        packets: list[av.Packet] = []
        try:
            for index in range(count):
                if abandon is not None and abandon():
                    self._failed = "a chunk's encoding was abandoned"
                    raise EncodingAbandoned(self._failed)
                yuv = to_encoder_frame(self._reformatter, frames[index])
                yuv.pts = self._frames_encoded + index
                if index == 0 and self._forces_keyframe():
                    yuv.pict_type = PictureType.I  # a place to join
                packets.extend(ctx.encode(yuv))
        except (av.error.FFmpegError, ValueError, MemoryError) as exc:
            self._failed = f"libx264 failed to encode a frame: {exc}"
            raise EncodingError(self._failed) from exc
        if len(packets) != count:
            self._failed = (
                f"the encoder returned {len(packets)} packets for {count} frames: the codec "
                "options re-enabled encoder delay (B-frames, lookahead or frame threads), "
                "which cannot stream each chunk's frames immediately"
            )
            raise EncodingError(self._failed)

        audio_packets = self._encode_audio(audio, final=False) if audio is not None else []

        out = []
        if not self._init_written:
            if self._avcc is None:
                # Only if extradata was empty: fall back to the in-band parameter sets.
                self._avcc = self._avcc_from_parameter_sets(bytes(packets[0]))
            self._init_bytes = self._init_segment()
            out.append(self._init_bytes)
            self._init_written = True
        out.append(self._fragment(packets, audio_packets))
        self._frames_encoded += count
        self._chunks_encoded += 1
        return b"".join(out)

    def _validate_audio(self, audio: object, frames: int) -> None:
        if self._audio is None:
            if audio is not None:
                raise EncodingError("audio given to an encoder opened without an audio track")
            return
        expected = self.audio_samples_for(frames)
        shape = f"({self._audio_channels}, {expected}) float32"
        if not isinstance(audio, np.ndarray):
            raise EncodingError(f"expected the chunk's audio as a {shape} numpy array")
        if audio.shape != (self._audio_channels, expected) or audio.dtype != np.float32:
            raise EncodingError(
                f"expected the chunk's audio as {shape}, got {tuple(audio.shape)} {audio.dtype}"
            )

    def _encode_audio(self, pcm: np.ndarray | None, *, final: bool) -> list[av.Packet]:
        """Feed the FIFO's whole AAC frames (and, ``final``, its rest) to the encoder;
        the packets it returns, each a whole frame the track has not had yet."""
        actx = self._audio
        assert actx is not None and self._audio_rate is not None
        if pcm is not None:
            self._audio_fifo = np.concatenate([self._audio_fifo, pcm], axis=1)
        fifo = self._audio_fifo
        usable = fifo.shape[1] if final else fifo.shape[1] - fifo.shape[1] % _AAC_FRAME
        packets: list[av.Packet] = []
        try:
            for begin in range(0, usable, _AAC_FRAME):
                block = np.ascontiguousarray(fifo[:, begin : min(begin + _AAC_FRAME, usable)])
                frame = av.AudioFrame.from_ndarray(block, format="fltp", layout=actx.layout.name)
                frame.sample_rate = self._audio_rate
                frame.pts = self._audio_fed
                self._audio_fed += block.shape[1]
                packets.extend(actx.encode(frame))
            if final:
                packets.extend(actx.encode(None))
        except (av.error.FFmpegError, ValueError, MemoryError) as exc:
            self._failed = f"the AAC encoder failed: {exc}"
            raise EncodingError(self._failed) from exc
        self._audio_fifo = fifo[:, usable:]
        for packet in packets:
            # Where the track is: priming first, then the engine's samples, in order.
            if packet.pts is None or packet.pts + _AAC_PRIMING != self._audio_written:
                self._failed = (
                    f"the AAC encoder put a packet at {packet.pts}, not at "
                    f"{self._audio_written - _AAC_PRIMING}: the audio would drift"
                )
                raise EncodingError(self._failed)
            self._audio_written += int(packet.duration or _AAC_FRAME)
        return packets

    def _forces_keyframe(self) -> bool:
        interval = self._keyframe_interval
        return interval > 0 and self._chunks_encoded % interval == 0

    def close(self) -> bytes:
        if self._closed:
            return b""
        self._closed = True
        ctx, self._ctx = self._ctx, None
        if ctx is None or not self._init_written or self._failed is not None:
            return b""
        try:
            leftover = ctx.encode(None)
        except (av.error.FFmpegError, ValueError) as exc:
            raise EncodingError(f"libx264 failed while flushing: {exc}") from exc
        # The audio still in the FIFO and in the AAC encoder: a last, short frame.
        audio_left = self._encode_audio(None, final=True) if self._audio is not None else []
        self._audio = None
        out = []
        if leftover or audio_left:
            # Unreachable for video with a zero-delay encoder (encode() checks one packet
            # per frame), but if the codec ever emits a final packet it belongs in the
            # stream, not on the floor.
            out.append(self._fragment(leftover, audio_left))
        # An mfra holding only its mfro: it marks the end of the stream the way FFmpeg's
        # trailer does, without an index that would grow with every fragment.
        out.append(_box(b"mfra", _full_box(b"mfro", 0, 0, struct.pack(">I", 8 + 16))))
        return b"".join(out)

    def _check_usable(self) -> None:
        if self._closed:
            raise EncodingError("encoder is closed")
        if self._failed is not None:
            raise EncodingError(f"encoder failed earlier and cannot continue: {self._failed}")

    def _validate(self, frames: object) -> None:
        expected = f"(T, {self._height}, {self._width}, 3) uint8"
        if not isinstance(frames, np.ndarray):
            raise EncodingError(
                f"expected frames as a numpy array of shape {expected}, got {type(frames).__name__}"
            )
        ok_shape = frames.ndim == 4 and frames.shape[1:] == (self._height, self._width, 3)
        if not ok_shape or frames.dtype != np.uint8 or frames.shape[0] < 1:
            got = f"{tuple(frames.shape)} {frames.dtype}"
            hint = " (T must be >= 1)" if ok_shape and frames.shape[0] < 1 else ""
            raise EncodingError(f"expected frames of shape {expected}, got {got}{hint}")

    @staticmethod
    def _avcc_from_parameter_sets(data: bytes) -> bytes:
        if data[:1] == b"\x01":
            return _box(b"avcC", data)  # already an AVCDecoderConfigurationRecord
        nals = _split_nal_units(data)
        sps = [n for n in nals if n[0] & 0x1F == _NAL_SPS]
        pps = [n for n in nals if n[0] & 0x1F == _NAL_PPS]
        if not sps or not pps:
            raise EncodingError("encoder did not produce SPS/PPS parameter sets")
        return _build_avcc(sps, pps)

    def _init_segment(self) -> bytes:
        assert self._avcc is not None
        w, h = self._width, self._height
        ftyp = _box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isomiso5iso6avc1mp41")
        mvhd = _full_box(
            b"mvhd", 0, 0,
            struct.pack(">IIII", 0, 0, _MOVIE_TIMESCALE, 0),
            struct.pack(">IH10x", 0x00010000, 0x0100),
            _UNITY_MATRIX,
            bytes(24),
            struct.pack(">I", (_AUDIO_TRACK_ID if self._audio is not None else _TRACK_ID) + 1),
        )  # fmt: skip
        tkhd = _full_box(
            b"tkhd", 0, 0x3,  # track enabled, in movie
            struct.pack(">IIIII8xhhhH", 0, 0, _TRACK_ID, 0, 0, 0, 0, 0, 0),
            _UNITY_MATRIX,
            struct.pack(">II", w << 16, h << 16),
        )  # fmt: skip
        mdhd = _full_box(
            b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, self._timescale, 0, 0x55C4, 0)
        )  # language "und"
        hdlr = _full_box(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, b"vide"), b"VideoHandler\x00")
        vmhd = _full_box(b"vmhd", 0, 1, bytes(8))
        dinf = _box(
            b"dinf", _full_box(b"dref", 0, 0, struct.pack(">I", 1), _full_box(b"url ", 0, 1))
        )
        avc1 = _box(
            b"avc1",
            struct.pack(">6xH16xHHIIIH", 1, w, h, 0x00480000, 0x00480000, 0, 1),
            bytes(32),  # compressorname
            struct.pack(">Hh", 0x0018, -1),
            self._avcc,
        )
        stbl = _box(
            b"stbl",
            _full_box(b"stsd", 0, 0, struct.pack(">I", 1), avc1),
            _full_box(b"stts", 0, 0, struct.pack(">I", 0)),
            _full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
            _full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)),
            _full_box(b"stco", 0, 0, struct.pack(">I", 0)),
        )
        trak = _box(b"trak", tkhd, _box(b"mdia", mdhd, hdlr, _box(b"minf", vmhd, dinf, stbl)))
        trex = _full_box(
            b"trex", 0, 0,
            struct.pack(">IIIII", _TRACK_ID, 1, self._frame_duration, 0, _SAMPLE_FLAGS_NON_SYNC),
        )  # fmt: skip
        if self._audio is None:
            return ftyp + _box(b"moov", mvhd, trak, _box(b"mvex", trex))
        audio_trex = _full_box(
            b"trex", 0, 0,
            struct.pack(">IIIII", _AUDIO_TRACK_ID, 1, _AAC_FRAME, 0, _AUDIO_SAMPLE_FLAGS),
        )  # fmt: skip
        return ftyp + _box(
            b"moov", mvhd, trak, self._audio_trak(dinf), _box(b"mvex", trex, audio_trex)
        )

    def _audio_trak(self, dinf: bytes) -> bytes:
        """The AAC track's ``trak``: an ``mp4a`` sample entry with its ``esds``, and the
        edit list that cuts the encoder's priming (see the module docstring)."""
        actx = self._audio
        assert actx is not None and self._audio_rate is not None
        rate, channels = self._audio_rate, self._audio_channels
        tkhd = _full_box(
            b"tkhd", 0, 0x3,
            # alternate_group 1, volume 1.0; an audio track has no size.
            struct.pack(">IIIII8xhhhH", 0, 0, _AUDIO_TRACK_ID, 0, 0, 0, 1, 0x0100, 0),
            _UNITY_MATRIX,
            struct.pack(">II", 0, 0),
        )  # fmt: skip
        # One edit: from track time 1024 (the first real sample) on, for the whole rest
        # (a segment_duration of 0 in a fragmented file: its length is not known yet).
        elst = _full_box(b"elst", 0, 0, struct.pack(">IIiHH", 1, 0, _AAC_PRIMING, 1, 0))
        mdhd = _full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, rate, 0, 0x55C4, 0))
        hdlr = _full_box(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, b"soun"), b"SoundHandler\x00")
        smhd = _full_box(b"smhd", 0, 0, struct.pack(">hH", 0, 0))
        mp4a = _box(
            b"mp4a",
            struct.pack(">6xH8xHHHH", 1, channels, 16, 0, 0),
            struct.pack(">I", rate << 16),
            _esds(bytes(actx.extradata or b""), actx.bit_rate or 0),
        )
        stbl = _box(
            b"stbl",
            _full_box(b"stsd", 0, 0, struct.pack(">I", 1), mp4a),
            _full_box(b"stts", 0, 0, struct.pack(">I", 0)),
            _full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
            _full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)),
            _full_box(b"stco", 0, 0, struct.pack(">I", 0)),
        )
        return _box(
            b"trak",
            tkhd,
            _box(b"edts", elst),
            _box(b"mdia", mdhd, hdlr, _box(b"minf", smhd, dinf, stbl)),
        )

    def _fragment(self, packets: list[av.Packet], audio: list[av.Packet] | None = None) -> bytes:
        """One ``moof`` + ``mdat``: the video's ``traf`` (if it has frames), then the
        audio's (if any AAC frame is ready); the ``mdat`` holds their samples in that order."""
        samples = [_to_sample(bytes(p)) for p in packets]
        entries: list[int] = []
        for packet, sample in zip(packets, samples, strict=True):
            entries.append(len(sample))
            entries.append(_SAMPLE_FLAGS_SYNC if packet.is_keyframe else _SAMPLE_FLAGS_NON_SYNC)
        audio_samples = [bytes(p) for p in audio or ()]
        audio_entries: list[int] = []
        audio_time = self._audio_written
        for packet, sample in zip(audio or (), audio_samples, strict=True):
            duration = int(packet.duration or _AAC_FRAME)
            audio_entries += [duration, len(sample)]
            audio_time -= duration  # where this fragment's first AAC frame starts
        self._sequence_number += 1
        base_decode_time = self._frames_encoded * self._frame_duration
        video_bytes = sum(len(sample) for sample in samples)

        def moof(data_offset: int) -> bytes:
            trafs = []
            if samples:
                tfhd = _full_box(
                    b"tfhd", 0, 0x020000 | 0x000008,  # default-base-is-moof, default duration
                    struct.pack(">II", _TRACK_ID, self._frame_duration),
                )  # fmt: skip
                tfdt = _full_box(b"tfdt", 1, 0, struct.pack(">Q", base_decode_time))
                trun = _full_box(
                    b"trun", 0, 0x000001 | 0x000200 | 0x000400,  # data offset, sizes, flags
                    struct.pack(f">Ii{len(entries)}I", len(samples), data_offset, *entries),
                )  # fmt: skip
                trafs.append(_box(b"traf", tfhd, tfdt, trun))
            if audio_samples:
                tfhd = _full_box(b"tfhd", 0, 0x020000, struct.pack(">I", _AUDIO_TRACK_ID))
                tfdt = _full_box(b"tfdt", 1, 0, struct.pack(">Q", audio_time))
                trun = _full_box(
                    b"trun", 0, 0x000001 | 0x000100 | 0x000200,  # data offset, durations, sizes
                    struct.pack(
                        f">Ii{len(audio_entries)}I",
                        len(audio_samples), data_offset + video_bytes, *audio_entries,
                    ),
                )  # fmt: skip
                trafs.append(_box(b"traf", tfhd, tfdt, trun))
            mfhd = _full_box(b"mfhd", 0, 0, struct.pack(">I", self._sequence_number))
            return _box(b"moof", mfhd, *trafs)

        moof_size = len(moof(0))
        mdat_payload = b"".join(samples) + b"".join(audio_samples)
        mdat_header = struct.pack(">I4s", 8 + len(mdat_payload), b"mdat")
        return moof(moof_size + len(mdat_header)) + mdat_header + mdat_payload


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
    es = _descriptor(0x03, struct.pack(">HB", _AUDIO_TRACK_ID, 0), decoder_config,
                     _descriptor(0x06, b"\x02"))  # fmt: skip
    return _full_box(b"esds", 0, 0, es)


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


def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """Decode a PNG, JPEG or WebP image to (H, W, 3) uint8 RGB via FFmpeg.

    Uses PyAV so the project needs no PIL; alpha is dropped, as conditioning images are RGB.
    The bytes come from clients, and a decoder allocates (and fills) whatever picture a
    header declares: a few hundred KB of PNG can claim 16000x16000. So the size is read
    from the header first (`trio_vstream.media.image_header`, which also refuses every format
    it cannot vet that way) and refused over ``max_pixels`` before anything decodes. Then
    exactly the vetted bytes go to that format's decoder as one packet (no demuxer, so
    nothing probes or guesses the format), and the picture that comes out must have the
    header's size: a header that lies does not get past.
    """
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) == 0:
        raise EncodingError("image data is empty or not bytes")
    try:
        header = read_image_header(bytes(data))
    except ImageHeaderError as exc:
        raise EncodingError(str(exc)) from None
    _check_image_size(header.width, header.height, max_pixels)
    try:
        ctx = av.CodecContext.create(_IMAGE_DECODERS[header.format], "r")
        assert isinstance(ctx, av.VideoCodecContext)
        ctx.thread_count = 1  # one picture: no frame threads holding extra copies
        frames = ctx.decode(av.Packet(bytes(data[: header.length])))
        frames += ctx.decode(None)
    except (av.error.FFmpegError, ValueError, OSError, IndexError, MemoryError) as exc:
        raise EncodingError(f"could not decode the {header.format} image: {exc}") from exc
    if not frames:
        raise EncodingError(f"the {header.format} image decoded to no picture")
    frame = frames[0]
    if (frame.width, frame.height) != (header.width, header.height):
        raise EncodingError(
            f"the {header.format} image decoded to {frame.width}x{frame.height}, "
            f"not the {header.width}x{header.height} its header declares"
        )
    try:
        return frame.to_ndarray(format="rgb24")
    except (av.error.FFmpegError, ValueError, MemoryError) as exc:
        raise EncodingError(f"could not convert the {header.format} image: {exc}") from exc


_IMAGE_DECODERS: Final = {"PNG": "png", "JPEG": "mjpeg", "WebP": "webp"}
"""FFmpeg's decoder for each of `image_header.ACCEPTED_FORMATS`."""


def _check_image_size(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels or max(width, height) > MAX_IMAGE_SIDE:
        raise EncodingError(
            f"image is {width}x{height}, more than the {max_pixels} pixels (or "
            f"{MAX_IMAGE_SIDE} a side) allowed"
        )
