"""A scripted stand-in for other servers of the protocol (the vllm-omni reference).

Each test gives `start_peer` a script that talks to one connection, so the client can
be checked against behaviour our own server never shows: reference-style metadata,
errors without a code, a server that ignores session.stop or drops the connection.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@attrs.define
class Peer:
    """A scripted server: the script talks to one connection; client messages are kept."""

    url: str
    received: list[Any]


Script = Callable[[WebSocketConnection, Peer], Awaitable[None]]


async def start_peer(nursery: trio.Nursery, script: Script) -> Peer:
    peer = Peer(url="", received=[])

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        with contextlib.suppress(ConnectionClosed):
            await script(ws, peer)

    server = await nursery.start(
        partial(serve_websocket, handler, "127.0.0.1", 0, ssl_context=None)
    )
    peer.url = f"ws://127.0.0.1:{server.port}/v1/realtime/video"
    return peer


async def receive_json(ws: WebSocketConnection, peer: Peer) -> dict[str, Any]:
    message = json.loads(await ws.get_message())
    peer.received.append(message)
    return message


async def send_reference_chunk(
    ws: WebSocketConnection, blob: bytes, index: int, frames: int
) -> None:
    """Metadata as older reference servers send it: no transport_chunk_index."""
    await ws.send_message(
        json.dumps(
            {
                "type": "video.chunk_metadata",
                "request_id": "ref-1",
                "kind": "media" if frames else "trailer",
                "num_frames": frames,
                "byte_length": len(blob),
                "generation_chunk_index": index if frames else None,
                "started_event_ids": [],
                "active_event_ids": [],
                "completed_event_ids": [],
            }
        )
    )
    await ws.send_message(blob)


VIDEO_START_REF = json.dumps(
    {"type": "video.start", "request_id": "ref-1", "format": "m4s", "config": {"prompt": "x"}}
)


async def send_session_done(ws: WebSocketConnection, chunks: int, stopped: bool = False) -> None:
    await ws.send_message(
        json.dumps(
            {"type": "session.done", "request_id": "ref-1", "chunks": chunks, "stopped": stopped}
        )
    )


def sent_interactions(peer: Peer) -> list[tuple[str, str]]:
    """(event_id, prompt) of each session.interaction the peer received, in order."""
    return [
        (m["interaction"]["event_id"], m["interaction"]["event"]["prompt"])
        for m in peer.received
        if m["type"] == "session.interaction"
    ]
