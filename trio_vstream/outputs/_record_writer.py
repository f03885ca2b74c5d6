"""A recording's writer thread: its queue from the event loop, and everything it does on disk.

`trio_vstream.outputs.recording` is the recording as the server sees it: the `Recorder`
(its directory, its limit on disk, its counts) and each session's tap, on the event
loop. This is the other side of the tap's queue, in the recording's own thread: the
fMP4 appended to a part file, the image beside it, then the remux into a progressive
MP4 and the JSON record. Apart because nothing here may touch the event loop, and
nothing there may touch the disk: the queue between them (`WriterQueue`) is the one
thing both sides share.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import attrs

from trio_vstream import protocol
from trio_vstream.logsafe import get_logger
from trio_vstream.media.remux import remux_to_mp4

# The recording's logger: these are its lines, under the name they had in `recording`.
logger = get_logger("trio_vstream.outputs.recording")

PartOpener = Callable[[Path], BinaryIO]
"""Opens the file the received fMP4 is appended to: the file boundary, where a test puts
a full or a slow disk."""


class RecorderSettings(Protocol):
    """What a writer reads of its `Recorder`."""

    @property
    def directory(self) -> Path: ...
    @property
    def engine(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def device(self) -> str | None: ...
    @property
    def node(self) -> str | None: ...
    @property
    def max_image_bytes(self) -> int: ...
    @property
    def open_part(self) -> PartOpener: ...


class Dropped(Exception):
    """The recording is abandoned (why: its message); the writer cleans up and leaves."""


@attrs.define
class WriterQueue:
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
                raise Dropped(self.dropped)
            item, size = self.items.popleft()
            self.queued_bytes -= size
            return item


class Writer:
    """Everything a recording does on disk, in its thread: the fMP4 appended to a part
    file, the image beside it, then the remux and the JSON, each written to a temporary
    name and renamed, so a file with the final name is always whole."""

    def __init__(self, recorder: RecorderSettings, request_id: str) -> None:
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
            "node": self.recorder.node,
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
        write_atomically(path, image.data)
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
        record["ended_at"] = now_iso()
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
        write_atomically(self.json_path, text.encode())
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


def write_atomically(path: Path, data: bytes) -> None:
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


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
