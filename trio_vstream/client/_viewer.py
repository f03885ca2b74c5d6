"""`PlaybackViewer`: a simulated real-time viewer, pure (fed the time, never reads a clock).

A person does not watch chunks arrive: they watch a playhead that moves at 1x through
what has arrived, and stops, waiting, when it runs out. Figures taken from arrivals
alone (frames per second, inter-arrival) do not say whether the video played smoothly;
this model turns the arrivals into what the person saw, and says what a client of
vllm-omni's paced protocol reports back (``session.playback``):

* the playhead starts once ``startup_seconds`` of media are buffered (0: at the first
  frame). A startup threshold must stay below ``streaming_buffer_seconds``, or a paced
  server stops generating before the viewer starts, and both wait for ever
  (`check_startup` says so before a session starts);
* it then advances at 1x while media is buffered, and stalls at the end of what has
  arrived: an *underrun*, which lasts until the next chunk arrives (a player resumes
  as soon as it has a frame to show; chunks are whole, so that is a chunk's worth);
* it reports the real playhead, never advanced past what is buffered to hide a stall
  (vllm-omni's rule), every ``report_interval`` seconds while it moves; a stalled
  playhead has nothing new to say;
* once the stream has ended, running out of media is the end of the video, not a stall.

It is sans-IO in the way `trio_vstream.protocol.ClientProtocol` is: `receive`, `end`
and `report` take the time now, so the client (`stream_video`), the benchmark and the
tests drive it with Trio's clock, recorded timestamps, or a table of numbers. Time
never runs backwards here: a time earlier than one already seen is taken as that one.
"""

from __future__ import annotations

import math
from typing import Any, Final

import attrs

__all__ = ["DEFAULT_REPORT_INTERVAL", "PlaybackViewer", "ViewerFigures", "check_startup"]

#: vllm-omni's player reports its playhead about this often (seconds).
DEFAULT_REPORT_INTERVAL: Final = 0.1


def check_startup(startup_seconds: float, buffer_seconds: float | None) -> None:
    """Refuse a startup threshold the paced server could never let the viewer reach.

    The server stops generating once ``buffer_seconds`` of media are ahead of the last
    reported playhead (0 before any report), so a viewer that waits for that much before
    it starts waits for ever. Raises `ValueError`; None (unpaced) allows any threshold.
    """
    if not math.isfinite(startup_seconds) or startup_seconds < 0:
        raise ValueError(f"the startup threshold must be >= 0 seconds, got {startup_seconds}")
    if buffer_seconds is not None and startup_seconds >= buffer_seconds:
        raise ValueError(
            f"the startup threshold ({startup_seconds:g} s) must stay below the "
            f"generation window (streaming_buffer_seconds {buffer_seconds:g} s)"
        )


@attrs.frozen(kw_only=True)
class ViewerFigures:
    """What the simulated viewer saw, up to the time they were taken."""

    time_to_first_frame: float | None
    """Seconds from ``started_at`` (``session.start`` sent) to the playhead starting;
    None if it has not started."""
    underruns: int
    """Times the playhead caught up with the media received before the stream ended."""
    stall_seconds: float
    """Wall time spent waiting in those underruns."""
    play_seconds: float
    """Wall time the playhead moved (= media seconds shown)."""
    chunks: int
    """Media chunks received."""
    late_chunks: int
    """Chunks that arrived after the playhead had already reached them (it was stalled)."""
    position: float
    """The playhead, in media seconds."""
    buffered: float
    """Media seconds received."""

    @property
    def continuous_play_ratio(self) -> float | None:
        """Share of wall time after the start spent playing rather than waiting (1.0:
        never stalled); None before the playhead has moved or stalled."""
        total = self.play_seconds + self.stall_seconds
        return self.play_seconds / total if total > 0 else None

    @property
    def on_time_share(self) -> float | None:
        """Share of chunks that arrived before the playhead needed them; None with none.
        Chunks that arrive before the start are on time: they are the startup buffer."""
        return (self.chunks - self.late_chunks) / self.chunks if self.chunks else None

    def summary(self) -> dict[str, Any]:
        """The JSON-ready figures (``--json``'s ``playback``)."""
        return {
            "time_to_first_frame_s": _round(self.time_to_first_frame),
            "underruns": self.underruns,
            "stall_s": round(self.stall_seconds, 4),
            "play_s": round(self.play_seconds, 4),
            "continuous_play_ratio": _round(self.continuous_play_ratio),
            "chunks": self.chunks,
            "chunks_on_time": self.chunks - self.late_chunks,
            "on_time_share": _round(self.on_time_share),
            "position_s": round(self.position, 4),
            "buffered_s": round(self.buffered, 4),
        }


class PlaybackViewer:
    """One session's simulated viewer; see the module docstring for the model.

    Feed it `receive` for every media chunk (its media seconds: frames / fps) and `end`
    when the stream ends; ask `report` when `next_report_at` comes, and `figures` at
    any time. Every method takes the time now, on the caller's clock.
    """

    def __init__(
        self,
        started_at: float,
        *,
        startup_seconds: float = 0.0,
        report_interval: float = DEFAULT_REPORT_INTERVAL,
    ) -> None:
        check_startup(startup_seconds, None)
        if not math.isfinite(report_interval) or report_interval <= 0:
            raise ValueError(f"the report interval must be > 0 seconds, got {report_interval}")
        self.started_at = started_at
        self.startup_seconds = startup_seconds
        self.report_interval = report_interval
        self.clock = started_at
        """The latest time seen; the state below is as of this time."""
        self.buffered = 0.0
        self.position = 0.0
        self.play_started_at: float | None = None
        self.stalled_since: float | None = None
        self.ended = False
        self.underruns = 0
        self.stall_seconds = 0.0
        self.play_seconds = 0.0
        self.chunks = 0
        self.late_chunks = 0
        self.next_report_at: float | None = None
        """When the next report is due; None until the playhead starts."""
        self.last_reported: float | None = None

    @property
    def playing(self) -> bool:
        """Started, not stalled, and not at the end of an ended stream."""
        return (
            self.play_started_at is not None
            and self.stalled_since is None
            and not (self.ended and self.position >= self.buffered)
        )

    def advance(self, now: float) -> None:
        """Move the playhead to ``now``: at 1x while media lasts, then stalled (or, after
        the end of the stream, finished)."""
        now = max(now, self.clock)
        elapsed, self.clock = now - self.clock, now
        if self.play_started_at is None or elapsed == 0:
            return
        if self.stalled_since is not None:
            self.stall_seconds += elapsed
            return
        ahead = self.buffered - self.position
        if elapsed <= ahead:
            self.position += elapsed
            self.play_seconds += elapsed
            return
        # The playhead reaches the end of what has arrived within this step.
        self.position = self.buffered
        self.play_seconds += ahead
        if not self.ended:
            self.stalled_since = now - (elapsed - ahead)
            self.underruns += 1
            self.stall_seconds += elapsed - ahead

    def receive(self, now: float, media_seconds: float) -> None:
        """A media chunk of ``media_seconds`` arrived at ``now``.

        Late when the playhead was already waiting for it; it ends that stall. The
        playhead starts (and reports are scheduled) once ``startup_seconds`` of media
        are buffered.
        """
        if not math.isfinite(media_seconds) or media_seconds <= 0:
            raise ValueError(f"a media chunk lasts > 0 seconds, got {media_seconds}")
        self.advance(now)
        self.chunks += 1
        if self.stalled_since is not None:
            self.late_chunks += 1
            self.stalled_since = None
        self.buffered += media_seconds
        if self.play_started_at is None and self.buffered >= self.startup_seconds:
            self._start()

    def end(self, now: float) -> None:
        """The stream ended (a terminal message, or the connection closed): no more
        media will come. A viewer that never reached its startup threshold plays what
        it has; a stall in progress ends here."""
        self.advance(now)
        self.ended = True
        self.stalled_since = None
        if self.play_started_at is None and self.buffered > 0:
            self._start()

    def _start(self) -> None:
        self.play_started_at = self.clock
        self.next_report_at = self.clock + self.report_interval

    def report(self, now: float) -> float | None:
        """The position to send in ``session.playback`` now, or None when no report is
        due: before the start, before `next_report_at`, or when the playhead has not
        moved since the last report (stalled, or at the end of the video).

        The position is the real playhead, which never runs past what has arrived. A
        report that comes late (the caller's loop was busy) does not make the next ones
        bunch up: they go on every ``report_interval`` from the late one.
        """
        self.advance(now)
        due = self.next_report_at
        if due is None or self.clock < due:
            return None
        following = due + self.report_interval
        self.next_report_at = (
            following if following > self.clock else (self.clock + self.report_interval)
        )
        if self.last_reported is not None and self.position <= self.last_reported:
            return None
        self.last_reported = self.position
        return self.position

    def reaches_at(self, position: float) -> float | None:
        """When the playhead reaches ``position`` if it plays on: the time it is at now if
        it is there already; None when it is not playing, or ``position`` lies beyond what
        has arrived (it cannot be known before more media comes)."""
        if self.position >= position:
            return self.clock
        if not self.playing or position > self.buffered:
            return None
        return self.clock + (position - self.position)

    @property
    def played_out_at(self) -> float | None:
        """When the playhead reaches the end of an ended stream that started; None before
        the end, or when it never started. Benchmarks take the figures then: what a
        viewer who watched to the end saw."""
        if not self.ended or self.play_started_at is None:
            return None
        return self.clock + (self.buffered - self.position)

    def figures(self, now: float) -> ViewerFigures:
        """The figures as of ``now`` (the playhead is advanced to it first)."""
        self.advance(now)
        started = self.play_started_at
        return ViewerFigures(
            time_to_first_frame=None if started is None else started - self.started_at,
            underruns=self.underruns,
            stall_seconds=self.stall_seconds,
            play_seconds=self.play_seconds,
            chunks=self.chunks,
            late_chunks=self.late_chunks,
            position=self.position,
            buffered=self.buffered,
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
