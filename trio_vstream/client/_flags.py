"""The ``client`` command's flags: what each accepts, and what they become.

Flags are parsed into ``session.start`` fields (``--param`` among them, checked against
the flags that set the same field), interactions at media times, a camera path, an
image made a data URL; and checked before anything is streamed: the URL, the API key
(never echoed), the output files, each failure a `_UsageError` that the command line
prints with exit status 2. ``watch`` and ``replay`` check their URL, key and outputs
with the same functions. Running the command is ``_cli``'s.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import mimetypes
import os
import re
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from trio_vstream import protocol
from trio_vstream.client._input_video import VideoFile, input_request, probe_video
from trio_vstream.client._stream import bearer
from trio_vstream.client._viewer import check_startup
from trio_vstream.values import CAMERA_MODES, Camera

__all__ = ["API_KEY_ENV", "DEFAULT_BUFFER_SECONDS", "DEFAULT_URL", "add_client_arguments"]

DEFAULT_URL: Final = "ws://127.0.0.1:8000/v1/realtime/video"

#: Where ``client`` reads its API key when ``--api-key`` is not given; the server reads
#: the same variable (trio_vstream.cli), so one exported key serves both on a workstation. The key
#: stays out of ``ps`` output that way.
API_KEY_ENV: Final = "TRIO_VSTREAM_API_KEY"

_SIZE: Final = re.compile(r"[0-9]+x[0-9]+")

#: ``--playback``'s ``streaming_buffer_seconds`` when ``--buffer-seconds`` is not given:
#: room for a few chunks of generation, their encoding and the report's round trip
#: (vllm-omni: "budget enough lead"), and still well under the seconds of an unpaced
#: server's lead, so that a steer shows soon.
DEFAULT_BUFFER_SECONDS: Final = 1.0

#: Flags that fill a session.start field; --param may not set these again.
_FLAG_FIELDS: Final = {
    "size": "size",
    "seconds": "seconds",
    "num_frames": "num_frames",
    "fps": "fps",
    "seed": "seed",
    "steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
    "negative_prompt": "negative_prompt",
    "model": "model",
}


def _size(text: str) -> str:
    if not _SIZE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT like 640x480, got {text!r}")
    return text


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _unit_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text!r}")
    return value


def _input_fps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= protocol.MAX_INPUT_FPS:
        raise argparse.ArgumentTypeError(f"must be from 1 to {protocol.MAX_INPUT_FPS}, got {value}")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _param(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``, VALUE as JSON when it is JSON, else the text itself.

    So ``seed=7`` sends a number and ``user=alice`` a string, while ``num_frames='"30"'``
    can still send a string on purpose. NaN and Infinity are not JSON and stay strings.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        value = raw
    return key, value


def _interaction(text: str) -> tuple[float, str]:
    at_text, sep, prompt = text.partition(":")
    try:
        at = float(at_text)
    except ValueError:
        at = math.nan
    if not sep or not math.isfinite(at) or at < 0 or not prompt.strip():
        raise argparse.ArgumentTypeError(
            f"expected SECONDS:PROMPT like '2.5:a green circle', got {text!r}"
        )
    return at, prompt


_CAMERA_USAGE: Final = (
    "expected SECONDS:MODE:X,Y,Z[:QX,QY,QZ,QW] like '2:velocity:0,0,0.05' "
    "(MODE velocity or target; the rotation defaults to 0,0,0,1)"
)
_KEYS_USAGE: Final = (
    "expected SECONDS:KEYS like '1.5:w' or '3:wj', KEYS from "
    f"{''.join(protocol.CAMERA_KEYS)} (any case), or '-' for none held (a still camera)"
)


def _at(text: str) -> float | None:
    """Media time in seconds, or None when it is not one (negative, nan, inf, not a number)."""
    try:
        at = float(text)
    except ValueError:
        return None
    return at if math.isfinite(at) and at >= 0 else None


def _numbers(text: str, count: int, what: str) -> tuple[float, ...]:
    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(
                f"{what} must be {count} finite numbers separated by commas, got {text!r}"
            )
        values.append(value)
    if len(values) != count:
        raise argparse.ArgumentTypeError(
            f"{what} must be {count} numbers separated by commas, got {len(values)} in {text!r}"
        )
    return tuple(values)


def _camera(text: str) -> tuple[float, Camera]:
    """``--camera SECONDS:MODE:X,Y,Z[:QX,QY,QZ,QW]``, checked as strictly as the server.

    The last check is the server's own parser on the message this camera makes, so a
    camera the command line takes is one the server takes (a rotation that is not a
    unit quaternion fails here, before minutes of generation, not mid-video).
    """
    parts = text.split(":")
    at = _at(parts[0])
    if len(parts) not in (3, 4) or at is None:
        raise argparse.ArgumentTypeError(f"{_CAMERA_USAGE}, got {text!r}")
    mode = parts[1]
    if mode not in CAMERA_MODES:
        modes = " or ".join(sorted(CAMERA_MODES))
        raise argparse.ArgumentTypeError(f"MODE must be {modes}, got {mode!r} in {text!r}")
    # Unpacked, so that the type checker knows the lengths _numbers checks.
    x, y, z = _numbers(parts[2], 3, "the translation X,Y,Z")
    qx, qy, qz, qw = (
        _numbers(parts[3], 4, "the rotation QX,QY,QZ,QW") if len(parts) == 4 else (0, 0, 0, 1)
    )
    camera = Camera(mode, (x, y, z), (qx, qy, qz, qw))
    try:
        protocol.parse_control(protocol.interaction_message(None, "check", camera=camera))
    except protocol.ProtocolError as exc:
        raise argparse.ArgumentTypeError(
            f"the server would refuse {text!r}: {exc.message}"
        ) from None
    return at, camera


def _keys(text: str) -> tuple[float, Camera]:
    """``--keys SECONDS:KEYS``: held keys as vllm-omni's example client turns them into a
    velocity camera (`protocol.key_velocity`); the keys themselves are never sent."""
    at_text, sep, keys = text.partition(":")
    at = _at(at_text)
    held = set(keys.lower()) if keys != "-" else set()
    if not sep or at is None or not keys or not held <= set(protocol.CAMERA_KEYS):
        raise argparse.ArgumentTypeError(f"{_KEYS_USAGE}, got {text!r}")
    return at, protocol.key_velocity([held])


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``client`` subcommand's flags; kept here so trio_vstream.cli only wires it in."""
    parser.add_argument("prompt", help="what to generate")
    parser.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="write a progressive MP4 here"
    )
    parser.add_argument(
        "--raw",
        type=Path,
        metavar="FILE",
        help="write the fragmented MP4 bytes exactly as received",
    )
    parser.add_argument(
        "--url", default=DEFAULT_URL, metavar="URL", help="server endpoint (default %(default)s)"
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"send 'Authorization: Bearer KEY', for servers started with --api-key "
        f"(default: ${API_KEY_ENV}, which keeps the key out of the process list)",
    )
    request = parser.add_argument_group("session.start fields")
    request.add_argument("--size", type=_size, metavar="WxH", help="frame size, like 640x480")
    request.add_argument(
        "--seconds", type=int, metavar="N", help="video length in seconds (times fps)"
    )
    request.add_argument("--num-frames", type=int, metavar="N", help="video length in frames")
    request.add_argument("--fps", type=int, metavar="N", help="frames per second")
    request.add_argument("--seed", type=int, metavar="N")
    request.add_argument("--steps", type=int, metavar="N", help="num_inference_steps")
    request.add_argument("--guidance-scale", type=float, metavar="X")
    request.add_argument("--negative-prompt", metavar="TEXT")
    request.add_argument("--model", metavar="NAME", help="model name the server must be serving")
    request.add_argument(
        "--image", type=Path, metavar="FILE", help="conditioning image, sent as a data: URL"
    )
    request.add_argument(
        "--param",
        dest="params",
        type=_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other session.start field; VALUE is parsed as JSON if it can be (repeatable)",
    )
    steering = parser.add_argument_group("interactions")
    steering.add_argument(
        "--interact",
        dest="interactions",
        type=_interaction,
        action="append",
        default=[],
        metavar="SECONDS:PROMPT",
        help="change the prompt once the video reaches SECONDS of media time (repeatable)",
    )
    steering.add_argument(
        "--camera",
        dest="cameras",
        type=_camera,
        action="append",
        default=[],
        metavar="SECONDS:MODE:X,Y,Z[:QX,QY,QZ,QW]",
        help="send a camera (velocity: motion per step; target: a pose) once the video "
        "reaches SECONDS of media time (repeatable; for engines that take cameras)",
    )
    steering.add_argument(
        "--keys",
        dest="key_cameras",
        type=_keys,
        action="append",
        default=[],
        metavar="SECONDS:KEYS",
        help="like --camera, from held keys: w/s forward/back, a/d left/right (0.05 a "
        "step), j/l yaw 6 degrees, i/k pitch 4 degrees; '-' for none (repeatable)",
    )
    steering.add_argument(
        "--transition-chunks",
        type=_non_negative_int,
        metavar="N",
        help="chunks to blend over, for every interaction (default: the server's)",
    )
    viewing = parser.add_argument_group("playback (vllm-omni's streaming_buffer_seconds)")
    viewing.add_argument(
        "--playback",
        action="store_true",
        help="act as a real-time viewer: opt into paced generation with "
        "streaming_buffer_seconds, play what arrives at 1x from the first frame, and report "
        "that playhead (session.playback, every 100 ms); the summary gives its stalls",
    )
    viewing.add_argument(
        "--buffer-seconds",
        type=_positive_float,
        metavar="SECONDS",
        help=f"with --playback: how far generation may run ahead of the playhead "
        f"(streaming_buffer_seconds; default {DEFAULT_BUFFER_SECONDS:g})",
    )
    viewing.add_argument(
        "--startup-seconds",
        type=_non_negative_float,
        metavar="SECONDS",
        help="with --playback: media to buffer before the playhead starts; below "
        "--buffer-seconds (default 0: at the first frame)",
    )
    video_in = parser.add_argument_group("video in (input_video, for engines that take it)")
    video_in.add_argument(
        "--input-video",
        type=Path,
        metavar="FILE",
        help="follow this video file: its frames go to the server as JPEG, paced, after "
        "video.start (read a frame at a time)",
    )
    video_in.add_argument(
        "--strength",
        type=_unit_float,
        metavar="X",
        help="how far the output may depart from the input: 0 keeps it, 1 ignores it "
        "(input_video.strength; default: the server's)",
    )
    video_in.add_argument(
        "--input-end",
        choices=("end", "hold"),
        help="when the file ends: end the video with it, or hold its last frame until "
        "the video's length (default end)",
    )
    video_in.add_argument(
        "--input-fps",
        type=_input_fps,
        metavar="N",
        help=f"the rate to send the file at, 1..{protocol.MAX_INPUT_FPS} (default: the "
        "file's, rounded); frames are repeated or skipped by their timestamps",
    )
    video_in.add_argument(
        "--input-size",
        type=_size,
        metavar="WxH",
        help="the size to send frames at (default: the output's --size, else the file's)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--stop-timeout",
        type=_positive_float,
        metavar="SECONDS",
        default=10.0,
        help="seconds to wait for session.done after Ctrl-C (default %(default)s)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=_positive_float,
        metavar="SECONDS",
        default=10.0,
        help="seconds to wait for the connection (default %(default)s)",
    )


class _UsageError(Exception):
    pass


def _start_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {"prompt": args.prompt}
    for attr, name in _FLAG_FIELDS.items():
        value = getattr(args, attr)
        if value is not None:
            fields[name] = str(value) if name == "seconds" else value
    if args.image is not None:
        fields["image_reference"] = {"image_url": _image_data_url(args.image)}
    if args.playback:
        fields["streaming_buffer_seconds"] = _buffer_seconds(args)
    elif args.buffer_seconds is not None or args.startup_seconds is not None:
        flag = "--buffer-seconds" if args.buffer_seconds is not None else "--startup-seconds"
        raise _UsageError(f"{flag} goes with --playback")
    video = _input_video(args, fields)
    flagged = dict(fields)
    for key, value in args.params:
        if key == "type":
            raise _UsageError("--param type: the message type is always session.start")
        if key in flagged:
            raise _UsageError(f"--param {key} conflicts with a value given by another flag")
        fields[key] = value
    if video is not None:
        _complete_input_video(fields, video)
    return fields


_INPUT_FLAGS: Final = {
    "strength": "--strength",
    "input_end": "--input-end",
    "input_fps": "--input-fps",
    "input_size": "--input-size",
}


def _input_video(args: argparse.Namespace, fields: dict[str, Any]) -> VideoFile | None:
    """``--input-video`` and its flags into ``fields``' ``input_video`` block; the file
    probed now, so that one that is not a video is a usage error, not a failed session."""
    if args.input_video is None:
        for attr, flag in _INPUT_FLAGS.items():
            if getattr(args, attr) is not None:
                raise _UsageError(f"{flag} goes with --input-video")
        return None
    try:
        video = probe_video(args.input_video)
    except ValueError as exc:
        raise _UsageError(f"--input-video {args.input_video}: {exc}") from None
    block: dict[str, Any] = {"on_end": args.input_end or "end"}
    if args.strength is not None:
        block["strength"] = args.strength
    if args.input_fps is not None:
        block["fps"] = args.input_fps
    if args.input_size is not None:
        width, _, height = args.input_size.partition("x")
        block["width"], block["height"] = int(width), int(height)
    fields["input_video"] = block
    return video


def _complete_input_video(fields: dict[str, Any], video: VideoFile) -> None:
    """The block completed as `stream_video` will complete it (so that what it would
    refuse is a usage error here), and, for ``--input-end end`` without a length, a
    length that covers the file: the server's default might end the video first."""
    try:
        fields["input_video"] = block = input_request(fields, video)
    except ValueError as exc:
        raise _UsageError(f"--input-video {video.path}: {exc}") from None
    nested = fields.get("video_params")
    lengths = ("num_frames", "seconds")
    given = any(key in fields for key in lengths) or (
        isinstance(nested, dict) and "num_frames" in nested
    )
    if block.get("on_end") == "end" and not given and video.duration is not None:
        fields["seconds"] = str(max(1, math.ceil(video.duration)))


def _buffer_seconds(args: argparse.Namespace) -> float:
    """``--buffer-seconds`` (or its default), with ``--startup-seconds`` below it."""
    buffer_seconds: float = (
        args.buffer_seconds if args.buffer_seconds is not None else DEFAULT_BUFFER_SECONDS
    )
    try:
        check_startup(args.startup_seconds or 0.0, buffer_seconds)
    except ValueError as exc:
        raise _UsageError(f"--startup-seconds: {exc}") from None
    return buffer_seconds


_IMAGE_SIGNATURES: Final = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
    (b"II*\x00", "image/tiff"),
    (b"MM\x00*", "image/tiff"),
)


def _image_mime(data: bytes, path: Path) -> str | None:
    """The media type from the file's content; the name is only a fallback."""
    for signature, mime in _IMAGE_SIGNATURES:
        if data.startswith(signature):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[4:8] == b"ftyp" and data[8:12] in (b"avif", b"avis"):
        return "image/avif"
    guessed, _ = mimetypes.guess_type(path.name)
    return guessed if guessed is not None and guessed.startswith("image/") else None


def _image_data_url(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _UsageError(f"--image {path}: {exc.strerror or exc}") from exc
    if not data:
        raise _UsageError(f"--image {path}: the file is empty")
    mime = _image_mime(data, path)
    if mime is None:
        raise _UsageError(f"--image {path}: not a recognised image file")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _check_outputs(args: argparse.Namespace) -> None:
    """``-o/--output`` and ``--raw``: at least one, each a file that can be written."""
    if args.output is None and args.raw is None:
        raise _UsageError("nothing to write: give -o/--output FILE.mp4 and/or --raw FILE")
    _check_output(args.output, "--output")
    _check_output(args.raw, "--raw")


def _check_output(path: Path | None, flag: str) -> None:
    """Fail before streaming, not after minutes of generation."""
    if path is None:
        return
    if path.is_dir():
        raise _UsageError(f"{flag} {path}: is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise _UsageError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise _UsageError(f"{flag} {path}: directory {parent} is not writable")


def _api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else the environment's key; None when neither is set.

    Checked here rather than by an argparse ``type``, whose error would echo the key.
    """
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is None or (args.api_key is None and not key.strip()):
        return None  # an empty variable is an unset one, as the server reads it
    key = key.strip()
    try:
        bearer(key)
    except ValueError as exc:
        source = "--api-key" if args.api_key is not None else API_KEY_ENV
        raise _UsageError(f"{source}: {exc}") from None
    return key


def _check_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise _UsageError(f"--url must be a ws:// or wss:// URL, got {url!r}")
