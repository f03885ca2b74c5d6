"""One run against one target: what every server scenario gets (``RunContext``), and the
checks made after each scenario, that nothing was left behind on the server."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import attrs
import trio

from bench._client import SessionClient
from bench._output import now, progress
from bench._server import Endpoint, fetch_stats, os_threads
from bench._settings import PROMPT, Settings, Target
from bench._stats import Figures
from trio_vstream import protocol


@attrs.define
class RunContext:
    """Everything a server scenario needs for one run: where the server is, what to
    measure, where the figures go; and what the first ``/stats`` told about the server."""

    target: Target
    endpoint: Endpoint
    settings: Settings
    figures: Figures
    run: int
    pid: int | None
    rng: random.Random
    checks: list[dict[str, Any]]
    has_metrics: bool = False
    clock_comparable: bool = False
    windows: list[dict[str, Any]] = attrs.field(factory=list)
    """Measurement windows (monotonic), to line results up with server-side logs."""

    def start_json(self, num_frames: int) -> str:
        s = self.settings
        return protocol.start_message(PROMPT, size=s.size, fps=s.fps, num_frames=num_frames)

    def client(self, num_frames: int | None = None) -> SessionClient:
        frames = self.settings.stream_frames if num_frames is None else num_frames
        return SessionClient(self.endpoint, self.start_json(frames))

    def add(self, name: str, values: Iterable[float]) -> None:
        self.figures.add(self.run, name, values)

    async def metrics(self) -> dict[str, Any] | None:
        return await fetch_stats(self.endpoint) if self.has_metrics else None

    async def settle(self, timeout: float = 10.0) -> tuple[dict[str, Any] | None, float]:
        """Wait until the server has no session left (known only where it has /stats)."""
        started = now()
        if not self.has_metrics:
            await trio.sleep(0.2)
            return None, now() - started
        metrics = None
        with trio.move_on_after(timeout):
            while True:
                metrics = await fetch_stats(self.endpoint)
                if metrics is not None and metrics.get("sessions_active") == 0:
                    break
                await trio.sleep(0.02)
        return metrics, now() - started

    async def check_after(self, scenario: str) -> None:
        """After every scenario: no session, no engine stream, no running worker thread."""
        metrics, waited = await self.settle()
        check: dict[str, Any] = {"run": self.run, "scenario": scenario, "settle_s": waited}
        for key in ("sessions_active", "streams_open", "worker_threads", "threads_alive"):
            check[key] = metrics.get(key) if metrics else None
        check["rss_bytes"] = metrics.get("rss_bytes") if metrics else None
        check["os_threads"] = os_threads(self.pid)
        check["ok"] = None
        if metrics is not None:
            keys = ("sessions_active", "streams_open", "worker_threads")
            check["ok"] = all(check[key] == 0 for key in keys)
        self.checks.append(check)
        if check["ok"] is False:
            progress(f"  !! left over after {scenario}: {check}")
