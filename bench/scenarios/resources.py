"""``resources``: server RSS per idle connection and per streaming session; and, after
every run, whether threads and memory return to their baseline (``wait_threads``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import trio

from bench._client import SessionClient, report_failures, run_clients, wait_for
from bench._context import RunContext
from bench._output import now, progress
from bench._server import os_threads
from bench._stats import percentile


async def _sample_metrics(ctx: RunContext, count: int, interval: float) -> list[dict[str, Any]]:
    samples = []
    for _ in range(count):
        metrics = await ctx.metrics()
        if metrics and metrics.get("rss_bytes"):
            samples.append(metrics)
        await trio.sleep(interval)
    return samples


def _median_rss(samples: Sequence[dict[str, Any]]) -> float:
    return percentile([float(m["rss_bytes"]) for m in samples], 50)


async def scenario_resources(ctx: RunContext) -> None:
    s = ctx.settings
    if not ctx.has_metrics:
        for name in ("resources.rss_idle_connection_kib", "resources.rss_streaming_session_mib"):
            ctx.figures.mark_unavailable(name, "the server has no /stats")
        return
    base = await _sample_metrics(ctx, 3, 0.05)
    idle = [SessionClient(ctx.endpoint, None) for _ in range(s.idle_connections)]
    with_idle: list[dict[str, Any]] = []

    held: list[SessionClient] = []

    async def hold_idle() -> None:
        for client in idle:
            await wait_for(client.connected, s.session_timeout_s)
        await trio.sleep(0.3)
        # A server with fewer session slots refuses the rest (server_busy): count only
        # the connections it holds.
        held.extend(c for c in idle if c.terminal is None and not c.finished.is_set())
        with_idle.extend(await _sample_metrics(ctx, 3, 0.1))
        for client in idle:
            await client.close()

    await run_clients(idle, hold_idle, s.session_timeout_s)
    report_failures(held, "resources: idle connection")
    if len(held) < len(idle):
        progress(f"  the server held {len(held)} of {len(idle)} idle connections")
    if base and with_idle and held:
        grown = _median_rss(with_idle) - _median_rss(base)
        ctx.add("resources.rss_idle_connection_kib", [grown / len(held) / 1024])
    await ctx.settle()
    base = await _sample_metrics(ctx, 3, 0.05)
    streams = [ctx.client() for _ in range(s.resource_sessions)]
    streaming: list[dict[str, Any]] = []

    async def hold_streams() -> None:
        for client in streams:
            await wait_for(client.first_chunk, s.session_timeout_s)
        streaming.extend(await _sample_metrics(ctx, 5, 0.05 if s.quick else 0.2))
        for client in streams:
            await client.stop()

    await run_clients(streams, hold_streams, s.session_timeout_s)
    report_failures(streams, "resources: streaming session")
    if base and streaming:
        grown = _median_rss(streaming) - _median_rss(base)
        ctx.add("resources.rss_streaming_session_mib", [grown / len(streams) / 2**20])
        ctx.add("resources.threads_alive_streaming", [m["threads_alive"] for m in streaming])


async def wait_threads(ctx: RunContext, baseline: dict[str, Any]) -> dict[str, Any]:
    """Threads back to the run's baseline? Trio keeps an idle worker thread for 10 s
    before it exits, so this waits, bounded by ``thread_wait_s``."""
    result: dict[str, Any] = {
        "baseline": baseline.get("threads_alive"),
        "baseline_os": baseline.get("os_threads"),
        "immediately_after": None,
        "after": None,
        "after_os": None,
        "returned_s": None,
        "waited_s": 0.0,
    }
    if not ctx.has_metrics or baseline.get("threads_alive") is None:
        ctx.figures.mark_unavailable("resources.threads_return_s", "the server has no /stats")
        return result
    started = now()
    metrics, _ = await ctx.settle()
    result["immediately_after"] = (metrics or {}).get("threads_alive")
    progress(f"  waiting up to {ctx.settings.thread_wait_s:.0f} s for threads to be back")
    with trio.move_on_after(ctx.settings.thread_wait_s):
        while True:
            metrics = await ctx.metrics()
            if metrics and metrics.get("threads_alive", math.inf) <= baseline["threads_alive"]:
                result["returned_s"] = now() - started
                break
            await trio.sleep(0.25)
    result["waited_s"] = now() - started
    result["after"] = (metrics or {}).get("threads_alive")
    result["after_os"] = os_threads(ctx.pid)
    if metrics and metrics.get("rss_bytes") and baseline.get("rss_bytes"):
        retained = (metrics["rss_bytes"] - baseline["rss_bytes"]) / 2**20
        ctx.add("resources.rss_retained_mib", [retained])
    return result
