"""``glass`` (issue 22, part 3): key to frame as a person sees it, glass to glass.

Per run, one shapes server and Debian's chromium (through Playwright, as
``tests/player`` drive it) on the player page with its defaults: Live on (the page
opts into ``streaming_buffer_seconds`` and reports its playhead), the engine's size and
fps, the length a live session gets. The prompt is the issue's, an object standing
still; once it plays, the scenario presses D and A in turn about every
``glass_press_every_s`` (seeded random pauses, `PRESS_JITTER`) for ``glass_seconds``,
and reads two figures for each press:

* the page's own "Key to frame": from the key's ``event.timeStamp`` to the first frame
  the video element presents (``requestVideoFrameCallback``) at or after the media time
  where the chunk that started the camera begins;
* the same, from pixels alone: every presented frame is drawn to a canvas in the
  scenario's own ``requestVideoFrameCallback`` (so it is the frame on screen, at the
  time the compositor shows it), the object found in it as the shapes evaluator finds
  it (`trio_vstream.models.shapes.evaluate.object_mask`), and the press's frame is the
  first presented after it whose motion has turned the key's way (and stays so for the
  next frames). Nothing in it reads the stream's metadata.

Beside them: the continuous play ratio (the share of wall time the video plays rather
than waits, from the presented frames: a gap between two that exceeds their media
distance by more than a vsync and a half is waiting), over the presses' span (steady
state: after ``glass_warmup_s`` of playing), and the page's own underrun count and
stall time (``waiting`` events).

Playwright's sync API blocks, so the browser part runs in a worker thread; the server
is started and always stopped by the harness (`serving`).
"""

from __future__ import annotations

import base64
import itertools
import math
import random
import shlex
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
import trio

from bench._output import markdown_table, progress, read_file
from bench._report import figure_rows, make_verdict
from bench._settings import Settings
from bench._stats import Figures, percentile
from bench.scenarios._own_server import serving, shapes_target
from trio_vstream.models.shapes.evaluate import background_colour, object_mask

CHROMIUM: Final = Path("/usr/bin/chromium")
GLASS_PROMPT: Final = "a red circle still on a navy background"
"""The issue's measurement: an object standing still, then steered left and right."""
KEYS: Final = (("d", 1.0), ("a", -1.0))
"""D moves the object right (+x), A left: pressed in turn."""
CANVAS: Final = 64
"""Presented frames are read back at this size (the object is a few pixels wide)."""
PRESS_JITTER: Final = 0.2
"""Each pause between presses is the setting's, times a seeded random factor within
this of 1: at 3 s, 2.4 to 3.6 s. A pause of whole chunks (3 s is nine 8-frame chunks at
24 fps) would press every key at the same point of a chunk's window, and the wait for the
next boundary, part of every latency, would be the same for all of a run's presses."""
TURN_FRAMES: Final = 3
"""A turn counts when this many consecutive presented frames move the key's way."""
STALL_SLACK_S: Final = 0.025
"""A presented frame later than its media distance by more than this (a vsync and a
half at 60 Hz) means the video waited."""
TARGET_MS: Final = 400.0
TARGET_PLAY_RATIO: Final = 0.99
PAGE_TIMEOUT_MS: Final = 60_000

COLLECTOR: Final = """(size) => {
  const video = document.getElementById("video");
  const canvas = document.createElement("canvas");
  canvas.width = canvas.height = size;
  const context = canvas.getContext("2d", { willReadFrequently: true });
  const log = { frames: [], keys: [] };
  window.__glass = log;
  window.addEventListener("keydown", (event) => {
    if (!event.repeat) log.keys.push([event.timeStamp, event.key]);
  }, true);
  const onFrame = (now, meta) => {
    video.requestVideoFrameCallback(onFrame);
    context.drawImage(video, 0, 0, size, size);
    const rgba = context.getImageData(0, 0, size, size).data;
    let rgb = "";
    for (let i = 0; i < rgba.length; i += 4) {
      rgb += String.fromCharCode(rgba[i], rgba[i + 1], rgba[i + 2]);
    }
    log.frames.push([meta.mediaTime, meta.expectedDisplayTime ?? now, btoa(rgb)]);
  };
  video.requestVideoFrameCallback(onFrame);
}"""
"""Installed in the page before Start: every presented frame's media time, display time
and pixels, and every key's timeStamp (the clock of the page's own figures)."""


@attrs.frozen
class Presented:
    """The presented frames of one run: media and display times (s), object centres
    (x unwrapped across the torus, in canvas pixels; NaN where no object was found)."""

    media: np.ndarray
    shown: np.ndarray
    x: np.ndarray


def _circular_mean(values: np.ndarray, period: int) -> float:
    angles = values * (2.0 * np.pi / period)
    angle = np.arctan2(np.sin(angles).mean(), np.cos(angles).mean())
    return float(angle * period / (2.0 * np.pi)) % period


def presented_frames(raw: Sequence[Sequence[Any]]) -> Presented:
    """The collector's log as arrays: each frame's object centre, as the shapes
    evaluator finds the object (the background from the frames' borders)."""
    frames = np.stack(
        [
            np.frombuffer(base64.b64decode(item[2]), dtype=np.uint8).reshape(CANVAS, CANVAS, 3)
            for item in raw
        ]
    )
    background = background_colour(frames)
    xs: list[float] = []
    for frame in frames:
        mask = object_mask(frame, background)
        if mask.sum() < 2:
            xs.append(math.nan)
            continue
        _, cols = np.nonzero(mask)
        xs.append(_circular_mean(cols + 0.5, CANVAS))
    # Unwrap: consecutive centres move less than half the frame.
    x = np.array(xs)
    unwrapped = x.copy()
    last: float | None = None
    for i, value in enumerate(x):
        if math.isnan(value):
            continue
        if last is not None:
            step = (value - last % CANVAS + CANVAS / 2) % CANVAS - CANVAS / 2
            value = last + step
        unwrapped[i] = value
        last = value
    return Presented(
        media=np.array([float(item[0]) for item in raw]),
        shown=np.array([float(item[1]) for item in raw]) / 1000.0,
        x=unwrapped,
    )


def turn_latency_ms(frames: Presented, pressed_s: float, sign: float) -> float | None:
    """From a press to the first presented frame whose motion has turned the key's way:
    it and the next ``TURN_FRAMES - 1`` each move at least a fifth of the typical speed
    that way. None when no frame after the press does."""
    velocity = np.diff(frames.x) / np.maximum(np.diff(frames.media), 1e-6)
    moving = np.abs(velocity[np.isfinite(velocity) & (np.abs(velocity) > 1e-3)])
    if moving.size == 0:
        return None
    threshold = 0.2 * float(np.median(moving))
    turned = np.isfinite(velocity) & (velocity * sign > threshold)
    # velocity[i] is the move into frame i + 1.
    for i in range(len(turned) - TURN_FRAMES + 1):
        if frames.shown[i + 1] <= pressed_s:
            continue
        if turned[i : i + TURN_FRAMES].all():
            return (frames.shown[i + 1] - pressed_s) * 1000.0
    return None


def play_ratio(frames: Presented, start_s: float, end_s: float) -> float | None:
    """The share of ``[start_s, end_s]`` (display time) the video played: a presented
    frame that comes later than its media distance from the one before (by more than
    `STALL_SLACK_S`) waited that long. A jump forward (the page catching up with the
    live edge) is not a wait."""
    inside = (frames.shown >= start_s) & (frames.shown <= end_s)
    index = np.nonzero(inside)[0]
    if len(index) < 2 or end_s <= start_s:
        return None
    waited = 0.0
    for a, b in itertools.pairwise(index):
        excess = (frames.shown[b] - frames.shown[a]) - (frames.media[b] - frames.media[a])
        if excess > STALL_SLACK_S:
            waited += excess
    # Waiting before the first presented frame or after the last one in the span.
    waited += max(0.0, frames.shown[index[0]] - start_s - STALL_SLACK_S)
    waited += max(0.0, end_s - frames.shown[index[-1]] - STALL_SLACK_S)
    return max(0.0, 1.0 - waited / (end_s - start_s))


def chunk_margins_ms(frames: Presented, arrivals: Sequence[Sequence[float]]) -> list[float]:
    """For each media chunk, how long before its first frame was presented it arrived
    (``arrivals``: its media start in seconds and its arrival on the page's clock, ms):
    the slack that the playhead's lag behind generation left it. A chunk whose frames
    were never presented (skipped, or after the end) has none."""
    margins: list[float] = []
    for media_start, arrived in arrivals:
        later = np.nonzero(frames.media >= media_start - 1e-3)[0]
        if later.size:
            margins.append(frames.shown[later[0]] * 1000.0 - arrived)
    return margins


def delivery_rtf(arrivals: Sequence[Sequence[float]]) -> float | None:
    """Media seconds delivered per wall second, from the first media chunk's arrival to
    the last one's: below 1, generation fell behind the playhead it is paced by, and the
    video must wait sooner or later."""
    if len(arrivals) < 2 or arrivals[-1][1] <= arrivals[0][1]:
        return None
    return (arrivals[-1][0] - arrivals[0][0]) / ((arrivals[-1][1] - arrivals[0][1]) / 1000.0)


def drive_page(url: str, s: Settings, rng: random.Random) -> dict[str, Any]:
    """One session on the page at ``url`` (blocking: Playwright's sync API): start with
    the page's defaults and the issue's prompt, press D/A in turn, stop. What the page
    and the collector measured."""
    from playwright.sync_api import sync_playwright

    every_ms = s.glass_press_every_s * 1000

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required"],
        )
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 900})
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"{url}/")
            page.wait_for_function("() => document.body.dataset.ready === 'true'")
            page.fill("#prompt", GLASS_PROMPT)
            defaults = page.evaluate(
                """() => ({live: document.getElementById("live").checked,
                          length: document.getElementById("length").value,
                          unit: document.getElementById("length-unit").value,
                          size: document.getElementById("size").value,
                          fps: document.getElementById("fps").value})"""
            )
            # The page's Live knobs, where the settings try others (None: its own).
            knobs = page.evaluate(
                """async ([buffer, start, chunk]) => {
                    const { LIVE } = await import("/static/player.js");
                    if (buffer != null) LIVE.bufferSeconds = buffer;
                    if (start != null) LIVE.startSeconds = start;
                    if (chunk != null) LIVE.chunkFrames = chunk;
                    return { ...LIVE };
                }""",
                [s.glass_buffer_s, s.glass_start_s, s.glass_chunk_frames],
            )
            defaults.update(knobs)
            page.evaluate(COLLECTOR, CANVAS)
            page.click("#start")
            page.wait_for_function(
                "t => document.getElementById('video').currentTime >= t", arg=s.glass_warmup_s
            )
            page.focus("#video")
            presses: list[tuple[float, str]] = []
            count = max(1, round(s.glass_seconds / s.glass_press_every_s))
            for k in range(count):
                key = KEYS[k % len(KEYS)][0]
                page.keyboard.press(key)
                presses.append((float(page.evaluate("() => performance.now()")), key))
                page.wait_for_timeout(rng.uniform(1 - PRESS_JITTER, 1 + PRESS_JITTER) * every_ms)
            stats = page.evaluate("""async () => (await import("/static/player.js")).liveStats()""")
            page.click("#stop")
            page.wait_for_function(
                "() => ['done', 'error', 'closed'].includes("
                "document.getElementById('status').dataset.phase)"
            )
            log = page.evaluate("() => window.__glass")
            figures = {
                name: page.locator(f"#{name}").get_attribute("data-ms")
                for name in ("fig-key-latency", "fig-key-p50")
            }
        finally:
            browser.close()
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    return {
        "engine_chunk_ms": engine_chunk_ms(metrics),
        "defaults": defaults,
        "stats": stats,
        "log": log,
        "figures": figures,
        "errors": errors,
        "presses": presses,
    }


def engine_chunk_ms(metrics: str) -> float | None:
    """The mean time the engine took per chunk, from the server's ``/metrics`` text
    (``trio_vstream_engine_chunk_seconds``: its sum over its count); None without one."""
    values: dict[str, float] = {}
    for line in metrics.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"trio_vstream_engine_chunk_seconds_{part}{{"):
                values[part] = values.get(part, 0.0) + float(line.rsplit(" ", 1)[1])
    if not values.get("count"):
        return None
    return 1000.0 * values["sum"] / values["count"]


def measure(result: dict[str, Any], s: Settings) -> dict[str, Any]:
    """The figures of one run, from what `drive_page` brought back."""
    log = result["log"]
    keys = [(float(t) / 1000.0, str(k).lower()) for t, k in log["keys"]]
    frames = presented_frames(log["frames"])
    signs = dict(KEYS)
    pixel_ms: list[float] = []
    missed = 0
    for pressed, key in keys:
        if key not in signs:
            continue
        latency = turn_latency_ms(frames, pressed, signs[key])
        if latency is None:
            missed += 1
        else:
            pixel_ms.append(latency)
    ratio = None
    if keys:
        ratio = play_ratio(frames, keys[0][0], keys[-1][0] + s.glass_press_every_s)
    stats = result["stats"] or {}
    arrivals = stats.get("arrivals", [])
    margins = chunk_margins_ms(frames, arrivals)
    parts = stats.get("keyParts", [])
    return {
        "engine_chunk_ms": result["engine_chunk_ms"],
        "chunk_margin_ms": margins,
        "chunk_interarrival_ms": [b[1] - a[1] for a, b in itertools.pairwise(arrivals)],
        "delivery_rtf": delivery_rtf(arrivals),
        "key_to_arrival_ms": [float(p[0]) for p in parts],
        "arrival_to_frame_ms": [float(p[1]) for p in parts],
        "page_ms": [float(v) for v in stats.get("keyLatencies", [])],
        "pixel_ms": pixel_ms,
        "missed": missed,
        "presses": len(keys),
        "presented": len(frames.media),
        "play_ratio": ratio,
        "underruns": stats.get("underruns"),
        "stall_ms": stats.get("stallMs"),
        "reports": stats.get("reports"),
        "buffer_s": stats.get("bufferSeconds"),
        "page_errors": result["errors"],
        "defaults": result["defaults"],
    }


class GlassScenario:
    """The scenario over all runs: its server, figures and verdicts."""

    def __init__(self, s: Settings, server_args: Sequence[str]) -> None:
        self.settings = s
        self.figures = Figures()
        self.runs: list[dict[str, Any]] = []
        self.target = shapes_target(
            "glass", s.glass_engine_args, server_args, max_sessions=1, num_frames=0
        )

    async def run(self, run: int, log_dir: Path) -> None:
        s = self.settings
        tag = f"run {run + 1}/{s.repeat} glass"
        load_before = read_file("/proc/loadavg").split()[:3]
        async with serving({"server": self.target}, log_dir, f"glass-{run}", tag) as servers:
            served = servers["server"]
            url = f"http://{served.endpoint.host_header}"
            progress(f"{tag}: chromium on {url}, {s.glass_seconds:g} s of D/A presses")
            rng = random.Random(f"glass-{s.seed}-{run}")  # the same pauses every time
            result = await trio.to_thread.run_sync(drive_page, url, s, rng)
        figures = measure(result, s)
        for problem in figures["page_errors"]:
            progress(f"  !! glass: the page raised {problem}")
        self.figures.add(run, "glass.page_key_to_frame_ms", figures["page_ms"])
        self.figures.add(run, "glass.pixel_key_to_frame_ms", figures["pixel_ms"])
        self.figures.add(run, "glass.missed_turns", [figures["missed"]])
        self.figures.add(run, "glass.presented_frames", [figures["presented"]])
        if figures["play_ratio"] is not None:
            self.figures.add(run, "glass.play_ratio", [figures["play_ratio"]])
        for name in ("chunk_margin_ms", "key_to_arrival_ms", "arrival_to_frame_ms"):
            self.figures.add(run, f"glass.{name}", figures[name])
        self.figures.add(run, "glass.chunk_interarrival_ms", figures["chunk_interarrival_ms"])
        if figures["delivery_rtf"] is not None:
            self.figures.add(run, "glass.delivery_rtf", [figures["delivery_rtf"]])
        if figures["engine_chunk_ms"] is not None:
            self.figures.add(run, "glass.engine_chunk_ms", [figures["engine_chunk_ms"]])
        for name in ("underruns", "stall_ms"):
            if figures[name] is not None:
                self.figures.add(run, f"glass.{name}", [figures[name]])
        # Other work on the machine slows the engine, and so every figure: say how much.
        load = {
            "loadavg_before": load_before,
            "loadavg_after": read_file("/proc/loadavg").split()[:3],
        }
        progress(
            f"{tag}: load average {' '.join(load_before)} -> {' '.join(load['loadavg_after'])}"
        )
        self.runs.append({"run": run, **load, **figures})

    def _run_stat(self, name: str, q: float) -> float | None:
        """The median over runs of each run's ``q``-th percentile: runs on a shared
        machine differ, and one bad run should not decide."""
        figure = self.figures.get(name)
        if figure is None:
            return None
        values = [percentile(run, q) for run in figure.runs if run]
        return percentile(values, 50) if values else None

    def evaluate(self) -> list[dict[str, Any]]:
        rule = f"p50 <= {TARGET_MS:.0f} ms (median of the runs' p50s)"
        ratio = self._run_stat("glass.play_ratio", 50)
        return [
            make_verdict(
                "glass: key -> first presented frame showing it, the page's figure",
                self._run_stat("glass.page_key_to_frame_ms", 50),
                TARGET_MS,
                rule,
            ),
            make_verdict(
                "glass: key -> first presented frame whose motion turned, from pixels",
                self._run_stat("glass.pixel_key_to_frame_ms", 50),
                TARGET_MS,
                rule,
            ),
            make_verdict(
                "glass: continuous play ratio over the presses",
                ratio,
                TARGET_PLAY_RATIO,
                f">= {TARGET_PLAY_RATIO} (median of the runs)",
                at_least=True,
            ),
        ]

    def markdown(self) -> list[str]:
        s = self.settings
        header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
        return [
            f"Glass: the player page in chromium with its defaults, prompt {GLASS_PROMPT!r}; "
            f"D and A in turn about every {s.glass_press_every_s:g} s for {s.glass_seconds:g} s, "
            f"after {s.glass_warmup_s:g} s of playing",
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
        ]

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "server": self.target.to_json(),
            **self.figures.to_json(),
            "runs": self.runs,
            "targets": verdicts,
        }
