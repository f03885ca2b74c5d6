"""LL-HLS viewers, as a low-latency player follows a live playlist, for the tests and the
benchmark that put a crowd of them behind nginx's cache (``tests/server/
test_deploy_hls_cache.py``, the ``hls`` scenario): what they check is what they measure.

A viewer (`HlsViewer`) is a tiny HTTP/1.1 client on one keep-alive connection (h11):
it loads the playlist once as a player starts (no directive), then, until
``EXT-X-ENDLIST``, fetches the init segment and every part listed after the last it
has, and asks for the next part with a blocking reload (``_HLS_msn``/``_HLS_part``, RFC
8216bis §6.2.5.2). It starts at the first part listed rather than at the live edge,
so that it ends with the whole video: the caller compares it with what the session's
owner got. Its loop is bounded in requests; its caller bounds it in time.

`origin_requests` reads nginx's access log (the shipped ``trio_vstream`` format): how
many requests for each resource reached the server, the rest being the cache's.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import re
import resource
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

import attrs
import av
import h11
import m3u8
import trio

from bench._nginx import LogEntry
from trio_vstream.outputs.hls import FIRST_MSN

PART_URI: Final = re.compile(r"part/(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.m4s")
"""The server's part names (``trio_vstream.outputs.hls``): ``part/<msn>.<index>.m4s``."""
RECEIVE: Final = 65536

Place = tuple[int, int]
"""A part's place: (Media Sequence Number of its segment, its index in the segment)."""
FIRST_PLACE: Final[Place] = (FIRST_MSN, 0)
"""The stream's first part: part 0 of the server's first segment (``FIRST_MSN``)."""


class HlsViewerError(Exception):
    """What made a viewer stop before the end of the stream."""


@attrs.frozen
class Listing:
    """What a viewer needs of one media playlist."""

    parts: tuple[tuple[Place, str], ...]
    """Every part listed, in order, with its URI."""
    complete: frozenset[int]
    """Segments listed as complete (with their own URI)."""
    last_index: dict[int, int]
    """The last part index listed in each segment."""
    map_uri: str | None
    ended: bool
    first_msn: int


@functools.lru_cache(maxsize=1024)
def parse_listing(body: bytes) -> Listing:
    """One playlist, parsed once however many viewers got the same bytes (a cache hands
    them all the same answer)."""
    playlist = m3u8.loads(body.decode())
    first = int(playlist.media_sequence or 0)
    parts: list[tuple[Place, str]] = []
    complete: set[int] = set()
    last_index: dict[int, int] = {}
    for offset, segment in enumerate(playlist.segments):
        msn = first + offset
        if segment.uri:
            complete.add(msn)
        for index, part in enumerate(segment.parts):
            if part.uri is None:
                raise HlsViewerError(f"a part of segment {msn} has no URI")
            parts.append(((msn, index), part.uri))
            last_index[msn] = index
    map_uri = playlist.segment_map[0].uri if playlist.segment_map else None
    return Listing(
        tuple(parts), frozenset(complete), last_index, map_uri, bool(playlist.is_endlist), first
    )


def next_place(listing: Listing, place: Place) -> Place:
    """Where the part after ``place`` is: the next index, or part 0 of the next segment
    once ``place`` is the last part of a complete segment (what the viewer asks a
    blocking reload for, so that every viewer asks the same query)."""
    msn, index = place
    if msn in listing.complete and listing.last_index.get(msn) == index:
        return (msn + 1, 0)
    return (msn, index + 1)


@attrs.frozen
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


class KeepAliveClient:
    """GETs one after another on one HTTP/1.1 connection, opened again when the server
    closes it (or had closed it, idle, before a request: retried once)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._stream: trio.SocketStream | None = None
        self._connection = h11.Connection(h11.CLIENT)
        self.connections = 0

    async def get(self, target: str, headers: Sequence[tuple[str, str]] = ()) -> Response:
        """``headers``: besides Host."""
        fresh = self._stream is None
        try:
            return await self._exchange(target, headers)
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError, EOFError):
            await self.aclose()
            if fresh:
                raise
        return await self._exchange(target, headers)

    async def _exchange(self, target: str, extra: Sequence[tuple[str, str]]) -> Response:
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self.host, self.port)
            self._connection = h11.Connection(h11.CLIENT)
            self.connections += 1
        stream, connection = self._stream, self._connection
        request = h11.Request(method="GET", target=target, headers=[("Host", self.host), *extra])
        await stream.send_all(connection.send(request) + connection.send(h11.EndOfMessage()))
        status, headers, body = 0, {}, bytearray()
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(RECEIVE))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise EOFError("the server closed the connection before answering")
        if connection.our_state is h11.DONE and connection.their_state is h11.DONE:
            connection.start_next_cycle()
        else:
            await self.aclose()
        return Response(status, headers, bytes(body))

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()


@attrs.define
class HlsViewer:
    """One viewer of a live LL-HLS playlist at ``playlist_path`` on ``host:port``."""

    name: str
    host: str
    port: int
    playlist_path: str
    max_requests: int
    """The loop's bound: a viewer that needs more has failed (a stream that never ends,
    a playlist that never moves)."""
    init: bytes = b""
    places: list[Place] = attrs.field(factory=list)
    """The parts fetched, in order."""
    data: list[bytes] = attrs.field(factory=list, repr=False)
    arrived: list[float] = attrs.field(factory=list, repr=False)
    """When each part's bytes were in (`trio.current_time`)."""
    final: Listing | None = None
    """The playlist with ``EXT-X-ENDLIST``, once it came."""
    requests: int = 0
    reloads: int = 0
    failure: str | None = None
    connections: int = 0

    @property
    def base(self) -> str:
        return self.playlist_path.rsplit("/", 1)[0]

    @property
    def complete(self) -> bool:
        """The whole stream: from the first part to the last the final playlist lists,
        none missed, in order (each part was checked to be the one after the last as it
        came: `run`), and the final playlist's parts (its last few segments') are the
        last ones fetched."""
        if self.failure is not None or self.final is None or not self.places:
            return False
        listed = [place for place, _ in self.final.parts]
        return (
            self.places[0] == FIRST_PLACE and bool(listed) and self.places[-len(listed) :] == listed
        )

    def media(self) -> bytes:
        """The init segment and every part, one after the other: a fragmented MP4."""
        return self.init + b"".join(self.data)

    def digest(self) -> str:
        return hashlib.sha256(self.media()).hexdigest()

    async def run(self) -> None:
        """Follow the playlist to its end; never raises for what the server or the
        network does (``failure`` says), only for cancellation."""
        client = KeepAliveClient(self.host, self.port)
        try:
            await self._follow(client)
        except HlsViewerError as exc:
            self.failure = str(exc)
        except (OSError, EOFError, trio.BrokenResourceError, h11.ProtocolError) as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            self.connections = client.connections
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def _get(self, client: KeepAliveClient, target: str) -> bytes:
        if self.requests >= self.max_requests:
            raise HlsViewerError(f"still no end after {self.requests} requests")
        self.requests += 1
        answer = await client.get(target)
        if answer.status != 200:
            raise HlsViewerError(f"GET {target}: {answer.status} {answer.body[:200]!r}")
        return answer.body

    async def _follow(self, client: KeepAliveClient) -> None:
        listing = parse_listing(await self._get(client, self.playlist_path))
        while True:
            if not self.init and listing.map_uri is not None:
                self.init = await self._get(client, f"{self.base}/{listing.map_uri}")
            await self._fetch_new_parts(client, listing)
            if listing.ended:
                self.final = listing
                return
            if self.places:
                msn, part = next_place(listing, self.places[-1])
            elif listing.parts:  # listed, yet not fetched: cannot be
                raise HlsViewerError("parts listed and none fetched")
            else:
                msn, part = listing.first_msn, 0
            query = f"?_HLS_msn={msn}&_HLS_part={part}"
            self.reloads += 1
            listing = parse_listing(await self._get(client, self.playlist_path + query))

    async def _fetch_new_parts(self, client: KeepAliveClient, listing: Listing) -> None:
        """Every part listed after the last one fetched; each must be the one after it
        (the first: the first of the stream), or a part was skipped."""
        new = listing.parts
        if self.places:
            last = self.places[-1]
            after = [n for n, (place, _) in enumerate(listing.parts) if place == last]
            if not after:
                raise HlsViewerError(f"part {last} is no longer listed: fell behind the window")
            new = listing.parts[after[0] + 1 :]
        for place, uri in new:
            if self.places and place != next_place(listing, self.places[-1]):
                raise HlsViewerError(f"part {place} listed after {self.places[-1]}")
            if not self.places and place != FIRST_PLACE:
                raise HlsViewerError(f"the first part listed is {place}, not {FIRST_PLACE}")
            self.data.append(await self._get(client, f"{self.base}/{uri}"))
            self.arrived.append(trio.current_time())
            self.places.append(place)


def open_files_short_of(wanted: int) -> str | None:
    """Why this process cannot hold ``wanted`` open files (its hard limit), or None."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        return f"{wanted} open files needed; the hard limit (ulimit -Hn) is {hard}"
    return None


@contextlib.contextmanager
def open_files(wanted: int) -> Iterator[None]:
    """The soft limit on open files raised to ``wanted`` where it is lower (as far as the
    hard limit allows: `open_files_short_of` says whether that is far enough), and put
    back afterwards: a crowd of viewers is a socket each."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raised = soft != resource.RLIM_INFINITY and soft < wanted
    if raised:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        if raised:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def decoded_frames(media: bytes) -> int:
    """Video frames FFmpeg (through PyAV) decodes from a fragmented MP4 held in memory."""
    with av.open(io.BytesIO(media), format="mp4", mode="r") as container:
        return sum(1 for _ in container.decode(video=0))


def part_place(path: str) -> Place | None:
    """The place a logged request's path names, if it is a part."""
    match = PART_URI.search(path.split("?", 1)[0])
    return (int(match[1]), int(match[2])) if match else None


def origin_requests(entries: Iterable[LogEntry], prefix: str) -> Counter[str]:
    """Requests under ``prefix`` (a playlist's directory) that reached a server, by
    path and query: the origin's share; the rest the cache answered."""
    return Counter(e.path for e in entries if e.path.startswith(prefix) and e.reached_a_backend)


def parts_origin_counts(
    entries: Sequence[LogEntry], prefix: str, places: Iterable[Place]
) -> dict[Place, int]:
    """For each part, how many of its requests reached a server (0: none did, which the
    caller should find as strange as three)."""
    counted: Counter[Place] = Counter()
    for path, n in origin_requests(entries, prefix).items():
        place = part_place(path)
        if place is not None:
            counted[place] += n
    return {place: counted[place] for place in places}
