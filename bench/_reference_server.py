"""A stand-in for the vllm-omni reference handler, for throughput comparisons.

``python -m bench._reference_server --port 0 [--engine-arg K=V ...]`` serves
``/v1/realtime/video`` the way the reference handler (its text is
``/work/shared/reference/handler_reference.txt`` in the project's workspace) is built,
which is what a throughput comparison is about: one asyncio event loop; per session,
one encoder, and each chunk encoded **in the event loop** as it arrives (the handler
calls ``encoder.encode(video)`` in its async generator), then its metadata and bytes
sent; the engine elsewhere (vllm-omni's runs in other processes; here the synthetic
engine's ``next_chunk`` runs in a thread pool, as this project's server runs it). No
encode limiter, no pacing, no stall guard, no validation beyond what it needs: it is a
yardstick, not a server. Pings are answered with ``session.pong`` and a
``session.stop`` ends the session after the chunk in hand, with ``session.done``.

What is not the reference's: the encoder is this project's `FragmentedMP4Encoder`
(the reference muxes with FFmpeg's mov muxer and holds each chunk's last frame back; the
x264 settings are the same), the WebSocket is wsproto over asyncio streams (the
reference's is Starlette's), and the engine is in-process. ``GET /stats`` is not
served: the harness reports what needs it as unavailable.

Run side by side with this server: ``python bench/run.py --scenario concurrency
--levels 8 --compare "--engine synthetic ..." "python -m bench._reference_server"``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import signal
import sys
from typing import Any, Literal

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Request,
    TextMessage,
)

from trio_vstream import protocol
from trio_vstream.engines.contract import Checkpoint, GenerationRequest
from trio_vstream.engines.frames import frames_to_uint8_array
from trio_vstream.engines.synthetic import SyntheticEngine, parse_settings
from trio_vstream.media.encoding import FragmentedMP4Encoder

_REQUESTS = itertools.count(1)


class Connection:
    """One WebSocket over asyncio streams: text messages in a queue, sends in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.ws = WSConnection(ConnectionType.SERVER)
        self.texts: asyncio.Queue[str | None] = asyncio.Queue()
        self.closed = False
        self._parts: list[str] = []

    def _handle(self, event: Event) -> None:
        if isinstance(event, Request):
            self.writer.write(self.ws.send(AcceptConnection()))
        elif isinstance(event, TextMessage):
            self._parts.append(event.data)
            if event.message_finished:
                self.texts.put_nowait("".join(self._parts))
                self._parts = []
        elif isinstance(event, Ping):
            self.writer.write(self.ws.send(event.response()))
        elif isinstance(event, CloseConnection):
            if not self.closed:
                self.writer.write(self.ws.send(event.response()))
            self.closed = True

    async def read(self) -> None:
        """Read until the peer goes; then a None in the queue."""
        try:
            while not self.closed and (data := await self.reader.read(65536)):
                self.ws.receive_data(data)
                for event in self.ws.events():
                    self._handle(event)
        except (ConnectionError, Exception):  # a yardstick: any failure ends the reading
            pass
        finally:
            self.closed = True
            self.texts.put_nowait(None)

    async def send(self, data: str | bytes) -> None:
        if self.closed:
            raise ConnectionError("closed")
        message = TextMessage(data=data) if isinstance(data, str) else BytesMessage(data=data)
        self.writer.write(self.ws.send(message))
        await self.writer.drain()

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.writer.write(self.ws.send(CloseConnection(code=1000)))
                await self.writer.drain()
            except Exception:
                pass
        self.writer.close()


class ReferenceServer:
    def __init__(self, engine: SyntheticEngine) -> None:
        self.engine = engine
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(reader, writer)
        reading = asyncio.create_task(conn.read())
        try:
            text = await conn.texts.get()
            if text is not None:
                await self._session(conn, json.loads(text))
        except Exception:
            pass
        finally:
            await conn.close()
            reading.cancel()

    async def _session(self, conn: Connection, start: dict[str, Any]) -> None:
        if start.get("type") != "session.start":
            return
        width, height = (int(v) for v in str(start.get("size", "256x256")).split("x"))
        fps = int(start.get("fps", 24))
        request = GenerationRequest(
            request_id=f"ref-{next(_REQUESTS)}",
            prompt=str(start.get("prompt", "")),
            width=width,
            height=height,
            fps=fps,
            num_frames=int(start.get("num_frames", 48)),
            seed=start.get("seed"),
        )
        rid = request.request_id
        loop = asyncio.get_running_loop()
        stream = await loop.run_in_executor(self.pool, self.engine.open_stream, request)
        encoder = FragmentedMP4Encoder(width=width, height=height, fps=fps)
        config = {"width": width, "height": height, "fps": fps, "num_frames": request.num_frames}
        await conn.send(protocol.VideoStart(rid, "mp4", config).to_json())
        stopped = asyncio.Event()
        control = asyncio.create_task(self._control(conn, stopped))
        sent = 0

        async def chunk_out(
            kind: Literal["media", "trailer"], frames: int, data: bytes, index: int | None
        ) -> None:
            nonlocal sent
            metadata = protocol.ChunkMetadata(
                request_id=rid,
                kind=kind,
                num_frames=frames,
                byte_length=len(data),
                generation_chunk_index=index,
                started_event_ids=(),
                active_event_ids=(),
                completed_event_ids=(),
                transport_chunk_index=sent,
            )
            await conn.send(metadata.to_json())
            await conn.send(data)
            sent += 1

        try:
            index = 0
            while not stopped.is_set() and not conn.closed:
                chunk = await loop.run_in_executor(self.pool, stream.next_chunk, Checkpoint())
                if chunk is None:
                    break
                frames = frames_to_uint8_array(chunk.frames, width=width, height=height)
                data = encoder.encode(frames)  # in the event loop, as the reference does
                await chunk_out("media", frames.shape[0], data, index)
                index += 1
            if not stopped.is_set():
                await chunk_out("trailer", 0, encoder.close(), None)
            await conn.send(protocol.SessionDone(rid, sent, stopped.is_set()).to_json())
        finally:
            control.cancel()
            encoder.close()
            stream.close()

    async def _control(self, conn: Connection, stopped: asyncio.Event) -> None:
        while (text := await conn.texts.get()) is not None:
            kind = json.loads(text).get("type")
            if kind == "session.ping":
                await conn.send(protocol.Pong().to_json())
            elif kind == "session.stop":
                stopped.set()
        stopped.set()


async def main_async(port: int, engine_args: dict[str, str]) -> None:
    server = ReferenceServer(SyntheticEngine(parse_settings(engine_args)))
    listener = await asyncio.start_server(server.serve, "127.0.0.1", port)
    bound = listener.sockets[0].getsockname()[1]
    print(f"reference stand-in serving ws://127.0.0.1:{bound}/v1/realtime/video", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    async with listener:
        await stop.wait()
    server.pool.shutdown(wait=False, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._reference_server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--engine", default="synthetic", choices=["synthetic"])
    parser.add_argument("--engine-arg", action="append", default=[], metavar="K=V")
    parser.add_argument("--max-sessions", type=int, default=None, help="ignored")
    args = parser.parse_args(argv)
    engine_args = dict(item.split("=", 1) for item in args.engine_arg)
    asyncio.run(main_async(args.port, engine_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
