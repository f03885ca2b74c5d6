"""Attacks through ``extra_params.video_codec_options`` (issue 20, item 1).

libx264 options can write files (``dump-yuv=``), probe them (``cqmfile=``) and burn CPU
(``preset=veryslow``). These tests send them through a real server, as an attacker would,
and check that the server refuses each one by name before any encoder opens, and that a
file the option names never appears. They also show that what stays allowed still makes
a video with a keyframe at every chunk start (what a joining viewer needs).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import decode_video
from trio_vstream import cli, protocol
from trio_vstream.client import ReplayError, load_recording
from trio_vstream.media.encoding import EncodingError, FragmentedMP4Encoder
from trio_vstream.media.fmp4 import fragment_starts_with_keyframe
from trio_vstream.protocol import CodecOptionError, check_codec_options
from trio_vstream.protocol._codec_options import PRESETS, PROFILES, TUNES, X264_PARAMS_NAMES

START = {"type": "session.start", "prompt": "a red circle", "size": "64x48", "fps": 8}
ALLOWED_X264 = "allowed: crf, qp, keyint"


async def refused(running: Any, options: Any) -> str:
    """Send a start with these codec options; it must be refused as invalid_request
    before the engine opens a stream. Returns the error message."""
    transcript = await running.run_session(
        {**START, "num_frames": 4, "extra_params": {"video_codec_options": options}}
    )
    assert transcript.types == ["error"], transcript.types
    error = transcript.messages[0]
    assert error["code"] == "invalid_request"
    assert running.engine.streams == []
    message: str = error["message"]
    assert message.startswith("Invalid session.start: extra_params.video_codec_options")
    return message


@pytest.mark.parametrize("name", X264_PARAMS_NAMES)
async def test_dump_yuv_is_refused_and_writes_nothing(
    start_server: Any, tmp_path: Path, name: str
) -> None:
    target = tmp_path / "written-by-a-client.yuv"
    running = await start_server()
    message = await refused(running, {name: f"dump-yuv={target}"})
    assert message == (
        f"Invalid session.start: extra_params.video_codec_options.{name}: "
        f"dump-yuv is not allowed; {ALLOWED_X264}"
    )
    # Hidden behind an allowed key, too.
    await refused(running, {name: f"crf=20:dump-yuv={target}"})
    assert not target.exists()


async def test_cqmfile_is_refused_and_says_nothing_about_the_file(
    start_server: Any, tmp_path: Path
) -> None:
    """Whether the file exists changes nothing in the answer: no existence oracle."""
    present = tmp_path / "present.cqm"
    present.write_text("INTRA4X4_LUMA = 16\n")
    running = await start_server()
    answers = {
        await refused(running, {"x264-params": f"cqmfile={path}"})
        for path in (present, tmp_path / "missing.cqm")
    }
    assert answers == {
        "Invalid session.start: extra_params.video_codec_options.x264-params: "
        f"cqmfile is not allowed; {ALLOWED_X264}"
    }


@pytest.mark.parametrize("preset", ["slow", "slower", "veryslow", "placebo"])
async def test_slow_presets_are_refused(start_server: Any, preset: str) -> None:
    running = await start_server()
    message = await refused(running, {"preset": preset})
    assert f'preset: "{preset}" is not allowed (slower presets cost too much CPU)' in message


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"bf": 3}, "option bf is not allowed"),
        ({"threads": "64"}, "option threads is not allowed"),
        ({"forced-idr": "0"}, "option forced-idr is not allowed"),
        ({"x264-params": "intra-refresh=1"}, "x264-params: intra-refresh is not allowed"),
        ({"x264opts": "bframes=3"}, "x264opts: bframes is not allowed"),
        ({"x264-params": "preset=placebo"}, "x264-params: preset is not allowed"),
        ({"x264-params": "keyint=0"}, "keyint must be a whole number of frames in 1..600"),
        ({"g": 100000}, "g: must be a whole number of frames in 1..600"),
        ({"qp": "-1"}, "qp: must be an integer in 0..51"),
        ({"profile": "high444"}, 'profile: "high444" is not allowed'),
        ({"x264-params": "crf=20\\:dump-yuv=x"}, "x264-params: crf must be a number"),
        ({"x264-params": "crf='2':qp=1"}, "x264-params: crf must be a number"),
    ],
)
async def test_options_off_the_list_are_refused_by_name(
    start_server: Any, options: dict[str, Any], problem: str
) -> None:
    running = await start_server()
    assert problem in await refused(running, options)


async def test_allowed_options_still_stream_a_video_with_a_keyframe_per_chunk(
    start_server: Any,
) -> None:
    running = await start_server()
    options = {
        "preset": "medium",
        "tune": "film",
        "profile": "high",
        "crf": 20.5,
        "g": 600,
        "x264-params": "qp=12:keyint=600",
    }
    transcript = await running.run_session(
        {**START, "num_frames": 24, "extra_params": {"video_codec_options": options}}
    )
    assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
    media = [m for m in transcript.messages if isinstance(m, bytes)][:-1]  # no trailer
    assert len(media) == 3
    assert all(fragment_starts_with_keyframe(chunk) for chunk in media)
    assert decode_video(transcript.video_bytes).shape == (24, 48, 64, 3)


# ------------------------------------------------------------- the encoder itself


def test_the_encoder_refuses_dump_yuv_when_called_directly(tmp_path: Path) -> None:
    """Defence in depth: a caller that skips the protocol meets the same allow-list."""
    target = tmp_path / "dump.yuv"
    frames = np.zeros((2, 48, 64, 3), np.uint8)
    for name in ("x264-params", "x264opts"):
        # Three statements (PT012): an encoder that took the option goes on to encode and
        # close, so that the check below sees whether it dumped.
        with pytest.raises(EncodingError, match=f"codec_options.{name}: dump-yuv is not"):  # noqa: PT012
            encoder = FragmentedMP4Encoder(
                width=64, height=48, fps=8, codec_options={name: f"dump-yuv={target}"}
            )
            encoder.encode(frames)  # only reached by an encoder that took the option
            encoder.close()
    assert not target.exists()


@pytest.mark.parametrize("preset", PRESETS)
def test_every_allowed_combination_keeps_zero_delay_and_a_keyframe_per_chunk(
    preset: str,
) -> None:
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, (6, 48, 64, 3), dtype=np.uint8)
    for index, tune in enumerate(TUNES):
        profile = PROFILES[index % 3]
        options = {"preset": preset, "tune": tune, "profile": profile, "g": 600}
        encoder = FragmentedMP4Encoder(width=64, height=48, fps=8, codec_options=options)
        chunks = [encoder.encode(frames[i : i + 2]) for i in (0, 2, 4)]
        encoder.close()  # encode() raised if any chunk had fewer packets than frames
        assert all(fragment_starts_with_keyframe(c) for c in chunks), (preset, tune)
        with av.open(io.BytesIO(b"".join(chunks))) as container:
            assert len(list(container.decode(video=0))) == 6


# ------------------------------------------------------------------- the parser


@pytest.mark.parametrize(
    ("options", "checked"),
    [
        ({}, {}),
        ({"crf": 0, "qp": 51}, {"crf": "0", "qp": "51"}),
        ({"crf": "23.50", "g": "048"}, {"crf": "23.5", "g": "48"}),
        ({"crf": 1e-9}, {"crf": "0"}),
        ({"x264-params": "crf=20.25:qp=3:keyint=1"}, {"x264-params": "crf=20.25:qp=3:keyint=1"}),
        ({"x264opts": "keyint=600"}, {"x264opts": "keyint=600"}),
        (
            {"tune": "zerolatency", "profile": "baseline"},
            {"tune": "zerolatency", "profile": "baseline"},
        ),
    ],
)
def test_the_parser_accepts_and_canonicalises(options: dict[str, Any], checked: dict) -> None:
    assert check_codec_options(options) == checked
    assert check_codec_options(checked) == checked  # canonical: checking again changes nothing


W = "extra_params.video_codec_options"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"x264-params": "dump-yuv=/tmp/x"},
            f"{W}.x264-params: dump-yuv is not allowed; {ALLOWED_X264}",
        ),
        ({"x264-params": ""}, f"{W}.x264-params: an empty entry is not allowed; {ALLOWED_X264}"),
        (
            {"x264-params": "crf=1:"},
            f"{W}.x264-params: an empty entry is not allowed; {ALLOWED_X264}",
        ),
        ({"x264-params": "crf"}, f"{W}.x264-params: crf needs a value (crf=...)"),
        ({"x264-params": "crf=1:crf=2"}, f"{W}.x264-params: crf is given twice"),
        ({"x264-params": "CRF=1"}, f"{W}.x264-params: CRF is not allowed; {ALLOWED_X264}"),
        ({"x264-params": "g=5"}, f"{W}.x264-params: g is not allowed; {ALLOWED_X264}"),
        ({"x264-params": 5}, f"{W}.x264-params: must be a string of key=value:key=value, got 5"),
        ({"x264-params": "crf=1:" * 40}, f"{W}.x264-params: is longer than 200 characters"),
        ({"x264-params": "a\nb=1"}, f'{W}.x264-params: "a\\nb" is not allowed; {ALLOWED_X264}'),
        ({"crf": "nan"}, f'{W}.crf: must be a number in 0..51, got "nan"'),
        ({"crf": float("inf")}, f"{W}.crf: must be a number in 0..51, got Infinity"),
        ({"crf": 52}, f"{W}.crf: must be a number in 0..51, got 52"),
        ({"crf": " 1"}, f'{W}.crf: must be a number in 0..51, got " 1"'),
        ({"qp": 1.5}, f"{W}.qp: must be an integer in 0..51, got 1.5"),
        ({"qp": True}, f"{W}.qp: must be an integer in 0..51, got true"),
        ({"g": "1e2"}, f'{W}.g: must be a whole number of frames in 1..600, got "1e2"'),
        (
            {"tune": "film,fastdecode"},
            f'{W}.tune: "film,fastdecode" is not allowed; allowed: '
            "film, animation, grain, stillimage, fastdecode, zerolatency, psnr, ssim",
        ),
        (
            {1: "x"},
            f"{W}: option 1 is not allowed; allowed: {', '.join(protocol.CODEC_OPTION_NAMES)}",
        ),
        ([("crf", 1)], f"{W} must be an object, got an array"),
    ],
)
def test_the_parser_refuses_and_names_the_option(options: Any, message: str) -> None:
    with pytest.raises(CodecOptionError) as caught:
        check_codec_options(options)
    assert str(caught.value) == message


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    st.text(max_size=60) | st.from_regex(r"(?:(?:crf|qp|keyint|dump-yuv)=[0-9a-z./]{0,4}:?){1,4}")
)
def test_whatever_x264_params_text_comes_in_only_checked_values_go_out(text: str) -> None:
    try:
        checked = check_codec_options({"x264-params": text})
    except CodecOptionError as exc:  # checked or refused (no pytest.raises): both are right
        assert str(exc).startswith(f"{W}.x264-params")  # noqa: PT017
        return
    out = checked["x264-params"]
    # Nothing libx264's splitter could read differently: no quote, escape or path.
    assert re.fullmatch(r"(?:crf|qp|keyint)=[0-9.]+(?::(?:crf|qp|keyint)=[0-9.]+)*", out)
    assert check_codec_options(checked) == checked


# ------------------------------------------------------------------------- replay


def recording_with(tmp_path: Path, request: dict[str, Any]) -> Path:
    """A minimal recording (as ``--record`` writes them) holding this request."""
    record = {
        "format": "trio_vstream.recording",
        "version": 1,
        "request_id": "video_stream-x",
        "request": {"prompt": "a red circle", "size": "64x48", "num_frames": 8, **request},
        "seed": 3,
        "interactions": [],
        "chunks": [],
        "outcome": "completed",
    }
    path = tmp_path / "handed-to-you.json"
    path.write_text(json.dumps(record))
    return path


def test_replay_drops_recorded_codec_options_and_says_so(tmp_path: Path) -> None:
    target = tmp_path / "dump.yuv"
    hostile = {"x264-params": f"dump-yuv={target}"}
    path = recording_with(
        tmp_path,
        {
            "extra_params": {"video_codec_options": hostile, "flow": 1},
            "sampling_params": {"video_codec_options": hostile},  # lifted by the server
        },
    )
    plan = load_recording(path)
    assert plan.start_fields["extra_params"] == {"flow": 1}
    assert plan.start_fields["sampling_params"] == {}
    assert "video_codec_options" not in json.dumps(plan.start_fields)
    (warning,) = plan.warnings
    assert "extra_params.video_codec_options" in warning and "are not sent" in warning
    assert "--keep-codec-options" in warning
    # Kept on request, but only within the server's allow-list.
    with pytest.raises(ReplayError, match=r"dump-yuv is not allowed.*even with --keep-codec"):
        load_recording(path, keep_codec_options=True)
    lossless = recording_with(tmp_path, {"extra_params": {"video_codec_options": {"qp": "0"}}})
    kept = load_recording(lossless, keep_codec_options=True)
    assert kept.start_fields["extra_params"] == {"video_codec_options": {"qp": "0"}}
    assert kept.warnings == ()


def test_the_replay_command_warns_and_sends_none_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = recording_with(tmp_path, {"extra_params": {"video_codec_options": {"qp": "0"}}})
    nowhere = ["--url", "ws://127.0.0.1:9/v1/realtime/video", "--connect-timeout", "1"]
    cli.main(["replay", str(path), *nowhere])  # cannot connect: exit 3, after the warning
    err = capsys.readouterr().err
    assert err.startswith(
        "python -m trio_vstream replay: warning: the recording's "
        'extra_params.video_codec_options {"qp": "0"} are not sent'
    )
    cli.main(["replay", str(path), "--keep-codec-options", *nowhere])
    assert "warning" not in capsys.readouterr().err
