#!/usr/bin/env python3
"""Benchmark harness for trio_vstream, or any server of the realtime video protocol.

``python bench/run.py --scenario all`` starts a server itself (``python -m trio_vstream
--port 0 ...``), or targets ``--url``, and measures over real sockets:

* ``latency``: one session at a time: connect, ``video.start``, time to first chunk (TTFC),
  chunk inter-arrival times, real-time factor; plus an in-process calibration of the
  engine's own time to its first chunk and of one chunk's encode, so that the server's
  transport overhead (TTFC minus the engine's time) is told apart from the model's;
* ``concurrency``: N sessions at once: aggregate and per-session delivered fps, fairness,
  and ``session.ping`` round trips sampled every 50 ms while the sessions stream;
* ``abort``: ``session.stop`` -> ``session.done``, and client disconnect -> engine stream
  closed (from ``GET /stats``), alone and with other sessions streaming;
* ``resources``: server RSS per idle connection and per streaming session, and whether
  threads and engine streams return to their baseline;
* ``encoder``: ``FragmentedMP4Encoder`` cost per frame, as a share of the chunk period;
* ``diffusers`` (where diffusers is installed): a random Wan pipeline, built in a temporary
  directory, served by ``--engine diffusers``: the server's time per segment (and TTFC,
  delivered fps) against the same pipeline calls made directly, in a process of their own.
* ``batching`` (by name, not in ``all``): the shapes engine with its sessions' steps
  batched and not, at 1 to 16 sessions, in the same run: aggregate and per-session fps,
  TTFC, stop -> done, and the on/off ratios;
* ``decode`` (by name, not in ``all``): the shapes engine with its decode deferred to the
  server's encode thread (``defer_decode``, the default) and in ``next_chunk``, in the same
  run: TTFC and aggregate fps at 1 and 4 sessions, and the deferred/eager ratios;
* ``effect`` (by name, not in ``all``): a camera interaction sent -> the first chunk
  generated under it, at 1 and 8 sessions and 8-, 4- and 2-frame chunks, against the
  delivered fps each chunk size gives.
* ``streaming`` (by name, not in ``all``): the shapes engine at 1, 4 and 8 sessions, with
  and without ``streaming_buffer_seconds``: time to first chunk, chunk inter-arrival,
  real-time factor, and a simulated real-time viewer's chunks on time, continuous play
  ratio, underruns and stall time; and whether paused sessions cost the others anything.
* ``glass`` (by name, not in ``all``): the player page in chromium with its defaults on
  the shapes model, D and A pressed in turn: key to presented frame, from the page's
  figure and from the presented frames' pixels, and the continuous play ratio.
* ``camera_in`` (by name, not in ``all``): the player page in chromium with its defaults
  and Camera in, chromium's fake camera a moving blob, on the shapes model: an input
  frame drawn -> the output frame made from it presented, and its parts.
* ``fleet`` (by name, not in ``all``; needs /usr/sbin/nginx): a wave of sessions, each
  with viewers of its watch link, through nginx (the shipped deploy/nginx.conf) in front
  of one server and in front of three: sessions completed and refused, viewers that saw
  their session's end, and a viewer's delay behind the owner, relayed or direct.
* ``hls`` (by name, not in ``all``; needs /usr/sbin/nginx): one session watched by 500
  LL-HLS viewers through nginx's cache (the shipped deploy/nginx.conf) and by none:
  requests per part that reach the server, viewers that got every part, and the
  server's CPU per frame with the crowd over without.
* ``hls_latency`` (by name, not in ``all``; needs chromium, nginx and hls.js): a paced
  session on the shapes model, its LL-HLS playlist played live by hls.js in chromium
  through nginx: each chunk's delay from the owner's receipt on the WebSocket to its first
  frame presented by hls.js.

It talks to a server only through the WebSocket protocol and ``GET /stats``, so it works
against any server of the protocol; figures that need ``/stats`` are reported as
unavailable where a server has none. Results go to stdout (a markdown table and PASS/FAIL
per target) and to ``bench/results/`` (JSON with the machine, the settings, and every
figure with min/median/p99 and its per-run values). See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shlex
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The names other code imports from ``bench.run`` (soak, fuzz, the tests) come from the
# package's modules; they stay importable here.
from bench._client import (
    CLIENT_MAX_MESSAGE,
    RECEIVE_BUFFER,
    SessionClient,
    lag_monitor,
    report_failures,
    run_clients,
    run_one,
    wait_for,
)
from bench._context import RunContext
from bench._output import START_TIME, markdown_table, now, progress, read_file
from bench._report import (
    compare_json,
    compare_rows,
    evaluate,
    figure_rows,
    machine_description,
    render,
)
from bench._server import (
    Endpoint,
    ServerProcess,
    cpu_seconds,
    fetch_stats,
    minor_faults,
    os_threads,
)
from bench._settings import (
    ALL_SCENARIOS,
    BENCH_DIR,
    DEFAULT_ENGINE,
    DEFAULT_SYNTHETIC_ARGS,
    OWN_SERVER_SCENARIOS,
    PROMPT,
    REPO_DIR,
    RESULTS_DIR,
    SCENARIOS,
    SERVER_SCENARIOS,
    Settings,
    Target,
    make_target,
)
from bench._stats import CATALOGUE, Figure, Figures, catalogue_key, percentile, summarize
from bench.scenarios import SCENARIO_FUNCTIONS, run_target
from bench.scenarios.batching import BATCHING_PRESETS, BatchingPreset, BatchingScenario
from bench.scenarios.camera_in import CameraInScenario
from bench.scenarios.concurrency import session_fps
from bench.scenarios.decode import DecodePreset, DecodeScenario
from bench.scenarios.diffusers import (
    DIFFUSERS_OVERHEAD_LIMIT_PCT,
    DIFFUSERS_PRESETS,
    DiffusersPreset,
    DiffusersScenario,
    diffusers_available,
    diffusers_worker,
)
from bench.scenarios.effect import EffectScenario
from bench.scenarios.encoder import ENCODER_SIZES, scenario_encoder
from bench.scenarios.fleet import FleetScenario
from bench.scenarios.glass import GlassScenario
from bench.scenarios.hls import HlsScenario
from bench.scenarios.hls_latency import HlsLatencyScenario
from bench.scenarios.overhead import OverheadScenario
from bench.scenarios.streaming import StreamingScenario
from trio_vstream.client import check_startup

_read = read_file
_START_TIME = START_TIME

__all__ = [
    "ALL_SCENARIOS",
    "BATCHING_PRESETS",
    "BENCH_DIR",
    "CATALOGUE",
    "CLIENT_MAX_MESSAGE",
    "DEFAULT_ENGINE",
    "DEFAULT_SYNTHETIC_ARGS",
    "DIFFUSERS_OVERHEAD_LIMIT_PCT",
    "DIFFUSERS_PRESETS",
    "ENCODER_SIZES",
    "PROMPT",
    "RECEIVE_BUFFER",
    "REPO_DIR",
    "RESULTS_DIR",
    "SCENARIOS",
    "SCENARIO_FUNCTIONS",
    "SERVER_SCENARIOS",
    "BatchingPreset",
    "BatchingScenario",
    "CameraInScenario",
    "DiffusersPreset",
    "DiffusersScenario",
    "EffectScenario",
    "Endpoint",
    "Figure",
    "Figures",
    "FleetScenario",
    "HlsLatencyScenario",
    "HlsScenario",
    "RunContext",
    "ServerProcess",
    "SessionClient",
    "Settings",
    "StreamingScenario",
    "Target",
    "_read",
    "build_parser",
    "catalogue_key",
    "compare_rows",
    "cpu_seconds",
    "diffusers_available",
    "diffusers_worker",
    "evaluate",
    "fetch_stats",
    "figure_rows",
    "lag_monitor",
    "main",
    "main_async",
    "make_target",
    "markdown_table",
    "minor_faults",
    "now",
    "os_threads",
    "percentile",
    "progress",
    "render",
    "report_failures",
    "run_clients",
    "run_one",
    "run_target",
    "session_fps",
    "settings_from",
    "summarize",
    "targets_from",
    "wait_for",
]


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels must be >= 1")
    return levels


def _size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def build_parser() -> argparse.ArgumentParser:
    defaults = " ".join(f"{k}={v}" for k, v in DEFAULT_SYNTHETIC_ARGS)
    parser = argparse.ArgumentParser(
        prog="python bench/run.py",
        description="Benchmark a realtime video server (/v1/realtime/video) over real sockets.",
        epilog="A target spec is a ws:// URL, the flags of 'python -m trio_vstream' in one "
        'quoted argument ("--engine synthetic --engine-arg step_delay=0.01"), or a whole '
        "server command. Servers the harness starts get --port 0 unless a port is given, and "
        "are always stopped, Ctrl-C included.",
    )
    add = parser.add_argument
    add(
        "--scenario",
        action="append",
        default=None,
        help=f"all (default) or any of {', '.join(SCENARIOS)}; repeatable or comma-separated "
        "(all leaves out batching, decode, effect, streaming, glass, camera_in, overhead, "
        "fleet, hls and hls_latency: name them)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help="measure a server that is already running")
    where.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="two target specs, alternated run by run; prints B/A for every metric",
    )
    add("--engine", default=None, help=f"engine of the started server (default {DEFAULT_ENGINE})")
    add(
        "--engine-arg",
        action="append",
        default=[],
        metavar="K=V",
        help=f"engine option, repeatable (synthetic without any: {defaults})",
    )
    add(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="another flag for the started server, repeatable: --server-arg=--max-sessions=32",
    )
    add(
        "--engine-step",
        type=float,
        default=None,
        metavar="SECONDS",
        help="one engine step, for the abort target (synthetic: its step_delay)",
    )
    add("--repeat", type=int, default=None, help="runs per target (default 3; --quick: 1)")
    add("--quick", action="store_true", help="smoke mode, for CI: seconds, not minutes")
    add("--size", type=_size, default=(832, 480), help="video size (default 832x480)")
    add("--fps", type=int, default=24, help="frames per second (default 24)")
    add("--levels", type=_levels, default=None, help="concurrency levels (default 1,2,4,8,16)")
    add("--window", type=float, default=None, help="seconds measured per level (default 4)")
    add(
        "--thread-wait",
        type=float,
        default=None,
        help="seconds to wait for threads to be back at baseline (default 15; --quick: 12)",
    )
    add("--abort-samples", type=int, default=None, help="stops per abort phase (default 20)")
    add("--seed", type=int, default=1, help="for the random points at which aborts happen")
    add(
        "--diffusers-preset",
        choices=DIFFUSERS_PRESETS,
        default=None,
        help="size of the diffusers scenario's random pipeline (default: tiny with --quick, "
        "else gpu where CUDA is available, else cpu)",
    )
    add(
        "--batching-preset",
        choices=BATCHING_PRESETS,
        default=None,
        help="the batching and decode scenarios' levels, batch size and device (default: "
        "quick with --quick, else gpu where CUDA is available, else cpu)",
    )
    add(
        "--streaming-startup",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the streaming scenario's viewers start once this much media is buffered "
        "(default 0: at the first frame; below its streaming_buffer_seconds, 1)",
    )
    add("--diffusers-worker", default=None, help=argparse.SUPPRESS)
    add("--output", type=Path, default=None, help="JSON path (default bench/results/<time>.json)")
    add("--strict", action="store_true", help="exit with status 1 when a target is missed")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    chosen: list[str] = []
    for item in args.scenario or ["all"]:
        for name in (n.strip() for n in item.split(",")):
            if name == "all":
                chosen.extend(ALL_SCENARIOS)
                if not (args.url or args.compare) and diffusers_available():
                    chosen.append("diffusers")
            elif name == "diffusers" and not diffusers_available():
                raise SystemExit(
                    "the diffusers scenario needs diffusers and transformers: "
                    "pip install 'trio-vstream[diffusers]'"
                )
            elif name in OWN_SERVER_SCENARIOS[1:] and (args.url or args.compare):
                raise SystemExit(
                    f"the {name} scenario starts servers of its own: "
                    "it takes neither --url nor --compare"
                )
            elif name in SCENARIOS:
                chosen.append(name)
            elif name:
                raise SystemExit(f"unknown scenario {name!r}: use all, {', '.join(SCENARIOS)}")
    overrides: dict[str, Any] = {
        "width": args.size[0],
        "height": args.size[1],
        "fps": args.fps,
        "seed": args.seed,
        "diffusers_preset": args.diffusers_preset,
        "batching_preset": args.batching_preset,
    }
    for option, field in (
        ("repeat", "repeat"),
        ("levels", "levels"),
        ("window", "window_s"),
        ("thread_wait", "thread_wait_s"),
        ("abort_samples", "abort_samples"),
        ("streaming_startup", "streaming_startup_s"),
    ):
        if getattr(args, option) is not None:
            overrides[field] = getattr(args, option)
    overrides["repeat"] = max(1, overrides.get("repeat", 1 if args.quick else 3))
    startup = overrides.get("streaming_startup_s", 0.0)
    try:
        check_startup(startup, Settings(scenarios=()).streaming_buffer_s)
    except ValueError as exc:
        raise SystemExit(f"--streaming-startup: {exc}") from None
    scenarios = tuple(name for name in SCENARIOS if name in chosen)
    if args.quick:
        return Settings.quick_settings(scenarios, **overrides)
    return Settings(scenarios=scenarios, **overrides)


def targets_from(args: argparse.Namespace, s: Settings) -> list[Target]:
    needed = max([*s.levels, s.abort_load + 1, s.idle_connections, s.resource_sessions])
    step = args.engine_step
    if args.compare:
        return [
            make_target(label, spec, max_sessions_needed=needed, declared_step=step)
            for label, spec in zip(("A", "B"), args.compare, strict=True)
        ]
    if args.url:
        return [make_target("A", args.url, max_sessions_needed=needed, declared_step=step)]
    engine = args.engine or DEFAULT_ENGINE
    engine_args = list(args.engine_arg)
    if engine == "synthetic" and not engine_args:
        engine_args = [f"{k}={v}" for k, v in DEFAULT_SYNTHETIC_ARGS]
    tokens = ["--engine", engine]
    for item in engine_args:
        tokens += ["--engine-arg", item]
    spec = shlex.join([*tokens, *args.server_arg])
    return [make_target("A", spec, max_sessions_needed=needed, declared_step=step)]


def chunk_frames_of(targets: Sequence[Target]) -> int:
    """Frames per chunk for the encoder scenario: the synthetic engine's, else 16."""
    for target in targets:
        if target.engine == "synthetic":
            return int(dict(target.engine_args).get("chunk_frames", "8"))
    return int(dict(DEFAULT_SYNTHETIC_ARGS)["chunk_frames"])


async def main_async(args: argparse.Namespace) -> int:
    s = settings_from(args)
    targets = targets_from(args, s)
    machine = await machine_description()
    progress(
        f"{machine['cpu_model']}, {machine['cpu_count']} cores, {machine['ram_gib']} GiB; "
        f"scenarios {', '.join(s.scenarios)}; {s.repeat} run(s) per target"
    )
    for target in targets:
        progress(f"target {target.label}: {target.shown}")
    load = machine["loadavg_at_start"]
    if load and float(load[0]) > 0.5:
        progress(f"warning: load average {load[0]} at start: something else is using the CPU")
    per_target = {t.label: Figures() for t in targets}
    checks: dict[str, list[dict[str, Any]]] = {t.label: [] for t in targets}
    runs: dict[str, list[dict[str, Any]]] = {t.label: [] for t in targets}
    local = Figures()
    chunk_frames = chunk_frames_of(targets)
    started = dt.datetime.now(dt.UTC)
    with tempfile.TemporaryDirectory(prefix="trio_vstream-bench-") as log_dir:
        for run in range(s.repeat):
            if "encoder" in s.scenarios:
                progress(f"run {run + 1}/{s.repeat}: encoder")
                await scenario_encoder(local, run, s, chunk_frames)
            if not any(name in s.scenarios for name in SERVER_SCENARIOS):
                continue
            # A, B in odd runs and B, A in even ones: drift (thermal, other load) evens out.
            for target in targets if run % 2 == 0 else targets[::-1]:
                info = await run_target(
                    target, s, per_target[target.label], checks[target.label], run, Path(log_dir)
                )
                runs[target.label].append(info)
        diffusers: DiffusersScenario | None = None
        if "diffusers" in s.scenarios:
            preset = (
                DiffusersPreset.named(s.diffusers_preset)
                if s.diffusers_preset
                else DiffusersPreset.default(s.quick)
            )
            diffusers = DiffusersScenario(s, preset, args.server_arg)
            try:
                await diffusers.setup(Path(log_dir))
                for run in range(s.repeat):
                    await diffusers.run(run, Path(log_dir))
            finally:
                await diffusers.close()
        batching: BatchingScenario | None = None
        if "batching" in s.scenarios:
            batching_preset = (
                BatchingPreset.named(s.batching_preset)
                if s.batching_preset
                else BatchingPreset.default(s.quick)
            )
            batching = BatchingScenario(s, batching_preset, args.server_arg)
            for run in range(s.repeat):
                await batching.run(run, Path(log_dir))
        decode: DecodeScenario | None = None
        if "decode" in s.scenarios:
            decode_preset = (
                DecodePreset.named(s.batching_preset)
                if s.batching_preset
                else DecodePreset.default(s.quick)
            )
            decode = DecodeScenario(s, decode_preset, args.server_arg)
            for run in range(s.repeat):
                await decode.run(run, Path(log_dir))
        effect: EffectScenario | None = None
        if "effect" in s.scenarios:
            effect = EffectScenario(s, args.server_arg)
            for run in range(s.repeat):
                await effect.run(run, Path(log_dir))
        streaming: StreamingScenario | None = None
        if "streaming" in s.scenarios:
            streaming = StreamingScenario(s, args.server_arg)
            for run in range(s.repeat):
                await streaming.run(run, Path(log_dir))
        glass: GlassScenario | None = None
        if "glass" in s.scenarios:
            glass = GlassScenario(s, args.server_arg)
            for run in range(s.repeat):
                await glass.run(run, Path(log_dir))
        camera_in: CameraInScenario | None = None
        if "camera_in" in s.scenarios:
            camera_in = CameraInScenario(s, args.server_arg)
            if camera_in.skipped is not None:
                progress(f"camera_in: skipped: {camera_in.skipped}")
            for run in range(s.repeat if camera_in.skipped is None else 0):
                await camera_in.run(run, Path(log_dir))
        overhead: OverheadScenario | None = None
        if "overhead" in s.scenarios:
            overhead = OverheadScenario(s, args.server_arg)
            for run in range(s.repeat):
                await overhead.run(run, Path(log_dir))
        fleet: FleetScenario | None = None
        if "fleet" in s.scenarios:
            fleet = FleetScenario(s, args.server_arg)
            if fleet.skipped is not None:
                progress(f"fleet: skipped: {fleet.skipped}")
            for run in range(s.repeat if fleet.skipped is None else 0):
                await fleet.run(run, Path(log_dir))
        hls: HlsScenario | None = None
        if "hls" in s.scenarios:
            hls = HlsScenario(s, args.server_arg)
            if hls.skipped is not None:
                progress(f"hls: skipped: {hls.skipped}")
            for run in range(s.repeat if hls.skipped is None else 0):
                await hls.run(run, Path(log_dir))
        hls_latency: HlsLatencyScenario | None = None
        if "hls_latency" in s.scenarios:
            hls_latency = HlsLatencyScenario(s, args.server_arg)
            if hls_latency.skipped is not None:
                progress(f"hls_latency: skipped: {hls_latency.skipped}")
            for run in range(s.repeat if hls_latency.skipped is None else 0):
                await hls_latency.run(run, Path(log_dir))
    verdicts = {
        t.label: evaluate(per_target[t.label], t, s, checks[t.label], runs[t.label])
        for t in targets
    }
    report: dict[str, Any] = {
        "schema": 1,
        "created": started.isoformat(timespec="seconds"),
        "duration_s": round(now() - START_TIME, 1),
        "command": shlex.join(["python", *sys.argv]),
        "loadavg_at_end": read_file("/proc/loadavg").split()[:3],
        "machine": machine,
        "settings": {
            **attrs.asdict(s),
            "chunk_frames": chunk_frames,
            "prompt": PROMPT,
            "client_max_message_size": CLIENT_MAX_MESSAGE,
        },
        "targets": {t.label: t.to_json() for t in targets},
        "local": local.to_json(),
        "results": {
            t.label: {
                **per_target[t.label].to_json(),
                "checks": checks[t.label],
                "runs": runs[t.label],
                "targets": verdicts[t.label],
            }
            for t in targets
        },
    }
    diffusers_verdicts: list[dict[str, Any]] = []
    if diffusers is not None:
        diffusers_verdicts = diffusers.evaluate()
        report["diffusers"] = diffusers.to_json(diffusers_verdicts)
    Section = (
        BatchingScenario
        | EffectScenario
        | StreamingScenario
        | GlassScenario
        | CameraInScenario
        | OverheadScenario
        | FleetScenario
        | HlsScenario
        | HlsLatencyScenario
    )
    sections: list[Section] = []
    section_verdicts: list[dict[str, Any]] = []
    named: tuple[tuple[str, Section | None], ...] = (
        ("batching", batching),
        ("decode", decode),
        ("effect", effect),
        ("streaming", streaming),
        ("glass", glass),
        ("camera_in", camera_in),
        ("overhead", overhead),
        ("fleet", fleet),
        ("hls", hls),
        ("hls_latency", hls_latency),
    )
    for name, section in named:
        if section is not None:
            judged = section.evaluate()
            report[name] = section.to_json(judged)
            sections.append(section)
            section_verdicts += judged
    if len(targets) == 2:
        report["compare"] = compare_json(per_target["A"], per_target["B"])
    text = render(
        report, targets, per_target, local, verdicts, s, diffusers, sections, section_verdicts
    )
    print(text)
    stamp = started.strftime("%Y%m%d-%H%M%S") + ("-quick" if s.quick else "")
    output = args.output or RESULTS_DIR / f"bench-{stamp}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    output.with_suffix(".md").write_text(text + "\n")
    progress(f"wrote {output} and {output.with_suffix('.md')}")
    missed = any(
        v["status"] == "FAIL"
        for vs in [*verdicts.values(), diffusers_verdicts, section_verdicts]
        for v in vs
    )
    return 1 if missed and args.strict else 0


async def until_interrupted(args: argparse.Namespace) -> int | None:
    """`main_async`, cancelled by Ctrl-C (SIGINT): its status, or None when interrupted.

    A signal receiver, not the KeyboardInterrupt trio would raise wherever the run is: a
    cancellation is what every part of the harness already ends on, and its shielded
    stops still stop the servers it started."""
    status: int | None = None

    async def on_interrupt(scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            async for _ in signals:
                scope.cancel()
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_interrupt, nursery.cancel_scope)
        status = await main_async(args)
        nursery.cancel_scope.cancel()
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.diffusers_worker:
        return diffusers_worker(args.diffusers_worker)
    try:
        status = trio.run(until_interrupted, args)
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        # Ctrl-C before the receiver is open (trio's KeyboardInterrupt), inside nurseries
        # wrapped in exception groups.
        if isinstance(exc, BaseExceptionGroup):
            interrupts, others = exc.split(KeyboardInterrupt)
            if interrupts is None or others is not None:
                raise
        status = None
    if status is None:
        progress("interrupted; the servers the harness started are stopped")
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
