"""``concurrency``: N sessions at once: aggregate and per-session delivered fps, fairness,
and ``session.ping`` round trips sampled while the sessions stream (the control plane must
stay responsive under load)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import attrs
import trio

from bench._client import SessionClient, lag_monitor, report_failures, run_clients
from bench._context import RunContext
from bench._output import now, progress
from bench._server import cpu_seconds


def session_fps(client: SessionClient, start: float, end: float) -> float:
    """Frames per second one session received in the window ``[start, end]``.

    Chunks come whole (16 frames, maybe a second apart under load), so counting the frames
    that land in a short window is off by up to a chunk. With two or more chunks in the
    window, the rate from the first of them to the last has no such error.
    """
    inside = [(t, f) for t, f, _ in client.arrivals if start <= t <= end]
    if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
        return sum(f for _, f in inside[1:]) / (inside[-1][0] - inside[0][0])
    return sum(f for _, f in inside) / (end - start)


@attrs.define
class Window:
    """What one concurrency level saw while all its sessions streamed."""

    start: float = math.nan
    end: float = math.nan
    client_lag_ms: list[float] = attrs.field(factory=list)
    server_cpu: float | None = None
    client_cpu: float | None = None


async def _stream_and_ping(
    ctx: RunContext, clients: Sequence[SessionClient], window: Window
) -> None:
    s = ctx.settings
    with trio.move_on_after(s.session_timeout_s):
        for client in clients:
            await client.first_chunk.wait()
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        window.start = now()
        server0, client0 = cpu_seconds(ctx.pid), cpu_seconds("self")
        for client in clients:
            nursery.start_soon(client.ping_every, s.ping_interval_s, done)
        nursery.start_soon(lag_monitor, window.client_lag_ms, done)
        await trio.sleep(s.window_s)
        # A window too short for every session to get a chunk (the quick form's, on a
        # busy machine) would call a session starved that was only waiting its turn:
        # it lasts until each has had one, unless one gets none within the session
        # timeout, which is starvation (fairness 0).
        with trio.move_on_after(s.session_timeout_s):
            for client in clients:
                await client.wait_chunk_since(window.start)
        window.end = now()
        server1, client1 = cpu_seconds(ctx.pid), cpu_seconds("self")
        done.set()
    span = window.end - window.start
    if server0 is not None and server1 is not None:
        window.server_cpu = (server1 - server0) / span
    if client0 is not None and client1 is not None:
        window.client_cpu = (client1 - client0) / span
    for client in clients:
        await client.stop()


async def scenario_concurrency(ctx: RunContext) -> None:
    s = ctx.settings
    for level in s.levels:
        progress(f"  concurrency N={level}")
        clients = [ctx.client() for _ in range(level)]
        window = Window()
        body = functools.partial(_stream_and_ping, ctx, clients, window)
        await run_clients(clients, body, s.session_timeout_s)
        failures = report_failures(clients, f"concurrency N={level}")
        await ctx.settle()
        start, end = window.start, window.end
        if math.isnan(end):
            continue
        ctx.windows.append({"scenario": "concurrency", "level": level, "start": start, "end": end})
        prefix = f"concurrency.n{level}"
        frames = sum(f for c in clients for t, f, _ in c.arrivals if start <= t <= end)
        ctx.add(f"{prefix}.aggregate_fps", [frames / (end - start)])
        fps = [session_fps(client, start, end) for client in clients]
        ctx.add(f"{prefix}.session_fps", fps)
        if max(fps) > 0:
            ctx.add(f"{prefix}.fairness", [min(fps) / max(fps)])
        rtts = [rtt * 1000 for c in clients for sent, rtt in c.pings if start <= sent <= end]
        ctx.add(f"{prefix}.ping_rtt_ms", rtts)
        ctx.add(f"{prefix}.pings_unanswered", [sum(c.pings_sent - len(c.pings) for c in clients)])
        ctx.add(f"{prefix}.errors", [failures])
        ctx.add(f"{prefix}.client_lag_ms", window.client_lag_ms)
        if window.server_cpu is not None:
            ctx.add(f"{prefix}.server_cpu_cores", [window.server_cpu])
        if window.client_cpu is not None:
            ctx.add(f"{prefix}.client_cpu_cores", [window.client_cpu])
