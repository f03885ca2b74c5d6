"""``effect`` (issue 15, item 5): latency to effect, from a camera interaction sent to the
first delivered frames generated under it, with the shapes engine (which steers its
object by camera velocity).

Per run, one server (the shapes engine at its defaults, batching included). For each
chunk size (``extra_params.chunk_frames`` 8, 4, 2; the order reversed in odd runs) and
each level (1 and 8 sessions), the sessions start together and stream unpaced; each then
sends ``effect_interactions`` camera velocities (a W, A, S or D key's, with
``transition_chunks`` 0), one at a time, each after a random pause (seeded) once the
previous one took effect. An interaction's latency runs from its ``session.interaction``
sent to the arrival of the first media chunk whose metadata lists its event id in
``started_event_ids``. Beside it: the ``session.interaction.queued`` round trip, the
aggregate delivered fps while the interactions ran (the other side of the chunk-size
trade-off), and the interactions that never took effect.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import trio

from bench._client import SessionClient, report_failures, run_clients
from bench._context import RunContext
from bench._output import markdown_table, now, progress
from bench._report import cleanup_verdict, figure_rows, make_verdict
from bench._settings import Settings
from bench._stats import Figures
from bench.scenarios._own_server import (
    chunk_rate,
    serving,
    shapes_target,
    start_json,
    started_context,
    wait_all,
)
from trio_vstream import protocol

EFFECT_KEYS: Final = ("w", "a", "s", "d")
"""The camera keys of vllm-omni's example client that translate (up, left, down, right
for the shapes world), so that consecutive interactions mostly steer somewhere new."""
TARGET_CHUNK_FRAMES: Final = 8
TARGET_SLACK_MS: Final = 100.0


class EffectScenario:
    """The scenario over all runs: its server, figures, checks and verdicts."""

    def __init__(self, s: Settings, server_args: Sequence[str]) -> None:
        self.settings = s
        self.figures = Figures()
        self.checks: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.target = shapes_target(
            "effect",
            (),
            server_args,
            max_sessions=max(s.effect_levels),
            num_frames=s.effect_frames,
        )

    def start_json(self, chunk_frames: int) -> str:
        s = self.settings
        return start_json(
            s.effect_width, s.effect_height, s.fps, s.effect_frames, chunk_frames=chunk_frames
        )

    async def run(self, run: int, log_dir: Path) -> None:
        s = self.settings
        sizes = s.effect_chunk_frames if run % 2 == 0 else s.effect_chunk_frames[::-1]
        info: dict[str, Any] = {"run": run, "chunk_frames_order": list(sizes), "parts": []}
        self.runs.append(info)
        tag = f"run {run + 1}/{s.repeat} effect"
        async with serving({"server": self.target}, log_dir, f"effect-{run}", tag) as servers:
            served = servers["server"]
            info["server_pid"] = served.pid
            ctx = await started_context(served, self.target, s, self.figures, run, self.checks)
            for chunk_frames in sizes:
                for level in s.effect_levels:
                    progress(f"{tag}: chunk_frames={chunk_frames}, N={level}")
                    info["parts"].append(await self._part(ctx, chunk_frames, level))
        info["server_exit"] = served.exit_status

    async def _part(self, ctx: RunContext, chunk_frames: int, level: int) -> dict[str, Any]:
        s = self.settings
        clients = [SessionClient(ctx.endpoint, self.start_json(chunk_frames)) for _ in range(level)]
        window = [math.nan, math.nan]
        latencies: list[float] = []

        async def steer(index: int, client: SessionClient) -> None:
            # Seeded per run, chunk size, level and session: the same moments every time.
            rng = random.Random(f"{s.seed}-{ctx.run}-{chunk_frames}-{level}-{index}")
            for k in range(s.effect_interactions):
                await trio.sleep(rng.uniform(0.0, s.effect_gap_s))
                if client.terminal is not None:
                    return
                event_id = f"effect-{chunk_frames}-{level}-{index}-{k}"
                camera = protocol.key_velocity([{rng.choice(EFFECT_KEYS)}])
                if not await client.interact(event_id, camera, transition_chunks=0):
                    return
                started = await client.wait_started(event_id, s.session_timeout_s)
                if started is not None:
                    latencies.append((started - client.interactions_sent[event_id]) * 1000)

        async def body() -> None:
            if not await wait_all([c.first_chunk for c in clients], s.session_timeout_s):
                return
            window[0] = now()
            async with trio.open_nursery() as nursery:
                for index, client in enumerate(clients):
                    nursery.start_soon(steer, index, client)
            window[1] = now()
            for client in clients:
                if client.terminal is None:
                    await client.stop()

        await run_clients(clients, body, s.session_timeout_s)
        failures = report_failures(clients, f"effect chunk_frames={chunk_frames} N={level}")
        for client in clients:
            for problem in client.control_errors[:3]:
                progress(f"  !! effect: interaction refused: {problem}")
        await ctx.check_after(f"effect c{chunk_frames} n{level}")
        prefix = f"effect.c{chunk_frames}.n{level}"
        ctx.add(f"{prefix}.latency_ms", latencies)
        ctx.add(
            f"{prefix}.queued_ms",
            [
                (c.interactions_queued[e] - sent) * 1000
                for c in clients
                for e, sent in c.interactions_sent.items()
                if e in c.interactions_queued
            ],
        )
        sent = sum(len(c.interactions_sent) for c in clients)
        ctx.add(f"{prefix}.unresolved", [sent - len(latencies)])
        ctx.add(f"{prefix}.errors", [failures + sum(len(c.control_errors) for c in clients)])
        if not math.isnan(window[1]):
            rates = [chunk_rate(c, window[0], window[1]) for c in clients]
            if all(r is not None for r in rates):
                ctx.add(f"{prefix}.aggregate_fps", [sum(r for r in rates if r is not None)])
        return {
            "chunk_frames": chunk_frames,
            "level": level,
            "window": window,
            "interactions": sent,
            "took_effect": len(latencies),
        }

    def evaluate(self) -> list[dict[str, Any]]:
        s = self.settings
        media_ms = TARGET_CHUNK_FRAMES / s.fps * 1000
        measured = (
            self.figures.stat(f"effect.c{TARGET_CHUNK_FRAMES}.n1.latency_ms", "median")
            if TARGET_CHUNK_FRAMES in s.effect_chunk_frames and 1 in s.effect_levels
            else None
        )
        return [
            make_verdict(
                f"effect: camera -> first frame under it, p50, one session, "
                f"{TARGET_CHUNK_FRAMES}-frame chunks",
                measured,
                media_ms + TARGET_SLACK_MS,
                f"p50 <= one chunk's media duration ({media_ms:.0f} ms at {s.fps} fps) "
                f"+ {TARGET_SLACK_MS:.0f} ms",
            ),
            cleanup_verdict("effect", self.checks),
        ]

    def markdown(self) -> list[str]:
        s = self.settings
        header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
        return [
            f"Effect: the shapes engine; {s.effect_width}x{s.effect_height} at {s.fps} fps, "
            f"unpaced; chunk_frames {','.join(map(str, s.effect_chunk_frames))}; "
            f"{','.join(map(str, s.effect_levels))} session(s); {s.effect_interactions} "
            f"camera interactions per session (transition_chunks 0), each after a random "
            f"pause of up to {s.effect_gap_s:g} s",
            "",
            f"Server: `{self.target.shown}`",
            "",
            markdown_table(header, figure_rows(self.figures)),
        ]

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "server": self.target.to_json(),
            **self.figures.to_json(),
            "checks": self.checks,
            "runs": self.runs,
            "targets": verdicts,
        }
