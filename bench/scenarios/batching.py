"""``batching`` (issue 13): the shapes engine with its sessions' denoising steps batched
(``max_batch`` 8, its default) against the same engine stepping each session alone
(``max_batch=1``), at 1 to 16 sessions, in the same run.

Every run starts one server of each mode (together, since starting is not measured) and
measures them one after the other, in the order on, off in even runs and off, on in odd
ones, as ``--compare`` alternates its targets: drift on the machine (other load, heat)
then lands on both modes alike, and the ratios are taken within a run.

Per mode and level N, N sessions start together and stream (unpaced, a video longer than
the level lasts); once every session has its first chunk, a window runs until each has
had ``window_chunks`` more chunks and at least ``window_s`` passed; then all are stopped.
Figures: time to first chunk, aggregate and per-session delivered fps, stop -> done, the
rows the server ran in batches (``/stats``), and per run the on/off ratios of the
aggregate fps and of the median TTFC.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

import attrs
import trio

from bench._client import SessionClient, report_failures, run_clients
from bench._context import RunContext
from bench._output import markdown_table, now, progress
from bench._report import cleanup_verdict, figure_rows, make_verdict
from bench._server import cpu_seconds
from bench._settings import Settings
from bench._stats import Figures, percentile
from bench.scenarios._own_server import (
    chunk_rate,
    serving,
    shapes_target,
    start_json,
    started_context,
    stop_done_ms,
    wait_all,
)

BATCHING_PRESETS: Final = ("quick", "cpu", "gpu")
MODES: Final = ("on", "off")
"""``on``: the preset's ``max_batch``; ``off``: ``max_batch=1`` (each session alone)."""
FPS_RATIO_LEVEL: Final = 8
FPS_RATIO_MIN: Final = 1.3
TTFC_RATIO_MAX: Final = 1.15


@attrs.frozen(kw_only=True)
class BatchingPreset:
    """What the scenario asks of the shapes engine: a small video (64x64, so the model,
    not the encoder, is what is under load), long enough that no session ends before it
    is stopped, at these levels, with this batch size."""

    name: str
    device: str
    levels: tuple[int, ...]
    max_batch: int
    width: int = 64
    height: int = 64
    fps: int = 24
    num_frames: int = 2400
    window_s: float = 4.0
    """The least time measured per level, once every session has its first chunk."""
    window_chunks: int = 3
    """...and until every session had this many chunks in the window."""
    ttfc_sessions: int = 5
    """Single sessions (stopped at their first chunk) before level 1: TTFC samples."""

    @classmethod
    def named(cls, name: str) -> BatchingPreset:
        if name == "quick":  # for CI: seconds
            return cls(
                name=name,
                device="cpu",
                levels=(1, 8),
                max_batch=8,
                window_s=1.0,
                window_chunks=2,
                ttfc_sessions=2,
            )
        if name == "cpu":  # the 2-core machine the targets are stated for
            return cls(name=name, device="cpu", levels=(1, 2, 4, 8, 16), max_batch=8)
        if name == "gpu":  # a GPU runs a batch of 32 rows in about the time of one
            return cls(
                name=name,
                device="cuda",
                levels=(1, 8, 16, 32, 64),
                max_batch=32,
                num_frames=24000,
            )
        raise ValueError(f"unknown batching preset {name!r}: use {', '.join(BATCHING_PRESETS)}")

    @classmethod
    def default(cls, quick: bool) -> BatchingPreset:
        """--quick: quick; otherwise gpu where CUDA is available, else cpu."""
        if quick:
            return cls.named("quick")
        import torch

        return cls.named("gpu" if torch.cuda.is_available() else "cpu")

    def engine_args(self, mode: str) -> tuple[tuple[str, str], ...]:
        return (("max_batch", str(self.max_batch if mode == "on" else 1)),)


@attrs.define
class _Level:
    """One level of one mode: its sessions and what the server said around them."""

    clients: list[SessionClient]
    probes: list[SessionClient] = attrs.field(factory=list)
    start: float = math.nan
    end: float = math.nan
    stats_before: dict[str, Any] | None = None
    stats_after: dict[str, Any] | None = None
    server_cpu: float | None = None


class BatchingScenario:
    """The scenario over all runs: its servers, figures, checks and verdicts.

    ``name`` prefixes its figures and ``modes`` are its two servers, the first measured
    against the second: the ``decode`` scenario is this one with other modes."""

    name: ClassVar[str] = "batching"
    modes: ClassVar[tuple[str, str]] = MODES

    def __init__(self, s: Settings, preset: BatchingPreset, server_args: Sequence[str]) -> None:
        self.settings = s
        self.preset = preset
        self.figures = Figures()
        self.checks: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        # The preset says the device; a --server-arg=--device=... after it wins.
        self.server_args = [f"--device={preset.device}", *server_args]
        self.targets = {
            mode: shapes_target(
                mode,
                preset.engine_args(mode),
                self.server_args,
                max_sessions=max(preset.levels),
                num_frames=preset.num_frames,
            )
            for mode in self.modes
        }

    def start_json(self) -> str:
        p = self.preset
        return start_json(p.width, p.height, p.fps, p.num_frames)

    async def run(self, run: int, log_dir: Path) -> None:
        order = self.modes if run % 2 == 0 else self.modes[::-1]
        info: dict[str, Any] = {"run": run, "order": list(order), "modes": {}}
        self.runs.append(info)
        tag = f"run {run + 1}/{self.settings.repeat} {self.name}"
        async with serving(self.targets, log_dir, f"{self.name}-{run}", tag) as served:
            for mode in order:
                ctx = await started_context(
                    served[mode], self.targets[mode], self.settings, self.figures, run, self.checks
                )
                info["modes"][mode] = {"server_pid": served[mode].pid, "levels": []}
                await self._warm_up(ctx)
                for level in self.preset.levels:
                    progress(f"{tag} {mode}: N={level}")
                    info["modes"][mode]["levels"].append(await self._level(ctx, mode, level))
        for mode in self.modes:
            info["modes"][mode]["server_exit"] = served[mode].exit_status
        self._ratios(run)

    async def _warm_up(self, ctx: RunContext) -> None:
        """One untimed session, so that neither mode's first level pays for a fresh
        process (first allocations, first batch shapes)."""
        client = SessionClient(ctx.endpoint, self.start_json())
        await _first_chunk_then_stop([client], self.settings.session_timeout_s)
        report_failures([client], f"{self.name}: warm-up")
        await ctx.settle()

    async def _level(self, ctx: RunContext, mode: str, level: int) -> dict[str, Any]:
        s, p = self.settings, self.preset
        measured = _Level([SessionClient(ctx.endpoint, self.start_json()) for _ in range(level)])
        measured.stats_before = await ctx.metrics()
        if level == 1:
            # More TTFC samples for the target: single sessions, each stopped at its
            # first chunk, before the one that streams through the window.
            for _ in range(p.ttfc_sessions - 1):
                probe = SessionClient(ctx.endpoint, self.start_json())
                await _first_chunk_then_stop([probe], s.session_timeout_s)
                measured.probes.append(probe)
                await ctx.settle()

        async def body() -> None:
            clients = measured.clients
            if not await wait_all([c.first_chunk for c in clients], s.session_timeout_s):
                return
            measured.start = now()
            cpu0 = cpu_seconds(ctx.pid)
            with trio.move_on_after(s.session_timeout_s):
                await trio.sleep(p.window_s)
                # Sampled every 20 ms (ASYNC110), as the published figures were measured.
                while not all(  # noqa: ASYNC110
                    c.finished.is_set() or _chunks_since(c, measured.start) >= p.window_chunks
                    for c in clients
                ):
                    await trio.sleep(0.02)
            measured.end = now()
            cpu1 = cpu_seconds(ctx.pid)
            if cpu0 is not None and cpu1 is not None:
                measured.server_cpu = (cpu1 - cpu0) / (measured.end - measured.start)
            for client in clients:
                if client.terminal is None:
                    await client.stop()

        await run_clients(measured.clients, body, s.session_timeout_s)
        failures = report_failures(
            [*measured.probes, *measured.clients], f"{self.name} {mode} N={level}"
        )
        await ctx.check_after(f"{self.name} {mode} n{level}")
        measured.stats_after = await ctx.metrics()
        self._record(ctx, mode, level, measured, failures)
        return {
            "level": level,
            "window": [measured.start, measured.end],
            "stats_before": _counters(measured.stats_before),
            "stats_after": _counters(measured.stats_after),
        }

    def _record(
        self, ctx: RunContext, mode: str, level: int, measured: _Level, failures: int
    ) -> None:
        prefix = f"{self.name}.{mode}.n{level}"
        everyone = [*measured.probes, *measured.clients]
        ctx.add(
            f"{prefix}.ttfc_ms",
            [
                (c.arrivals[0][0] - c.t_start_sent) * 1000
                for c in everyone
                if c.arrivals and c.t_start_sent is not None
            ],
        )
        ctx.add(f"{prefix}.stop_done_ms", stop_done_ms(everyone))
        ctx.add(f"{prefix}.errors", [failures])
        ctx.add(
            f"{prefix}.ended_early",
            [sum(1 for c in measured.clients if c.t_stop_sent is None)],
        )
        before, after = measured.stats_before, measured.stats_after
        if before is not None and after is not None:
            rows = after.get("batch_rows", 0) - before.get("batch_rows", 0)
            batches = after.get("batches", 0) - before.get("batches", 0)
            ctx.add(f"{prefix}.batch_rows", [rows])
            if batches > 0:
                ctx.add(f"{prefix}.mean_batch", [rows / batches])
        else:
            ctx.figures.mark_unavailable(f"{prefix}.batch_rows", "needs /stats")
        if math.isnan(measured.end):
            return
        rates = [chunk_rate(c, measured.start, measured.end) for c in measured.clients]
        known = [r for r in rates if r is not None]
        ctx.add(f"{prefix}.session_fps", known)
        if len(known) == len(rates):
            ctx.add(f"{prefix}.aggregate_fps", [sum(known)])
        if measured.server_cpu is not None:
            ctx.add(f"{prefix}.server_cpu_cores", [measured.server_cpu])

    def _ratios(self, run: int) -> None:
        """Per run, on / off: aggregate fps and median TTFC, level by level."""
        for level in self.preset.levels:
            for figure, name in (("aggregate_fps", "fps_ratio"), ("ttfc_ms", "ttfc_ratio")):
                on, off = (
                    self._run_median(run, f"{self.name}.{m}.n{level}.{figure}") for m in self.modes
                )
                if on is not None and off:
                    self.figures.add(run, f"{self.name}.n{level}.{name}", [on / off])

    def _run_median(self, run: int, name: str) -> float | None:
        figure = self.figures.get(name)
        if figure is None or len(figure.runs) <= run or not figure.runs[run]:
            return None
        return percentile(figure.runs[run], 50)

    def evaluate(self) -> list[dict[str, Any]]:
        """The targets, on the median over runs of each run's own ratio."""
        p = self.preset
        fps_level = FPS_RATIO_LEVEL if FPS_RATIO_LEVEL in p.levels else max(p.levels)
        return [
            make_verdict(
                f"batching: aggregate fps at {fps_level} sessions, batched / unbatched",
                self.figures.stat(f"batching.n{fps_level}.fps_ratio", "median"),
                FPS_RATIO_MIN,
                f">= {FPS_RATIO_MIN}x (median over runs of each run's ratio)",
                at_least=True,
            ),
            make_verdict(
                "batching: time to first chunk, one session, batched / unbatched",
                self.figures.stat("batching.n1.ttfc_ratio", "median"),
                TTFC_RATIO_MAX,
                f"<= {TTFC_RATIO_MAX}x (median over runs of each run's ratio of median TTFCs)",
                note="" if 1 in p.levels else "level 1 not measured",
            ),
            cleanup_verdict("batching", self.checks),
        ]

    def describe(self) -> list[str]:
        p = self.preset
        return [
            f"Batching: preset {p.name}: the shapes engine on {p.device}, max_batch "
            f"{p.max_batch} (on) against 1 (off); {p.width}x{p.height} at {p.fps} fps, "
            f"{p.num_frames} frames per session (unpaced); levels "
            f"{','.join(map(str, p.levels))}; a window of at least {p.window_s:g} s and "
            f"{p.window_chunks} chunks per session; {p.ttfc_sessions} single-session TTFC "
            f"sample(s) per run",
            "",
            *(f"Server {mode}: `{self.targets[mode].shown}`" for mode in self.modes),
        ]

    def markdown(self) -> list[str]:
        header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
        return [*self.describe(), "", markdown_table(header, figure_rows(self.figures))]

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "preset": attrs.asdict(self.preset),
            "servers": {mode: target.to_json() for mode, target in self.targets.items()},
            **self.figures.to_json(),
            "checks": self.checks,
            "runs": self.runs,
            "targets": verdicts,
        }


def _chunks_since(client: SessionClient, start: float) -> int:
    return sum(1 for t, _, _ in client.arrivals if t >= start)


def _counters(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    if stats is None:
        return None
    keys = ("sessions_total", "chunks_sent", "batches", "batch_rows")
    return {key: stats.get(key) for key in keys}


async def _first_chunk_then_stop(clients: Sequence[SessionClient], timeout: float) -> None:
    """Sessions that stop as soon as their first chunk is in (``session.stop`` at once)."""

    async def body() -> None:
        await wait_all([c.first_chunk for c in clients], timeout)
        for client in clients:
            if client.terminal is None:
                await client.stop()

    await run_clients(clients, body, timeout)
