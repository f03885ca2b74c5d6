"""``overhead`` (issue 24, section 3): what serving costs on top of encoding, in CPU per
delivered frame, measured against a bare PyAV/libx264 encoder on the same frames.

Per run, one fresh server (``--engine synthetic`` with the harness's default engine
arguments: 16-frame chunks, 4 steps of 10 ms; ``--server-arg`` applies) and one run of
the bare encoder (`bench._bare_encoder`, a process of its own), in the order server,
bare in even runs and bare, server in odd ones, so that drift on a shared machine
affects both.

- **The server.** An untimed round first (the same sessions: a fresh process's heap
  grows to the load's high-water mark, faulting its pages in), then
  ``overhead_sessions`` sessions (8) of ``overhead_frames`` frames (480) at ``--size``
  (832x480) start together and run to their end, unpaced. The
  server process's CPU (user + system, every thread: `bench._server.cpu_seconds`) from
  before the first connects to after the server has none left, over the frames the
  clients received. Of that, the engine's own (``engine_cpu_seconds`` in ``/stats``:
  its ``next_chunk`` calls' thread CPU, where the synthetic engine renders its frames)
  is told apart: the rest, ``serving``, is what the server costs.
- **The bare encoder.** The same frames (the synthetic engine's, same request), one
  libx264 context per session with the server's settings, the server's conversion,
  the sessions in turn chunk by chunk; its CPU with the frames' generation left out.
- **Figures** (``overhead.*``, per run): ``server_ms_per_frame`` (everything),
  ``engine_ms_per_frame``, ``serving_ms_per_frame`` (the difference),
  ``bare_ms_per_frame``, ``bare_generate_ms_per_frame`` (the bare side's generation,
  for comparison with the engine's), ``ratio`` (serving / bare: the figure the target
  is on), ``ratio_with_generation`` (server / (bare + its generation): both sides
  with their frames' making), ``aggregate_fps`` (frames over the sessions' wall time:
  on a shared machine only indicative) and ``errors``.
- **Target**: the median over runs of ``ratio`` <= 1.10.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from bench._bare_encoder import BareJob
from bench._client import SessionClient, report_failures, run_clients
from bench._context import RunContext
from bench._output import markdown_table, now, progress
from bench._report import cleanup_verdict, figure_rows, make_verdict
from bench._server import cpu_seconds, fetch_stats
from bench._settings import DEFAULT_SYNTHETIC_ARGS, PROMPT, REPO_DIR, Settings, make_target
from bench._stats import Figures
from bench.scenarios._own_server import serving, started_context, wait_all
from trio_vstream import protocol

OVERHEAD_LIMIT: Final = 1.10
"""Server CPU (its engine's left out) per frame / the bare encoder's, at most."""
SEED: Final = 1


def per_frame_ms(cpu_s: float | None, frames: int) -> float:
    """CPU seconds over frames, in ms per frame; NaN where either is missing."""
    if cpu_s is None or frames <= 0:
        return math.nan
    return cpu_s * 1000 / frames


def overhead_figures(
    *,
    server_cpu_s: float | None,
    engine_cpu_s: float | None,
    frames: int,
    bare_encode_cpu_s: float,
    bare_generate_cpu_s: float,
    bare_frames: int,
) -> dict[str, float]:
    """One run's figures, from the server's CPU (and its engine's share) over the frames
    its clients received, and the bare encoder's over the frames it encoded. A figure
    that cannot be had is NaN (the statistics leave it out)."""
    server = per_frame_ms(server_cpu_s, frames)
    engine = per_frame_ms(engine_cpu_s, frames)
    bare = per_frame_ms(bare_encode_cpu_s, bare_frames)
    bare_generate = per_frame_ms(bare_generate_cpu_s, bare_frames)
    serving_ms = server - engine
    return {
        "server_ms_per_frame": server,
        "engine_ms_per_frame": engine,
        "serving_ms_per_frame": serving_ms,
        "bare_ms_per_frame": bare,
        "bare_generate_ms_per_frame": bare_generate,
        "ratio": serving_ms / bare if bare > 0 else math.nan,
        "ratio_with_generation": (
            server / (bare + bare_generate) if bare + bare_generate > 0 else math.nan
        ),
    }


class OverheadScenario:
    """The scenario over all runs: its server, figures, checks and verdicts."""

    def __init__(self, s: Settings, server_args: Sequence[str]) -> None:
        self.settings = s
        self.figures = Figures()
        self.checks: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        tokens = ["--engine", "synthetic"]
        for key, value in DEFAULT_SYNTHETIC_ARGS:
            tokens += ["--engine-arg", f"{key}={value}"]
        self.target = make_target(
            "overhead",
            shlex.join([*tokens, *server_args]),
            max_sessions_needed=s.overhead_sessions,
        )
        self.chunk_frames = int(dict(DEFAULT_SYNTHETIC_ARGS)["chunk_frames"])

    def start_json(self, num_frames: int) -> str:
        s = self.settings
        return protocol.start_message(
            PROMPT, size=s.size, fps=s.fps, num_frames=num_frames, seed=SEED
        )

    def bare_job(self) -> BareJob:
        s = self.settings
        return BareJob(
            sessions=s.overhead_sessions,
            num_frames=s.overhead_frames,
            width=s.width,
            height=s.height,
            fps=s.fps,
            chunk_frames=self.chunk_frames,
            prompt=PROMPT,
            seed=SEED,
        )

    async def run(self, run: int, log_dir: Path) -> None:
        s = self.settings
        order = ("server", "bare") if run % 2 == 0 else ("bare", "server")
        info: dict[str, Any] = {"run": run, "order": list(order)}
        self.runs.append(info)
        tag = f"run {run + 1}/{s.repeat} overhead"
        for side in order:
            progress(f"{tag}: {side}")
            if side == "bare":
                info["bare"] = await self._bare()
            else:
                info["server"] = await self._server(run, log_dir, tag)
        server, bare = info["server"], info["bare"]
        figures = overhead_figures(
            server_cpu_s=server["cpu_s"],
            engine_cpu_s=server["engine_cpu_s"],
            frames=server["frames"],
            bare_encode_cpu_s=bare["encode_cpu_s"],
            bare_generate_cpu_s=bare["generate_cpu_s"],
            bare_frames=bare["frames"],
        )
        info["figures"] = figures
        for name, value in figures.items():
            self.figures.add(run, f"overhead.{name}", [value])
        wall = server["wall_s"]
        self.figures.add(
            run, "overhead.aggregate_fps", [server["frames"] / wall if wall > 0 else math.nan]
        )
        self.figures.add(run, "overhead.errors", [server["errors"]])

    async def _bare(self) -> dict[str, Any]:
        """The bare encoder, in a process of its own (see `bench._bare_encoder`)."""
        job = json.dumps(attrs.asdict(self.bare_job()))
        done = await trio.run_process(
            [sys.executable, "-m", "bench._bare_encoder", job],
            cwd=REPO_DIR,
            capture_stdout=True,
        )
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    async def _server(self, run: int, log_dir: Path, tag: str) -> dict[str, Any]:
        s = self.settings
        async with serving({"server": self.target}, log_dir, f"overhead-{run}", tag) as servers:
            served = servers["server"]
            ctx = await started_context(served, self.target, s, self.figures, run, self.checks)
            # An untimed round at the same load first: a fresh process grows its heap to
            # the load's high-water mark (~600 MB here), faulting fresh pages in all the
            # way (8 minor faults a frame, against 1 in the next round); a server that
            # has run a while has it already.
            await self._sessions(ctx, s.overhead_sessions, s.overhead_frames)
            await ctx.settle()
            before = await fetch_stats(ctx.endpoint)
            cpu0 = cpu_seconds(served.pid)
            started = now()
            clients = await self._sessions(ctx, s.overhead_sessions, s.overhead_frames)
            ended = max((c.t_terminal or math.nan for c in clients), default=math.nan)
            await ctx.settle()
            cpu1 = cpu_seconds(served.pid)
            after = await fetch_stats(ctx.endpoint)
            errors = report_failures(clients, "overhead")
            await ctx.check_after("overhead")
        frames = sum(c.frames for c in clients)
        expected = s.overhead_sessions * s.overhead_frames
        if frames != expected:
            progress(f"  !! overhead: {frames} frames delivered of {expected}")
        engine_cpu = None
        if before is not None and after is not None and "engine_cpu_seconds" in after:
            engine_cpu = after["engine_cpu_seconds"] - before["engine_cpu_seconds"]
        return {
            "server_pid": served.pid,
            "server_exit": served.exit_status,
            "frames": frames,
            "cpu_s": cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None,
            "engine_cpu_s": engine_cpu,
            "wall_s": ended - started,
            "errors": errors + (frames != expected),
        }

    async def _sessions(self, ctx: RunContext, count: int, frames: int) -> list[SessionClient]:
        """``count`` sessions of ``frames`` frames started together, run to their end."""
        s = self.settings
        clients = [SessionClient(ctx.endpoint, self.start_json(frames)) for _ in range(count)]

        async def body() -> None:
            await wait_all([c.finished for c in clients], s.session_timeout_s * 4)

        await run_clients(clients, body, s.session_timeout_s * 4)
        return clients

    def evaluate(self) -> list[dict[str, Any]]:
        return [
            make_verdict(
                "overhead: server CPU per frame (its engine's left out) / the bare encoder's",
                self.figures.stat("overhead.ratio", "median"),
                OVERHEAD_LIMIT,
                f"median over runs <= {OVERHEAD_LIMIT:.2f}",
            ),
            cleanup_verdict("overhead", self.checks),
        ]

    def markdown(self) -> list[str]:
        s = self.settings
        header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
        return [
            f"Overhead: {s.overhead_sessions} sessions of {s.overhead_frames} frames at "
            f"{s.size}, {s.fps} fps, {self.chunk_frames}-frame chunks, started together, "
            "unpaced; against a bare PyAV/libx264 encoder (the server's settings and "
            "conversion, one context per session) on the same frames",
            "",
            f"Server: `{self.target.shown}`",
            "",
            markdown_table(header, figure_rows(self.figures)),
        ]

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "server": self.target.to_json(),
            "bare": attrs.asdict(self.bare_job()),
            **self.figures.to_json(),
            "checks": self.checks,
            "runs": self.runs,
            "targets": verdicts,
        }
