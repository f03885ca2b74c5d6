"""``hls``: one session watched by a crowd of LL-HLS viewers through nginx's cache, against
the same session watched by nobody.

Per run, two setups one after the other (``alone``, ``crowd``; the order reversed in odd
runs), each with a fresh server (the synthetic engine, ``hls_chunk_frames``-frame
chunks of 4 steps of ``hls_step_delay``: a little faster than real time, as a live
session is) behind a fresh nginx rendered from the shipped ``deploy/nginx.conf``
(`bench._nginx`; one ``server`` line), and in each, through nginx:

* an untimed warm-up session (a few chunks: the encoder's first use, the allocator's
  first pages), then
* the measured session: ``hls_frames`` frames at ``hls_width`` x ``hls_height``. In
  ``crowd``, ``hls_viewers`` LL-HLS viewers (`bench._hls.HlsViewer`: a player's first
  load, then blocking reloads and parts, to ``EXT-X-ENDLIST``) start at its
  ``video.start``, all at once, from its ``hls_path``. In ``alone`` nobody watches
  (the server still keeps the session's playlist, as every session's).

What is measured, per run:

* the server process's CPU (user + system, every thread: `bench._server.cpu_seconds`)
  from the measured session's start to the last of its clients done, per frame the
  owner got (``hls.S.cpu_ms_per_frame``), and crowd over alone (``hls.cpu_ratio``);
* how many requests reached the server (nginx's access log: ``upstream=`` not ``-``)
  for each part (``hls.origin_per_part``, every part; per run its median and max),
  for each blocking reload's query (``hls.origin_per_reload_max``), and in all
  (``hls.origin_requests``: the viewers' first loads included, which the cache keeps a
  second); the viewers' requests (``hls.viewer_requests``) and the cache's share
  (``hls.cache_hit_pct``);
* viewers **complete** (every part from the first to the last, in order, none missed,
  and their bytes the owner's, byte for byte: one SHA-256) and **failed**;
* each part's **delay**: a viewer's receipt of part k minus the owner's of its k-th
  media chunk (one process, one clock), p50 and p95 per run.

Targets (`HlsScenario.evaluate`), never loosened to fit a result: in every run, at most
2 requests per part reach the server (``max``); every viewer complete, in every run;
the server's CPU per frame with the crowd at most 1.2 times without it (the median
over runs of each run's ratio); nothing left on the server.
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import trio

from bench._hls import (
    HlsViewer,
    open_files,
    open_files_short_of,
    origin_requests,
    parts_origin_counts,
)
from bench._nginx import NGINX, LogEntry, Nginx, read_requests, running_nginx
from bench._output import markdown_table, now, progress
from bench._report import cleanup_verdict, figure_rows, make_verdict, median_and_range
from bench._server import cpu_seconds
from bench._settings import Settings, Target, make_target
from bench._stats import Figures, percentile
from bench.scenarios._own_server import serving, started_context
from bench.scenarios.fleet import exact_verdict
from trio_vstream.client import StreamConnectError, StreamOutcome, StreamResult, stream_video
from trio_vstream.server.config import VIDEO_PATH

SETUPS: Final = ("alone", "crowd")
CPU_RATIO_LIMIT: Final = 1.2
"""The server's CPU per frame with the crowd, over without: at most (the issue's)."""
ORIGIN_PER_PART_LIMIT: Final = 2
"""Requests for one part that reach the server, however many viewers: at most."""
WARMUP_CHUNKS: Final = 3
PROMPT: Final = "a lighthouse on a cliff at dusk, waves rolling in"
FILES_PER_VIEWER: Final = 1
"""A viewer holds one keep-alive connection: one socket of the harness."""
FILES_SPARE: Final = 256


def _part_delays(viewer: HlsViewer, owner: StreamResult) -> list[float]:
    """Seconds from the owner's receipt of its k-th media chunk to the viewer's of part k
    (a part is a media chunk, in order; the first without the init segment)."""
    owned = [c.received_at for c in owner.chunks if c.num_frames]
    return [got - sent for got, sent in zip(viewer.arrived, owned, strict=False)]


def owner_digest(owner: StreamResult) -> str:
    """SHA-256 of the owner's media chunks, one after the other (init segment first)."""
    media = hashlib.sha256()
    for chunk, data in zip(owner.chunks, owner.binary_messages, strict=True):
        if chunk.metadata is not None and chunk.metadata.kind == "media":
            media.update(data)
    return media.hexdigest()


class HlsScenario:
    """The scenario over all runs: its server's command, figures, checks and verdicts."""

    def __init__(self, s: Settings, server_args: Sequence[str]) -> None:
        self.settings = s
        self.server_args = list(server_args)
        self.figures = Figures()
        self.checks: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.viewer_counts: list[dict[str, int]] = []
        self.shown: str | None = None
        self.files = s.hls_viewers * FILES_PER_VIEWER + FILES_SPARE

    @property
    def skipped(self) -> str | None:
        """Why the scenario cannot run here, or None."""
        if not NGINX.exists():
            return f"no {NGINX}: `apt-get install nginx` (Debian's package) to run it"
        return open_files_short_of(self.files)

    def target(self) -> Target:
        s = self.settings
        tokens = [
            "--engine",
            "synthetic",
            "--engine-arg",
            f"step_delay={s.hls_step_delay:g}",
            "--engine-arg",
            f"chunk_frames={s.hls_chunk_frames}",
            "--host",
            "127.0.0.1",
            *self.server_args,
        ]
        return make_target("hls", shlex.join(tokens), max_sessions_needed=1)

    def start_fields(self, frames: int) -> dict[str, Any]:
        s = self.settings
        return {
            "prompt": PROMPT,
            "size": f"{s.hls_width}x{s.hls_height}",
            "fps": s.fps,
            "num_frames": frames,
            "seed": 7,
        }

    async def run(self, run: int, log_dir: Path) -> None:
        if self.skipped is not None:
            return
        order = list(SETUPS) if run % 2 == 0 else list(SETUPS)[::-1]
        info: dict[str, Any] = {"run": run, "order": order, "setups": {}}
        self.runs.append(info)
        with open_files(self.files):
            for setup in order:
                tag = f"run {run + 1}/{self.settings.repeat} hls {setup}"
                info["setups"][setup] = await self._setup(run, setup, log_dir, tag)
        self._ratio(run, info)

    async def _setup(self, run: int, setup: str, log_dir: Path, tag: str) -> dict[str, Any]:
        s = self.settings
        target = self.target()
        self.shown = self.shown or target.shown
        stem = f"hls-{run}-{setup}"
        count = s.hls_viewers if setup == "crowd" else 0
        async with serving({"server": target}, log_dir, stem, tag) as servers:
            served = servers["server"]
            ctx = await started_context(served, target, s, self.figures, run, self.checks)
            backend = [(served.endpoint.host, served.endpoint.port)]
            async with running_nginx(log_dir / stem, backend, fewer_backends=True) as nginx:
                progress(f"{tag}: nginx on port {nginx.port}; {count} viewers")
                warmup = self.start_fields(WARMUP_CHUNKS * s.hls_chunk_frames)
                with trio.move_on_after(s.session_timeout_s):
                    await stream_video(nginx.url(f"{VIDEO_PATH}?session=warmup"), warmup)
                cpu_before = cpu_seconds(served.pid)
                started = now()
                owner, viewers = await self._session(nginx, count, f"r{run}-{setup}")
                wall_s = now() - started
                cpu_after = cpu_seconds(served.pid)
                log = read_requests(nginx.access_log_path)
            await ctx.check_after(f"hls {setup}")
        cpu_s = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
        return self._record(run, setup, owner, viewers, log, cpu_s, wall_s) | {
            "exit_status": served.exit_status
        }

    async def _session(
        self, nginx: Nginx, count: int, name: str
    ) -> tuple[StreamResult | None, list[HlsViewer]]:
        """The measured session and its viewers, all started at its ``video.start``; all
        within the session timeout (what still runs then has failed)."""
        s = self.settings
        viewers: list[HlsViewer] = []
        owner: list[StreamResult] = []
        # A viewer needs a load, the init segment, and per part a reload and the part,
        # with room for reloads answered before a new part (segment ends, the end).
        parts = -(-s.hls_frames // s.hls_chunk_frames)
        bound = 4 * parts + 20
        with trio.move_on_after(s.session_timeout_s):
            async with trio.open_nursery() as nursery:

                def on_message(_message: object, result: StreamResult) -> None:
                    start = result.video_start
                    if start is None or viewers or start.hls_path is None:
                        return
                    for n in range(count):
                        viewer = HlsViewer(
                            f"{name}-v{n}", "127.0.0.1", nginx.port, start.hls_path, bound
                        )
                        viewers.append(viewer)
                        nursery.start_soon(viewer.run)

                url = nginx.url(f"{VIDEO_PATH}?session={name}")
                try:
                    fields = self.start_fields(s.hls_frames)
                    owner.append(await stream_video(url, fields, on_message=on_message))
                except StreamConnectError as exc:
                    progress(f"  !! hls: the session did not connect: {exc}")
        return (owner[0] if owner else None), viewers

    def _record(
        self,
        run: int,
        setup: str,
        owner: StreamResult | None,
        viewers: Sequence[HlsViewer],
        log: Sequence[LogEntry],
        cpu_s: float | None,
        wall_s: float,
    ) -> dict[str, Any]:
        s = self.settings
        add = self.figures.add
        completed = (
            owner is not None
            and owner.outcome is StreamOutcome.COMPLETED
            and owner.frames == s.hls_frames
        )
        frames = owner.frames if owner is not None else 0
        part: dict[str, Any] = {"session_completed": completed, "frames": frames}
        if not completed:
            progress(f"  !! hls {setup}: {owner.summary() if owner else 'no session'}")
        if cpu_s is not None and frames:
            add(run, f"hls.{setup}.cpu_ms_per_frame", [cpu_s * 1000 / frames])
        add(run, f"hls.{setup}.session_s", [wall_s])
        part.update({"cpu_s": cpu_s, "wall_s": wall_s})
        if setup != "crowd":
            return part
        digest = owner_digest(owner) if owner is not None else None
        problems: dict[str, str] = {}
        for viewer in viewers:
            if not viewer.complete:
                problems[viewer.name] = viewer.failure or "no end"
            elif viewer.digest() != digest:
                problems[viewer.name] = "its bytes are not the owner's"
        not_started = s.hls_viewers - len(viewers)
        counts = {
            "complete": len(viewers) - len(problems),
            "failed": len(problems) + not_started,
        }
        self.viewer_counts.append(counts)
        if not_started:
            progress(f"  !! hls crowd: {not_started} viewers never started")
        for name, problem in list(problems.items())[:5]:
            progress(f"  !! hls crowd: viewer {name}: {problem}")
        add(run, "hls.viewers_complete", [counts["complete"]])
        add(run, "hls.viewers_failed", [counts["failed"]])
        part["viewer_counts"] = counts
        part["viewer_problems"] = dict(list(problems.items())[:20])
        if not viewers:
            return part
        prefix = viewers[0].base + "/"
        reference = max(viewers, key=lambda v: len(v.places))
        per_part = parts_origin_counts(log, prefix, reference.places)
        origin = origin_requests(log, prefix)
        reloads = [n for path, n in origin.items() if "_HLS_msn=" in path]
        mine = [e for e in log if e.path.startswith(prefix)]
        hits = sum(e.cache == "HIT" for e in mine)
        if per_part:
            values = list(per_part.values())
            add(run, "hls.origin_per_part", values)
            add(run, "hls.origin_per_part_median", [percentile(values, 50)])
            add(run, "hls.origin_per_part_max", [max(values)])
        if reloads:
            add(run, "hls.origin_per_reload_max", [max(reloads)])
        add(run, "hls.origin_requests", [sum(origin.values())])
        add(run, "hls.viewer_requests", [sum(v.requests for v in viewers)])
        if mine:
            add(run, "hls.cache_hit_pct", [100.0 * hits / len(mine)])
        if owner is not None:
            delays = [d * 1000 for v in viewers if v.complete for d in _part_delays(v, owner)]
            if delays:
                add(run, "hls.part_delay_ms", delays)
                add(run, "hls.part_delay_p50_ms", [percentile(delays, 50)])
                add(run, "hls.part_delay_p95_ms", [percentile(delays, 95)])
        part["origin_per_part"] = {f"{m}.{i}": n for (m, i), n in per_part.items()}
        part["origin_requests"] = dict(origin.most_common(10))
        return part

    def _ratio(self, run: int, info: dict[str, Any]) -> None:
        alone = self.figures.get("hls.alone.cpu_ms_per_frame")
        crowd = self.figures.get("hls.crowd.cpu_ms_per_frame")
        if alone is None or crowd is None or run >= min(len(alone.runs), len(crowd.runs)):
            return
        if alone.runs[run] and crowd.runs[run] and alone.runs[run][0] > 0:
            ratio = crowd.runs[run][0] / alone.runs[run][0]
            self.figures.add(run, "hls.cpu_ratio", [ratio])
            info["cpu_ratio"] = ratio

    def _values(self, name: str) -> list[float]:
        figure = self.figures.get(name)
        return [] if figure is None else [v for run in figure.runs for v in run]

    def evaluate(self) -> list[dict[str, Any]]:
        s = self.settings
        if self.skipped is not None:
            return [make_verdict("hls: skipped", None, None, "needs nginx", self.skipped)]
        n = s.hls_viewers
        maxima = self._values("hls.origin_per_part_max")
        ratios = self._values("hls.cpu_ratio")
        return [
            make_verdict(
                f"hls: {n} viewers through nginx's cache, requests per part that reach the "
                "server, max",
                max(maxima) if maxima else None,
                ORIGIN_PER_PART_LIMIT,
                f"<= {ORIGIN_PER_PART_LIMIT} for every part, in every run (nginx's access log)",
                f"{len(maxima)} run(s)" if maxima else "no part counted",
            ),
            exact_verdict(
                f"hls: every one of {n} viewers gets every part, the owner's bytes",
                f"complete = {n}, failed = 0, in every run",
                self.viewer_counts,
                {"complete": n, "failed": 0},
            ),
            make_verdict(
                f"hls: the server's CPU per frame with {n} viewers / with none",
                percentile(ratios, 50) if ratios else None,
                CPU_RATIO_LIMIT,
                f"the median over runs of each run's ratio <= {CPU_RATIO_LIMIT:g}",
                f"{len(ratios)} run(s)" if ratios else "not measured",
            ),
            cleanup_verdict("hls", self.checks),
        ]

    def markdown(self) -> list[str]:
        s = self.settings
        intro = (
            f"LL-HLS through nginx's cache (the shipped deploy/nginx.conf): one session, "
            f"{s.hls_width}x{s.hls_height} at {s.fps} fps, {s.hls_frames} frames in "
            f"{s.hls_chunk_frames}-frame chunks (parts) of 4 steps of "
            f"{s.hls_step_delay * 1000:g} ms, watched by {s.hls_viewers} LL-HLS viewers "
            f"through nginx (crowd) and by none (alone); {s.repeat} run(s), medians over "
            f"runs (their range in brackets)"
        )
        if self.skipped is not None:
            return [intro, "", f"Skipped: {self.skipped}"]
        rows = [
            ("viewers complete / failed", self._pair("hls.viewers_complete", "hls.viewers_failed")),
            (
                "requests per part that reach the server, median / max",
                self._pair("hls.origin_per_part_median", "hls.origin_per_part_max"),
            ),
            (
                "requests per blocking reload that reach the server, max",
                self._cell("hls.origin_per_reload_max"),
            ),
            (
                "requests that reach the server / the viewers' requests",
                self._pair("hls.origin_requests", "hls.viewer_requests"),
            ),
            ("answered by the cache (%)", self._cell("hls.cache_hit_pct")),
            (
                "server CPU per frame, alone / crowd (ms)",
                self._pair("hls.alone.cpu_ms_per_frame", "hls.crowd.cpu_ms_per_frame"),
            ),
            ("crowd / alone, CPU per frame", self._cell("hls.cpu_ratio")),
            (
                "a part's delay behind the owner, p50 / p95 (ms)",
                self._pair("hls.part_delay_p50_ms", "hls.part_delay_p95_ms"),
            ),
            (
                "session to its last client done, alone / crowd (s)",
                self._pair("hls.alone.session_s", "hls.crowd.session_s"),
            ),
        ]
        table_header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
        return [
            intro,
            "",
            f"Server: `{self.shown}`",
            "",
            markdown_table(("per run", "value"), rows),
            "",
            markdown_table(table_header, figure_rows(self.figures)),
        ]

    def _cell(self, name: str) -> str:
        """The median over runs, and their range where they differ (`median_and_range`)."""
        return median_and_range(self._values(name))

    def _pair(self, first: str, second: str) -> str:
        return f"{self._cell(first)} / {self._cell(second)}"

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "skipped": self.skipped,
            "server": self.shown,
            "cpu_ratio_limit": CPU_RATIO_LIMIT,
            "origin_per_part_limit": ORIGIN_PER_PART_LIMIT,
            **self.figures.to_json(),
            "checks": self.checks,
            "runs": self.runs,
            "targets": verdicts,
        }
