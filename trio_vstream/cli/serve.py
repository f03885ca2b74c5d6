"""``serve`` as a process: its logging, the engine, the server until a signal, its exit.

`run_serve` loads the engine and the recorder, runs the server in ``trio.run`` until a
first SIGINT or SIGTERM drains it (a second stops it at once), then writes the last
recordings and closes the engine, each within a deadline, and returns the exit status.
A stop arms `trio_vstream.server.last_resort`, which ends the process if what follows
never finishes (a wedged device). The server and the engines are imported inside these
functions: only ``serve`` loads them (see ``trio_vstream.cli``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import shutil
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import trio

from trio_vstream import logsafe, protocol
from trio_vstream.cli.serve_config import (
    access_policy,
    exit_when_wedged,
    image_url_config,
    tls_context,
)
from trio_vstream.server import access, memory
from trio_vstream.server.last_resort import FAILURE_STATUS as LAST_RESORT_STATUS
from trio_vstream.server.last_resort import MARGIN_SECONDS as LAST_RESORT_MARGIN
from trio_vstream.server.last_resort import SECOND_SIGNAL_SECONDS, LastResort

if TYPE_CHECKING:
    from trio_vstream.engines.contract import Engine
    from trio_vstream.outputs.recording import Recorder
    from trio_vstream.server.app import ServerConfig

__all__ = [
    "RECORDING_CLOSE_TIMEOUT",
    "RECORD_FREE_SPACE_SHARE",
    "run_serve",
    "signals_noted_while_exiting",
]

RECORDING_CLOSE_TIMEOUT = 120.0
"""Seconds the server waits at exit for ``--record``'s last recordings to be written
(less when a signal's hard deadline comes sooner: `trio_vstream.server.last_resort`)."""
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The first drains the server, a second stops it at once (`_serve_until_signalled`)."""
RECORD_FREE_SPACE_SHARE = 0.9
"""Without ``--record-max-bytes``, recordings may add this share of the free space (at
start) to what DIR already holds: they stop before the disk is full, which would fail
the rest of the machine, and a full disk would drop whole recordings anyway."""

logger = logsafe.get_logger("trio_vstream")


def run_serve(args: argparse.Namespace) -> int:
    # Not at the top: only serve loads the server and the engines (see trio_vstream.cli).
    from trio_vstream.engines import EngineConfigError, load_engine
    from trio_vstream.outputs.hls import HlsSettings
    from trio_vstream.outputs.watch import WatchConfig
    from trio_vstream.server.app import ServerConfig
    from trio_vstream.server.fleet import FleetConfig
    from trio_vstream.session.session import SessionConfig

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logsafe.escape_on_handlers(logging.getLogger().handlers)  # libraries' records too
    try:
        policy = access_policy(args)
        context = tls_context(args)
        image_urls = image_url_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    memory.tune_allocator()  # before the engine starts any threads
    try:
        engine = load_engine(args.engine, dict(args.engine_args), device=args.device)
    except EngineConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    limits = protocol.Limits(
        max_width=args.max_width,
        max_height=args.max_height,
        max_num_frames=args.max_num_frames,
        max_total_pixels=args.max_total_pixels,
        max_start_bytes=args.max_start_bytes,
        max_control_bytes=args.max_control_bytes,
    )
    config = ServerConfig(
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        max_connections=args.max_connections,
        max_connections_per_ip=args.max_connections_per_ip,
        head_timeout=args.head_timeout,
        encode_concurrency=args.encode_concurrency,
        shutdown_grace=args.shutdown_grace,
        max_stuck_calls=args.max_stuck_calls,
        exit_when_wedged=exit_when_wedged(args.exit_when_wedged),
        access=policy,
        ssl_context=context,
        watch=WatchConfig(
            max_viewers=args.max_viewers,
            requires_key=args.watch_requires_key,
            hls=HlsSettings(segment_seconds=args.hls_segment_seconds, linger=args.hls_linger)
            if args.hls
            else None,
            hls_part_seconds=args.hls_part_seconds,
        ),
        fleet=FleetConfig(
            node_name=args.node_name, peers=dict(args.peers), peer_domain=args.peer_domain
        ),
        session=SessionConfig(
            start_timeout=args.start_timeout,
            stall_timeout=args.stall_timeout,
            close_timeout=args.close_timeout,
            limits=limits,
            served_model=args.model or engine.name,
            image_urls=image_urls,
        ),
    )
    try:
        recorder = _recorder(args, engine, config)
    except OSError as exc:
        print(f"error: --record {args.record}: {exc.strerror or exc}", file=sys.stderr)
        engine.close()
        return 2
    # Everything loaded so far lives as long as the process: keep the garbage
    # collector from walking it again and again (a full pass stalls the event loop).
    gc.collect()
    gc.freeze()
    if config.exit_when_wedged:
        logger.info(
            "a wedged engine drains the server, which then exits with status 69 for a restart%s",
            "" if args.exit_when_wedged else " (on under systemd or Kubernetes)",
        )
    last_resort = LastResort()
    try:
        status = trio.run(_serve_until_signalled, engine, config, recorder, last_resort)
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    finally:
        with signals_noted_while_exiting():
            # The last sessions' recordings, remuxed and written; a disk stuck for longer
            # than this would otherwise keep the process from ever exiting, and after a
            # signal, the hard deadline comes first (a second left for the engine).
            timeout = last_resort.allow(RECORDING_CLOSE_TIMEOUT)
            if recorder is not None and not recorder.close(timeout=timeout):
                logger.warning(
                    "recordings still being written after %g s: left unfinished", timeout
                )
            # May block on a wedged device: the last resort, armed by the stop, ends it.
            engine.close()
    # Armed by a signal or a wedge, it stays armed through the interpreter's exit (which
    # joins the engine's non-daemon threads); an in-process caller gets it disarmed.
    if not getattr(args, "whole_process", False):
        last_resort.disarm()
    return status


@contextlib.contextmanager
def signals_noted_while_exiting() -> Iterator[None]:
    """While the server, already stopped, finishes its recordings and frees the engine,
    a SIGINT or SIGTERM is logged and changes nothing.

    Trio puts back the default handlers when its run ends, so without this a signal in
    that window (an operator's second Ctrl-C, a supervisor's SIGTERM after the drain)
    would end the process with -15, or raise KeyboardInterrupt in the middle of freeing
    the engine, instead of the documented status 0. Both steps are bounded already
    (`RECORDING_CLOSE_TIMEOUT`, the engine's own close).
    """

    def note(signum: int, frame: object) -> None:
        logger.warning("%s: already stopping", signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, note) for signum in _STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _recorder(args: argparse.Namespace, engine: Engine, config: ServerConfig) -> Recorder | None:
    """The ``--record`` recorder (None without it); raises ``OSError`` when the directory
    cannot be made."""
    # Not at the top: only serve loads the engines and the recorder (see trio_vstream.cli).
    from trio_vstream.engines.interfaces import supports_device
    from trio_vstream.outputs.recording import Recorder

    if args.record is None:
        return None
    device = engine.device if supports_device(engine) else None
    recorder = Recorder(
        args.record,
        engine=engine.name,
        model=config.session.served_model or engine.name,
        device=None if device is None else str(device),
        max_bytes=args.record_max_bytes,
        node=args.node_name,
    )
    if recorder.max_bytes is None:
        free = shutil.disk_usage(recorder.directory).free
        recorder.max_bytes = recorder.used + int(free * RECORD_FREE_SPACE_SHARE)
    logger.info(
        "recording every session in %s: recordings may take %d bytes (%s), %d taken now",
        recorder.directory,
        recorder.max_bytes,
        "--record-max-bytes" if args.record_max_bytes is not None else "90% of the free space",
        recorder.used,
    )
    if recorder.used >= recorder.max_bytes:
        logger.warning(
            "%s holds as much as the recordings may take: sessions are not recorded",
            recorder.directory,
        )
    return recorder


def _log_hosts(config: ServerConfig) -> None:
    """Say which Host names are served; on a non-loopback bind without --allowed-hosts, say
    that clients reaching the server by a DNS name (through a proxy, say) need it."""
    hosts = config.access.allowed_hosts
    if hosts:
        logger.info("Host names served besides local ones: %s", ", ".join(hosts))
    elif not access.is_loopback(config.host):
        logger.warning(
            "serving %s: requests must name this server by an IP address or localhost; "
            "a client or proxy that uses a DNS name gets HTTP 421 until the name is given "
            "with --allowed-hosts NAME",
            config.host or "every address",
        )


async def _serve_until_signalled(
    engine: Engine,
    config: ServerConfig,
    recorder: Recorder | None = None,
    last_resort: LastResort | None = None,
) -> int:
    """Serve; the first SIGINT/SIGTERM shuts down gracefully, a second one at once.
    Returns the exit status (`VideoServer.exit_status`).

    Once a shutdown begins (a signal, or a wedged engine with ``--exit-when-wedged``),
    ``last_resort`` ends the process if it has not exited by the drain's bound plus a
    margin; after a second signal, within a few seconds.
    """
    # Not at the top: only serve loads the server (see trio_vstream.cli).
    from trio_vstream.server.app import VideoServer

    server = VideoServer(engine, config, taps=recorder)
    if last_resort is None:
        last_resort = LastResort()
    last_resort.stuck = server.abandoned_calls.names
    with trio.open_signal_receiver(*_STOP_SIGNALS) as signals:
        async with trio.open_nursery() as nursery:

            async def serve(task_status: trio.TaskStatus[VideoServer]) -> None:
                await server.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # graceful shutdown done: stop watching signals

            async def arm_when_stopping() -> None:
                await server.wait_shutdown_requested()
                last_resort.arm(
                    server.drain_bound + LAST_RESORT_MARGIN,
                    status=server.exit_status or LAST_RESORT_STATUS,
                    why="draining",
                )

            await nursery.start(serve)
            nursery.start_soon(arm_when_stopping)
            print(f"trio_vstream serving {server.url} (engine: {engine.name})", flush=True)
            if config.access.needs_key:
                logger.info("API keys required: %d configured", len(config.access.api_keys))
            if config.access.admin_keys:
                logger.info(
                    "admin keys for /stats and /metrics: %d configured",
                    len(config.access.admin_keys),
                )
            _log_hosts(config)
            if config.session.image_urls.enabled:
                logger.info(
                    "image_reference URLs fetched from: %s",
                    ", ".join(sorted(config.session.image_urls.allowed_hosts)),
                )
            async for signum in signals:
                if server.shutting_down:
                    logger.warning("%s again: stopping now", signal.Signals(signum).name)
                    last_resort.arm(
                        SECOND_SIGNAL_SECONDS,
                        status=server.exit_status or LAST_RESORT_STATUS,
                        why="stopping now",
                    )
                    nursery.cancel_scope.cancel()
                else:
                    logger.info("%s: shutting down gracefully", signal.Signals(signum).name)
                    server.shutdown()
    # Engine calls still run in their threads: those the stop left mid-step (a second
    # signal does not wait for them), and those sessions abandoned just before it, which
    # may be on their way back (a hung batch abandoned, its rows failed). The engine is
    # not closed, nor the interpreter torn down, under a running step, which kills the
    # process (a thread that wakes in libtorch during the interpreter's exit: "terminate
    # called without an active exception", SIGABRT). A healthy step returns well within
    # this; a hung one is waited for no longer, and the last resort ends the process.
    with trio.move_on_after(last_resort.allow(config.session.close_timeout)):
        await server.abandoned_calls.wait_returned()
    return server.exit_status
