"""The scenarios, one module each, and ``run_target``, which runs the server scenarios on
one target: it starts the server (for a command target), measures, and always stops it.

``encoder`` (no server), ``diffusers`` (a server of its own), ``batching`` and ``effect``
(shapes servers of their own) are driven by ``run.py``.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from bench._context import RunContext
from bench._output import now, progress
from bench._server import Endpoint, ServerProcess, fetch_stats, os_threads
from bench._settings import Settings, Target
from bench._stats import Figures
from bench.scenarios.abort import scenario_abort
from bench.scenarios.concurrency import scenario_concurrency
from bench.scenarios.latency import scenario_latency
from bench.scenarios.resources import scenario_resources, wait_threads

SCENARIO_FUNCTIONS: Final[dict[str, Callable[[RunContext], Awaitable[None]]]] = {
    "latency": scenario_latency,
    "concurrency": scenario_concurrency,
    "abort": scenario_abort,
    "resources": scenario_resources,
}


async def run_target(
    target: Target,
    s: Settings,
    figures: Figures,
    checks: list[dict[str, Any]],
    run: int,
    log_dir: Path,
) -> dict[str, Any]:
    """Start the server (for a command target), run the scenarios, stop the server."""
    server: ServerProcess | None = None
    info: dict[str, Any] = {"run": run, "target": target.label}
    tag = f"run {run + 1}/{s.repeat} {target.label}"
    try:
        if target.command is not None:
            server = ServerProcess(target.command, log_dir / f"server-{target.label}-{run}.log")
            url = await server.start(timeout=120)
            info["server_pid"] = server.pid
            progress(f"{tag}: server pid {server.pid} at {url}")
        else:
            assert target.url is not None
            url = target.url
            progress(f"{tag}: {url}")
        ctx = RunContext(
            target=target,
            endpoint=Endpoint.parse(url),
            settings=s,
            figures=figures,
            run=run,
            pid=server.pid if server else None,
            rng=random.Random(s.seed * 1000 + run),
            checks=checks,
        )
        before = now()
        metrics = await fetch_stats(ctx.endpoint)
        after = now()
        ctx.has_metrics = metrics is not None
        # Monotonic clocks compare only on one host; the server's reading must fall
        # between two of ours.
        server_clock = (metrics or {}).get("monotonic")
        ctx.clock_comparable = isinstance(server_clock, int | float) and (
            before <= server_clock <= after
        )
        if metrics is not None:
            metrics, _ = await ctx.settle()
        info["has_metrics"] = ctx.has_metrics
        info["clock_comparable"] = ctx.clock_comparable
        info["baseline"] = {
            "threads_alive": (metrics or {}).get("threads_alive"),
            "rss_bytes": (metrics or {}).get("rss_bytes"),
            "os_threads": os_threads(ctx.pid),
        }
        for name in s.scenarios:
            if name in SCENARIO_FUNCTIONS:
                progress(f"{tag}: {name}")
                await SCENARIO_FUNCTIONS[name](ctx)
                await ctx.check_after(name)
        info["windows"] = ctx.windows
        info["threads"] = await wait_threads(ctx, info["baseline"])
        if info["threads"]["returned_s"] is not None:
            ctx.add("resources.threads_return_s", [info["threads"]["returned_s"]])
    finally:
        if server is not None:
            info["server_exit"] = await server.stop()
            if info["server_exit"] != 0:
                progress(f"server exited with {info['server_exit']}:\n{server.log_tail(10)}")
    return info
