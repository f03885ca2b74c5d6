"""Recordings: each session kept as ``DIR/<request_id>.mp4`` beside ``DIR/<request_id>.json``.

Research runs must be reproducible and their data kept, so ``--record DIR`` keeps, for
every session that sent ``video.start``, the video exactly as it was sent (its packets
remuxed into a progressive MP4: copied, never re-encoded) and a JSON record of what
made it: the request as validated, the seed, the engine and model, every interaction
with its arrival and the chunks where it started and completed, per-chunk timings, the
outcome and the terminal message. Stopped and failed sessions are kept up to what was
sent. ``python -m trio_vstream replay`` repeats a recording (``client/_replay.py``).

A recording must never slow its session. Its `SessionTap` runs on the event loop and
only queues references (bytes are immutable: nothing is copied) into a bounded queue;
one writer thread per recording does every disk operation. When the writer falls
behind (the queue is full) or the disk fails (a full disk), the recording is dropped:
logged once, its partial files deleted, the session untouched. A thread rather than a
Trio task, because a recording outlives its session (the remux and the JSON come after
the terminal message) and must not be cut half-way by the server's cancellation; the
server's command line calls `Recorder.close` at exit to finish them.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import errno
import hashlib
import json
import mimetypes
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Final

import attrs
import av
import av.error

from trio_vstream import protocol
from trio_vstream.logsafe import get_logger
from trio_vstream.taps import SessionTaps

__all__ = ["FORMAT", "FORMAT_VERSION", "Recorder", "open_part_file"]

logger = get_logger(__name__)

FORMAT: Final = "trio_vstream.recording"
"""The JSON's ``format`` field: what tells a recording from any other JSON file."""
FORMAT_VERSION: Final = 1
"""The JSON's ``version``: raised on any change a reader of older files would misread."""

DEFAULT_MAX_QUEUED_BYTES: Final = 256 * 1024 * 1024
"""Chunk bytes a recording may have waiting for its writer: seconds of HD video, far
more than a healthy disk ever lets pile up; past it the disk is not keeping up."""
DEFAULT_MAX_QUEUED_ITEMS: Final = 4096
"""Messages a recording may have waiting (interactions are small but unbounded in number)."""

PartOpener = Callable[[Path], BinaryIO]
"""Opens the file the received fMP4 is appended to: the file boundary, where a test puts
a full or a slow disk."""


def open_part_file(path: Path) -> BinaryIO:
    """The default `PartOpener`: a new file (never someone else's, hence ``x``)."""
    return open(path, "xb")


class _Dropped(Exception):
    """The recording is abandoned (why: its message); the writer cleans up and leaves."""


class Recorder:
    """Where and how the server records sessions; ``Recorder(...)`` is the `TapFactory`.

    ``engine`` and ``model`` name what generated the videos (the JSON records both);
    ``device`` too, when known. The directory is created if needed.
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
        open_part: PartOpener = open_part_file,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.engine = engine
        self.model = model
        self.device = device
        self.max_queued_bytes = max_queued_bytes
        self.max_queued_items = max_queued_items
        self.open_part = open_part
        self.written = 0
        """Recordings written whole so far (an MP4 and its JSON)."""
        self.dropped = 0
        """Recordings dropped so far (behind, or a disk error)."""
        self._lock = threading.Lock()
        self._writing: set[_RecordingTap] = set()

    def __call__(self, request_id: str, start: protocol.SessionStart) -> SessionTaps:
        return SessionTaps([_RecordingTap(self, request_id)])

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

    def _finished(self, tap: _RecordingTap, dropped: bool) -> None:
        with self._lock:
            self._writing.discard(tap)
            self.dropped += dropped
            self.written += not dropped


@attrs.define
class _Queue:
    """A bounded queue between the event loop (which never waits) and one writer thread."""

    max_bytes: int
    max_items: int
    items: collections.deque[tuple[tuple[Any, ...], int]] = attrs.field(factory=collections.deque)
    queued_bytes: int = 0
    dropped: str | None = None
    """Why the recording was dropped; then `get` raises and `put` refuses."""
    condition: threading.Condition = attrs.field(factory=threading.Condition)

    def put(self, item: tuple[Any, ...], size: int = 0, *, force: bool = False) -> bool:
        """Queue ``item`` unless it is over the bounds (``force``: a last, small item that
        the bounds do not refuse, so a recording that kept up is always finished)."""
        with self.condition:
            if self.dropped is not None:
                return False
            if not force and (
                len(self.items) >= self.max_items or self.queued_bytes + size > self.max_bytes
            ):
                return False
            self.items.append((item, size))
            self.queued_bytes += size
            self.condition.notify()
            return True

    def drop(self, reason: str) -> bool:
        """Abandon what is queued; False if it was already dropped."""
        with self.condition:
            if self.dropped is not None:
                return False
            self.dropped = reason
            self.items.clear()
            self.queued_bytes = 0
            self.condition.notify()
            return True

    def get(self) -> tuple[Any, ...]:
        with self.condition:
            while not self.items and self.dropped is None:
                self.condition.wait()
            if self.dropped is not None:
                raise _Dropped(self.dropped)
            item, size = self.items.popleft()
            self.queued_bytes -= size
            return item


class _RecordingTap:
    """One session's recording: the tap (event loop side) and its writer thread."""

    def __init__(self, recorder: Recorder, request_id: str) -> None:
        self._recorder = recorder
        self.request_id = request_id
        self._queue = _Queue(recorder.max_queued_bytes, recorder.max_queued_items)
        self._started_at = 0.0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------ the tap (event loop)

    def started(self, video_start: protocol.VideoStart, start: protocol.SessionStart) -> None:
        self._started_at = time.monotonic()
        self._put(("started", video_start, start, _now_iso()))
        self._recorder._began(self)
        thread = threading.Thread(
            target=self._write, name=f"record-{self.request_id[-8:]}", daemon=True
        )
        try:
            thread.start()
        except BaseException:  # no thread to be had: no recording (the tap set logs it)
            self._queue.drop("no writer thread")
            self._recorder._finished(self, dropped=True)
            raise
        self._thread = thread

    def chunk(self, metadata: protocol.ChunkMetadata, data: bytes, init_segment: bytes) -> None:
        self._put(("chunk", metadata, data, self._elapsed()), len(data))

    def interaction(
        self, event_id: str, message: protocol.Interaction, error: protocol.Error | None
    ) -> None:
        self._put(("interaction", event_id, message, error, self._elapsed(), _now_iso()))

    def ended(self, outcome: str, terminal: protocol.SessionDone | protocol.Error | None) -> None:
        self._queue.put(("ended", outcome, terminal, self._elapsed()), force=True)

    def abandoned(self) -> None:
        """The server is going away without this session's end (see `Recorder.close`)."""
        self._queue.put(("ended", "unfinished", None, self._elapsed()), force=True)

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
        writer = _Writer(self._recorder, self.request_id)
        dropped = False
        try:
            while True:
                item = self._queue.get()
                if writer.handle(item):
                    break
        except _Dropped:
            dropped = True  # logged by whoever dropped it
        except (OSError, av.error.FFmpegError) as exc:
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
            self._recorder._finished(self, dropped)


class _Writer:
    """Everything a recording does on disk, in its thread: the fMP4 appended to a part
    file, the image beside it, then the remux and the JSON, each written to a temporary
    name and renamed, so a file with the final name is always whole."""

    def __init__(self, recorder: Recorder, request_id: str) -> None:
        self.recorder = recorder
        self.request_id = request_id
        directory = recorder.directory
        self.part_path = directory / f".{request_id}.fmp4.part"
        self.video_path = directory / f"{request_id}.mp4"
        self.json_path = directory / f"{request_id}.json"
        self.written: list[Path] = []
        """Final files already in place: removed too if the recording is dropped later."""
        self.part: BinaryIO | None = None
        self.record: dict[str, Any] = {}
        self.interactions: dict[str, dict[str, Any]] = {}

    def handle(self, item: tuple[Any, ...]) -> bool:
        """Write one queued item; True once the recording is complete."""
        kind = item[0]
        if kind == "started":
            self._started(*item[1:])
        elif kind == "chunk":
            self._chunk(*item[1:])
        elif kind == "interaction":
            self._interaction(*item[1:])
        else:
            self._ended(*item[1:])
            return True
        return False

    def _started(
        self, video_start: protocol.VideoStart, start: protocol.SessionStart, at: str
    ) -> None:
        self.part = self.recorder.open_part(self.part_path)
        request = json.loads(json.dumps(video_start.config))
        request.pop("image_reference", None)  # recorded as "image" (see _image)
        self.record = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "request_id": self.request_id,
            "engine": self.recorder.engine,
            "model": self.recorder.model,
            "device": self.recorder.device,
            "started_at": at,
            "ended_at": None,
            "request": request,
            "seed": video_start.config.get("seed"),
            "video": attrs.asdict(start.video),
            "image": self._image(start.image),
            "interactions": [],
            "chunks": [],
            "outcome": None,
            "terminal": None,
            "duration": None,
            "file": None,
        }
        for entry in start.interaction_script:
            message = protocol.Interaction(
                entry.event_id, entry.prompt, entry.transition_chunks, entry.camera
            )
            self._add_interaction(entry.event_id, message, None, 0.0, at, "script")

    def _image(self, image: protocol.ImageInput | protocol.ImageURL | None) -> Any:
        """What ``image_reference`` was: inline data goes to a file beside the video (its
        hash and size in the JSON), since a replay needs it; of an https URL only the
        address without its query (which may carry a signature) is kept."""
        if image is None:
            return None
        if isinstance(image, protocol.ImageURL):
            address, _, query = image.url.partition("?")
            return {"source": "url", "url": address.partition("#")[0], "query_removed": bool(query)}
        extension = mimetypes.guess_extension(image.mime_type) or ".img"
        path = self.recorder.directory / f"{self.request_id}.image{extension}"
        _write_atomically(path, image.data)
        self.written.append(path)
        return {
            "source": "inline",
            "file": path.name,
            "mime_type": image.mime_type,
            "bytes": len(image.data),
            "sha256": hashlib.sha256(image.data).hexdigest(),
        }

    def _chunk(self, metadata: protocol.ChunkMetadata, data: bytes, elapsed: float) -> None:
        assert self.part is not None
        self.part.write(data)
        index = metadata.generation_chunk_index
        for ids, key in (
            (metadata.started_event_ids, "started_chunk"),
            (metadata.completed_event_ids, "completed_chunk"),
        ):
            for event_id in ids:
                entry = self.interactions.get(event_id)
                if entry is not None and entry[key] is None:
                    entry[key] = index
        self.record["chunks"].append(
            {
                "kind": metadata.kind,
                "transport_chunk_index": metadata.transport_chunk_index,
                "generation_chunk_index": index,
                "t": elapsed,
                "frames": metadata.num_frames,
                "bytes": metadata.byte_length,
                "started_event_ids": list(metadata.started_event_ids),
                "active_event_ids": list(metadata.active_event_ids),
                "completed_event_ids": list(metadata.completed_event_ids),
            }
        )

    def _interaction(
        self,
        event_id: str,
        message: protocol.Interaction,
        error: protocol.Error | None,
        elapsed: float,
        at: str,
    ) -> None:
        self._add_interaction(event_id, message, error, elapsed, at, "live")

    def _add_interaction(
        self,
        event_id: str,
        message: protocol.Interaction,
        error: protocol.Error | None,
        elapsed: float,
        at: str,
        source: str,
    ) -> None:
        entry = {
            "event_id": event_id,
            "source": source,
            "t": elapsed,
            "at": at,
            "message": json.loads(attrs.evolve(message, event_id=event_id).to_json()),
            "accepted": error is None,
            "error": None if error is None else {"code": str(error.code), "message": error.message},
            "started_chunk": None,
            "completed_chunk": None,
        }
        self.record["interactions"].append(entry)
        if error is None:  # a refused id may be reused: only the accepted one has chunks
            self.interactions[event_id] = entry

    def _ended(
        self,
        outcome: str,
        terminal: protocol.SessionDone | protocol.Error | None,
        elapsed: float,
    ) -> None:
        record = self.record
        record["outcome"] = outcome
        record["terminal"] = None if terminal is None else json.loads(terminal.to_json())
        record["duration"] = elapsed
        record["ended_at"] = _now_iso()
        sent = sum(chunk["frames"] for chunk in record["chunks"])
        if self.part is not None:
            self.part.close()
            self.part = None
            if sent:
                frames = _remux(self.part_path, self.video_path)
                self.written.append(self.video_path)
                record["file"] = {
                    "name": self.video_path.name,
                    "frames": frames,
                    "bytes": self.video_path.stat().st_size,
                }
                if frames != sent:
                    logger.warning(
                        "session %s: recording holds %d frames, %d were sent",
                        self.request_id,
                        frames,
                        sent,
                    )
            self.part_path.unlink()
        text = json.dumps(record, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
        _write_atomically(self.json_path, text.encode())
        self.written.append(self.json_path)
        logger.info("session %s recorded: %s (%d frames)", self.request_id, self.json_path, sent)

    def discard(self) -> None:
        """Remove whatever this recording wrote: half a recording is not one."""
        if self.part is not None:
            with contextlib.suppress(OSError):
                self.part.close()
        for path in (self.part_path, *self.written):
            with contextlib.suppress(OSError):
                path.unlink()


def _remux(source: Path, target: Path) -> int:
    """Copy the fMP4's packets into a progressive MP4 (``faststart``); returns how many.

    No re-encoding: the file holds the very bytes the client decoded. A stream without
    its trailer (a stopped or failed session) remuxes the same way.
    """
    temp = target.with_name(f".{target.name}.part")
    frames = 0
    try:
        with av.open(str(source), mode="r") as reading:
            if not reading.streams.video:
                raise OSError(errno.EINVAL, "the recorded stream holds no video", str(source))
            in_stream = reading.streams.video[0]
            with av.open(
                str(temp), mode="w", format="mp4", options={"movflags": "+faststart"}
            ) as output:
                out_stream = output.add_stream_from_template(in_stream)
                for packet in reading.demux(in_stream):
                    if packet.dts is None:  # the demuxer's end-of-stream marker
                        continue
                    packet.stream = out_stream
                    output.mux(packet)
                    frames += 1
        os.replace(temp, target)
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()
    return frames


def _write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary name, flush to disk, rename: the final name is never partial."""
    temp = path.with_name(f".{path.name}.part")
    try:
        with open(temp, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
