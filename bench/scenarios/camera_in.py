"""``camera_in`` (issue 34): camera to frame, glass to glass, for a session that follows a
live input video.

Per run, one shapes server (``--engine shapes --device cpu``, ``threads=1`` as in
``glass``, so that chromium has the other core of a 2-core machine) and Debian's chromium
(through Playwright) whose camera is a fake one: a Y4M loop at the session's frame rate
of a green blob going round on grey (`tests.player.fake_camera`), played by chromium's
``--use-file-for-fake-video-capture``. The player page runs with its defaults (Live on,
the engine's size and fps: 256x256 at 24 fps, and with Camera in the chunk the engine
suggests for a live camera session, ``live_input_chunk_frames``: 4 frames of the model's
8; ``camera_in_chunk_frames`` sets the page's ``LIVE.chunkFrames`` instead) plus Camera
in: it draws
the camera to a canvas at the session's size and sends it as JPEG binary messages at the
session's fps, paced to the chunks' ``input_frames.last``, and the shapes model's object
follows the blob. After ``camera_in_warmup_s`` of playing, the scenario reads the page's
own measurements for ``camera_in_seconds``:

* the figure, the page's "Camera to frame": for each chunk, from the moment the page drew
  the input frame that the chunk's last output frame was made from (``input_frames.last``)
  to that output frame's presentation (``requestVideoFrameCallback``'s
  ``expectedDisplayTime``);
* the page's two parts of it: drawn -> the chunk's ``video.chunk_metadata`` arrived, and
  arrived -> presented.

Where the time goes, part by part (`measure`): the server needs a chunk's whole window of
input before it makes the chunk, and the last frame of a chunk plays ``(chunk frames -
1) / fps`` after its first, so every output frame's delay from its own input frame is
the same as this one's:

* **buffer**: ``(num_frames - 1) / fps`` of each chunk, from the chunks' metadata (read
  off the page's WebSocket): the capture time that the window spans;
* **generation, encode**: the server's ``/metrics`` histograms (the engine's time per
  chunk, the encoder's, and their queue waits), over the measured span only (read at its
  start and end);
* **the rest of drawn -> arrived**: the page's JPEG encode and send, the loopback hop
  both ways and the server's JPEG decode, not measured apart (the page's first part less
  the server's figures);
* **the player's lag**: a chunk's arrival on the page to its first frame presented,
  from every presented frame's media and display time (a collector in the page, as in
  ``glass``, reading no pixels) and the page's arrivals.

Target (`CameraInScenario.evaluate`, never loosened to fit a result): the median, over
runs, of each run's median camera-to-frame delay at most 500 ms.

Playwright's sync API blocks, so the browser part runs in a worker thread; the server is
started and always stopped by the harness (`serving`). Without chromium the scenario is
skipped and says why.
"""

from __future__ import annotations

import itertools
import json
import shlex
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import trio

from bench._output import markdown_table, progress, read_file
from bench._report import figure_rows, make_verdict
from bench._settings import Settings
from bench._stats import Figures, percentile
from bench.scenarios._own_server import serving, shapes_target
from bench.scenarios.glass import CHROMIUM
from tests.player import fake_camera

CAMERA_PROMPT: Final = "a red circle on a navy background"
"""Words the shapes model knows; where the object goes is the camera's to say."""
CAMERA_FPS: Final = 24
"""The session's fps with the page's defaults (the shapes engine's): the fake camera
plays at it, so that each input frame is a new picture."""
TARGET_MS: Final = 500.0
POLL_MS: Final = 2000
"""How often the page's figures are read: its lists keep the last 50 chunks' (about
17 s at 3 chunks a second), and each read takes what came since the last."""
PAGE_TIMEOUT_MS: Final = 60_000
METRICS: Final = (
    ("engine_chunk_ms", "trio_vstream_engine_chunk_seconds"),
    ("encode_ms", "trio_vstream_encode_seconds"),
    ("engine_queue_wait_ms", "trio_vstream_engine_queue_wait_seconds"),
    ("encode_queue_wait_ms", "trio_vstream_encode_queue_wait_seconds"),
)
"""The server's histograms of a chunk's way, by the figure they make."""

COLLECTOR: Final = """() => {
  const video = document.getElementById("video");
  const frames = [];
  window.__cameraFrames = frames;
  const onFrame = (now, meta) => {
    video.requestVideoFrameCallback(onFrame);
    frames.push([meta.mediaTime, meta.expectedDisplayTime ?? now]);
  };
  video.requestVideoFrameCallback(onFrame);
}"""
"""Installed in the page before Start: every presented frame's media time and display
time (the clock of the page's own figures), for the player's lag."""

CAPTURES: Final = """async () => {
  const camera = (await import("/static/player.js")).liveStats().cameraIn;
  return [performance.now(), camera ? camera.sent + camera.skipped : 0];
}"""
"""The page's clock and the captures it has made so far (sent or skipped), read together:
its capture rate over the span."""


def histogram_totals(metrics: str) -> dict[str, tuple[float, float]]:
    """The sum and count of each of `METRICS`' histograms in the server's ``/metrics``
    text, over all their labels; a histogram the text lacks is left out."""
    totals: dict[str, tuple[float, float]] = {}
    for field, name in METRICS:
        values = {"sum": 0.0, "count": 0.0}
        seen = False
        for line in metrics.splitlines():
            for part in values:
                if line.startswith(f"{name}_{part}{{"):
                    values[part] += float(line.rsplit(" ", 1)[1])
                    seen = True
        if seen:
            totals[field] = (values["sum"], values["count"])
    return totals


def mean_ms_between(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Each histogram's mean (ms) over the observations made between two reads."""
    means: dict[str, float] = {}
    for field, (total, count) in after.items():
        total_before, count_before = before.get(field, (0.0, 0.0))
        if count > count_before:
            means[field] = 1000.0 * (total - total_before) / (count - count_before)
    return means


def new_samples(
    stats: dict[str, Any], seen: int
) -> tuple[list[float], list[list[float]], int, int]:
    """What the page measured since it had measured ``seen`` latencies in all: the new
    latencies and parts, its new total, and how many new ones its window had already let
    go (read too seldom)."""
    total = int(stats.get("measured", 0))
    new = max(0, total - seen)
    latencies = [float(v) for v in stats.get("latencies", [])]
    parts = [[float(a), float(b)] for a, b in stats.get("parts", [])]
    kept = min(new, len(latencies))
    return latencies[len(latencies) - kept :], parts[len(parts) - kept :], total, new - kept


def chunk_lags_ms(
    frames: Sequence[Sequence[float]], arrivals: Sequence[Sequence[float]], since_ms: float
) -> list[float]:
    """The player's lag for each media chunk that arrived after ``since_ms`` (the page's
    clock): from its arrival (``arrivals``: its media start in seconds, its arrival in
    ms) to the first frame presented at or after its media start. A chunk none of whose
    frames was presented has none."""
    if not frames:
        return []
    media = np.array([float(f[0]) for f in frames])
    shown = np.array([float(f[1]) for f in frames])
    lags: list[float] = []
    for media_start, arrived in arrivals:
        if arrived < since_ms:
            continue
        later = np.nonzero(media >= media_start - 1e-3)[0]
        if later.size:
            lags.append(float(shown[later[0]]) - float(arrived))
    return lags


def capture_rate(before: Sequence[float], after: Sequence[float]) -> float | None:
    """Captures a second between two reads of `CAPTURES`; None over no time."""
    seconds = (float(after[0]) - float(before[0])) / 1000.0
    return (float(after[1]) - float(before[1])) / seconds if seconds > 0 else None


def metrics_totals(url: str) -> dict[str, tuple[float, float]]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return histogram_totals(response.read().decode())


def drive_page(url: str, y4m: Path, s: Settings) -> dict[str, Any]:
    """One Camera-in session on the page at ``url`` (blocking: Playwright's sync API),
    chromium's camera playing ``y4m``: start with the page's defaults, measure for
    ``camera_in_seconds`` after ``camera_in_warmup_s`` of playing, stop."""
    from playwright.sync_api import sync_playwright

    chunks: list[dict[str, Any]] = []

    def on_socket(socket: Any) -> None:
        def on_received(payload: str | bytes) -> None:
            if isinstance(payload, str) and '"video.chunk_metadata"' in payload:
                message = json.loads(payload)
                if message.get("kind") == "media":
                    chunks.append(
                        {"num_frames": message["num_frames"], "input": message["input_frames"]}
                    )

        socket.on("framereceived", on_received)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=[
                "--no-sandbox",
                "--autoplay-policy=no-user-gesture-required",
                "--use-fake-device-for-media-stream",
                "--use-fake-ui-for-media-stream",
                f"--use-file-for-fake-video-capture={y4m}",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 900})
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("websocket", on_socket)
            page.goto(f"{url}/")
            page.wait_for_function("() => document.body.dataset.ready === 'true'")
            page.fill("#prompt", CAMERA_PROMPT)
            page.check("#camera-in")
            defaults = page.evaluate(
                """() => ({live: document.getElementById("live").checked,
                          size: document.getElementById("size").value,
                          fps: document.getElementById("fps").value})"""
            )
            knobs = page.evaluate(
                """async ([chunk]) => {
                    const { LIVE } = await import("/static/player.js");
                    if (chunk != null) LIVE.chunkFrames = chunk;
                    return { ...LIVE };
                }""",
                [s.camera_in_chunk_frames],
            )
            defaults.update(knobs)
            page.evaluate(COLLECTOR)
            page.click("#start")
            page.wait_for_function(
                "t => document.getElementById('video').currentTime >= t",
                arg=s.camera_in_warmup_s,
            )
            read = """async () => (await import("/static/player.js")).liveStats()"""
            stats = page.evaluate(read)
            captures_before = page.evaluate(CAPTURES)
            since_ms = float(captures_before[0])
            metrics_before = metrics_totals(url)
            chunks_before = len(chunks)
            seen = int((stats["cameraIn"] or {}).get("measured", 0))
            latencies: list[float] = []
            parts: list[list[float]] = []
            lost = 0
            end_ms = since_ms + s.camera_in_seconds * 1000
            while True:
                left = end_ms - float(page.evaluate("() => performance.now()"))
                page.wait_for_timeout(max(0.0, min(POLL_MS, left)))
                stats = page.evaluate(read)
                more, more_parts, seen, gone = new_samples(stats["cameraIn"] or {}, seen)
                latencies += more
                parts += more_parts
                lost += gone
                if left <= POLL_MS:
                    break
            captures_after = page.evaluate(CAPTURES)
            metrics_after = metrics_totals(url)
            measured_chunks = chunks[chunks_before:]
            frames = page.evaluate("() => window.__cameraFrames")
            page.click("#stop")
            page.wait_for_function(
                "() => ['done', 'error', 'closed'].includes("
                "document.getElementById('status').dataset.phase)"
            )
        finally:
            browser.close()
    return {
        "defaults": defaults,
        "latencies": latencies,
        "parts": parts,
        "lost": lost,
        "stats": stats,
        "chunks": measured_chunks,
        "arrivals": [a for a in stats.get("arrivals", []) if a[1] >= since_ms],
        "lags": chunk_lags_ms(frames, stats.get("arrivals", []), since_ms),
        "presented": len(frames),
        "capture_fps": capture_rate(captures_before, captures_after),
        "server_ms": mean_ms_between(metrics_before, metrics_after),
        "errors": errors,
    }


def measure(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run, from what `drive_page` brought back."""
    stats = result["stats"] or {}
    camera = stats.get("cameraIn") or {}
    fps = float(result["defaults"].get("fps") or CAMERA_FPS)
    buffers = [1000.0 * (c["num_frames"] - 1) / fps for c in result["chunks"]]
    return {
        "camera_to_frame_ms": result["latencies"],
        "drawn_to_arrival_ms": [p[0] for p in result["parts"]],
        "arrival_to_frame_ms": [p[1] for p in result["parts"]],
        "buffer_ms": buffers,
        "player_lag_ms": result["lags"],
        "chunk_interarrival_ms": [b[1] - a[1] for a, b in itertools.pairwise(result["arrivals"])],
        "server_ms": result["server_ms"],
        "chunks": len(result["chunks"]),
        "chunk_frames": sorted({int(c["num_frames"]) for c in result["chunks"]}),
        "inputs_dropped": sum(int(c["input"].get("dropped") or 0) for c in result["chunks"]),
        "inputs_sent": camera.get("sent"),
        "inputs_skipped": camera.get("skipped"),
        "samples_lost": result["lost"],
        "presented": result["presented"],
        "capture_fps": result["capture_fps"],
        "underruns": stats.get("underruns"),
        "stall_ms": stats.get("stallMs"),
        "catch_ups": stats.get("catchUps"),
        "page_errors": result["errors"],
        "defaults": result["defaults"],
    }


class CameraInScenario:
    """The scenario over all runs: its server, figures and verdicts."""

    def __init__(self, s: Settings, server_args: Sequence[str]) -> None:
        self.settings = s
        self.figures = Figures()
        self.runs: list[dict[str, Any]] = []
        self.target = shapes_target(
            "camera_in",
            s.camera_in_engine_args,
            ["--device", "cpu", *server_args],
            max_sessions=1,
            num_frames=0,
        )
        self.skipped = (
            None
            if CHROMIUM.exists()
            else f"no {CHROMIUM} (apt-get install chromium; never playwright install)"
        )

    async def run(self, run: int, log_dir: Path) -> None:
        if self.skipped is not None:
            return
        s = self.settings
        tag = f"run {run + 1}/{s.repeat} camera_in"
        y4m = fake_camera.write_y4m(log_dir / f"camera-in-{CAMERA_FPS}fps.y4m", fps=CAMERA_FPS)
        load_before = read_file("/proc/loadavg").split()[:3]
        stem = f"camera-in-{run}"
        async with serving({"server": self.target}, log_dir, stem, tag) as servers:
            url = f"http://{servers['server'].endpoint.host_header}"
            progress(f"{tag}: chromium on {url}, Camera in for {s.camera_in_seconds:g} s")
            result = await trio.to_thread.run_sync(drive_page, url, y4m, s)
        figures = measure(result)
        for problem in figures["page_errors"]:
            progress(f"  !! camera_in: the page raised {problem}")
        add = self.figures.add
        for name in (
            "camera_to_frame_ms",
            "drawn_to_arrival_ms",
            "arrival_to_frame_ms",
            "buffer_ms",
            "player_lag_ms",
            "chunk_interarrival_ms",
        ):
            add(run, f"camera_in.{name}", figures[name])
        for name, value in figures["server_ms"].items():
            add(run, f"camera_in.{name}", [value])
        for name in ("inputs_sent", "inputs_skipped", "inputs_dropped", "presented", "capture_fps"):
            if figures[name] is not None:
                add(run, f"camera_in.{name}", [figures[name]])
        for name in ("underruns", "stall_ms"):
            if figures[name] is not None:
                add(run, f"camera_in.{name}", [figures[name]])
        load = {
            "loadavg_before": load_before,
            "loadavg_after": read_file("/proc/loadavg").split()[:3],
        }
        progress(
            f"{tag}: load average {' '.join(load_before)} -> {' '.join(load['loadavg_after'])}"
        )
        self.runs.append({"run": run, **load, **figures})

    def _run_stat(self, name: str, q: float) -> float | None:
        """The median over runs of each run's ``q``-th percentile."""
        figure = self.figures.get(name)
        if figure is None:
            return None
        values = [percentile(run, q) for run in figure.runs if run]
        return percentile(values, 50) if values else None

    def parts(self) -> dict[str, float | None]:
        """The figure and its parts, each the median over runs of the run's median
        (the server's are one mean per run)."""
        names = (
            "camera_to_frame_ms",
            "buffer_ms",
            "drawn_to_arrival_ms",
            "engine_chunk_ms",
            "encode_ms",
            "engine_queue_wait_ms",
            "encode_queue_wait_ms",
            "arrival_to_frame_ms",
            "player_lag_ms",
        )
        return {name: self._run_stat(f"camera_in.{name}", 50) for name in names}

    def evaluate(self) -> list[dict[str, Any]]:
        what = "camera_in: input frame drawn -> the output frame made from it presented"
        rule = f"p50 <= {TARGET_MS:.0f} ms (median of the runs' p50s)"
        if self.skipped is not None:
            return [make_verdict(what, None, None, rule, self.skipped)]
        return [
            make_verdict(what, self._run_stat("camera_in.camera_to_frame_ms", 50), TARGET_MS, rule)
        ]

    def markdown(self) -> list[str]:
        s = self.settings
        if self.skipped is not None:
            return [f"Camera in: skipped: {self.skipped}"]
        chunk = s.camera_in_chunk_frames
        header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
        p = self.parts()

        def ms(name: str) -> str:
            value = p[name]
            return "?" if value is None else f"{value:.0f} ms"

        engine_side = [
            p[name]
            for name in (
                "engine_chunk_ms",
                "encode_ms",
                "engine_queue_wait_ms",
                "encode_queue_wait_ms",
            )
        ]
        rest = (
            None
            if p["drawn_to_arrival_ms"] is None or any(v is None for v in engine_side)
            else p["drawn_to_arrival_ms"] - sum(v for v in engine_side if v is not None)
        )
        return [
            "Camera in: the player page in chromium with its defaults and Camera in, a fake "
            f"camera at {CAMERA_FPS} fps (a green blob going round), prompt "
            f"{CAMERA_PROMPT!r}; measured for {s.camera_in_seconds:g} s after "
            f"{s.camera_in_warmup_s:g} s of playing"
            + ("" if chunk is None else f"; the page's LIVE.chunkFrames {chunk}"),
            "",
            f"Server: `{shlex.join(self.target.command or ())}`",
            "",
            "Load average (1 min) per run, before -> after: "
            + ", ".join(
                f"{run['loadavg_before'][0]} -> {run['loadavg_after'][0]}"
                for run in self.runs
                if run.get("loadavg_before") and run.get("loadavg_after")
            ),
            "",
            markdown_table(header, figure_rows(self.figures)),
            "",
            f"Where the time goes (medians of the runs' medians): camera to frame "
            f"{ms('camera_to_frame_ms')} = drawn -> its chunk arrived "
            f"{ms('drawn_to_arrival_ms')} (generation {ms('engine_chunk_ms')}, encode "
            f"{ms('encode_ms')}, queue waits {ms('engine_queue_wait_ms')} + "
            f"{ms('encode_queue_wait_ms')}, the rest "
            + ("?" if rest is None else f"{rest:.0f} ms")
            + ": the page's JPEG, loopback, the server's decode) + arrived -> presented "
            f"{ms('arrival_to_frame_ms')} (the player's lag {ms('player_lag_ms')} + the "
            f"buffer, (chunk frames - 1) / fps, {ms('buffer_ms')})",
        ]

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "server": self.target.to_json(),
            **self.figures.to_json(),
            "parts": self.parts(),
            "runs": self.runs,
            "skipped": self.skipped,
            "targets": verdicts,
        }
