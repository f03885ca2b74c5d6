"""``python -m trio_vstream client``: the command line around `stream_video`.

Flags into ``session.start`` fields, signals into stop and abort, a progress line on a
terminal, then the output files (raw and remuxed), the summary or ``--json``, and an
exit status from the table in docs/client.md. The streaming itself is `stream_video`'s.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import json
import math
import mimetypes
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final, TextIO
from urllib.parse import urlsplit

import attrs
import trio

from trio_vstream import protocol
from trio_vstream.client._results import (
    ScheduledInteraction,
    StreamConnectError,
    StreamOutcome,
    StreamResult,
)
from trio_vstream.client._stream import bearer, seconds_text, stream_video
from trio_vstream.client._viewer import check_startup
from trio_vstream.media.remux import RemuxError, remux_to_mp4
from trio_vstream.values import CAMERA_MODES, Camera

__all__ = ["API_KEY_ENV", "DEFAULT_URL", "add_client_arguments", "run_client"]

DEFAULT_URL: Final = "ws://127.0.0.1:8000/v1/realtime/video"

#: Where ``client`` reads its API key when ``--api-key`` is not given; the server reads
#: the same variable (cli.py), so one exported key serves both on a workstation. The key
#: stays out of ``ps`` output that way.
API_KEY_ENV: Final = "TRIO_VSTREAM_API_KEY"

# Exit statuses of `run_client`; documented in docs/client.md.
EXIT_OK: Final = 0
EXIT_SERVER_ERROR: Final = 1
EXIT_USAGE: Final = 2
EXIT_CONNECTION: Final = 3
EXIT_OUTPUT: Final = 4
EXIT_INTERRUPTED: Final = 130

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
    """The ``client`` subcommand's flags; kept here so cli.py only wires it in."""
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
    flagged = dict(fields)
    for key, value in args.params:
        if key == "type":
            raise _UsageError("--param type: the message type is always session.start")
        if key in flagged:
            raise _UsageError(f"--param {key} conflicts with a value given by another flag")
        fields[key] = value
    return fields


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


class _Progress:
    """The ``\\r``-updated status line; silent unless stderr is a terminal."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.result: StreamResult | None = None
        self.started = 0.0  # set inside trio.run, where the Trio clock exists
        self.stopping = False
        self._shown = False
        self._drawn_at = -math.inf

    def update(self, _event: object, result: StreamResult) -> None:
        """Fits both `stream_video` callbacks; redraws at most ten times a second."""
        self.result = result
        if self.enabled and trio.current_time() - self._drawn_at >= 0.1:
            self.draw()

    def draw(self) -> None:
        if not self.enabled:
            return
        now = trio.current_time()
        result = self.result
        chunks = frames = 0
        fps = 0.0
        phase = "connecting"
        if result is not None:
            chunks, frames = len(result.chunks), result.frames
            phase = "streaming" if result.video_start_at is not None else "starting"
            if result.video_start_at is not None and frames:
                span = (result.last_media_at or now) - result.video_start_at
                fps = frames / span if span > 0 else 0.0
        if self.stopping:
            phase = "stopping"
        line = (
            f"{phase}: {chunks} chunks, {frames} frames, {fps:.1f} fps, {now - self.started:.1f} s"
        )
        self.stream.write(f"\r{line}\x1b[K")
        self.stream.flush()
        self._shown = True
        self._drawn_at = now

    def note(self, text: str) -> None:
        """A message on its own line, without tearing the status line."""
        if not self.enabled:
            return
        self.clear()
        self.stream.write(text + "\n")
        self.stream.flush()
        self.draw()

    def clear(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    async def run(self) -> None:
        """Redraw while the stream runs, so elapsed time moves even between chunks."""
        while True:
            self.draw()
            await trio.sleep(0.25)


@attrs.define
class _Run:
    """What the async part hands back to `run_client` (also after a late Ctrl-C)."""

    result: StreamResult | None = None
    connect_error: StreamConnectError | None = None


async def _stream_to_end(
    run: _Run,
    progress: _Progress,
    on_signal: Callable[[int], None],
    stream: Callable[[], Awaitable[StreamResult]],
) -> None:
    """Run ``stream`` with the progress line, handing SIGINT/SIGTERM to ``on_signal``;
    its result, or its failure to connect, goes into ``run``. What ``client`` and
    ``watch`` share: only what a signal means differs."""
    progress.started = trio.current_time()

    async def relay(signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            on_signal(signum)

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay, signals)
            if progress.enabled:
                nursery.start_soon(progress.run)
            try:
                run.result = await stream()
            except StreamConnectError as exc:
                run.connect_error = exc
            nursery.cancel_scope.cancel()


def _run_streaming(
    args: argparse.Namespace,
    main: Callable[[_Progress, _Run], Awaitable[None]],
    out: TextIO,
    err: TextIO,
) -> int:
    """``trio.run(main, progress, run)``, with a progress line on a terminal, then the
    exit status: interrupted before a result, or no connection; else `_finish`'s report
    of ``run.result``."""
    run = _Run()
    progress = _Progress(err, enabled=err.isatty())
    try:
        trio.run(main, progress, run)
    except KeyboardInterrupt:
        # A signal outside the receiver's lifetime: before it was installed (nothing
        # received yet) or just after the stream ended (the result is in `run`).
        if run.result is None:
            print("interrupted", file=err)
            return EXIT_INTERRUPTED
    finally:
        progress.clear()
    if run.connect_error is not None:
        print(f"error: {_connect_error_line(run.connect_error)}", file=err)
        return EXIT_CONNECTION
    assert run.result is not None
    return _finish(args, run.result, out, err)


async def _run_async(
    args: argparse.Namespace,
    api_key: str | None,
    fields: dict[str, Any],
    interactions: Sequence[ScheduledInteraction],
    progress: _Progress,
    run: _Run,
) -> None:
    stop_event, abort_event = trio.Event(), trio.Event()

    def on_signal(signum: int) -> None:
        # First signal: stop cleanly and keep what arrives; second: give up now.
        if not stop_event.is_set():
            stop_event.set()
            progress.stopping = True
            progress.note(
                f"{signal.Signals(signum).name}: stopping (sent session.stop); "
                "press Ctrl-C again to quit now"
            )
        else:
            abort_event.set()

    await _stream_to_end(
        run,
        progress,
        on_signal,
        lambda: stream_video(
            args.url,
            fields,
            interactions=interactions,
            on_chunk=progress.update,
            on_message=progress.update,
            stop_event=stop_event,
            abort_event=abort_event,
            stop_timeout=args.stop_timeout,
            connect_timeout=args.connect_timeout,
            api_key=api_key,
            playback=args.playback,
            startup_seconds=args.startup_seconds or 0.0,
        ),
    )


def run_client(args: argparse.Namespace, *, stdout: TextIO | None = None) -> int:
    """The ``client`` subcommand; returns the exit status (see docs/client.md's table)."""
    out = stdout or sys.stdout
    err = sys.stderr
    try:
        _check_outputs(args)
        _check_url(args.url)
        fields = _start_fields(args)
        api_key = _api_key(args)
    except _UsageError as exc:
        print(f"python -m trio_vstream client: error: {exc}", file=err)
        return EXIT_USAGE
    interactions = [
        ScheduledInteraction(at=at, prompt=prompt, transition_chunks=args.transition_chunks)
        for at, prompt in args.interactions
    ] + [
        ScheduledInteraction(at=at, camera=camera, transition_chunks=args.transition_chunks)
        for at, camera in [*args.cameras, *args.key_cameras]
    ]
    main = functools.partial(_run_async, args, api_key, fields, interactions)
    return _run_streaming(args, main, out, err)


def _connect_error_line(exc: StreamConnectError) -> str:
    """The one line for a failed connection; a 401 also names the two ways to give the
    key, since that is the whole fix (and never shows the key that was refused)."""
    hint = f" (--api-key or {API_KEY_ENV})" if exc.status_code == 401 else ""
    return f"{exc}{hint}"


def _finish(args: argparse.Namespace, result: StreamResult, out: TextIO, err: TextIO) -> int:
    """Report errors, write the files, print the summary, pick the exit status.

    A rejected session (an error before ``video.start``) gets only the server's error:
    there is no video, no interaction could have been sent, and a summary of dashes
    would only bury the one line that matters. ``--json`` still prints its object, for
    the programs that read it.
    """
    answered = [record.error for record in result.interactions if record.error is not None]
    for error in result.errors:
        if error is not result.error and any(error is e for e in answered):
            continue  # reported below, with the interaction it refused
        where = f" (event {error.event_id})" if error.event_id else ""
        label = "error" if error is result.error else "warning"
        print(f"{label}: server error {error.code}{where}: {error.message}", file=err)
    if not result.rejected:
        for record in result.interactions:
            what = (
                f"{record.event_id} {record.interaction.describe()}"
                f" (at {seconds_text(record.interaction.at)} s)"
            )
            if record.error is result.error and record.error is not None:
                continue  # the error line above names its event already
            if record.error is not None:
                print(
                    f"warning: {what} rejected by the server: "
                    f"{record.error.code}: {record.error.message}",
                    file=err,
                )
            elif record.not_sent is not None:
                print(f"warning: {what} not sent: {record.not_sent}", file=err)
    for problem in result.problems:
        print(f"warning: {problem}", file=err)
    if result.outcome is StreamOutcome.DISCONNECTED:
        print(
            f"error: the connection to {result.url} ended before the session did"
            + (f" (close code {result.close_code})" if result.close_code is not None else ""),
            file=err,
        )
    elif result.outcome is StreamOutcome.ABORTED:
        if result.stop_timed_out:
            reason = f"no session.done within {args.stop_timeout:g} s of session.stop"
        elif result.watching:
            reason = "interrupted (left the watch link; the session goes on)"
        else:
            reason = "interrupted"
        print(f"error: gave up: {reason}", file=err)

    written: dict[str, Any] = {"output": None, "output_frames": None, "raw": None}
    output_failed = False
    try:
        if args.raw is not None:
            with open(args.raw, "wb") as raw_file:
                for data in result.binary_messages:
                    raw_file.write(data)
            written["raw"] = str(args.raw)
        if args.output is not None:
            if not result.binary_messages:
                if not result.rejected:
                    print(f"warning: no video arrived; {args.output} not written", file=err)
            else:
                try:
                    written["output_frames"] = remux_to_mp4(result.video, args.output)
                    written["output"] = str(args.output)
                except RemuxError as exc:
                    print(f"warning: {args.output} not written: {exc}", file=err)
    except OSError as exc:
        print(f"error: cannot write output: {exc}", file=err)
        output_failed = True
    except KeyboardInterrupt:
        print("interrupted while writing the output", file=err)
        return EXIT_INTERRUPTED

    summary = result.summary()
    summary.update(written)
    try:
        if args.json:
            print(json.dumps(summary), file=out)
        elif not result.rejected:
            _print_summary(summary, out)
        out.flush()
    except BrokenPipeError:
        # `... --json | head`: the reader left; the files are written, so carry on quietly
        # (and keep Python from complaining again when it flushes stdout at exit).
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())

    if result.outcome is StreamOutcome.ERROR:
        return EXIT_SERVER_ERROR
    if result.outcome is StreamOutcome.DISCONNECTED:
        return EXIT_CONNECTION
    if result.outcome is StreamOutcome.ABORTED:
        return EXIT_INTERRUPTED
    return EXIT_OUTPUT if output_failed else EXIT_OK


def _print_summary(summary: dict[str, Any], out: TextIO) -> None:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    outcome = summary["outcome"]
    if summary["error"] is not None:
        outcome += f" ({summary['error']['code']})"
    fps = summary["delivered_fps"]
    rows = [
        ("outcome", outcome),
        ("request id", summary["request_id"] or "-"),
        ("seed", "unknown" if summary["seed"] is None else str(summary["seed"])),
        # A viewer sends no session.start: its times count from the connection.
        (
            "time to watch.start" if summary["watching"] else "time to video.start",
            seconds(summary["time_to_video_start_s"]),
        ),
        ("time to first chunk", seconds(summary["time_to_first_chunk_s"])),
        ("frames", str(summary["frames"])),
        ("delivered fps", "-" if fps is None else f"{fps:.2f}"),
        ("bytes", str(summary["bytes"])),
        ("chunks", str(summary["chunks"])),
    ]
    if summary["interactions"]:
        sent = sum(1 for i in summary["interactions"] if i["sent_s"] is not None)
        queued = sum(1 for i in summary["interactions"] if i["queued"])
        rows.append(
            (
                "interactions",
                f"{len(summary['interactions'])} planned, {sent} sent, {queued} queued",
            )
        )
    playback = summary["playback"]
    if playback is not None:
        ratio = playback["continuous_play_ratio"]
        rows += [
            ("time to first frame", seconds(playback["time_to_first_frame_s"])),
            (
                "playback",
                f"{playback['underruns']} underruns, {playback['stall_s']:.3f} s stalled, "
                f"continuous play {'-' if ratio is None else f'{ratio:.3f}'}, "
                f"{playback['chunks_on_time']}/{playback['chunks']} chunks on time",
            ),
        ]
        if playback["streaming_buffer_seconds"] is not None:
            rows.append(
                (
                    "paced",
                    f"streaming_buffer_seconds {playback['streaming_buffer_seconds']:g}, "
                    f"{playback['reports']} playback reports",
                )
            )
    if summary["output"] is not None:
        rows.append(("wrote", f"{summary['output']} ({summary['output_frames']} frames)"))
    if summary["raw"] is not None:
        rows.append(("wrote", f"{summary['raw']} (raw fragmented MP4)"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=out)
