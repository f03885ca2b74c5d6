"""The client as a real-time viewer (issue 22): ``stream_video(playback=True)`` and
``python -m trio_vstream client --playback`` opt into vllm-omni's pacing with
``streaming_buffer_seconds`` and report the simulated viewer's playhead in
``session.playback``; against a scripted peer that paces as the spec says (it sends
more only once the reports say the playhead has moved), and through the command line.

The viewer's own rules (stalls, on-time chunks, the report schedule) are tables in
test_viewer.py; here is what goes over the wire, and what the summary says.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from trio_websocket import WebSocketConnection

from tests.client.test_client import encode_clip, finish, gradient_chunks
from tests.client.test_client_cli import run_cli
from tests.fake_reference import (
    Peer,
    receive_json,
    send_reference_chunk,
    send_session_done,
    start_peer,
)
from trio_vstream import cli
from trio_vstream.client import ScheduledInteraction, StreamOutcome, stream_video
from trio_vstream.client._flags import DEFAULT_BUFFER_SECONDS, _start_fields, add_client_arguments
from trio_vstream.engines.synthetic import SyntheticSettings

START = {"prompt": "a red circle", "size": "64x48", "fps": 8}
VIDEO_START_8FPS = json.dumps(
    {"type": "video.start", "request_id": "ref-1", "format": "m4s", "config": {"fps": 8}}
)


def positions(peer: Peer) -> list[float]:
    return [m["position_seconds"] for m in peer.received if m["type"] == "session.playback"]


async def receive_reports(ws: WebSocketConnection, peer: Peer, until: float) -> None:
    """Read the client's messages until a report at or past ``until`` seconds: what a
    paced server waits for before it generates more."""
    while True:
        message = await receive_json(ws, peer)
        if message["type"] == "session.playback" and message["position_seconds"] >= until:
            return


async def test_a_paced_session_reports_the_real_playhead(nursery: trio.Nursery) -> None:
    # A chunk of 2 frames at 8 fps (0.25 s), then one of 4 (0.5 s, so that the end of
    # the stream comes well before the playhead reaches it); the peer sends the second
    # only once the playhead has reached the end of the first: the viewer stalls there,
    # once, and its reports never run past what arrived.
    first, *rest = gradient_chunks(3, 2)
    blobs = encode_clip([first, np.concatenate(rest)], fps=8)

    async def paced(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_8FPS)
        await send_reference_chunk(ws, blobs[0], 0, 2)
        await receive_reports(ws, peer, until=0.25)
        await send_reference_chunk(ws, blobs[1], 1, 4)
        await receive_reports(ws, peer, until=0.35)
        await send_reference_chunk(ws, blobs[2], 0, 0)
        await send_session_done(ws, chunks=3)

    peer = await start_peer(nursery, paced)
    result = await stream_video(peer.url, {**START, "streaming_buffer_seconds": 0.5}, playback=True)
    assert result.outcome is StreamOutcome.COMPLETED and result.problems == []
    assert peer.received[0]["streaming_buffer_seconds"] == 0.5
    sent = positions(peer)
    # Every ~100 ms, strictly forward, never past the media that had arrived: 0.25 s
    # until the second chunk came (the stall was reported once, not repeated).
    assert len(sent) >= 3 and sent == sorted(set(sent))
    assert sent[0] >= 0.1
    first_chunk_only = [p for p in sent if p <= 0.25]
    assert first_chunk_only[-1] == 0.25 and sent.count(0.25) == 1
    assert [p for _, p in result.playback_sent][: len(sent)] == sent
    viewer = result.viewer
    assert viewer is not None
    figures = viewer.figures(viewer.clock)
    assert (figures.chunks, figures.late_chunks, figures.underruns) == (2, 1, 1)
    assert figures.stall_seconds > 0 and figures.buffered == 0.75
    summary = result.summary()["playback"]
    assert summary["streaming_buffer_seconds"] == 0.5
    assert summary["reports"] == len(result.playback_sent)
    assert summary["underruns"] == 1 and summary["on_time_share"] == 0.5
    assert summary["time_to_first_frame_s"] == pytest.approx(result.time_to_first_chunk, abs=1e-3)


async def test_an_unpaced_session_is_watched_but_gets_no_reports(nursery: trio.Nursery) -> None:
    # Without streaming_buffer_seconds the server knows no session.playback: the viewer
    # still simulates what a person saw (to the end of the stream: session.done), and
    # nothing is sent.
    blobs = encode_clip(gradient_chunks(2, 2), fps=8)

    async def unpaced(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_8FPS)
        for index, blob in enumerate(blobs[:-1]):
            await send_reference_chunk(ws, blob, index, 2)
        await send_reference_chunk(ws, blobs[-1], 0, 0)
        await send_session_done(ws, chunks=3)
        await ws.aclose()

    peer = await start_peer(nursery, unpaced)
    result = await stream_video(peer.url, START, playback=True)
    assert result.outcome is StreamOutcome.COMPLETED
    assert [m["type"] for m in peer.received] == ["session.start"]
    assert result.playback_sent == []
    summary = result.summary()["playback"]
    assert summary["streaming_buffer_seconds"] is None
    assert summary["chunks"] == 2 and summary["buffered_s"] == 0.5
    assert summary["underruns"] == 0 and summary["on_time_share"] == 1.0


async def test_a_viewer_interacts_when_its_playhead_gets_there(nursery: trio.Nursery) -> None:
    # The whole second of media arrives at once; an interaction at 0.5 s is sent when
    # the playhead reaches 0.5 s, half a second of playing later, not as soon as the
    # media reached it (what a client without a viewer does).
    blobs = encode_clip(gradient_chunks(2, 4), fps=8)
    received: dict[str, Any] = {}

    async def peer_script(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_8FPS)
        for index, blob in enumerate(blobs[:-1]):
            await send_reference_chunk(ws, blob, index, 4)
        while (message := await receive_json(ws, peer))["type"] != "session.interaction":
            pass
        received.update(message)
        await send_reference_chunk(ws, blobs[-1], 0, 0)
        await send_session_done(ws, chunks=3)

    peer = await start_peer(nursery, peer_script)
    result = await stream_video(
        peer.url,
        {**START, "streaming_buffer_seconds": 2.0},
        interactions=[ScheduledInteraction(at=0.5, prompt="blue")],
        playback=True,
    )
    assert result.outcome is StreamOutcome.COMPLETED, result.problems
    assert received["interaction"]["event"] == {"prompt": "blue"}
    [record] = result.interactions
    viewer = result.viewer
    assert viewer is not None and viewer.play_started_at is not None
    assert record.sent_at is not None and record.sent_media_time is not None
    assert record.sent_at - viewer.play_started_at >= 0.5  # it played half a second first
    assert 0.5 <= record.sent_media_time < 1.0  # the playhead's time, not the media's (1.0)
    assert result.media_time == 1.0


async def test_without_playback_there_is_no_viewer(nursery: trio.Nursery) -> None:
    blobs = encode_clip(gradient_chunks(1, 2), fps=8)

    async def reference(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_8FPS)
        await send_reference_chunk(ws, blobs[0], 0, 2)
        await send_reference_chunk(ws, blobs[1], 0, 0)
        await send_session_done(ws, chunks=2)

    peer = await start_peer(nursery, reference)
    result = await stream_video(peer.url, START)
    assert result.viewer is None and result.summary()["playback"] is None
    status, out, _ = finish(result)
    assert status == 0 and "time to first frame" not in out


@pytest.mark.slow
async def test_our_server_generates_no_further_ahead_than_the_buffer(start_server: Any) -> None:
    # A 1 s video in 0.25 s chunks, made far faster than real time, paced to a 0.5 s
    # buffer: each chunk arrives at most the buffer and one chunk (the one in flight)
    # ahead of the playhead last reported, so the video takes about its own length.
    running = await start_server(SyntheticSettings(chunk_frames=2))
    buffer_s, chunk_s = 0.5, 0.25
    result = await stream_video(
        running.url,
        {**START, "num_frames": 8, "streaming_buffer_seconds": buffer_s},
        playback=True,
    )
    assert result.outcome is StreamOutcome.COMPLETED and result.errors == []
    assert result.frames == 8 and result.playback_sent
    received = 0.0
    for chunk in result.chunks:
        if not chunk.num_frames:
            continue
        received += chunk.num_frames / 8
        reported = [p for t, p in result.playback_sent if t <= chunk.received_at]
        lead = received - (reported[-1] if reported else 0.0)
        assert lead <= buffer_s + chunk_s + 1e-9, (chunk, reported)
    assert result.first_chunk_at is not None and result.last_media_at is not None
    assert result.last_media_at - result.first_chunk_at >= 1.0 - buffer_s - chunk_s
    viewer = result.viewer
    assert viewer is not None and viewer.figures(viewer.clock).chunks == 4


async def test_a_startup_threshold_at_the_window_is_refused_before_connecting() -> None:
    with pytest.raises(ValueError, match="must stay below the generation window"):
        await stream_video(
            "ws://127.0.0.1:9/never",
            {**START, "streaming_buffer_seconds": 0.5},
            playback=True,
            startup_seconds=0.5,
        )


# ------------------------------------------------------------ the command line


def _fields(*flags: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_client_arguments(parser)
    return _start_fields(parser.parse_args(["a red circle", "-o", "o.mp4", *flags]))


def test_playback_opts_in_with_the_buffer() -> None:
    assert "streaming_buffer_seconds" not in _fields()
    assert _fields("--playback")["streaming_buffer_seconds"] == DEFAULT_BUFFER_SECONDS
    assert _fields("--playback", "--buffer-seconds", "0.4")["streaming_buffer_seconds"] == 0.4
    fields = _fields("--playback", "--buffer-seconds", "2", "--startup-seconds", "1.5")
    assert fields["streaming_buffer_seconds"] == 2.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--buffer-seconds", "1"], "--buffer-seconds goes with --playback"),
        (["--startup-seconds", "0.2"], "--startup-seconds goes with --playback"),
        (["--playback", "--buffer-seconds", "0"], "must be a number > 0"),
        (["--playback", "--buffer-seconds", "nan"], "must be a number > 0"),
        (["--playback", "--startup-seconds", "-1"], "must be a number >= 0"),
        (["--playback", "--startup-seconds", "1"], "must stay below the generation window"),
        (
            ["--playback", "--buffer-seconds", "0.5", "--startup-seconds", "0.5"],
            "must stay below the generation window",
        ),
        (["--playback", "--param", "streaming_buffer_seconds=2"], "conflicts"),
    ],
)
def test_playback_usage_errors_exit_2(
    args: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:  # argparse's errors exit; ours return 2
        sys.exit(cli.main(["client", "x", "-o", "o.mp4", *args]))
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
async def test_cli_playback_reports_and_summarises(nursery: trio.Nursery, tmp_path: Path) -> None:
    # One 1 s chunk: the session ends long before the playhead runs out.
    blobs = encode_clip(gradient_chunks(1, 8), fps=8)

    async def paced(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_8FPS)
        await send_reference_chunk(ws, blobs[0], 0, 8)
        await receive_reports(ws, peer, until=0.2)
        await send_reference_chunk(ws, blobs[1], 0, 0)
        await send_session_done(ws, chunks=2)

    peer = await start_peer(nursery, paced)
    base = ["a red circle", "--url", peer.url, "--raw", str(tmp_path / "o.m4s"), "--fps", "8"]
    run = await run_cli(tmp_path, *base, "--playback", "--buffer-seconds", "0.75", "--json")
    assert run.returncode == 0, run.stderr
    assert peer.received[0]["streaming_buffer_seconds"] == 0.75
    assert len(positions(peer)) >= 2
    playback = run.summary["playback"]
    assert playback["streaming_buffer_seconds"] == 0.75 and playback["reports"] >= 2
    assert playback["chunks"] == playback["chunks_on_time"] == 1
    assert playback["underruns"] == 0 and playback["continuous_play_ratio"] == 1.0

    peer = await start_peer(nursery, paced)
    base[2] = peer.url
    run = await run_cli(tmp_path, *base, "--playback", "--buffer-seconds", "0.75")
    assert run.returncode == 0, run.stderr
    assert re.search(r"^time to first frame +\d+\.\d{3} s$", run.stdout, re.MULTILINE)
    assert re.search(
        r"^playback +0 underruns, 0\.000 s stalled, continuous play 1\.000, "
        r"1/1 chunks on time$",
        run.stdout,
        re.MULTILINE,
    ), run.stdout
    assert re.search(
        r"^paced +streaming_buffer_seconds 0\.75, \d+ playback reports$", run.stdout, re.MULTILINE
    ), run.stdout
