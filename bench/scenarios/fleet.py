"""``fleet``: sessions and viewers served through nginx across three servers, against one
server alone, under the same load.

Per run, two setups one after the other (``one``, ``three``; the order reversed in odd
runs), each with fresh servers and nginx rendered from the shipped ``deploy/nginx.conf``
(`bench._nginx`):

* ``one``: one server on 127.0.0.2, listed on one ``server`` line (the shipped file's
  other two lines left out: what an operator with one server writes), started as one
  server is, without fleet flags;
* ``three``: three servers on 127.0.0.2, .3 and .4 (each a host of its own, as far as
  nginx and the servers can tell), each named (``--node-name host0`` ...) and given the
  whole fleet's list (``--peer``, its own entry included), as docs/deploying.md ("Watch
  links across servers") says.

Every server runs the synthetic engine (small frames, 8-frame chunks of 4 steps of
``fleet_step_delay``) with ``--max-sessions`` ``fleet_max_sessions``. The load is a wave
of ``fleet_sessions`` sessions opened at once through nginx, more than one server's
slots and more than the fleet's, each of them watched by ``fleet_viewers`` viewers
opened through nginx on its ``watch_path`` as soon as its ``video.start`` arrives
(`trio_vstream.client.watch_video`). Sessions and viewers carry their names in the URL's
query, which the servers ignore and nginx's access log shows.

What is counted, per setup and run:

* sessions **completed** (the whole video, ``session.done``, a normal close), **refused**
  (``server_busy``: an error before ``video.start``, or the upgrade answered 503) and
  **failed** (anything else);
* viewers **complete** (from the chunk they joined at to the owner's last, every one, in
  order, then the session's own ``session.done`` and a normal close) and **failed**;
* for each media chunk a viewer got, its **delay** behind the owner: the viewer's receipt
  minus the owner's of the same ``transport_chunk_index`` (both clients are in this
  process: one clock), split into **relayed** viewers (nginx sent them to a server other
  than the one nginx sent their session to, by its access log) and **direct** ones. The
  servers' own count of relayed viewers (``trio_vstream_viewers_relayed_total``) is
  kept beside the log's, as a cross-check.

Targets (`FleetScenario.evaluate`), never loosened to fit a result: in every run, exactly
``min(N, slots)`` sessions complete and the rest are refused, none fail (slots: one
server's ``S`` alone, ``3 S`` for the fleet); every viewer of a completed session gets
its end; a relayed viewer's delay behind the owner, median, <= 50 ms (the median over
runs of each run's median); nothing left on any server after the wave.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from bench._nginx import NGINX, LogEntry, Nginx, free_port, read_access_log, running_nginx
from bench._output import markdown_table, now, progress
from bench._report import (
    cleanup_verdict,
    figure_rows,
    format_figure,
    make_verdict,
    median_and_range,
)
from bench._server import Endpoint, http_get
from bench._settings import Settings, Target, make_target
from bench._stats import Figures, percentile
from bench.scenarios._own_server import serving, started_context
from trio_vstream.client import (
    StreamConnectError,
    StreamOutcome,
    StreamResult,
    stream_video,
    watch_video,
)
from trio_vstream.protocol import ErrorCode
from trio_vstream.server.config import VIDEO_PATH

HOSTS: Final = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
"""The fleet's hosts, as the servers and nginx see them: each its own loopback address."""
SETUPS: Final = {"one": 1, "three": len(HOSTS)}
"""Each setup and its number of servers."""
RELAY_DELAY_LIMIT_MS: Final = 50.0
"""A relayed viewer's delay behind the owner, median: one more hop inside the fleet (a
WebSocket message received and sent again on the relaying server's event loop, over
loopback here). The bound is the control plane's on this machine (ping round trip p99
with 8 sessions streaming <= 50 ms): an event loop that answers a ping in that time
passes a chunk on in it too."""
LOG_WAIT_S: Final = 10.0
"""nginx writes a WebSocket request's log line when its connection closes: how long to
wait for the wave's lines once every client is done."""
PROMPT: Final = "a lighthouse on a cliff at dusk, waves rolling in"
CHUNK_FRAMES: Final = 8


# ------------------------------------------------------------------- the clients


@attrs.define
class Viewer:
    """One viewer of a session's watch link, through nginx."""

    name: str
    url: str
    result: StreamResult | None = None
    failure: str | None = None
    """Why no connection was made (StreamConnectError), or that it timed out."""

    async def run(self) -> None:
        try:
            self.result = await watch_video(self.url)
        except StreamConnectError as exc:
            self.failure = str(exc)


@attrs.define
class WaveSession:
    """One session of the wave, through nginx, and its viewers."""

    name: str
    fields: dict[str, Any]
    viewer_count: int
    result: StreamResult | None = None
    failure: str | None = None
    status: int | None = None
    """The HTTP status of a refused upgrade (StreamConnectError.status_code)."""
    viewers: list[Viewer] = attrs.field(factory=list)
    no_watch_path: bool = False

    async def run(self, nginx: Nginx, nursery: trio.Nursery) -> None:
        """The session, starting its viewers in ``nursery`` once ``video.start`` is in."""
        watched = [False]

        def on_message(_message: object, result: StreamResult) -> None:
            if watched[0] or result.video_start is None:
                return
            watched[0] = True
            path = result.video_start.watch_path
            if path is None:
                self.no_watch_path = True
                return
            for n in range(self.viewer_count):
                name = f"{self.name}-v{n}"
                viewer = Viewer(name, nginx.url(f"{path}?viewer={name}"))
                self.viewers.append(viewer)
                nursery.start_soon(viewer.run)

        url = nginx.url(f"{VIDEO_PATH}?session={self.name}")
        try:
            self.result = await stream_video(url, self.fields, on_message=on_message)
        except StreamConnectError as exc:
            self.failure = str(exc)
            self.status = exc.status_code

    @property
    def outcome(self) -> str:
        """``completed``, ``refused`` or ``failed`` (`session_outcome`)."""
        return session_outcome(self.result, self.failure, self.status, self.fields["num_frames"])

    def describe(self) -> str:
        if self.result is None:
            return f"{self.name}: no session ({self.failure or 'timed out'})"
        r = self.result
        return (
            f"{self.name}: {r.outcome} frames={r.frames}/{self.fields['num_frames']} "
            f"close={r.close_code} error={r.error} problems={r.problems}"
        )


# ------------------------------------------------------------------- pure parts


def session_outcome(
    result: StreamResult | None, failure: str | None, status: int | None, frames: int
) -> str:
    """``completed``: the whole video (``frames``), ``session.done`` not stopped, a normal
    close, no protocol slip; ``refused``: ``server_busy`` before ``video.start`` (today's
    servers), or the upgrade answered 503 (a server that refuses before accepting; nginx
    passes the last backend's 503 on once its tries are spent); ``failed``: the rest."""
    if result is None:
        busy = status == 503 or (failure is not None and ErrorCode.SERVER_BUSY in failure)
        return "refused" if busy else "failed"
    if (
        result.outcome is StreamOutcome.COMPLETED
        and result.done is not None
        and not result.done.stopped
        and result.frames == frames
        and result.close_code == 1000
        and not result.problems
    ):
        return "completed"
    if result.rejected and result.error is not None and result.error.code == ErrorCode.SERVER_BUSY:
        return "refused"
    return "failed"


def chunk_indices(result: StreamResult) -> list[int]:
    """The ``transport_chunk_index`` of every announced chunk, in order of arrival."""
    return [c.metadata.transport_chunk_index for c in result.chunks if c.metadata is not None]


def viewer_problem(viewer: StreamResult, owner: StreamResult) -> str | None:
    """None when the viewer got the whole video from where it joined (every chunk the
    owner got from that one on, in order, none missed) and the session's end
    (``session.done``, not stopped, and a normal close); else what went wrong."""
    if viewer.outcome is not StreamOutcome.COMPLETED:
        return f"outcome {viewer.outcome} (error {viewer.error}, close {viewer.close_code})"
    if viewer.done is None or viewer.done.stopped:
        return "no session.done, or a stopped one"
    if viewer.close_code != 1000:
        return f"close code {viewer.close_code}"
    if viewer.problems:
        return f"protocol problems {viewer.problems}"
    seen, owned = chunk_indices(viewer), chunk_indices(owner)
    if not seen:
        return "no chunk"
    if seen[0] not in owned:
        return f"joined at chunk {seen[0]}, which the owner never got"
    expected = owned[owned.index(seen[0]) :]
    if seen != expected:
        missing = sorted(set(expected) - set(seen))
        return f"chunks {seen} where the owner got {expected} (missing {missing})"
    return None


def chunk_delays(viewer: StreamResult, owner: StreamResult) -> list[float]:
    """Seconds from the owner's receipt of each media chunk to the viewer's, matched by
    ``transport_chunk_index`` (both times ``trio.current_time()`` in one process)."""
    owned = {
        c.metadata.transport_chunk_index: c.received_at
        for c in owner.chunks
        if c.metadata is not None and c.num_frames
    }
    return [
        c.received_at - owned[c.metadata.transport_chunk_index]
        for c in viewer.chunks
        if c.metadata is not None and c.num_frames and c.metadata.transport_chunk_index in owned
    ]


def exact_verdict(
    name: str, rule: str, per_run: Sequence[dict[str, int]], expected: dict[str, int]
) -> dict[str, Any]:
    """PASS when every run's counts are exactly ``expected`` (not "at least")."""
    status = "N/A" if not per_run else "PASS"
    if per_run and any(counts != expected for counts in per_run):
        status = "FAIL"
    return {
        "target": name,
        "rule": rule,
        "measured": {"runs": list(per_run), "expected": expected},
        "threshold": None,
        "status": status,
        "note": "" if per_run else "not run",
    }


async def relayed_total(endpoint: Endpoint) -> int | None:
    """``trio_vstream_viewers_relayed_total`` of one server, from its ``/metrics``."""
    status, body = await http_get(endpoint, "/metrics")
    if status != 200:
        return None
    total = 0.0
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("trio_vstream_viewers_relayed_total"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


# ------------------------------------------------------------------- the scenario


class FleetScenario:
    """The scenario over all runs: its servers' commands, figures, checks and verdicts."""

    def __init__(self, s: Settings, server_args: Sequence[str]) -> None:
        self.settings = s
        self.server_args = list(server_args)
        self.figures = Figures()
        self.checks: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.available = NGINX.exists()
        self.counts: dict[str, list[dict[str, int]]] = {setup: [] for setup in SETUPS}
        self.viewer_counts: dict[str, list[dict[str, int]]] = {setup: [] for setup in SETUPS}
        self.shown: dict[str, str] = {}

    @property
    def skipped(self) -> str | None:
        """Why the scenario cannot run here, or None."""
        if self.available:
            return None
        return f"no {NGINX}: `apt-get install nginx` (Debian's package) to run it"

    def slots(self, setup: str) -> int:
        return SETUPS[setup] * self.settings.fleet_max_sessions

    def targets(self, setup: str, ports: Sequence[int]) -> dict[str, Target]:
        """The setup's servers, by name (``host0`` ...), each on its host and port."""
        s = self.settings
        hosts = HOSTS[: SETUPS[setup]]
        names = [f"host{n}" for n in range(len(hosts))]
        peers: list[str] = []
        if setup != "one":
            for name, host, port in zip(names, hosts, ports, strict=True):
                peers += ["--peer", f"{name}={host}:{port}"]
        targets = {}
        for name, host, port in zip(names, hosts, ports, strict=True):
            tokens = [
                "--engine",
                "synthetic",
                "--engine-arg",
                f"step_delay={s.fleet_step_delay:g}",
                "--engine-arg",
                f"chunk_frames={CHUNK_FRAMES}",
                "--max-sessions",
                str(s.fleet_max_sessions),
                "--host",
                host,
                "--port",
                str(port),
                *(["--node-name", name, *peers] if setup != "one" else []),
                *self.server_args,
            ]
            spec = shlex.join(tokens)
            targets[name] = make_target(name, spec, max_sessions_needed=s.fleet_max_sessions)
        return targets

    def start_fields(self, name: str) -> dict[str, Any]:
        s = self.settings
        return {
            "prompt": f"{PROMPT} ({name})",
            "size": f"{s.fleet_size}x{s.fleet_size}",
            "fps": s.fps,
            "num_frames": s.fleet_frames,
            "seed": 7,
        }

    async def run(self, run: int, log_dir: Path) -> None:
        if not self.available:
            return
        s = self.settings
        order = list(SETUPS) if run % 2 == 0 else list(SETUPS)[::-1]
        info: dict[str, Any] = {"run": run, "order": order, "setups": {}}
        self.runs.append(info)
        for setup in order:
            tag = f"run {run + 1}/{s.repeat} fleet {setup}"
            info["setups"][setup] = await self._setup(run, setup, log_dir, tag)

    async def _setup(self, run: int, setup: str, log_dir: Path, tag: str) -> dict[str, Any]:
        s = self.settings
        hosts = HOSTS[: SETUPS[setup]]
        ports = [free_port(host) for host in hosts]
        targets = self.targets(setup, ports)
        self.shown.setdefault(setup, targets["host0"].shown)
        stem = f"fleet-{run}-{setup}"
        part: dict[str, Any] = {"servers": {n: t.shown for n, t in targets.items()}}
        async with serving(targets, log_dir, stem, tag) as servers:
            contexts = {
                name: await started_context(
                    served, targets[name], s, self.figures, run, self.checks
                )
                for name, served in servers.items()
            }
            addresses = {f"{h}:{p}": name for name, h, p in zip(targets, hosts, ports, strict=True)}
            async with running_nginx(
                log_dir / stem, list(zip(hosts, ports, strict=True)), fewer_backends=True
            ) as nginx:
                progress(
                    f"{tag}: nginx on port {nginx.port} in front of {len(hosts)} server(s); "
                    f"{s.fleet_sessions} sessions, {s.fleet_viewers} viewers each"
                )
                sessions, wave_s = await self._wave(nginx, f"r{run}-{setup}")
                sessions_log, viewers_log = await self._logged(nginx, sessions)
            counters = [await relayed_total(ctx.endpoint) for ctx in contexts.values()]
            for name, ctx in contexts.items():
                await ctx.check_after(f"fleet {setup} {name}")
        part.update(
            self._record(run, setup, sessions, sessions_log, viewers_log, addresses, wave_s)
        )
        known = [c for c in counters if c is not None]
        part["relayed_by_the_servers"] = sum(known) if len(known) == len(counters) else None
        part["exit_status"] = {name: served.exit_status for name, served in servers.items()}
        if part["relayed_by_the_servers"] != part["viewers_relayed"]:
            progress(
                f"  !! {tag}: the servers counted {part['relayed_by_the_servers']} relayed "
                f"viewers, nginx's log {part['viewers_relayed']}"
            )
        return part

    async def _wave(self, nginx: Nginx, prefix: str) -> tuple[list[WaveSession], float]:
        """Every session at once, each with its viewers once its video.start is in; all
        within the session timeout (what is still running then has failed)."""
        s = self.settings
        sessions = [
            WaveSession(f"{prefix}-s{n}", self.start_fields(f"{prefix}-s{n}"), s.fleet_viewers)
            for n in range(s.fleet_sessions)
        ]
        started = now()
        with trio.move_on_after(s.session_timeout_s):
            async with trio.open_nursery() as nursery:
                for session in sessions:
                    nursery.start_soon(session.run, nginx, nursery)
        return sessions, now() - started

    async def _logged(
        self, nginx: Nginx, sessions: Sequence[WaveSession]
    ) -> tuple[dict[str, LogEntry], dict[str, LogEntry]]:
        """nginx's log entries for the wave's sessions and viewers that reached it."""
        wanted_sessions = {x.name for x in sessions if x.result is not None or x.status}
        wanted_viewers = {v.name for x in sessions for v in x.viewers if v.result is not None}
        path = nginx.access_log_path
        with trio.move_on_after(LOG_WAIT_S):
            # Polled (ASYNC110): nginx's log file, with no event to wait on.
            while not (  # noqa: ASYNC110
                wanted_sessions <= read_access_log(path, "session").keys()
                and wanted_viewers <= read_access_log(path, "viewer").keys()
            ):
                await trio.sleep(0.05)
        return read_access_log(path, "session"), read_access_log(path, "viewer")

    def _record(
        self,
        run: int,
        setup: str,
        sessions: Sequence[WaveSession],
        sessions_log: dict[str, LogEntry],
        viewers_log: dict[str, LogEntry],
        addresses: dict[str, str],
        wave_s: float,
    ) -> dict[str, Any]:
        """The setup's figures for this run, and what the run's JSON keeps of it."""
        prefix = f"fleet.{setup}"
        counts = {"completed": 0, "refused": 0, "failed": 0}
        viewer_counts = {"complete": 0, "failed": 0}
        delays: dict[str, list[float]] = {"relayed": [], "direct": []}
        kept: dict[str, Any] = {}
        unlogged: list[str] = []
        for session in sessions:
            outcome = session.outcome
            counts[outcome] += 1
            entry = sessions_log.get(session.name)
            owner = entry.served_by if entry is not None else None
            kept[session.name] = {
                "outcome": outcome,
                "served_by": addresses.get(owner or ""),
                "upstream_statuses": None if entry is None else list(entry.upstream_statuses),
                "viewers": {},
            }
            if outcome == "failed":
                progress(f"  !! fleet {setup}: session {session.describe()}")
            if session.no_watch_path:
                viewer_counts["failed"] += self.settings.fleet_viewers
                progress(f"  !! fleet {setup}: {session.name} has no watch_path")
            for viewer in session.viewers:
                if viewer.result is None or session.result is None:
                    problem: str | None = viewer.failure or "timed out"
                else:
                    problem = viewer_problem(viewer.result, session.result)
                if problem is None and outcome == "completed":
                    viewer_counts["complete"] += 1
                else:
                    viewer_counts["failed"] += 1
                    progress(f"  !! fleet {setup}: viewer {viewer.name}: {problem}")
                entered = viewers_log.get(viewer.name)
                kind = None
                if entered is not None and owner is not None:
                    kind = "direct" if entered.served_by == owner else "relayed"
                elif viewer.result is not None:
                    unlogged.append(viewer.name)
                kept[session.name]["viewers"][viewer.name] = {"kind": kind, "problem": problem}
                if kind is not None and viewer.result is not None and session.result is not None:
                    delays[kind] += chunk_delays(viewer.result, session.result)
        if unlogged:
            progress(f"  !! fleet {setup}: not in nginx's log: {', '.join(unlogged)}")
        self.counts[setup].append(counts)
        self.viewer_counts[setup].append(viewer_counts)
        add = self.figures.add
        for key, value in counts.items():
            add(run, f"{prefix}.sessions_{key}", [value])
        for key, value in viewer_counts.items():
            add(run, f"{prefix}.viewers_{key}", [value])
        relayed = sum(
            1 for x in kept.values() for v in x["viewers"].values() if v["kind"] == "relayed"
        )
        add(run, f"{prefix}.viewers_relayed", [relayed])
        for kind, values in delays.items():
            if values:
                ms = [v * 1000 for v in values]
                add(run, f"{prefix}.{kind}_delay_ms", ms)
                add(run, f"{prefix}.{kind}_delay_p50_ms", [percentile(ms, 50)])
                add(run, f"{prefix}.{kind}_delay_p95_ms", [percentile(ms, 95)])
        add(
            run,
            f"{prefix}.ttfc_ms",
            [
                ttfc * 1000
                for x in sessions
                if x.result is not None
                and x.outcome == "completed"
                and (ttfc := x.result.time_to_first_chunk) is not None
            ],
        )
        add(run, f"{prefix}.wave_s", [wave_s])
        placement: dict[str, dict[str, int]] = {}
        for x in kept.values():
            where = placement.setdefault(x["served_by"] or "?", {})
            where[x["outcome"]] = where.get(x["outcome"], 0) + 1
        return {
            "sessions": kept,
            "placement": placement,
            "counts": counts,
            "viewer_counts": viewer_counts,
            "viewers_relayed": relayed,
            "viewers_not_in_the_log": unlogged,
            "wave_s": wave_s,
        }

    def evaluate(self) -> list[dict[str, Any]]:
        s = self.settings
        if self.skipped is not None:
            return [make_verdict("fleet: skipped", None, None, "needs nginx", self.skipped)]
        verdicts = []
        n = s.fleet_sessions
        for setup, servers in SETUPS.items():
            slots = self.slots(setup)
            expected = min(n, slots)
            label = "one server" if servers == 1 else f"{servers} servers"
            verdicts.append(
                exact_verdict(
                    f"fleet: {label}, {n} sessions at once: every session that fits completes",
                    f"completed = min({n}, {slots} slots) = {expected}, refused (server_busy) "
                    f"= {n - expected}, failed = 0, in every run",
                    self.counts[setup],
                    {"completed": expected, "refused": n - expected, "failed": 0},
                )
            )
            verdicts.append(
                exact_verdict(
                    f"fleet: {label}, every viewer of a completed session gets its end",
                    f"complete = {s.fleet_viewers} x completed sessions = "
                    f"{s.fleet_viewers * expected}, failed = 0, in every run",
                    self.viewer_counts[setup],
                    {"complete": s.fleet_viewers * expected, "failed": 0},
                )
            )
        run_medians = self._values("fleet.three.relayed_delay_p50_ms")
        verdicts.append(
            make_verdict(
                "fleet: 3 servers, a relayed viewer's delay behind the owner, median",
                percentile(run_medians, 50) if run_medians else None,
                RELAY_DELAY_LIMIT_MS,
                f"the median over runs of each run's median <= {RELAY_DELAY_LIMIT_MS:g} ms "
                "(one more hop; the control plane's bound on this machine)",
                f"{len(run_medians)} run(s)" if run_medians else "no relayed viewer",
            )
        )
        verdicts.append(cleanup_verdict("fleet", self.checks))
        return verdicts

    def markdown(self) -> list[str]:
        s = self.settings
        intro = (
            f"Fleet: {s.fleet_sessions} sessions at once through nginx (the shipped "
            f"deploy/nginx.conf), {s.fleet_viewers} viewers of each through nginx from its "
            f"video.start; every server the synthetic engine, {s.fleet_size}x{s.fleet_size} "
            f"at {s.fps} fps, {s.fleet_frames} frames in {CHUNK_FRAMES}-frame chunks of 4 "
            f"steps of {s.fleet_step_delay * 1000:g} ms, --max-sessions "
            f"{s.fleet_max_sessions}. One server alone (one `server` line) against three on "
            f"127.0.0.2-4 (three lines, each server named and given the others); "
            f"{s.repeat} run(s), medians over runs (their range in brackets)"
        )
        if self.skipped is not None:
            return [intro, "", f"Skipped: {self.skipped}"]
        header = ("per run", "one server", "three servers")
        rows = [
            (
                "sessions completed / refused / failed",
                *(
                    self._counts_cell(setup, "sessions", ("completed", "refused", "failed"))
                    for setup in SETUPS
                ),
            ),
            (
                "viewers complete / failed",
                *(self._counts_cell(setup, "viewers", ("complete", "failed")) for setup in SETUPS),
            ),
            ("viewers relayed", *(self._cell(f"fleet.{x}.viewers_relayed") for x in SETUPS)),
            (
                "direct viewer's delay behind the owner, p50 / p95 (ms)",
                *(self._pair(f"fleet.{x}.direct_delay") for x in SETUPS),
            ),
            (
                "relayed viewer's delay behind the owner, p50 / p95 (ms)",
                *(self._pair(f"fleet.{x}.relayed_delay") for x in SETUPS),
            ),
            ("session's time to first chunk, median (ms)", *(self._ttfc(x) for x in SETUPS)),
            (
                "the wave, first session to last client (s)",
                *(self._cell(f"fleet.{x}.wave_s") for x in SETUPS),
            ),
        ]
        table_header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
        return [
            intro,
            "",
            *(f"Server ({setup}): `{shown}`" for setup, shown in self.shown.items()),
            "",
            markdown_table(header, rows),
            "",
            markdown_table(table_header, figure_rows(self.figures)),
        ]

    def _values(self, name: str) -> list[float]:
        figure = self.figures.get(name)
        return [] if figure is None else [v for run in figure.runs for v in run]

    def _cell(self, name: str) -> str:
        """The median over runs, and their range where they differ (`median_and_range`)."""
        return median_and_range(self._values(name))

    def _counts_cell(self, setup: str, what: str, keys: Sequence[str]) -> str:
        names = [f"fleet.{setup}.{what}_{key}" for key in keys]
        return " / ".join(self._cell(name) for name in names)

    def _pair(self, stem: str) -> str:
        return f"{self._cell(f'{stem}_p50_ms')} / {self._cell(f'{stem}_p95_ms')}"

    def _ttfc(self, setup: str) -> str:
        values = self._values(f"fleet.{setup}.ttfc_ms")
        return format_figure(percentile(values, 50)) if values else "n/a"

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "skipped": self.skipped,
            "servers": self.shown,
            "relay_delay_limit_ms": RELAY_DELAY_LIMIT_MS,
            **self.figures.to_json(),
            "checks": self.checks,
            "runs": self.runs,
            "targets": verdicts,
        }
