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
"""

from __future__ import annotations

import collections
import contextlib
import datetime
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
from trio_vstream.media.remux import RemuxError, remux_to_mp4
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
    ) -> None:
        self.directory = Path(directory)
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
        self._put(("started", video_start, start, _now_iso()))
        self._recorder._began(self)
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
            self._put(("interaction", event_id, message, error, self._elapsed(), _now_iso()))

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
        writer = _Writer(self._recorder, self.request_id)
        dropped = False
        truncated = False
        try:
            while True:
                item = self._queue.get()
                if writer.handle(item):
                    truncated = item[-1] is not None  # the "ended" item's truncation
                    break
        except _Dropped:
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
        elif kind == "refused":
            self._refused(*item[1:])
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
        audio = request.pop("audio", None)  # the server's word, not the client's request
        self.record = {
            "format": protocol.RECORDING_FORMAT,
            "version": protocol.RECORDING_FORMAT_VERSION,
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
            "truncated": False,
            "truncation": None,
        }
        if audio is not None:
            # The stream has sound (its MP4 keeps it); each chunk then says how much.
            self.record["audio"] = audio
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
        described = {
            "source": "inline",
            "file": None,
            "mime_type": image.mime_type,
            "bytes": len(image.data),
            "sha256": hashlib.sha256(image.data).hexdigest(),
        }
        if len(image.data) > self.recorder.max_image_bytes:
            limit = self.recorder.max_image_bytes
            return {**described, "not_kept": f"larger than the {limit} bytes kept"}
        extension = mimetypes.guess_extension(image.mime_type) or ".img"
        path = self.recorder.directory / f"{self.request_id}.image{extension}"
        _write_atomically(path, image.data)
        self.written.append(path)
        return {**described, "file": path.name}

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
                **(
                    {"audio_samples": metadata.num_audio_samples}
                    if metadata.num_audio_samples is not None
                    else {}
                ),
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

    def _refused(self, event_id: str, error: protocol.Error, elapsed: float) -> None:
        """An interaction recorded as accepted was refused at its hand-over: its entry
        says so (``refused_t``: when), and its id may be used again."""
        entry = self.interactions.pop(event_id, None)
        if entry is not None:
            entry["accepted"] = False
            entry["error"] = {"code": str(error.code), "message": error.message}
            entry["refused_t"] = elapsed

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
        truncation: dict[str, Any] | None,
    ) -> None:
        record = self.record
        record["truncated"] = truncation is not None
        record["truncation"] = truncation
        record["outcome"] = outcome
        record["terminal"] = None if terminal is None else json.loads(terminal.to_json())
        record["duration"] = elapsed
        record["ended_at"] = _now_iso()
        sent = sum(chunk["frames"] for chunk in record["chunks"])
        if self.part is not None:
            self.part.close()
            self.part = None
            if sent:
                frames = remux_to_mp4(self.part_path, self.video_path)
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

    def size(self) -> int:
        """Bytes of the files this recording left in place."""
        total = 0
        for path in self.written:
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        return total

    def discard(self) -> None:
        """Remove whatever this recording wrote: half a recording is not one."""
        if self.part is not None:
            with contextlib.suppress(OSError):
                self.part.close()
        for path in (self.part_path, *self.written):
            with contextlib.suppress(OSError):
                path.unlink()


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
