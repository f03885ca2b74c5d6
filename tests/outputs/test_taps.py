"""Session taps (what viewers and recordings build on): a tap sees exactly what the
client got, in order, and a tap that fails is dropped without touching the session."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import Transcript, is_type, receive_into, receive_until
from trio_vstream import protocol
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.outputs.taps import SessionTaps
from trio_vstream.outputs.watch import WatchConfig

START = {"type": "session.start", "prompt": "a red circle", "size": "64x48", "num_frames": 16}
SLOW = SyntheticSettings(step_delay=0.01, chunk_frames=4, steps=2)


class ListTap:
    """Keeps every call, as the JSON (or bytes) the client was sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.init_segments: list[bytes] = []

    def started(self, video_start: protocol.VideoStart, start: protocol.SessionStart) -> None:
        self.calls.append(("started", json.loads(video_start.to_json())))
        self.prompt = start.request.prompt

    def chunk(self, metadata: protocol.ChunkMetadata, data: bytes, init_segment: bytes) -> None:
        self.calls.append(("chunk", json.loads(metadata.to_json())))
        self.calls.append(("data", data))
        self.init_segments.append(init_segment)

    def interaction(
        self, event_id: str, message: protocol.Interaction, error: protocol.Error | None
    ) -> None:
        self.calls.append(("interaction", (event_id, message.prompt, error and error.code.value)))

    def ended(self, outcome: str, terminal: Any) -> None:
        self.calls.append(("ended", (outcome, json.loads(terminal.to_json()))))


class BrokenTap(ListTap):
    def chunk(self, metadata: protocol.ChunkMetadata, data: bytes, init_segment: bytes) -> None:
        raise RuntimeError("disk on fire")


def interaction(event_id: str, prompt: str = "a blue circle") -> str:
    event = {"event_id": event_id, "event": {"prompt": prompt}}
    return json.dumps({"type": "session.interaction", "interaction": event})


async def test_a_tap_sees_what_the_client_got_in_order(start_server: Any) -> None:
    taps: list[ListTap] = []

    def factory(request_id: str, start: protocol.SessionStart) -> SessionTaps:
        taps.append(ListTap())
        return SessionTaps([taps[-1]], {"watch_path": f"/watch/{request_id}"})

    running = await start_server(SLOW, taps=factory)
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps(START))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(interaction("e1"))
        await ws.send_message(interaction("e1"))  # a conflict: refused
        await receive_into(ws, transcript)
    [tap] = taps
    video_start = transcript.messages[0]
    assert video_start["watch_path"] == f"/watch/{video_start['request_id']}"
    assert tap.prompt == "a red circle"
    video = [
        m
        for m in transcript.messages
        if isinstance(m, bytes) or m["type"] in ("video.start", "video.chunk_metadata")
    ]
    seen = [call for call in tap.calls if call[0] != "interaction"]
    assert [c[1] for c in seen[:-1]] == video
    assert seen[-1] == ("ended", ("completed", transcript.messages[-1]))
    interactions = [call[1] for call in tap.calls if call[0] == "interaction"]
    assert interactions == [
        ("e1", "a blue circle", None),
        ("e1", "a blue circle", "event_id_conflict"),
    ]
    # The init segment: what the first chunk's bytes begin with, for followers who join later.
    [first, *_] = [m for m in transcript.messages if isinstance(m, bytes)]
    assert tap.init_segments[0] and first.startswith(tap.init_segments[0])
    assert len(set(tap.init_segments)) == 1


async def test_a_tap_that_fails_is_dropped_and_the_session_goes_on(start_server: Any) -> None:
    broken, healthy = BrokenTap(), ListTap()
    running = await start_server(
        SLOW, taps=lambda request_id, start: SessionTaps([broken, healthy])
    )
    transcript = await running.run_session(START)
    assert transcript.terminal[-1]["type"] == "session.done"
    assert [c[0] for c in broken.calls] == ["started"]  # dropped at its first chunk
    assert sum(1 for c in healthy.calls if c[0] == "chunk") == 5  # 4 media + trailer
    assert healthy.calls[-1][0] == "ended"


async def test_a_factory_that_fails_leaves_the_session_without_taps(start_server: Any) -> None:
    def factory(request_id: str, start: protocol.SessionStart) -> SessionTaps:
        raise OSError("no space left on device")

    # Watching off: no other factory could add a field either.
    running = await start_server(SLOW, taps=factory, watch=WatchConfig(max_viewers=0))
    transcript = await running.run_session(START)
    assert transcript.terminal[-1]["type"] == "session.done"
    assert "watch_path" not in transcript.messages[0]
