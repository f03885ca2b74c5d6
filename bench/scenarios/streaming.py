"""``streaming`` (issue 22): the streaming metrics of vllm-omni's realtime benchmark and
the SlackServe paper, with and without vllm-omni's ``streaming_buffer_seconds``, and a
check that paused sessions cost the others nothing.

Per run, one server: the shapes engine at its defaults (batching included), small frames
so that the model sets the pace. Two parts:

* **Streaming.** For each mode (``unpaced``; ``paced``: ``streaming_buffer_seconds``
  ``streaming_buffer_s``; the order reversed in odd runs) and level (1, 4, 8 sessions),
  the sessions start together and each streams a ``streaming_seconds`` video to its end,
  watched by a simulated real-time viewer (`trio_vstream.client.PlaybackViewer`: a
  playhead at 1x from the first frame, no startup threshold). A paced session sends
  that playhead in ``session.playback`` every 100 ms, the real one, never moved on to
  hide a stall; so the server generates about as fast as the video plays. Per session:
  time to first chunk, chunk inter-arrival (the table's median and p99), real-time
  factor (media seconds / wall seconds from ``session.start`` to the last chunk), and
  from the viewer, replayed on the arrivals once the session ended (`stream_figures`),
  the share of chunks on time, the continuous play ratio, underruns and stall time, as
  seen by a viewer who watched to the end.
* **Paused sessions cost nothing.** ``paused_active`` unpaced sessions stream, and
  their aggregate fps is measured over ``paused_window_s`` in three configurations:
  ``alone``; ``paused``, beside ``paused_idle`` sessions that opted into pacing and
  never report a position (they fill their window, then wait; they ping, as vllm-omni
  asks of a client paused for long); and ``active``, beside as many unpaced sessions
  (what paused sessions would cost if they kept generating: the figure can tell).
  ``paused_reps`` measurements of each per run, in alternating order. The rule
  (`paused_verdict`): the median ``paused`` fps is at least the median ``alone`` fps
  less the noise, where the noise is the ``alone`` measurements' own spread
  ((max - min) / median), and never less than 5 %.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from bench._client import SessionClient, report_failures, run_clients
from bench._context import RunContext
from bench._output import markdown_table, now, progress
from bench._report import cleanup_verdict, figure_rows, make_verdict
from bench._settings import Settings
from bench._stats import Figures, percentile
from bench.scenarios._own_server import (
    SERVER_FRAME_LIMIT,
    SHAPES_PROMPT,
    chunk_rate,
    serving,
    shapes_target,
    started_context,
    wait_all,
)
from trio_vstream import protocol
from trio_vstream.client import PlaybackViewer, check_startup

MODES: Final = ("unpaced", "paced")
CONFIGURATIONS: Final = ("alone", "paused", "active")
MIN_NOISE: Final = 0.05
"""The smallest run-to-run noise the paused-sessions rule allows for (5 %)."""
TARGET_PLAY_RATIO: Final = 0.99
"""Issue 22's steady-state target for the continuous play ratio."""
PAUSED_PING_S: Final = 1.0
"""Paused sessions ping this often: pausing is not engine progress for a stall guard."""
SETTLE_S: Final = 0.5
"""After the paused sessions have filled their window: time for a chunk in flight."""


@attrs.frozen(kw_only=True)
class StreamFigures:
    """One session's streaming figures (`stream_figures`)."""

    ttfc_s: float
    ttff_s: float
    """``session.start`` sent -> the viewer's first frame (its startup threshold met)."""
    interarrival_s: tuple[float, ...]
    rtf: float
    on_time_share: float
    continuous_play_ratio: float
    underruns: int
    stall_s: float


def stream_figures(
    arrivals: Sequence[tuple[float, int, int]],
    started_at: float,
    ended_at: float | None,
    fps: int,
    startup_s: float = 0.0,
) -> StreamFigures | None:
    """The figures of one session from its media arrivals ``(time, frames, bytes)``,
    ``session.start`` sent at ``started_at``, the stream's end (its terminal message;
    None: its last chunk) and the frame rate; None without a chunk.

    The viewer's figures are a `PlaybackViewer` (startup threshold ``startup_s``)
    replayed on the arrivals and taken once its playhead has reached the end: what a
    person who watched it all saw.
    """
    if not arrivals:
        return None
    viewer = PlaybackViewer(started_at, startup_seconds=startup_s)
    for t, frames, _ in arrivals:
        viewer.receive(t, frames / fps)
    last = arrivals[-1][0]
    viewer.end(max(last, ended_at) if ended_at is not None else last)
    played_out = viewer.played_out_at
    assert played_out is not None  # a chunk arrived and the stream ended
    figures = viewer.figures(played_out)
    media = sum(frames for _, frames, _ in arrivals) / fps
    ratio = figures.continuous_play_ratio
    share = figures.on_time_share
    ttff = figures.time_to_first_frame
    assert share is not None and ttff is not None
    return StreamFigures(
        ttfc_s=arrivals[0][0] - started_at,
        ttff_s=ttff,
        interarrival_s=tuple(b[0] - a[0] for a, b in itertools.pairwise(arrivals)),
        rtf=media / (last - started_at) if last > started_at else math.inf,
        on_time_share=share,
        # A video shorter than its startup threshold plays at its end, without a stall.
        continuous_play_ratio=1.0 if ratio is None else ratio,
        underruns=figures.underruns,
        stall_s=figures.stall_seconds,
    )


def chunks_since(client: SessionClient, since: float) -> int:
    """Media chunks the session received at or after ``since``."""
    return sum(1 for t, _, _ in client.arrivals if t >= since)


def paused_verdict(alone: Sequence[float], paused: Sequence[float]) -> dict[str, Any]:
    """Paused sessions cost the active ones nothing: the median fps beside them is at
    least the median alone, less the noise (the alone measurements' spread, at least
    `MIN_NOISE`). Measured: the ratio of the medians."""
    name = "streaming: paused sessions cost the active ones nothing (aggregate fps)"
    if not alone or not paused:
        return make_verdict(name, None, None, "needs both configurations measured")
    base = percentile(alone, 50)
    noise = max(MIN_NOISE, (max(alone) - min(alone)) / base) if base > 0 else MIN_NOISE
    return make_verdict(
        name,
        percentile(paused, 50) / base if base > 0 else None,
        1 - noise,
        f"median fps beside paused sessions / median alone >= 1 - noise; noise = the alone "
        f"runs' (max - min) / median, at least {MIN_NOISE:.0%} (here {noise:.1%})",
        f"{len(alone)} alone, {len(paused)} beside paused",
        at_least=True,
    )


class _Watcher:
    """A session's live simulated viewer: fed each chunk as it is recorded and, for a
    paced session, sending its playhead every 100 ms (`PlaybackViewer.report`)."""

    def __init__(self, client: SessionClient, fps: int, report: bool, startup_s: float) -> None:
        self.client = client
        self.fps = fps
        self.report = report
        self.startup_s = startup_s
        self.viewer: PlaybackViewer | None = None

    async def run(self) -> None:
        client = self.client
        await client.connected.wait()
        if client.t_start_sent is None:
            return  # the connection failed
        viewer = self.viewer = PlaybackViewer(client.t_start_sent, startup_seconds=self.startup_s)
        for t, frames, _ in client.arrivals:  # none yet, unless the server was very quick
            viewer.receive(t, frames / self.fps)
        client.on_media = lambda t, frames: viewer.receive(t, frames / self.fps)
        if not self.report:
            return
        while client.terminal is None and not client.finished.is_set():
            due = viewer.next_report_at
            wait = viewer.report_interval if due is None else due - now()
            await trio.sleep(max(0.0, wait))
            if client.terminal is not None:
                return
            position = viewer.report(now())
            if position is not None and not await client.playback(position):
                return


class StreamingScenario:
    """The scenario over all runs: its server, figures, checks and verdicts."""

    def __init__(self, s: Settings, server_args: Sequence[str]) -> None:
        check_startup(s.streaming_startup_s, s.streaming_buffer_s)
        self.settings = s
        self.figures = Figures()
        self.checks: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.alone: list[float] = []
        self.paused: list[float] = []
        self.target = shapes_target(
            "streaming",
            (),
            server_args,
            max_sessions=max(*s.streaming_levels, s.paused_active + s.paused_idle),
            num_frames=max(self.num_frames, SERVER_FRAME_LIMIT),
        )

    @property
    def num_frames(self) -> int:
        s = self.settings
        return max(1, round(s.streaming_seconds * s.fps))

    def start_json(self, num_frames: int, buffer_s: float | None) -> str:
        """The sessions' ``session.start``: seeded, as the other shapes scenarios'; a paced
        one with vllm-omni's ``streaming_buffer_seconds`` (a top-level field)."""
        s = self.settings
        paced = {} if buffer_s is None else {"streaming_buffer_seconds": buffer_s}
        return protocol.start_message(
            SHAPES_PROMPT,
            size=f"{s.streaming_width}x{s.streaming_height}",
            fps=s.fps,
            num_frames=num_frames,
            seed=7,
            **paced,
        )

    async def run(self, run: int, log_dir: Path) -> None:
        s = self.settings
        modes = MODES if run % 2 == 0 else MODES[::-1]
        info: dict[str, Any] = {"run": run, "mode_order": list(modes), "parts": []}
        self.runs.append(info)
        tag = f"run {run + 1}/{s.repeat} streaming"
        async with serving({"server": self.target}, log_dir, f"streaming-{run}", tag) as servers:
            served = servers["server"]
            info["server_pid"] = served.pid
            ctx = await started_context(served, self.target, s, self.figures, run, self.checks)
            for mode in modes:
                for level in s.streaming_levels:
                    progress(f"{tag}: {mode}, N={level}")
                    info["parts"].append(await self._part(ctx, mode, level))
            info["paused"] = await self._paused(ctx, tag)
        info["server_exit"] = served.exit_status

    async def _part(self, ctx: RunContext, mode: str, level: int) -> dict[str, Any]:
        s = self.settings
        buffer_s = s.streaming_buffer_s if mode == "paced" else None
        clients = [
            SessionClient(ctx.endpoint, self.start_json(self.num_frames, buffer_s))
            for _ in range(level)
        ]
        watchers = [
            _Watcher(client, s.fps, report=buffer_s is not None, startup_s=s.streaming_startup_s)
            for client in clients
        ]

        async def body() -> None:
            async with trio.open_nursery() as nursery:
                for watcher in watchers:
                    nursery.start_soon(watcher.run)

        await run_clients(clients, body, s.session_timeout_s * 2 + s.streaming_seconds)
        failures = report_failures(clients, f"streaming {mode} N={level}")
        await ctx.check_after(f"streaming {mode} n{level}")
        results = [
            stream_figures(c.arrivals, c.t_start_sent, c.t_terminal, s.fps, s.streaming_startup_s)
            for c in clients
            if c.t_start_sent is not None and not c.problem
        ]
        figures = [f for f in results if f is not None]
        prefix = f"streaming.{mode}.n{level}"
        ctx.add(f"{prefix}.ttfc_ms", [f.ttfc_s * 1000 for f in figures])
        ctx.add(f"{prefix}.ttff_ms", [f.ttff_s * 1000 for f in figures])
        ctx.add(f"{prefix}.interarrival_ms", [d * 1000 for f in figures for d in f.interarrival_s])
        ctx.add(f"{prefix}.rtf", [f.rtf for f in figures])
        ctx.add(f"{prefix}.on_time_share", [f.on_time_share for f in figures])
        ctx.add(f"{prefix}.continuous_play_ratio", [f.continuous_play_ratio for f in figures])
        ctx.add(f"{prefix}.underruns", [f.underruns for f in figures])
        ctx.add(f"{prefix}.stall_ms", [f.stall_s * 1000 for f in figures])
        # A session that failed, or got no chunk, has no figures: it counts here.
        ctx.add(f"{prefix}.errors", [max(failures, level - len(figures))])
        return {
            "mode": mode,
            "level": level,
            "frames": [c.frames for c in clients],
            "playback_reports": [c.playback_reports for c in clients],
        }

    async def _paused(self, ctx: RunContext, tag: str) -> list[dict[str, Any]]:
        s = self.settings
        measurements: list[dict[str, Any]] = []
        for rep in range(s.paused_reps):
            fps: dict[str, float] = {}
            for configuration in CONFIGURATIONS if rep % 2 == 0 else CONFIGURATIONS[::-1]:
                progress(f"{tag}: paused sessions, {configuration} ({rep + 1}/{s.paused_reps})")
                measured = await self._paused_once(ctx, configuration)
                measurements.append({"rep": rep, **measured})
                if "active_fps" in measured:
                    fps[configuration] = measured["active_fps"]
            if "alone" in fps:
                self.alone.append(fps["alone"])
            if "paused" in fps:
                self.paused.append(fps["paused"])
            if "alone" in fps and "paused" in fps and fps["alone"] > 0:
                ctx.add("streaming.paused.fps_ratio", [fps["paused"] / fps["alone"]])
        return measurements

    async def _paused_once(self, ctx: RunContext, configuration: str) -> dict[str, Any]:
        """One measurement of the active sessions' aggregate fps in ``configuration``."""
        s = self.settings
        unpaced = self.start_json(SERVER_FRAME_LIMIT, None)
        active = [SessionClient(ctx.endpoint, unpaced) for _ in range(s.paused_active)]
        others: list[SessionClient] = []
        if configuration != "alone":
            buffer_s = s.streaming_buffer_s if configuration == "paused" else None
            start = self.start_json(SERVER_FRAME_LIMIT, buffer_s)
            others = [SessionClient(ctx.endpoint, start) for _ in range(s.paused_idle)]
        window = [math.nan, math.nan]
        filled = [True]
        window_frames = s.streaming_buffer_s * s.fps

        async def measure() -> None:
            if not await wait_all([c.first_chunk for c in active], s.session_timeout_s):
                return
            window[0] = now()
            await trio.sleep(s.paused_window_s)
            # A rate needs two chunks in the window: a window too short for that (the
            # quick form's, beside 4 active sessions on a busy machine) lasts until each
            # session has had them, bounded by the session timeout.
            with trio.move_on_after(s.session_timeout_s):
                for client in active:
                    while chunks_since(client, window[0]) < 2 and client.terminal is None:
                        await client.wait_chunk_since(now())
            window[1] = now()
            for client in active:
                if client.terminal is None:
                    await client.stop()

        async def body() -> None:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                for client in others:
                    nursery.start_soon(client.ping_every, PAUSED_PING_S, stop)
                if configuration == "paused":
                    # They fill their window first (nothing reports a position), then
                    # wait; a chunk in flight then has time to land.
                    with trio.move_on_after(s.session_timeout_s):
                        for client in others:
                            while client.frames < window_frames and client.terminal is None:
                                await client.wait_chunk_since(now())
                    filled[0] = all(c.frames >= window_frames for c in others)
                    await trio.sleep(SETTLE_S)
                await run_clients(active, measure, s.session_timeout_s)
                stop.set()
            for client in others:
                if client.terminal is None:
                    await client.stop()

        await run_clients(others, body, s.session_timeout_s)
        failures = report_failures([*active, *others], f"streaming paused {configuration}")
        await ctx.check_after(f"streaming paused {configuration}")
        result: dict[str, Any] = {"configuration": configuration, "window": window}
        if not filled[0]:
            failures = max(failures, 1)
            progress("  !! streaming: the paused sessions did not fill their window")
        ctx.add("streaming.paused.errors", [failures])
        rates = [chunk_rate(c, window[0], window[1]) for c in active]
        if failures or math.isnan(window[1]) or any(r is None for r in rates):
            return result
        fps = sum(r for r in rates if r is not None)
        ctx.add(f"streaming.paused.{configuration}.active_fps", [fps])
        if others:
            idle = sum(f for c in others for t, f, _ in c.arrivals if window[0] <= t <= window[1])
            ctx.add(f"streaming.paused.{configuration}.idle_fps", [idle / (window[1] - window[0])])
        result["active_fps"] = fps
        return result

    def evaluate(self) -> list[dict[str, Any]]:
        s = self.settings
        level = min(s.streaming_levels)
        measured = self.figures.stat(f"streaming.paced.n{level}.continuous_play_ratio", "min")
        return [
            make_verdict(
                f"streaming: paced, {level} session(s), continuous play ratio (worst session)",
                measured,
                TARGET_PLAY_RATIO,
                f"every session's viewer plays >= {TARGET_PLAY_RATIO:.0%} of its wall time "
                f"after its first frame (streaming_buffer_seconds {s.streaming_buffer_s:g})",
                at_least=True,
            ),
            paused_verdict(self.alone, self.paused),
            cleanup_verdict("streaming", self.checks),
        ]

    def markdown(self) -> list[str]:
        s = self.settings
        header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
        return [
            f"Streaming: the shapes engine; {s.streaming_width}x{s.streaming_height} at "
            f"{s.fps} fps, {s.streaming_seconds:g} s videos; "
            f"{','.join(map(str, s.streaming_levels))} session(s), unpaced and paced "
            f"(streaming_buffer_seconds "
            f"{s.streaming_buffer_s:g}, the simulated viewer's playhead reported every 100 ms; "
            f"its startup threshold {s.streaming_startup_s:g} s). "
            f"Paused sessions: {s.paused_active} unpaced sessions alone, beside "
            f"{s.paused_idle} paused and beside {s.paused_idle} active ones, "
            f"{s.paused_window_s:g} s each, {s.paused_reps} time(s) per run",
            "",
            f"Server: `{self.target.shown}`",
            "",
            markdown_table(header, figure_rows(self.figures)),
        ]

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "server": self.target.to_json(),
            **self.figures.to_json(),
            "alone_fps": self.alone,
            "paused_fps": self.paused,
            "checks": self.checks,
            "runs": self.runs,
            "targets": verdicts,
        }
