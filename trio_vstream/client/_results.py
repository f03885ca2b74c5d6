"""What a streamed session delivered: `StreamResult` and the records inside it.

Plain data, filled in live by `stream_video` and read by the command line, the
benchmark and tests; nothing here does I/O.
"""

from __future__ import annotations

import enum
import json
from fractions import Fraction
from typing import Any

import attrs

from trio_vstream import protocol
from trio_vstream.client._viewer import PlaybackViewer
from trio_vstream.values import Camera

__all__ = [
    "InteractionRecord",
    "ReceivedChunk",
    "ScheduledInteraction",
    "StreamConnectError",
    "StreamOutcome",
    "StreamResult",
]


class StreamOutcome(enum.StrEnum):
    """How a streamed session ended, from the client's side."""

    COMPLETED = "completed"
    """``session.done`` with ``stopped: false``: the whole video arrived."""
    STOPPED = "stopped"
    """``session.done`` with ``stopped: true``: we asked for a stop and it was honoured."""
    ERROR = "error"
    """The server ended the session with an ``error``."""
    DISCONNECTED = "disconnected"
    """The connection ended without a terminal message."""
    ABORTED = "aborted"
    """We gave up: ``abort_event``, or the server did not finish a stop in time."""


class StreamConnectError(Exception):
    """No session could be opened (refused, unreachable, handshake rejected, timeout).

    Raised rather than returned because nothing arrived that a caller could keep.
    ``status_code`` is the HTTP status when the server answered the handshake with one
    (401 no or wrong API key, 403 Origin refused, 503 draining or at the connection
    cap), so a caller can act on it (ask for a key, try another server) without parsing
    the message. A full server's 503 is not raised: it says ``server_busy`` in an
    ``error`` message, which `stream_video` returns as the session's outcome.
    """

    def __init__(self, url: str, reason: str, status_code: int | None = None) -> None:
        super().__init__(f"cannot connect to {url}: {reason}")
        self.url = url
        self.reason = reason
        self.status_code = status_code


@attrs.frozen(kw_only=True)
class ScheduledInteraction:
    """A prompt change, a camera, or both, to send once the video reaches ``at`` seconds.

    Media time (frames received / fps), not wall time: a script then means the same
    thing however fast the server generates. Against a server faster than real time a
    wall-clock schedule fired after the video had ended; against a slow one, too early.
    The interaction is sent right after the first media chunk that brings the delivered
    media time to ``at`` or past it (``at=0``: right after ``video.start``), so it lands
    at the next chunk boundary after that point. With a simulated viewer (``playback``)
    it is sent when the viewer's playhead reaches ``at``, as a person presses a key at
    what they see.
    """

    at: float
    prompt: str | None = None
    transition_chunks: int | None = None
    event_id: str | None = None
    """None: the client picks ``interaction-N``, so acknowledgements can be matched."""
    camera: Camera | None = None
    """Sent as ``event.multi_modal_data.camera`` (only engines that take cameras accept
    it; the server answers others with ``interaction_failed``)."""

    def __attrs_post_init__(self) -> None:
        # Here, not at send time: a schedule that cannot be sent should fail when made.
        if self.prompt is None and self.camera is None:
            raise ValueError("a scheduled interaction needs a prompt, a camera, or both")

    def describe(self) -> str:
        """What it changes, in words, for warnings: the prompt (quoted) and/or the camera."""
        parts = []
        if self.prompt is not None:
            parts.append(json.dumps(self.prompt, ensure_ascii=False))
        if self.camera is not None:
            parts.append(f"camera {camera_text(self.camera)}")
        return " + ".join(parts)


def camera_text(camera: Camera) -> str:
    """``velocity:0,0,0.05:0,0,0,1``: short, and what ``--camera`` takes back."""
    numbers = [
        ",".join(f"{round(x, 6):g}" for x in v) for v in (camera.translation, camera.rotation)
    ]
    return f"{camera.mode}:{numbers[0]}:{numbers[1]}"


def camera_json(camera: Camera | None) -> dict[str, Any] | None:
    """The camera in its wire shape (``--json``), or None."""
    if camera is None:
        return None
    return {
        "mode": camera.mode,
        "data": {"translation": list(camera.translation), "rotation": list(camera.rotation)},
    }


@attrs.define(kw_only=True)
class InteractionRecord:
    """What happened to one scheduled interaction."""

    interaction: ScheduledInteraction
    event_id: str
    sent_at: float | None = None
    sent_media_time: float | None = None
    """The delivered media time (seconds) when it was sent: ``at`` rounded up to a chunk."""
    not_sent: str | None = None
    """Why it was never sent (set when the session ends), for warnings and ``--json``."""
    queued_at: float | None = None
    error: protocol.Error | None = None
    started_in_chunk: int | None = None
    """``generation_chunk_index`` of the first chunk that lists it in started_event_ids."""


@attrs.frozen(kw_only=True)
class ReceivedChunk:
    """One binary message and the metadata that announced it."""

    metadata: protocol.ChunkMetadata | None
    """None when the server sent binary data without announcing it (a protocol slip)."""
    size: int
    received_at: float

    @property
    def num_frames(self) -> int:
        if self.metadata is None or self.metadata.kind != "media":
            return 0
        return self.metadata.num_frames

    @property
    def num_audio_samples(self) -> int:
        """The PCM samples this chunk's frames cover; 0 without sound."""
        if self.metadata is None or self.metadata.kind != "media":
            return 0
        return self.metadata.num_audio_samples or 0


@attrs.define(kw_only=True)
class StreamResult:
    """Everything one session delivered, filled in live while it runs.

    Times are ``trio.current_time()`` values; the ``time_to_*`` properties turn them into
    durations. ``video`` is the exact concatenation of the binary messages.
    """

    url: str
    request: dict[str, Any]
    started_at: float
    start_sent_at: float | None = None
    video_start_at: float | None = None
    first_chunk_at: float | None = None
    last_media_at: float | None = None
    stop_requested_at: float | None = None
    ended_at: float | None = None
    video_start: protocol.VideoStart | None = None
    watching: bool = False
    """A viewer of a watch link (`watch_video`): nothing was requested, and the times
    count from the connection being open, since no ``session.start`` was sent."""
    watch_start: protocol.WatchStart | None = None
    """A viewer's ``watch.start`` (in place of ``video_start``)."""
    messages: list[protocol.ServerMessage] = attrs.field(factory=list)
    chunks: list[ReceivedChunk] = attrs.field(factory=list)
    binary_messages: list[bytes] = attrs.field(factory=list, repr=False)
    interactions: list[InteractionRecord] = attrs.field(factory=list)
    errors: list[protocol.Error] = attrs.field(factory=list)
    """Every ``error`` received, including ones that did not end the session."""
    error: protocol.Error | None = None
    """The ``error`` that ended the session, if one did."""
    done: protocol.SessionDone | None = None
    outcome: StreamOutcome | None = None
    stop_timed_out: bool = False
    close_code: int | None = None
    problems: list[str] = attrs.field(factory=list)
    """Protocol violations noticed; kept rather than raised, the data may still be good."""
    frame_rate: Fraction | None = None
    """Frames per second that `media_time` uses: the stream's own timing when it can be
    read, else ``video.start``'s ``config.fps``, else the ``fps`` that was requested."""
    viewer: PlaybackViewer | None = attrs.field(default=None, repr=False)
    """The simulated real-time viewer of ``stream_video(playback=True)``: what a person
    watching at 1x from the first frame saw (`playback_figures`)."""
    playback_sent: list[tuple[float, float]] = attrs.field(factory=list, repr=False)
    """(time, position) of each ``session.playback`` sent (only to a session that opted
    into pacing)."""
    input_frames_sent: int | None = None
    """Input video frames sent (``stream_video(input_video=...)``); None without one."""
    input_ended: bool = False
    """``input_video.end`` was sent: the whole file went, not cut short by the session's end."""

    @property
    def request_id(self) -> str | None:
        start = self.video_start or self.watch_start
        return start.request_id if start is not None else None

    @property
    def seed(self) -> int | None:
        """The seed the server reports in ``video.start``'s ``config.seed``.

        Only the server's word counts: the point is to reproduce a video, and a seed the
        server did not confirm (the reference echoes only what the client sent) may not
        be the one it used. None when it was not reported.
        """
        start = self.video_start or self.watch_start
        if start is None:
            return None
        seed = start.config.get("seed")
        return seed if isinstance(seed, int) and not isinstance(seed, bool) else None

    @property
    def rejected(self) -> bool:
        """The server refused the session: it ended with an error before ``video.start``
        (for a viewer, before ``watch.start``: ``watch_not_found``, ``server_busy``)."""
        return (
            self.outcome is StreamOutcome.ERROR
            and self.video_start is None
            and self.watch_start is None
        )

    @property
    def media_time(self) -> float | None:
        """Seconds of video delivered: frames / `frame_rate`; None if the rate is unknown.

        Computed as one division of integers, so it is the correctly rounded value and
        compares equal to a decimal time like ``0.3`` that it exactly reaches.
        """
        frames = self.frames
        if frames == 0:
            return 0.0
        rate = self.frame_rate
        if rate is None:
            return None
        return frames * rate.denominator / rate.numerator

    def playback_figures(self) -> dict[str, Any] | None:
        """The viewer's figures as of the end of the session (so far, while it runs),
        for ``--json``; None without a viewer."""
        viewer = self.viewer
        if viewer is None:
            return None
        figures = viewer.figures(self.ended_at if self.ended_at is not None else viewer.clock)
        buffer_seconds = self.request.get("streaming_buffer_seconds")
        return {
            "streaming_buffer_seconds": buffer_seconds,
            "startup_s": viewer.startup_seconds,
            "reports": len(self.playback_sent),
            **figures.summary(),
        }

    @property
    def input_frames(self) -> protocol.InputFrameCounts | None:
        """What the chunks made of the input video, summed: every frame sent ends in one
        chunk's ``used`` or ``dropped``, once the session has used the input up. ``first``
        and ``last`` are the first chunk's and the last chunk's; None when no chunk
        reported input (a session without one)."""
        counts = [
            chunk.metadata.input_frames
            for chunk in self.chunks
            if chunk.metadata is not None and chunk.metadata.input_frames is not None
        ]
        if not counts:
            return None
        return protocol.InputFrameCounts(
            used=sum(c.used for c in counts),
            dropped=sum(c.dropped for c in counts),
            reused=sum(c.reused for c in counts),
            first=counts[0].first,
            last=counts[-1].last,
        )

    @property
    def video(self) -> bytes:
        return b"".join(self.binary_messages)

    @property
    def byte_count(self) -> int:
        return sum(chunk.size for chunk in self.chunks)

    @property
    def frames(self) -> int:
        return sum(chunk.num_frames for chunk in self.chunks)

    @property
    def audio_sample_rate(self) -> int | None:
        """The stream's sound: its samples per second, as ``video.start`` (or a viewer's
        ``watch.start``) announced it; None for a stream without sound."""
        start = self.video_start or self.watch_start
        audio = start.config.get("audio") if start is not None else None
        rate = audio.get("sample_rate") if isinstance(audio, dict) else None
        return rate if isinstance(rate, int) and not isinstance(rate, bool) else None

    @property
    def audio_samples(self) -> int:
        """Samples of sound delivered (each chunk's ``num_audio_samples``); 0 without."""
        return sum(chunk.num_audio_samples for chunk in self.chunks)

    @property
    def time_to_video_start(self) -> float | None:
        """From sending session.start: the server's latency, not the network handshake."""
        return _since(self.start_sent_at, self.video_start_at)

    @property
    def time_to_first_chunk(self) -> float | None:
        return _since(self.start_sent_at, self.first_chunk_at)

    @property
    def connect_time(self) -> float | None:
        return _since(self.started_at, self.start_sent_at)

    @property
    def elapsed(self) -> float | None:
        return _since(self.started_at, self.ended_at)

    @property
    def delivered_fps(self) -> float | None:
        """Frames per second of wall time between ``video.start`` and the last media chunk.

        Starts at ``video.start`` so that the first chunk's generation time counts: this is
        the rate a viewer would have seen, not the network's burst rate.
        """
        span = _since(self.video_start_at, self.last_media_at)
        if not span or span <= 0:
            return None
        return self.frames / span

    def summary(self) -> dict[str, Any]:
        """The JSON-ready summary that ``--json`` prints."""
        error = self.error
        return {
            "url": self.url,
            "watching": self.watching,
            "outcome": self.outcome.value if self.outcome is not None else None,
            "request_id": self.request_id,
            "seed": self.seed,
            "stopped": self.done.stopped if self.done is not None else None,
            "error": None if error is None else {"code": str(error.code), "message": error.message},
            "connect_s": _round(self.connect_time),
            "time_to_video_start_s": _round(self.time_to_video_start),
            "time_to_first_chunk_s": _round(self.time_to_first_chunk),
            "elapsed_s": _round(self.elapsed),
            "frames": self.frames,
            "audio": None
            if self.audio_sample_rate is None
            else {"sample_rate": self.audio_sample_rate, "samples": self.audio_samples},
            "delivered_fps": _round(self.delivered_fps, 2),
            "bytes": self.byte_count,
            "chunks": len(self.chunks),
            "close_code": self.close_code,
            "interactions": [
                {
                    "event_id": record.event_id,
                    "prompt": record.interaction.prompt,
                    "camera": camera_json(record.interaction.camera),
                    "at_s": record.interaction.at,
                    "sent_s": _round(_since(self.video_start_at, record.sent_at)),
                    "sent_media_s": _round(record.sent_media_time),
                    "not_sent": record.not_sent,
                    "queued": record.queued_at is not None,
                    "started_in_chunk": record.started_in_chunk,
                    "error": None
                    if record.error is None
                    else {"code": str(record.error.code), "message": record.error.message},
                }
                for record in self.interactions
            ],
            "playback": self.playback_figures(),
            "input_video": _input_summary(self),
            "problems": list(self.problems),
        }


def _input_summary(result: StreamResult) -> dict[str, Any] | None:
    """The input video's figures for ``--json``: the frames sent, and what the chunks
    reported of them; None when no input video was sent."""
    if result.input_frames_sent is None:
        return None
    counts = result.input_frames
    return {
        "sent": result.input_frames_sent,
        "ended": result.input_ended,
        "used": counts.used if counts is not None else 0,
        "dropped": counts.dropped if counts is not None else 0,
        "reused": counts.reused if counts is not None else 0,
    }


def _since(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return end - start


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)
