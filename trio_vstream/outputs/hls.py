"""Low-Latency HLS: a session's own fragments, as parts and segments any HTTP cache can fan out.

A watch link serves a few viewers over WebSockets; a large audience needs plain HTTP
GETs that a cache answers for everyone. `HlsWindow` is a session tap
(`trio_vstream.outputs.taps`) that keeps the end of the stream as a Low-Latency media
playlist (RFC 8216bis: draft-pantos-hls-rfc8216bis, whose recent drafts' sections are
named below) and answers the GETs for it (`HlsWindow.respond`); the server routes them
and expires the window. Nothing is re-encoded or re-muxed: every chunk the encoder made
is already one ``moof``+``mdat`` that begins with an IDR frame
(`trio_vstream.media.encoding`), which is what a part is.

What is served, relative to the playlist's own URL (so the window needs no prefix):

* ``index.m3u8``: the media playlist (``_HLS_msn``/``_HLS_part``: a blocking reload).
* ``init.mp4``: the init segment (``ftyp``+``moov``), the playlist's ``EXT-X-MAP``. The
  first chunk's binary message begins with it; the part made of that chunk does not.
* ``part/<msn>.<index>.m4s``: one part, byte for byte one chunk's binary message (one
  ``EXT-X-PART``, ``INDEPENDENT=YES`` when the fragment begins with a sync sample, as
  every chunk of ours does). Sound, when the stream has it, is inside the fragments.
* ``seg/<msn>.m4s``: one whole segment, its parts' bytes one after the other.

Names are matched against an allow-list (decimal numbers without leading zeros, so
that each resource has one URL and one cache entry); anything else is 404.

Durations are exact: a part lasts its chunk's ``num_frames / fps`` (kept as fractions,
so that segments add up without drift; written as the nearest double). The
``PART-TARGET`` and ``TARGETDURATION`` are fixed when the window is made, because RFC
8216bis §6.2.1 lists every change a server may make to a playlist, and changing either
is not one of them. So the caller says how long a chunk of this session can be
(``max_part_seconds``: an engine's frames per chunk over the fps), and:

* ``PART-TARGET`` is that, rounded up to the millisecond; ``PART-HOLD-BACK`` is three
  times it (§4.4.3.8's SHOULD).
* Segments are whole parts, at most ``segment_seconds`` long (a segment is closed as
  soon as another part as long as its last one would not fit, so that a segment is
  listed the moment its last part exists, and the preload hint can name the next
  part's place). ``TARGETDURATION`` is the whole number of seconds at or above both
  ``segment_seconds`` and ``PART-TARGET``: no segment ever exceeds it, rounded or not.
* An engine whose chunks vary in length: a chunk that would take its segment past
  ``segment_seconds`` starts the next one (the part the hint named is then not
  published, which §6.2.6 allows; a request for it is 404).
* A chunk longer than ``PART-TARGET`` (the caller's promise was wrong) cannot be a
  part: a part MUST NOT exceed ``PART-TARGET`` (§4.4.4.9), and it cannot be split,
  since a part is whole fragments. It becomes a segment of its own, listed without
  ``EXT-X-PART`` tags (a segment need not have parts), if it fits ``TARGETDURATION``;
  if it does not even fit that, it is listed as an ``EXT-X-GAP`` segment of its
  duration (§6.2.1: missing media is a gap) and its bytes are not served. Either way
  the playlist stays valid and its timeline right (the next fragments' decode times
  follow on), and a warning is logged.

The encoder's trailer (a ``kind: "trailer"`` chunk: an ``mfra`` index, and with sound a
fragment without video holding the AAC frames the encoder still held) is not served: an
index box has no place in a media segment, and a fragment of no video frames would be a
part of no duration. HLS viewers of a completed stream with sound miss that end of its
audio (under three AAC frames: 64 ms at 48 kHz), as every client of a stopped session
does.

The window: the playlist lists the last ``window_segments`` whole segments (more if
those last less than three target durations: §6.2.2 forbids a shorter live playlist),
and ``EXT-X-PART`` tags only for the segments that begin within three target durations
of its end (§6.2.2's SHOULD; further when ``PART-HOLD-BACK`` needs it). Older segments
leave it (``EXT-X-MEDIA-SEQUENCE`` advances) and are still served for two segments
more, so that a segment stays available for its own duration and a playlist's after
it was listed (§6.2.2's availability duration); then their bytes are let go (404).
A part's bytes are the chunk's own ``bytes`` (the ones the session sent, shared, not
copied; the first chunk's less its init segment), and a segment's are joined on
request, so the window holds each chunk once.
The window counts media, not wall time: an engine much faster than real time moves it
faster than viewers play (a paced session, ``pace_to_media_time``, does not).

``EXT-X-PROGRAM-DATE-TIME`` on each segment is the wall-clock time (``clock``) its first
part arrived, but never before the previous segment's date plus its duration: a burst
of chunks would otherwise map two segments to one date, which §6.2.1 forbids.

Blocking reload (§6.2.5.2), the LL-HLS way to wait for the next part without polling:

* ``_HLS_msn=M``: answered once segment M is complete; with ``_HLS_part=N``, once part
  N of segment M, or anything after it, exists (a part index past a complete segment's
  last is part 0 of the next, as §6.2.5.2 says; a segment without parts counts as its
  part 0). Answered at once when that is already so, however long ago.
* ``_HLS_msn`` past the last complete segment plus two, or ``_HLS_part`` past the last
  part by more than the Advance Part Limit (3 / PART-TARGET parts, or 3 when
  PART-TARGET is a second or more): 400 at once. ``_HLS_part`` without ``_HLS_msn``:
  400. Numbers that are not plain decimal digits (at most ten): 400.
* Waiting more than three target durations: 503 (§6.2.5.2's SHOULD). The session
  ending while a request waits answers it with the final playlist, and once the
  playlist has ``EXT-X-ENDLIST`` the directives are ignored (§6.2.5.2's MUST).
* ``_HLS_skip`` is ignored: no ``CAN-SKIP-UNTIL`` is offered (§6.2.5.1 says to ignore it).
* The part named by ``EXT-X-PRELOAD-HINT`` is "available for request" (§6.2.6): a GET
  for it waits, like a blocking reload, until it exists (then its bytes), the hint
  moves past it without it (404), the session ends (404) or three target durations
  pass (503). Any other part not in the window is 404 at once.

Cache headers, so that a cache in front of many viewers answers nearly everything:

* The init segment, parts and segments never change at their URL (a URL names one
  session's one place in its stream): ``public, max-age=31536000, immutable``, with a
  strong ``ETag`` made of a random tag of this window and the resource's place.
* A plain playlist (a player's first load): ``max-age`` of a part's duration in whole
  seconds, and at least 1. A crowd joining at once then costs the server one request a
  second, not one each (a cache does not keep ``max-age=0``, and nginx's cache lock
  would pass such requests on one at a time). A second-old playlist is still a good
  place to join: the player's next request is a blocking reload for the part after
  its last, which comes as soon as that part exists.
* A blocking reload's answer: the playlist at that point of the stream, which a cache
  may give to whoever asks the same query for ``ceil(PART-HOLD-BACK)`` seconds (a
  player asks for the part after the last it saw, so duplicates come from players a
  part or two behind). Its live edge, where a player starts (PART-HOLD-BACK from the
  end), is still served long after that: the window keeps at least three target
  durations and two segments more.
* After the session ended the playlist no longer changes: ``max-age`` is the time left
  until the window expires (``HlsSettings.linger`` after ``ended_at``, trio time; the
  caller drops the window then, and until it does, every answer is 404).
* Errors (400, 404, 503) are ``no-store``: a part that is 404 now may exist in a moment.

What the RFC asks that this window cannot promise: a new part within one PART-TARGET
and a new segment within 1.5 target durations of the last (§6.2.1) depend on the engine
keeping up with real time.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from fractions import Fraction
from typing import Final

import attrs
import m3u8
import trio

from trio_vstream import protocol
from trio_vstream.logsafe import get_logger
from trio_vstream.media.fmp4 import fragment_starts_with_keyframe

__all__ = ["HlsResponse", "HlsSettings", "HlsWindow"]

logger = get_logger(__name__)

_PLAYLIST_TYPE: Final = "application/vnd.apple.mpegurl"
_MEDIA_TYPE: Final = "video/mp4"
_TEXT_TYPE: Final = "text/plain; charset=utf-8"

FIRST_MSN: Final = 1
"""The first segment's media sequence number. 1, not 0: hls.js 1.6 takes a playlist
whose last segment is number 0 for one it cannot block on (it tests the number for
truth), and so polls instead of holding a blocking reload, which left a viewer who
joined in a stream's first seconds 4 s behind, not 1. The RFC allows any start."""

_IMMUTABLE: Final = "public, max-age=31536000, immutable"
_NO_STORE: Final = "no-store"
_VERSION: Final = 6
"""``EXT-X-MAP`` in a playlist of media segments needs version 6; nothing here needs more
(§6.2.1: the version SHOULD NOT be higher than the playlist needs)."""
_GRACE_SEGMENTS: Final = 2
"""Segments still served after they leave the playlist (see the module's docstring)."""
_MAX_PART_SECONDS: Final = 60.0
"""The longest ``max_part_seconds`` taken: chunks are seconds long, not minutes."""

# Names and numbers from the network: ASCII digits only ([0-9], never \d, which takes
# any script's digits), bounded lengths, so that int() is always small and cheap.
_PART_NAME: Final = re.compile(r"part/(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.m4s")
_SEGMENT_NAME: Final = re.compile(r"seg/(0|[1-9][0-9]{0,8})\.m4s")
_DIRECTIVE: Final = re.compile(r"[0-9]{1,10}")
_MAX_NAME_CHARS: Final = 40


def _positive_finite(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


@attrs.frozen(kw_only=True)
class HlsSettings:
    """How a session's HLS window is cut and how long it is kept."""

    segment_seconds: float = attrs.field(default=2.0, validator=_positive_finite)
    """The longest segment (whole parts, so often a little less). Two seconds: with our
    chunks of a third of a second to a second, a segment holds two to six parts, which is
    what LL-HLS is for; the target duration it makes (2) keeps a plain HLS player's
    latency (three target durations) and a blocking reload's longest wait (the same) at
    six seconds, and a segment small enough that a non-LL player starts quickly. Longer
    segments would give a slow engine more slack to publish each one in time (§6.2.1
    asks for one every 1.5 target durations), at the cost of all of that."""
    window_segments: int = attrs.field(
        default=6, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)]
    )
    """Whole segments the playlist lists (about 12 seconds by default): how far back a
    viewer may start or fall behind. At least three target durations are always listed."""
    linger: float = attrs.field(default=60.0, validator=attrs.validators.ge(0.0))
    """Seconds the window stays readable after the session ended, so that viewers play
    out what they have not fetched yet; then it answers 404 and its owner drops it."""


@attrs.frozen
class HlsResponse:
    """What to answer a GET with: the server writes it as it is."""

    status: int
    body: bytes
    headers: dict[str, str]
    """Cache-Control, and an ETag for what never changes (Content-Type is apart)."""
    content_type: str


@attrs.define
class _Part:
    data: bytes
    duration: Fraction
    independent: bool


@attrs.define
class _Segment:
    msn: int
    parts: list[_Part] = attrs.field(factory=list)
    duration: Fraction = Fraction(0)
    date: float = 0.0
    """Wall-clock seconds of its first media (``EXT-X-PROGRAM-DATE-TIME``)."""
    whole: bytes | None = None
    """A segment of one chunk too long to be a part: its bytes, listed without parts."""
    gap: bool = False
    """A chunk too long even for a segment: listed as ``EXT-X-GAP``, not served."""

    def body(self) -> bytes:
        return self.whole if self.whole is not None else b"".join(p.data for p in self.parts)


class _Timeline:
    """The playlist's state and rules, sans-IO: chunks in, the playlist and bytes out.

    Segments are numbered from 0 (their Media Sequence Numbers); ``open`` is the segment
    being filled (it has parts, or none yet), every segment before it is complete.
    """

    def __init__(
        self,
        *,
        part_target: Fraction,
        segment_seconds: Fraction,
        target_duration: int,
        window_segments: int,
    ) -> None:
        self.part_target = part_target
        self.segment_seconds = segment_seconds
        self.target_duration = target_duration
        self.window_segments = window_segments
        self.part_hold_back = 3 * part_target
        self.advance_part_limit = 3 / part_target if part_target < 1 else Fraction(3)
        self.segments: deque[_Segment] = deque()
        """Complete segments still served: listed from ``media_sequence`` on."""
        self.media_sequence = FIRST_MSN
        self.open = _Segment(FIRST_MSN)
        self.last: tuple[int, int] | None = None
        """The place of the newest media: (msn, part index); a segment without parts is
        at its part 0."""
        self.last_complete = FIRST_MSN - 1
        self._next_date = -math.inf
        """The earliest date the next segment may have (the last one's end)."""

    # ------------------------------------------------------------------- chunks in

    def add(self, data: bytes, duration: Fraction, independent: bool, now: float) -> str:
        """Publish one chunk: ``"part"``, ``"segment"`` (too long for a part) or ``"gap"``
        (too long for a segment: not served)."""
        if duration > self.part_target:
            self.close()
            segment = self.open
            segment.duration, segment.date = duration, max(now, self._next_date)
            if duration <= self.target_duration:
                segment.whole = data
            else:
                segment.gap = True
            self.last = (segment.msn, 0)
            self._complete()
            return "gap" if segment.gap else "segment"
        if self.open.parts and self.open.duration + duration > self.segment_seconds:
            self.close()  # a longer chunk than the last: it starts the next segment
        segment = self.open
        if not segment.parts:
            segment.date = max(now, self._next_date)
        segment.parts.append(_Part(data, duration, independent))
        segment.duration += duration
        self.last = (segment.msn, len(segment.parts) - 1)
        if segment.duration + duration > self.segment_seconds:
            self.close()  # another part like this one would not fit
        return "part"

    def close(self) -> None:
        """Complete the open segment, if it has parts (at a size limit, or the end)."""
        if self.open.parts:
            self._complete()

    def _complete(self) -> None:
        segment = self.open
        self.segments.append(segment)
        self.last_complete = segment.msn
        self._next_date = segment.date + float(segment.duration)
        self.open = _Segment(segment.msn + 1)
        self._slide()

    def _slide(self) -> None:
        """Move the window's start on past the segments it no longer needs to list."""
        listed = [s for s in self.segments if s.msn >= self.media_sequence]
        listed_duration = sum((s.duration for s in listed), Fraction(0))
        minimum = 3 * self.target_duration  # §6.2.2: a live playlist's shortest duration
        while len(listed) > self.window_segments and (
            listed_duration - listed[0].duration >= minimum
        ):
            listed_duration -= listed.pop(0).duration
            self.media_sequence += 1
        while self.segments and self.segments[0].msn < self.media_sequence - _GRACE_SEGMENTS:
            self.segments.popleft()

    # ------------------------------------------------------------------ questions

    @property
    def hint(self) -> tuple[int, int]:
        """Where the next part will be, if the next chunk makes one that fits."""
        return (self.open.msn, len(self.open.parts))

    def part(self, msn: int, index: int) -> bytes | None:
        segment = self._held(msn)
        if segment is None or index >= len(segment.parts):
            return None
        return segment.parts[index].data

    def segment(self, msn: int) -> bytes | None:
        segment = self._held(msn)
        if segment is None or segment is self.open or segment.gap:
            return None
        return segment.body()

    def _held(self, msn: int) -> _Segment | None:
        if msn == self.open.msn:
            return self.open
        if self.segments and self.segments[0].msn <= msn <= self.last_complete:
            return self.segments[msn - self.segments[0].msn]
        return None

    def has(self, msn: int, part: int | None) -> bool:
        """Whether a blocking reload for ``_HLS_msn=msn`` (and ``_HLS_part=part``) can be
        answered (RFC 8216bis §6.2.5.2)."""
        if part is None:
            return self.last_complete >= msn
        return self.last is not None and (msn, part) <= self.last

    def too_far(self, msn: int, part: int | None) -> bool:
        """RFC 8216bis §6.2.5.2: a server SHOULD answer 400 at once when ``_HLS_msn`` is
        greater than the last Media Segment's number plus two, or ``_HLS_part`` exceeds
        the last Partial Segment by more than the Advance Part Limit."""
        if msn > self.last_complete + 2:
            return True
        if part is None:
            return False
        last_msn, last_part = self.last if self.last is not None else (self.open.msn, -1)
        if msn < last_msn:
            return False
        # In a later segment than the last part, at least part + 1 parts away.
        ahead = part - last_part if msn == last_msn else part + 1
        return ahead > self.advance_part_limit

    # ---------------------------------------------------------------- playlist out

    def render(self, *, init: bool, ended: bool) -> str:
        playlist = m3u8.M3U8()
        playlist.version = str(_VERSION)
        playlist.target_duration = self.target_duration
        playlist.media_sequence = self.media_sequence
        playlist.server_control = m3u8.ServerControl(
            can_block_reload="YES", part_hold_back=float(self.part_hold_back)
        )
        playlist.part_inf = m3u8.PartInformation(part_target=float(self.part_target))
        shown = [s for s in self.segments if s.msn >= self.media_sequence]
        if self.open.parts:
            shown.append(self.open)
        # EXT-X-PART tags for the segments that begin within three target durations of
        # the end (§6.2.2), or PART-HOLD-BACK and a segment where that is longer.
        edge = max(Fraction(3 * self.target_duration), self.part_hold_back + self.target_duration)
        from_end = Fraction(0)
        with_parts: set[int] = set()
        for segment in reversed(shown):
            from_end += segment.duration
            if from_end > edge and with_parts:
                break
            with_parts.add(segment.msn)
        for segment in shown:
            complete = segment is not self.open
            entry = m3u8.Segment(
                uri=f"seg/{segment.msn}.m4s" if complete else None,
                duration=float(segment.duration) if complete else None,
                program_date_time=datetime.fromtimestamp(segment.date, UTC),
                init_section={"uri": "init.mp4"} if init else None,
            )
            entry.gap_tag = True if segment.gap else None  # EXT-X-GAP
            if segment.msn in with_parts:
                for index, part in enumerate(segment.parts):
                    entry.add_part(
                        m3u8.PartialSegment(
                            "",
                            f"part/{segment.msn}.{index}.m4s",
                            float(part.duration),
                            independent="YES" if part.independent else None,
                        )
                    )
            playlist.add_segment(entry)
        if ended:
            playlist.is_endlist = True
        else:
            msn, index = self.hint
            playlist.preload_hint = m3u8.PreloadHint("PART", None, f"part/{msn}.{index}.m4s")
        return str(playlist.dumps())


def _part_target(max_part_seconds: float) -> Fraction:
    """``max_part_seconds`` rounded up to the millisecond, after the float's own noise is
    rounded off (8/24 computed in floats is read as 0.334, not 0.335)."""
    return Fraction(math.ceil(round(max_part_seconds * 1000, 6)), 1000)


class HlsWindow:
    """One session's LL-HLS playlist and the bytes it names: a `SessionTap` that answers
    HTTP GETs (`respond`). The tap's methods run on the event loop and never wait."""

    def __init__(
        self,
        settings: HlsSettings,
        *,
        max_part_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``max_part_seconds``: the longest chunk this session can send (an engine's
        frames per chunk over the fps); it fixes PART-TARGET for the session's life.
        ``clock``: wall-clock seconds, for ``EXT-X-PROGRAM-DATE-TIME``."""
        if not (
            isinstance(max_part_seconds, int | float)
            and math.isfinite(max_part_seconds)
            and 0 < max_part_seconds <= _MAX_PART_SECONDS
        ):
            raise ValueError(
                f"max_part_seconds must be in (0, {_MAX_PART_SECONDS}], got {max_part_seconds!r}"
            )
        self.settings = settings
        self._clock = clock
        part_target = _part_target(max_part_seconds)
        segment_seconds = Fraction(settings.segment_seconds)
        target_duration = max(1, math.ceil(max(segment_seconds, part_target)))
        self._timeline = _Timeline(
            part_target=part_target,
            segment_seconds=segment_seconds,
            target_duration=target_duration,
            window_segments=settings.window_segments,
        )
        self._blocking_timeout = 3.0 * target_duration
        """§6.2.5.2: a server that cannot answer after three target durations SHOULD
        answer 503."""
        self._tag = secrets.token_hex(8)
        """In every ETag, beside the resource's place: a place never names other bytes
        in this window, and the random tag keeps another window's ETags apart (it says
        nothing of the session, unlike a watch token)."""
        self._fps: int | None = None
        self._request_id: str | None = None
        self._init = b""
        self._warned_no_init = False
        self._changed = trio.Event()
        """Set and replaced whenever the playlist changes: what blocked requests wait on."""
        self._ended_at: float | None = None

    @property
    def ended_at(self) -> float | None:
        """When the session ended (`trio.current_time`), or None while it runs. The
        window expires ``settings.linger`` seconds later."""
        return self._ended_at

    def playlist(self) -> str:
        """The media playlist as it stands now (what a plain ``index.m3u8`` GET gets)."""
        return self._timeline.render(init=bool(self._init), ended=self._ended_at is not None)

    # ------------------------------------------------------------- the session's side

    def started(self, video_start: protocol.VideoStart, start: protocol.SessionStart) -> None:
        self._request_id = video_start.request_id
        self._fps = start.video.fps

    def chunk(self, metadata: protocol.ChunkMetadata, data: bytes, init_segment: bytes) -> None:
        if self._ended_at is not None or self._fps is None:
            return
        if metadata.kind != "media" or metadata.num_frames < 1:
            return  # the encoder's trailer (the module's docstring says why)
        if init_segment and not self._init:
            self._init = init_segment
        if not self._init:
            if not self._warned_no_init:
                self._warned_no_init = True
                logger.warning("session %s: no init segment; HLS has no media", self._request_id)
            return
        if data.startswith(self._init):
            data = data[len(self._init) :]  # the first chunk's: EXT-X-MAP has it
        duration = Fraction(metadata.num_frames, self._fps)
        made = self._timeline.add(
            data, duration, fragment_starts_with_keyframe(data), self._clock()
        )
        if made != "part":
            logger.warning(
                "session %s: chunk %d lasts %.3f s, more than the %.3f s PART-TARGET; "
                "HLS lists it as a %s",
                self._request_id,
                metadata.transport_chunk_index,
                float(duration),
                float(self._timeline.part_target),
                "segment of its own" if made == "segment" else "gap (too long for a segment)",
            )
        self._wake()

    def interaction(
        self, event_id: str, message: protocol.Interaction, error: protocol.Error | None
    ) -> None:
        """Not in the playlist: viewers see an interaction's effect in the video."""

    def interaction_refused(self, event_id: str, error: protocol.Error) -> None:
        """Nor is a refused one, which has no effect to see."""

    def ended(self, outcome: str, terminal: protocol.SessionDone | protocol.Error | None) -> None:
        if self._ended_at is not None:
            return
        self._timeline.close()
        self._ended_at = trio.current_time()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # ---------------------------------------------------------------- the GETs' side

    async def respond(self, resource: str, query: Mapping[str, str]) -> HlsResponse:
        """The answer to a GET of ``resource`` (a path relative to the playlist's URL)
        with ``query`` (its parameters). Waits only for a blocking reload or the hinted
        part, at most three target durations; never raises for what a client sends."""
        if self._expired() or len(resource) > _MAX_NAME_CHARS:
            return _error(404, "not found")
        if resource == "index.m3u8":
            return await self._playlist(query)
        if resource == "init.mp4":
            if not self._init:
                return _error(404, "no init segment yet")
            return self._immutable(self._init, "init")
        if match := _PART_NAME.fullmatch(resource):
            return await self._part(int(match[1]), int(match[2]))
        if match := _SEGMENT_NAME.fullmatch(resource):
            body = self._timeline.segment(int(match[1]))
            if body is None:
                return _error(404, "no such segment in the window")
            return self._immutable(body, f"s{match[1]}")
        return _error(404, "not found")

    def _expired(self) -> bool:
        ended = self._ended_at
        return ended is not None and trio.current_time() >= ended + self.settings.linger

    async def _playlist(self, query: Mapping[str, str]) -> HlsResponse:
        directives = _directives(query)
        if isinstance(directives, str):
            return _error(400, directives)
        if self._ended_at is not None:  # §6.2.5.2: with EXT-X-ENDLIST, directives are ignored
            return self._playlist_answer()
        msn, part = directives
        if msn is None:
            if part is not None:  # §6.2.5.2: MUST answer 400
                return _error(400, "_HLS_part needs _HLS_msn")
            return self._playlist_answer()
        timeline = self._timeline
        if timeline.too_far(msn, part):
            return _error(400, "_HLS_msn or _HLS_part is too far ahead of the stream")
        deadline = trio.current_time() + self._blocking_timeout
        while not timeline.has(msn, part) and self._ended_at is None:
            if trio.current_time() >= deadline:
                return _error(503, "the stream did not get there in time")
            changed = self._changed
            with trio.move_on_at(deadline):
                await changed.wait()
        return self._playlist_answer(blocking=True)

    def _playlist_answer(self, *, blocking: bool = False) -> HlsResponse:
        if self._ended_at is not None:
            left = self._ended_at + self.settings.linger - trio.current_time()
            max_age = max(0, math.floor(left))
        elif blocking:
            max_age = math.ceil(self._timeline.part_hold_back)
        else:
            max_age = max(1, math.floor(self._timeline.part_target))
        return HlsResponse(
            200,
            self.playlist().encode(),
            {"Cache-Control": f"public, max-age={max_age}"},
            _PLAYLIST_TYPE,
        )

    async def _part(self, msn: int, index: int) -> HlsResponse:
        """A part's bytes; the hinted one (§6.2.6) once it exists, else 404 at once."""
        deadline = trio.current_time() + self._blocking_timeout
        while (data := self._timeline.part(msn, index)) is None:
            if self._ended_at is not None or self._timeline.hint != (msn, index):
                return _error(404, "no such part in the window")
            if trio.current_time() >= deadline:
                return _error(503, "the hinted part did not come in time")
            changed = self._changed
            with trio.move_on_at(deadline):
                await changed.wait()
        return self._immutable(data, f"p{msn}.{index}")

    def _immutable(self, body: bytes, name: str) -> HlsResponse:
        headers = {"Cache-Control": _IMMUTABLE, "ETag": f'"{self._tag}-{name}"'}
        return HlsResponse(200, body, headers, _MEDIA_TYPE)


def _directives(query: Mapping[str, str]) -> tuple[int | None, int | None] | str:
    """``_HLS_msn`` and ``_HLS_part`` as numbers (None when absent), or why they are not."""
    numbers: list[int | None] = []
    for name in ("_HLS_msn", "_HLS_part"):
        raw = query.get(name)
        if raw is None:
            numbers.append(None)
        elif isinstance(raw, str) and _DIRECTIVE.fullmatch(raw):
            numbers.append(int(raw))
        else:
            return f"{name} must be a decimal integer of at most ten digits"
    return numbers[0], numbers[1]


def _error(status: int, text: str) -> HlsResponse:
    return HlsResponse(status, text.encode() + b"\n", {"Cache-Control": _NO_STORE}, _TEXT_TYPE)
