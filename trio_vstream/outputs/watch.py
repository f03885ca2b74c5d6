"""Watch links: several read-only viewers of one session, none of whom can slow it down.

Each session (when watching is on) gets an unguessable token, and its ``video.start``
carries ``watch_path`` (``/v1/realtime/video/watch/<token>``, this project's extension;
``.../watch/<node>/<token>`` for a server with a name in a fleet, whose other servers
relay its viewers to it: ``trio_vstream.server.fleet``). Whoever opens a WebSocket there
gets ``watch.start`` (the session's format and config, less what is not the viewers'
business), then the same ``video.chunk_metadata`` and binary pairs as the owner from
where it joined, then the same terminal message, and a normal close.

The pieces, from the session outwards:

* `WatchHub` is the session's tap (`trio_vstream.outputs.taps`): called on the event loop
  between the session's own sends, it never waits. Each viewer has a bounded Trio
  memory channel (``queue_chunks``); the hub puts each chunk there with
  ``send_nowait``. A full queue means the viewer is behind: it misses that chunk and
  resumes at the next one that begins with a keyframe (the encoder makes every chunk
  begin with an IDR, so that is the next chunk); a viewer that misses
  ``max_missed_chunks`` chunks in a row is closed with ``viewer_too_slow``. Either way
  the owner's session never waits, so its G5 bound (three chunks) is untouched.
* A joining viewer waits for a chunk that begins with a keyframe, and its first binary
  message is the init segment followed by that chunk, with ``byte_length`` to match:
  its binary messages, concatenated, decode on their own from there to the end.
* Each viewer is served by its own connection handler (`WatchRegistry.serve`): one task
  writes what its queue holds, each send with a deadline; one reads, answering
  ``session.ping`` with ``session.pong`` and every other control message with
  ``read_only``. The two share a lock, so a reply never lands between a chunk's metadata
  and its bytes. A viewer going away is no event for the session.
* `WatchRegistry` maps tokens to hubs, server-wide; a hub leaves it when its session
  ends (a later viewer gets ``watch_not_found``). The map holds hubs weakly too, so a
  session that never got to tell its taps it ended (it failed while sending
  ``video.start``, before anyone could know the token) leaves nothing behind. It also
  counts the viewers' connections, so that the server's drain can let viewers still
  behind when the last session ends receive their queued chunks and the terminal
  message (up to a close timeout) rather than cutting them off.

Memory: chunk bytes are shared by all viewers (one extra copy per chunk for joiners,
the init segment in front), so what viewers hold is at most ``queue_chunks`` chunks
each by reference, plus what the kernel buffers for their sockets.
"""

from __future__ import annotations

import contextlib
import secrets
import weakref
from collections.abc import Iterator
from typing import Any, Final, Protocol

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from trio_vstream import protocol
from trio_vstream.logsafe import get_logger
from trio_vstream.media.fmp4 import fragment_starts_with_keyframe
from trio_vstream.outputs.hls import HlsSettings, HlsWindow
from trio_vstream.outputs.taps import SessionTaps
from trio_vstream.protocol import ErrorCode

logger = get_logger(__name__)

WATCH_PREFIX: Final = "/v1/realtime/video/watch/"
"""Watch links are this prefix and a token."""

HLS_MARKER: Final = "/hls/"
"""A watch link's LL-HLS resources are under the link and this: ``<link>/hls/index.m3u8``."""

VIEWER_CONFIG_KEYS: Final = frozenset(
    {
        "model",
        "prompt",
        "negative_prompt",
        "seconds",
        "size",
        "width",
        "height",
        "fps",
        "num_frames",
        "video_params",
        "num_inference_steps",
        "guidance_scale",
        "guidance_scale_2",
        "boundary_ratio",
        "flow_shift",
        "true_cfg_scale",
        "seed",
        "quality",
        "generate_sound",
        "audio",  # the server's: the stream has sound (a page needs it for its MSE type)
        "sound_duration",
        "enable_frame_interpolation",
        "frame_interpolation_exp",
        "frame_interpolation_scale",
    }
)
"""The ``config`` keys a viewer sees: what describes the video. An allow list, so that a
field added to requests later stays private until someone decides otherwise. Left out:
``image_reference`` (a data URL is large, and an https URL may carry a signed token),
``user`` (the owner's end-user id), ``lora`` (paths and URLs of private adapters),
``extra_params`` (free-form: anything a client chose to put there),
``frame_interpolation_model_path`` (a path on the server) and anything new. The
prompt is shown: the owner shares the link knowingly, and a viewer sees the video anyway."""


@attrs.frozen(kw_only=True)
class WatchConfig:
    """How many may watch a session, and how far behind one may fall."""

    max_viewers: int = 8
    """Viewers at once, per session; 0 turns watching off (no ``watch_path``)."""
    requires_key: bool = False
    """With API keys on, whether a watch link needs one too (by default the token is
    the capability, so a link can be shared with people who hold no key)."""
    queue_chunks: int = 4
    """Chunks a viewer may have waiting to be sent before it starts missing chunks."""
    max_missed_chunks: int = 8
    """Chunks a viewer may miss in a row (its queue full every time) before it is closed
    with ``viewer_too_slow``: further behind than that, it is not watching live."""
    hls: HlsSettings | None = attrs.field(factory=HlsSettings)
    """Each watch link's Low-Latency HLS playlist (``<link>/hls/index.m3u8``, over plain
    GETs, for HTTP caches to fan out: `trio_vstream.outputs.hls`); None: none."""
    hls_part_seconds: float = 1.0
    """The longest chunk, in seconds, a session's playlist allows for as one part, for an
    engine that does not say its longest chunk (`SupportsChunkFrames`)."""

    @property
    def enabled(self) -> bool:
        return self.max_viewers > 0


_Unit = tuple[str | bytes, ...]
"""Messages sent back to back, never interleaved with another unit (a chunk's metadata
and bytes, or one text message)."""


class Viewer:
    """One viewer's queue and its standing with the hub."""

    def __init__(self, queue_chunks: int) -> None:
        self.send_channel, self.receive_channel = trio.open_memory_channel[_Unit](queue_chunks)
        self.joined = False
        """It was sent a chunk (its first began with the init segment)."""
        self.resync = True
        """Waiting for a chunk that begins with a keyframe: joining, or after a miss."""
        self.missed_in_row = 0
        self.kicked: protocol.Error | None = None
        """Why it was closed (too far behind): sent instead of the terminal message."""
        self.send_scope: trio.CancelScope | None = None
        """The send in progress, whose deadline a kick brings forward."""


class WatchHub:
    """One session's viewers: a `SessionTap` that queues what the session sends.

    Every tap method runs on the event loop and returns at once (``send_nowait`` only).
    """

    def __init__(
        self, registry: WatchRegistry, token: str, config: WatchConfig, close_timeout: float
    ) -> None:
        self._registry = registry
        self.token = token
        self._config = config
        self._close_timeout = close_timeout
        self._metrics = registry.metrics
        self.viewers: set[Viewer] = set()
        self.watch_start: protocol.WatchStart | None = None
        self.terminal: protocol.SessionDone | protocol.Error | None = None
        self._request_id: str | None = None
        self._init_segment = b""
        self._done = False

    # ------------------------------------------------------------- the session's side

    def started(self, video_start: protocol.VideoStart, start: protocol.SessionStart) -> None:
        self._request_id = video_start.request_id
        self.watch_start = protocol.WatchStart(
            video_start.request_id, video_start.format, viewer_config(video_start.config)
        )
        for viewer in list(self.viewers):  # any that came in while video.start went out
            self._offer(viewer, (self.watch_start.to_json(),))

    def chunk(self, metadata: protocol.ChunkMetadata, data: bytes, init_segment: bytes) -> None:
        if init_segment:
            self._init_segment = init_segment
        if not self.viewers:
            return
        media = metadata.kind == "media"
        keyframe = media and fragment_starts_with_keyframe(data)
        unit: _Unit = (metadata.to_json(), data)
        joining: _Unit | None = None
        for viewer in list(self.viewers):
            if viewer.kicked is not None:
                continue
            if viewer.resync:
                if not keyframe:
                    # Media it cannot decode from: a joiner waits; one that missed a
                    # chunk is still missing them. The trailer only ends what it had.
                    if media and viewer.joined:
                        self._missed(viewer)
                    continue
                if not viewer.joined:
                    joining = joining or self._join_unit(metadata, data)
                    if not self._offer(viewer, joining):
                        continue
                    viewer.joined = True
                elif not self._offer(viewer, unit):
                    continue
                viewer.resync = False
            elif not self._offer(viewer, unit):
                continue
            viewer.missed_in_row = 0

    def interaction(
        self, event_id: str, message: protocol.Interaction, error: protocol.Error | None
    ) -> None:
        """Not forwarded: viewers see an interaction's effect in the chunks' event ids."""

    def interaction_refused(self, event_id: str, error: protocol.Error) -> None:
        """Not forwarded either: a refused interaction has no effect to see."""

    def ended(self, outcome: str, terminal: protocol.SessionDone | protocol.Error | None) -> None:
        self.terminal = terminal
        self._done = True
        self._registry.forget(self.token)
        for viewer in list(self.viewers):
            viewer.send_channel.close()  # its handler sends what is queued, then the terminal

    # ---------------------------------------------------------------- the viewers' side

    def attach(self) -> Viewer | None:
        """A new viewer, or None when the session has its ``max_viewers`` (or has ended)."""
        if self._done or len(self.viewers) >= self._config.max_viewers:
            return None
        viewer = Viewer(self._config.queue_chunks)
        self.viewers.add(viewer)
        self._metrics.viewer_joined()
        if self.watch_start is not None:
            viewer.send_channel.send_nowait((self.watch_start.to_json(),))
        return viewer

    def detach(self, viewer: Viewer) -> None:
        if viewer in self.viewers:
            self.viewers.discard(viewer)
            self._metrics.viewer_left()
        viewer.send_channel.close()
        viewer.receive_channel.close()

    def queued_units(self) -> list[int]:
        """How many units each viewer has waiting (for tests and debugging)."""
        return [v.receive_channel.statistics().current_buffer_used for v in self.viewers]

    # ------------------------------------------------------------------------- policy

    def _offer(self, viewer: Viewer, unit: _Unit) -> bool:
        """Queue a unit for a viewer; False (and the miss counted) when its queue is full."""
        try:
            viewer.send_channel.send_nowait(unit)
        except trio.WouldBlock:
            self._missed(viewer)
            return False
        except trio.ClosedResourceError:  # it is leaving
            return False
        return True

    def _missed(self, viewer: Viewer) -> None:
        viewer.resync = True
        viewer.missed_in_row += 1
        self._metrics.viewer_chunk_skipped()
        if viewer.missed_in_row >= self._config.max_missed_chunks:
            self._kick(viewer)

    def _kick(self, viewer: Viewer) -> None:
        """Close a viewer that fell too far behind: what it has queued is dropped, the
        send in progress gets ``close_timeout`` to finish, then the error goes out."""
        viewer.kicked = protocol.Error(
            ErrorCode.VIEWER_TOO_SLOW,
            f"this viewer missed {viewer.missed_in_row} chunks in a row: too far behind "
            "the stream to watch it live",
            request_id=self._request_id,
        )
        viewer.send_channel.close()
        scope = viewer.send_scope
        if scope is not None:
            scope.deadline = min(scope.deadline, trio.current_time() + self._close_timeout)
        self._metrics.viewer_dropped()
        logger.info("session %s: a viewer fell too far behind; closing it", self._request_id)

    def _join_unit(self, metadata: protocol.ChunkMetadata, data: bytes) -> _Unit:
        """A joiner's first chunk: the init segment in front (the first chunk has it)."""
        init = self._init_segment
        payload = data if data.startswith(init) else init + data
        joined = attrs.evolve(metadata, byte_length=len(payload))
        return (joined.to_json(), payload)


class ViewerMetrics(Protocol):
    """What watch links report for ``/metrics``: the server's `ServerMetrics`
    (`trio_vstream.server.metrics`) is one. A Protocol, since outputs sit below the
    server and import nothing of it."""

    def viewer_joined(self) -> None: ...
    def viewer_left(self) -> None: ...
    def viewer_dropped(self) -> None: ...
    def viewer_chunk_skipped(self) -> None: ...


class WatchRegistry:
    """The server's watch links: a `TapFactory` that gives each session a hub, and what
    serves a viewer once the server has accepted its WebSocket."""

    def __init__(
        self,
        config: WatchConfig,
        metrics: ViewerMetrics,
        *,
        close_timeout: float = 5.0,
        send_timeout: float = 60.0,
        node: str | None = None,
        max_chunk_frames: int | None = None,
    ) -> None:
        self.config = config
        self._link_prefix = WATCH_PREFIX if node is None else f"{WATCH_PREFIX}{node}/"
        """Where this server's links begin: with its node's name in a fleet, so that any
        server of it can tell who owns a link (``trio_vstream.server.fleet``)."""
        self.metrics = metrics
        self._close_timeout = close_timeout
        self._send_timeout = send_timeout
        self._hubs: weakref.WeakValueDictionary[str, WatchHub] = weakref.WeakValueDictionary()
        self._max_chunk_frames = max_chunk_frames
        """The engine's longest chunk, if it says (for a playlist's part target)."""
        self._playlists: dict[str, HlsWindow] = {}
        """Each link's LL-HLS window, from its session's start until ``linger`` after its
        end (held strongly: it outlives the session, which the hubs do not)."""
        self._connections = 0
        """Viewers' connections being served, refused ones included."""
        self._connections_changed = trio.Event()

    def taps(self, request_id: str, start: protocol.SessionStart) -> SessionTaps:
        """The `TapFactory`: a hub and its ``watch_path`` for each session."""
        if not self.config.enabled:
            return SessionTaps()
        token = secrets.token_urlsafe(32)
        hub = WatchHub(self, token, self.config, self._close_timeout)
        self._hubs[token] = hub
        link = self._link_prefix + token
        if self.config.hls is None:
            return SessionTaps([hub], {"watch_path": link})
        self._forget_old_playlists()
        window = HlsWindow(self.config.hls, max_part_seconds=self._part_seconds(start))
        self._playlists[token] = window
        return SessionTaps(
            [hub, window], {"watch_path": link, "hls_path": f"{link}{HLS_MARKER}index.m3u8"}
        )

    def playlist(self, token: str) -> HlsWindow | None:
        """The LL-HLS window of the link at ``token``: its session runs, or ended less than
        ``linger`` ago."""
        self._forget_old_playlists()
        return self._playlists.get(token)

    def _part_seconds(self, start: protocol.SessionStart) -> float:
        """The longest part a session's playlist declares: the engine's longest chunk at
        the session's frame rate, or ``hls_part_seconds``."""
        if self._max_chunk_frames is None:
            return self.config.hls_part_seconds
        return min(60.0, self._max_chunk_frames / start.video.fps)

    def _forget_old_playlists(self) -> None:
        """Drop the windows whose linger is over, and those of sessions that ended before
        they could say so (their hub is gone, and they never will)."""
        now = trio.current_time()
        for token, window in list(self._playlists.items()):
            ended = window.ended_at
            if (ended is None and token not in self._hubs) or (
                ended is not None and ended + window.settings.linger <= now
            ):
                del self._playlists[token]

    def hub(self, token: str) -> WatchHub | None:
        """The running session's hub (a dict lookup by hash: the time taken tells
        nothing about how much of a guessed token was right)."""
        return self._hubs.get(token)

    def forget(self, token: str) -> None:
        self._hubs.pop(token, None)

    @property
    def connections(self) -> int:
        """Viewers' connections being served now (refused ones until they close)."""
        return self._connections

    async def wait_connections_closed(self) -> None:
        """Return once no viewer's connection is being served.

        For the server's drain: when the last session has ended, its viewers may still
        be sending what was queued for them and the terminal message; the drain waits
        for that (under its own deadline) instead of cutting them off.
        """
        while self._connections:
            await self._connections_changed.wait()

    @contextlib.contextmanager
    def connection(self) -> Iterator[None]:
        """Count a viewer's connection while inside: from before its handshake until it
        closes, refused ones included (the server's drain waits for them)."""
        self._connections += 1
        try:
            yield
        finally:
            self._connections -= 1
            self._connections_changed.set()
            self._connections_changed = trio.Event()

    def admit(self, token: str) -> tuple[WatchHub, Viewer] | protocol.Error:
        """A new viewer of the session at ``token``, or the error that refuses it: no
        such session (``watch_not_found``), or it has all its viewers (``server_busy``).
        An admitted viewer is attached: `serve` it, which detaches it at the end."""
        hub = self.hub(token)
        if hub is None:
            return protocol.Error(
                ErrorCode.WATCH_NOT_FOUND,
                "no running session at this watch link (it may have ended)",
            )
        viewer = hub.attach()
        if viewer is None:
            return protocol.Error(
                ErrorCode.SERVER_BUSY,
                f"this session has its {self.config.max_viewers} viewers; try again later",
            )
        return hub, viewer

    async def serve(self, ws: WebSocketConnection, hub: WatchHub, viewer: Viewer) -> None:
        """One admitted viewer's connection, from its accepted WebSocket to the close."""
        try:
            await _ViewerConnection(ws, hub, viewer, self._close_timeout, self._send_timeout).run()
        finally:
            hub.detach(viewer)


class _Gone(Exception):
    """The viewer's socket cannot be written any more (closed, or a send was cut)."""


class _ViewerConnection:
    def __init__(
        self,
        ws: WebSocketConnection,
        hub: WatchHub,
        viewer: Viewer,
        close_timeout: float,
        send_timeout: float,
    ) -> None:
        self._ws = ws
        self._hub = hub
        self._viewer = viewer
        self._close_timeout = close_timeout
        self._send_timeout = send_timeout
        self._lock = trio.Lock()
        self._broken = False

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read, nursery.cancel_scope)
            with contextlib.suppress(_Gone):  # the socket is gone; nothing left to do
                await self._write()
            nursery.cancel_scope.cancel()

    async def _write(self) -> None:
        viewer = self._viewer
        async for unit in viewer.receive_channel:
            if viewer.kicked is not None:
                break
            await self._send(unit, self._send_timeout)
        final = viewer.kicked or self._hub.terminal
        if final is not None:
            await self._send((final.to_json(),), self._close_timeout)
        with trio.move_on_after(self._close_timeout):
            await self._ws.aclose()

    async def _read(self, connection: trio.CancelScope) -> None:
        """Answer what the viewer sends: it may ping; everything else is the owner's."""
        while True:
            try:
                raw = await self._ws.get_message()
            except ConnectionClosed:
                connection.cancel()  # gone: nothing left to send it
                return
            reply = self._answer(raw)
            try:
                await self._send((reply.to_json(),), self._send_timeout)
            except _Gone:
                connection.cancel()
                return

    def _answer(self, raw: str | bytes) -> protocol.Pong | protocol.Error:
        start = self._hub.watch_start
        request_id = start.request_id if start is not None else None
        try:
            message = protocol.parse_control(raw)
        except protocol.ProtocolError as exc:
            return protocol.Error.from_protocol_error(exc, request_id)
        if isinstance(message, protocol.Ping):
            return protocol.Pong()
        if isinstance(message, protocol.Stop | protocol.Playback | protocol.InputEnd):
            what, event_id = message.TYPE, None
        else:
            what, event_id = "session.interaction", message.event_id
        return protocol.Error(
            ErrorCode.READ_ONLY,
            f"a watch link is read-only: only the session's owner may send {what}",
            request_id=request_id,
            event_id=event_id,
        )

    async def _send(self, unit: _Unit, timeout: float) -> None:
        """Send a unit whole, within ``timeout``; a send cut by its deadline leaves the
        socket broken (half a frame), so nothing more is written to it."""
        async with self._lock:
            if self._broken:
                raise _Gone
            with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                self._viewer.send_scope = scope
                try:
                    for message in unit:
                        await self._ws.send_message(message)
                except ConnectionClosed:
                    self._broken = True
                    raise _Gone from None
                finally:
                    self._viewer.send_scope = None
            if scope.cancelled_caught:
                self._broken = True
                raise _Gone


def viewer_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a ``video.start`` config that viewers see (`VIEWER_CONFIG_KEYS`)."""
    return {key: value for key, value in config.items() if key in VIEWER_CONFIG_KEYS}


__all__ = [
    "HLS_MARKER",
    "VIEWER_CONFIG_KEYS",
    "WATCH_PREFIX",
    "Viewer",
    "WatchConfig",
    "WatchHub",
    "WatchRegistry",
    "viewer_config",
]
