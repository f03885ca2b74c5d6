"""The LL-HLS window without sockets: the playlist it writes (read back with m3u8), the
bytes it serves, blocking reloads, its sliding window and what hostile requests get.
Chunks are real fMP4 from the encoder; expected values come from the chunks' frame
counts, the settings and RFC 8216bis, never from the window's own output."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any

import m3u8
import numpy as np
import pytest
import trio
import trio.testing

from tests.conftest import decode_video
from trio_vstream import protocol
from trio_vstream.media.encoding import FragmentedMP4Encoder
from trio_vstream.outputs.hls import FIRST_MSN, HlsResponse, HlsSettings, HlsWindow

FPS = 24
FRAMES = 8  # a third of a second per chunk
SIZE = (64, 48)
T0 = 1_700_000_000.0


def encode(frame_counts: Sequence[int], seed: int = 0) -> tuple[bytes, list[bytes], bytes]:
    """(init segment, one binary message per chunk as the session sends it, trailer)."""
    width, height = SIZE
    encoder = FragmentedMP4Encoder(width=width, height=height, fps=FPS)
    rng = np.random.default_rng(seed)
    chunks = [
        encoder.encode(rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8))
        for count in frame_counts
    ]
    init = encoder.init_segment
    assert init is not None
    return init, chunks, encoder.close()


INIT, CHUNKS, TRAILER = encode([FRAMES] * 24)


def metadata(index: int, data: bytes, frames: int, kind: str = "media") -> protocol.ChunkMetadata:
    return protocol.ChunkMetadata(
        request_id="r1",
        kind=kind,  # type: ignore[arg-type]
        num_frames=frames,
        byte_length=len(data),
        generation_chunk_index=index if kind == "media" else None,
        started_event_ids=(),
        active_event_ids=(),
        completed_event_ids=(),
        transport_chunk_index=index,
    )


def session_start() -> protocol.SessionStart:
    return protocol.parse_start(
        json.dumps({"type": "session.start", "prompt": "a cat", "size": "64x48", "fps": FPS})
    )


class Feeder:
    """A window and the chunks given to it, as a session gives them."""

    def __init__(
        self,
        settings: HlsSettings | None = None,
        *,
        max_part_seconds: float = FRAMES / FPS,
        clock: Callable[[], float] = lambda: T0,
    ) -> None:
        self.settings = settings or HlsSettings()
        self.window = HlsWindow(self.settings, max_part_seconds=max_part_seconds, clock=clock)
        self.window.started(protocol.VideoStart("r1", "m4s", {}), session_start())
        self.sent = 0
        self.frames: list[int] = []
        self.messages: list[bytes] = []

    def feed(self, data: bytes, frames: int = FRAMES, kind: str = "media") -> None:
        self.window.chunk(metadata(self.sent, data, frames, kind), data, INIT)
        self.sent += 1
        if kind == "media":
            self.frames.append(frames)
            self.messages.append(data)

    def feed_many(self, count: int) -> None:
        """``count`` more chunks of FRAMES frames (the first with the init segment)."""
        for _ in range(count):
            self.feed(CHUNKS[len(self.messages) % len(CHUNKS)])

    def parsed(self) -> m3u8.M3U8:
        return m3u8.loads(self.window.playlist())


async def get(window: HlsWindow, resource: str, **query: str) -> HlsResponse:
    return await window.respond(resource, query)


async def ask_in_background(
    nursery: trio.Nursery, window: HlsWindow, resource: str, **query: str
) -> list[HlsResponse]:
    """Start a GET and return once it is parked: its answer lands in the list."""
    answers: list[HlsResponse] = []

    async def ask() -> None:
        answers.append(await window.respond(resource, query))

    nursery.start_soon(ask)
    await trio.testing.wait_all_tasks_blocked()
    return answers


def all_parts(playlist: m3u8.M3U8) -> Iterator[m3u8.PartialSegment]:
    for segment in playlist.segments:
        yield from segment.parts


def msn(n: int) -> str:
    """The n-th segment's Media Sequence Number (from 0), as a directive's value."""
    return str(FIRST_MSN + n)


def seg(n: int) -> str:
    """The n-th segment's name (from 0): numbered from FIRST_MSN."""
    return f"seg/{FIRST_MSN + n}.m4s"


def part(n: int, index: int) -> str:
    """The name of part ``index`` of the n-th segment (from 0)."""
    return f"part/{FIRST_MSN + n}.{index}.m4s"


def part_place(uri: str) -> tuple[int, int]:
    msn, index = uri.removeprefix("part/").removesuffix(".m4s").split(".")
    return int(msn), int(index)


# --------------------------------------------------------------------------- the playlist


def test_the_playlist_has_every_low_latency_tag_with_its_value() -> None:
    feeder = Feeder()
    feeder.feed_many(9)  # three seconds: a whole segment of two seconds, then a third
    text = feeder.window.playlist()
    playlist = m3u8.loads(text)
    part_target = Fraction(FRAMES, FPS)  # 0.3333..., rounded up to the millisecond
    assert playlist.part_inf.part_target == 0.334 >= part_target
    # RFC 8216bis §4.4.3.8: PART-HOLD-BACK at least three times PART-TARGET (SHOULD).
    assert playlist.server_control.can_block_reload == "YES"
    assert playlist.server_control.part_hold_back == pytest.approx(3 * 0.334)
    # TARGETDURATION: a whole number >= segment_seconds (2.0) and PART-TARGET.
    assert playlist.target_duration == 2
    assert int(playlist.version) >= 6  # EXT-X-MAP needs 6
    assert [m.uri for m in playlist.segment_map] == ["init.mp4"]
    assert playlist.media_sequence == FIRST_MSN
    assert not playlist.is_endlist
    whole, open_one = playlist.segments
    assert (whole.uri, whole.duration) == (seg(0), 2.0)
    assert open_one.uri is None  # parts only: its segment is still being made
    assert [p.uri for p in all_parts(playlist)] == [part(0, i) for i in range(6)] + [
        part(1, i) for i in range(3)
    ]
    assert all(p.independent == "YES" for p in all_parts(playlist))
    assert (playlist.preload_hint.hint_type, playlist.preload_hint.uri) == (
        "PART",
        part(1, 3),
    )
    assert text.count("#EXT-X-PROGRAM-DATE-TIME:") == 2  # one per segment
    assert whole.program_date_time == datetime.fromtimestamp(T0, UTC)


async def test_durations_are_frames_over_fps_and_parts_and_segments_keep_their_bounds() -> None:
    # 72 frames, 3 s: every segment begins within three target durations (1 s) of the
    # end, so every part is listed.
    counts = [8, 5, 8, 3, 7, 8, 1, 8, 6, 2, 8, 8]
    init, chunks, _ = encode(counts, seed=1)
    settings = HlsSettings(segment_seconds=1.0)
    feeder = Feeder(settings)
    for data, frames in zip(chunks, counts, strict=True):
        feeder.window.chunk(metadata(feeder.sent, data, frames), data, init)
        feeder.sent += 1
    feeder.window.ended("completed", None)
    playlist = feeder.parsed()
    parts = list(all_parts(playlist))
    # One part per chunk, in order, each exactly num_frames / fps.
    assert [p.duration for p in parts] == [float(Fraction(n, FPS)) for n in counts]
    part_target = playlist.part_inf.part_target
    assert all(p.duration <= part_target for p in parts)
    # A segment's EXTINF is the sum of its parts', exactly (not of their rounded floats).
    place = 0
    for segment in playlist.segments:
        frames = counts[place : place + len(segment.parts)]
        place += len(segment.parts)
        assert segment.duration == float(Fraction(sum(frames), FPS))
        assert segment.duration <= settings.segment_seconds <= playlist.target_duration
        # Not cut sooner than it must be: the next part would not have fitted, or a
        # part as long as its last one would not (the segment closes as that one comes).
        if place < len(counts):
            longest_next = max(frames[-1], counts[place])
            assert Fraction(sum(frames) + longest_next, FPS) > settings.segment_seconds
    assert place == len(counts)
    assert sum(Fraction(n, FPS) for n in counts) == sum(
        Fraction(s.duration).limit_denominator(FPS) for s in playlist.segments
    )


@pytest.mark.parametrize("segment_seconds", [2.0, 1.0, 1.5, 4.0])
def test_constant_chunks_fill_each_segment_to_segment_seconds(segment_seconds: float) -> None:
    feeder = Feeder(HlsSettings(segment_seconds=segment_seconds, window_segments=20))
    feeder.feed_many(18)
    per_segment = math.floor(Fraction(segment_seconds) / Fraction(FRAMES, FPS))
    playlist = feeder.parsed()
    complete = [s for s in playlist.segments if s.uri]
    assert len(complete) == 18 // per_segment
    for segment in complete:
        assert segment.duration == float(Fraction(per_segment * FRAMES, FPS))
    assert playlist.target_duration == math.ceil(segment_seconds)


def test_m3u8_reads_back_the_segments_and_parts_it_was_given() -> None:
    feeder = Feeder(HlsSettings(window_segments=3))
    feeder.feed_many(16)
    first = feeder.window.playlist()
    playlist = m3u8.loads(first)
    again = m3u8.loads(playlist.dumps())

    def shape(p: m3u8.M3U8) -> list[Any]:
        return [(s.uri, s.duration, [(q.uri, q.duration) for q in s.parts]) for s in p.segments]

    per_segment = 6
    expected = [
        (
            seg(m) if (m + 1) * per_segment <= 16 else None,
            2.0 if (m + 1) * per_segment <= 16 else None,
            [
                (part(m, i), float(Fraction(FRAMES, FPS)))
                for i in range(min(per_segment, 16 - m * per_segment))
            ],
        )
        for m in range(3)
    ]
    assert shape(playlist) == shape(again) == expected


def test_program_date_time_is_the_first_parts_arrival_never_overlapping() -> None:
    arrivals: list[float] = []
    feeder = Feeder(HlsSettings(window_segments=20), clock=lambda: arrivals[-1])

    def feed_at(times: Sequence[float]) -> None:
        for t in times:
            arrivals.append(t)
            feeder.feed_many(1)

    chunk = FRAMES / FPS
    feed_at([T0 + i * 2 * chunk for i in range(6)])  # slower than real time: as they came
    feed_at([T0 + 100.0] * 12)  # a burst: each segment right after the one before
    feed_at([T0 + 100.0 + 20.0] * 6)
    complete = [s for s in feeder.parsed().segments if s.uri]
    dates = [s.program_date_time for s in complete]

    def at(t: float) -> datetime:
        return datetime.fromtimestamp(t, UTC)

    assert dates == [at(T0), at(T0 + 100.0), at(T0 + 102.0), at(T0 + 120.0)]


# --------------------------------------------------------------------------- the bytes


async def test_parts_segments_and_init_are_the_streams_bytes_and_decode() -> None:
    feeder = Feeder(HlsSettings(window_segments=10))
    feeder.feed_many(17)  # under three target durations: every part is listed
    feeder.window.ended("completed", None)
    window, playlist = feeder.window, feeder.parsed()
    init = await get(window, "init.mp4")
    assert init.body == INIT and feeder.messages[0].startswith(INIT)
    # Every part is one chunk's binary message, in order; the first less the init segment.
    expected = [feeder.messages[0][len(INIT) :], *feeder.messages[1:]]
    served = [(await get(window, p.uri)).body for p in all_parts(playlist)]
    assert served == expected
    stream = INIT
    for segment in playlist.segments:
        body = (await get(window, segment.uri)).body
        assert body == b"".join([(await get(window, p.uri)).body for p in segment.parts])
        stream += body
    assert stream == b"".join(feeder.messages)
    assert decode_video(stream).shape[0] == sum(feeder.frames) == 17 * FRAMES


async def test_what_never_changes_is_cached_for_good_and_the_rest_briefly() -> None:
    feeder = Feeder()
    feeder.feed_many(7)
    window = feeder.window
    tags = set()
    for name in ("init.mp4", part(0, 0), part(1, 0), seg(0)):
        answer = await get(window, name)
        assert (answer.status, answer.content_type) == (200, "video/mp4")
        assert answer.headers["Cache-Control"] == "public, max-age=31536000, immutable"
        etag = answer.headers["ETag"]
        assert etag.startswith('"') and etag.endswith('"') and not etag.startswith('W/"')
        tags.add(etag)
    assert len(tags) == 4
    # A second window of the same bytes: other ETags.
    other = Feeder()
    other.feed_many(1)
    assert (await get(other.window, part(0, 0))).headers["ETag"] not in tags

    plain = await get(window, "index.m3u8")
    assert plain.content_type == "application/vnd.apple.mpegurl"
    assert plain.body == window.playlist().encode()
    # At most a part's duration (a third of a second: whole seconds make that 0).
    # Kept a second even with parts under one: a crowd's first loads cost one request.
    assert plain.headers["Cache-Control"] == "public, max-age=1"
    blocking = await get(window, "index.m3u8", _HLS_msn=msn(1), _HLS_part="0")
    assert blocking.status == 200
    assert blocking.headers["Cache-Control"] == f"public, max-age={math.ceil(3 * 0.334)}"
    missing = await get(window, part(9, 0))
    assert (missing.status, missing.headers) == (404, {"Cache-Control": "no-store"})


async def test_the_trailer_is_not_served() -> None:
    feeder = Feeder()
    feeder.feed_many(4)
    before = feeder.window.playlist()
    feeder.feed(TRAILER, frames=0, kind="trailer")
    assert feeder.window.playlist() == before
    feeder.window.ended("completed", None)
    playlist = feeder.parsed()
    [segment] = playlist.segments
    body = (await get(feeder.window, segment.uri)).body
    assert TRAILER not in body and b"mfra" not in body
    assert body == b"".join(feeder.messages)[len(INIT) :]


# ------------------------------------------------------------------- chunks too long


async def test_a_chunk_longer_than_part_target_is_a_segment_and_one_too_long_a_gap() -> None:
    counts = [8, 8, 12, 8, 72, 8]  # 12 frames: 0.5 s > PART-TARGET; 72: 3 s > TARGETDURATION
    init, chunks, _ = encode(counts, seed=2)
    feeder = Feeder(HlsSettings(window_segments=10))
    window = feeder.window
    for index in range(2):
        window.chunk(metadata(index, chunks[index], counts[index]), chunks[index], init)
    hinted = m3u8.loads(window.playlist()).preload_hint.uri
    assert hinted == part(0, 2)
    for index in range(2, len(counts)):
        window.chunk(metadata(index, chunks[index], counts[index]), chunks[index], init)
    window.ended("completed", None)
    text = window.playlist()
    playlist = m3u8.loads(text)
    durations = [float(Fraction(n, FPS)) for n in counts]
    assert [(s.uri, s.duration, len(s.parts)) for s in playlist.segments] == [
        (seg(0), durations[0] + durations[1], 2),
        (seg(1), durations[2], 0),  # a segment of its own, without parts
        (seg(2), durations[3], 1),
        (seg(3), durations[4], 0),  # a gap: longer than TARGETDURATION
        (seg(4), durations[5], 1),
    ]
    assert [bool(s.gap_tag) for s in playlist.segments] == [False, False, False, True, False]
    assert "#EXT-X-GAP" in text
    # The playlist stays valid: no part over PART-TARGET, no segment over TARGETDURATION
    # but the gap, which holds no media.
    assert all(p.duration <= playlist.part_inf.part_target for p in all_parts(playlist))
    assert all(s.duration <= playlist.target_duration for s in playlist.segments if not s.gap_tag)
    assert (await get(window, hinted)).status == 404  # the hint was not published
    assert (await get(window, seg(1))).body == chunks[2]
    assert (await get(window, seg(3))).status == 404
    served = [(await get(window, s.uri)).body for s in playlist.segments if not s.gap_tag]
    frames = decode_video(init + b"".join(served))
    assert frames.shape[0] == sum(counts) - 72


# ------------------------------------------------------------------- blocking reload


async def test_a_blocking_reload_waits_for_the_part_then_lists_it(nursery: trio.Nursery) -> None:
    feeder = Feeder()
    feeder.feed_many(8)  # segment 0 (six parts) and parts 0 and 1 of segment 1
    answers = await ask_in_background(
        nursery, feeder.window, "index.m3u8", _HLS_msn=msn(1), _HLS_part="2"
    )
    assert answers == []
    feeder.feed_many(1)
    await trio.testing.wait_all_tasks_blocked()
    [answer] = answers
    assert answer.status == 200
    assert part(1, 2) in [p.uri for p in all_parts(m3u8.loads(answer.body.decode()))]


async def test_a_part_index_past_a_segments_last_waits_for_the_next_segment(
    nursery: trio.Nursery,
) -> None:
    feeder = Feeder()
    feeder.feed_many(6)  # segment 0 is whole with parts 0 to 5
    # RFC 8216bis §6.2.5.2: part 6 of segment 0 is part 0 of segment 1.
    by_part = await ask_in_background(
        nursery, feeder.window, "index.m3u8", _HLS_msn=msn(0), _HLS_part="6"
    )
    by_msn = await ask_in_background(nursery, feeder.window, "index.m3u8", _HLS_msn=msn(1))
    assert (await get(feeder.window, "index.m3u8", _HLS_msn=msn(0))).status == 200
    feeder.feed_many(1)
    await trio.testing.wait_all_tasks_blocked()
    assert [a.status for a in by_part] == [200]
    assert by_msn == []  # segment 1 is not whole yet
    feeder.feed_many(5)
    await trio.testing.wait_all_tasks_blocked()
    [answer] = by_msn
    assert seg(1) in [s.uri for s in m3u8.loads(answer.body.decode()).segments]


async def test_what_exists_is_answered_at_once(autojump_clock: trio.testing.MockClock) -> None:
    feeder = Feeder(HlsSettings(window_segments=1))
    feeder.feed_many(60)  # long enough for the first segments to have left the playlist
    start = trio.current_time()
    for query in ({"_HLS_msn": msn(0), "_HLS_part": "0"}, {"_HLS_msn": msn(9), "_HLS_part": "5"}):
        answer = await get(feeder.window, "index.m3u8", **query)
        # The whole playlist, even though segment 0 is no longer in it (§6.2.5.2).
        assert answer.status == 200 and answer.body == feeder.window.playlist().encode()
    assert (await get(feeder.window, part(9, 5))).status == 200
    assert trio.current_time() == start  # no waiting: the mock clock never moved


async def test_too_far_ahead_is_400_at_once_and_the_limit_itself_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    feeder = Feeder()
    feeder.feed_many(9)  # segment 0 whole; parts 0 to 2 of segment 1
    window = feeder.window
    last_msn = FIRST_MSN  # the last whole segment
    start = trio.current_time()
    refused = await get(window, "index.m3u8", _HLS_msn=str(last_msn + 3))
    assert refused.status == 400 and refused.headers["Cache-Control"] == "no-store"
    # The Advance Part Limit: 3 / PART-TARGET parts when PART-TARGET is under a second.
    limit = math.floor(3 / 0.334)
    far = await get(window, "index.m3u8", _HLS_msn=msn(1), _HLS_part=str(2 + limit + 1))
    assert far.status == 400
    assert trio.current_time() == start
    # At the limits: held, then 503 after three target durations (§6.2.5.2).
    for query in (
        {"_HLS_msn": str(last_msn + 2)},
        {"_HLS_msn": msn(1), "_HLS_part": str(2 + limit)},
    ):
        start = trio.current_time()
        answer = await get(window, "index.m3u8", **query)
        assert answer.status == 503 and answer.headers["Cache-Control"] == "no-store"
        assert trio.current_time() - start == pytest.approx(3 * 2)


async def test_a_part_without_msn_is_400_but_skip_is_ignored() -> None:
    feeder = Feeder()
    feeder.feed_many(2)
    assert (await get(feeder.window, "index.m3u8", _HLS_part="0")).status == 400
    plain = feeder.window.playlist().encode()
    for query in ({"_HLS_skip": "YES"}, {"_HLS_skip": "v2"}, {"_HLS_skip": "\x00"}, {"x": "y"}):
        answer = await get(feeder.window, "index.m3u8", **query)
        assert (answer.status, answer.body) == (200, plain)


async def test_the_session_ending_answers_whoever_waits(nursery: trio.Nursery) -> None:
    feeder = Feeder()
    feeder.feed_many(3)
    window = feeder.window
    reload = await ask_in_background(nursery, window, "index.m3u8", _HLS_msn=msn(0), _HLS_part="3")
    hinted = await ask_in_background(nursery, window, part(0, 3))
    window.ended("completed", None)
    await trio.testing.wait_all_tasks_blocked()
    [answer] = reload
    final = m3u8.loads(answer.body.decode())
    assert answer.status == 200 and final.is_endlist and final.preload_hint is None
    assert [s.uri for s in final.segments] == [seg(0)]
    assert [a.status for a in hinted] == [404]
    # With EXT-X-ENDLIST the directives are ignored (§6.2.5.2), too far or not.
    late = await get(window, "index.m3u8", _HLS_msn="99", _HLS_part="99")
    assert (late.status, late.body) == (200, answer.body)


async def test_a_wait_that_runs_out_is_503_after_three_target_durations(
    autojump_clock: trio.testing.MockClock,
) -> None:
    feeder = Feeder(HlsSettings(segment_seconds=3.0))
    feeder.feed_many(2)
    start = trio.current_time()
    answer = await get(feeder.window, "index.m3u8", _HLS_msn=msn(0), _HLS_part="2")
    assert answer.status == 503
    assert trio.current_time() - start == pytest.approx(3 * 3)
    start = trio.current_time()
    assert (await get(feeder.window, part(0, 2))).status == 503
    assert trio.current_time() - start == pytest.approx(3 * 3)


async def test_the_hinted_part_waits_and_any_other_missing_part_is_404(
    nursery: trio.Nursery,
) -> None:
    feeder = Feeder()
    feeder.feed_many(4)
    window = feeder.window
    assert feeder.parsed().preload_hint.uri == part(0, 4)
    hinted = await ask_in_background(nursery, window, part(0, 4))
    for name in (part(0, 5), part(1, 0), seg(0)):
        assert (await get(window, name)).status == 404
    assert hinted == []
    feeder.feed_many(1)
    await trio.testing.wait_all_tasks_blocked()
    [answer] = hinted
    assert (answer.status, answer.body) == (200, feeder.messages[4])


# --------------------------------------------------------------------------- the window


async def test_the_window_slides_and_holds_a_bounded_number_of_segments() -> None:
    settings = HlsSettings(window_segments=4)
    feeder = Feeder(settings)
    window = feeder.window
    per_segment = 6  # two seconds of thirds of a second
    for _ in range(40):
        feeder.feed_many(per_segment)
        # From msn 0 on: none before FIRST_MSN is served either.
        served = [n for n in range(-FIRST_MSN, 60) if (await get(window, seg(n))).status == 200]
        playlist = feeder.parsed()
        listed = [s for s in playlist.segments if s.uri]
        whole = feeder.sent // per_segment
        # The last window_segments whole segments (4 x 2 s >= 3 target durations).
        first = max(0, whole - settings.window_segments)
        assert playlist.media_sequence == FIRST_MSN + first
        assert [s.uri for s in listed] == [seg(n) for n in range(first, whole)]
        assert set(range(first, whole)) <= set(served)
        assert len(served) <= settings.window_segments + 2
    assert (await get(window, seg(0))).status == 404
    assert (await get(window, part(0, 0))).status == 404
    # EXT-X-PART only for the segments that begin within three target durations of the
    # end (RFC 8216bis §6.2.2); the parts of older ones are still served.
    with_parts = [s.uri for s in listed if s.parts]
    assert with_parts == [seg(n) for n in range(first, whole) if (whole - n) * 2 <= 3 * 2]
    assert seg(first) not in with_parts
    assert (await get(window, part(first, 0))).status == 200


def test_the_playlist_never_lasts_less_than_three_target_durations() -> None:
    feeder = Feeder(HlsSettings(segment_seconds=1.0, window_segments=1))
    feeder.feed_many(60)
    playlist = feeder.parsed()
    listed = sum(s.duration for s in playlist.segments if s.uri)
    assert listed >= 3 * playlist.target_duration
    assert playlist.media_sequence > FIRST_MSN


async def test_endlist_after_the_end_and_404_once_the_linger_is_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    feeder = Feeder(HlsSettings(linger=30.0))
    feeder.feed_many(8)
    window = feeder.window
    assert window.ended_at is None
    window.ended("completed", None)
    assert window.ended_at == trio.current_time()
    playlist = feeder.parsed()
    assert playlist.is_endlist and playlist.preload_hint is None
    # The segment being made when the session ended is whole now.
    assert [(s.uri, s.duration) for s in playlist.segments] == [
        (seg(0), 2.0),
        (seg(1), float(Fraction(2 * FRAMES, FPS))),
    ]
    answer = await get(window, "index.m3u8")
    assert answer.headers["Cache-Control"] == "public, max-age=30"
    feeder.feed_many(1)  # nothing after the end
    assert feeder.parsed().segments[-1].uri == seg(1)
    await trio.sleep(29.5)
    assert (await get(window, seg(1))).status == 200
    await trio.sleep(0.5)
    for name in ("index.m3u8", "init.mp4", seg(1), part(1, 0)):
        assert (await get(window, name)).status == 404


# --------------------------------------------------------------------- hostile requests


HOSTILE_NAMES = [
    "",
    "/",
    ".",
    "..",
    "../index.m3u8",
    "/index.m3u8",
    "index.m3u8/",
    "INDEX.M3U8",
    "index.m3u8\x00",
    "init.mp4 ",
    "part/../../etc/passwd",
    "part/..%2f..%2fetc/passwd",
    "part/-1.0.m4s",
    "part/01.0.m4s",
    # Mangled spellings of a part and a segment that exist (FIRST_MSN's).
    f"part/{FIRST_MSN}.00.m4s",
    f"part/{FIRST_MSN}.0.m4s/",
    f"part/{FIRST_MSN}.0.M4S",
    f"part/{FIRST_MSN}.0",
    f"part/{FIRST_MSN}..m4s",
    "part/\u0661.\u0660.m4s",  # Arabic-Indic digits: \d would take them
    "part/" + "9" * 30 + ".0.m4s",
    "seg/" + "9" * 10 + ".m4s",
    "seg/+1.m4s",
    "seg/1e3.m4s",
    "seg/0x1.m4s",
    f"seg/{FIRST_MSN}.m4s?x=1",
    f"seg/{FIRST_MSN}.m4s\n",
    "\N{FULLWIDTH DIGIT ZERO}",
    "part/" + "0" * 5000 + ".0.m4s",
    "x" * 100_000,
]

HOSTILE_QUERIES = [
    {"_HLS_msn": ""},
    {"_HLS_msn": "-1"},
    {"_HLS_msn": "1.5"},
    {"_HLS_msn": "abc"},
    {"_HLS_msn": "\u0661"},
    {"_HLS_msn": " 1"},
    {"_HLS_msn": "+1"},
    {"_HLS_msn": "0x1"},
    {"_HLS_msn": "1e3"},
    {"_HLS_msn": "9" * 11},
    {"_HLS_msn": "9" * 5000},
    {"_HLS_msn": "9999999999"},  # ten digits: a number, far too far ahead
    {"_HLS_msn": "0", "_HLS_part": "-1"},
    {"_HLS_msn": "0", "_HLS_part": "9" * 11},
    # Ten digits, far past the open segment's last part (the first whole one's would be
    # answered at once: RFC 8216bis §6.2.5.2).
    {"_HLS_msn": str(FIRST_MSN + 1), "_HLS_part": "9999999999"},
    {"_HLS_msn": "0", "_HLS_part": "\N{FULLWIDTH DIGIT ONE}"},
    {"_HLS_part": "0"},
]


async def test_hostile_names_are_404_and_hostile_queries_400() -> None:
    feeder = Feeder()
    feeder.feed_many(8)
    for name in HOSTILE_NAMES:
        answer = await get(feeder.window, name)
        assert answer.status == 404, name
        assert answer.headers == {"Cache-Control": "no-store"}
        assert len(answer.body) < 100
    for query in HOSTILE_QUERIES:
        answer = await get(feeder.window, "index.m3u8", **query)
        assert answer.status == 400, query
        assert answer.headers == {"Cache-Control": "no-store"} and len(answer.body) < 100
    not_text: Any = {"_HLS_msn": ["1"]}
    assert (await feeder.window.respond("index.m3u8", not_text)).status == 400
    # A query on anything but the playlist changes nothing.
    answer = await feeder.window.respond(part(0, 0), {"_HLS_msn": "x" * 1000})
    assert answer.status == 200


async def test_before_the_first_chunk() -> None:
    window = HlsWindow(HlsSettings(), max_part_seconds=FRAMES / FPS)
    assert (await window.respond("init.mp4", {})).status == 404
    assert (await window.respond(seg(0), {})).status == 404
    playlist = m3u8.loads((await window.respond("index.m3u8", {})).body.decode())
    assert playlist.segments == [] and playlist.preload_hint.uri == part(0, 0)
    # A chunk before started() (no fps yet) is not guessed at.
    window.chunk(metadata(0, CHUNKS[0], FRAMES), CHUNKS[0], INIT)
    assert m3u8.loads(window.playlist()).segments == []


@pytest.mark.parametrize("seconds", [0, -1.0, math.nan, math.inf, 61.0])
def test_max_part_seconds_is_checked(seconds: float) -> None:
    with pytest.raises(ValueError, match="max_part_seconds"):
        HlsWindow(HlsSettings(), max_part_seconds=seconds)


@pytest.mark.parametrize(
    "fields",
    [{"segment_seconds": 0}, {"segment_seconds": math.nan}, {"window_segments": 0}, {"linger": -1}],
)
def test_settings_are_checked(fields: dict[str, Any]) -> None:
    with pytest.raises((ValueError, TypeError)):
        HlsSettings(**fields)
