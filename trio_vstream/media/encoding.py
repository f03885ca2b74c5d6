"""H.264 in fragmented MP4, emitted chunk by chunk while the model is still generating.

`FragmentedMP4Encoder` composes the codec adapters (`trio_vstream.media.h264`,
`trio_vstream.media.aac`) with the box writer (`trio_vstream.media.fmp4`): it keeps the
counters (frames, fragments, where each track is) and hands the writer the samples each
``encode()`` made.

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

So this module uses PyAV only as an encoder (a bare ``CodecContext``) and has the ISO BMFF
boxes written by `trio_vstream.media.fmp4`: one ``ftyp``+``moov`` init segment (``avcC``
built from the SPS/PPS that libx264 puts in extradata under ``GLOBAL_HEADER``), then exactly
one ``moof``+``mdat`` per ``encode()`` call holding all of that call's frames, and an
``mfra`` trailer on ``close()``. Nothing is buffered between calls, no AVIO buffer exists
that could hold bytes back, and the state kept per session is a handful of counters (no
ever-growing BytesIO, no per-fragment index). Timestamps are derived from the frame count,
never from the codec, so the stream always plays at ``fps``.

Why every chunk begins with an IDR frame: a viewer who joins a running session (see
``trio_vstream.outputs.watch``) gets the init segment and then the chunks from the one it joined
at; its bytes decode on their own only if that chunk's first frame depends on nothing
before it. Forcing the first frame of each ``encode()`` to be an IDR makes every chunk a
join point (and a skip point for a viewer that falls behind), at a measured cost of a few
percent of the bitrate at the usual chunk lengths (docs/performance.md, "Keyframes").
``keyframe_interval`` (chunks from one forced IDR to the next; 0 leaves keyframes to
x264, every 250 frames and at scene cuts) exists for that measurement. A caller's ``g``
(or ``keyint``) only adds keyframes between those: it cannot remove the forced ones.
Should the encoder delay a frame (see `trio_vstream.media.h264` for why it must not),
``encode()`` reports it as :class:`EncodingError` rather than stalling the stream.

Sound, when the engine makes it (``audio_sample_rate``): a second track, AAC-LC from
FFmpeg's own encoder (`trio_vstream.media.aac`), in the same ``moov`` and in every ``moof``
beside the video. Each chunk's PCM covers exactly its frames
(`trio_vstream.values.audio_samples_through`); a fragment carries the audio encoded so
far, a frame or two behind its video, and its timestamps say where it belongs, so the two
tracks stay in step to the sample. ``close`` codes what is left as a short last frame:
the joined stream decodes to exactly the PCM the engine returned, no sample more or less.
A stopped session gets no trailer, so its last one to two AAC frames are not sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import av
import av.error
import numpy as np
from av.video.frame import PictureType
from av.video.reformatter import VideoReformatter

from trio_vstream.media import fmp4
from trio_vstream.media.aac import AacEncoder
from trio_vstream.media.errors import EncodingError
from trio_vstream.media.h264 import (
    avc_config_from_parameter_sets,
    codec_string,
    open_h264,
    to_encoder_frame,
    to_sample,
)
from trio_vstream.values import audio_samples_through

__all__ = ["EncodingAbandoned", "EncodingError", "FragmentedMP4Encoder"]


class EncodingAbandoned(Exception):
    """``encode`` stopped between frames because its caller no longer wants the chunk.

    The encoder has taken part of the chunk and cannot go on; only ``close`` is left.
    """


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
        self._timescale = fmp4.track_timescale(fps)
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
        self._audio: AacEncoder | None = None
        self._audio_channels = audio_channels
        self._audio_rate = audio_sample_rate
        self._audio_written = 0  # track time of the next AAC sample (priming included)
        if audio_sample_rate is not None:
            self._audio = AacEncoder(audio_sample_rate, audio_channels)
        self._reformatter = VideoReformatter()
        self._avc_config: bytes | None = None
        if ctx.extradata:
            self._avc_config = avc_config_from_parameter_sets(bytes(ctx.extradata))
        self._frames_encoded = 0
        self._sequence_number = 0
        self._init_written = False
        self._init_bytes: bytes | None = None
        self._closed = False
        self._failed: str | None = None

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
        if self._avc_config is None:
            return None
        return codec_string(self._avc_config)

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

        audio_samples = self._encode_audio(audio, final=False) if audio is not None else []

        out = []
        if not self._init_written:
            if self._avc_config is None:
                # Only if extradata was empty: fall back to the in-band parameter sets.
                self._avc_config = avc_config_from_parameter_sets(bytes(packets[0]))
            self._init_bytes = self._init_segment()
            out.append(self._init_bytes)
            self._init_written = True
        out.append(self._fragment(packets, audio_samples))
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

    def _encode_audio(self, pcm: np.ndarray | None, *, final: bool) -> list[fmp4.AudioSample]:
        """The AAC frames ``pcm`` (and, ``final``, the rest) completes; a failure is final."""
        assert self._audio is not None
        try:
            samples = self._audio.encode(pcm, final=final)
        except EncodingError as exc:
            self._failed = str(exc)
            raise
        self._audio_written = self._audio.samples_written
        return samples

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
        out.append(fmp4.trailer())
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

    def _init_segment(self) -> bytes:
        assert self._avc_config is not None
        video = fmp4.VideoTrack(
            width=self._width,
            height=self._height,
            timescale=self._timescale,
            frame_duration=self._frame_duration,
            avc_config=self._avc_config,
        )
        return fmp4.init_segment(video, self._audio.track if self._audio is not None else None)

    def _fragment(
        self, packets: list[av.Packet], audio: list[fmp4.AudioSample] | None = None
    ) -> bytes:
        """One ``moof`` + ``mdat`` of the video's packets and the AAC frames ready so far."""
        samples = [fmp4.VideoSample(to_sample(bytes(p)), bool(p.is_keyframe)) for p in packets]
        audio = audio or []
        self._sequence_number += 1
        return fmp4.media_fragment(
            sequence_number=self._sequence_number,
            frame_duration=self._frame_duration,
            video_decode_time=self._frames_encoded * self._frame_duration,
            video=samples,
            # Where this fragment's first AAC frame starts on the audio track.
            audio_decode_time=self._audio_written - sum(s.duration for s in audio),
            audio=audio,
        )
