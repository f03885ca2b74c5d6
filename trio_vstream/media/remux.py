"""A received or recorded fragmented MP4, rewritten as a progressive one, and back.

Desktop players and editors cope badly with fragmented files (no duration, slow
seeking), so the client's ``--output`` and the server's recordings both end as a plain
MP4 with its ``moov`` first. One function does it for both, by copying packets: never
re-encoding, so the file holds the very bytes the viewer decoded, its sound too.

`fragment_mp4` goes the other way, for a recording played as HLS
(`trio_vstream.outputs.recording_hls`): the same packets, copied again, into an init
segment and one fragment per video keyframe, with each fragment's place in the file and
its exact duration.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import av
import av.error

__all__ = ["Fragment", "FragmentedMP4", "RemuxError", "fragment_mp4", "remux_to_mp4"]


class RemuxError(Exception):
    """The received bytes hold no video that could be written."""


def remux_to_mp4(source: bytes | str | os.PathLike[str], path: str | os.PathLike[str]) -> int:
    """Copy the packets of a fragmented MP4 into a progressive one; returns frames written.

    ``source`` is the stream's bytes (the client's) or a file that holds them (a
    recording's part file).

    No re-encoding, so it is fast and lossless. ``faststart`` puts the ``moov`` first so
    the file also streams over HTTP. A stream cut short (no trailer, or damaged at the end)
    keeps every packet that demuxes; the file is written to a temporary name and renamed,
    so ``path`` is never left half-written.
    """
    target = Path(path)
    try:
        reading = av.open(
            io.BytesIO(source) if isinstance(source, bytes) else os.fspath(source), mode="r"
        )
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise RemuxError(f"the received data is not a readable MP4 stream: {exc}") from exc
    # Not mkstemp: its 0600 mode would survive the rename; this name honours the umask.
    temp_name = str(target.with_name(f".{target.name}.{os.getpid()}.part"))
    frames = 0
    try:
        with reading:
            if not reading.streams.video:
                raise RemuxError("the received data holds no video stream")
            in_stream = reading.streams.video[0]
            # The sound too, when the stream has it (its edit list, cutting the AAC
            # priming, is carried over by the muxer from the packets' timestamps).
            in_streams = [in_stream, *reading.streams.audio[:1]]
            with av.open(
                temp_name, mode="w", format="mp4", options={"movflags": "+faststart"}
            ) as output:
                out_streams = {s.index: _add_stream_like(output, s) for s in in_streams}
                try:
                    for packet in reading.demux(in_streams):
                        if packet.dts is None:  # the demuxer's end-of-stream marker
                            continue
                        is_video = packet.stream.index == in_stream.index
                        packet.stream = out_streams[packet.stream.index]
                        output.mux(packet)
                        frames += is_video
                except av.error.FFmpegError as exc:
                    if frames == 0:
                        raise RemuxError(f"the received video is unreadable: {exc}") from exc
                    # Damaged tail: keep what came before it.
                if frames == 0:
                    raise RemuxError("the received data holds no video frames")
        os.replace(temp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
    return frames


@attrs.frozen
class Fragment:
    """One ``moof`` + ``mdat`` of a fragmented MP4: where it lies in the file, and what of
    the video it holds (the sound beside it is in the same fragment)."""

    offset: int
    size: int
    frames: int
    """Video frames: the first one a keyframe."""
    duration: Fraction
    """Seconds of video, exactly: from the keyframe's timestamp to the next one's (the
    last fragment: to the end of its last frame), in the video track's time base."""


@attrs.frozen
class FragmentedMP4:
    """What `fragment_mp4` wrote: the init segment is the file's first ``init_size`` bytes
    (``ftyp`` + ``moov``), then come the fragments, in order."""

    init_size: int
    fragments: tuple[Fragment, ...]

    @property
    def frames(self) -> int:
        return sum(fragment.frames for fragment in self.fragments)


_FRAGMENTED_FLAGS = "+frag_keyframe+delay_moov+default_base_moof"
"""FFmpeg's mov muxer, fragmented: a new fragment at each video keyframe; ``delay_moov``
(not ``empty_moov``) writes the ``moov`` once the first fragment is known, so that the
sound's edit list, which cuts the AAC priming, is kept (with ``empty_moov`` it is lost
and the sound plays 1024 samples late); ``default_base_moof``, as every fragment of the
live stream has (`trio_vstream.media.fmp4`): each fragment's offsets count from its own
``moof``, so a fragment can be cut out of the file and played after the init segment."""


def fragment_mp4(
    source: BinaryIO | str | os.PathLike[str], path: str | os.PathLike[str]
) -> FragmentedMP4:
    """Copy the packets of an MP4 (a recording's) into a fragmented one at ``path``, a
    fragment at each video keyframe, and say where each fragment lies and how long it is.

    Packets are copied, never re-encoded: the fragments decode to the very frames, and
    sound, of ``source``. A stream of this project starts every chunk with an IDR, so the
    fragments are the session's chunks again. Raises `RemuxError` for a source without
    video, or a result whose fragments are not one per keyframe; ``path`` is written
    under a temporary name and renamed, so it is never left half-written.
    """
    target = Path(path)
    try:
        reading = av.open(
            source if not isinstance(source, os.PathLike) else os.fspath(source), mode="r"
        )
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise RemuxError(f"the recording is not a readable MP4: {exc}") from exc
    temp_name = str(target.with_name(f".{target.name}.{os.getpid()}.part"))
    starts: list[int] = []
    """Each fragment's first video timestamp (in the video's time base)."""
    frames: list[int] = []
    end = 0
    try:
        with reading:
            if not reading.streams.video:
                raise RemuxError("the recording holds no video stream")
            video = reading.streams.video[0]
            time_base = video.time_base
            if time_base is None:
                raise RemuxError("the recording's video has no time base")
            in_streams = [video, *reading.streams.audio[:1]]
            with av.open(
                temp_name, mode="w", format="mp4", options={"movflags": _FRAGMENTED_FLAGS}
            ) as output:
                out_streams = {s.index: _add_stream_like(output, s) for s in in_streams}
                try:
                    for packet in reading.demux(in_streams):
                        if packet.dts is None:  # the demuxer's end-of-stream marker
                            continue
                        if packet.stream.index == video.index:
                            pts = packet.pts if packet.pts is not None else packet.dts
                            if not starts or packet.is_keyframe:  # where the muxer cuts
                                starts.append(pts)
                                frames.append(0)
                            frames[-1] += 1
                            end = max(end, pts + (packet.duration or 0))
                        packet.stream = out_streams[packet.stream.index]
                        output.mux(packet)
                except av.error.FFmpegError as exc:
                    raise RemuxError(f"the recording is unreadable: {exc}") from exc
            if not starts:
                raise RemuxError("the recording holds no video frames")
        init_size, places = _fragment_places(temp_name)
        if len(places) != len(starts):
            raise RemuxError(
                f"the fragmented recording has {len(places)} fragments for {len(starts)} keyframes"
            )
        os.replace(temp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
    ends = [*starts[1:], end]
    fragments = tuple(
        Fragment(offset, size, count, (stop - start) * Fraction(time_base))
        for (offset, size), count, start, stop in zip(places, frames, starts, ends, strict=True)
    )
    return FragmentedMP4(init_size, fragments)


def _fragment_places(path: str) -> tuple[int, list[tuple[int, int]]]:
    """Where the init segment ends and where each ``moof`` + ``mdat`` lies in a fragmented
    MP4, from its top-level boxes (the ``mfra`` index at the end left out)."""
    places: list[tuple[int, int]] = []
    init_size: int | None = None
    with open(path, "rb") as file:
        file_size = os.fstat(file.fileno()).st_size
        offset = 0
        while offset < file_size:
            file.seek(offset)
            head = file.read(16)
            if len(head) < 8:
                raise RemuxError("the fragmented recording ends inside a box")
            size, kind = struct.unpack(">I4s", head[:8])
            if size == 1:  # a 64-bit size follows the type
                if len(head) < 16:
                    raise RemuxError("the fragmented recording ends inside a box")
                (size,) = struct.unpack(">Q", head[8:16])
            elif size == 0:  # to the end of the file
                size = file_size - offset
            if size < 8 or offset + size > file_size:
                raise RemuxError(f"the fragmented recording has a damaged {kind!r} box")
            if kind == b"moof":
                if init_size is None:
                    init_size = offset
                places.append((offset, size))
            elif kind == b"mdat" and places and sum(places[-1]) == offset:
                places[-1] = (places[-1][0], places[-1][1] + size)
            offset += size
    if init_size is None:
        raise RemuxError("the fragmented recording has no fragment")
    return init_size, places


def _add_stream_like(output: Any, template: Any) -> Any:
    # PyAV >= 13 has add_stream_from_template; older versions took template= instead.
    if hasattr(output, "add_stream_from_template"):
        return output.add_stream_from_template(template)
    return output.add_stream(template=template)  # pragma: no cover
