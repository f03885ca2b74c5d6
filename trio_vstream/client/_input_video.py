"""Video in from a file: ``stream_video(input_video=PATH)`` and ``client --input-video``.

A session that asked for ``input_video`` follows the frames its client sends, one binary
message each, after ``video.start`` (the server's side: ``trio_vstream.session.input_video``).
This module is the client's side for a file: what the file is (`probe_video`, run before
connecting, so that a file that is not a video fails at once, not after a handshake),
what ``session.start`` declares for it (`input_request`), its frames as the session wants
them (`InputSource.frames`), and when each may go (`InputPacer`). The sending itself is a
task of `StreamRun`'s (``_stream_run``), beside the receive loop.

Each choice has a reason:

* The file is read lazily, a frame at a time, in a worker thread: a film is gigabytes,
  and a decode must not hold up the receive loop.
* Frames are resampled to the declared rate by their timestamps (`at_rate`), not sent
  one for one: the server numbers frames as they arrive, frame ``n`` at ``n / fps``, so
  a 60 fps file declared at 15 (or a file of variable rate) would otherwise play slower
  or faster than it is.
* Sending is paced, because the server keeps only about two seconds of input and drops
  the oldest beyond it, and decodes at most twice the declared rate.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Generator, Iterable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any, Final, TypeGuard, TypeVar

import attrs
import av

from trio_vstream import protocol

__all__ = [
    "InputPacer",
    "InputSource",
    "VideoFile",
    "at_rate",
    "input_request",
    "probe_video",
]

_T = TypeVar("_T")

MAX_SOURCE_PIXELS: Final = 8192 * 8192
"""The largest picture a source file may have: every frame is decoded whole before it is
scaled, so a hostile file's 30000x30000 header must not become gigabytes of memory."""

JPEG_QSCALES: Final = (3, 6, 12, 31)
"""mjpeg's quantiser, best first (3 is about JPEG quality 90): a frame over the server's
limit (`protocol.Limits.max_input_frame_bytes`) is encoded again coarser, rather than
sent to be refused. At the largest input size (1920x1080) even noise fits at 31."""

_SIZE: Final = re.compile(r"([0-9]+)x([0-9]+)")


@attrs.frozen(kw_only=True)
class VideoFile:
    """What `probe_video` learned of a file: enough to declare it and to say why not."""

    path: Path
    width: int
    height: int
    rate: Fraction | None
    """The video stream's average frame rate, None when the file does not say."""
    duration: float | None
    """Seconds, None when the file does not say (a raw stream)."""

    @property
    def fps(self) -> int | None:
        """The rate to declare: the file's, rounded, within what a session accepts."""
        if self.rate is None:
            return None
        return min(protocol.MAX_INPUT_FPS, max(1, round(self.rate)))


def probe_video(path: str | os.PathLike[str]) -> VideoFile:
    """Open ``path`` and decode its first video frame; `ValueError` says, in a person's
    words, why it cannot be an input video (missing, not a video, no video stream, no
    frame that decodes, a picture too large). Blocking: a worker thread's."""
    file = Path(path)
    try:
        with _open(file) as container:
            if not container.streams.video:
                kinds = sorted({stream.type for stream in container.streams}) or ["nothing"]
                raise ValueError(f"has no video stream (only {', '.join(kinds)})")
            stream = _video_stream(container)
            first = next(container.decode(stream), None)
            if first is None:
                raise ValueError("its video stream has no frame that decodes")
            rate = stream.average_rate or stream.guessed_rate
            duration: float | None = None
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / av.time_base
    except av.error.FFmpegError as exc:
        raise ValueError(_ffmpeg_reason(exc)) from None
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    return VideoFile(
        path=file,
        width=first.width,
        height=first.height,
        rate=Fraction(rate) if rate else None,
        duration=duration if duration is not None and duration > 0 else None,
    )


def _open(file: Path) -> Any:
    """The file as a container, read by FFmpeg's ``file`` protocol only: a path is never
    taken for a URL (``http:...``), nor may the file make FFmpeg open one (a playlist)."""
    if not file.is_file():
        raise ValueError("no such file" if not file.exists() else "not a regular file")
    return av.open(f"file:{os.fspath(file)}", container_options={"protocol_whitelist": "file"})


def _ffmpeg_reason(exc: av.error.FFmpegError) -> str:
    if isinstance(exc, av.error.InvalidDataError):
        return "not a video file (FFmpeg cannot read it)"
    return f"cannot read it: {exc.strerror or exc}"


def _video_stream(container: Any) -> Any:
    """The first video stream, its size checked (`MAX_SOURCE_PIXELS`) as its header says
    and, for a header that lies, by the decoder (which refuses a larger picture)."""
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > MAX_SOURCE_PIXELS:
        raise ValueError(f"its frames are {width}x{height}, too large to decode")
    stream.codec_context.options = {"max_pixels": str(MAX_SOURCE_PIXELS)}
    return stream


def input_request(fields: dict[str, Any], video: VideoFile) -> dict[str, Any]:
    """``session.start``'s ``input_video`` for this file: the caller's block (``fields``'
    ``input_video``, if any) with what it left out filled in. `ValueError` for a block
    the frames could not follow (another format, a rate or size that is not a number).

    The frames are JPEG. The rate is the file's (rounded, 1..60). The size is the
    output's when ``fields`` say it (frames are then sent at the size they are shown);
    otherwise the file's, shrunk to the default limits, since the server's default size
    is not known before its first chunk, which already needs input.
    """
    given = fields.get("input_video", {})
    if not isinstance(given, dict):
        raise ValueError(f"input_video must be an object, got {given!r}")
    block = dict(given)
    if block.setdefault("frame_format", "jpeg") != "jpeg":
        raise ValueError(
            f"input_video.frame_format: a file is sent as jpeg, not {block['frame_format']!r}"
        )
    if "fps" not in block:
        if video.fps is None:
            raise ValueError(f"{video.path}: its frame rate is unknown; declare input_video.fps")
        block["fps"] = video.fps
    if "width" not in block and "height" not in block:
        width, height = _output_size(fields) or _fit(video.width, video.height)
        block["width"], block["height"] = width, height
    for name, low, high in (
        ("fps", 1, protocol.MAX_INPUT_FPS),
        ("width", 1, None),
        ("height", 1, None),
    ):
        value = block.get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < low
            or (high is not None and value > high)
        ):
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            raise ValueError(f"input_video.{name} must be a whole number {bound}, got {value!r}")
    return block


def _output_size(fields: dict[str, Any]) -> tuple[int, int] | None:
    """The output's size as the server resolves it from ``fields`` (``size`` first, then
    ``width``/``height``, then ``video_params``), None where any of it is the server's."""
    size = fields.get("size")
    if isinstance(size, str) and (match := _SIZE.fullmatch(size)):
        return int(match[1]), int(match[2])
    nested = fields.get("video_params")
    nested = nested if isinstance(nested, dict) else {}
    width = fields.get("width", nested.get("width"))
    height = fields.get("height", nested.get("height"))
    if _whole(width) and _whole(height):
        return width, height
    return None


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _fit(width: int, height: int) -> tuple[int, int]:
    """The largest size of this shape within the default limits on an input frame."""
    limits = protocol.DEFAULT_LIMITS
    scale = min(
        1.0,
        math.sqrt(limits.max_input_pixels / (width * height)),
        limits.max_width / width,
        limits.max_height / height,
    )
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def at_rate(timed: Iterable[tuple[float, _T]], fps: int, interval: float) -> Iterator[_T]:
    """Items at times (seconds, in order, ``interval`` apart on average) resampled to
    ``fps``: output frame ``n`` is the item shown at ``n / fps``, counted from the first.
    An item up to a quarter of a frame late (of the shorter of the two rates' frames) is
    taken as on time, so that timestamps rounded to milliseconds neither repeat nor skip
    a frame. The last item lasts ``interval``; at least one item comes out of any. Pure."""
    slack = 0.25 * min(1 / fps, interval)
    held: _T | None = None
    start = end = 0.0
    sent = 0
    for time, item in timed:
        if held is None:
            start = time
        else:
            while time - start > sent / fps + slack:
                yield held
                sent += 1
        held, end = item, time - start
    if held is None:
        return
    while sent == 0 or sent / fps + slack < end + interval:
        yield held
        sent += 1


@attrs.frozen(kw_only=True)
class InputSource:
    """A file's frames as a session declared them (`input_request`'s block)."""

    video: VideoFile
    fps: int
    width: int
    height: int
    max_bytes: int = protocol.DEFAULT_LIMITS.max_input_frame_bytes

    def frames(self) -> Generator[bytes, None, None]:
        """The frames, JPEG at the declared size and rate, decoded one at a time.

        Blocking (a worker thread's, one call of ``next`` at a time). Raises `ValueError`
        (FFmpeg's errors are among them) for a file that fails part way; what came
        before it was good.
        """
        try:
            yield from self._frames()
        except (av.error.FFmpegError, OSError) as exc:
            raise ValueError(
                _ffmpeg_reason(exc) if isinstance(exc, av.error.FFmpegError) else str(exc)
            ) from exc

    def _frames(self) -> Iterator[bytes]:
        rate = self.video.rate or Fraction(self.fps)
        encoder = _JpegEncoder(self.width, self.height, self.max_bytes)
        with _open(self.video.path) as container:
            stream = _video_stream(container)
            stream.thread_type = "AUTO"
            timed = (
                (frame.time if frame.time is not None else float(index / rate), frame)
                for index, frame in enumerate(container.decode(stream))
            )
            last: av.VideoFrame | None = None
            data = b""
            for frame in at_rate(timed, self.fps, float(1 / rate)):
                if frame is not last:  # a frame shown twice is encoded once
                    data, last = encoder.encode(frame), frame
                yield data


_JPEG_TIME_BASE: Final = Fraction(1, 25)
"""Any: an encoder needs one, though a JPEG has no time."""


class _JpegEncoder:
    """Frames scaled to one size and encoded as JPEG by FFmpeg's mjpeg, full range
    (``yuvj420p``, as JPEG files are), each under ``max_bytes`` if it can be."""

    def __init__(self, width: int, height: int, max_bytes: int) -> None:
        self.width, self.height, self.max_bytes = width, height, max_bytes
        self._contexts: dict[int, av.VideoCodecContext] = {}
        self._count = 0

    def encode(self, frame: av.VideoFrame) -> bytes:
        picture = frame.reformat(self.width, self.height, format="yuvj420p")
        # Numbered in the encoder's time base: an encoder refuses a time it has seen.
        picture.pts, picture.time_base = self._count, _JPEG_TIME_BASE
        self._count += 1
        data = b""
        for qscale in JPEG_QSCALES:
            data = b"".join(bytes(packet) for packet in self._context(qscale).encode(picture))
            if len(data) <= self.max_bytes:
                break
        return data

    def _context(self, qscale: int) -> av.VideoCodecContext:
        context = self._contexts.get(qscale)
        if context is None:
            context = av.CodecContext.create("mjpeg", "w")
            assert isinstance(context, av.VideoCodecContext)
            context.width, context.height = self.width, self.height
            context.pix_fmt = "yuvj420p"
            context.time_base = _JPEG_TIME_BASE
            # Rate control pinned to one quantiser: mjpeg then encodes at that quality.
            context.qmin = context.qmax = qscale
            self._contexts[qscale] = context
        return context


class InputPacer:
    """When the next input frame may be sent: pure (fed times, reads no clock).

    Two bounds, both for the server's input buffer (about two seconds of input, the
    oldest frames dropped beyond it; decodes at most twice the declared rate):

    * **ahead**: frame ``n`` waits until ``n < acked + window``, ``acked`` being one past
      the last input frame a chunk reported using (``input_frames.last``). The client
      never has more than a window of frames in the server's buffer, so none is dropped
      for want of room however slow the engine. (The next chunk starts before this
      one's report arrives, so a chunk that needs more than half a window of input may
      wait for the rest, and at worst reuse a frame: the server counts it ``reused``.)
    * **rate**: a token bucket of ``window`` frames refilled at ``fps``: after a first
      burst of a window, no faster than the declared rate on average, so a fast engine
      does not push the client past the server's decode rate.

    The window is a second of frames (``fps``) unless given.
    """

    def __init__(self, fps: int, window: int | None = None) -> None:
        if fps < 1 or (window is not None and window < 1):
            raise ValueError(f"fps and window must be >= 1, got {fps} and {window}")
        self.fps = fps
        self.window = window if window is not None else fps
        self.sent = 0
        """Frames sent: the next one's index."""
        self.acked = 0
        """One past the last input frame a chunk reported using."""
        self._tokens = float(self.window)
        self._counted_at: float | None = None

    def acknowledge(self, last: int | None) -> None:
        """A chunk's ``input_frames.last`` (None: it used no input yet)."""
        if last is not None:
            self.acked = max(self.acked, last + 1)

    def send_at(self, now: float) -> float | None:
        """When the next frame may go (``now`` when it may now); None while it waits for
        a chunk to report using the frames ahead of it."""
        if self.sent >= self.acked + self.window:
            return None
        tokens = self._tokens_at(now)
        if tokens >= 1 - 1e-9:
            return now
        return now + (1 - tokens) / self.fps

    def sending(self, now: float) -> None:
        """The next frame goes now (as `send_at` allowed)."""
        self._tokens = max(0.0, self._tokens_at(now) - 1)
        self._counted_at = now
        self.sent += 1

    def _tokens_at(self, now: float) -> float:
        if self._counted_at is None:
            return self._tokens
        return min(float(self.window), self._tokens + (now - self._counted_at) * self.fps)
