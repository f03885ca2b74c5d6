"""What the scenarios that start servers of their own (``batching``, ``effect``) share:
the shapes server's command, a started server that is always stopped, the sessions'
request, and rates measured from whole chunks.

They start their own servers because what they compare is a server setting (batching on
or off) or needs an engine that takes camera interactions, neither of which the
harness's main target (the synthetic engine, or ``--url``) can be asked for.
"""

from __future__ import annotations

import contextlib
import random
import shlex
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from bench._client import SessionClient
from bench._context import RunContext
from bench._output import progress
from bench._server import Endpoint, ServerProcess, fetch_stats
from bench._settings import Settings, Target, make_target
from bench._stats import Figures
from trio_vstream import protocol

SHAPES_PROMPT = "a red circle moving right on a black background"
"""A prompt the shapes model knows every word of (no 'unknown word' log lines)."""
SERVER_START_TIMEOUT = 120.0
"""The shapes engine loads its weights and warms up before it prints its URL."""
SERVER_FRAME_LIMIT = 2400
"""The server's default ``--max-num-frames``: longer requests need the flag."""


def shapes_target(
    label: str,
    engine_args: Sequence[tuple[str, str]],
    server_args: Sequence[str],
    *,
    max_sessions: int,
    num_frames: int,
) -> Target:
    """A ``--engine shapes`` server with these engine arguments, started by the harness."""
    tokens = ["--engine", "shapes"]
    for key, value in engine_args:
        tokens += ["--engine-arg", f"{key}={value}"]
    if num_frames > SERVER_FRAME_LIMIT:
        tokens += ["--max-num-frames", str(num_frames)]
    spec = shlex.join([*tokens, *server_args])
    return make_target(label, spec, max_sessions_needed=max_sessions)


@attrs.define
class Served:
    """A server this scenario started: the process, where it listens, how it ended."""

    process: ServerProcess
    endpoint: Endpoint
    exit_status: int | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid


@contextlib.asynccontextmanager
async def serving(
    targets: Mapping[str, Target], log_dir: Path, stem: str, tag: str
) -> AsyncIterator[dict[str, Served]]:
    """Started servers for the body, by name, all stopped (SIGTERM, then SIGKILL) however
    it ends. They start together: starting is not measured, and each loads its model."""
    processes: dict[str, ServerProcess] = {}
    for name, target in targets.items():
        assert target.command is not None
        processes[name] = ServerProcess(target.command, log_dir / f"{stem}-{name}.log")
    served: dict[str, Served] = {}

    async def start(name: str, process: ServerProcess) -> None:
        url = await process.start(timeout=SERVER_START_TIMEOUT)
        progress(f"{tag} {name}: server pid {process.pid} at {url}")
        served[name] = Served(process, Endpoint.parse(url))

    try:
        async with trio.open_nursery() as nursery:
            for name, process in processes.items():
                nursery.start_soon(start, name, process)
        yield served
    finally:
        for name, process in processes.items():
            status = await process.stop()
            if name in served:
                served[name].exit_status = status
            if status != 0:
                progress(f"{tag} {name}: server exited with {status}:\n{process.log_tail(10)}")


async def started_context(
    served: Served,
    target: Target,
    s: Settings,
    figures: Figures,
    run: int,
    checks: list[dict[str, Any]],
) -> RunContext:
    """A `RunContext` for a server this scenario started (for its settle and checks)."""
    ctx = RunContext(
        target=target,
        endpoint=served.endpoint,
        settings=s,
        figures=figures,
        run=run,
        pid=served.pid,
        rng=random.Random(s.seed * 1000 + run),
        checks=checks,
    )
    ctx.has_metrics = await fetch_stats(ctx.endpoint) is not None
    return ctx


def start_json(width: int, height: int, fps: int, num_frames: int, **extra: Any) -> str:
    """The sessions' ``session.start``: seeded, so every run asks for the same video."""
    params = {"extra_params": extra} if extra else {}
    return protocol.start_message(
        SHAPES_PROMPT, size=f"{width}x{height}", fps=fps, num_frames=num_frames, seed=7, **params
    )


def chunk_rate(client: SessionClient, start: float, end: float) -> float | None:
    """Frames per second from the first to the last chunk that arrived in ``[start, end]``.

    Sessions that share an engine get their chunks in bursts, one per round of the engine
    (every session's rows finish together), so counting the frames that land in a fixed
    window is off by up to a burst; between two arrivals it is exact. None with fewer
    than two chunks in the window.
    """
    inside = [(t, frames) for t, frames, _ in client.arrivals if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return sum(frames for _, frames in inside[1:]) / (inside[-1][0] - inside[0][0])


async def wait_all(events: Sequence[trio.Event], timeout: float) -> bool:
    """True when every event was set within ``timeout`` seconds (all together)."""
    with trio.move_on_after(timeout):
        for event in events:
            await event.wait()
        return True
    return False


def stop_done_ms(clients: Sequence[SessionClient]) -> list[float]:
    """``session.stop`` sent -> ``session.done`` received, for the sessions it stopped."""
    return [
        (c.t_terminal - c.t_stop_sent) * 1000
        for c in clients
        if c.t_stop_sent is not None
        and c.t_terminal is not None
        and c.terminal == "session.done"
        and c.stopped
    ]
