"""A fleet of servers: a watch link names its node, and any server relays its viewer to
the node that owns the session (``trio_vstream.server.fleet``).

Two real servers in one Trio run: ``owner`` (node ``a``) runs the session, ``relay``
(node ``b``) knows it as a peer. A viewer that opens the link on the relay gets what a
viewer on the owner gets, byte for byte; a link that names a node nobody knows, or one
that is down, gets ``watch_not_found`` at once; a name that is not a DNS label is never
dialled; what the owner refuses is refused the same way.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.conftest import (
    CLIENT_MAX_MESSAGE,
    RunningServer,
    Transcript,
    is_type,
    receive_into,
    receive_until,
)
from trio_vstream.cli import build_parser
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.outputs.recording import Recorder
from trio_vstream.outputs.watch import WATCH_PREFIX, WatchConfig
from trio_vstream.server import fleet
from trio_vstream.server.access import AccessPolicy
from trio_vstream.server.fleet import FleetConfig

START = {"type": "session.start", "prompt": "a red circle", "size": "64x48", "num_frames": 24}
SLOW = SyntheticSettings(step_delay=0.02, chunk_frames=4, steps=2)


def url(running: RunningServer, path: str) -> str:
    return f"ws://127.0.0.1:{running.server.port}{path}"


async def pair(start_server: Any, **kwargs: Any) -> tuple[RunningServer, RunningServer]:
    """Node ``a`` (the owner) and node ``b``, which lists ``a`` as its peer."""
    owner = await start_server(SLOW, fleet=FleetConfig(node_name="a"), **kwargs)
    peers = {"a": ("127.0.0.1", owner.server.port)}
    relay = await start_server(SLOW, fleet=FleetConfig(node_name="b", peers=peers), **kwargs)
    return owner, relay


async def watch_into(address: str, transcript: Transcript, **kwargs: Any) -> None:
    async with open_websocket_url(address, max_message_size=CLIENT_MAX_MESSAGE, **kwargs) as ws:
        await receive_into(ws, transcript)


def binaries(transcript: Transcript) -> list[bytes]:
    return [m for m in transcript.messages if isinstance(m, bytes)]


async def test_a_viewer_on_another_node_gets_what_a_viewer_on_the_owner_gets(
    start_server: Any,
) -> None:
    owner, relay = await pair(start_server)
    direct, relayed, session = Transcript(), Transcript(), Transcript()
    async with owner.connect() as ws:
        await ws.send_message(json.dumps(START))
        video_start = await receive_until(ws, session, is_type("video.start"))
        path = video_start["watch_path"]
        assert path.startswith(f"{WATCH_PREFIX}a/")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_into, url(owner, path), direct)
            nursery.start_soon(watch_into, url(relay, path), relayed)
            await receive_into(ws, session)
    assert session.terminal[-1]["type"] == "session.done"
    # Both joined before the first chunk was made, so both got the whole stream.
    assert relayed.types == direct.types
    assert relayed.json[0]["type"] == "watch.start"
    assert relayed.json[-1] == direct.json[-1]
    assert b"".join(binaries(relayed)) == b"".join(binaries(direct))
    assert len(binaries(relayed)) == len(session.of_type("video.chunk_metadata"))
    assert relayed.close_code == direct.close_code == 1000
    assert 'trio_vstream_viewers_relayed_total{model="synthetic"} 1.0' in (
        relay.server.metrics.exposition().decode()
    )


async def test_a_relayed_viewers_ping_reaches_the_owner_and_its_pong_comes_back(
    start_server: Any,
) -> None:
    owner, relay = await pair(start_server)
    async with owner.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 400}))
        path = (await receive_until(ws, Transcript(), is_type("video.start")))["watch_path"]
        async with open_websocket_url(
            url(relay, path), max_message_size=CLIENT_MAX_MESSAGE
        ) as viewer:
            await viewer.send_message(json.dumps({"type": "session.ping"}))
            seen = Transcript()
            await receive_until(viewer, seen, is_type("session.pong"))
            await viewer.send_message(json.dumps({"type": "session.stop"}))
            refused = await receive_until(viewer, seen, is_type("error"))
            assert refused["code"] == "read_only"
        await ws.send_message(json.dumps({"type": "session.stop"}))
        await receive_into(ws, Transcript())


async def test_a_link_to_an_ended_session_on_another_node_is_refused_at_once(
    start_server: Any,
) -> None:
    owner, relay = await pair(start_server)
    session = await owner.run_session(START)
    path = session.json[0]["watch_path"]
    seen = Transcript()
    with trio.fail_after(5):
        await watch_into(url(relay, path), seen)
    assert [m["code"] for m in seen.json] == ["watch_not_found"]


@pytest.mark.parametrize(
    "node",
    [
        "c",  # no such peer, and no domain to find it under
        "a.example.org",  # a DNS name, not a label: never dialled
        "A",  # not lower case
        "-a",
        "x" * 64,
    ],
)
async def test_a_link_naming_an_unknown_node_gets_watch_not_found_at_once(
    start_server: Any, node: str
) -> None:
    _, relay = await pair(start_server)
    seen = Transcript()
    with trio.fail_after(5):
        await watch_into(url(relay, f"{WATCH_PREFIX}{node}/{'t' * 43}"), seen)
    assert [m["code"] for m in seen.json] == ["watch_not_found"]
    assert 'trio_vstream_viewers_relayed_total{model="synthetic"} 1.0' not in (
        relay.server.metrics.exposition().decode()
    )


async def test_a_peer_that_is_down_gets_the_viewer_watch_not_found_at_once(
    start_server: Any,
) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    relay = await start_server(
        SLOW, fleet=FleetConfig(node_name="b", peers={"gone": ("127.0.0.1", port)})
    )
    seen = Transcript()
    with trio.fail_after(5):
        await watch_into(url(relay, f"{WATCH_PREFIX}gone/{'t' * 43}"), seen)
    assert [m["code"] for m in seen.json] == ["watch_not_found"]


def test_only_labels_are_placed_under_the_peer_domain() -> None:
    config = FleetConfig(node_name="pod-0", peer_domain="peers.ns.svc.cluster.local")
    found = fleet.locate(config, "pod-3", port=8000, relayed=False)
    assert found == fleet.Peer("pod-3", "pod-3.peers.ns.svc.cluster.local", 8000)
    assert fleet.locate(config, "pod-0", port=8000, relayed=False) is fleet.LOCAL
    assert fleet.locate(config, None, port=8000, relayed=False) is fleet.LOCAL
    for hostile in ["evil.com", "evil.com:80", "..", "", "a_b", "a b", "%2e", "x" * 64]:
        refused = fleet.locate(config, hostile, port=8000, relayed=False)
        assert isinstance(refused, fleet.protocol.Error), hostile
    # A relayed request is never relayed again: a fleet whose peers disagree cannot loop.
    assert isinstance(fleet.locate(config, "pod-3", port=8000, relayed=True), fleet.protocol.Error)


async def test_a_relayed_request_for_a_node_it_is_not_is_not_relayed_again(
    start_server: Any,
) -> None:
    # b thinks "c" is a, a thinks "c" is b: without the header this would bounce forever.
    owner = await start_server(SLOW, fleet=FleetConfig(node_name="a"))
    relay = await start_server(
        SLOW,
        fleet=FleetConfig(node_name="b", peers={"c": ("127.0.0.1", owner.server.port)}),
    )
    seen = Transcript()
    with trio.fail_after(5):
        await watch_into(url(relay, f"{WATCH_PREFIX}c/{'t' * 43}"), seen)
    assert [m["code"] for m in seen.json] == ["watch_not_found"]
    assert 'trio_vstream_viewers_relayed_total{model="synthetic"} 1.0' in (
        relay.server.metrics.exposition().decode()
    )


async def test_what_the_owner_refuses_the_relay_refuses_the_same_way(
    start_server: Any,
) -> None:
    keys = AccessPolicy(api_keys=("secret",))
    owner, relay = await pair(start_server, access=keys, watch=WatchConfig(requires_key=True))
    bearer = [("Authorization", "Bearer secret")]
    async with owner.connect(extra_headers=bearer) as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 400}))
        path = (await receive_until(ws, Transcript(), is_type("video.start")))["watch_path"]
        # The relay lets the viewer through its own check with the key; the owner sees the
        # same key, forwarded, and serves it.
        seen = Transcript()
        async with open_websocket_url(
            url(relay, path), extra_headers=bearer, max_message_size=CLIENT_MAX_MESSAGE
        ) as viewer:
            await receive_until(viewer, seen, is_type("watch.start"))
        await ws.send_message(json.dumps({"type": "session.stop"}))
        await receive_into(ws, Transcript())


def test_node_names_on_the_command_line_are_labels() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--node-name", "gpu-3", "--peer", "gpu-4=10.0.0.12:8001", "--peer", "g5=[::1]:9"]
    )
    assert args.node_name == "gpu-3"
    assert dict(args.peers) == {"gpu-4": ("10.0.0.12", 8001), "g5": ("::1", 9)}
    for bad in (
        ["--node-name", "Gpu"],
        ["--node-name", "a.b"],
        ["--peer", "x=host"],
        ["--peer", "x=host:0"],
        ["--peer", "x.y=h:1"],
        ["--peer", "=h:1"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])


async def test_a_recording_says_which_node_made_it(
    start_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_vstream.outputs.recording")
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic", node="gpu-7")
    running = await start_server(SLOW, taps=recorder, fleet=FleetConfig(node_name="gpu-7"))
    session = await running.run_session(START)
    video_start = session.json[0]
    request_id = video_start["request_id"]
    assert video_start["recording"] == {"file": f"{request_id}.mp4", "node": "gpu-7"}
    await trio.to_thread.run_sync(recorder.wait_idle, 10.0)
    record = json.loads((tmp_path / f"{request_id}.json").read_text())
    assert record["node"] == "gpu-7"
    assert (tmp_path / video_start["recording"]["file"]).stat().st_size > 0
    recording = tmp_path / video_start["recording"]["file"]
    assert f"session {request_id}: recording to {recording} on node gpu-7" in caplog.text


async def test_a_refused_handshake_is_passed_back(start_server: Any) -> None:
    keys = AccessPolicy(api_keys=("secret",))
    owner = await start_server(SLOW, fleet=FleetConfig(node_name="a"))
    # The relay lets watch links in without a key; the owner wants one for them.
    owner_strict = await start_server(
        SLOW, access=keys, watch=WatchConfig(requires_key=True), fleet=FleetConfig(node_name="s")
    )
    relay = await start_server(
        SLOW,
        fleet=FleetConfig(
            node_name="b",
            peers={
                "a": ("127.0.0.1", owner.server.port),
                "s": ("127.0.0.1", owner_strict.server.port),
            },
        ),
    )
    with pytest.raises(ConnectionRejected) as refused:
        async with open_websocket_url(url(relay, f"{WATCH_PREFIX}s/{'t' * 43}")):
            pass
    assert refused.value.status_code == 401


async def test_a_draining_server_relays_its_viewers_to_the_end_of_the_session(
    start_server: Any,
) -> None:
    # The session outlasts the relay's close timeout many times over: only the grace,
    # which relayed viewers share with sessions, lets the viewer see its end.
    owner, relay = await pair(start_server, shutdown_grace=30.0, close_timeout=0.2)
    relayed = Transcript()
    async with owner.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 200}))
        path = (await receive_until(ws, Transcript(), is_type("video.start")))["watch_path"]
        async with (
            trio.open_nursery() as nursery,
            open_websocket_url(url(relay, path), max_message_size=CLIENT_MAX_MESSAGE) as viewer,
        ):
            await receive_until(viewer, relayed, is_type("watch.start"))
            # The relay has no session of its own; its drain waits for the viewer.
            relay.server.shutdown()
            nursery.start_soon(receive_into, ws, Transcript())
            await receive_into(viewer, relayed)
    assert relayed.json[-1]["type"] == "session.done"
    assert relayed.close_code == 1000
