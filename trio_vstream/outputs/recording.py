"""Recordings: each session kept as ``DIR/<request_id>.mp4`` beside ``DIR/<request_id>.json``.

Research runs must be reproducible and their data kept, so ``--record DIR`` keeps, for
every session that sent ``video.start``, the video exactly as it was sent (its packets
remuxed into a progressive MP4: copied, never re-encoded) and a JSON record of what
made it: the request as validated, the seed, the engine and model, every interaction
with its arrival and the chunks where it started and completed, per-chunk timings, the
outcome and the terminal message. Stopped and failed sessions are kept up to what was
sent. ``python -m trio_vstream replay`` repeats a recording (``client/_replay.py``).

The disk is bounded too: a `Recorder` may be given ``max_bytes``, the most its
recordings in the directory may take (those already there count). Every byte a
recording will write is reserved before it is queued (a chunk twice: the part file,
then the MP4 it is remuxed into), and the reservation becomes the files' real size when
the recording is written. At the limit, a session that starts is not recorded (counted
as dropped, logged once until there is room again), and a recording that reaches it
mid-way stops there and is finished as it stands: a valid MP4 of the chunks written,
and a JSON that says ``"truncated": true``, why, and how many chunks and interactions
were not recorded. What a client sent is never left out silently.

A recording must never slow its session. Its `SessionTap` runs on the event loop and
only queues references (bytes are immutable: nothing is copied) into a bounded queue;
one writer thread per recording does every disk operation. When the writer falls
behind (the queue is full) or the disk fails (a full disk), the recording is dropped:
logged once, its partial files deleted, the session untouched. A thread rather than a
Trio task, because a recording outlives its session (the remux and the JSON come after
the terminal message) and must not be cut half-way by the server's cancellation; the
server's command line calls `Recorder.close` at exit to finish them.

This module is the event loop's side: the `Recorder` and each session's tap. The
writer thread's side, the queue it reads and all it does on disk, is
`trio_vstream.outputs._record_writer`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Final

import av.error

from trio_vstream import protocol
from trio_vstream.logsafe import get_logger
from trio_vstream.media.remux import RemuxError
from trio_vstream.outputs._record_writer import (
    Dropped,
    PartOpener,
    Writer,
    WriterQueue,
    now_iso,
)
from trio_vstream.outputs.taps import SessionTaps

__all__ = ["Recorder", "open_part_file"]

logger = get_logger(__name__)

DEFAULT_MAX_QUEUED_BYTES: Final = 256 * 1024 * 1024
"""Chunk bytes a recording may have waiting for its writer: seconds of HD video, far
more than a healthy disk ever lets pile up; past it the disk is not keeping up."""
DEFAULT_MAX_QUEUED_ITEMS: Final = 4096
"""Messages a recording may have waiting (interactions are small but unbounded in number)."""
DEFAULT_MAX_IMAGE_BYTES: Final = 16 * 1024 * 1024
"""The largest inline ``image_reference`` kept as a file beside a recording; a larger
one is described in the JSON (size, type, SHA-256) but not kept."""

_START_BYTES: Final = 16 * 1024
"""Reserved for a recording's JSON besides its request, chunks and interactions."""
_ENTRY_BYTES: Final = 1024
"""Reserved for each chunk's or interaction's entry in the JSON, besides its text."""


def open_part_file(path: Path) -> BinaryIO:
    """The default `PartOpener`: a new file (never someone else's, hence ``x``)."""
    return open(path, "xb")


class Recorder:
    """Where and how the server records sessions; ``Recorder(...)`` is the `TapFactory`.

    ``engine`` and ``model`` name what generated the videos (the JSON records both);
    ``device`` too, when known. The directory is created if needed. ``max_bytes``
    bounds what the recordings in it may take (see the module's docstring; None: no
    bound); the recordings already there are counted now.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        engine: str,
        model: str,
        device: str | None = None,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        max_queued_items: int = DEFAULT_MAX_QUEUED_ITEMS,
        max_bytes: int | None = None,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        open_part: PartOpener = open_part_file,
        node: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.node = node
        """The server's name in its fleet (``--node-name``): kept in each record and told
        in ``video.start``, so that a recording on a shared volume says who made it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.engine = engine
        self.model = model
        self.device = device
        self.max_queued_bytes = max_queued_bytes
        self.max_queued_items = max_queued_items
        self.max_bytes = max_bytes
        self.max_image_bytes = max_image_bytes
        self.open_part = open_part
        self.written = 0
        """Recordings written whole so far (an MP4 and its JSON)."""
        self.dropped = 0
        """Recordings dropped so far (behind, a disk error), or never begun (the limit)."""
        self.truncated = 0
        """Recordings written, but stopped part-way at ``max_bytes``."""
        self.used = recordings_size(self.directory)
        """Bytes the recordings take: those in the directory, written or being written,
        and what those being written have reserved."""
        self._lock = threading.Lock()
        self._writing: set[_RecordingTap] = set()
        self._full_logged = False

    def __call__(self, request_id: str, start: protocol.SessionStart) -> SessionTaps:
        where = {"file": f"{request_id}.mp4"}
        if self.node is not None:
            where["node"] = self.node
        return SessionTaps([_RecordingTap(self, request_id)], {"recording": where})

    def close(self, timeout: float | None = None) -> bool:
        """Finish every recording still being written, and wait for them (at most
        ``timeout`` seconds; True when all are done). A session that never ended (the
        server was cancelled) is written as it stands, with outcome ``unfinished``."""
        with self._lock:
            taps = list(self._writing)
        for tap in taps:
            tap.abandoned()
        return self.wait_idle(timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no recording is being written; True unless ``timeout`` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                taps = list(self._writing)
            if not taps:
                return True
            for tap in taps:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not tap.join(left):
                    return False

    @property
    def active(self) -> int:
        """Recordings being written now."""
        with self._lock:
            return len(self._writing)

    def _began(self, tap: _RecordingTap) -> None:
        with self._lock:
            self._writing.add(tap)

    def _reserve(self, size: int) -> bool:
        """Take ``size`` bytes of the limit for a recording; False if they do not fit."""
        with self._lock:
            if self.max_bytes is not None and self.used + size > self.max_bytes:
                return False
            self.used += size
            return True

    def _refuse(self, request_id: str) -> None:
        """A session not recorded for the limit: counted, and logged once until a
        recording fits again (a client could otherwise fill the log, one line a session)."""
        with self._lock:
            self.dropped += 1
            log, self._full_logged = not self._full_logged, True
            used = self.used
        if log:
            logger.warning(
                "recordings use %d of their %s bytes (--record-max-bytes): new sessions are "
                "not recorded until there is room (first: session %s)",
                used,
                self.max_bytes,
                request_id,
            )

    def _finished(
        self, tap: _RecordingTap, dropped: bool, reserved: int, size: int, truncated: bool
    ) -> None:
        """A recording is done: its reservation becomes the ``size`` its files take
        (nothing, when it was dropped and its files removed)."""
        with self._lock:
            self._writing.discard(tap)
            self.dropped += dropped
            self.written += not dropped
            self.truncated += truncated and not dropped
            self.used += size - reserved
            if self.max_bytes is None or self.used < self.max_bytes:
                self._full_logged = False


class _RecordingTap:
    """One session's recording: the tap (event loop side) and its writer thread."""

    def __init__(self, recorder: Recorder, request_id: str) -> None:
        self._recorder = recorder
        self.request_id = request_id
        self._queue = WriterQueue(recorder.max_queued_bytes, recorder.max_queued_items)
        self._started_at = 0.0
        self._thread: threading.Thread | None = None
        self.reserved = 0
        """Bytes of the recorder's limit this recording holds (its writer reads it last)."""
        self._truncated: dict[str, Any] | None = None
        """Why and when the recording stopped short of the session, and what it left out."""

    # ------------------------------------------------------ the tap (event loop)

    def started(self, video_start: protocol.VideoStart, start: protocol.SessionStart) -> None:
        self._started_at = time.monotonic()
        size = _start_size(video_start, start, self._recorder.max_image_bytes)
        if not self._recorder._reserve(size):
            self._queue.drop("the recordings' limit is reached")  # the tap does nothing more
            self._recorder._refuse(self.request_id)
            return
        self.reserved = size
        self._put(("started", video_start, start, now_iso()))
        self._recorder._began(self)
        # Which server made a recording, for a fleet recording to one shared volume.
        logger.info(
            "session %s: recording to %s%s",
            self.request_id,
            self._recorder.directory / f"{self.request_id}.mp4",
            "" if self._recorder.node is None else f" on node {self._recorder.node}",
        )
        thread = threading.Thread(
            target=self._write, name=f"record-{self.request_id[-8:]}", daemon=True
        )
        try:
            thread.start()
        except BaseException:  # no thread to be had: no recording (the tap set logs it)
            self._queue.drop("no writer thread")
            self._recorder._finished(self, True, self.reserved, 0, False)
            raise
        self._thread = thread

    def chunk(self, metadata: protocol.ChunkMetadata, data: bytes, init_segment: bytes) -> None:
        # Twice: the part file, then the MP4 remuxed from it, are both on disk a moment.
        if self._fits("chunks", 2 * len(data) + _ENTRY_BYTES):
            self._put(("chunk", metadata, data, self._elapsed()), len(data))

    def interaction(
        self, event_id: str, message: protocol.Interaction, error: protocol.Error | None
    ) -> None:
        text = len(message.to_json()) + (len(error.message) if error is not None else 0)
        if self._fits("interactions", 2 * text + _ENTRY_BYTES):
            self._put(("interaction", event_id, message, error, self._elapsed(), now_iso()))

    def interaction_refused(self, event_id: str, error: protocol.Error) -> None:
        if self._fits("interactions", 2 * len(error.message) + _ENTRY_BYTES):
            self._put(("refused", event_id, error, self._elapsed()))

    def ended(self, outcome: str, terminal: protocol.SessionDone | protocol.Error | None) -> None:
        self._queue.put(
            ("ended", outcome, terminal, self._elapsed(), self._truncation()), force=True
        )

    def abandoned(self) -> None:
        """The server is going away without this session's end (see `Recorder.close`)."""
        self._queue.put(
            ("ended", "unfinished", None, self._elapsed(), self._truncation()), force=True
        )

    def _truncation(self) -> dict[str, Any] | None:
        """What the JSON says of a truncation (a copy: the writer thread reads it)."""
        return None if self._truncated is None else dict(self._truncated)

    def _fits(self, what: str, size: int) -> bool:
        """Reserve what an item will write, or, at the recorder's limit, stop the
        recording here: nothing more is recorded, and the JSON counts what was not."""
        if self._queue.dropped is not None:
            return False
        if self._truncated is None:
            if self._recorder._reserve(size):
                self.reserved += size
                return True
            self._truncated = {
                "reason": f"the recordings' limit of {self._recorder.max_bytes} bytes "
                "(--record-max-bytes) was reached",
                "t": self._elapsed(),
                "chunks_not_recorded": 0,
                "interactions_not_recorded": 0,
            }
            logger.warning(
                "session %s: recording stopped at the recordings' limit of %s bytes; "
                "the rest of the session is not recorded",
                self.request_id,
                self._recorder.max_bytes,
            )
        self._truncated[f"{what}_not_recorded"] += 1
        return False

    def join(self, timeout: float | None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _elapsed(self) -> float:
        return round(time.monotonic() - self._started_at, 6)

    def _put(self, item: tuple[Any, ...], size: int = 0) -> None:
        if self._queue.put(item, size) or self._queue.dropped is not None:
            return
        queue = self._queue
        reason = (
            f"its writer fell behind ({len(queue.items)} items, {queue.queued_bytes} bytes "
            "queued): the disk is too slow"
        )
        if queue.drop(reason):
            logger.warning("session %s: recording dropped: %s", self.request_id, reason)

    # ------------------------------------------------------ the writer (thread)

    def _write(self) -> None:
        writer = Writer(self._recorder, self.request_id)
        dropped = False
        truncated = False
        try:
            while True:
                item = self._queue.get()
                if writer.handle(item):
                    truncated = item[-1] is not None  # the "ended" item's truncation
                    break
        except Dropped:
            dropped = True  # logged by whoever dropped it
        except (OSError, av.error.FFmpegError, RemuxError) as exc:
            dropped = True
            if self._queue.drop(str(exc)):
                logger.error(
                    "session %s: recording dropped: cannot write it: %s", self.request_id, exc
                )
        except Exception:
            dropped = True
            self._queue.drop("internal error")
            logger.exception("session %s: recording dropped: internal error", self.request_id)
        finally:
            if dropped:
                writer.discard()
            size = 0 if dropped else writer.size()
            self._recorder._finished(self, dropped, self.reserved, size, truncated)


def recordings_size(directory: Path) -> int:
    """Bytes taken by the recordings in ``directory``: its files named for a session
    (``video_stream-...``, and the hidden part files of one being written)."""
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.lstrip(".").startswith(_RECORDING_PREFIX) and entry.is_file(
                follow_symlinks=False
            ):
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


_RECORDING_PREFIX: Final = "video_stream-"
"""How the server's request ids, and so its recordings' file names, begin."""


def _start_size(
    video_start: protocol.VideoStart, start: protocol.SessionStart, max_image_bytes: int
) -> int:
    """What a recording reserves when it begins: its JSON's fixed part (the request twice:
    in ``request`` and, for scripted interactions, in their entries) and the image."""
    config = {k: v for k, v in video_start.config.items() if k != "image_reference"}
    size = _START_BYTES + 2 * len(json.dumps(config, ensure_ascii=False).encode())
    size += _ENTRY_BYTES * len(start.interaction_script)
    image = start.image
    if isinstance(image, protocol.ImageInput) and len(image.data) <= max_image_bytes:
        size += len(image.data)
    return size
