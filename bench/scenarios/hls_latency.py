"""``hls_latency`` (issue 33): how far behind the WebSocket stream a viewer of its
Low-Latency HLS playlist sees it, through nginx, in a real player.

Per run: one shapes server (``--engine shapes --device cpu``, its video defaults: 256x256
at 24 fps in 8-frame chunks; ``threads=1`` as in ``glass``, so that chromium has the other
core of a 2-core machine), nginx in front of it rendered from the shipped
``deploy/nginx.conf`` (`bench._nginx`, one ``server`` line), and the server's default
LL-HLS settings (2 s segments; PART-TARGET the engine's 8-frame chunk, 0.334 s;
PART-HOLD-BACK three times it). The harness is the session's owner: it opens one session
straight on the server, paced to media time (``pace_to_media_time``, the server's
default lead), ``hls_seconds`` long, so that the playlist grows in real time as a live
broadcast's does. hls.js, the release pinned for the tests (`tests.player.hlsjs`), plays
the session's ``hls_path`` through nginx in Debian's chromium, in its low-latency mode
with its defaults, from the live edge as a viewer does, until the playlist ends. Two
viewers, each on a page of its own (`VIEWERS`):

* ``first`` is given the URL at ``video.start``, as someone who opens a shared link at
  once (hls.js starts playing once the playlist lists a whole segment, 2 s in);
* ``joined`` is given it once ``hls_join_s`` of the stream has been sent: a viewer of a
  stream already running.

The figure, per media chunk and viewer: from the owner's receipt of the chunk on its
WebSocket (the nearest this side can see to the server's first send of it: the server's
own send time is not exposed, and the two are a loopback hop apart) to the moment hls.js's
video element presented that chunk's first frame (``requestVideoFrameCallback``'s
``expectedDisplayTime``). Both are wall-clock times on this machine: the harness's
``time.time()`` and the page's ``performance.timeOrigin + expectedDisplayTime``, the
offset between the two clocks measured through Playwright (the shortest of a few round
trips; the report keeps it and its uncertainty). A frame's place in the stream is its
``mediaTime`` plus hls.js's ``initPTS`` (how it maps the stream's decode times onto the
element's timeline). Chunks sent before a viewer began playing are not counted; a chunk
after that whose first frame never showed is counted as missed.

Beside it: hls.js's own estimate of its distance behind the live edge and the distance it
aims at (``hls.latency``, ``hls.targetLatency``), the playlist's PART-TARGET and
PART-HOLD-BACK as hls.js read them, and its stalls.

Targets (`HlsLatencyScenario.evaluate`), never loosened to fit a result: for each viewer,
the median delay at most 2.0 s (the median over runs of each run's median).

Playwright's sync API blocks, so the browser runs in a worker thread, as in ``glass``;
servers and nginx are started and always stopped by the harness. Needs Debian's chromium
and nginx, and hls.js (downloaded once from the npm registry into a cache; see
`tests.player.hlsjs`): without any of them the scenario is skipped and says why.
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import trio

from bench._nginx import NGINX, running_nginx
from bench._output import markdown_table, progress, read_file
from bench._report import figure_rows, make_verdict
from bench._server import http_get
from bench._settings import Settings
from bench._stats import Figures, percentile
from bench.scenarios._own_server import SHAPES_PROMPT, serving, shapes_target
from bench.scenarios.glass import CHROMIUM, engine_chunk_ms
from tests.player.hlsjs import (
    HLSJS_VERSION,
    HlsJsUnavailable,
    hlsjs_script,
    route_page,
)
from trio_vstream.client import ReceivedChunk, StreamResult, stream_video

TARGET_MS: Final = 2000.0
"""The issue's target for the median delay, with the built-in model and default LL-HLS."""
FPS: Final = 24
"""The shapes engine's default frame rate (its chunks: 8 frames)."""
PAGE_TIMEOUT_MS: Final = 60_000
CLOCK_PROBES: Final = 7
"""Round trips to the page for the clock offset; the shortest one is kept."""
VIEWERS: Final = ("first", "joined")
"""The viewers of each run's session (the module's docstring says when each joins)."""
PRESENT_SLACK_S: Final = 0.5 / FPS
"""A presented frame is a chunk's first frame when its stream time is within this of
the chunk's start (half a frame: the frames are 1/24 s apart)."""


def clock_offset(page: Any) -> tuple[float, float]:
    """The page's wall clock minus this process's, in seconds, and the uncertainty (half
    the round trip it was read in): the smallest of `CLOCK_PROBES` round trips."""
    best: tuple[float, float] | None = None
    for _ in range(CLOCK_PROBES):
        before = time.time()
        page_ms = float(page.evaluate("() => performance.timeOrigin + performance.now()"))
        after = time.time()
        probe = (page_ms / 1000.0 - (before + after) / 2, (after - before) / 2)
        if best is None or probe[1] < best[1]:
            best = probe
    assert best is not None
    return best


def _collector(errors: list[str]) -> Callable[[Any], None]:
    return lambda error: errors.append(str(error))


def drive_hlsjs(
    origin: str,
    script: bytes,
    playlist_paths: Sequence[Callable[[], str | None]],
    timeout_ms: int,
) -> list[dict[str, Any]]:
    """Chromium with one page of the hls.js test page at ``origin`` (nginx) per viewer,
    each playing the playlist whose path its ``playlist_paths[i]()`` gives (each waits
    for that viewer's moment to join; None: the session has no playlist), all until the
    playlist ends. Blocking (Playwright's sync API): run in a thread."""
    from playwright.sync_api import sync_playwright

    viewers: list[dict[str, Any]] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required"],
        )
        try:
            pages = []
            for _ in playlist_paths:
                page = browser.new_page()
                page.set_default_timeout(PAGE_TIMEOUT_MS)
                errors: list[str] = []
                page.on("pageerror", _collector(errors))
                page.goto(route_page(page, origin, script))
                pages.append(page)
                viewers.append({"errors": errors, "run": None, "clock": []})
            for page, viewer, playlist_path in zip(pages, viewers, playlist_paths, strict=True):
                path = playlist_path()
                if path is None:
                    viewer["errors"].append("the session's video.start has no hls_path")
                    continue
                viewer["clock"].append(clock_offset(page))
                page.evaluate("([url, config]) => playHls(url, config)", [origin + path, {}])
            for page, viewer in zip(pages, viewers, strict=True):
                if not viewer["clock"]:
                    continue
                page.wait_for_function(
                    "() => window.hlsRun.ended || window.hlsRun.fatal != null",
                    timeout=timeout_ms,
                )
                viewer["run"] = page.evaluate("() => window.hlsRun")
                viewer["clock"].append(clock_offset(page))
        finally:
            browser.close()
    return viewers


def chunk_starts(chunks: Sequence[tuple[int, float]], fps: int) -> list[tuple[float, float]]:
    """(media start in seconds, receipt time) of each media chunk, from (frames, receipt)."""
    starts: list[tuple[float, float]] = []
    frames = 0
    for count, received in chunks:
        starts.append((frames / fps, received))
        frames += count
    return starts


def chunk_delays(
    starts: Sequence[tuple[float, float]],
    frames: Sequence[Sequence[float]],
    init_pts: Sequence[Sequence[float]],
    offset_s: float,
) -> tuple[list[float], int]:
    """Per media chunk whose first frame hls.js presented: its receipt -> that
    presentation, in seconds; and how many chunks after the first one presented never had
    their first frame shown. ``frames``: the page's [mediaTime, presentedFrames, shown
    (ms, the page's clock)]; ``init_pts``: hls.js's [initPTS, timescale, start] as it
    found them (`stream_shift`); ``offset_s``: the page's clock minus the receipts'."""
    if not frames or not init_pts:
        return [], 0
    shown = sorted(
        (media + stream_shift(media, init_pts), at / 1000.0 - offset_s) for media, _, at in frames
    )
    first_presented = shown[0][0]
    delays: list[float] = []
    missed = 0
    index = 0
    for start, received in starts:
        while index < len(shown) and shown[index][0] < start - PRESENT_SLACK_S:
            index += 1
        if index < len(shown) and abs(shown[index][0] - start) <= PRESENT_SLACK_S:
            delays.append(shown[index][1] - received)
        elif start > first_presented:
            missed += 1
    return delays, missed


def stream_shift(media: float, init_pts: Sequence[Sequence[float | None]]) -> float:
    """A frame's place in the stream less its place on the element's timeline
    (``media``), from hls.js's initPTS entries [initPTS, timescale, start]: hls.js finds
    one on a fragment (at ``start`` on the element's timeline) and remuxes that fragment
    and the ones after it with it, and may find a new one mid-play (a new base time, a
    discontinuity), which moves the fragments from there on. So a frame takes the entry
    of the latest fragment that starts at or before it (within `PRESENT_SLACK_S`), the
    last found among equals, and one before them all the first entry. An entry without a
    start holds from the beginning."""
    chosen, latest = init_pts[0], -math.inf
    for entry in init_pts:
        start = entry[2] if len(entry) > 2 and entry[2] is not None else -math.inf
        if latest <= start <= media + PRESENT_SLACK_S:
            chosen, latest = entry, start
    base, timescale = chosen[0], chosen[1]
    assert base is not None and timescale is not None
    return base / timescale


class HlsLatencyScenario:
    """The scenario over all runs: its server, figures and verdicts."""

    def __init__(self, s: Settings, server_args: Sequence[str]) -> None:
        self.settings = s
        self.figures = Figures()
        self.runs: list[dict[str, Any]] = []
        self.frames = round(s.hls_seconds * FPS)
        self.target = shapes_target(
            "hls",
            s.hls_engine_args,
            ["--device", "cpu", *server_args],
            max_sessions=1,
            num_frames=self.frames,
        )
        self.script: bytes | None = None
        self.skipped = self._why_skipped()

    def _why_skipped(self) -> str | None:
        """Why the scenario cannot run here, or None; fetches hls.js (cached). A tarball
        other than the pinned one raises: never measure with it."""
        if not NGINX.exists():
            return f"no {NGINX}: `apt-get install nginx` (Debian's package) to run it"
        if not CHROMIUM.exists():
            return f"no {CHROMIUM}: `apt-get install chromium` (Debian's package) to run it"
        try:
            self.script = hlsjs_script()
        except HlsJsUnavailable as exc:
            return f"hls.js {HLSJS_VERSION}: {exc}"
        return None

    def start_fields(self) -> dict[str, Any]:
        return {
            "prompt": SHAPES_PROMPT,
            "num_frames": self.frames,
            "seed": 7,
            "extra_params": {"pace_to_media_time": True},
        }

    async def run(self, run: int, log_dir: Path) -> None:
        if self.skipped is not None:
            return
        s = self.settings
        tag = f"run {run + 1}/{s.repeat} hls_latency"
        load_before = read_file("/proc/loadavg").split()[:3]
        async with serving({"server": self.target}, log_dir, f"hls-{run}", tag) as servers:
            endpoint = servers["server"].endpoint
            async with running_nginx(
                log_dir / f"hls-{run}", [(endpoint.host, endpoint.port)], fewer_backends=True
            ) as nginx:
                progress(
                    f"{tag}: hls.js {HLSJS_VERSION} in chromium through nginx (port "
                    f"{nginx.port}), a paced session of {s.hls_seconds:g} s, viewers joining "
                    f"at once and at {s.hls_join_s:g} s"
                )
                owner, viewers = await self._session(endpoint.url, nginx.port)
            _, metrics = await http_get(endpoint, "/metrics")
        self._record(run, owner, viewers, engine_chunk_ms(metrics.decode()), load_before)

    async def _session(
        self, server_url: str, nginx_port: int
    ) -> tuple[tuple[StreamResult | None, list[tuple[int, float]]], list[dict[str, Any]]]:
        """The owner's session (straight on the server) and the viewers' playback of its
        playlist through nginx, at once."""
        script = self.script
        assert script is not None
        join_frames = round(self.settings.hls_join_s * FPS)
        received: list[tuple[int, float]] = []
        path: list[str | None] = []
        started, joined = trio.Event(), trio.Event()
        result: list[StreamResult] = []

        def on_chunk(chunk: ReceivedChunk, stream: StreamResult) -> None:
            if chunk.num_frames:
                received.append((chunk.num_frames, time.time()))
            if not started.is_set():
                path.append(stream.video_start.hls_path if stream.video_start else None)
                started.set()
            if sum(frames for frames, _ in received) >= join_frames:
                joined.set()

        async def owner() -> None:
            try:
                result.append(
                    await stream_video(server_url, self.start_fields(), on_chunk=on_chunk)
                )
            finally:
                if not started.is_set():
                    path.append(None)
                    started.set()
                joined.set()

        async def playlist_path(moment: trio.Event) -> str | None:
            await started.wait()
            await moment.wait()
            return path[0]

        def waiting_for(moment: trio.Event) -> Callable[[], str | None]:
            return lambda: trio.from_thread.run(playlist_path, moment)

        timeout_ms = int(self.settings.hls_seconds * 1000) + PAGE_TIMEOUT_MS
        viewers: list[dict[str, Any]] = []

        async def watch() -> None:
            viewers.extend(
                await trio.to_thread.run_sync(
                    drive_hlsjs,
                    f"http://127.0.0.1:{nginx_port}",
                    script,
                    [waiting_for(started), waiting_for(joined)],
                    timeout_ms,
                )
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            nursery.start_soon(owner)
        return (result[0] if result else None, received), viewers

    def _record(
        self,
        run: int,
        owner: tuple[StreamResult | None, list[tuple[int, float]]],
        viewers: list[dict[str, Any]],
        engine_ms: float | None,
        load_before: list[str],
    ) -> None:
        result, received = owner
        add = self.figures.add
        info: dict[str, Any] = {
            "run": run,
            "loadavg_before": load_before,
            "problems": [],
            "hlsjs": HLSJS_VERSION,
            "chunks_received": len(received),
            "viewers": {},
        }
        if result is None or result.done is None:
            info["problems"].append("the owner's session did not complete")
        starts = chunk_starts(received, FPS)
        for name, viewer in zip(VIEWERS, viewers, strict=True):
            hls = viewer["run"] or {}
            problems = [f"{name}: {e}" for e in viewer["errors"]]
            if hls.get("fatal"):
                problems.append(f"{name}: hls.js: {hls['fatal']}")
            elif not hls.get("ended"):
                problems.append(f"{name}: hls.js did not play to the end")
            clock = viewer["clock"]
            offset = sum(c[0] for c in clock) / len(clock) if clock else math.nan
            delays, missed = chunk_delays(
                starts, hls.get("frames", []), hls.get("initPts", []), offset
            )
            ms = [d * 1000.0 for d in delays]
            prefix = f"hls_latency.{name}"
            add(run, f"{prefix}.chunk_delay_ms", ms)
            if ms:
                add(run, f"{prefix}.delay_p50_ms", [percentile(ms, 50)])
                add(run, f"{prefix}.delay_p95_ms", [percentile(ms, 95)])
            add(run, f"{prefix}.chunks_presented", [len(ms)])
            add(run, f"{prefix}.chunks_missed", [missed])
            samples = hls.get("latency", [])
            add(run, f"{prefix}.hlsjs_latency_ms", [1000.0 * float(x[1]) for x in samples])
            add(run, f"{prefix}.hlsjs_target_ms", [1000.0 * float(x[2]) for x in samples])
            stalls = sum(1 for e in hls.get("errors", []) if "bufferStalledError" in e)
            add(run, f"{prefix}.stalls", [stalls])
            info["problems"] += problems
            errors = hls.get("errors", [])
            info["viewers"][name] = {
                "playlist": hls.get("playlist"),
                "live": hls.get("live"),
                "init_pts": hls.get("initPts"),
                "clock_offset_s": clock,
                # Counted: an hls.js fault can repeat an error thousands of times.
                "hlsjs_errors": {e: errors.count(e) for e in dict.fromkeys(errors)},
                "frames_presented": len(hls.get("frames", [])),
                "quality": hls.get("quality"),
                "delays_ms": ms,
                "missed": missed,
            }
            if ms:
                progress(
                    f"  hls_latency run {run + 1} {name}: {len(ms)} chunks, median "
                    f"{percentile(ms, 50):.0f} ms, p95 {percentile(ms, 95):.0f} ms; hls.js aims "
                    f"{1000 * float(samples[-1][2]) if samples else math.nan:.0f} ms behind "
                    f"the edge, {stalls} stall(s)"
                )
        if engine_ms is not None:
            add(run, "hls_latency.engine_chunk_ms", [engine_ms])
        for problem in info["problems"]:
            progress(f"  !! hls_latency: {problem}")
        info["loadavg_after"] = read_file("/proc/loadavg").split()[:3]
        self.runs.append(info)

    def _run_stat(self, name: str, q: float) -> float | None:
        """The median over runs of each run's ``q``-th percentile (as ``glass``)."""
        figure = self.figures.get(name)
        if figure is None:
            return None
        values = [percentile(run, q) for run in figure.runs if run]
        return percentile(values, 50) if values else None

    def evaluate(self) -> list[dict[str, Any]]:
        s = self.settings
        rule = f"median <= {TARGET_MS:.0f} ms (median of the runs' medians)"
        described = {
            "first": "a viewer from the start (given the URL at video.start)",
            "joined": f"a viewer of a running stream (joined at {s.hls_join_s:g} s)",
        }
        verdicts = []
        for name in VIEWERS:
            what = (
                f"hls_latency, {described[name]}: chunk received on the WebSocket -> "
                "presented by hls.js through nginx"
            )
            if self.skipped is not None:
                verdicts.append(make_verdict(what, None, None, rule, self.skipped))
                continue
            problems = [
                p for run in self.runs for p in run["problems"] if not p.startswith(VIEWERS)
            ] + [p for run in self.runs for p in run["problems"] if p.startswith(f"{name}:")]
            verdicts.append(
                make_verdict(
                    what,
                    self._run_stat(f"hls_latency.{name}.chunk_delay_ms", 50),
                    TARGET_MS,
                    rule,
                    "; ".join(problems),
                )
            )
        return verdicts

    def markdown(self) -> list[str]:
        s = self.settings
        if self.skipped is not None:
            return [f"HLS latency: skipped: {self.skipped}"]
        header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
        playlists = {
            str(viewer["playlist"])
            for run in self.runs
            for viewer in run["viewers"].values()
            if viewer["playlist"]
        }
        return [
            f"HLS latency: hls.js {HLSJS_VERSION} (low-latency mode, its defaults) in chromium, "
            f"through nginx (the shipped deploy/nginx.conf), playing a paced {s.hls_seconds:g} s "
            f"session of the shapes model from its live edge: `first` given the URL at "
            f"video.start, `joined` at {s.hls_join_s:g} s",
            "",
            f"Server: `{shlex.join(self.target.command or ())}`",
            "",
            "Playlist as hls.js read it: " + ", ".join(sorted(playlists)),
            "",
            "Load average (1 min) per run, before -> after: "
            + ", ".join(
                f"{run['loadavg_before'][0]} -> {run['loadavg_after'][0]}" for run in self.runs
            ),
            "",
            markdown_table(header, figure_rows(self.figures)),
        ]

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "server": self.target.to_json(),
            "hlsjs": HLSJS_VERSION,
            "skipped": self.skipped,
            **self.figures.to_json(),
            "runs": self.runs,
            "targets": verdicts,
        }
