"""``python -m trio_vstream replay FILE.json``: a recorded session, again, at the same chunks.

A recording (``--record DIR`` on the server, `trio_vstream.outputs.recording`) holds the request
as validated, the seed the engine used, and every interaction with the generation chunk
where it started. Replaying sends the same ``session.start`` with that seed, and the
interactions not over the network at their old times (a client racing a fast engine
cannot hit a chunk boundary by timing) but as ``extra_params.interaction_script``, this
project's extension: the server hands each one to the engine right before its recorded
chunk, as the live one was. On the same engine (same engine args) and device that gives
the same frames, and this command checks it: each interaction must start at its
recorded chunk again, and the frames must decode equal to the recorded MP4's, and the sound
too (a stream with sound: as many samples, and the same waveform, correlation >= 0.999
after decoding both). A
recording that did not complete (stopped, failed, client gone), or that stopped short
of its session (``"truncated"``: the server's ``--record-max-bytes``), is replayed up
to as many frames as it holds: the replay stops itself there.

A recording is a file someone may hand you, and its request is sent as it stands, so
one thing in it is not sent unless asked for: ``extra_params.video_codec_options``. Those
libx264 options could make a server without this project's allow-list write files
(``dump-yuv=``) or burn CPU. They are dropped, with a warning on stderr (the frames may
then differ from the recording's); ``--keep-codec-options`` sends them, and only when
they pass the same allow-list the server applies (`protocol.check_codec_options`).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, TextIO

import attrs
import av
import av.error
import numpy as np
import trio

from trio_vstream import protocol
from trio_vstream.client._cli import (
    EXIT_CONNECTION,
    EXIT_OK,
    EXIT_OUTPUT,
    EXIT_SERVER_ERROR,
    EXIT_USAGE,
    _connect_error_line,
)
from trio_vstream.client._flags import (
    API_KEY_ENV,
    DEFAULT_URL,
    _api_key,
    _check_output,
    _check_url,
    _image_data_url,
    _UsageError,
)
from trio_vstream.client._mp4 import decode_audio
from trio_vstream.client._results import ReceivedChunk, StreamConnectError, StreamResult
from trio_vstream.client._stream import stream_video
from trio_vstream.media.remux import RemuxError, remux_to_mp4

__all__ = [
    "EXIT_MISMATCH",
    "ReplayError",
    "ReplayPlan",
    "ReplayReport",
    "add_replay_arguments",
    "load_recording",
    "replay",
    "run_replay",
]

EXIT_MISMATCH: Final = 5
"""The replay ran, but differs from the recording (an interaction's chunk, the frames)."""


class ReplayError(Exception):
    """The recording cannot be replayed; the message says why, naming the file."""


@attrs.frozen(kw_only=True)
class ReplayPlan:
    """What a recording asks to be replayed, and what the replay must reproduce."""

    source: Path
    request_id: str
    start_fields: dict[str, Any]
    """The ``session.start`` fields: the recorded request, seed and interaction script."""
    expected_chunks: dict[str, int]
    """Each replayed interaction's event id, and the generation chunk it started in."""
    recorded_frames: int
    recorded_audio_samples: int | None = None
    """Samples of sound the recording holds (its chunks' ``audio_samples``); None for a
    stream without sound."""
    recorded_video: Path | None
    complete: bool
    """The recorded session completed: the replay must give exactly as many frames."""
    skipped: tuple[str, ...] = ()
    """Interactions that changed no frame (refused, or never started), in words."""
    warnings: tuple[str, ...] = ()
    """What the replay leaves out of the recorded request, and why (codec options)."""


@attrs.define
class ReplayReport:
    """What a replay did, and how it compares with the recording."""

    result: StreamResult
    started: dict[str, int] = attrs.field(factory=dict)
    """Where each event id started in the replay (from its chunks' metadata)."""
    mismatches: list[str] = attrs.field(factory=list)
    frames_compared: int = 0
    audio_correlation: float | None = None
    """How alike the replay's sound and the recording's are (Pearson, over the samples
    both hold); None without sound."""

    @property
    def identical(self) -> bool:
        return not self.mismatches


def load_recording(
    path: Path, *, image: Path | None = None, keep_codec_options: bool = False
) -> ReplayPlan:
    """Read a recording's JSON and make its replay; raises `ReplayError` on anything that
    is not a replayable recording. ``image`` replaces the recorded ``image_reference``
    (needed when it came from a URL, whose image a recording does not keep).

    The recorded ``extra_params.video_codec_options`` are dropped (the plan's
    ``warnings`` say so) unless ``keep_codec_options``; kept, they must pass the
    server's allow-list, or `ReplayError` names the option."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReplayError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ReplayError(f"{path} is not a recording: not UTF-8 text") from None
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise ReplayError(f"{path} is not a recording: invalid JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != protocol.RECORDING_FORMAT:
        raise ReplayError(f'{path} is not a recording: no "format": "{protocol.RECORDING_FORMAT}"')
    version = record.get("version")
    if isinstance(version, bool) or version not in protocol.RECORDING_READABLE_VERSIONS:
        readable = " and ".join(str(v) for v in protocol.RECORDING_READABLE_VERSIONS)
        raise ReplayError(
            f"{path}: recording version {version!r}; this trio_vstream reads versions {readable}"
        )
    where = str(path)
    request = _get(record, "request", dict, where)
    if not isinstance(request.get("prompt"), str):
        raise ReplayError(f"{path}: request.prompt is missing")
    fields = json.loads(json.dumps(request))
    seed = record.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        fields["seed"] = seed
    fields.pop("image_reference", None)
    fields.pop("audio", None)  # the server's echo (a recording keeps it apart), not a field
    if image is not None:
        try:
            fields["image_reference"] = {"image_url": _image_data_url(image)}
        except _UsageError as exc:
            raise ReplayError(str(exc)) from None
    else:
        recorded_image = _image_url(record.get("image"), path)
        if recorded_image is not None:
            fields["image_reference"] = {"image_url": recorded_image}

    script: list[dict[str, Any]] = []
    expected: dict[str, int] = {}
    skipped: list[str] = []
    for number, entry in enumerate(_get(record, "interactions", list, where)):
        item = f"{where}: interactions[{number}]"
        if not isinstance(entry, dict):
            raise ReplayError(f"{item} is not an object")
        event_id = _get(entry, "event_id", str, item)
        message = _get(entry, "message", dict, item)
        chunk = entry.get("started_chunk")
        if not entry.get("accepted"):
            skipped.append(f"{event_id}: refused by the server ({_error_text(entry)})")
        elif not isinstance(chunk, int) or isinstance(chunk, bool):
            skipped.append(f"{event_id}: never started (the video ended first)")
        else:
            body = _get(message, "interaction", dict, f"{item}.message")
            script.append({"chunk_index": chunk, "interaction": {**body, "event_id": event_id}})
            expected[event_id] = chunk
    extra = fields.get("extra_params")
    extra = dict(extra) if isinstance(extra, dict) else {}
    extra.pop(protocol.INTERACTION_SCRIPT_PARAM, None)  # rebuilt from the interactions
    warnings = _codec_options_to_send(fields, extra, keep_codec_options, where)
    if script:
        extra[protocol.INTERACTION_SCRIPT_PARAM] = script
    if extra:
        fields["extra_params"] = extra
    else:
        fields.pop("extra_params", None)

    chunks = _get(record, "chunks", list, where)
    frames = sum(
        chunk.get("frames", 0)
        for chunk in chunks
        if isinstance(chunk, dict) and chunk.get("kind") == "media"
    )
    audio_samples = None
    if isinstance(record.get("audio"), dict):
        audio_samples = sum(
            chunk.get("audio_samples", 0)
            for chunk in chunks
            if isinstance(chunk, dict) and chunk.get("kind") == "media"
        )
    video = record.get("file")
    recorded_video = None
    if isinstance(video, dict) and isinstance(video.get("name"), str):
        recorded_video = path.parent / Path(video["name"]).name
    return ReplayPlan(
        source=path,
        request_id=str(record.get("request_id")),
        start_fields=fields,
        expected_chunks=expected,
        recorded_frames=frames,
        recorded_audio_samples=audio_samples,
        recorded_video=recorded_video,
        complete=record.get("outcome") == "completed" and not record.get("truncated"),
        skipped=tuple(skipped),
        warnings=warnings,
    )


def _codec_options_to_send(
    fields: dict[str, Any], extra: dict[str, Any], keep: bool, where: str
) -> tuple[str, ...]:
    """Drop the recorded codec options from ``extra`` (and from a legacy
    ``sampling_params``, which the server lifts into ``extra_params``), or, with
    ``keep``, check them; returns the warnings to show."""
    blocks = [extra]
    sampling = fields.get("sampling_params")
    if isinstance(sampling, dict) and protocol.CODEC_OPTIONS_PARAM in sampling:
        fields["sampling_params"] = sampling = dict(sampling)
        blocks.append(sampling)
    found = [block for block in blocks if protocol.CODEC_OPTIONS_PARAM in block]
    if not found:
        return ()
    if keep:
        for block in found:
            try:
                protocol.check_codec_options(block[protocol.CODEC_OPTIONS_PARAM])
            except protocol.CodecOptionError as exc:
                raise ReplayError(
                    f"{where}: the recorded {exc} (not sent, even with --keep-codec-options)"
                ) from None
        return ()
    dropped = [block.pop(protocol.CODEC_OPTIONS_PARAM) for block in found]
    shown = json.dumps(dropped[0])  # ASCII, control characters escaped
    if len(shown) > 200:
        shown = shown[:197] + "..."
    return (
        f"the recording's extra_params.{protocol.CODEC_OPTIONS_PARAM} {shown} are not sent "
        "(a recording may come from anyone, and codec options can make a server write "
        "files); the frames may differ from the recording's. Pass --keep-codec-options "
        "to send them",
    )


def _get(record: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = record.get(key)
    if not isinstance(value, kind):
        raise ReplayError(f"{where}: {key} is missing or not {_KINDS[kind]}")
    return value


_KINDS: Final[dict[type, str]] = {dict: "an object", list: "an array", str: "a string"}


def _error_text(entry: dict[str, Any]) -> str:
    error = entry.get("error")
    if isinstance(error, dict):
        return f"{error.get('code')}: {error.get('message')}"
    return "no reason recorded"


def _image_url(image: Any, path: Path) -> str | None:
    """The recorded ``image_reference`` as a data URL again, from the file beside the JSON,
    checked against the recorded hash; `ReplayError` when it cannot be had."""
    if image is None:
        return None
    if not isinstance(image, dict):
        raise ReplayError(f"{path}: image is not an object")
    if image.get("source") != "inline":
        raise ReplayError(
            f"{path}: the session's image_reference was a URL ({image.get('url')}), whose "
            "image a recording does not keep: pass the image with --image FILE"
        )
    name = image.get("file")
    if not isinstance(name, str):
        raise ReplayError(f"{path}: image.file is missing")
    image_path = path.parent / Path(name).name
    try:
        data = image_path.read_bytes()
    except OSError as exc:
        raise ReplayError(
            f"cannot read the recorded image {image_path}: {exc.strerror or exc} "
            "(or pass one with --image FILE)"
        ) from None
    if hashlib.sha256(data).hexdigest() != image.get("sha256"):
        raise ReplayError(f"{image_path} is not the recorded image: its SHA-256 differs")
    mime = image.get("mime_type") or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


async def replay(
    plan: ReplayPlan,
    url: str,
    *,
    api_key: str | None = None,
    connect_timeout: float = 10.0,
) -> ReplayReport:
    """Run the replay against ``url`` and compare it with the recording. Raises
    `StreamConnectError` when no connection could be made, like `stream_video`."""
    stop = trio.Event()

    def on_chunk(chunk: ReceivedChunk, result: StreamResult) -> None:
        # An incomplete recording: as many frames as it holds are enough.
        if not plan.complete and 0 < plan.recorded_frames <= result.frames:
            stop.set()

    result = await stream_video(
        url,
        plan.start_fields,
        on_chunk=on_chunk,
        stop_event=stop,
        api_key=api_key,
        connect_timeout=connect_timeout,
    )
    report = ReplayReport(result)
    for chunk in result.chunks:
        metadata = chunk.metadata
        if metadata is None or metadata.generation_chunk_index is None:
            continue
        for event_id in metadata.started_event_ids:
            report.started.setdefault(event_id, metadata.generation_chunk_index)
    for event_id, chunk_index in plan.expected_chunks.items():
        got = report.started.get(event_id)
        if got != chunk_index:
            where = "never" if got is None else f"at chunk {got}"
            report.mismatches.append(
                f"interaction {event_id} started {where}, recorded at chunk {chunk_index}"
            )
    if result.rejected or not result.frames:
        return report
    if plan.complete and result.frames != plan.recorded_frames:
        report.mismatches.append(
            f"the replay has {result.frames} frames, the recording {plan.recorded_frames}"
        )
    elif result.frames < plan.recorded_frames:
        report.mismatches.append(
            f"the replay has only {result.frames} frames, the recording {plan.recorded_frames}"
        )
    if plan.recorded_video is not None:
        video = result.video
        different = await trio.to_thread.run_sync(
            _first_difference, plan.recorded_video, video, plan.recorded_frames
        )
        report.frames_compared, first = different
        if first is not None:
            report.mismatches.append(first)
    if plan.recorded_audio_samples is not None:
        await _compare_audio(plan, result, report)
    return report


AUDIO_MIN_CORRELATION: Final = 0.999
"""The least correlation of the replay's sound with the recording's that counts as the
same: the same engine and seed give the same PCM, and the AAC encoder is deterministic,
so this is 1.0 but for a decoder's rounding."""


async def _compare_audio(plan: ReplayPlan, result: StreamResult, report: ReplayReport) -> None:
    """The sound, as the frames are compared: its length (the chunks' sample counts) and
    its waveform (decoded from the recorded MP4 and from the replay)."""
    recorded = plan.recorded_audio_samples
    assert recorded is not None
    got = result.audio_samples
    if result.audio_sample_rate is None:
        report.mismatches.append("the replay has no sound, the recording has")
        return
    if plan.complete and got != recorded:
        report.mismatches.append(f"the replay has {got} audio samples, the recording {recorded}")
    elif got < recorded and result.frames >= plan.recorded_frames:  # frames short: said
        report.mismatches.append(
            f"the replay has only {got} audio samples, the recording {recorded}"
        )
    if plan.recorded_video is None:
        return
    video = result.video
    path = plan.recorded_video
    correlation, problem = await trio.to_thread.run_sync(
        _audio_correlation, path, video, min(recorded, got)
    )
    report.audio_correlation = correlation
    if problem is not None:
        report.mismatches.append(problem)
    elif correlation is not None and correlation < AUDIO_MIN_CORRELATION:
        report.mismatches.append(
            f"the sound differs from the recording's (correlation {correlation:.4f})"
        )


def _audio_correlation(
    recorded: Path, replayed: bytes, samples: int
) -> tuple[float | None, str | None]:
    """The correlation of the two sounds' first ``samples`` samples, or why there is none."""
    try:
        theirs = decode_audio(recorded.read_bytes())
        ours = decode_audio(replayed)
    except (OSError, RemuxError) as exc:
        return None, f"cannot compare the sound with {recorded}: {exc}"
    if theirs is None or ours is None:
        return (
            None,
            f"cannot compare the sound: {recorded if theirs is None else 'the replay'} has none",
        )
    count = min(samples, theirs[1].shape[1], ours[1].shape[1])
    if count == 0:
        return None, None
    a, b = theirs[1][:, :count].ravel(), ours[1][:, :count].ravel()
    if np.array_equal(a, b):
        return 1.0, None
    if not a.any() or not b.any():  # silence against sound: no correlation to speak of
        return 0.0, None
    return float(np.corrcoef(a, b)[0, 1]), None


def _first_difference(recorded: Path, replayed: bytes, count: int) -> tuple[int, str | None]:
    """Decode both videos side by side (one frame of each in memory at a time): how many
    frames were compared, and the first difference in words (None: equal)."""
    compared = 0
    try:
        with av.open(str(recorded)) as first, av.open(io.BytesIO(replayed)) as second:
            ours, theirs = _frames(first), _frames(second)
            for compared in range(count):
                a, b = next(ours, None), next(theirs, None)
                if a is None or b is None:
                    return compared, None  # the frame counts are checked on their own
                if a.shape != b.shape or not np.array_equal(a, b):
                    return compared, f"frame {compared} differs from the recording's"
            compared = count
    except (OSError, av.error.FFmpegError) as exc:
        return compared, f"cannot compare the frames with {recorded}: {exc}"
    return compared, None


def _frames(container: Any) -> Iterator[np.ndarray]:
    for frame in container.decode(video=0):
        yield frame.to_ndarray(format="rgb24")


# ------------------------------------------------------------------ command line


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``replay`` subcommand's flags; kept here so trio_vstream.cli only wires it in."""
    parser.add_argument("recording", type=Path, help="a recording's JSON: DIR/<request_id>.json")
    parser.add_argument(
        "--url", default=DEFAULT_URL, metavar="URL", help="server endpoint (default %(default)s)"
    )
    parser.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="write the replay as a progressive MP4"
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--image",
        type=Path,
        metavar="FILE",
        help="the conditioning image, when the recording does not hold it (a URL's image)",
    )
    parser.add_argument(
        "--keep-codec-options",
        action="store_true",
        help="send the recording's extra_params.video_codec_options (dropped by default, "
        "with a warning); only options on the server's allow-list are sent",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        metavar="SECONDS",
        default=10.0,
        help="seconds to wait for the connection (default %(default)s)",
    )


def run_replay(args: argparse.Namespace, *, stdout: TextIO | None = None) -> int:
    """The ``replay`` subcommand; returns the exit status (the client's, and 5: differs)."""
    out = stdout or sys.stdout
    err = sys.stderr
    try:
        _check_url(args.url)
        _check_output(args.output, "--output")
        api_key = _api_key(args)
        plan = load_recording(
            args.recording, image=args.image, keep_codec_options=args.keep_codec_options
        )
    except (_UsageError, ReplayError) as exc:
        print(f"python -m trio_vstream replay: error: {exc}", file=err)
        return EXIT_USAGE
    for warning in plan.warnings:
        print(f"python -m trio_vstream replay: warning: {warning}", file=err)
    try:
        report = trio.run(
            lambda: replay(plan, args.url, api_key=api_key, connect_timeout=args.connect_timeout)
        )
    except StreamConnectError as exc:
        print(f"error: {_connect_error_line(exc)}", file=err)
        return EXIT_CONNECTION
    except KeyboardInterrupt:
        print("interrupted", file=err)
        return 130
    result = report.result
    if result.rejected:
        error = result.error
        assert error is not None
        print(f"error: the server refused the replay: {error.code}: {error.message}", file=err)
        return EXIT_SERVER_ERROR
    if args.output is not None and result.frames:
        try:
            remux_to_mp4(result.video, args.output)
        except (RemuxError, OSError) as exc:
            print(f"error: cannot write {args.output}: {exc}", file=err)
            return EXIT_OUTPUT
    outcome = result.outcome.value if result.outcome is not None else "unknown"
    print(
        f"replayed {plan.request_id} as {result.request_id}: {outcome}, {result.frames} frames",
        file=out,
    )
    for note in plan.skipped:
        print(f"not replayed: {note}", file=out)
    if plan.expected_chunks:
        matched = sum(
            1
            for event_id, chunk in plan.expected_chunks.items()
            if report.started.get(event_id) == chunk
        )
        print(
            f"interactions: {matched} of {len(plan.expected_chunks)} at their recorded chunks",
            file=out,
        )
    if report.frames_compared:
        print(f"frames compared with the recording: {report.frames_compared}", file=out)
    if report.audio_correlation is not None:
        print(
            f"sound compared with the recording: {result.audio_samples} samples, "
            f"correlation {report.audio_correlation:.4f}",
            file=out,
        )
    for mismatch in report.mismatches:
        print(f"differs: {mismatch}", file=err)
    if result.error is not None:
        print(f"server error: {result.error.code}: {result.error.message}", file=err)
    return EXIT_MISMATCH if report.mismatches else EXIT_OK
