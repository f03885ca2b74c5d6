"""Recordings played as HLS: a VOD playlist, an init segment and segments, made once.

A server started with ``--record DIR`` keeps each session as ``DIR/<request_id>.mp4``
(`trio_vstream.outputs.recording`). `RecordingHLS` serves that video again over plain
HTTP, as HTTP Live Streaming that hls.js, Safari, ffplay and FFmpeg play::

    GET /v1/recordings/<request_id>/index.m3u8   the playlist (EXT-X-PLAYLIST-TYPE:VOD)
    GET /v1/recordings/<request_id>/init.mp4     the init segment (EXT-X-MAP)
    GET /v1/recordings/<request_id>/<n>.m4s      segment n, from 0

The first request for a recording converts it (`trio_vstream.media.remux.fragment_mp4`:
packets copied into fragments, one per chunk, never re-encoded) into
``DIR/<request_id>.hls/``, which every later request reads: the playlist, the init
segment and the segments, each fragment whole in one segment, segments of at most
`SEGMENT_SECONDS` (a longer chunk is a segment alone). The conversion runs in a worker
thread under the server's own thread limiter, one at a time; concurrent first requests
for one recording wait for the one conversion. It is made in a temporary folder and
renamed, so ``<request_id>.hls`` is always whole; a recording larger than
``max_bytes`` is refused instead.

A request names a recording and a file by text a client wrote, so both are allow-listed
before anything touches the disk: the request id exactly as the server makes them
(`REQUEST_ID`), the file one of the three forms above. Each is then opened one path
component at a time, relative to the directory, with ``O_NOFOLLOW``: a symbolic link in
the directory (a recording, its JSON or its ``.hls`` folder pointing elsewhere) is never
followed, and a name that is not a regular file is not read. Every such refusal is the
same 404, which tells nothing of what lies outside.

A recording is served once it is whole: its MP4 and then its JSON are written last, so
a recording whose session still runs (its part file there, or its MP4 without the JSON)
is answered 409. Recordings never change once written, so every answer may be cached
(``Cache-Control: private``, since recordings need a key where keys are configured, and
``immutable``) and carries an ``ETag``; a matching ``If-None-Match`` gets 304.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO, Final

import attrs
import m3u8
import trio

from trio_vstream.logsafe import get_logger
from trio_vstream.media.remux import Fragment, RemuxError, fragment_mp4

__all__ = [
    "DEFAULT_MAX_RECORDING_BYTES",
    "RECORDINGS_PREFIX",
    "REQUEST_ID",
    "SEGMENT_SECONDS",
    "Answer",
    "RecordingHLS",
    "group_segments",
    "playlist",
]

logger = get_logger(__name__)

RECORDINGS_PREFIX: Final = "/v1/recordings/"
"""Where the server serves its recordings: ``/v1/recordings/<request_id>/<file>``."""

REQUEST_ID: Final = re.compile(r"video_stream-[0-9a-f]{32}")
"""A request id exactly as a session makes it (``video_stream-`` and a UUID's 32 hex
digits): the only recording names a request may ask for."""

_FILE: Final = re.compile(r"index\.m3u8|init\.mp4|(?:0|[1-9][0-9]{0,5})\.m4s")
"""The only files of a recording's HLS a request may ask for."""

PLAYLIST: Final = "index.m3u8"
INIT_SEGMENT: Final = "init.mp4"

SEGMENT_SECONDS: Final = Fraction(2)
"""The most a segment lasts, unless one chunk is longer (a chunk is never split: each
starts with a keyframe, and a segment must too)."""

DEFAULT_MAX_RECORDING_BYTES: Final = 2 * 1024**3
"""The largest recording converted: its conversion holds a thread, and its segments
take as much disk again, for seconds per GiB."""

HLS_VERSION: Final = 7
"""EXT-X-VERSION: fMP4 segments with EXT-X-MAP need 6 or later (RFC 8216, section 7);
7, as FFmpeg's and Apple's tools write for fMP4."""

MAX_AGE: Final = 365 * 24 * 3600
CACHE_CONTROL: Final = f"private, max-age={MAX_AGE}, immutable"
"""A recording never changes once written; ``private``: a shared cache must not keep
what needs a key to fetch."""

_CONTENT_TYPES: Final[Mapping[str, str]] = {
    ".m3u8": "application/vnd.apple.mpegurl",
    ".mp4": "video/mp4",
    ".m4s": "video/mp4",
}

_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
"""One component, never through a symbolic link, never waiting (a FIFO is not read)."""


@attrs.frozen
class Answer:
    """An HTTP response for the router to send."""

    status: int
    body: bytes | str
    content_type: str | None = None
    headers: Mapping[str, str] = attrs.field(factory=dict)


NOT_FOUND: Final = Answer(404, "recording_not_found: no such recording here\n")
"""Every refusal of a name, a link or a missing file: the same answer."""

IN_PROGRESS: Final = Answer(
    409,
    "recording_in_progress: this session is still being recorded; "
    "it plays as HLS once the session has ended\n",
)


class _Refused(Exception):
    """Ends a lookup with an `Answer` other than the file."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.status)
        self.answer = answer


class RecordingHLS:
    """Serves the recordings in ``directory`` as HLS (see the module's docstring).

    ``limiter`` is the server's own for blocking work: every disk access of a request
    runs in a worker thread under it. ``max_bytes``: the largest recording converted.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        limiter: trio.CapacityLimiter,
        max_bytes: int = DEFAULT_MAX_RECORDING_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._limiter = limiter
        self._one_conversion = trio.CapacityLimiter(1)
        """Conversions run one at a time: each may hold a thread for seconds."""
        self._converting: dict[str, trio.Event] = {}
        """Recordings being converted now: a request for one waits for its event."""
        self.conversions = 0
        """Recordings converted by this server so far."""

    async def answer(self, path: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> Answer:
        """The answer to ``GET path``, a path under `RECORDINGS_PREFIX`."""
        request_id, slash, name = path.removeprefix(RECORDINGS_PREFIX).partition("/")
        if not slash or not REQUEST_ID.fullmatch(request_id) or not _FILE.fullmatch(name):
            return NOT_FOUND
        etags = _if_none_match(headers)
        found = await trio.to_thread.run_sync(
            _read, self.directory, request_id, name, etags, limiter=self._limiter
        )
        if found is not None:
            return found
        refusal = await self._convert(request_id)
        if refusal is not None:
            return refusal
        found = await trio.to_thread.run_sync(
            _read, self.directory, request_id, name, etags, limiter=self._limiter
        )
        return NOT_FOUND if found is None else found  # its HLS was removed meanwhile

    async def _convert(self, request_id: str) -> Answer | None:
        """Make the recording's HLS unless it is there; None once it is, else why not."""
        while (pending := self._converting.get(request_id)) is not None:
            await pending.wait()
        done = self._converting[request_id] = trio.Event()
        try:
            async with self._one_conversion:
                # Not abandoned on cancel: the thread always finishes, and so the
                # folder it makes; the cap on the recording's size bounds the wait.
                result = await trio.to_thread.run_sync(
                    _convert, self.directory, request_id, self.max_bytes, limiter=self._limiter
                )
        finally:
            del self._converting[request_id]
            done.set()
        if isinstance(result, Answer):
            return result
        self.conversions += result
        return None


# ------------------------------------------------------------------ the worker threads


@contextlib.contextmanager
def _opened(name: str | os.PathLike[str], flags: int, dir_fd: int | None = None) -> Iterator[int]:
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _component(name: str, dir_fd: int, *, directory: bool = False) -> Iterator[int | None]:
    """One entry of a directory, opened without following a link; None when it is not
    there. A link, or an entry of the wrong kind, is `NOT_FOUND`."""
    try:
        fd = os.open(name, _OPEN_FLAGS | (os.O_DIRECTORY if directory else 0), dir_fd=dir_fd)
    except FileNotFoundError:
        fd = None
    except OSError as exc:
        # ELOOP: a symbolic link; ENOTDIR: not a folder; anything else: not readable.
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.ENXIO):
            logger.warning("recordings: cannot open %s: %s", ascii(name), exc.strerror)
        raise _Refused(NOT_FOUND) from None
    if fd is None:
        yield None
        return
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
            raise _Refused(NOT_FOUND)
        yield fd
    finally:
        os.close(fd)


def _exists(name: str, dir_fd: int) -> bool:
    """Whether an entry is there, a link included (never followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _is_file(name: str, dir_fd: int) -> bool:
    """Whether an entry is a regular file (a link to one is not)."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _read(
    directory: Path, request_id: str, name: str, etags: frozenset[str] | None
) -> Answer | None:
    """A file of the recording's HLS, or None when the recording is not converted yet."""
    try:
        with (
            _opened(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) as dir_fd,
            _component(f"{request_id}.hls", dir_fd, directory=True) as hls_fd,
        ):
            if hls_fd is None:
                return None
            with _component(name, hls_fd) as fd:
                if fd is None:
                    return NOT_FOUND  # a segment past the last one
                info = os.fstat(fd)
                etag = f'"{info.st_size:x}-{info.st_mtime_ns:x}"'
                headers = {"cache-control": CACHE_CONTROL, "etag": etag}
                content_type = _CONTENT_TYPES[Path(name).suffix]
                if etags is not None and (etag in etags or "*" in etags):
                    return Answer(304, b"", content_type, headers)
                with os.fdopen(os.dup(fd), "rb") as file:
                    data = file.read()
    except _Refused as refused:
        return refused.answer
    except OSError as exc:  # the directory itself: the operator's to fix
        logger.error("recordings: cannot read %s: %s", directory, exc.strerror)
        return Answer(500, "recordings_unavailable: the recordings cannot be read\n")
    return Answer(200, data, content_type, headers)


def _convert(directory: Path, request_id: str, max_bytes: int) -> Answer | bool:
    """Make ``<request_id>.hls/`` from the recording: True when made here, False when it
    was there already, else the `Answer` that says why not."""
    try:
        with _opened(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) as dir_fd:
            return _convert_in(directory, dir_fd, request_id, max_bytes)
    except _Refused as refused:
        return refused.answer
    except RemuxError as exc:
        logger.error("recordings: %s cannot play as HLS: %s", request_id, exc)
        return Answer(500, f"recording_unreadable: {exc}\n")
    except OSError as exc:
        logger.error("recordings: %s cannot be made into HLS: %s", request_id, exc.strerror)
        return Answer(500, "recordings_unavailable: the recording's HLS could not be written\n")


def _convert_in(directory: Path, dir_fd: int, request_id: str, max_bytes: int) -> Answer | bool:
    with _component(f"{request_id}.hls", dir_fd, directory=True) as hls_fd:
        if hls_fd is not None:
            return False  # made by a request before this one (here, or by another server)
    # The recording's writer renames its MP4 into place, then writes its JSON: both there
    # is a recording whole; its part file, or its MP4 alone, one still being written.
    if _exists(f".{request_id}.fmp4.part", dir_fd):
        return IN_PROGRESS
    with _component(f"{request_id}.mp4", dir_fd) as video_fd:
        if not _is_file(f"{request_id}.json", dir_fd):
            return IN_PROGRESS if video_fd is not None else NOT_FOUND
        if video_fd is None:
            return Answer(404, "recording_not_found: this recording holds no video\n")
        size = os.fstat(video_fd).st_size
        if size > max_bytes:
            return Answer(
                500,
                f"recording_too_large: this recording's {size} bytes are more than the "
                f"{max_bytes} this server converts to HLS\n",
            )
        temp = f".{request_id}.hls.{secrets.token_hex(6)}.part"
        os.mkdir(temp, dir_fd=dir_fd)  # the umask's mode, like the recordings
        try:
            with os.fdopen(os.dup(video_fd), "rb") as video:
                _write_hls(video, directory / temp)
            try:
                os.rename(temp, f"{request_id}.hls", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                return False  # another server on this directory made it meanwhile
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(directory / temp)
    logger.info("recordings: %s converted to HLS (%d bytes)", request_id, size)
    return True


def _write_hls(video: BinaryIO, folder: Path) -> None:
    """The playlist, init segment and segments of ``video`` in ``folder``, each flushed to
    disk (the folder is renamed into place after: its files must be whole)."""
    fragmented_path = folder / "fragmented.mp4"
    fragmented = fragment_mp4(video, fragmented_path)
    segments = group_segments(fragmented.fragments)
    with open(fragmented_path, "rb") as source:
        _write_file(folder / INIT_SEGMENT, source.read(fragmented.init_size))
        for number, segment in enumerate(segments):
            source.seek(segment[0].offset)
            _write_file(folder / f"{number}.m4s", source.read(sum(f.size for f in segment)))
    os.unlink(fragmented_path)
    durations = [sum((f.duration for f in segment), Fraction(0)) for segment in segments]
    _write_file(folder / PLAYLIST, playlist(durations).encode())


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


# ------------------------------------------------------------------ pure parts


def group_segments(
    fragments: Sequence[Fragment], longest: Fraction = SEGMENT_SECONDS
) -> list[list[Fragment]]:
    """Fragments in segments, in order: each segment as many whole fragments as fit in
    ``longest`` seconds, and at least one."""
    segments: list[list[Fragment]] = []
    duration = Fraction(0)
    for fragment in fragments:
        if segments and duration + fragment.duration <= longest:
            segments[-1].append(fragment)
            duration += fragment.duration
        else:
            segments.append([fragment])
            duration = fragment.duration
    return segments


def playlist(durations: Sequence[Fraction]) -> str:
    """The VOD media playlist of segments ``0.m4s``, ``1.m4s``... lasting ``durations``
    seconds, after the init segment ``init.mp4``."""
    document = m3u8.M3U8()
    document.version = str(HLS_VERSION)
    document.playlist_type = "vod"
    # RFC 8216 4.3.3.1: every EXTINF, rounded to the nearest integer, is at most the
    # target duration; the ceiling is never below it, and never below a duration.
    document.target_duration = max(1, math.ceil(max(durations, default=Fraction(1))))
    document.is_independent_segments = True  # each segment starts with a keyframe
    document.is_endlist = True
    for number, duration in enumerate(durations):
        document.add_segment(
            m3u8.Segment(
                uri=f"{number}.m4s",
                duration=_decimal(duration),
                init_section={"uri": INIT_SEGMENT},
            )
        )
    text: str = document.dumps()
    return text


def _decimal(duration: Fraction) -> float:
    """A duration as EXTINF writes it: exact when it is a short decimal (0.5, 1.25),
    else to the microsecond."""
    return round(float(duration), 6)


def _if_none_match(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[str] | None:
    """The entity tags of ``If-None-Match``, None without one."""
    values = [value for name, value in headers if name.lower() == b"if-none-match"]
    if not values:
        return None
    tags = b",".join(values).decode("latin-1").split(",")
    return frozenset(tag.strip().removeprefix("W/") for tag in tags if tag.strip())
