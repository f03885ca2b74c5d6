"""The client's command line (``python -m trio_vstream client``): flags, signals, the
progress line, output files and exit statuses, run as a process or in-process.
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import av
import numpy as np
import pytest
import trio
from trio_websocket import WebSocketConnection

from tests.client.test_client import (
    KEY,
    REFUSED_401,
    assert_plays,
    assert_progressive_mp4,
    decode,
    encode_clip,
    gradient_chunks,
    mp4_boxes,
)
from tests.fake_reference import (
    VIDEO_START_REF,
    Peer,
    free_port,
    receive_json,
    send_reference_chunk,
    start_peer,
)
from trio_vstream import cli
from trio_vstream.client import (
    API_KEY_ENV,
)
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.server.access import AccessPolicy

REPO = Path(__file__).resolve().parents[2]
PROGRESS = r"streaming: [1-9]\d* chunks, [1-9]\d* frames, \d+\.\d fps, \d+\.\d s\x1b\[K"


@attrs.frozen
class CliRun:
    returncode: int
    stdout: str
    stderr: str

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads(self.stdout)


async def run_cli(
    tmp_path: Path,
    *args: str,
    while_running: Callable[[trio.Process], Awaitable[None]] | None = None,
    timeout: float = 20,
    env: dict[str, str] | None = None,
    command: str = "client",
) -> CliRun:
    """``python -m trio_vstream client ARGS`` in a subprocess (outputs go to files);
    ``command`` names another subcommand (``watch``).

    The environment is this one plus ``env``, less any API key of the developer's own:
    a test gives the client a key only on purpose.
    """
    out_path, err_path = tmp_path / "cli.stdout", tmp_path / "cli.stderr"
    environment = {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | (env or {})
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "trio_vstream", command, *args],
            stdout=out,
            stderr=err,
            cwd=REPO,
            env=environment,
        )
    try:
        with trio.fail_after(timeout):
            if while_running is not None:
                await while_running(process)
            await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return CliRun(process.returncode, out_path.read_text(), err_path.read_text())


# ------------------------------------------------------------ the command line


@pytest.mark.slow
async def test_cli_api_key_from_the_flag_or_the_environment(
    start_server: Any, tmp_path: Path
) -> None:
    running = await start_server(access=AccessPolicy(api_keys=(KEY,)))
    base = ["a red circle", "--url", running.url, "-o", str(tmp_path / "o.mp4"), "--json"]
    base += ["--size", "32x16", "--fps", "8", "--num-frames", "4"]

    from_env = await run_cli(tmp_path, *base, env={API_KEY_ENV: KEY})
    assert from_env.returncode == 0, from_env.stderr
    assert from_env.summary["frames"] == 4
    # The flag wins over the environment.
    from_flag = await run_cli(tmp_path, *base, "--api-key", KEY, env={API_KEY_ENV: "stale"})
    assert from_flag.returncode == 0, from_flag.stderr
    assert KEY not in from_env.stdout + from_env.stderr + from_flag.stdout + from_flag.stderr
    assert len(running.engine.streams) == 2


@pytest.mark.slow
async def test_cli_without_the_key_says_so_in_one_line_and_exits_3(
    start_server: Any, tmp_path: Path
) -> None:
    running = await start_server(access=AccessPolicy(api_keys=(KEY,)))
    output = tmp_path / "o.mp4"
    for extra in ([], ["--api-key", "wrong-key-7c1e"]):
        run = await run_cli(tmp_path, "x", "--url", running.url, "-o", str(output), *extra)
        assert run.returncode == 3, run.stderr
        assert run.stderr.splitlines() == [f"error: cannot connect to {running.url}: {REFUSED_401}"]
        assert run.stdout == ""
        assert "wrong-key-7c1e" not in run.stderr
        assert not output.exists()
    assert running.engine.streams == []


@pytest.mark.slow
async def test_cli_end_to_end_against_a_server_process(tmp_path: Path) -> None:
    with open(tmp_path / "server.log", "wb") as log:
        server = await trio.lowlevel.open_process(
            [
                *[sys.executable, "-m", "trio_vstream", "--port", "0"],
                *["--engine", "synthetic", "--engine-arg", "chunk_frames=4"],
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=REPO,
        )
    try:
        assert server.stdout is not None
        line = b""
        with trio.fail_after(15):
            while b"\n" not in line:
                data = await server.stdout.receive_some()
                assert data, "server exited before printing its address"
                line += data
        url = next(word for word in line.decode().split() if word.startswith("ws://"))

        clip, raw = tmp_path / "clip.mp4", tmp_path / "clip.m4s"
        ok = await run_cli(
            tmp_path,
            "a red circle moving left",
            "--url", url, "-o", str(clip), "--raw", str(raw), "--json",
            "--size", "64x48", "--fps", "8", "--num-frames", "10",
        )  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        assert ok.stderr == ""  # no progress line when stderr is not a terminal
        summary = ok.summary
        assert summary["outcome"] == "completed" and summary["stopped"] is False
        assert summary["frames"] == 10 and summary["output_frames"] == 10
        assert summary["chunks"] == 4  # three media chunks and the trailer
        assert summary["time_to_video_start_s"] <= summary["time_to_first_chunk_s"]
        assert summary["delivered_fps"] > 0
        assert summary["output"] == str(clip) and summary["raw"] == str(raw)
        assert_plays(clip, 10)
        assert_progressive_mp4(clip, 10)
        assert len(raw.read_bytes()) == summary["bytes"]
        assert len(decode(raw.read_bytes())[0]) == 10
        assert mp4_boxes(raw.read_bytes())[-1][0] == b"mfra"

        bad = await run_cli(
            tmp_path, "x", "--url", url, "-o", str(tmp_path / "bad.mp4"),
            "--param", 'num_frames="30"',
        )  # fmt: skip
        assert bad.returncode == 1
        assert bad.stderr.startswith("error: server error invalid_request: ")
        assert "num_frames" in bad.stderr and len(bad.stderr.splitlines()) == 1
        assert bad.stdout == ""  # only the server's error: no summary of dashes
        assert not (tmp_path / "bad.mp4").exists()

        mismatch = await run_cli(tmp_path, "x", "--url", url, "--raw", str(raw), "--model", "m")
        assert mismatch.returncode == 1 and "model_mismatch" in mismatch.stderr
        assert raw.read_bytes() == b""  # exactly what arrived: nothing

        server.send_signal(signal.SIGINT)
        with trio.fail_after(10):
            assert await server.wait() == 0
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()


@pytest.mark.slow
async def test_cli_raw_is_exactly_the_wire_bytes(nursery: trio.Nursery, tmp_path: Path) -> None:
    blobs = encode_clip(gradient_chunks(2, 3))

    async def reference(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_REF)
        await send_reference_chunk(ws, blobs[0], 0, 3)
        await send_reference_chunk(ws, blobs[1], 1, 3)
        await send_reference_chunk(ws, blobs[2], 0, 0)
        await ws.send_message(
            json.dumps(
                {"type": "session.done", "request_id": "ref-1", "chunks": 3, "stopped": False}
            )
        )

    peer = await start_peer(nursery, reference)
    raw = tmp_path / "wire.m4s"
    run = await run_cli(tmp_path, "x", "--url", peer.url, "--raw", str(raw), "--json")
    assert run.returncode == 0, run.stderr
    assert raw.read_bytes() == b"".join(blobs)
    assert run.summary["output"] is None and run.summary["frames"] == 6


@pytest.mark.slow
async def test_cli_sends_every_flag_as_a_start_field(start_server: Any, tmp_path: Path) -> None:
    picture = np.zeros((20, 30, 3), np.uint8)
    picture[..., 2] = 180
    png = tmp_path / "picture.bin"  # the type comes from the content, not the name
    with av.open(str(png), "w", format="image2pipe") as container:
        stream = container.add_stream("png", rate=1)
        stream.width, stream.height, stream.pix_fmt = 30, 20, "rgb24"
        for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)

    running = await start_server()
    run = await run_cli(
        tmp_path, "a red circle", "--url", running.url, "-o", str(tmp_path / "o.mp4"), "--json",
        "--size", "32x16", "--fps", "6", "--seconds", "1", "--seed", "7", "--steps", "3",
        "--guidance-scale", "2.5", "--negative-prompt", "blurry", "--model", "synthetic",
        "--image", str(png), "--param", "user=alice", "--param", 'extra_params={"knob": 1}',
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.summary["seed"] == 7  # as echoed in video.start
    request = running.engine.streams[0].request
    assert (request.width, request.height, request.fps, request.num_frames) == (32, 16, 6, 6)
    assert (request.seed, request.num_inference_steps, request.guidance_scale) == (7, 3, 2.5)
    assert request.negative_prompt == "blurry" and request.extra_params == {"knob": 1}
    assert request.image is not None and np.array_equal(request.image, picture)
    assert_plays(tmp_path / "o.mp4", 6, size=(32, 16), fps=6)


@pytest.mark.slow
async def test_cli_interactions(start_server: Any, tmp_path: Path) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.02, steps=2, chunk_frames=2))
    run = await run_cli(
        tmp_path, "a red circle", "--url", running.url, "-o", str(tmp_path / "i.mp4"), "--json",
        "--num-frames", "30", "--interact", "0.1:a green circle", "--interact", "0.2:a blue one",
        "--transition-chunks", "1",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    interactions = run.summary["interactions"]
    assert [(i["prompt"], i["queued"]) for i in interactions] == [
        ("a green circle", True),
        ("a blue one", True),
    ]
    # The server's default 24 fps, read from the stream: 2-frame chunks end at 1/12 s steps.
    assert [i["sent_media_s"] for i in interactions] == [0.1667, 0.25]
    assert all(i["started_in_chunk"] is not None for i in interactions)
    changes = running.engine.streams[0].changes
    assert [(c.prompt, c.transition_chunks) for c in changes] == [
        ("a green circle", 1),
        ("a blue one", 1),
    ]


@pytest.mark.slow
async def test_cli_ctrl_c_stops_and_writes_what_arrived(start_server: Any, tmp_path: Path) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.05, steps=2, chunk_frames=2))
    clip = tmp_path / "partial.mp4"

    async def interrupt_mid_stream(process: trio.Process) -> None:
        assert await trio.to_thread.run_sync(running.engine.wait_for_chunks, 3)
        process.send_signal(signal.SIGINT)

    run = await run_cli(
        tmp_path, "x", "--url", running.url, "-o", str(clip), "--json", "--num-frames", "400",
        "--size", "64x48", "--fps", "8", while_running=interrupt_mid_stream,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary = run.summary
    assert summary["outcome"] == "stopped" and summary["stopped"] is True
    assert 4 <= summary["frames"] < 400
    assert summary["output_frames"] == summary["frames"]
    assert_plays(clip, summary["frames"])
    await running.wait_sessions_ended(1)
    assert running.summaries[0].outcome.value == "stopped"


@pytest.mark.slow
async def test_cli_second_ctrl_c_gives_up_at_once(nursery: trio.Nursery, tmp_path: Path) -> None:
    blobs = encode_clip(gradient_chunks(1, 4))  # 0.5 s at 8 fps
    chunk_read, stop_seen = trio.Event(), trio.Event()

    async def deaf(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_REF)
        await send_reference_chunk(ws, blobs[0], 0, 4)
        while True:
            kind = (await receive_json(ws, peer))["type"]
            if kind == "session.interaction":  # sent once the client has read the chunk
                chunk_read.set()
            elif kind == "session.stop":
                stop_seen.set()

    peer = await start_peer(nursery, deaf)
    clip = tmp_path / "gave-up.mp4"

    async def interrupt_twice(process: trio.Process) -> None:
        await chunk_read.wait()
        process.send_signal(signal.SIGINT)
        await stop_seen.wait()
        process.send_signal(signal.SIGINT)
        with trio.fail_after(3):  # not the 30 s stop timeout
            await process.wait()

    run = await run_cli(
        tmp_path, "x", "--url", peer.url, "-o", str(clip), "--json", "--stop-timeout", "30",
        "--interact", "0.1:read", while_running=interrupt_twice,
    )  # fmt: skip
    assert run.returncode == 130
    assert run.summary["outcome"] == "aborted" and "gave up" in run.stderr
    assert_plays(clip, 4)


@pytest.mark.slow
async def test_cli_connection_refused_exits_3(tmp_path: Path) -> None:
    url = f"ws://127.0.0.1:{free_port()}/v1/realtime/video"
    run = await run_cli(tmp_path, "x", "--url", url, "-o", str(tmp_path / "x.mp4"))
    assert run.returncode == 3
    assert url in run.stderr and "refused" in run.stderr.lower()
    assert not (tmp_path / "x.mp4").exists()


@pytest.mark.slow
async def test_cli_progress_line_on_a_terminal(start_server: Any, tmp_path: Path) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.02, steps=2, chunk_frames=2))
    leader, follower = pty.openpty()
    try:
        process = await trio.lowlevel.open_process(
            [
                sys.executable, "-m", "trio_vstream", "client", "x", "--url", running.url,
                "-o", str(tmp_path / "p.mp4"), "--num-frames", "16", "--size", "64x48",
            ],
            stdout=subprocess.DEVNULL,
            stderr=follower,
            cwd=REPO,
        )  # fmt: skip
    finally:
        os.close(follower)

    def read_all() -> bytes:
        data = b""
        while True:
            try:
                piece = os.read(leader, 4096)
            except OSError:  # EIO: the child closed the terminal
                return data
            if not piece:
                return data
            data += piece

    try:
        with trio.fail_after(15):
            terminal = await trio.to_thread.run_sync(read_all)
            assert await process.wait() == 0
    finally:
        os.close(leader)
        if process.returncode is None:
            process.kill()
    text = terminal.decode()
    lines = [line for line in text.split("\r") if line]
    assert len(lines) >= 3  # redrawn in place, not scrolled
    assert any(re.fullmatch(PROGRESS, line) for line in lines), lines
    assert text.endswith("\r\x1b[K")  # the line is cleared at the end


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["x"], "nothing to write"),
        (["x", "-o", "o.mp4", "--interact", "soon:blue"], "SECONDS:PROMPT"),
        (["x", "-o", "o.mp4", "--interact", "-1:blue"], "SECONDS:PROMPT"),
        (["x", "-o", "o.mp4", "--size", "64by48"], "WIDTHxHEIGHT"),
        (["x", "-o", "o.mp4", "--param", "novalue"], "KEY=VALUE"),
        (["x", "-o", "o.mp4", "--size", "64x48", "--param", "size=32x32"], "conflicts"),
        (["x", "-o", "o.mp4", "--param", "type=session.stop"], "type"),
        (["x", "-o", "o.mp4", "--image", "missing.png"], "missing.png"),
        (["x", "-o", "o.mp4", "--url", "http://127.0.0.1:8000/"], "ws://"),
        (["x", "-o", "no/such/dir/o.mp4"], "does not exist"),
        (["x", "-o", "o.mp4", "--transition-chunks", "-1"], ">= 0"),
        (["x", "-o", "o.mp4", "--api-key", "my secret"], "--api-key: the API key must be"),
    ],
)
def test_cli_usage_errors_exit_2(
    args: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        sys.exit(cli.main(["client", *args]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "my secret" not in err  # a refused key is never echoed
    assert list(tmp_path.iterdir()) == []


def test_cli_image_flag_rejects_non_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    assert cli.main(["client", "x", "-o", "o.mp4", "--image", "notes.txt"]) == 2
    assert "not a recognised image" in capsys.readouterr().err


def test_param_values_are_json_when_they_parse() -> None:
    from trio_vstream.client._flags import _param

    assert _param("seed=7") == ("seed", 7)
    assert _param("user=alice") == ("user", "alice")
    assert _param('num_frames="30"') == ("num_frames", "30")
    assert _param("lora=null") == ("lora", None)
    assert _param('extra_params={"a": [1]}') == ("extra_params", {"a": [1]})
    assert _param("guidance_scale=NaN") == ("guidance_scale", "NaN")  # not JSON
    assert _param("note=a=b") == ("note", "a=b")


# ---------------------------------------------------------------- cameras (issue 15)


def test_camera_flag_parses_mode_translation_and_rotation() -> None:
    from trio_vstream.client._flags import _camera
    from trio_vstream.values import Camera

    assert _camera("2:velocity:0,0,0.05") == (
        2.0,
        Camera("velocity", (0.0, 0.0, 0.05), (0.0, 0.0, 0.0, 1.0)),
    )
    assert _camera("0.5:target:1,-2,3:0,1,0,0") == (
        0.5,
        Camera("target", (1.0, -2.0, 3.0), (0.0, 1.0, 0.0, 0.0)),
    )


def test_keys_flag_is_vllm_omnis_wasd_mapping() -> None:
    from trio_vstream.client._flags import _keys
    from trio_vstream.protocol import key_velocity

    assert _keys("1.5:w") == (1.5, key_velocity([{"w"}]))
    assert _keys("3:WJ") == (3.0, key_velocity([{"w", "j"}]))
    assert _keys("4:-")[1].translation == (0.0, 0.0, 0.0)  # none held: a still camera
    assert _keys("4:-")[1].rotation == (0.0, 0.0, 0.0, 1.0)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--camera", "2:velocity", "expected SECONDS:MODE:X,Y,Z"),
        ("--camera", "-1:velocity:0,0,1", "expected SECONDS:MODE:X,Y,Z"),
        ("--camera", "nan:velocity:0,0,1", "expected SECONDS:MODE:X,Y,Z"),
        ("--camera", "2:spin:0,0,1", "MODE must be target or velocity, got 'spin'"),
        ("--camera", "2:velocity:0,0", "the translation X,Y,Z must be 3 numbers"),
        ("--camera", "2:velocity:0,0,x", "the translation X,Y,Z must be 3 finite numbers"),
        ("--camera", "2:velocity:0,0,inf", "the translation X,Y,Z must be 3 finite numbers"),
        ("--camera", "2:velocity:0,0,1:0,0,1", "the rotation QX,QY,QZ,QW must be 4 numbers"),
        ("--camera", "2:velocity:0,0,1:0,0,0,2", "must be a unit quaternion"),
        ("--camera", "2:velocity:0,0,1:0:0", "expected SECONDS:MODE:X,Y,Z"),
        ("--keys", "2:wx", "expected SECONDS:KEYS"),
        ("--keys", "2:", "expected SECONDS:KEYS"),
        ("--keys", "w", "expected SECONDS:KEYS"),
        ("--keys", "-3:w", "expected SECONDS:KEYS"),
    ],
)
def test_camera_usage_errors_exit_2_and_name_the_problem(
    flag: str,
    value: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        # FLAG=VALUE: a negative time would otherwise read as an option to argparse.
        sys.exit(cli.main(["client", "x", "-o", "o.mp4", f"{flag}={value}"]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and message in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
async def test_cli_sends_cameras_at_their_media_time(start_server: Any, tmp_path: Path) -> None:
    from tests.server.test_server_camera import CameraEngine
    from trio_vstream.protocol import key_velocity
    from trio_vstream.values import Camera

    running = await start_server(
        SyntheticSettings(step_delay=0.02, steps=2, chunk_frames=2), engine_class=CameraEngine
    )
    run = await run_cli(
        tmp_path, "a red circle", "--url", running.url, "-o", str(tmp_path / "c.mp4"), "--json",
        "--num-frames", "30", "--keys", "0.1:wl", "--camera", "0.2:target:1,2,3:0,1,0,0",
        "--interact", "0.15:a blue one",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    interactions = run.summary["interactions"]
    forward_right = key_velocity([{"w", "l"}])
    assert [(i["event_id"], i["prompt"], i["queued"]) for i in interactions] == [
        ("interaction-1", None, True),
        ("interaction-2", "a blue one", True),
        ("interaction-3", None, True),
    ]
    assert interactions[2]["camera"] == {
        "mode": "target",
        "data": {"translation": [1.0, 2.0, 3.0], "rotation": [0.0, 1.0, 0.0, 0.0]},
    }
    changes = running.engine.streams[0].changes
    assert [(c.event_id, c.prompt, c.camera) for c in changes] == [
        ("interaction-1", None, forward_right),
        ("interaction-2", "a blue one", None),
        ("interaction-3", None, Camera("target", (1.0, 2.0, 3.0), (0.0, 1.0, 0.0, 0.0))),
    ]
    assert all(i["started_in_chunk"] is not None for i in interactions)


@pytest.mark.slow
async def test_cli_camera_refused_by_a_prompt_only_engine_is_a_warning(
    start_server: Any, tmp_path: Path
) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.02, steps=2, chunk_frames=2))
    run = await run_cli(
        tmp_path, "a red circle", "--url", running.url, "-o", str(tmp_path / "c.mp4"),
        "--num-frames", "16", "--keys", "0.1:w",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert (
        "warning: interaction-1 camera velocity:0,0,0.05:0,0,0,1 (at 0.1 s) rejected by the "
        "server: interaction_failed: this engine takes no camera interactions (it takes: prompt)"
    ) in run.stderr
    assert running.engine.streams[0].changes == []
