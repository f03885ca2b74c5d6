"""Reading and rewriting the received fragmented MP4.

`decode_audio` gives back a stream's sound as PCM (remuxing into a progressive MP4 is
`trio_vstream.media.remux`, shared with the recorder). `StreamTiming` reads the frame
rate written in the stream itself, which the client needs to turn frames into media
time.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterable
from fractions import Fraction

import av
import av.error
import numpy as np

__all__ = ["StreamTiming", "decode_audio"]

from trio_vstream.media.remux import RemuxError


class StreamTiming:
    """The frame rate written in the fragmented MP4 itself: timescale / sample duration.

    Needed because the rate is often nowhere else: a server echoes ``fps`` in
    ``video.start`` only when the client sent one, and its default is not announced.
    Reads the track timescale (``moov/trak/mdia/mdhd``) and the first fragment's sample
    duration (``trun``, else ``tfhd``, else ``moov/mvex/trex``). Only the first track is
    read: servers of this protocol send the video first (a stream with sound has its AAC
    track second, in the ``moov`` and in every ``moof``). Anything unreadable leaves the
    rate unknown rather than raising, since the video itself may still be fine.
    """

    def __init__(self) -> None:
        self.timescale: int | None = None
        self.trex_duration: int | None = None
        self.frame_rate: Fraction | None = None

    def feed(self, data: bytes) -> None:
        """Read one binary message; call until `frame_rate` is known."""
        try:
            for kind, payload in _mp4_boxes(data):
                if kind == b"moov":
                    self._read_moov(payload)
                elif kind == b"moof" and self.timescale:
                    duration = self._fragment_duration(payload) or self.trex_duration
                    if duration:
                        self.frame_rate = Fraction(self.timescale, duration)
                        return
        except (struct.error, ValueError):
            return

    def _read_moov(self, moov: bytes) -> None:
        trak = _mp4_child(moov, b"trak")
        mdia = _mp4_child(trak, b"mdia") if trak is not None else None
        mdhd = _mp4_child(mdia, b"mdhd") if mdia is not None else None
        if mdhd is not None:
            # Full box: version, flags, then creation and modification times (4 bytes
            # each in version 0, 8 in version 1), then the timescale.
            offset = 4 + (16 if mdhd[0] == 1 else 8)
            (self.timescale,) = struct.unpack_from(">I", mdhd, offset)
        mvex = _mp4_child(moov, b"mvex")
        trex = _mp4_child(mvex, b"trex") if mvex is not None else None
        if trex is not None:
            # version/flags, track_ID, default_sample_description_index, default duration
            (self.trex_duration,) = struct.unpack_from(">I", trex, 12)

    @staticmethod
    def _fragment_duration(moof: bytes) -> int | None:
        traf = _mp4_child(moof, b"traf")
        if traf is None:
            return None
        trun = _mp4_child(traf, b"trun")
        if trun is not None:
            flags = int.from_bytes(trun[1:4], "big")
            if flags & 0x100:  # sample-duration-present
                offset = 8 + (4 if flags & 0x01 else 0) + (4 if flags & 0x04 else 0)
                (duration,) = struct.unpack_from(">I", trun, offset)
                return duration
        tfhd = _mp4_child(traf, b"tfhd")
        if tfhd is not None:
            flags = int.from_bytes(tfhd[1:4], "big")
            if flags & 0x08:  # default-sample-duration-present
                offset = 8 + (8 if flags & 0x01 else 0) + (4 if flags & 0x02 else 0)
                (duration,) = struct.unpack_from(">I", tfhd, offset)
                return duration
        return None


def _mp4_boxes(data: bytes) -> Iterable[tuple[bytes, bytes]]:
    """The (type, payload) of each top-level ISO BMFF box; stops at a malformed one."""
    pos = 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, pos + 8)
            header = 16
        elif size == 0:
            size = len(data) - pos
        if size < header or pos + size > len(data):
            return
        yield kind, data[pos + header : pos + size]
        pos += size


def _mp4_child(payload: bytes, kind: bytes) -> bytes | None:
    return next((body for k, body in _mp4_boxes(payload) if k == kind), None)


def decode_audio(fmp4: bytes) -> tuple[int, np.ndarray] | None:
    """The sound of a received stream: (sample rate, (channels, samples) float32 PCM), or
    None for a stream without an audio track.

    Decoded as a player plays it: FFmpeg honours the track's edit list (the AAC encoder's
    priming is cut), and the last AAC frame is cut where its sample duration says the
    track ends (a decoder always outputs a whole 1024-sample frame; the stream's last one
    is shorter). So a whole stream gives back exactly the PCM its engine made.
    """
    try:
        with av.open(io.BytesIO(fmp4), mode="r") as source:
            if not source.streams.audio:
                return None
            stream = source.streams.audio[0]
            rate = stream.codec_context.sample_rate
            channels = stream.codec_context.channels
            # Read here: a stream's fields are garbage once its container is closed.
            time_base = stream.time_base
            start: int | None = None  # a viewer's stream begins mid-way
            end = 0
            pieces: list[np.ndarray] = []
            for packet in source.demux(stream):
                if packet.pts is not None and packet.duration:
                    end = max(end, packet.pts + packet.duration)
                for frame in packet.decode():
                    if start is None and frame.pts is not None:
                        start = frame.pts
                    pieces.append(frame.to_ndarray().astype(np.float32, copy=False))
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise RemuxError(f"the received audio is unreadable: {exc}") from exc
    if not pieces:
        return rate, np.zeros((channels, 0), np.float32)
    pcm = np.concatenate(pieces, axis=1)
    if not time_base or start is None:
        return rate, pcm
    # The track's timescale is its sample rate here; converted all the same.
    return rate, pcm[:, : int((end - start) * time_base * rate)]
