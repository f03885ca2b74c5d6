"""``diffusers`` (where diffusers is installed): a random Wan pipeline, built in a
temporary directory and served by ``--engine diffusers``: the server's time per segment
(and TTFC, delivered fps) against the same pipeline calls made directly, in a process of
their own (``run.py --diffusers-worker``); and each family the engine streams exactly
(`STREAMED`: Helios chunks, SkyReels-V2 DF windows), its first chunk against the
pipeline's own single call for the whole video.

The measurement in three modules: what is measured (``_diffusers_presets``: the presets,
the streamed families), the direct side (``_diffusers_worker``: the worker process that
makes exactly the calls the engine makes, and the harness's handle on it), and here the
scenario, which drives both sides and the server, and its verdicts. What ``run.py``
needs of the other two is named here too (``__all__``).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
import shlex
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from bench._client import SessionClient, report_failures, run_clients
from bench._context import RunContext
from bench._output import now, progress
from bench._server import Endpoint, ServerProcess, cpu_seconds, fetch_stats, minor_faults
from bench._settings import BENCH_DIR, PROMPT, Settings, Target, make_target
from bench._stats import Figures, percentile
from bench.scenarios._diffusers_presets import (
    DIFFUSERS_PRESETS,
    STREAMED,
    DiffusersPreset,
    StreamedFamily,
)
from bench.scenarios._diffusers_worker import DirectWorker, diffusers_worker
from trio_vstream import protocol

__all__ = [
    "CHUNKED_FIRST_CHUNK_SLACK",
    "DIFFUSERS_OVERHEAD_LIMIT_PCT",
    "DIFFUSERS_PRESETS",
    "DiffusersPreset",
    "DiffusersScenario",
    "diffusers_available",
    "diffusers_worker",
]


def diffusers_available() -> bool:
    """Whether the ``diffusers`` scenario can run here (it needs the optional extra)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("diffusers", "transformers"))


DIFFUSERS_OVERHEAD_LIMIT_PCT: Final = 5.0
CHUNKED_FIRST_CHUNK_SLACK: Final = 1.5
"""How far over 1/k the chunked first-chunk fraction may be (its own decode, noise)."""


def _steady_fps(times_ms: Sequence[float], frames: int) -> float:
    """Frames per second over the segments after the first."""
    steady = times_ms[1:]
    return frames * len(steady) / (sum(steady) / 1000) if steady else math.nan


class DiffusersScenario:
    """The server's overhead over calling the same diffusers pipeline directly.

    Once: a worker process (``--diffusers-worker``) builds a random Wan pipeline of the
    preset's size into a temporary directory and loads it as the server does
    (``load_engine("diffusers", ...)``, ``threads=1``). Per run: a fresh server
    (``--engine diffusers``, the same engine args), one warm-up segment on each side, then
    ``diffusers_reps`` times, in alternating order: (a) the session's pipeline calls made
    directly in the worker, (b) the same session through the engine alone, in the worker,
    (c) the same session through the server, over a WebSocket.
    """

    def __init__(self, s: Settings, preset: DiffusersPreset, server_args: Sequence[str]) -> None:
        self.s = s
        self.preset = preset
        self.server_args = list(server_args)
        self.figures = Figures()
        self.checks: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.worker: DirectWorker | None = None
        self.target: Target | None = None
        self.inproc_torch_threads: int | None = None
        self.build_s: float | None = None
        self.worker_exit: int | None = None

    @property
    def segments(self) -> int:
        return self.s.diffusers_segments

    async def setup(self, work_dir: Path) -> None:
        preset = self.preset
        model = work_dir / f"Wan-random-{preset.name}"
        config = {"preset": preset.name, "model": str(model)}
        command = [
            sys.executable,
            str(BENCH_DIR / "run.py"),
            "--diffusers-worker",
            json.dumps(config),
        ]
        progress(f"diffusers: building and loading a random Wan pipeline ({preset.name} preset)")
        self.worker = DirectWorker(command, work_dir / "diffusers-worker.log")
        ready = await self.worker.start(timeout=600)
        self.build_s = ready["build_s"]
        self.inproc_torch_threads = ready["torch_threads"]
        spec = ["--engine", "diffusers", "--device", preset.device]
        for key, value in preset.engine_args(model).items():
            spec += ["--engine-arg", f"{key}={value}"]
        self.target = make_target(
            "diffusers", shlex.join([*spec, *self.server_args]), max_sessions_needed=1
        )

    async def close(self) -> None:
        if self.worker is not None:
            self.worker_exit = await self.worker.stop()
            self.worker = None

    async def _process_cost(
        self, run: int, side: str, pid: int | None, body: Callable[[], Awaitable[Any]]
    ) -> Any:
        """Run ``body``; record the process's page faults and CPU time per segment."""
        faults, cpu = minor_faults(pid), cpu_seconds(pid)
        result = await body()
        faults_after, cpu_after = minor_faults(pid), cpu_seconds(pid)
        if faults is not None and faults_after is not None:
            per_segment = (faults_after - faults) / self.segments
            self.figures.add(run, f"diffusers.{side}.faults_per_segment", [per_segment])
        if cpu is not None and cpu_after is not None:
            per_segment = (cpu_after - cpu) * 1000 / self.segments
            self.figures.add(run, f"diffusers.{side}.cpu_ms_per_segment", [per_segment])
        return result

    async def _direct(self, run: int, what: str, side: str, seed: int) -> list[float]:
        worker = self.worker
        assert worker is not None and worker.process is not None
        timeout = self.s.session_timeout_s

        async def call() -> dict[str, Any]:
            return await worker.call(timeout, what=what, segments=self.segments, seed=seed)

        result = await self._process_cost(run, side, worker.process.pid, call)
        return result["segment_ms"]

    async def _inproc(self, run: int, seed: int) -> None:
        times = await self._direct(run, "pipeline", "inproc", seed)
        self.figures.add(run, "diffusers.inproc.first_segment_ms", times[:1])
        self.figures.add(run, "diffusers.inproc.segment_ms", times[1:])
        self.figures.add(
            run, "diffusers.inproc.fps", [_steady_fps(times, self.preset.segment_frames)]
        )

    async def _engine(self, run: int, seed: int) -> None:
        times = await self._direct(run, "engine", "engine", seed)
        self.figures.add(run, "diffusers.engine.first_segment_ms", times[:1])
        self.figures.add(run, "diffusers.engine.segment_ms", times[1:])

    async def _streamed(self, run: int, seed: int, family: StreamedFamily) -> None:
        """First chunk vs whole call, for a streamed random pipeline (in the worker)."""
        worker = self.worker
        assert worker is not None
        result = await worker.call(
            self.s.session_timeout_s, what=family.key, segments=self.segments, seed=seed
        )
        if "error" in result:
            progress(f"  !! diffusers: {family.key}: {result['error']}")
            return
        whole, done = result["whole_call_ms"], result["chunk_done_ms"]
        prefix = f"diffusers.{family.key}"
        self.figures.add(run, f"{prefix}.whole_call_ms", [whole])
        self.figures.add(run, f"{prefix}.first_chunk_ms", done[:1])
        self.figures.add(run, f"{prefix}.streamed_total_ms", done[-1:])
        self.figures.add(run, f"{prefix}.first_chunk_fraction", [done[0] / whole])

    async def _server(self, ctx: RunContext, seed: int) -> None:
        frames = self.segments * self.preset.segment_frames
        client = SessionClient(
            ctx.endpoint,
            protocol.start_message(PROMPT, **self.preset.start_fields(frames, seed)),
        )
        await self._process_cost(
            ctx.run,
            "server",
            ctx.pid,
            functools.partial(
                run_clients, [client], trio.lowlevel.checkpoint, self.s.session_timeout_s
            ),
        )
        failed = report_failures([client], "diffusers: server session")
        await ctx.settle()
        if failed or not client.arrivals or client.t_start_sent is None:
            ctx.add("diffusers.server.errors", [1])
            return
        ctx.add("diffusers.server.errors", [0])
        arrivals = [t for t, _, _ in client.arrivals]
        ctx.add("diffusers.server.ttfc_ms", [(arrivals[0] - client.t_start_sent) * 1000])
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
        ctx.add("diffusers.server.interarrival_ms", gaps)
        if len(arrivals) > 1:
            steady = sum(f for _, f, _ in client.arrivals[1:])
            ctx.add("diffusers.server.fps", [steady / (arrivals[-1] - arrivals[0])])
        if len(client.arrivals) != self.segments:
            progress(f"  !! diffusers: {len(client.arrivals)} chunks for {self.segments} segments")

    async def run(self, run: int, log_dir: Path) -> None:
        assert self.target is not None and self.target.command is not None
        assert self.worker is not None
        s = self.s
        tag = f"run {run + 1}/{s.repeat} diffusers"
        server = ServerProcess(self.target.command, log_dir / f"server-diffusers-{run}.log")
        info: dict[str, Any] = {"run": run, "target": "diffusers"}
        try:
            url = await server.start(timeout=300)
            info["server_pid"] = server.pid
            progress(f"{tag}: server pid {server.pid} at {url}")
            endpoint = Endpoint.parse(url)
            ctx = RunContext(
                target=self.target,
                endpoint=endpoint,
                settings=s,
                figures=self.figures,
                run=run,
                pid=server.pid,
                rng=random.Random(s.seed * 1000 + run),
                checks=self.checks,
                has_metrics=await fetch_stats(endpoint) is not None,
            )
            progress(f"{tag}: warm-up, one segment on each side")
            warm_up = SessionClient(
                endpoint,
                protocol.start_message(
                    PROMPT, **self.preset.start_fields(self.preset.segment_frames, s.seed)
                ),
            )
            await run_clients([warm_up], trio.lowlevel.checkpoint, s.session_timeout_s)
            report_failures([warm_up], "diffusers: warm-up session")
            await ctx.settle()
            await self.worker.call(s.session_timeout_s, what="pipeline", segments=1, seed=s.seed)
            started = now()
            for rep in range(s.diffusers_reps):
                seed = s.seed + 1000 * (run * s.diffusers_reps + rep)
                steps = [
                    ("direct pipeline calls", functools.partial(self._inproc, run, seed)),
                    ("engine alone", functools.partial(self._engine, run, seed)),
                    ("server", functools.partial(self._server, ctx, seed)),
                ]
                if (run + rep) % 2:
                    steps.reverse()  # drift on the machine affects both sides alike
                for label, step in steps:
                    progress(f"{tag}: {label}, {self.segments} segments")
                    await step()
                for family in STREAMED:
                    progress(
                        f"{tag}: {family.label}, {self.segments} {family.unit}s, "
                        "streamed vs one call"
                    )
                    await self._streamed(run, seed, family)
            ctx.windows.append({"scenario": "diffusers", "start": started, "end": now()})
            info["windows"] = ctx.windows
            await ctx.check_after("diffusers")
            self._add_ratios(run)
        finally:
            info["server_exit"] = await server.stop()
            if info["server_exit"] != 0:
                progress(f"server exited with {info['server_exit']}:\n{server.log_tail(10)}")
            self.runs.append(info)

    def _run_median(self, name: str, run: int) -> float | None:
        figure = self.figures.get(name)
        if figure is None or len(figure.runs) <= run or not figure.runs[run]:
            return None
        return percentile(figure.runs[run], 50)

    def _add_ratios(self, run: int) -> None:
        """One value per run: the run's medians compared."""
        inproc = self._run_median("diffusers.inproc.segment_ms", run)
        server = self._run_median("diffusers.server.interarrival_ms", run)
        engine = self._run_median("diffusers.engine.segment_ms", run)
        if inproc and server:
            self.figures.add(run, "diffusers.overhead_pct", [100 * (server / inproc - 1)])
        if inproc and engine:
            self.figures.add(run, "diffusers.engine_overhead_pct", [100 * (engine / inproc - 1)])
        first = self._run_median("diffusers.inproc.first_segment_ms", run)
        ttfc = self._run_median("diffusers.server.ttfc_ms", run)
        if first and ttfc:
            self.figures.add(run, "diffusers.ttfc_overhead_ms", [ttfc - first])

    def evaluate(self) -> list[dict[str, Any]]:
        """Pooled medians of all runs: server per-segment time over the in-process one."""
        inproc = self.figures.stat("diffusers.inproc.segment_ms", "median")
        server = self.figures.stat("diffusers.server.interarrival_ms", "median")
        measured = None if not inproc or server is None else 100 * (server / inproc - 1)
        status = "N/A" if measured is None else "PASS"
        if measured is not None and measured > DIFFUSERS_OVERHEAD_LIMIT_PCT:
            status = "FAIL"
        leftovers = [c for c in self.checks if c["ok"] is False]
        cleanup = "PASS" if not leftovers else "FAIL"
        if not self.checks or any(c["ok"] is None for c in self.checks):
            cleanup = "N/A"
        return [
            {
                "target": "diffusers: server overhead per segment",
                "rule": "median chunk inter-arrival through the server / median segment time "
                "of the same pipeline calls made directly (in a process of their own) - 1 "
                "<= 5 %",
                "measured": measured,
                "threshold": DIFFUSERS_OVERHEAD_LIMIT_PCT,
                "status": status,
                "note": f"{server:.1f} ms vs {inproc:.1f} ms" if measured is not None else "",
            },
            *(self._streamed_verdict(family) for family in STREAMED),
            {
                "target": "diffusers: cleanup",
                "rule": "sessions_active = streams_open = worker_threads = 0 after each run",
                "measured": {"runs_with_leftovers": len(leftovers)},
                "threshold": None,
                "status": cleanup,
                "note": "",
            },
        ]

    def _streamed_verdict(self, family: StreamedFamily) -> dict[str, Any]:
        """The first chunk's share of the single call (pooled median) against 1.5 / k."""
        fraction = self.figures.stat(f"diffusers.{family.key}.first_chunk_fraction", "median")
        ideal = 1 / self.segments
        status = "N/A" if fraction is None else "PASS"
        if fraction is not None and fraction > CHUNKED_FIRST_CHUNK_SLACK * ideal:
            status = "FAIL"
        k, unit = self.segments, family.unit
        return {
            "target": family.target,
            "rule": f"a {family.label} streamed in {k} {unit}s: time to the first {unit} / "
            f"time of the single pipeline call for the whole video <= "
            f"{CHUNKED_FIRST_CHUNK_SLACK} / {k} (ideal 1/k, plus one decode)",
            "measured": fraction,
            "threshold": CHUNKED_FIRST_CHUNK_SLACK * ideal,
            "status": status,
            "note": "" if fraction is None else f"ideal {ideal:.3f}",
        }

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.target is not None
        return {
            "preset": attrs.asdict(self.preset),
            "segments": self.segments,
            "reps_per_run": self.s.diffusers_reps,
            "build_s": self.build_s,
            "command": list(self.target.command or ()),
            "engine_args": dict(self.target.engine_args),
            "inproc_torch_threads": self.inproc_torch_threads,
            "worker_exit": self.worker_exit,
            **self.figures.to_json(),
            "checks": self.checks,
            "runs": self.runs,
            "targets": verdicts,
        }
