"""A received or recorded fragmented MP4, rewritten as a progressive one.

Desktop players and editors cope badly with fragmented files (no duration, slow
seeking), so the client's ``--output`` and the server's recordings both end as a plain
MP4 with its ``moov`` first. One function does it for both, by copying packets: never
re-encoding, so the file holds the very bytes the viewer decoded, its sound too.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any

import av
import av.error

__all__ = ["RemuxError", "remux_to_mp4"]


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


def _add_stream_like(output: Any, template: Any) -> Any:
    # PyAV >= 13 has add_stream_from_template; older versions took template= instead.
    if hasattr(output, "add_stream_from_template"):
        return output.add_stream_from_template(template)
    return output.add_stream(template=template)  # pragma: no cover
