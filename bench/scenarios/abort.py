"""``abort``: ``session.stop`` -> ``session.done``, and a client that vanishes -> its
engine stream closed on the server (from ``GET /stats``), alone and with other sessions
streaming: how fast a server gives back what a session held."""

from __future__ import annotations

import trio

from bench._client import (
    SessionClient,
    report_failures,
    run_clients,
    run_one,
    seconds_between,
    wait_for,
)
from bench._context import RunContext
from bench._output import progress


async def _background(ctx: RunContext, count: int, ready: trio.Event, done: trio.Event) -> None:
    """``count`` sessions streaming until ``done``; a session that completes is replaced."""
    timeout = ctx.settings.session_timeout_s
    streaming = 0

    async def worker() -> None:
        nonlocal streaming
        counted = False
        while not done.is_set():
            client = ctx.client()

            async def body(client: SessionClient = client) -> None:
                nonlocal streaming, counted
                await wait_for(client.first_chunk, timeout)
                if not counted:
                    counted = True
                    streaming += 1
                    if streaming == count:
                        ready.set()
                async with trio.open_nursery() as race:
                    for event in (done, client.finished):
                        race.start_soon(_cancel_when, event, race.cancel_scope)
                if client.terminal is None:
                    await client.stop()

            await run_clients([client], body, timeout)
            report_failures([client], "abort: background session")

    if count == 0:
        ready.set()
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(worker)


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def scenario_abort(ctx: RunContext) -> None:
    s = ctx.settings
    for phase, load in (("idle", 0), ("load", s.abort_load)):
        progress(f"  abort, {phase}: {load} other sessions streaming")
        ready, done = trio.Event(), trio.Event()
        stops: list[SessionClient] = []
        cuts: list[SessionClient] = []
        modes = ["stop"] * s.abort_samples + ["disconnect"] * s.disconnect_samples
        ctx.rng.shuffle(modes)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_background, ctx, load, ready, done)
            await wait_for(ready, s.session_timeout_s)
            for mode in modes:
                client = ctx.client()

                async def act(client: SessionClient = client, mode: str = mode) -> None:
                    # A random point of the engine's cycle: mid-step, mid-encode, mid-send.
                    await trio.sleep(ctx.rng.uniform(0.0, s.abort_jitter_s))
                    await (client.stop() if mode == "stop" else client.disconnect())

                await run_one(client, s.session_timeout_s, act)
                report_failures([client], f"abort, {phase}: {mode}")
                (stops if mode == "stop" else cuts).append(client)
            done.set()
        stopped = [c for c in stops if c.terminal == "session.done" and c.stopped]
        ctx.add(
            f"abort.{phase}.stop_done_ms",
            [seconds_between(c.t_stop_sent, c.t_terminal) * 1000 for c in stopped],
        )
        ctx.add(f"abort.{phase}.stop_not_done", [len(stops) - len(stopped)])
        await ctx.settle()
        if not ctx.clock_comparable:
            reason = "needs /stats with a time.monotonic() comparable to the harness's"
            ctx.figures.mark_unavailable(f"abort.{phase}.disconnect_closed_ms", reason)
            continue
        metrics = await ctx.metrics()
        recent = {r.get("request_id"): r for r in (metrics or {}).get("recent_sessions", [])}
        closed, ended = [], []
        for client in cuts:
            record = recent.get(client.request_id)
            if record is None or client.t_disconnect is None:
                continue
            if record.get("stream_closed_at") is not None:
                closed.append((record["stream_closed_at"] - client.t_disconnect) * 1000)
            if record.get("ended_at") is not None:
                ended.append((record["ended_at"] - client.t_disconnect) * 1000)
        ctx.add(f"abort.{phase}.disconnect_closed_ms", closed)
        ctx.add(f"abort.{phase}.disconnect_ended_ms", ended)
