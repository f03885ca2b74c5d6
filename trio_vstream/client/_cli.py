"""``python -m trio_vstream client``: the command line around `stream_video`.

Signals into stop and abort, a progress line on a terminal, then the output files (raw
and remuxed), the summary or ``--json``, and an exit status from the table in
docs/client.md. The flags and what they become (``session.start`` fields, checks before
streaming) are ``_flags``'s; the streaming itself is `stream_video`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final, TextIO

import attrs
import trio

from trio_vstream.client._flags import (
    API_KEY_ENV,
    _api_key,
    _check_outputs,
    _check_url,
    _start_fields,
    _UsageError,
)
from trio_vstream.client._results import (
    ScheduledInteraction,
    StreamConnectError,
    StreamOutcome,
    StreamResult,
)
from trio_vstream.client._stream import stream_video
from trio_vstream.client._stream_run import seconds_text
from trio_vstream.media.remux import RemuxError, remux_to_mp4

__all__ = [
    "EXIT_CONNECTION",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_OUTPUT",
    "EXIT_SERVER_ERROR",
    "EXIT_USAGE",
    "run_client",
]


# Exit statuses of `run_client`; documented in docs/client.md.
EXIT_OK: Final = 0
EXIT_SERVER_ERROR: Final = 1
EXIT_USAGE: Final = 2
EXIT_CONNECTION: Final = 3
EXIT_OUTPUT: Final = 4
EXIT_INTERRUPTED: Final = 130


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
            input_video=args.input_video,
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
    video_in = summary["input_video"]
    if video_in is not None:
        rows.append(
            (
                "input frames",
                f"{video_in['sent']} sent, {video_in['used']} used, "
                f"{video_in['dropped']} dropped, {video_in['reused']} reused"
                + ("" if video_in["ended"] else " (the session ended before the file)"),
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
