"""H.264 through PyAV's libx264: the encoder's settings, its frames in, its samples out.

A thin adapter: `open_h264` opens the context `trio_vstream.media.encoding` encodes with
(and the benchmark's bare encoder too), `to_encoder_frame` converts an RGB picture for
it, and the rest turns what libx264 emits into what an MP4 carries: `to_sample` makes a
packet's NAL units length-prefixed, `avc_config_from_parameter_sets` builds the
AVCDecoderConfigurationRecord (the ``avcC`` payload) from the SPS/PPS that libx264 puts in
extradata under ``GLOBAL_HEADER``. The boxes themselves are `trio_vstream.media.fmp4`'s.

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
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from fractions import Fraction

import av
import av.error
import numpy as np
from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

from trio_vstream.media.errors import EncodingError
from trio_vstream.protocol import CodecOptionError, check_codec_options

__all__ = [
    "DEFAULT_CODEC_OPTIONS",
    "avc_config_from_parameter_sets",
    "codec_string",
    "open_h264",
    "split_nal_units",
    "to_encoder_frame",
    "to_sample",
]

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

_NAL_SPS = 7
_NAL_PPS = 8


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


def split_nal_units(data: bytes) -> list[bytes]:
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


def to_sample(packet_bytes: bytes) -> bytes:
    """A packet as an MP4 sample: its NAL units, each after its 4-byte length."""
    return b"".join(struct.pack(">I", len(nal)) + nal for nal in split_nal_units(packet_bytes))


def avc_config_from_parameter_sets(data: bytes) -> bytes:
    """The AVCDecoderConfigurationRecord for extradata (or an in-band access unit) that
    holds the SPS and PPS; extradata that already is such a record, as it is."""
    if data[:1] == b"\x01":
        return data  # already an AVCDecoderConfigurationRecord
    nals = split_nal_units(data)
    sps = [n for n in nals if n[0] & 0x1F == _NAL_SPS]
    pps = [n for n in nals if n[0] & 0x1F == _NAL_PPS]
    if not sps or not pps:
        raise EncodingError("encoder did not produce SPS/PPS parameter sets")
    return _build_avc_config(sps, pps)


def _build_avc_config(sps_list: list[bytes], pps_list: list[bytes]) -> bytes:
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
    return b"".join(parts)


def codec_string(avc_config: bytes) -> str:
    """RFC 6381 codecs value (e.g. ``avc1.42c01e``) of a stream with this
    AVCDecoderConfigurationRecord: its profile, constraint flags and level."""
    return "avc1." + avc_config[1:4].hex()
